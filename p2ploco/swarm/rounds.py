"""Which peers all-reduce together in a round.

Every peer of a run must average with the same peers in a round, or their global parameters part
ways. So a group is not negotiated pairwise: one coordinator decides it. The coordinator is the
live, not-leaving peer with the smallest id (the same choice on every peer whose view of the swarm
agrees; a peer whose view lacks a smaller id is redirected to it). A peer that is ready for round r
sends the coordinator a join request and waits; the coordinator closes the group when every live
peer that works on round r from the same state with the same config has joined, or
``matchmaking_timeout`` after the first join, and answers every waiting peer with the same ordered
list. A late peer is told so: it applies nothing this round and catches up from the swarm after.
Peers whose config, exchange or starting state differ never share a group. The coordinator needs
no Δ of its own: it serves joins from its event loop while it trains.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from hivemind.p2p import P2P

from p2ploco.errors import PayloadError
from p2ploco.swarm import wire
from p2ploco.swarm.records import PeerDirectory

logger = logging.getLogger(__name__)

KEEP_CLOSED_ROUNDS = 8  # closed groups remembered, to answer stragglers "late" rather than start a new group
LEAVE_GRACE = 5.0  # a leaving coordinator still answers the groups it is forming, for at most this long


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
    members: set[str] = field(default_factory=set)
    unreachable: set[str] = field(default_factory=set)  # peers the members could not reach
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    closed: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class Matchmaker:
    def __init__(self, p2p: P2P, directory: PeerDirectory, run_id: str, timeout: float):
        self.p2p, self.directory, self.timeout = p2p, directory, timeout
        self.me = directory.me.peer_id
        self.handler_name = f"p2ploco/{run_id}/join"
        self._forming: dict[FormationKey, _Formation] = {}
        self._closed: dict[FormationKey, Group] = {}
        self.leaving = asyncio.Event()

    async def start(self) -> None:
        await self.p2p.add_binary_stream_handler(self.handler_name, self._serve_join)

    def candidates(self, exclude: set[str] = frozenset()) -> set[str]:
        """Peers that may coordinate: live, not leaving, not known unreachable."""
        live = {p for p, r in self.directory.live.items() if r.state != "leaving"}
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
        if it came too late (or is leaving) and must apply nothing this round."""
        me = self.directory.me
        request = {"round": round_index, "name": name, "config": me.fingerprint, "exchange": exchange_fingerprint,
                   "state": me.params_sha256, "unreachable": []}
        deadline = time.monotonic() + self.timeout + 5.0  # the coordinator may wait `timeout` for others
        unreachable: set[str] = set()
        hints: set[str] = set()
        await self.directory.refresh()  # a fresh view: peers that just joined may hold a smaller id
        while time.monotonic() < deadline and not self.leaving.is_set():
            candidates = self.candidates(unreachable) | (hints - unreachable)
            if not candidates:
                break
            coordinator = min(candidates)
            request["unreachable"] = sorted(unreachable)
            try:
                if coordinator == self.me:
                    response = await self._join_here(self.me, request)
                else:
                    response = await self._ask(coordinator, request, deadline - time.monotonic())
            except Exception as e:  # timeouts, bad replies, and the daemon's several "cannot dial" errors
                logger.info(f"coordinator {coordinator[-8:]} unreachable ({e!r}); trying the next one")
                unreachable.add(coordinator)
                continue
            status = response.get("status")
            if status == "group":
                group = _parse_group(response, round_index, name, coordinator)
                if group is not None and self.me in group.peers:
                    return group
                logger.warning(f"coordinator {coordinator[-8:]} sent a malformed group; ignoring it")
                unreachable.add(coordinator)
            elif status == "redirect" and isinstance(response.get("to"), str) and response["to"] < coordinator:
                hints.add(response["to"])
            elif status == "late":
                logger.warning(f"round {round_index}: {response.get('reason', status)}; this peer applies nothing "
                               f"this round and catches up")
                return None
            else:
                unreachable.add(coordinator)
        if self.leaving.is_set():
            return None
        return Group("alone", round_index, name, (self.me,), self.me)

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
            return {"status": "withdrawn"}
        return asked.result()[0]

    # ---- the coordinating side --------------------------------------------------------------------

    async def _serve_join(self, stream_info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sender = str(stream_info.peer_id)
        try:
            request, _ = await asyncio.wait_for(wire.read_message(reader, max_payload=0), self.timeout)
            response = await self._join_here(sender, request)
            await wire.write_message(writer, response)
        except (TimeoutError, PayloadError) as e:
            logger.info(f"bad join request from {sender[-8:]}: {e}")
        except (OSError, ConnectionError):
            pass  # the joiner went away; it will retry elsewhere
        except Exception as e:  # whatever a peer sends, the node keeps serving
            logger.warning(f"join request from {sender[-8:]} failed: {e!r}")
        finally:
            writer.close()

    async def _join_here(self, sender: str, request: dict[str, Any]) -> dict[str, Any]:
        key = (wire.field(request, "round", int), wire.field(request, "name", str),
               wire.field(request, "config", str), wire.field(request, "exchange", str),
               wire.field(request, "state", str))
        listed = request.get("unreachable")
        unreachable = {p for p in listed if isinstance(p, str)} if isinstance(listed, list) else set()
        formation = self._forming.get(key)
        if formation is None and sender != self.me:  # an open formation is finished even while leaving
            if self.leaving.is_set():
                return {"status": "leaving"}
            lowest = min(self.candidates(unreachable | {sender}))
            if lowest != self.me:
                return {"status": "redirect", "to": lowest}
        if key in self._closed:
            return {"status": "late", "reason": f"round {key[0]} had already started without this peer"}
        if formation is None:
            formation = _Formation(key, time.monotonic() + self.timeout)
            self._forming[key] = formation
            asyncio.get_running_loop().create_task(self._close_when_complete(formation))
        formation.members.add(sender)
        formation.unreachable |= unreachable
        formation.changed.set()
        outcome: Group | str = await asyncio.shield(formation.closed)
        if isinstance(outcome, str):
            return {"status": "redirect", "to": outcome}
        return {"status": "group", "group_id": outcome.group_id, "peers": list(outcome.peers)}

    async def _close_when_complete(self, formation: _Formation) -> None:
        """Close the group when everyone expected has joined or at the deadline; or hand the whole
        formation over to a peer with a smaller id that has come into view (every member retries there)."""
        round_index, name, config, _, state = key = formation.key
        try:
            while time.monotonic() < formation.deadline:
                live = await self.directory.refresh()
                lowest = min(self.candidates(formation.unreachable), default=self.me)
                if lowest < self.me:
                    del self._forming[key]
                    formation.closed.set_result(lowest)
                    return
                # Peers working on this round from this state, and peers just starting at it: a swarm
                # started together should not split because one peer published its record a moment late.
                expected = {p for p, r in live.items() if r.round == round_index and r.fingerprint == config
                            and r.params_sha256 == state and r.state != "leaving"}
                if expected <= formation.members:
                    break
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


def _parse_group(response: dict[str, Any], round_index: int, name: str, coordinator: str) -> Group | None:
    peers, group_id = response.get("peers"), response.get("group_id")
    if (isinstance(peers, list) and peers and all(isinstance(p, str) for p in peers)
            and peers == sorted(set(peers)) and isinstance(group_id, str)):
        return Group(group_id, round_index, name, tuple(peers), coordinator)
    return None
