"""Matchmaking, the coordinator's side: it serves the joins of the rounds it coordinates, holds their formations,
and closes each with one group (``sync/form.py`` is the joiner's side).

A peer that is ready for round r sends the coordinator a join request and waits; the coordinator
closes the group when every live peer that works on round r from the same state with the same config
(or announced that it fetches that state to join round r; and still renews its record and can be dialled:
a crashed peer is not waited for) has joined, or
a formation's wait after the first join that brings a contribution (a hub's does not: it joins as the round
begins, ``roles.py``): the expected peers' published step times allow for it, within ``swarm.matchmaking_timeout``
(``deadlines.formation_wait``). It answers every waiting peer with the same ordered list. For that wait it also
waits for peers still moving to round r (records at r - 1, or at r with another state: they catch up), since a
round's all-reduce may come early in it (Streaming DiLoCo's first fragment syncs a step or two into the round); it
waited for them a third of a hand-set timeout, which a measured wait, a few seconds on a fast swarm, would leave too
short for a catch-up. It does not poll the DHT for it: it looks up the records once as the first peer joins and
then re-judges on events (a join, a heartbeat's lookup, a probe, the end of that grace), so the last join closes the
group at once (it looks again only before closing without a peer that its view shows at an earlier round).
A late peer is told so: it applies nothing this round and catches up from the swarm after. A member that
asks again (its answer was lost on a broken stream, and it asks the same coordinator once more before
any other) gets the group it is in. A peer this coordinator has banned (``swarm/bans.py``) is told so
too. Peers whose config, exchange or starting state differ never share a group. The coordinator needs no
pseudo-gradient of its own: it serves joins from its event loop while it trains. Only a peer that can be dialled
coordinates. A rejoin (its group of the round died: ``Matchmaker.rejoin``) that finds no formation of the round open
here is answered "late" rather than given a formation of its own.

A group smaller than the peers that joined or were expected is the coordinator's decision, never an
accident: the answer lists who was left out and why (another state, an incomplete pipeline group, did not
join in time), and every member logs it.

When the coordinator closes the formation it refuses (``admission.admit``) members that hold another state of some
slice than the majority (they catch up), every stage peer of a pipeline group that is not complete in the formation
(a group acts as one replica or not at all), and the holders of a slice that no member others can dial holds (it
cannot be reduced); the answer lists which slices each member holds, so that every member cuts each slice among
exactly its holders.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import secrets
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from hivemind.p2p import P2P

from p2ploco.aio import in_time
from p2ploco.swarm import wire
from p2ploco.swarm.bans import Bans
from p2ploco.swarm.consensus import round_state
from p2ploco.swarm.deadlines import formation_wait
from p2ploco.swarm.directory import PeerDirectory
from p2ploco.swarm.evidence import Signer, group_statement
from p2ploco.swarm.messages import MAX_REASON
from p2ploco.swarm.records import PeerRecord, PeerRole, Phase
from p2ploco.sync.admission import admit
from p2ploco.sync.group import FormationKey, Group, GroupBook, Member
from p2ploco.sync.join import MAX_LEFT_OUT, JoinStatus, best_coordinator, group_answer, join_handler, parse_join
from p2ploco.sync.tether import BROKE, Tethers

logger = logging.getLogger(__name__)

MAX_FORMING_PER_PEER = 4  # open formations at one coordinator a peer may be in at once (an overlapped round's next
# one, Streaming DiLoCo's next fragment): more is junk, refused
STRAGGLER_MISSES = 2  # formations a peer was expected in and never joined, after which it is not waited for
BAN_MISSES = 4  # and after which it is banned: its record claims rounds it never joins
KEEP_ASKED_ROUNDS = 8  # rounds for which a coordinator remembers who asked to join (an overlapped peer asks ahead)
LEAVE_GRACE = 5.0  # a leaving coordinator still answers the groups it is forming, for at most this long
HUB_PATIENCE = 3600.0  # seconds a hub's join waits for a round's first contribution (a round may be long)


@dataclass
class _Formation:
    key: FormationKey
    deadline: float
    wait: float = 0.0  # how long it waits for the peers it expects after its first contribution (deadlines.py)
    members: dict[str, Member] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)  # members the closed formation left out, and why
    awaited: set[str] = field(default_factory=set)  # expected peers that had not joined at the last look
    waited_for: set[str] = field(default_factory=set)  # every peer it awaited at some look, and stragglers
    unreachable: set[str] = field(default_factory=set)  # peers the members could not reach
    # expected peers gone while it waited, and how that is known: the coordinator could not reach one, or the tether
    # of one behind a NAT broke (``sync/tether.py``)
    dead: dict[str, str] = field(default_factory=dict)
    joined: float = field(default_factory=time.monotonic)  # when the latest member joined
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    closed: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())

    def contributed(self) -> bool:
        """Whether some member brings a contribution: a formation of hubs alone has nothing to reduce."""
        return any(m.tokens for m in self.members.values())





class Coordinator:
    """The rounds this peer coordinates: it serves their joins, holds a formation for each, and closes it with one
    group, which it signs, remembers (``GroupBook``) and answers every joiner. A leaving coordinator finishes the
    formations it holds and opens none."""

    def __init__(self, p2p: P2P, directory: PeerDirectory, run_id: str, timeout: float, bans: Bans, stages: int,
                 book: GroupBook, max_tokens: int, max_reducers: int, signer: Signer, tethers: Tethers,
                 dial_out: bool = False):
        """``stages``: slices of a pipeline group, all of which it must bring to a round; ``max_tokens``: the most
        tokens a member's contribution may weigh (``Config.max_contribution_tokens``); ``max_reducers``: the run's
        ``swarm.max_reducers``, which the groups it forms carry; ``signer``: signs the groups this peer forms;
        ``tethers``: those the peers behind NATs hold to it (a broken one tells that its peer crashed); ``dial_out``:
        this peer cannot be dialled (``swarm/reachability.py``): it never coordinates. ``timeout``: the bound on a
        formation's wait (``swarm.matchmaking_timeout``)."""
        self.p2p, self.directory, self.timeout, self.bans = p2p, directory, timeout, bans
        self.run_id, self.signer = run_id, signer
        self.stages, self.book, self.max_tokens, self.dial_out = stages, book, max_tokens, dial_out
        self.max_reducers, self.tethers = max_reducers, tethers
        self.me = directory.me.peer_id
        self.handler_name = join_handler(run_id)
        self._forming: dict[FormationKey, _Formation] = {}
        self._missed: Counter[str] = Counter()  # rounds each peer was waited for in vain here, in a row
        self._missed_round: dict[str, int] = {}  # the last round counted for each: a round counts once
        self._asked: dict[int, set[str]] = {}  # round -> the peers that asked to join some formation of it here
        self._checking: dict[FormationKey, set[int]] = {}  # joins being checked (``_refusal``), per formation
        self._check_ids = itertools.count()
        # the group this peer applied its last round with (``Matchmaker.follow``): a joiner that follows that very
        # version of it too is answered its difference (``join.group_answer``)
        self.following: Group | None = None
        self.leaving = asyncio.Event()

    async def start(self) -> None:
        await self.p2p.add_binary_stream_handler(self.handler_name, self._serve_join)

    def candidates(self, exclude: set[str] = frozenset()) -> set[str]:
        """Peers that may coordinate: live peers of this run's config that can be dialled, not leaving, not known
        unreachable."""
        config = self.directory.me.fingerprint
        live = {p for p, r in self.directory.live.items() if r.state != Phase.LEAVING and r.fingerprint == config
                and not r.dials_out and p not in self.bans.proofs}
        if not self.leaving.is_set() and not self.dial_out:
            live.add(self.me)
        return live - exclude

    async def withdraw(self) -> None:
        """This peer is leaving: open no formation, and finish those already open (for LEAVE_GRACE at most)."""
        self.leaving.set()
        forming = [f.closed for f in self._forming.values()]
        if forming:
            await asyncio.wait(forming, timeout=LEAVE_GRACE)

    def drop(self, peer: str, round_index: int) -> None:
        """``peer`` takes part in no group of ``round_index`` formed here from now on (a hub that gave up waiting for
        the round's first contribution)."""
        for key, formation in self._forming.items():
            if key[0] == round_index:
                formation.members.pop(peer, None)

    async def _serve_join(self, stream_info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sender = str(stream_info.peer_id)
        # a join that broke off is asked again: worth a debug line only
        async with wire.serving(logger, "join request", sender, reader, writer, self.timeout, logging.DEBUG):
            request, _ = await in_time(wire.read_message(reader, max_payload=0), self.timeout)
            response = await self.join_here(sender, request)
            await wire.write_message(writer, response)

    async def join_here(self, sender: str, request: dict[str, Any]) -> dict[str, Any]:
        """The answer to ``sender``'s join ``request`` (this peer's own too, asked without a stream): at once where
        it is refused, redirected or late, else the group its formation closes with."""
        key, unreachable, member = parse_join(request)
        answer = await self._answer_at_once(sender, key, unreachable, member)
        if answer is not None:
            return answer
        round_index = key[0]
        formation = self._forming.get(key)
        if formation is None:
            if member.rejoins:  # it joins the others where they are, and never forms a group of its own here
                return {"status": JoinStatus.LATE, "reason": f"no group of round {round_index} is forming at "
                                                             f"coordinator {self.me[-8:]}"}
            # A hub's join does not start the wait: it joins as the round begins, and the formation waits for
            # the first contribution (for HUB_PATIENCE at most)
            formation = _Formation(key, time.monotonic() + HUB_PATIENCE)
            self._forming[key] = formation
            asyncio.get_running_loop().create_task(self._close_when_complete(formation))
        if member.tokens and not formation.contributed():  # the first contribution: the wait starts now
            formation.wait = self.formation_wait(round_index)
            formation.deadline = min(formation.deadline, time.monotonic() + formation.wait)
        if sender not in formation.members:
            formation.members[sender], formation.joined = member, time.monotonic()
        formation.unreachable |= unreachable
        formation.changed.set()
        outcome: Group | str = await asyncio.shield(formation.closed)
        if isinstance(outcome, str):
            return {"status": JoinStatus.REDIRECT, "to": outcome}
        if sender in formation.refused:
            return {"status": JoinStatus.LEFT_OUT, "reason": formation.refused[sender]}
        if not any(tokens for _, tokens in outcome.tokens):
            return {"status": JoinStatus.LATE, "reason": f"no contribution to round {round_index} came to coordinator "
                                                         f"{self.me[-8:]} while its hubs waited"}
        return group_answer(outcome, self.following, member.follows)

    async def _answer_at_once(self, sender: str, key: FormationKey, unreachable: set[str], member: Member
                              ) -> dict[str, Any] | None:
        """The answer to a join of ``sender``'s that waits for no formation (None: it joins one): it is banned,
        claims too many tokens or is refused (``_refusal``), this peer leaves or is not the best coordinator it may
        ask (a formation open here is finished all the same), or the formation closed already (a member that asks
        again gets its group, anyone else "late")."""
        round_index = key[0]
        if self.bans.banned(sender, round_index):
            return {"status": JoinStatus.BANNED, "reason": f"coordinator {self.me[-8:]} has banned this peer for what "
                                                           f"it sent (its log says what)"}
        if member.tokens > self.max_tokens:  # no honest peer claims more: its weight is capped as it contributes
            return {"status": JoinStatus.LEFT_OUT, "reason": f"this peer claims {member.tokens} tokens, more than a "
                                                             f"contribution may weigh ({self.max_tokens})"}
        self._note_asked(sender, round_index)
        refusal = None if sender == self.me else await self._checked(sender, key)
        if refusal is not None:
            return {"status": JoinStatus.LEFT_OUT, "reason": refusal}
        if key not in self._forming and sender != self.me:  # an open formation is finished even while leaving
            if self.leaving.is_set():
                return {"status": JoinStatus.LEAVING, "reason": "the coordinator is leaving"}
            best = best_coordinator(self.candidates(unreachable | {sender}), round_index)
            if best != self.me:
                return {"status": JoinStatus.REDIRECT, "to": best}
        closed = self.book.closed(key)
        if closed is not None:
            if sender in closed.peers:
                return group_answer(closed)  # asked again (its first answer was lost): the same group, not "late"
            return {"status": JoinStatus.LATE, "reason": f"round {round_index} had already started without this peer"}
        return None

    def _note_asked(self, sender: str, round_index: int) -> None:
        """``sender`` asked to join a formation of ``round_index``: late perhaps, but no straggler."""
        self._missed.pop(sender, None)
        self._missed_round.pop(sender, None)
        # Kept around this peer's own round, never the sender's: a join for a made-up far round must neither grow
        # the memory nor push out who asked for the rounds under way.
        own = self.directory.me.round
        if abs(round_index - own) <= KEEP_ASKED_ROUNDS:
            self._asked.setdefault(round_index, set()).add(sender)
        for old in [r for r in self._asked if r < own - KEEP_ASKED_ROUNDS]:
            del self._asked[old]

    def formation_wait(self, round_index: int) -> float:
        """How long a formation of ``round_index`` waits after its first contribution (``deadlines.formation_wait``):
        by the step times the records of this run's peers at that round or the one before publish (neither a banned
        peer's nor one that sits rounds out: nobody waits for it), and this peer's own last round."""
        me, banned = self.directory.me, self.bans.active(round_index)
        peers = [r for p, r in self.directory.live.items()
                 if p != self.me and r.fingerprint == me.fingerprint and r.round in (round_index - 1, round_index)
                 and not r.sits_out and p not in banned]
        return formation_wait(self.timeout, self.directory.interval, me.round_seconds,
                              [r.step_seconds for r in peers if r.role != PeerRole.HUB],
                              [r.round_seconds for r in peers])

    async def _checked(self, sender: str, key: FormationKey) -> str | None:
        """``_refusal``, noted as a check under way for the formation of ``key``: a joiner this view lacks is looked
        up (a heartbeat at most), and a formation that closed meanwhile would tell it "late"
        (``_close_when_complete`` waits for the checks under way when it could close)."""
        check = next(self._check_ids)
        self._checking.setdefault(key, set()).add(check)
        try:
            return await self._refusal(sender, key)
        finally:
            self._checking[key].discard(check)
            if not self._checking[key]:
                del self._checking[key]
            if key in self._forming:
                self._forming[key].changed.set()

    async def _refusal(self, sender: str, key: FormationKey) -> str | None:
        """Why a join from ``sender`` for ``key`` is refused, if it is: a peer joins only rounds of this run's config,
        with a live record of it (anyone can open a stream; only peers of the run form groups), and only a few at
        once. An unknown sender is looked up under its record key (``PeerDirectory.look_up``): its record may be a
        moment old."""
        if key[2] != self.directory.me.fingerprint:
            return f"coordinator {self.me[-8:]} trains another config"
        if not self.directory.of_run(sender):
            await self.directory.look_up([sender])
        if not self.directory.of_run(sender):
            return f"coordinator {self.me[-8:]} sees no live record of this run's config for this peer"
        if sum(sender in f.members for k, f in self._forming.items() if k != key) >= MAX_FORMING_PER_PEER:
            return f"this peer is in {MAX_FORMING_PER_PEER} open rounds at coordinator {self.me[-8:]} already"
        return None

    async def _close_when_complete(self, formation: _Formation) -> None:
        """Close the group when everyone expected has joined or at the deadline; or hand the whole
        formation over to a better-scored peer that has come into view (every member retries there)."""
        round_index = formation.key[0]
        probed = time.monotonic()
        chosen: dict[str, str] = {}  # the hash of each slice most records show at this round
        # The joins being checked when the formation could first close: waited for, and no later ones, or joins
        # from made-up peers, one after another, would hold it open until its deadline
        held: set[int] | None = None
        self.directory.watchers.add(formation.changed)  # a heartbeat's lookup is an event too
        try:
            await self.directory.refresh()  # once, when the first peer joins: who works on this round?
            while time.monotonic() < formation.deadline:
                formation.changed.clear()  # whatever happens from here on wakes the wait below
                live = self.directory.live
                best = best_coordinator(self.candidates(formation.unreachable) | {self.me}, round_index)
                if best != self.me:
                    del self._forming[formation.key]
                    formation.closed.set_result(best)
                    return
                chosen, runs_here = self._await_peers(formation, live)
                complete = not formation.awaited and formation.contributed()
                if complete:
                    checking = self._checking.get(formation.key, set())
                    held = checking.copy() if held is None else held & checking
                if complete and not held:
                    # A peer of this run still at an earlier round in this view may have moved to this one since
                    # the view was taken: before closing without it, one fresh look (none when all are in).
                    behind = {p for p in runs_here if live[p].round < round_index} - set(formation.members) \
                        - set(formation.dead)
                    if behind and self.directory.refreshed_at < formation.joined:
                        await self.directory.refresh()
                        continue
                    break
                if time.monotonic() >= probed + wire.PROBE_EVERY:  # a peer killed in its inner steps is not waited for
                    probed = time.monotonic()
                    probes = sorted(p for p in formation.awaited - {self.me} if not live[p].dials_out)
                    alive = await asyncio.gather(*(wire.reachable(self.p2p, p, self.handler_name, wire.PROBE_EVERY)
                                                   for p in probes))
                    formation.dead.update((p, "it could not be reached") for p, ok in zip(probes, alive) if not ok)
                    formation.dead.update((p, BROKE) for p in self.tethers.cut(
                        {p for p in formation.awaited if live[p].dials_out}))
                # Woken by a join, a heartbeat's lookup, the next probe or the deadline: no polling of the DHT.
                wake = min(probed + wire.PROBE_EVERY, formation.deadline)
                try:
                    await in_time(formation.changed.wait(), max(0.0, wake - time.monotonic()))
                except TimeoutError:
                    pass
        finally:
            self.directory.watchers.discard(formation.changed)
            if not formation.closed.done():
                self._close(formation, chosen)

    def _await_peers(self, formation: _Formation, live: dict[str, PeerRecord]) -> tuple[dict[str, str], set[str]]:
        """Who the formation waits for now, by the records in ``live`` (``formation.awaited``, and every peer it
        ever waited for in ``formation.waited_for``); the hash of each slice most records show at this round and
        the peers of this run that may join it."""
        round_index, _, config, _ = formation.key
        # Peers working on this round from this state, for the whole wait: a swarm started together should not
        # split because one peer published its record a moment late. A peer that announced it is fetching this very
        # state (joining at this round: told "late" for the last one, or just restarted from a checkpoint of it) is
        # one of them: it brings its update once it has it, and it would otherwise lose this round too, and the
        # next, whenever a round is shorter than its lag. Not a peer that stopped renewing its record (it crashed),
        # nor one banned here.
        banned = self.bans.active(round_index)
        _, chosen = round_state(live, self.directory.me, round_index, banned)
        runs_here = {p for p, r in live.items() if r.fingerprint == config
                     and r.state not in (Phase.LEAVING, Phase.STANDBY)
                     and self.directory.fresh(p) and p not in banned}
        claim = {p for p in runs_here if live[p].round == round_index and live[p].slices
                 and all(chosen.get(k) == v for k, v in live[p].slices.items())}
        expected = {p for p in claim if self._missed[p] < STRAGGLER_MISSES}
        # Peers moving to this round are awaited like joiners, for the formation's wait: one still finishing the
        # previous round, and one at this round that holds another state (it was left out of the last round and
        # fetches the swarm's state now). A round's all-reduce need not come at its end: Streaming DiLoCo syncs its
        # first fragment a step or two into the round, and a peer a step behind (or catching up, every round anew)
        # would miss it every time.
        moving = {p for p in runs_here if live[p].round == round_index - 1
                  or (live[p].round == round_index and p not in expected)}
        formation.awaited = (expected | moving) - set(formation.dead) - set(formation.members)
        formation.waited_for |= formation.awaited | (claim - expected)  # a straggler still misses this round
        return chosen, runs_here

    def _close(self, formation: _Formation, chosen: dict[str, str]) -> None:
        """Close the formation: admit its members (``admission.admit``), name whom it left out and why, and answer
        every joiner the group."""
        round_index, name = formation.key[0], formation.key[1]
        members, formation.refused = admit(formation.members, self.stages, chosen)
        left_out = dict(formation.refused)
        # Whom it still awaited as of its last look: a join that came in as the deadline passed is a member all
        # the same (a group that left out a member of its own was refused by every member as implausible: 16 real
        # nodes on 2 cores lost rounds 2 and 5 so)
        left_out.update((p, f"it did not join within {formation.wait:.0f} s") for p in formation.awaited - set(members))
        left_out.update((p, why) for p, why in formation.dead.items() if p not in members)
        self._count_misses(formation, round_index)
        if left_out:  # every member logs it at WARNING, with the coordinator's name
            logger.info(f"round {round_index}: formed a group of {len(members)} without "
                        + ", ".join(f"{p[-8:]} ({why})" for p, why in sorted(left_out.items())))
        peers = sorted(members)
        group = Group(secrets.token_hex(8), round_index, name, tuple(peers), self.me,
                      holdings=tuple((p, tuple(sorted(dict(members[p].slices)))) for p in peers),
                      pipelines=tuple((p, members[p].pipeline) for p in peers
                                            if members[p].pipeline),
                      left_out=tuple(sorted((p, why[:MAX_REASON]) for p, why in left_out.items()))[:MAX_LEFT_OUT],
                      tokens=tuple((p, members[p].tokens) for p in peers),
                      dial_out=tuple(p for p in peers if members[p].dial_out), max_reducers=self.max_reducers)
        group = dataclasses.replace(group, grant=self.signer.sign(group_statement(self.run_id, group.group_id,
                                                                                  bytes.fromhex(group.digest))))
        self.book.add(group, formation.key)
        del self._forming[formation.key]
        formation.closed.set_result(group)

    def _count_misses(self, formation: _Formation, round_index: int) -> None:
        """Peers waited for in vain (for the whole wait, or the joiners' grace) that asked to join no formation of
        the round here: after STRAGGLER_MISSES such rounds in a row they are not expected any more (a live peer
        that never joins cost every round the whole timeout), after BAN_MISSES (rounds that no longer expected them
        count too) they are banned. A peer that asks, late or not, starts again from none."""
        # A peer in another formation of the round is no straggler, and a round counts once: junk joins open
        # formations of it that expect everyone, and may close before an honest peer has finished its inner steps.
        asked = self._asked.get(round_index, set())
        for peer in formation.waited_for - set(formation.dead) - set(formation.members) - asked - {self.me}:
            if self._missed_round.get(peer) == round_index:
                continue
            self._missed_round[peer] = round_index
            self._missed[peer] += 1
            if self._missed[peer] == STRAGGLER_MISSES:
                logger.warning(f"round {round_index}: {peer[-8:]} did not join the last {STRAGGLER_MISSES} rounds its "
                               f"record claims; not waiting for it any more")
            if self._missed[peer] >= BAN_MISSES:
                self.bans.ban(peer, round_index, f"it did not join the last {BAN_MISSES} rounds its record claims")
                del self._missed[peer], self._missed_round[peer]
