"""Matchmaking, the joiner's side: which peers all-reduce together in a round, their group (``sync/group.py``).

Every peer of a run must average with the same peers in a round, or their global parameters part
ways. So a group is not negotiated pairwise: one coordinator decides it (``sync/coordinator.py``, the other side).
The coordinator of round r is the live, not-leaving peer whose rendezvous score ``sha256(r / peer id)``
(``join.rendezvous``) is smallest: every peer whose view of the swarm agrees makes the same choice. The score depends
on nothing sent during the run: seeded by the hash of the round's starting parameters (as it once was), a reducer
could try low-bit variants of its span until that hash made it the next round's coordinator, every round. With
a fixed seed a key wins about one round in n + 1 among n peers, and a key ground to win m chosen
rounds costs about (n + 1)^m keys. A peer whose view lacks the winner is redirected to it; a
redirect must name a better score, so redirects end.

A peer that is ready for round r sends the coordinator a join request and waits for its group; it does not poll
the DHT for it: it uses the view it holds (``PeerDirectory.view``: taken since it moved to the round, or that of the
group it follows). A late peer is told so: it applies nothing this round and catches up from the swarm after. A
member checks the group it is given against its own view (every member a known live peer, itself included) and
refuses an implausible one, trying the next coordinator. The join request and its answers are ``sync/join.py``.

A peer takes part in one group per round and sync: it notes each coordinator before it asks it
(``sync/whereabouts.py``), and never takes the group of a coordinator it moved on from. Its reducer refuses at
once a contribution for a group of that round another coordinator formed. A member whose group died so (every
other member is elsewhere, or its vote finds no coordinator: ``SwarmCommunicator``) sends the same join again,
once, with the dead group's coordinator listed unreachable (``rejoin``); the next coordinator's formation of the
round waits for it as for any peer whose record claims the round. After a lost vote the rejoin says so, and a
coordinator with no formation of the round open answers it "late" rather than open one for it alone.

A group smaller than the peers that joined or were expected is the coordinator's decision, and every member logs
who was left out and why. A group of one is remembered like any other (its peer may apply
the round alone: stragglers that formed a second group of the same round at the same coordinator split the
swarm in two); and a peer that is alone, or reaches no coordinator, while other peers that could apply the
round without it are alive (``working_on``) applies nothing rather than its own update
(``SwarmCommunicator``): a solitary commit would split it from them. Where there is no coordinator to ask at all
while other trainers of the run live (all of them behind NAT, their hub gone), it waits for one until its join's
deadline, looking each heartbeat: a hub started again is asked as soon as its record is out.

A round covers named parameter slices (one per pipeline stage; the whole model when it is not cut):
a full replica holds them all, a stage peer one. The state a round starts from is, for every slice,
the hash most active peers of that round hold (``consensus.round_state``); its digest names the
formation, so peers that start from different states never share a group. Each joiner says which
slices it holds (with its exchange fingerprint and hash for each) and, for a stage peer, its pipeline
group; the group it is given lists which slices each member holds, so that every member cuts each slice among
exactly its holders.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

from hivemind.p2p import P2P

from p2ploco import faults
from p2ploco.aio import in_time
from p2ploco.errors import Failure, PayloadError, TransportError
from p2ploco.swarm import wire
from p2ploco.swarm.bans import Bans
from p2ploco.swarm.consensus import contested, round_state
from p2ploco.swarm.directory import PeerDirectory
from p2ploco.swarm.evidence import group_statement, signed_by
from p2ploco.swarm.messages import MAX_GROUP_HEADER, decode
from p2ploco.swarm.records import PeerRecord, PeerRole, Phase
from p2ploco.sync.coordinator import HUB_PATIENCE, Coordinator
from p2ploco.sync.group import Group
from p2ploco.sync.join import (
    JOIN_FAILURES,
    JoinAnswer,
    JoinStatus,
    best_coordinator,
    join_handler,
    parse_group,
    rendezvous,
)
from p2ploco.sync.this_peer import ThisPeer
from p2ploco.sync.whereabouts import Whereabouts

logger = logging.getLogger(__name__)

KEEP_JOINS = 8  # this peer's latest joins it keeps, to ask again at the next coordinator if their group dies
PROBES_AT_ONCE = 16  # daemons of other peers a peer left alone probes at once (``working_on``)
NOBODY_ANSWERED = "alone"  # the group id of a group of one that no coordinator formed: none could be asked, or answered


class Matchmaker:
    """This peer's joins: it asks each round's coordinator for its group (and the next one, if that group dies),
    checks the group it is given, and follows the group it applied its last round with."""

    def __init__(self, p2p: P2P, directory: PeerDirectory, coordinator: Coordinator, me: ThisPeer, run_id: str,
                 timeout: float, bans: Bans, stages: int, max_tokens: int, keys: Callable[[str], bytes | None],
                 dial_out: bool = False):
        """``me``: this peer, as the sync knows it; ``coordinator``: this peer's coordinator side, which it asks as any
        other when it is the round's best, and whose list of the peers that may coordinate it, and the run's
        ``swarm.max_reducers`` that every group of the run carries (a join names the run's config), it goes by;
        ``stages``: slices of a pipeline group; ``max_tokens``: the most tokens a member's contribution may
        weigh (``Config.max_contribution_tokens``); ``keys``: a peer's public key as its record names it (None:
        unknown), which the groups its coordinators hand out are checked with; ``dial_out``: this peer cannot be
        dialled (``swarm/reachability.py``), as its joins say. ``timeout``: the bound on a formation's wait
        (``swarm.matchmaking_timeout``), which its join waits for at most."""
        self.p2p, self.directory, self.coordinator, self.timeout, self.bans = p2p, directory, coordinator, timeout, bans
        self.run_id, self.keys, self.stages, self.max_tokens, self.dial_out = run_id, keys, stages, max_tokens, dial_out
        self.me, self.hub = me.peer_id, me.hub
        self.handler_name = join_handler(run_id)
        self._leavers: dict[str, int] = {}  # coordinators that answered they are leaving -> the round they said so
        self.following: Group | None = None  # the group this peer applied its last round with
        self.leaving = asyncio.Event()
        self.whereabouts = Whereabouts()  # the coordinator this peer asks (or holds the group of) for each round
        # (round, name) -> this peer's join of that sync (the request, the group it names as followed, its slices)
        self._joins: dict[tuple[int, str], tuple[dict[str, Any], Group | None, dict[str, tuple[str, str]]]] = {}

    def follow(self, group: Group | None, vouched: Iterable[str] = ()) -> None:
        """This peer applied its last round with ``group`` (None: it did not, or alone), and ``vouched`` members
        delivered it a contribution or an aggregate: its view of the swarm (``PeerDirectory.follow``), and the
        base its joins are answered relative to (and its coordinator side answers others relative to)."""
        self.following = self.coordinator.following = group if group is not None and len(group.peers) > 1 else None
        if self.following is None:
            self.directory.follow(())
        else:
            self.directory.follow(self.following.peers, vouched, self.following.coordinator)

    async def withdraw(self) -> None:
        """This peer is leaving: stop joining groups, and finish coordinating what it already started."""
        self.leaving.set()
        await self.coordinator.withdraw()

    async def form_group(self, round_index: int, name: str, slices: dict[str, tuple[str, str]],
                         pipeline: str = "", failures: list[Failure] | None = None,
                         weight: int = 1) -> Group | None:
        """The group this peer all-reduces with in ``round_index``, given the slices it holds (name -> (exchange
        fingerprint, hash)), what its contribution weighs (``ThisPeer.weight``) and, for a stage peer, its
        pipeline group: a group of one (``alone``) if no coordinator could be reached or none put anyone else
        with it (the caller decides whether it may commit alone), None if it came too late, is banned, was
        refused, or is leaving, and must apply nothing this round. What went wrong on the way is added to
        ``failures``."""
        failures = failures if failures is not None else []
        base = self.following  # as named in the request: it may change while the join waits (an overlapped round)
        request = await self._join_request(round_index, name, slices, pipeline, weight, base)
        self._joins[(round_index, name)] = (request, base, slices)
        for old in list(self._joins)[:-KEEP_JOINS]:
            del self._joins[old]
        return await self._join(round_index, name, request, base, slices, failures, {})

    async def rejoin(self, group: Group, failures: list[Failure], only_open: bool) -> Group | None:
        """This peer's group ``group`` is dead (``SwarmCommunicator``): the same join as before, at the next
        coordinator, which is asked for the group of the same round; as ``form_group`` answers. ``only_open``: join
        only a formation of the round that is open there already (its coordinator opens none for this peer)."""
        joined = self._joins.get((group.round_index, group.name))
        if joined is None:  # KEEP_JOINS later joins since: none to send again
            logger.warning(f"round {group.round_index}: this peer no longer holds its join of the round; it applies "
                           f"nothing this round and catches up")
            return None
        request, base, slices = joined
        request = {**request, "rejoin": only_open}
        return await self._join(group.round_index, group.name, request, base, slices, failures,
                                {group.coordinator: "its group is dead"})


    async def _join(self, round_index: int, name: str, request: dict[str, Any], base: Group | None,
                    slices: dict[str, tuple[str, str]], failures: list[Failure], unreachable: dict[str, str]
                    ) -> Group | None:
        """Ask coordinators in rendezvous order, less those in ``unreachable`` (coordinators tried in vain, and
        why), for a group of the sync ``name`` of ``round_index`` (``form_group``)."""
        # The coordinator may wait up to `timeout` for others after the first contribution; a hub joins as the round
        # begins, and waits for that first contribution too
        deadline = time.monotonic() + self.timeout + 5.0 + (HUB_PATIENCE if self.hub else 0.0)
        hints: set[str] = set()
        while time.monotonic() < deadline and not self.leaving.is_set():
            candidates = self.coordinator.candidates(set(unreachable)) \
                | (hints - set(unreachable) - set(self.bans.proofs))
            if not candidates:
                if not await self._coordinator_may_come(round_index, deadline):
                    break
                continue
            coordinator = best_coordinator(candidates, round_index)
            request["unreachable"] = sorted(unreachable)
            self.whereabouts.join(round_index, name, coordinator)  # before the ask: its group may reach us first
            try:
                answer = await self._answer_of(coordinator, round_index, request, deadline)
                status = answer.status
                if status == JoinStatus.GROUP:
                    return await self._accept(parse_group(answer.on(base), round_index, name, coordinator,
                                                          self.coordinator.max_reducers), slices,
                                              request["tokens"], failures)
                if status == JoinStatus.REDIRECT:
                    to = answer.to
                    if rendezvous(round_index, to) >= rendezvous(round_index, coordinator):
                        raise PayloadError(f"redirect to {to[-8:]}, which does not score better")
                    hints.add(to)
                elif status in (JoinStatus.LATE, JoinStatus.LEFT_OUT, JoinStatus.BANNED):
                    failures.append(JOIN_FAILURES[status])
                    logger.warning(f"round {round_index}: {(answer.reason or status)[:300]}; this peer "
                                   f"applies nothing this round and catches up")
                    return None
                else:  # its own word, before its record may say so: it applies no round from now on
                    unreachable[coordinator] = "it is leaving"
                    self._leavers[coordinator] = round_index
            except (TimeoutError, PayloadError, TransportError) as e:
                failures.append(wire.failure_of(e))
                logger.warning(f"round {round_index}: coordinator {coordinator[-8:]} unreachable or implausible "
                               f"({e!r}); trying the next one")
                unreachable[coordinator] = str(e) or type(e).__name__
        return None if self.leaving.is_set() else self._alone(round_index, name, slices, request["tokens"], unreachable)

    async def _answer_of(self, coordinator: str, round_index: int, request: dict[str, Any], deadline: float
                         ) -> JoinAnswer:
        """``coordinator``'s answer to ``request`` (this peer's own coordinator side's, asked without a stream)."""
        await faults.hit_async("matchmaking.join", round_index)
        asking = (self.coordinator.join_here(self.me, request) if coordinator == self.me
                  else self._ask(coordinator, request, deadline - time.monotonic()))
        response = await (self._unless_passed(round_index, asking) if self.hub else asking)
        return decode(JoinAnswer, response)

    def _alone(self, round_index: int, name: str, slices: dict[str, tuple[str, str]], tokens: int,
               unreachable: dict[str, str]) -> Group:
        """The group of one this peer is in where no coordinator answered (``unreachable``: those it tried, and
        why)."""
        tried = ", ".join(f"{peer[-8:]} ({why[:100]})" for peer, why in unreachable.items())
        logger.warning(f"round {round_index}: no coordinator answered ({tried or 'none to ask'})")
        self.whereabouts.join(round_index, name, self.me)  # so it answers the probes of the groups it is not in
        return Group(NOBODY_ANSWERED, round_index, name, (self.me,), self.me,
                     holdings=((self.me, tuple(sorted(slices))),), tokens=((self.me, tokens),),
                     max_reducers=self.coordinator.max_reducers)

    async def _coordinator_may_come(self, round_index: int, deadline: float) -> bool:
        """Whether to wait for a coordinator, none being there to ask: while the run's other live trainers all dial
        out too (``stranded_with``: none of them applies a round meanwhile either), until ``deadline``, a heartbeat
        at a time (a hub started again after a crash shows up so; rounds rushed through meanwhile were lost to all of
        them). False at once for a hub, for a peer alone in its run (it applies its round alone), and where another
        trainer can be dialled (the others may go on with it: this peer catches up)."""
        if self.hub or time.monotonic() + self.directory.interval >= deadline \
                or not await self.stranded_with(round_index):
            return False
        with contextlib.suppress(TimeoutError):
            await in_time(self.leaving.wait(), self.directory.interval)
        return not self.leaving.is_set()

    async def _unless_passed(self, round_index: int, asking: Coroutine[Any, Any, dict[str, Any]]) -> dict[str, Any]:
        """A hub's answer to ``asking``, unless, at a fresh look each heartbeat, most of the run's trainers are at a
        later round first (then "late": the hub waited for a round's first contribution at a formation the trainers
        did not come to, its view of the coordinators being another than theirs, and it catches up rather than wait
        out ``HUB_PATIENCE``; one record at a later round, anyone's to publish, decides nothing), or it starts
        leaving (then "leaving")."""
        def passed(live: dict[str, PeerRecord]) -> bool:
            trainers = [r for p, r in live.items() if r.role != PeerRole.HUB
                        and r.fingerprint == self.directory.me.fingerprint and self.directory.fresh(p)
                        and r.state != Phase.LEAVING]
            return 2 * sum(r.round > round_index for r in trainers) > len(trainers)

        asked = asyncio.ensure_future(asking)
        try:
            while True:
                done, _ = await asyncio.wait({asked}, timeout=self.directory.interval)
                if done:
                    return asked.result()
                if self.leaving.is_set():
                    return {"status": JoinStatus.LEAVING}
                if passed(await self.directory.refresh()):
                    break
        finally:
            asked.cancel()
        self.coordinator.drop(self.me, round_index)  # a group formed here later is not one this hub takes part in
        return {"status": JoinStatus.LATE, "reason": f"the trainers moved past round {round_index} while this hub "
                                                     f"waited for its first contribution"}

    async def _join_request(self, round_index: int, name: str, slices: dict[str, tuple[str, str]],
                            pipeline: str, weight: int, base: Group | None) -> dict[str, Any]:
        """The join this peer sends coordinators: it names the formation by the state digest the swarm starts the
        round from, as this peer's view of the records has it."""
        me = self.directory.me
        banned = self.bans.active(round_index)
        looked = self.directory.refreshed_at
        view = await self.directory.view()  # no lookup if the heartbeat's will do
        state_digest, _ = round_state(view, me, round_index, banned)
        if self.directory.refreshed_at == looked and contested(view, me, round_index, banned):
            # Records at this round disagree: a peer left out of the last round shows its old state until it
            # catches up, and the records of those that applied it may not be in this view yet. One fresh look.
            state_digest, _ = round_state(await self.directory.refresh(), me, round_index, banned)
        return {"round": round_index, "name": name, "config": me.fingerprint, "state": state_digest,
                "slices": {k: list(v) for k, v in sorted(slices.items())}, "pipeline": pipeline,
                "unreachable": [], "tokens": weight, "dial_out": self.dial_out,
                "follows": base.digest if base else ""}

    def formation_wait(self, round_index: int) -> float:
        """How long a formation of ``round_index`` waits after its first contribution, as a coordinator judges it
        (``Coordinator.formation_wait``)."""
        return self.coordinator.formation_wait(round_index)

    async def _accept(self, group: Group, slices: dict[str, tuple[str, str]], tokens: int, failures: list[Failure]
                      ) -> Group:
        """A coordinator's group, once checked against what this peer joined with (its slices, its weight) and
        against the records (PayloadError if implausible)."""
        if group.coordinator != self.me and not signed_by(
                self.keys(group.coordinator) or b"", group_statement(self.run_id, group.group_id,
                                                                     bytes.fromhex(group.digest)), group.grant):
            raise PayloadError("group that its coordinator's key did not sign")
        if set(group.slices_of(self.me)) != set(slices):
            raise PayloadError("group that says this peer holds other slices")
        if group.tokens_of().get(self.me) != tokens:
            raise PayloadError("group that gives this peer another weight than it joined with")
        if any(t > self.max_tokens for _, t in group.tokens):
            raise PayloadError(f"group that gives a member more tokens than a contribution may weigh "
                               f"({self.max_tokens})")
        await self._check_plausible(group)
        if group.left_out:
            failures.append(Failure.SMALLER_GROUP)
            logger.warning(f"round {group.round_index}: the coordinator {group.coordinator[-8:]} formed a group of "
                           f"{len(group.peers)} without {group.without()}")
        return group

    async def working_on(self, round_index: int, any_round: bool = False) -> list[str]:
        """Other peers that could apply ``round_index`` without this one, so that applying it alone would split this
        peer from them ([]: none): those whose records, at a fresh look, say they work on that round, a later one or the
        one before (still moving to it: an overlapped peer's record moves on only once its round in flight has a group;
        ``any_round``: at any round, as every trainer of a run that nobody can coordinate is) for our config (fresh, not
        leaving, not waiting for a slot, not banned here), whose daemon can still be dialled (a peer killed a moment ago
        still has a fresh record) and that did not answer this round that it is leaving, less the stage peers whose
        pipeline group has no such peer for some stage (a group acts as one replica or not at all), and less the peers
        that sit rounds out (``budget.py``: one whose short step of a round it sat out is over shows a later round, yet
        applied none; one that contributes a step's work does so in a group, whose other members count), and less the
        hubs (they train nothing: without a contribution they apply no round). Those further behind follow this peer's
        state once they reach it. The peers behind a NAT, whose fresh records are all there is to go by, are all
        listed; the others are probed PROBES_AT_ONCE at a time, in random order, until one of them counts (or none is
        left): a peer left alone in a round of 2,048 probed all ~1,400 that could be dialled, and a thousand were left
        alone."""
        live = await self.directory.refresh()
        banned = self.bans.active(round_index)
        since = 0 if any_round else round_index - 1
        ahead = [p for p, r in live.items() if p != self.me and r.round >= since
                 and r.fingerprint == self.directory.me.fingerprint and self.directory.fresh(p)
                 and not r.sits_out and r.role != PeerRole.HUB
                 and r.state not in (Phase.LEAVING, Phase.STANDBY, Phase.SERVING)
                 and p not in banned and self._leavers.get(p, -1) < round_index]
        alive = [p for p in ahead if live[p].dials_out]
        dialable = [p for p in ahead if not live[p].dials_out]
        random.shuffle(dialable)
        while dialable and all(live[p].dials_out for p in self._replicas_among(alive, live)):
            probed, dialable = dialable[:PROBES_AT_ONCE], dialable[PROBES_AT_ONCE:]
            dialled = await asyncio.gather(*(wire.reachable(self.p2p, p, self.handler_name, wire.PROBE_EVERY)
                                             for p in probed))
            alive += [p for p, reached in zip(probed, dialled) if reached]
        return sorted(self._replicas_among(alive, live))

    def _replicas_among(self, peers: list[str], live: dict[str, PeerRecord]) -> list[str]:
        """Of ``peers``, the full replicas and the stage peers of pipeline groups whose every stage ``peers`` cover."""
        stages: dict[str, set[int]] = {}
        for p in peers:
            if live[p].group:
                stages.setdefault(live[p].group, set()).add(live[p].stage)
        return [p for p in peers if not live[p].group or len(stages[live[p].group]) >= self.stages]

    async def stranded_with(self, round_index: int) -> list[str]:
        """The run's other live trainers (at any round: ``working_on``), if every one of them dials out: then none of
        them can coordinate, and none applies a round that this peer, which reached no coordinator, could catch up
        to; [] where one of them can be dialled, or none lives."""
        others = await self.working_on(round_index, any_round=True)
        live = self.directory.live
        return others if all(p in live and live[p].dials_out for p in others) else []

    async def _check_plausible(self, group: Group) -> None:
        """PayloadError unless every member of ``group`` is a peer this peer knows, itself included: one whose record
        it saw live within the formation's bound (the coordinator may have formed the group from joins that old, and
        checked them). A member this view lacks (a joiner, or one whose record lapsed here longer ago: a peer that
        follows its group reads the others' records now and then) is looked up under its record key, and may have
        published its record a moment ago: one more look a heartbeat later before refusing. (Had only unlapsed
        records counted, the 2,045 members of a first round at 2,048, whose records had lapsed in views taken at their
        joins, would all have read every record key at once: some keys' replicas answered after the records had
        lapsed again, and hundreds of members refused the group.)"""
        if self.me not in group.peers:
            raise PayloadError("group without this peer")
        unknown = self.directory.lacks(group.peers, lapsed_within=self.timeout)
        if unknown:
            await self.directory.look_up(unknown)
            unknown = self.directory.lacks(group.peers, lapsed_within=self.timeout)
        if unknown:
            await asyncio.sleep(self.directory.interval)
            await self.directory.look_up(unknown)
            unknown = self.directory.lacks(group.peers, lapsed_within=self.timeout)
        if unknown:
            raise PayloadError(f"group of {len(group.peers)} names {len(unknown)} peer(s) this peer does not know")
        # Only a hub contributes nothing: a coordinator that gave trainers no weight would make the group's aggregate
        # its own contribution alone
        live = self.directory.live
        weightless = {p for p, t in group.tokens if t == 0 and (p not in live or live[p].role != PeerRole.HUB)}
        if weightless:
            raise PayloadError(f"group that gives {len(weightless)} member(s) that are no hub no weight")

    async def _ask(self, coordinator: str, request: dict[str, Any], timeout: float) -> dict[str, Any]:
        """One join request. A stream that breaks is asked again: the coordinator may hold our join all the same, and
        answers a second ask with the group it formed (a next coordinator would form a group the others are not in).
        Not abandoned if this peer starts leaving meanwhile: the coordinator may hold its join already, and the group
        it closes with it would wait for a contribution that never came (a Ctrl-C then cost the others their round).
        The peer finishes the all-reduce it joined, then leaves."""
        response, _ = await in_time(
            wire.call(self.p2p, coordinator, self.handler_name, request, attempts=2, max_header=MAX_GROUP_HEADER),
            timeout)
        return response
