"""A simulated internet for the real p2ploco code: each peer's libp2p daemon (``SimP2P``, the part of hivemind's
``P2P`` that p2ploco calls) and the links between them.

Every peer has a ``Link``: a one-way latency, an upload and a download rate, and whether it sits behind a NAT
(it dials out, nobody dials it). A message written on a stream leaves when the sender's uplink is free and has
sent it (uplinks are FIFO: a peer's streams share its upload), arrives a latency later, and is read once the
receiver's downlink has taken it in; a writer's ``drain`` returns when its bytes have left. Opening a stream takes
a round trip on a connection the two peers already hold, two more to open one; a peer behind a NAT can be reached
only on a connection it opened itself (as libp2p lets a peer answer on a connection a NATed peer dialled). A peer
that crashes takes its streams with it: the other ends read an end of stream, and nobody can dial it any more.

Bytes are counted per peer (``sent``, ``received``): payload as written, plus ``FRAME_BYTES`` per message and
``STREAM_OPEN_BYTES`` per stream for what yamux and multistream-select add."""

from __future__ import annotations

import asyncio
from collections import defaultdict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from hivemind.p2p import P2PDaemonError, PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import PeerInfo, StreamInfo
from hivemind.utils.multiaddr import Multiaddr

from p2ploco.simulation.clock import on_behalf_of

FRAME_BYTES = 12  # a yamux data frame's header, per message written
STREAM_OPEN_BYTES = 80  # a new stream: yamux's window update and multistream-select's protocol names

LOOPBACK = Multiaddr("/ip4/127.0.0.1/tcp/1")  # every simulated daemon's address: the links are what differ

Handler = Callable[[StreamInfo, asyncio.StreamReader, "SimWriter"], Awaitable[None]]


@dataclass(frozen=True)
class Link:
    latency: float = 0.05  # seconds, one way
    up: float = 12.5e6  # bytes per second (100 Mbit/s)
    down: float = 12.5e6
    nat: bool = False  # dials out only


@dataclass
class _End:
    """One end of a stream: what it reads, and whether it is closed."""

    peer: str
    reader: asyncio.StreamReader
    closed: bool = False
    last_arrival: float = 0.0  # when the last message written to this end arrives (messages keep their order)
    # what is on its way to this end, in the order it was sent: a message's bytes and size, or None for the end of
    # the stream. Each arrival delivers the head: timers due at one instant may run in any order, arrivals may not
    in_flight: deque[tuple[bytes, int] | None] = field(default_factory=deque)


@dataclass(eq=False)
class _Stream:
    ends: tuple[_End, _End]  # the caller's, the handler's
    protocol: str  # the handler's name


class SimWriter:
    """The writing half of one end of a simulated stream (the part of asyncio.StreamWriter p2ploco uses)."""

    def __init__(self, network: SimNetwork, stream: _Stream, side: int):
        self._network, self._stream, self._side = network, stream, side
        self._left_at = 0.0  # when the last byte written has left this peer

    def write(self, data: bytes) -> None:
        mine, theirs = self._stream.ends[self._side], self._stream.ends[1 - self._side]
        if mine.closed or not self._network.alive(mine.peer):
            raise ConnectionResetError("write on a closed stream")
        self._left_at = self._network.transmit(self._stream, mine.peer, theirs, bytes(data))

    async def drain(self) -> None:
        mine = self._stream.ends[self._side]
        if not self._network.alive(mine.peer):
            raise ConnectionResetError("this peer's daemon is gone")
        delay = self._left_at - self._network.loop.time()
        if delay > 0:
            await asyncio.sleep(delay)

    def close(self) -> None:
        mine, theirs = self._stream.ends[self._side], self._stream.ends[1 - self._side]
        if not mine.closed:
            mine.closed = True
            self._network.end_of_stream(self._stream, theirs, mine.peer)

    def is_closing(self) -> bool:
        return self._stream.ends[self._side].closed

    async def wait_closed(self) -> None:
        return None


