"""The production Communicator: a group from the round's coordinator, a butterfly all-reduce over
hivemind, and a vote on the outcome, so that every survivor applies the same aggregate or none.

A sync is a value (``Sync``) moved through named states, one handler each, and ended once, by ``_result``:

    FORMING --group--> REDUCING --> VOTING --commit / abort--> DONE
       |                  ^           |
       |                  +---redo----+   (the decision's group of survivors, this peer in it)
       |                              |
       |                  +-- dead ---+   (once a sync: REJOINING at the next coordinator, then as FORMING)
       +--group of one--> ALONE --> DONE   (its own update, or nothing)
       +--no group------------------> DONE

A group can die under its members: its coordinator answered some of them and crashed before the others had their
answer (they joined the round at the next coordinator), or its answers to them were lost. A member learns it
when every other member answers its contributions that it takes part in this round in another group
(``sync/reduce.py``: none of them holds this group, so nobody applies it), or when its vote cannot reach the
coordinator at all (no stream opens: without its coordinator, no member applies the group). Instead of applying nothing,
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
import enum
import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

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
from p2ploco.swarm.directory import PeerDirectory
from p2ploco.swarm.loop import EventLoopThread
from p2ploco.swarm.records import Phase
from p2ploco.sync.decide import RoundCommit
from p2ploco.sync.form import NOBODY_ANSWERED, Matchmaker
from p2ploco.sync.group import Group
from p2ploco.sync.reduce import ButterflyAllReduce
from p2ploco.sync.reduce_values import Attempt, DroppedFromRound
from p2ploco.sync.tally import Decision, Outcome, Vote, slice_digests
from p2ploco.sync.this_peer import ThisPeer

logger = logging.getLogger(__name__)

PARTNER_ROUNDS = 4  # applied all-reduces whose partners this peer remembers


class SyncState(enum.Enum):
    """Where a sync stands (``docs/design.md``, "A sync's states")."""

    FORMING = "forming"  # asking the round's coordinator for a group
    REDUCING = "reducing"  # a butterfly among the group
    VOTING = "voting"  # asking the coordinator for the group's one outcome
    REJOINING = "rejoining"  # the group died under this peer: the same join at the next coordinator
    ALONE = "alone"  # a group of one: its own update, or nothing
    DONE = "done"


class Ending(enum.Enum):
    """How a sync ended for this peer: what its one exit (``SwarmCommunicator._result``) builds the result from."""

    UNGROUPED = "ungrouped"  # late, refused or leaving, or a dead group with no other to rejoin: nothing to apply
    DECIDED = "decided"  # the coordinator decided for the group: commit, redo ended, or abort
    OWN_UPDATE = "own update"  # alone, and nobody else could apply the round without it: it applies its own
    LEFT_BEHIND = "left behind"  # alone while others could apply the round without it: it catches up
    STRANDED = "stranded"  # no coordinator answered while the run's other trainers only dial out
    NOTHING_TO_APPLY = "nothing to apply"  # a hub alone: it brought no update of its own


@dataclass
class Sync:
    """One sync as this peer runs it, from its join to its result: the group it holds, the butterflies it ran and
    what the coordinator decided, moved on by ``SwarmCommunicator``'s one handler per state."""

    exchange: SlicedExchange
    round_index: int
    name: str
    grouped: threading.Event  # set once this peer knows whom it averages with (``PendingAllReduce``)
    started: float = field(default_factory=time.perf_counter)
    failures: list[Failure] = field(default_factory=list)
    group: Group | None = None
    formed: frozenset[str] = frozenset()  # the group as formed: those a redo left out are dropped
    attempts: list[Attempt] = field(default_factory=list)
    vote: Vote = Vote.MISSING
    decision: Decision = field(default_factory=lambda: Decision(Outcome.ABORT))
    lost: Failure | None = None  # why no decision arrived, if none did
    dead: str = ""  # why nobody applies the group's round, if so (module docstring)
    rejoined: bool = False  # once a sync at most
    uploaded: int = 0  # bytes of its own update, applied alone
    ending: Ending = Ending.UNGROUPED

    def end(self, ending: Ending) -> SyncState:
        self.ending = ending
        return SyncState.DONE


