"""Which peers all-reduce together in a round.

Every peer of a run must average with the same peers in a round, or their global parameters part
ways. So a group is not negotiated pairwise: one coordinator decides it. The coordinator of the
round r that starts from state s is the live, not-leaving peer whose rendezvous score
``sha256(r / s / peer id)`` is smallest: every peer whose view of the swarm agrees makes the same
choice, and no peer can make itself coordinator by grinding keys, since s (the hash of the round's
starting parameters) is known only once the previous round has ended. A peer whose view lacks the
winner is redirected to it; a redirect must name a better score, so redirects end.

A peer that is ready for round r sends the coordinator a join request and waits; the coordinator
closes the group when every live peer that works on round r from the same state with the same config
(and still renews its record and can be dialled: a crashed peer is not waited for) has joined, or
``matchmaking_timeout`` after the first join, and answers every waiting peer with the same ordered
list. A late peer is told so: it applies nothing this round and catches up from the swarm after. A
peer this coordinator has banned (``swarm/bans.py``) is told so too. Peers whose config, exchange or
starting state differ never share a group. A member checks the group it is given against its own
view (every member a known live peer, itself included) and refuses an implausible one, trying the
next coordinator. The coordinator needs no pseudo-gradient of its own: it serves joins from its event
loop while it trains.

A join request, a wire message (``swarm/wire.py``) with no payload::

    {v, round, name, config, exchange, state, unreachable: [peer ids the joiner could not reach]}

answered ``{v, status: group, group_id, peers}``, ``{v, status: redirect, to}``, or
``{v, status: late|banned|leaving, reason}``.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from hivemind.p2p import P2P

from p2ploco.errors import PayloadError
from p2ploco.swarm import wire
from p2ploco.swarm.bans import Bans
from p2ploco.swarm.records import PeerDirectory, PeerState

logger = logging.getLogger(__name__)

KEEP_CLOSED_ROUNDS = 8  # closed groups remembered, to answer stragglers "late" rather than start a new group
LEAVE_GRACE = 5.0  # a leaving coordinator still answers the groups it is forming, for at most this long
JOINER_GRACE = 1 / 3  # share of the matchmaking timeout a formation waits for peers that are still joining
PROBE_EVERY = 2.0  # seconds between checks that the peers a formation waits for can still be reached


class JoinStatus(enum.StrEnum):
    GROUP = "group"  # the group formed: all-reduce with these peers
    REDIRECT = "redirect"  # another peer coordinates this round
    LATE = "late"  # the round started without the joiner: it applies nothing and catches up
    BANNED = "banned"  # the coordinator caught the joiner sending malformed data; it sits this round out
    LEAVING = "leaving"  # the coordinator is leaving and forms no new group


def rendezvous(round_index: int, state: str, peer: str) -> bytes:
    """A peer's score for coordinating the round that starts from ``state``; the smallest score wins."""
    return hashlib.sha256(f"{round_index}/{state}/{peer}".encode()).digest()


def best_coordinator(candidates: set[str], round_index: int, state: str) -> str:
    return min(candidates, key=lambda peer: rendezvous(round_index, state, peer))


@dataclass(frozen=True)
class Group:
    group_id: str
    round_index: int
    name: str
    peers: tuple[str, ...]  # canonical order: sorted peer ids; peer i reduces span i
    coordinator: str  # who formed the group; it also decides the round's outcome
    attempt: int = 0  # 1 for the redo of a failed all-reduce among its survivors


# round, all-reduce name, config fingerprint, exchange fingerprint, hash of the state the round starts from
FormationKey = tuple[int, str, str, str, str]


