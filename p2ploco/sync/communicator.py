"""The production Communicator: a group from the round's coordinator, a butterfly all-reduce over
hivemind, and a vote on the outcome, so that every survivor applies the same aggregate or none.

A group can die under its members: its coordinator answered some of them and crashed before the others had their
answer (they joined the round at the next coordinator), or its answers to them were lost. A member learns it
when every other member answers its contributions that it takes part in this round in another group
(``sync/reduce.py``: none of them holds this group, so nobody applies it), or when its vote cannot reach the
coordinator at all (no stream opens: without its judge, no member applies the group). Instead of applying nothing,
it then sends the same join again (``Matchmaker.rejoin``) to the next coordinator in rendezvous order, the dead
group's left out, and all-reduces with the group it gets there: the others' formation of the same round waits for
it, as its record says it works on the round. After a vote that found no coordinator it joins only a formation
that is open there already: a coordinator that can be reached by the others may still decide for them, and a group
of this peer's own at the next one would split the round (as members that asked the next member in id order once
did). Once a round at most; a second dead group, a closed formation or none open there: it applies nothing, as
before. A single hostile member cannot make it leave a live group: it takes every other member's word, or the
coordinator's silence.

It also remembers who took part in this peer's recent rounds (``partners``): the members that delivered it something
of their own (a contribution in its aggregates, or an aggregate) in a round it applied, in its last
``PARTNER_ROUNDS`` all-reduces. Unlike a record, which anyone can publish, that takes training with the swarm; the
round budget goes by their step times (``budget.py``), and the group this peer follows is vouched for by them
(``swarm/directory.py``)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterable

from p2ploco import faults
from p2ploco.collective.exchange import (
    AllReduceResult,
    Communicator,
    Exchange,
    PendingAllReduce,
    Traffic,
)
from p2ploco.collective.sliced import SlicedExchange, as_sliced, reduce_alone
from p2ploco.errors import Failure, PayloadError, TrainingError
from p2ploco.swarm.loop import EventLoopThread
from p2ploco.swarm.records import PeerState
from p2ploco.sync.decide import RoundCommit
from p2ploco.sync.form import NOBODY_ANSWERED, Matchmaker
from p2ploco.sync.group import Group
from p2ploco.sync.reduce import Attempt, ButterflyAllReduce, DroppedFromRound
from p2ploco.sync.tally import Decision, Outcome, Vote, slice_digests

logger = logging.getLogger(__name__)

PARTNER_ROUNDS = 4  # applied all-reduces whose partners this peer remembers


class SwarmCommunicator(Communicator):
    def __init__(self, loop: EventLoopThread, matchmaker: Matchmaker, butterfly: ButterflyAllReduce,
                 commit: RoundCommit):
        self.loop, self.matchmaker, self.butterfly, self.commit = loop, matchmaker, butterfly, commit
        self._recent: tuple[frozenset[str], ...] = ()  # each recent all-reduce's partners, oldest first
        # Replaced whole, never changed in place: the training thread reads it while the event loop writes it.
        self.partners: frozenset[str] = frozenset()
        self._stranded_said = False  # said, since this peer last applied a round, that nobody can coordinate

    def all_reduce(self, exchange: Exchange, round_index: int, name: str) -> AllReduceResult:
        return self.loop.run(self._all_reduce(as_sliced(exchange, name), round_index, name, threading.Event()))

    def start_all_reduce(self, exchange: Exchange, round_index: int, name: str) -> PendingAllReduce:
        grouped = threading.Event()
        future = asyncio.run_coroutine_threadsafe(self._all_reduce(as_sliced(exchange, name), round_index, name,
                                                                   grouped), self.loop.loop)
        future.add_done_callback(lambda _: grouped.set())
        return PendingAllReduce(future, grouped)

    async def _all_reduce(self, exchange: SlicedExchange, round_index: int, name: str,
                          grouped: threading.Event) -> AllReduceResult:
        started = time.perf_counter()
        me = self.matchmaker.me
        directory = self.matchmaker.directory
        # The record of this round (published in the background as the round began) must be out before joining:
        # the coordinator waits for the peers whose records say they work on this round. Normally long stored.
        await directory.flush(timeout=self.matchmaker.timeout)
        directory.update_soon(state=PeerState.AVERAGING)  # informative only: nobody waits for it
        held = directory.me.slices  # the hash of each slice at the start of the round, as the node published it
        # Some of them (Streaming DiLoCo averages one fragment at a time), each as it was at the round's start.
        if not set(exchange.parts) <= set(held):
            raise TrainingError(f"this peer published slices {sorted(held)} but averages {sorted(exchange.parts)}")
        slices = {k: (part.fingerprint(), held[k]) for k, part in exchange.parts.items()}
        failures: list[Failure] = []
        group = await self.matchmaker.form_group(round_index, name, slices, directory.me.group, failures,
                                                 exchange.tokens)
        grouped.set()  # the join no longer reads this peer's record: it may announce its next round
        if group is None:  # late, refused, or leaving: nothing to apply
            self._applied_with(None)
            return AllReduceResult([me], committed=False, excluded=True, failures=failures,
                                   traffic=Traffic(seconds=time.perf_counter() - started))
        if len(group.peers) == 1:
            self._applied_with(None)
            return await self._alone(exchange, round_index, started, failures, group)

        attempts: list[Attempt] = []
        formed = set(group.peers)
        rejoined = False
        while True:
            await faults.hit_async("matchmaking.grouped", round_index)
            attempt = await self.butterfly.run(group, exchange)
            attempts.append(attempt)
            failures += attempt.failures
            if attempt.error is not None:
                logger.warning(f"round {round_index}: all-reduce among {len(group.peers)} peers failed here "
                               f"({attempt.error})")
            vote = (Vote.HOLDS if attempt.error is None else
                    Vote.DROPPED if isinstance(attempt.error, DroppedFromRound) else Vote.MISSING)
            digests = slice_digests(attempt.evidence) if vote == Vote.HOLDS else {}
            dead = ""  # why nobody applies this group's round, if so (module docstring)
            if set(group.peers) - {me} <= attempt.elsewhere:
                decision, lost = Decision(Outcome.ABORT), None
                dead = "every other member takes part in this round in another group"
            else:
                decision, lost = await self.commit.vote(group, vote, attempt.evidence, attempt.rejected,
                                                        attempt.refused, attempt.refused_by)
                if lost == Failure.UNREACHABLE:
                    dead = "its coordinator cannot be reached"
            if lost is not None:
                failures.append(Failure.NO_DECISION)
            elif decision.reason:  # the coordinator went on without some members, or dropped the round
                logger.warning(f"round {round_index}: the coordinator {group.coordinator[-8:]} decided "
                               f"{decision.outcome}: {decision.reason}")
            if dead and not rejoined:
                rejoined = True
                logger.warning(f"round {round_index}: the group of coordinator {group.coordinator[-8:]} is dead "
                               f"({dead}); joining the round at the next coordinator")
                regroup = await self.matchmaker.rejoin(group, failures, only_open=lost is not None)
                if regroup is None or len(regroup.peers) == 1:
                    self._applied_with(None)
                    if regroup is not None:
                        return await self._alone(exchange, round_index, started, failures, regroup)
                    return AllReduceResult([me], committed=False, excluded=True, attempts=len(attempts),
                                           failures=failures, tokens=self.matchmaker.weight(exchange.tokens),
                                           traffic=round_traffic(attempts, time.perf_counter() - started))
                group, formed = regroup, set(regroup.peers)
                continue
            if decision.outcome == Outcome.REDO and decision.redo is not None and me in decision.redo.peers:
                group = decision.redo
                continue
            if decision.outcome == Outcome.ABORT and lost is None and not dead:
                failures.append(Failure.ABORTED)
            committed = vote == Vote.HOLDS and decision.applies(digests)
            self._applied_with(group if committed else None, attempt.delivered)
            weights = {p: t for p, t in group.tokens_of().items() if t > 0 and p not in attempt.dropped}
            return AllReduceResult(
                list(group.peers), committed,
                # Others applied an aggregate this peer does not hold (or redid the round without it).
                excluded=not committed and (decision.outcome in (Outcome.COMMIT, Outcome.REDO) or bool(dead)),
                dropped=sorted(attempt.dropped | (formed - set(group.peers))),  # incl. those a redo left out
                clipped=attempt.clipped, opposed=attempt.opposed, attempts=len(attempts), failures=failures,
                tokens=self.matchmaker.weight(exchange.tokens),
                traffic=round_traffic(attempts, time.perf_counter() - started), weights=weights if committed else {},
                refused_by=sorted({p for a in attempts for p in a.refused_by}))

    def _applied_with(self, group: Group | None, delivered: Iterable[str] = ()) -> None:
        """This peer applied the round's aggregate with ``group`` (None: it applied none, or its own alone), whose
        ``delivered`` members delivered it something of their own (a contribution in its aggregates, or an
        aggregate): the group it follows, vouched for by them (``Matchmaker.follow``), and its partners. A round it
        did not apply leaves its partners as they were: after aborted rounds, every record's step time would set the
        pace of its budget, and a few records claiming fast steps shortened its rounds up to 16x."""
        self.matchmaker.follow(group, delivered)
        if group is not None:
            self._stranded_said = False
            self._recent = (*self._recent, frozenset(delivered))[-PARTNER_ROUNDS:]
            self.partners = frozenset().union(*self._recent)

    async def _alone(self, exchange: SlicedExchange, round_index: int, started: float, failures: list[Failure],
                     alone: Group) -> AllReduceResult:
        """A group of one (``alone``): its own update, through the same codec, if nobody else could apply this round
        without it (``Matchmaker.working_on``); else nothing (a solitary commit would split this peer from the others:
        it catches up with them instead). Nothing either where no coordinator answered while other trainers of the run
        live (``_stranded``). A hub has no update of its own: alone, it applies nothing."""
        if self.matchmaker.hub:  # it brought nothing of its own: alone, it has nothing to apply
            return AllReduceResult([self.matchmaker.me], committed=False, failures=failures,
                                   traffic=Traffic(seconds=time.perf_counter() - started))
        if await self._stranded(round_index, alone):
            failures.append(Failure.NO_COORDINATOR)
            return AllReduceResult([self.matchmaker.me], committed=False, failures=failures,
                                   traffic=Traffic(seconds=time.perf_counter() - started))
        others = await self.matchmaker.working_on(round_index)
        if others:
            failures.append(Failure.ALONE)
            logger.warning(f"round {round_index}: this peer is alone while {len(others)} other peer(s) could apply "
                           f"this round without it ({', '.join(p[-8:] for p in others)}): it applies nothing rather "
                           f"than its own update, and catches up with them")
            return AllReduceResult([self.matchmaker.me], committed=False, excluded=True, failures=failures,
                                   traffic=Traffic(seconds=time.perf_counter() - started))
        try:
            uploaded = await asyncio.get_running_loop().run_in_executor(None, reduce_alone, exchange)
        except PayloadError as e:
            raise TrainingError(f"this peer's own update is unusable ({e}): training diverged; "
                                f"lower the inner or outer learning rate") from None
        return AllReduceResult([self.matchmaker.me], committed=True, failures=failures, tokens=exchange.tokens,
                               traffic=Traffic(contribution_bytes=uploaded, params=exchange.numel(),
                                               seconds=time.perf_counter() - started),
                               weights={self.matchmaker.me: exchange.tokens})


    async def _stranded(self, round_index: int, alone: Group) -> bool:
        """Whether no coordinator answered this peer (``alone`` is no group a coordinator formed) while other trainers
        of the run live, at any round, and every one of them only dials out (``Matchmaker.stranded_with``): no hub
        serves the run, or none answers. Each applying its own update would fork the run into private models that
        never meet again (nobody can fetch a state from a peer that cannot be dialled), so this peer applies nothing,
        and, nobody else having applied it either, has nothing to catch up to; its work waits in its error feedback
        (or carry) and goes into the first round it shares. Said once, in one line, with the fix. Where another
        trainer can be dialled, the rule for a peer alone holds (it may have gone on: this peer catches up)."""
        if alone.group_id != NOBODY_ANSWERED:
            return False
        others = await self.matchmaker.stranded_with(round_index)
        if others and not self._stranded_said:
            self._stranded_said = True
            logger.warning(
                f"round {round_index}: {len(others)} other trainer(s) of this run are live "
                f"({', '.join(p[-8:] for p in others[:8])}), but no coordinator answered: none of them can be dialled, "
                f"and no hub serves the run. This peer applies nothing until one can (its work waits, and goes into "
                f"the first round it shares). Fix: a hub (`p2ploco dht` hosts one unless --no-hub; or `p2ploco node "
                f"start --role hub` on a machine others can dial), a trainer others can dial, or a port forwarded to "
                f"this one (--announce-maddrs)")
        return bool(others)


def round_traffic(attempts: list[Attempt], seconds: float) -> Traffic:
    """A round's traffic over its butterflies: the bytes of every one (a redo sends again, and so would a dense
    fp32 butterfly), the contribution and the parameters of the last (what one replica uploads, once)."""
    last = attempts[-1].traffic
    return Traffic(sum(a.traffic.bytes_sent for a in attempts), sum(a.traffic.bytes_received for a in attempts),
                   sum(a.traffic.dense_fp32_bytes for a in attempts), last.contribution_bytes, last.params, seconds)