class SwarmCommunicator(Communicator):
    def __init__(self, loop: EventLoopThread, me: ThisPeer, directory: PeerDirectory, join_timeout: float,
                 matchmaker: Matchmaker, butterfly: ButterflyAllReduce, commit: RoundCommit):
        self.loop, self.me, self.directory, self.join_timeout = loop, me, directory, join_timeout
        self.matchmaker, self.butterfly, self.commit = matchmaker, butterfly, commit
        self._recent: tuple[frozenset[str], ...] = ()  # each recent all-reduce's partners, oldest first
        # Replaced whole, never changed in place: the training thread reads it while the event loop writes it.
        self.partners: frozenset[str] = frozenset()
        self._stranded_said = False  # said, since this peer last applied a round, that nobody can coordinate
        # FORMING is a seam: a hostile peer in the tests swaps it (``faults.py``) before its node starts
        self._handlers = {SyncState.FORMING: faults.seam("sync.forming", self, self._form),
                          SyncState.REDUCING: self._reduce,
                          SyncState.VOTING: self._vote, SyncState.REJOINING: self._rejoin,
                          SyncState.ALONE: self._alone}

    def all_reduce(self, exchange: Exchange, round_index: int, name: str) -> AllReduceResult:
        return self.loop.run(self.sync(exchange, round_index, name))

    async def sync(self, exchange: Exchange, round_index: int, name: str) -> AllReduceResult:
        """One sync, on the swarm's loop (``all_reduce`` from any other thread)."""
        return await self._run(Sync(as_sliced(exchange, name), round_index, name, threading.Event()))

    def start_all_reduce(self, exchange: Exchange, round_index: int, name: str) -> PendingAllReduce:
        grouped = threading.Event()
        future = asyncio.run_coroutine_threadsafe(
            self._run(Sync(as_sliced(exchange, name), round_index, name, grouped)), self.loop.loop)
        future.add_done_callback(lambda _: grouped.set())
        return PendingAllReduce(future, grouped)

    async def _run(self, sync: Sync) -> AllReduceResult:
        state = SyncState.FORMING
        while state is not SyncState.DONE:
            state = await self._handlers[state](sync)
        return self._result(sync)

    # ---- the states ---------------------------------------------------------------------------------------

    async def _form(self, sync: Sync) -> SyncState:
        """Ask the round's coordinator for a group, once this peer's record of the round is out."""
        # The record of this round (published in the background as the round began) must be out before joining:
        # the coordinator waits for the peers whose records say they work on this round. Normally long stored.
        await self.directory.flush(timeout=self.join_timeout)
        self.directory.update_soon(state=Phase.AVERAGING)  # informative only: nobody waits for it
        held = self.directory.me.slices  # the hash of each slice at the start of the round, as the node published it
        # Some of them (Streaming DiLoCo averages one fragment at a time), each as it was at the round's start.
        if not set(sync.exchange.parts) <= set(held):
            raise TrainingError(f"this peer published slices {sorted(held)} but averages {sorted(sync.exchange.parts)}")
        slices = {k: (part.fingerprint(), held[k]) for k, part in sync.exchange.parts.items()}
        group = await self.matchmaker.form_group(sync.round_index, sync.name, slices, self.directory.me.group,
                                                 sync.failures, self.me.weight(sync.exchange.tokens))
        sync.grouped.set()  # the join no longer reads this peer's record: it may announce its next round
        return self._grouped(sync, group)

    def _grouped(self, sync: Sync, group: Group | None) -> SyncState:
        if group is None:  # late, refused, or leaving: nothing to apply
            return sync.end(Ending.UNGROUPED)
        sync.group, sync.formed = group, frozenset(group.peers)
        return SyncState.ALONE if len(group.peers) == 1 else SyncState.REDUCING

    async def _reduce(self, sync: Sync) -> SyncState:
        await faults.hit_async("matchmaking.grouped", sync.round_index)
        attempt = await self.butterfly.run(sync.group, sync.exchange)
        sync.attempts.append(attempt)
        sync.failures += attempt.failures
        if attempt.error is not None:
            logger.warning(f"round {sync.round_index}: all-reduce among {len(sync.group.peers)} peers failed here "
                           f"({attempt.error})")
        sync.vote = (Vote.HOLDS if attempt.error is None else
                     Vote.DROPPED if isinstance(attempt.error, DroppedFromRound) else Vote.MISSING)
        return SyncState.VOTING

    async def _vote(self, sync: Sync) -> SyncState:
        """The group's one outcome: the coordinator's decision, or abort where the group is dead (no other member
        holds it, or its coordinator cannot be reached). Then redo, rejoin, or done."""
        group, attempt = sync.group, sync.attempts[-1]
        sync.dead = ""
        if set(group.peers) - {self.me.peer_id} <= attempt.elsewhere:
            sync.decision, sync.lost = Decision(Outcome.ABORT), None
            sync.dead = "every other member takes part in this round in another group"
        else:
            sync.decision, sync.lost = await self.commit.vote(group, sync.vote, attempt.evidence, attempt.rejected,
                                                              attempt.refused, attempt.refused_by)
            if sync.lost == Failure.UNREACHABLE:
                sync.dead = "its coordinator cannot be reached"
        if sync.lost is not None:
            sync.failures.append(Failure.NO_DECISION)
        elif sync.decision.reason:  # the coordinator went on without some members, or dropped the round
            logger.warning(f"round {sync.round_index}: the coordinator {group.coordinator[-8:]} decided "
                           f"{sync.decision.outcome}: {sync.decision.reason}")
        if sync.dead and not sync.rejoined:
            return SyncState.REJOINING
        redo = sync.decision.redo
        if sync.decision.outcome == Outcome.REDO and redo is not None and self.me.peer_id in redo.peers:
            sync.group = redo
            return SyncState.REDUCING
        if sync.decision.outcome == Outcome.ABORT and sync.lost is None and not sync.dead:
            sync.failures.append(Failure.ABORTED)
        return sync.end(Ending.DECIDED)

    async def _rejoin(self, sync: Sync) -> SyncState:
        sync.rejoined = True
        logger.warning(f"round {sync.round_index}: the group of coordinator {sync.group.coordinator[-8:]} is dead "
                       f"({sync.dead}); joining the round at the next coordinator")
        regroup = await self.matchmaker.rejoin(sync.group, sync.failures, only_open=sync.lost is not None)
        return self._grouped(sync, regroup)

    async def _alone(self, sync: Sync) -> SyncState:
        """A group of one: its own update, through the same codec, if nobody else could apply this round without it
        (``Matchmaker.working_on``); else nothing (a solitary commit would split this peer from the others: it
        catches up with them instead). Nothing either where no coordinator answered while other trainers of the run
        live (``_stranded``). A hub has no update of its own: alone, it applies nothing."""
        self._applied_with(None)
        if self.me.hub:
            return sync.end(Ending.NOTHING_TO_APPLY)
        if await self._stranded(sync.round_index, sync.group):
            sync.failures.append(Failure.NO_COORDINATOR)
            return sync.end(Ending.STRANDED)
        others = await self.matchmaker.working_on(sync.round_index)
        if others:
            sync.failures.append(Failure.ALONE)
            logger.warning(f"round {sync.round_index}: this peer is alone while {len(others)} other peer(s) could "
                           f"apply this round without it ({', '.join(p[-8:] for p in others[:8])}"
                           f"{', ...' if len(others) > 8 else ''}): it applies nothing "
                           f"rather than its own update, and catches up with them")
            return sync.end(Ending.LEFT_BEHIND)
        try:
            sync.uploaded = await asyncio.get_running_loop().run_in_executor(None, reduce_alone, sync.exchange)
        except PayloadError as e:
            raise TrainingError(f"this peer's own update is unusable ({e}): training diverged; "
                                f"lower the inner or outer learning rate") from None
        return sync.end(Ending.OWN_UPDATE)

    # ---- the one exit -------------------------------------------------------------------------------------

    def _result(self, sync: Sync) -> AllReduceResult:
        """The sync's result, built here only; the commit gate for a group's aggregate is ``_commits``."""
        seconds = time.perf_counter() - sync.started
        me, tokens = self.me.peer_id, sync.exchange.tokens
        if sync.ending is Ending.DECIDED:
            return self._decided(sync, seconds)
        if sync.ending is Ending.OWN_UPDATE:
            return AllReduceResult([me], committed=True, failures=sync.failures, tokens=tokens,
                                   traffic=Traffic(contribution_bytes=sync.uploaded, params=sync.exchange.numel(),
                                                   seconds=seconds), weights={me: tokens})
        excluded = sync.ending in (Ending.UNGROUPED, Ending.LEFT_BEHIND)
        if sync.ending is Ending.UNGROUPED:
            self._applied_with(None)
            if sync.attempts:  # a dead group, and none to rejoin: what it sent still counts
                return AllReduceResult([me], committed=False, excluded=True, attempts=len(sync.attempts),
                                       failures=sync.failures, tokens=self.me.weight(tokens),
                                       traffic=round_traffic(sync.attempts, seconds))
        return AllReduceResult([me], committed=False, excluded=excluded, failures=sync.failures,
                               traffic=Traffic(seconds=seconds))

    def _decided(self, sync: Sync, seconds: float) -> AllReduceResult:
        group, attempt, decision = sync.group, sync.attempts[-1], sync.decision
        committed = self._commits(sync)
        self._applied_with(group if committed else None, attempt.delivered)
        weights = {p: t for p, t in group.tokens_of().items() if t > 0 and p not in attempt.dropped}
        return AllReduceResult(
            list(group.peers), committed,
            # Others applied an aggregate this peer does not hold (or redid the round without it).
            excluded=not committed and (decision.outcome in (Outcome.COMMIT, Outcome.REDO) or bool(sync.dead)),
            dropped=sorted(attempt.dropped | (sync.formed - set(group.peers))),  # incl. those a redo left out
            clipped=attempt.clipped, opposed=attempt.opposed, attempts=len(sync.attempts), failures=sync.failures,
            tokens=self.me.weight(sync.exchange.tokens), traffic=round_traffic(sync.attempts, seconds),
            weights=weights if committed else {}, refused_by=sorted({p for a in sync.attempts for p in a.refused_by}))

    @staticmethod
    def _commits(sync: Sync) -> bool:
        """The commit gate: this peer applies the group's aggregate only if it holds every span's and the
        coordinator's decision commits exactly what it holds."""
        digests = slice_digests(sync.attempts[-1].evidence) if sync.vote == Vote.HOLDS else {}
        return sync.vote == Vote.HOLDS and sync.decision.applies(digests)

    # ---- what a sync leaves behind --------------------------------------------------------------------------

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