class SimNetwork:
    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.daemons: dict[str, SimP2P] = {}
        self.links: dict[str, Link] = {}
        self.sent: dict[str, int] = defaultdict(int)
        self.received: dict[str, int] = defaultdict(int)
        self.streams_opened: dict[str, int] = defaultdict(int)  # per peer, the streams it opened
        self.served: dict[tuple[str, str], int] = defaultdict(int)  # (peer, handler) -> bytes its streams carried
        self._up_free: dict[str, float] = defaultdict(float)
        self._down_free: dict[str, float] = defaultdict(float)
        self._connected: set[frozenset[str]] = set()
        self._open: dict[str, set[_Stream]] = defaultdict(set)  # per peer, its streams not closed at both ends

    def daemon(self, peer_id: PeerID, link: Link) -> SimP2P:
        name = str(peer_id)
        self.links[name] = link
        self.daemons[name] = SimP2P(self, peer_id)
        return self.daemons[name]

    def alive(self, peer: str) -> bool:
        return peer in self.daemons

    def crash(self, peer: str) -> None:
        """``peer``'s daemon is gone: the other ends of its streams read an end of stream, nobody dials it again."""
        self.daemons.pop(peer, None)
        self._connected = {c for c in self._connected if peer not in c}
        for stream in self._open.pop(peer, set()):
            for end in stream.ends:
                if end.peer != peer:
                    self.end_of_stream(stream, end, peer)

    def carry(self, sender: str, receiver: str, size: int, after: float = 0.0) -> tuple[float, float]:
        """``size`` bytes from ``sender`` to ``receiver``, arriving no earlier than ``after``: when they have left
        the sender's uplink, and when the receiver's downlink has taken them in."""
        send, receive = self.links[sender], self.links.get(receiver, self.links[sender])
        left = self._up_free[sender] = max(self.loop.time(), self._up_free[sender]) + size / send.up
        arrives = max(left + send.latency + receive.latency, self._down_free[receiver] + size / receive.down, after)
        self._down_free[receiver] = arrives
        return left, arrives

    def transmit(self, stream: _Stream, sender: str, to: _End, data: bytes) -> float:
        """Send ``data`` to ``to``: returns when it has left ``sender``; it is fed to the reader when it arrives."""
        size = len(data) + FRAME_BYTES
        left, to.last_arrival = self.carry(sender, to.peer, size, after=to.last_arrival)
        self.sent[sender] += size
        self.served[stream.ends[1].peer, stream.protocol] += size
        to.in_flight.append((data, size))
        self.loop.call_at(to.last_arrival, self._arrive, to)
        return left

    def _arrive(self, to: _End) -> None:
        """The next thing on its way to ``to`` arrives: fed to its reader, unless the end is closed or gone."""
        message = to.in_flight.popleft()
        if to.closed or not self.alive(to.peer) or to.reader.at_eof():
            return
        if message is None:
            to.reader.feed_eof()
            return
        data, size = message
        self.received[to.peer] += size
        to.reader.feed_data(data)

    def end_of_stream(self, stream: _Stream, to: _End, closer: str) -> None:
        """The other end (``closer``'s) is closed: ``to`` reads an end of stream after everything sent before."""
        if all(end.closed for end in stream.ends):
            for end in stream.ends:
                self._open[end.peer].discard(stream)
        link = self.links.get(closer) or Link()
        to.last_arrival = max(self.loop.time() + link.latency, to.last_arrival)
        to.in_flight.append(None)
        self.loop.call_at(to.last_arrival, self._arrive, to)

    def connections_of(self, peer: str) -> list[str]:
        return [other for connection in self._connected if peer in connection for other in connection - {peer}]

    async def open(self, caller: str, callee: str, handler_name: str) -> tuple[StreamInfo, asyncio.StreamReader,
                                                                               SimWriter]:
        """A new stream from ``caller`` to ``callee``'s ``handler_name``, as ``P2P.call_binary_stream_handler``."""
        there = self.links.get(callee, Link())
        connection = frozenset((caller, callee))
        rtt = self.links[caller].latency + there.latency
        dialled = connection in self._connected
        await asyncio.sleep(rtt if dialled else 3 * rtt)
        daemon = self.daemons.get(callee)
        if not self.alive(caller):
            raise ConnectionResetError("this peer's daemon is gone")
        if daemon is None or (there.nat and not dialled):
            raise P2PDaemonError(f"failed to dial {callee[-8:]}: no route to the peer")
        handler = daemon.handlers.get(handler_name)
        if handler is None:
            raise P2PDaemonError(f"protocol not supported: {handler_name}")
        self._connected.add(connection)
        stream = _Stream((_End(caller, asyncio.StreamReader(limit=1 << 30)),
                          _End(callee, asyncio.StreamReader(limit=1 << 30))), handler_name)
        for peer in (caller, callee):
            self._open[peer].add(stream)
        self.sent[caller] += STREAM_OPEN_BYTES
        self.served[callee, handler_name] += STREAM_OPEN_BYTES
        self.received[callee] += STREAM_OPEN_BYTES
        self.streams_opened[caller] += 1
        info = StreamInfo(self.daemons[caller].peer_id, LOOPBACK, handler_name)
        daemon.serve(handler, info, stream.ends[1].reader, SimWriter(self, stream, 1))
        return StreamInfo(daemon.peer_id, LOOPBACK, handler_name), stream.ends[0].reader, SimWriter(self, stream, 0)


@dataclass
class SimP2P:
    """One peer's daemon: the calls of hivemind's ``P2P`` that p2ploco makes."""

    network: SimNetwork
    peer_id: PeerID
    handlers: dict[str, Handler] = field(default_factory=dict)
    tasks: set[asyncio.Task] = field(default_factory=set)

    async def add_binary_stream_handler(self, name: str, handler: Handler, balanced: bool = False) -> None:
        self.handlers[name] = handler

    async def call_binary_stream_handler(self, peer_id: PeerID, handler_name: str) -> tuple[Any, Any, Any]:
        return await self.network.open(str(self.peer_id), str(peer_id), handler_name)

    def serve(self, handler: Handler, info: StreamInfo, reader: asyncio.StreamReader, writer: SimWriter) -> None:
        task = on_behalf_of(str(self.peer_id), handler(info, reader, writer), service=info.proto)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def list_peers(self) -> list[PeerInfo]:
        return [PeerInfo(PeerID.from_base58(other), [LOOPBACK])
                for other in self.network.connections_of(str(self.peer_id))]

    async def get_visible_maddrs(self, latest: bool = False) -> list[Multiaddr]:
        return [Multiaddr(f"/ip4/127.0.0.1/tcp/1/p2p/{self.peer_id}")]