@dataclass
class _Formation:
    key: FormationKey
    deadline: float
    opened: float = field(default_factory=time.monotonic)
    members: set[str] = field(default_factory=set)
    unreachable: set[str] = field(default_factory=set)  # peers the members could not reach
    dead: set[str] = field(default_factory=set)  # expected peers the coordinator could not reach while waiting
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    closed: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class Matchmaker:
    def __init__(self, p2p: P2P, directory: PeerDirectory, run_id: str, timeout: float, bans: Bans):
        self.p2p, self.directory, self.timeout, self.bans = p2p, directory, timeout, bans
        self.me = directory.me.peer_id
        self.handler_name = f"p2ploco/{run_id}/join"
        self._forming: dict[FormationKey, _Formation] = {}
        self._closed: dict[FormationKey, Group] = {}
        self.leaving = asyncio.Event()

    async def start(self) -> None:
        await self.p2p.add_binary_stream_handler(self.handler_name, self._serve_join)

    def candidates(self, exclude: set[str] = frozenset()) -> set[str]:
        """Peers that may coordinate: live, not leaving, not known unreachable."""
        live = {p for p, r in self.directory.live.items() if r.state != PeerState.LEAVING}
        if not self.leaving.is_set():
            live.add(self.me)
        return live - exclude

    async def withdraw(self) -> None:
        """This peer is leaving: stop joining groups, and finish coordinating what it already started."""
        self.leaving.set()
        forming = [f.closed for f in self._forming.values()]
        if forming:
            await asyncio.wait(forming, timeout=LEAVE_GRACE)

    # ---- the joining side -------------------------------------------------------------------------

    async def form_group(self, round_index: int, name: str, exchange_fingerprint: str) -> Group | None:
        """The group this peer all-reduces with in ``round_index``: a group of one if it is alone, None
        if it came too late, is banned, or is leaving, and must apply nothing this round."""
        me = self.directory.me
        state = me.params_sha256
        request = {"round": round_index, "name": name, "config": me.fingerprint, "exchange": exchange_fingerprint,
                   "state": state, "unreachable": []}
        deadline = time.monotonic() + self.timeout + 5.0  # the coordinator may wait `timeout` for others
        unreachable: set[str] = set()
        hints: set[str] = set()
        await self.directory.refresh()  # a fresh view: peers that just joined may score better
        while time.monotonic() < deadline and not self.leaving.is_set():
            candidates = self.candidates(unreachable) | (hints - unreachable)
            if not candidates:
                break
            coordinator = best_coordinator(candidates, round_index, state)
            request["unreachable"] = sorted(unreachable)
            try:
                if coordinator == self.me:
                    response = await self._join_here(self.me, request)
                else:
                    response = await self._ask(coordinator, request, deadline - time.monotonic())
                status = wire.status(response, JoinStatus)
                if status == JoinStatus.GROUP:
                    group = parse_group(response, round_index, name, coordinator)
                    await self._check_plausible(group)
                    return group
                if status == JoinStatus.REDIRECT:
                    to = wire.field(response, "to", str)
                    if rendezvous(round_index, state, to) >= rendezvous(round_index, state, coordinator):
                        raise PayloadError(f"redirect to {to[-8:]}, which does not score better")
                    hints.add(to)
                elif status in (JoinStatus.LATE, JoinStatus.BANNED):
                    logger.warning(f"round {round_index}: {response.get('reason', status)}; this peer applies "
                                   f"nothing this round and catches up")
                    return None
                else:
                    unreachable.add(coordinator)
            except (TimeoutError, PayloadError, *wire.TRANSPORT_ERRORS) as e:
                logger.info(f"coordinator {coordinator[-8:]} unreachable or implausible ({e!r}); trying the next one")
                unreachable.add(coordinator)
        if self.leaving.is_set():
            return None
        return Group("alone", round_index, name, (self.me,), self.me)

    async def _check_plausible(self, group: Group) -> None:
        """PayloadError unless every member of ``group`` is a live peer this peer knows, itself included. A
        member may have published its record a moment ago: one more look before refusing."""
        if self.me not in group.peers:
            raise PayloadError("group without this peer")
        for attempt in range(2):
            unknown = set(group.peers) - set(await self.directory.refresh())
            if not unknown:
                return
            if attempt == 0:
                await asyncio.sleep(self.directory.interval)
        raise PayloadError(f"group of {len(group.peers)} names {len(unknown)} peer(s) this peer does not know")

    async def _ask(self, coordinator: str, request: dict[str, Any], timeout: float) -> dict[str, Any]:
        """One join request, abandoned at once if this peer starts leaving."""
        asked = asyncio.ensure_future(asyncio.wait_for(wire.call(self.p2p, coordinator, self.handler_name, request),
                                                       timeout))
        leaving = asyncio.ensure_future(self.leaving.wait())
        try:
            await asyncio.wait({asked, leaving}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            leaving.cancel()
        if not asked.done():
            asked.cancel()
            return {"status": JoinStatus.LEAVING}
        return asked.result()[0]

    # ---- the coordinating side --------------------------------------------------------------------

    async def _serve_join(self, stream_info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sender = str(stream_info.peer_id)
        try:
            request, _ = await asyncio.wait_for(wire.read_message(reader, max_payload=0), self.timeout)
            response = await self._join_here(sender, request)
            await wire.write_message(writer, response)
        except PayloadError as e:
            logger.info(f"bad join request from {sender[-8:]}: {e}")
        except wire.TRANSPORT_ERRORS as e:  # the joiner went away (or never finished asking); it retries elsewhere
            logger.debug(f"join request from {sender[-8:]} broke off: {e!r}")
        except Exception:  # a bug: keep serving joins, and say where it is
            logger.exception(f"join request from {sender[-8:]} failed unexpectedly")
        finally:
            writer.close()

    async def _join_here(self, sender: str, request: dict[str, Any]) -> dict[str, Any]:
        key, unreachable = parse_join(request)
        round_index, state = key[0], key[4]
        if self.bans.banned(sender, round_index):
            return {"status": JoinStatus.BANNED, "reason": f"coordinator {self.me[-8:]} has banned this peer for "
                                                           f"sending malformed data"}
        formation = self._forming.get(key)
        if formation is None and sender != self.me:  # an open formation is finished even while leaving
            if self.leaving.is_set():
                return {"status": JoinStatus.LEAVING, "reason": "the coordinator is leaving"}
            best = best_coordinator(self.candidates(unreachable | {sender}), round_index, state)
            if best != self.me:
                return {"status": JoinStatus.REDIRECT, "to": best}
        if key in self._closed:
            return {"status": JoinStatus.LATE, "reason": f"round {round_index} had already started without this peer"}
        if formation is None:
            formation = _Formation(key, time.monotonic() + self.timeout)
            self._forming[key] = formation
            asyncio.get_running_loop().create_task(self._close_when_complete(formation))
        formation.members.add(sender)
        formation.unreachable |= unreachable
        formation.changed.set()
        outcome: Group | str = await asyncio.shield(formation.closed)
        if isinstance(outcome, str):
            return {"status": JoinStatus.REDIRECT, "to": outcome}
        return {"status": JoinStatus.GROUP, "group_id": outcome.group_id, "peers": list(outcome.peers)}

    async def _close_when_complete(self, formation: _Formation) -> None:
        """Close the group when everyone expected has joined or at the deadline; or hand the whole
        formation over to a better-scored peer that has come into view (every member retries there)."""
        round_index, name, config, _, state = key = formation.key
        probed = time.monotonic()
        try:
            while time.monotonic() < formation.deadline:
                live = await self.directory.refresh()
                best = best_coordinator(self.candidates(formation.unreachable) | {self.me}, round_index, state)
                if best != self.me:
                    del self._forming[key]
                    formation.closed.set_result(best)
                    return
                # Peers working on this round from this state: a swarm started together should not split
                # because one peer published its record a moment late. Peers still joining at it (catching
                # up, or just restarted from a checkpoint of it) only for the first third of the wait: a
                # restarting process may take longer than a round. Not a peer that stopped renewing its
                # record (it crashed), nor one banned here.
                banned = self.bans.active(round_index)
                joiners_welcome = time.monotonic() < formation.opened + JOINER_GRACE * self.timeout
                expected = {p for p, r in live.items() if r.round == round_index and r.fingerprint == config
                            and r.params_sha256 == state and r.state != PeerState.LEAVING
                            and (r.state != PeerState.JOINING or joiners_welcome)
                            and self.directory.fresh(p) and p not in banned}
                if expected - formation.dead <= formation.members:
                    break
                if time.monotonic() >= probed + PROBE_EVERY:  # a peer killed in its inner steps is not waited for
                    probed = time.monotonic()
                    awaited = sorted(expected - formation.members - formation.dead - {self.me})
                    alive = await asyncio.gather(*(wire.reachable(self.p2p, p, self.handler_name, PROBE_EVERY)
                                                   for p in awaited))
                    formation.dead.update(p for p, ok in zip(awaited, alive) if not ok)
                formation.changed.clear()
                try:
                    await asyncio.wait_for(formation.changed.wait(), min(0.5, formation.deadline - time.monotonic()))
                except TimeoutError:
                    pass
        finally:
            if not formation.closed.done():
                group = Group(secrets.token_hex(8), round_index, name, tuple(sorted(formation.members)), self.me)
                self._closed[key] = group
                del self._forming[key]
                for old in sorted(self._closed)[:-KEEP_CLOSED_ROUNDS]:
                    del self._closed[old]
                formation.closed.set_result(group)


def parse_join(request: dict[str, Any]) -> tuple[FormationKey, set[str]]:
    """A join request's formation key and the peers the joiner could not reach; PayloadError if malformed."""
    round_index = wire.field(request, "round", int)
    if round_index < 0:
        raise PayloadError("join request for a negative round")
    key = (round_index, wire.field(request, "name", str), wire.field(request, "config", str),
           wire.field(request, "exchange", str), wire.field(request, "state", str))
    return key, set(wire.peer_ids(request, "unreachable"))


def parse_group(response: dict[str, Any], round_index: int, name: str, coordinator: str) -> Group:
    """The group in a coordinator's answer; PayloadError if malformed."""
    peers = wire.peer_ids(response, "peers")
    if not peers:
        raise PayloadError("empty group")
    return Group(wire.field(response, "group_id", str), round_index, name, tuple(peers), coordinator)
