"""Matchmaking: which peers all-reduce together in a round, their group (``sync/group.py``).

Every peer of a run must average with the same peers in a round, or their global parameters part
ways. So a group is not negotiated pairwise: one coordinator decides it. The coordinator of round r
is the live, not-leaving peer whose rendezvous score ``sha256(r / peer id)`` is smallest: every peer
whose view of the swarm agrees makes the same choice. The score depends on nothing sent during the
run: seeded by the hash of the round's starting parameters (as it once was), a reducer could try
low-bit variants of its span until that hash made it the next round's coordinator, every round. With
a fixed seed a key wins about one round in n + 1 among n peers, and a key ground to win m chosen
rounds costs about (n + 1)^m keys. A peer whose view lacks the winner is redirected to it; a
redirect must name a better score, so redirects end.

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
short for a catch-up. Neither side polls the DHT for it: a joiner
uses the view it holds (``PeerDirectory.view``: taken since it moved to the round, or that of the group it
follows), the coordinator looks up the records once as the first peer joins and then re-judges on events (a
join, a heartbeat's lookup, a probe, the end of that grace), so the last join closes the group at once (it
looks again only before closing without a peer that its view shows at an earlier round).
A late peer is told so: it applies nothing this round and catches up from the swarm after. A member that
asks again (its answer was lost on a broken stream, and it asks the same coordinator once more before
any other) gets the group it is in. A peer this coordinator has banned (``swarm/bans.py``) is told so
too. Peers whose config, exchange or starting state differ never share a group. A member checks the
group it is given against its own view (every member a known live peer, itself included) and refuses an
implausible one, trying the next coordinator. The coordinator needs no pseudo-gradient of its own: it
serves joins from its event loop while it trains. Only a peer that can be dialled coordinates. The join
request and its answers are ``sync/join.py``.

A peer takes part in one group per round and sync: it notes each coordinator before it asks it
(``sync/whereabouts.py``), and never takes the group of a coordinator it moved on from. Its reducer refuses at
once a contribution for a group of that round another coordinator formed. A member whose group died so (every
other member is elsewhere, or its vote finds no coordinator: ``SwarmCommunicator``) sends the same join again,
once, with the dead group's coordinator listed unreachable (``rejoin``); the next coordinator's formation of the
round waits for it as for any peer whose record claims the round. After a lost vote the rejoin says so, and a
coordinator with no formation of the round open answers it "late" rather than open one for it alone.

A group smaller than the peers that joined or were expected is the coordinator's decision, never an
accident: the answer lists who was left out and why (another state, an incomplete pipeline group, did not
join in time), and every member logs it. A group of one is remembered like any other (its peer may apply
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
group. When the coordinator closes the formation it refuses (``admission.admit``)
members that hold another state of some slice than the majority (they catch up), every stage peer
of a pipeline group that is not complete in the formation (a group acts as one replica or not at all),
and the holders of a slice that no member others can dial holds (it cannot be reduced);
the answer lists which slices each member holds, so that every member cuts each slice among exactly
its holders.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import secrets
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from typing import Any

from hivemind.p2p import P2P

from p2ploco import faults
from p2ploco.errors import Failure, PayloadError, TransportError
from p2ploco.swarm import wire
from p2ploco.swarm.bans import Bans
from p2ploco.swarm.consensus import contested, round_state
from p2ploco.swarm.deadlines import formation_wait
from p2ploco.swarm.directory import PeerDirectory
from p2ploco.swarm.evidence import Signer, group_statement, signed_by
from p2ploco.swarm.messages import MAX_REASON, decode
from p2ploco.swarm.records import PeerRecord, PeerState
from p2ploco.sync.admission import admit
from p2ploco.sync.group import FormationKey, Group, GroupBook, Member
from p2ploco.sync.join import JOIN_FAILURES, JoinAnswer, JoinStatus, group_answer, parse_group, parse_join
from p2ploco.sync.whereabouts import Whereabouts

logger = logging.getLogger(__name__)

MAX_FORMING_PER_PEER = 4  # open formations at one coordinator a peer may be in at once (an overlapped round's next
# one, Streaming DiLoCo's next fragment): more is junk, refused
STRAGGLER_MISSES = 2  # formations a peer was expected in and never joined, after which it is not waited for
BAN_MISSES = 4  # and after which it is banned: its record claims rounds it never joins
KEEP_ASKED_ROUNDS = 8  # rounds for which a coordinator remembers who asked to join (an overlapped peer asks ahead)
KEEP_JOINS = 8  # this peer's latest joins it keeps, to ask again at the next coordinator if their group dies
LEAVE_GRACE = 5.0  # a leaving coordinator still answers the groups it is forming, for at most this long
PROBE_EVERY = 2.0  # seconds between checks that the peers a formation waits for can still be reached
HUB_PATIENCE = 3600.0  # seconds a hub's join waits for a round's first contribution (a round may be long)
NOBODY_ANSWERED = "alone"  # the group id of a group of one that no coordinator formed: none could be asked, or answered


def rendezvous(round_index: int, peer: str) -> bytes:
    """A peer's score for coordinating round ``round_index``; the smallest score wins. It depends on nothing a
    peer sends during the run: seeded by the round's starting state, a reducer could try low-bit variants of its
    span until the next round's hash made it coordinator, every round."""
    return hashlib.sha256(f"{round_index}/{peer}".encode()).digest()


