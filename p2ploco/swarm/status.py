"""A node's read-only status endpoint: what ``p2ploco peers --from HOST:PORT`` reads in a fraction of a second,
and the dashboard (``p2ploco/dashboard/``) a browser opens at ``/``.

``p2ploco peers`` over the DHT takes seconds (``benchmarks/peers_cli.py``): importing hivemind and torch, starting
a p2p daemon, bootstrapping, then looking up. A node already holds a DHT node in its run. With ``--status-port``
(off by default) it answers ``GET /peers`` with the survey of its run (``status_document.status_answer``), and the
paths its other routes name (``StatusServer(routes)``: the dashboard's page, assets and JSON documents).

- The survey is looked up afresh, at most once per heartbeat interval (``Surveyed``), in the background while the
  last one is at most a few intervals old. The node's own view follows its group and may be stale by design
  (``swarm/directory.py``), so it is not served. A flood of requests costs the DHT nothing more than one lookup per
  interval.
- The survey is parsed and serialized in a thread, one record at a time: of a survey, the event loop that runs
  the node's rounds runs only the DHT lookup (hivemind's, which checks each record as the node's own lookups do).
  One record at a time, because json.dumps holds the GIL for all it serializes in one call: 1,800 padded records
  serialized in one call stalled the loop for up to 0.5 s even from a thread. The answer is at most
  ``status_document.MAX_STATUS_BYTES`` however the records are padded (the largest are left out, and counted).
- The endpoint serves what the DHT already publishes to anyone (signed peer records), the node's own round records
  and its run's config, and takes no input but its path and a query the route parses. It listens on loopback
  unless ``--status-host`` says otherwise. A request that breaks HTTP gets ``400``. Nothing a client sends reaches
  training. Every answer forbids the browser to run anything but the page's own scripts (``SECURITY_HEADERS``).
- A request whose ``Host`` header names anything but the address it serves or a loopback name gets ``403``
  (``Host.serves``): a page of another site that a browser is made to send here by DNS rebinding (its name
  resolved to this node's address) names its own host, and reads nothing. An IP address cannot be rebound, so a
  node that listens on every address (``0.0.0.0``) answers any IP literal; a name, only the one it was told.
- A lookup that fails is remembered as one that succeeded is: requests get ``503`` until the next interval.

What one client can cost (a slot, for a bounded time; never everyone's service):

- A connection holds one of MAX_CONNECTIONS slots for at most HEAD_TIMEOUT to send its request head (in all, not
  per read: a head sent a byte at a time is cut off like a silent one), then, once its answer is at hand, at most
  WRITE_TIMEOUT to take it. The answer is written in pieces of WRITE_PIECE, so a client that stops reading holds
  one piece of memory, not a copy of the answer.
- A remote address holds at most MAX_PER_ADDRESS slots (IPv6: its /64, which one host usually has). Loopback
  clients share all MAX_CONNECTIONS: every local process connects from 127.0.0.1, so a cap per address there
  would be one small cap for all of this machine's users.
- At a limit, a new connection takes the slot of the oldest connection that is waiting on its client (sending
  its head or taking its answer): of its own address at the address limit, of anyone at the total limit. Only
  when every slot waits on the node (for a survey being looked up) is it answered ``503`` at once. So sockets
  that sit idle, from one source or many, never deny a client that sends its request when it connects: it
  pushes the oldest idle one out. What still denies service is a flood of new connections that pushes a client
  out before its head arrives: MAX_CONNECTIONS new connections (MAX_PER_ADDRESS from its own remote address)
  within the moment between its connect and its request.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

from p2ploco.aio import in_time
from p2ploco.swarm.loop import finishes_within
from p2ploco.swarm.status_document import STATUS_PATH, Survey, status_answer

logger = logging.getLogger(__name__)

MAX_HEAD = 8192  # bytes of request line and headers
HEAD_TIMEOUT = 2.0  # to send them, in all (a request is one short packet)
WRITE_TIMEOUT = 5.0  # to take the answer, in all
WRITE_PIECE = 1 << 16  # bytes of the answer handed to the socket at a time
MAX_CONNECTIONS = 32  # served at once
MAX_PER_ADDRESS = 4  # of those, held by one remote address (loopback: all)
LOOKUP_TIMEOUT = 10.0  # for one survey of the DHT
STALE_INTERVALS = 3  # a survey this many refresh intervals old is still served while a newer one is looked up
BUSY = b"busy: every slot waits on a survey; try again in a moment\n"
REASONS = {200: "OK", 400: "Bad Request", 403: "Forbidden", 404: "Not Found", 405: "Method Not Allowed",
           502: "Bad Gateway", 503: "Service Unavailable"}
JSON, TEXT = "application/json", "text/plain; charset=utf-8"
# On every answer: the browser runs the page's own scripts and styles only (never one a peer's text smuggles in),
# connects to this endpoint only, takes no answer for another type than it says, and shows the page in no frame.
SECURITY_HEADERS = ("Content-Security-Policy: default-src 'none'; script-src 'self'; style-src 'self'; "
                    "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
                    "frame-ancestors 'none'\r\nX-Content-Type-Options: nosniff\r\nReferrer-Policy: no-referrer\r\n")
WILDCARDS = ("0.0.0.0", "::")  # hosts that mean "every address of this machine"


def why_not_listening(error: OSError) -> str:
    """Why ``listen`` failed, in the OS's few words (not Python's long form): the port is taken, the host is not
    one of this machine's addresses, ..."""
    return os.strerror(error.errno) if error.errno and error.errno > 0 else error.strerror or str(error)


