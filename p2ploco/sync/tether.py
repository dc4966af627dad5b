"""Tethers: how a coordinator learns at once that a peer behind a NAT has crashed.

Nobody can dial a peer behind a NAT, so no probe tells whether it still runs (``liveness.py``); its record, no longer
renewed, did, after ``PeerDirectory.fresh``'s three heartbeats. A formation waited that long for such a peer that had
crashed in its inner steps, and a ballot for its vote: 30 s a round at a heartbeat of 10 s, which a swarm of
thousands needs (``benchmarks/simulate.py``, docs/design.md "Scale").

So such a peer holds a stream open (a tether) to the coordinator of the round it trains, and of the one before
while that round's sync may still run (an overlapped schedule's), from the round's start. A process that dies takes
its streams with it; the coordinator counts a tether that ended without a release, and was not tied again within
``RETIE_GRACE``, as a peer gone (``Tethers.cut``): its formation and ballot wait for it no more. A tether only ever
speaks for its own peer (the stream is its key's), so the worst a peer does with one is leave its own round early.
A peer whose tether broke on a live link ties it again at once; one that moves on to another coordinator releases
the old tether first. Where no tether was tied (a coordinator the peer did not foresee), the record rules as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from hivemind.p2p import P2P

from p2ploco.aio import in_time
from p2ploco.errors import PayloadError, TransportError
from p2ploco.swarm import wire
from p2ploco.swarm.directory import PeerDirectory
from p2ploco.swarm.messages import Message, decode, status_of
from p2ploco.sync.join import best_coordinator

logger = logging.getLogger(__name__)

RETIE_GRACE = wire.PROBE_EVERY  # seconds a peer whose tether broke has to tie it again before it counts as gone
KEEP_CUT = 600.0  # seconds a coordinator remembers a tether that broke
BROKE = "its tether broke"  # how a peer cut so is known gone, in a formation's and a ballot's lines


class TetherKind(enum.StrEnum):
    TIE = "tie"  # the first message on a tether: hold it
    RELEASE = "release"  # the last: this peer moved on, it is not gone


class TetherMessage(Message):
    kind: status_of(TetherKind)


def tether_handler(run_id: str) -> str:
    """The protocol a run's coordinators hold tethers on."""
    return f"p2ploco/{run_id}/tether"