def best_coordinator(candidates: set[str], round_index: int) -> str:
    return min(candidates, key=lambda peer: rendezvous(round_index, peer))



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
    dead: set[str] = field(default_factory=set)  # expected peers the coordinator could not reach while waiting
    joined: float = field(default_factory=time.monotonic)  # when the latest member joined
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    closed: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())

    def contributed(self) -> bool:
        """Whether some member brings a contribution: a formation of hubs alone has nothing to reduce."""
        return any(m.tokens for m in self.members.values())



class Matchmaker:
    def __init__(self, p2p: P2P, directory: PeerDirectory, run_id: str, timeout: float, bans: Bans, stages: int,
                 book: GroupBook, max_tokens: int, signer: Signer, keys: Callable[[str], bytes | None],
                 dial_out: bool = False):
        """``stages``: slices of a pipeline group, all of which it must bring to a round; ``max_tokens``: the most
        tokens a member's contribution may weigh (``Config.max_contribution_tokens``); ``signer``: signs the groups
        this peer forms; ``keys``: a peer's public key as its record names it (None: unknown), which the groups its
        coordinators hand out are checked with; ``dial_out``: this peer cannot be dialled
        (``swarm/reachability.py``): it never coordinates, and reduces no span. ``timeout``: the bound on a
        formation's wait (``swarm.matchmaking_timeout``), which its join waits for at most."""
        self.p2p, self.directory, self.timeout, self.bans = p2p, directory, timeout, bans
        self.run_id, self.signer, self.keys = run_id, signer, keys
        self.stages, self.book, self.max_tokens, self.dial_out = stages, book, max_tokens, dial_out
        self.me = directory.me.peer_id
        self.hub = directory.me.role == "hub"  # it trains nothing: it joins with no tokens (``roles.py``)
        self.handler_name = f"p2ploco/{run_id}/join"
        self._forming: dict[FormationKey, _Formation] = {}
        self._missed: Counter[str] = Counter()  # rounds each peer was waited for in vain here, in a row
        self._missed_round: dict[str, int] = {}  # the last round counted for each: a round counts once
        self._asked: dict[int, set[str]] = {}  # round -> the peers that asked to join some formation of it here
        self._leavers: dict[str, int] = {}  # coordinators that answered they are leaving -> the round they said so
        self.following: Group | None = None  # the group this peer applied its last round with
        self.leaving = asyncio.Event()
        self.whereabouts = Whereabouts()  # the coordinator this peer asks (or holds the group of) for each round
        # (round, name) -> this peer's join of that sync (the request, the group it names as followed, its slices)
        self._joins: dict[tuple[int, str], tuple[dict[str, Any], Group | None, dict[str, tuple[str, str]]]] = {}

    async def start(self) -> None:
        await self.p2p.add_binary_stream_handler(self.handler_name, self._serve_join)

    def candidates(self, exclude: set[str] = frozenset()) -> set[str]:
        """Peers that may coordinate: live peers of this run's config that can be dialled, not leaving, not known
        unreachable."""
        config = self.directory.me.fingerprint
        live = {p for p, r in self.directory.live.items() if r.state != PeerState.LEAVING and r.fingerprint == config
                and not r.dials_out and p not in self.bans.proofs}
        if not self.leaving.is_set() and not self.dial_out:
            live.add(self.me)
        return live - exclude

    def follow(self, group: Group | None, vouched: Iterable[str] = ()) -> None:
        """This peer applied its last round with ``group`` (None: it did not, or alone), and ``vouched`` members
        delivered it a contribution or an aggregate: its view of the swarm (``PeerDirectory.follow``), and the
        base its joins are answered relative to."""
        self.following = group if group is not None and len(group.peers) > 1 else None
        if self.following is None:
            self.directory.follow(())
        else:
            self.directory.follow(self.following.peers, vouched, self.following.coordinator)

    async def withdraw(self) -> None:
        """This peer is leaving: stop joining groups, and finish coordinating what it already started."""
        self.leaving.set()
        forming = [f.closed for f in self._forming.values()]
        if forming:
            await asyncio.wait(forming, timeout=LEAVE_GRACE)

    # ---- the joining side -------------------------------------------------------------------------

    async def form_group(self, round_index: int, name: str, slices: dict[str, tuple[str, str]],
                         pipeline_group: str = "", failures: list[Failure] | None = None,
                         tokens: int = 1) -> Group | None:
        """The group this peer all-reduces with in ``round_index``, given the slices it holds (name -> (exchange
        fingerprint, hash)), the tokens its contribution carries and, for a stage peer, its pipeline group: a group
        of one (``alone``) if no coordinator could be reached or none put anyone else with it (the caller decides
        whether it may commit alone), None if it came too late, is banned, was refused, or is leaving, and must
        apply nothing this round. What went wrong on the way is added to ``failures``."""
        failures = failures if failures is not None else []
        base = self.following  # as named in the request: it may change while the join waits (an overlapped round)
        request = await self._join_request(round_index, name, slices, pipeline_group, tokens, base)
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
            candidates = self.candidates(set(unreachable)) | (hints - set(unreachable) - set(self.bans.proofs))
            if not candidates:
                if not await self._coordinator_may_come(round_index, deadline):
                    break
                continue
            coordinator = best_coordinator(candidates, round_index)
            request["unreachable"] = sorted(unreachable)
            self.whereabouts.join(round_index, name, coordinator)  # before the ask: its group may reach us first
            try:
                await faults.hit_async("matchmaking.join", round_index)
                asking = (self._join_here(self.me, request) if coordinator == self.me
                          else self._ask(coordinator, request, deadline - time.monotonic()))
                response = await (self._unless_passed(round_index, asking) if self.hub else asking)
                answer = decode(JoinAnswer, response)
                status = answer.status
                if status == JoinStatus.GROUP:
                    return await self._accept(parse_group(answer.on(base), round_index, name, coordinator), slices,
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
        if self.leaving.is_set():
            return None
        tried = ", ".join(f"{peer[-8:]} ({why[:100]})" for peer, why in unreachable.items())
        logger.warning(f"round {round_index}: no coordinator answered ({tried or 'none to ask'})")
        return Group(NOBODY_ANSWERED, round_index, name, (self.me,), self.me,
                     holdings=((self.me, tuple(sorted(slices))),),
                     tokens=((self.me, request["tokens"]),))

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
            await asyncio.wait_for(self.leaving.wait(), self.directory.interval)
        return not self.leaving.is_set()

    async def _unless_passed(self, round_index: int, asking: Coroutine[Any, Any, dict[str, Any]]) -> dict[str, Any]:
        """A hub's answer to ``asking``, unless, at a fresh look each heartbeat, most of the run's trainers are at a
        later round first (then "late": the hub waited for a round's first contribution at a formation the trainers
        did not come to, its view of the coordinators being another than theirs, and it catches up rather than wait
        out ``HUB_PATIENCE``; one record at a later round, anyone's to publish, decides nothing), or it starts
        leaving (then "leaving")."""
        def passed(live: dict[str, PeerRecord]) -> bool:
            trainers = [r for p, r in live.items() if r.role != "hub" and r.fingerprint == self.directory.me.fingerprint
                        and self.directory.fresh(p) and r.state != PeerState.LEAVING]
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
        for key, formation in self._forming.items():  # a group formed here later is not one this hub takes part in
            if key[0] == round_index:
                formation.members.pop(self.me, None)
        return {"status": JoinStatus.LATE, "reason": f"the trainers moved past round {round_index} while this hub "
                                                     f"waited for its first contribution"}

    async def _join_request(self, round_index: int, name: str, slices: dict[str, tuple[str, str]],
                            pipeline_group: str, tokens: int, base: Group | None) -> dict[str, Any]:
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
                "slices": {k: list(v) for k, v in sorted(slices.items())}, "pipeline": pipeline_group,
                "unreachable": [], "tokens": self.weight(tokens), "dial_out": self.dial_out,
                "follows": base.digest if base else ""}

    def weight(self, tokens: int) -> int:
        """What a contribution trained on ``tokens`` weighs in this peer's joins: at least 1, and 0 for a hub, which
        sends none (``roles.py``)."""
        return 0 if self.hub else max(1, tokens)

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
        """The other peers that could apply ``round_index`` without this one, so that applying it alone would split this
        peer from them: those whose records, at a fresh look, say they work on that round, a later one or the one before
        (still moving to it: an overlapped peer's record moves on only once its round in flight has a group;
        ``any_round``: at any round, as every trainer of a run that nobody can coordinate is) for our config (fresh, not
        leaving, not waiting for a slot, not banned here), whose daemon can still be dialled (a peer killed a moment ago
        still has a fresh record) and that did not answer this round that it is leaving, less the stage peers whose
        pipeline group has no such peer for some stage (a group acts as one replica or not at all), and less the peers
        that sit rounds out (``budget.py``: one whose short step of a round it sat out is over shows a later round, yet
        applied none; one that contributes a step's work does so in a group, whose other members count), and less the
        hubs (they train nothing: without a contribution they apply no round). Those further behind follow this peer's
        state once they reach it."""
        live = await self.directory.refresh()
        banned = self.bans.active(round_index)
        since = 0 if any_round else round_index - 1
        ahead = sorted(p for p, r in live.items() if p != self.me and r.round >= since
                       and r.fingerprint == self.directory.me.fingerprint and self.directory.fresh(p)
                       and not r.sits_out and r.role != "hub"
                       and r.state not in (PeerState.LEAVING, PeerState.STANDBY, PeerState.SERVING)
                       and p not in banned and self._leavers.get(p, -1) < round_index)
        # A peer behind a NAT cannot be dialled: its fresh record is all there is to go by.
        dialled = await asyncio.gather(*(wire.reachable(self.p2p, p, self.handler_name, PROBE_EVERY)
                                         for p in ahead if not live[p].dials_out))
        reached = iter(dialled)
        alive = [p for p in ahead if live[p].dials_out or next(reached)]
        stages: dict[str, set[int]] = {}
        for p in alive:
            if live[p].group:
                stages.setdefault(live[p].group, set()).add(live[p].stage)
        return [p for p in alive if not live[p].group or len(stages[live[p].group]) >= self.stages]

    async def stranded_with(self, round_index: int) -> list[str]:
        """The run's other live trainers (at any round: ``working_on``), if every one of them dials out: then none of
        them can coordinate, and none applies a round that this peer, which reached no coordinator, could catch up
        to; [] where one of them can be dialled, or none lives."""
        others = await self.working_on(round_index, any_round=True)
        live = self.directory.live
        return others if all(p in live and live[p].dials_out for p in others) else []

    async def _check_plausible(self, group: Group) -> None:
        """PayloadError unless every member of ``group`` is a live peer this peer knows, itself included. A
        member this view lacks (a joiner) is looked up, and may have published its record a moment ago: one more
        look before refusing."""
        if self.me not in group.peers:
            raise PayloadError("group without this peer")
        known = set(self.directory.live)
        if not set(group.peers) <= known:
            known = set(await self.directory.refresh())
        if not set(group.peers) <= known:
            await asyncio.sleep(self.directory.interval)
            known = set(await self.directory.refresh())
        unknown = set(group.peers) - known
        if unknown:
            raise PayloadError(f"group of {len(group.peers)} names {len(unknown)} peer(s) this peer does not know")
        # Only a hub contributes nothing: a coordinator that gave trainers no weight would make the group's aggregate
        # its own contribution alone
        live = self.directory.live
        weightless = {p for p, t in group.tokens if t == 0 and (p not in live or live[p].role != "hub")}
        if weightless:
            raise PayloadError(f"group that gives {len(weightless)} member(s) that are no hub no weight")

    async def _ask(self, coordinator: str, request: dict[str, Any], timeout: float) -> dict[str, Any]:
        """One join request. A stream that breaks is asked again: the coordinator may hold our join all the same, and
        answers a second ask with the group it formed (a next coordinator would form a group the others are not in).
        Not abandoned if this peer starts leaving meanwhile: the coordinator may hold its join already, and the group
        it closes with it would wait for a contribution that never came (a Ctrl-C then cost the others their round).
        The peer finishes the all-reduce it joined, then leaves."""
        response, _ = await asyncio.wait_for(
            wire.call(self.p2p, coordinator, self.handler_name, request, attempts=2), timeout)
        return response

    # ---- the coordinating side --------------------------------------------------------------------

    async def _serve_join(self, stream_info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sender = str(stream_info.peer_id)
        # a join that broke off is asked again: worth a debug line only
        async with wire.serving(logger, "join request", sender, reader, writer, self.timeout, logging.DEBUG):
            request, _ = await asyncio.wait_for(wire.read_message(reader, max_payload=0), self.timeout)
            response = await self._join_here(sender, request)
            await wire.write_message(writer, response)

    async def _join_here(self, sender: str, request: dict[str, Any]) -> dict[str, Any]:
        key, unreachable, member = parse_join(request)
        round_index = key[0]
        if self.bans.banned(sender, round_index):
            return {"status": JoinStatus.BANNED, "reason": f"coordinator {self.me[-8:]} has banned this peer for what "
                                                           f"it sent (its log says what)"}
        if member.tokens > self.max_tokens:  # no honest peer claims more: its weight is capped as it contributes
            return {"status": JoinStatus.LEFT_OUT, "reason": f"this peer claims {member.tokens} tokens, more than a "
                                                             f"contribution may weigh ({self.max_tokens})"}
        self._missed.pop(sender, None)  # it asks: late perhaps, but no straggler
        self._missed_round.pop(sender, None)
        # Kept around this peer's own round, never the sender's: a join for a made-up far round must neither grow
        # the memory nor push out who asked for the rounds under way.
        own = self.directory.me.round
        if abs(round_index - own) <= KEEP_ASKED_ROUNDS:
            self._asked.setdefault(round_index, set()).add(sender)
        for old in [r for r in self._asked if r < own - KEEP_ASKED_ROUNDS]:
            del self._asked[old]
        refusal = None if sender == self.me else await self._refusal(sender, key)
        if refusal is not None:
            return {"status": JoinStatus.LEFT_OUT, "reason": refusal}
        formation = self._forming.get(key)
        if formation is None and sender != self.me:  # an open formation is finished even while leaving
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

    def formation_wait(self, round_index: int) -> float:
        """How long a formation of ``round_index`` waits after its first contribution (``deadlines.formation_wait``):
        by the step times the records of this run's peers at that round or the one before publish (neither a banned
        peer's nor one that sits rounds out: nobody waits for it), and this peer's own last round."""
        me, banned = self.directory.me, self.bans.active(round_index)
        peers = [r for p, r in self.directory.live.items()
                 if p != self.me and r.fingerprint == me.fingerprint and r.round in (round_index - 1, round_index)
                 and not r.sits_out and p not in banned]
        return formation_wait(self.timeout, self.directory.interval, me.round_seconds,
                              [r.step_seconds for r in peers if r.role != "hub"], [r.round_seconds for r in peers])

    async def _refusal(self, sender: str, key: FormationKey) -> str | None:
        """Why a join from ``sender`` for ``key`` is refused, if it is: a peer joins only rounds of this run's config,
        with a live record of it (anyone can open a stream; only peers of the run form groups), and only a few at
        once. An unknown sender is looked up afresh, at most once a heartbeat: its record may be a moment old."""
        if key[2] != self.directory.me.fingerprint:
            return f"coordinator {self.me[-8:]} trains another config"
        stale = time.monotonic() - self.directory.refreshed_at > self.directory.interval
        if not self.directory.of_run(sender) and stale:
            await self.directory.refresh()
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
                if not formation.awaited and formation.contributed():
                    # A peer of this run still at an earlier round in this view may have moved to this one since
                    # the view was taken: before closing without it, one fresh look (none when all are in).
                    behind = {p for p in runs_here if live[p].round < round_index} - set(formation.members) \
                        - formation.dead
                    if behind and self.directory.refreshed_at < formation.joined:
                        await self.directory.refresh()
                        continue
                    break
                if time.monotonic() >= probed + PROBE_EVERY:  # a peer killed in its inner steps is not waited for
                    probed = time.monotonic()
                    probes = sorted(p for p in formation.awaited - {self.me} if not live[p].dials_out)
                    alive = await asyncio.gather(*(wire.reachable(self.p2p, p, self.handler_name, PROBE_EVERY)
                                                   for p in probes))
                    formation.dead.update(p for p, ok in zip(probes, alive) if not ok)
                # Woken by a join, a heartbeat's lookup, the next probe or the deadline: no polling of the DHT.
                wake = min(probed + PROBE_EVERY, formation.deadline)
                try:
                    await asyncio.wait_for(formation.changed.wait(), max(0.0, wake - time.monotonic()))
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
                     and r.state not in (PeerState.LEAVING, PeerState.STANDBY)
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
        formation.awaited = (expected | moving) - formation.dead - set(formation.members)
        formation.waited_for |= formation.awaited | (claim - expected)  # a straggler still misses this round
        return chosen, runs_here

    def _close(self, formation: _Formation, chosen: dict[str, str]) -> None:
        """Close the formation: admit its members (``admission.admit``), name whom it left out and why, and answer
        every joiner the group."""
        round_index, name = formation.key[0], formation.key[1]
        members, formation.refused = admit(formation.members, self.stages, chosen)
        left_out = dict(formation.refused)
        left_out.update((p, f"it did not join within {formation.wait:.0f} s") for p in formation.awaited)
        left_out.update((p, "it could not be reached") for p in formation.dead - set(members))
        self._count_misses(formation, round_index)
        if left_out:  # every member logs it at WARNING, with the coordinator's name
            logger.info(f"round {round_index}: formed a group of {len(members)} without "
                        + ", ".join(f"{p[-8:]} ({why})" for p, why in sorted(left_out.items())))
        peers = sorted(members)
        group = Group(secrets.token_hex(8), round_index, name, tuple(peers), self.me,
                      holdings=tuple((p, tuple(sorted(dict(members[p].slices)))) for p in peers),
                      pipeline_groups=tuple((p, members[p].pipeline_group) for p in peers
                                            if members[p].pipeline_group),
                      left_out=tuple(sorted((p, why[:MAX_REASON]) for p, why in left_out.items())),
                      tokens=tuple((p, members[p].tokens) for p in peers),
                      dial_out=tuple(p for p in peers if members[p].dial_out))
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
        for peer in formation.waited_for - formation.dead - set(formation.members) - asked - {self.me}:
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