def listen(host: str, port: int) -> tuple[socket.socket, str]:
    """A socket listening on ``host:port`` (port 0: one the OS picks), and that address as HOST:PORT. Bound before
    the node joins its swarm, so that a port that is taken stops the node before any peer has seen it."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    listening = socket.create_server(address, family=family)
    bound_host, bound_port = listening.getsockname()[:2]
    return listening, f"[{bound_host}]:{bound_port}" if family == socket.AF_INET6 else f"{bound_host}:{bound_port}"


@dataclass(frozen=True)
class Host:
    """Which ``Host`` headers a status server answers: what it listens on (``listen``'s host, as given) and loopback
    names; where it listens on every address, any IP literal."""

    listening: str

    def serves(self, header: str) -> bool:
        name = _without_port(header.strip()).lower()
        if name == "localhost" or name.endswith(".localhost"):
            return True
        try:
            address = ipaddress.ip_address(name)
        except ValueError:  # a name: only the one this server was told to listen on
            return name == self.listening.lower()
        return address.is_loopback or self.listening in WILDCARDS or name == self.listening.strip("[]").lower()


def _without_port(host: str) -> str:
    """``host`` (a Host header's value) without its port: ``[::1]:80`` -> ``::1``, ``a.b:80`` -> ``a.b``."""
    if host.startswith("["):
        return host[1:].partition("]")[0]
    return host.rpartition(":")[0] if host.count(":") == 1 else host


@dataclass(frozen=True)
class Answer:
    """What a request gets: an HTTP status, the body, and the body's media type."""

    status: int
    body: bytes
    content_type: str = JSON

    @classmethod
    def error(cls, status: int, message: str) -> Answer:
        """A one-line plain-text answer saying what is wrong."""
        return cls(status, message.encode() + b"\n", TEXT)


# What a path answers: the request's query (what follows "?", "" if nothing does) -> its answer. A route that looks
# something up waits on the node; one that has its answer at hand returns at once.
Route = Callable[[str], Awaitable[Answer]]


def constant(answer: Answer) -> Route:
    """A route that answers ``answer`` whatever the query."""
    async def route(query: str) -> Answer:
        return answer

    return route


def answer_head(answer: Answer) -> bytes:
    """The status line and headers of ``answer``; the connection closes after it."""
    return (f"HTTP/1.1 {answer.status} {REASONS[answer.status]}\r\nContent-Type: {answer.content_type}\r\n"
            f"Content-Length: {len(answer.body)}\r\nCache-Control: no-store\r\n{SECURITY_HEADERS}"
            f"Connection: close\r\n\r\n").encode()


def source_of(writer: asyncio.StreamWriter) -> str | None:
    """Whose slots a connection counts against: its remote address (an IPv6 one's /64), or None for loopback and
    a socket already gone, which count against the total only."""
    peer = writer.get_extra_info("peername")
    try:
        address = ipaddress.ip_address(peer[0])
    except (TypeError, ValueError):  # not an IP socket, or no peer any more
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:  # a dual-stack listener's
        address = address.ipv4_mapped
    if address.is_loopback:
        return None
    if isinstance(address, ipaddress.IPv6Address):
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


@dataclass(eq=False)
class Connection:
    writer: asyncio.StreamWriter
    source: str | None  # ``source_of`` it
    on_client: bool = True  # waiting on its client (for its head, or to take its answer): a newcomer may push it out


class Surveyed:
    """The route of ``STATUS_PATH``: the survey ``look`` gives, looked up at most once per ``refresh_interval``.

    An answer younger than the interval is served as it is. One up to STALE_INTERVALS intervals old is served too,
    while a lookup in the background (one at a time) replaces it: a page that refreshes every few seconds never
    waits on the DHT. An older one, or none, waits for a lookup."""

    def __init__(self, look: Callable[[], Awaitable[Survey]], refresh_interval: float):
        self.look, self.refresh_interval = look, refresh_interval
        # the last lookup: its monotonic time and the answer it gave (None: it failed; 503 until the next one)
        self._looked: tuple[float, bytes | None] | None = None
        self._lookup = asyncio.Lock()  # concurrent requests wait for one lookup
        self._refreshing: asyncio.Task | None = None  # the lookup in the background, if one is under way

    async def __call__(self, query: str) -> Answer:
        body = await self._body()
        if body is None:
            return Answer.error(503, "the node could not survey its run just now; try again in a moment")
        return Answer(200, body)

    async def close(self) -> None:
        """Stop the lookup in the background, if one is under way (before the DHT stops)."""
        if self._refreshing is not None:
            self._refreshing.cancel()
            await asyncio.wait({self._refreshing})

    async def _body(self) -> bytes | None:
        """The survey's answer: the last one if it is recent enough (above), else looked up afresh; None if that
        lookup failed."""
        if self._looked is not None and self._looked[1] is not None:
            age = time.monotonic() - self._looked[0]
            if age < self.refresh_interval:
                return self._looked[1]
            if age < STALE_INTERVALS * self.refresh_interval:
                if self._refreshing is None or self._refreshing.done():
                    self._refreshing = asyncio.ensure_future(self._refresh())
                return self._looked[1]
        await self._refresh()
        return self._looked[1]

    async def _refresh(self) -> None:
        """Look the survey up, unless another lookup did while this one waited for its turn."""
        async with self._lookup:
            if self._looked is not None and time.monotonic() - self._looked[0] < self.refresh_interval:
                return
            # not wait_for: a hivemind call into a daemon that hangs may not honour a cancellation
            looking = asyncio.ensure_future(self.look())
            try:
                done, _ = await asyncio.wait({looking}, timeout=LOOKUP_TIMEOUT)
            except asyncio.CancelledError:  # closed while looking in the background: the lookup goes too
                looking.cancel()
                raise
            self._looked = (time.monotonic(), None)
            if not done:
                looking.cancel()
                logger.warning(f"status endpoint: the DHT did not answer within {LOOKUP_TIMEOUT:.0f} s")
            elif looking.exception() is not None:  # a bug must not take the node down: say where it is
                logger.error("status endpoint: the survey failed", exc_info=looking.exception())
            else:  # off the loop (above): it is as long as the records are padded
                answer = await asyncio.get_running_loop().run_in_executor(None, status_answer, looking.result())
                self._looked = (time.monotonic(), answer)


class StatusServer:
    """Serves ``GET`` (and ``HEAD``) of the paths ``routes`` names, on the node's event loop, to requests whose
    ``Host`` it serves (``host``)."""

    def __init__(self, routes: Mapping[str, Route], host: Host):
        self.routes, self.host = dict(routes), host
        self._connections: dict[asyncio.StreamWriter, Connection] = {}  # oldest first
        self._server: asyncio.Server | None = None

    async def start(self, listening: socket.socket) -> None:
        """Serve on ``listening`` (from ``listen``)."""
        self._server = await asyncio.start_server(self._serve, sock=listening, limit=MAX_HEAD)

    async def stop(self) -> None:
        """Stop listening and drop the connections still open, so that no handler outlives the loop."""
        if self._server is None:
            return
        self._server.close()
        for writer in list(self._connections):
            writer.transport.abort()
        await finishes_within(self._server.wait_closed(), HEAD_TIMEOUT)

    def _admit(self, source: str | None) -> bool:
        """Whether a new connection from ``source`` gets a slot: at a limit, the oldest connection waiting on its
        client gives up its own (of the same source at the per-address limit), or none is given."""
        if source is not None:
            same = [c for c in self._connections.values() if c.source == source]
            if len(same) >= MAX_PER_ADDRESS and not self._push_out(same):
                return False
        return len(self._connections) < MAX_CONNECTIONS or self._push_out(list(self._connections.values()))

    def _push_out(self, connections: list[Connection]) -> bool:
        """Close the oldest of ``connections`` that waits on its client; False if none does."""
        oldest = next((c for c in connections if c.on_client), None)
        if oldest is None:
            return False
        del self._connections[oldest.writer]
        oldest.writer.transport.abort()  # its handler's read or write fails at once, and it ends
        return True

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        source = source_of(writer)
        if not self._admit(source):  # every slot waits on the node: the client may try again in a moment
            # a few bytes: the socket's buffer takes them at once
            writer.write(answer_head(Answer(503, BUSY, TEXT)) + BUSY)
            writer.close()
            return
        connection = self._connections[writer] = Connection(writer, source)
        try:
            answer, send_body = await self._answer(reader, connection)
            if writer not in self._connections:  # pushed out while it sent its head
                return
            connection.on_client = True
            # In pieces of the one answer all requests share: one piece at a time is buffered for a slow reader.
            sent = memoryview(answer.body if send_body else b"")
            async with asyncio.timeout(WRITE_TIMEOUT):
                writer.write(answer_head(answer))
                for start in range(0, len(sent), WRITE_PIECE):
                    await writer.drain()
                    writer.write(sent[start:start + WRITE_PIECE])
                await writer.drain()
            writer.close()
        except (TimeoutError, ConnectionError):  # the client left, stopped reading, or was pushed out
            writer.transport.abort()  # close() would keep the unsent answer buffered for as long as it stalls
        finally:
            self._connections.pop(writer, None)

    async def _answer(self, reader: asyncio.StreamReader, connection: Connection) -> tuple[Answer, bool]:
        """The answer to the request ``reader`` carries, and whether to send its body."""
        try:
            head = await in_time(reader.readuntil(b"\r\n\r\n"), HEAD_TIMEOUT)
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            return Answer.error(400, f"send one HTTP/1.x request: GET {STATUS_PATH}"), True
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ")
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
            return Answer.error(400, f"send one HTTP/1.x request: GET {STATUS_PATH}"), True
        named = [line[5:].decode("latin-1") for line in lines[1:] if line[:5].lower() == b"host:"]
        if named and not self.host.serves(named[0]):  # a page of another site, by DNS rebinding
            return Answer.error(403, f"this node serves requests for {self.host.listening} or a loopback name "
                                     f"only; ask for it by that address"), True
        method, (path, _, query) = parts[0], parts[1].partition(b"?")
        route = self.routes.get(path.decode("latin-1"))
        if route is None:
            return Answer.error(404, f"this node serves {', '.join(sorted(self.routes))} only"), method != b"HEAD"
        if method not in (b"GET", b"HEAD"):
            return Answer.error(405, "GET or HEAD only"), True
        connection.on_client = False  # from here it waits on the node: nobody may push it out
        return await route(query.decode("latin-1")), method == b"GET"