class Tethers:
    """A coordinator's side: the tethers the peers behind NATs hold to it, and which of them broke."""

    def __init__(self, p2p: P2P, run_id: str, directory: PeerDirectory, timeout: float):
        """``directory``: whose records say which peers are of this run; ``timeout``: the bound on a tether's first
        message."""
        self.p2p, self.directory, self.timeout = p2p, directory, timeout
        self.handler_name = tether_handler(run_id)
        self._held: dict[str, asyncio.StreamWriter] = {}  # peer -> the writer of the tether it holds here
        self._broke: dict[str, float] = {}  # peer -> when its last tether here ended without a release

    async def start(self) -> None:
        await self.p2p.add_binary_stream_handler(self.handler_name, self._serve)

    def cut(self, peers: set[str]) -> set[str]:
        """Of ``peers``, those whose tether here broke more than RETIE_GRACE ago and was not tied again: gone."""
        now = time.monotonic()
        return {p for p in peers if p not in self._held and now - self._broke.get(p, now) >= RETIE_GRACE}

    async def _serve(self, stream_info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = str(stream_info.peer_id)
        async with wire.serving(logger, "tether", peer, reader, writer, self.timeout, logging.DEBUG):
            header, _ = await in_time(wire.read_message(reader, max_payload=0), self.timeout)
            if decode(TetherMessage, header).kind != TetherKind.TIE:
                raise PayloadError("a tether that does not begin with a tie")
            if not self.directory.of_run(peer):
                await self.directory.look_up([peer])  # a record a moment old; anyone can open a stream
            if self.directory.of_run(peer):
                await self._hold(peer, reader, writer)
            else:  # hung up: it ties again next heartbeat
                logger.debug(f"no tether for {peer[-8:]}: no live record of this run's config")

    async def _hold(self, peer: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Hold ``peer``'s tether until it ends: one tether a peer (a new one replaces the one before, which is
        closed), and a break is noted unless the tether was released or replaced."""
        before = self._held.get(peer)
        if before is not None:
            before.close()
        self._held[peer], released = writer, False
        self._broke.pop(peer, None)
        try:
            header, _ = await wire.read_message(reader, max_payload=0)  # unbounded: the tether's whole life
            released = decode(TetherMessage, header).kind == TetherKind.RELEASE
        finally:
            if self._held.get(peer) is writer:
                del self._held[peer]
                if not released:
                    now = time.monotonic()
                    self._broke = {p: t for p, t in self._broke.items() if now - t < KEEP_CUT}
                    self._broke[peer] = now


class Tether:
    """A peer behind a NAT: its tethers to the coordinators of the rounds it is in (module docstring)."""

    def __init__(self, p2p: P2P, run_id: str, directory: PeerDirectory, candidates: Callable[[], set[str]]):
        """``candidates``: the peers that may coordinate, as this peer's joins choose among them
        (``Coordinator.candidates``)."""
        self.p2p, self.directory, self.candidates = p2p, directory, candidates
        self.handler_name = tether_handler(run_id)
        self._held: dict[str, asyncio.StreamWriter] = {}  # coordinator -> the writer of this peer's tether to it
        self._broke = asyncio.Event()  # a tether broke: tie it again now, not a heartbeat later
        self._tasks: set[asyncio.Task] = set()  # the loop holds only weak references to tasks

    def start(self) -> None:
        self._run(self._keep())

    def _run(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def targets(self) -> set[str]:
        """The coordinators of the round this peer's record is at and of the one before, by its view."""
        candidates, round_index = self.candidates(), self.directory.me.round
        if not candidates:
            return set()
        return {best_coordinator(candidates, r) for r in (round_index - 1, round_index) if r >= 0}

    async def _keep(self) -> None:
        """Each heartbeat, and at once after a break: release the tethers to coordinators this peer moved on from,
        tie those it lacks."""
        while True:
            with contextlib.suppress(TimeoutError):  # the first time: this peer's record is out then
                await in_time(self._broke.wait(), self.directory.interval)
            self._broke.clear()
            targets = self.targets()
            for coordinator in set(self._held) - targets:
                await self._release(coordinator)
            await asyncio.gather(*(self._tie(c) for c in targets - set(self._held)))

    async def _tie(self, coordinator: str) -> None:
        try:
            reader, writer = await in_time(wire.open_stream(self.p2p, coordinator, self.handler_name),
                                           self.directory.interval)
            await in_time(wire.write_message(writer, {"kind": TetherKind.TIE.value}), self.directory.interval)
        except (TimeoutError, PayloadError, TransportError) as e:  # tried again next heartbeat
            logger.debug(f"no tether to coordinator {coordinator[-8:]}: {e!r}")
            return
        self._held[coordinator] = writer
        self._run(self._watch(coordinator, reader, writer, time.monotonic()))

    async def _watch(self, coordinator: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     tied_at: float) -> None:
        """Until the tether ends: then it is tied again at once, unless it had lasted less than a heartbeat (the
        coordinator refused it, or keeps dropping it: again at the next heartbeat)."""
        with contextlib.suppress(*wire.DAEMON_ERRORS):
            while await reader.read(wire.DRAIN_CHUNK):
                pass
        if self._held.get(coordinator) is writer:
            del self._held[coordinator]
            writer.close()
            if time.monotonic() - tied_at >= self.directory.interval:
                self._broke.set()

    async def _release(self, coordinator: str) -> None:
        writer = self._held.pop(coordinator)
        with contextlib.suppress(TimeoutError, TransportError):  # a release that cannot be sent: a break, at worst
            await in_time(wire.write_message(writer, {"kind": TetherKind.RELEASE.value}), self.directory.interval)
        writer.close()


