"""A node's read-only status endpoint: what ``p2ploco peers --from HOST:PORT`` reads in a fraction of a second.

``p2ploco peers`` over the DHT takes seconds (``benchmarks/peers_cli.py``): importing hivemind and torch, starting
a p2p daemon, bootstrapping, then looking up. A node already holds a DHT node in its run. With ``--status-port``
(off by default) it answers ``GET /peers`` with the survey of its run, as ``p2ploco peers --json`` prints it.

- The survey is looked up afresh, at most once per heartbeat interval. The node's own view follows its group and
  may be stale by design (``swarm/directory.py``), so it is not served. A flood of requests costs the DHT
  nothing more than one lookup per interval.
- The endpoint serves what the DHT already publishes to anyone (signed peer records) and takes no input but its
  path. It listens on loopback unless ``--status-host`` says otherwise.
- A request is bounded: its head is at most MAX_HEAD bytes, sent within REQUEST_TIMEOUT, on one of at most
  MAX_CONNECTIONS connections. A request that breaks HTTP gets ``400``. Nothing a client sends reaches training.
- A lookup that fails is remembered as one that succeeded is: requests get ``503`` until the next interval.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time

from hivemind.dht.node import DHTNode

from p2ploco.monitor import STATUS_PATH, peers_json
from p2ploco.swarm.loop import finishes_within
from p2ploco.swarm.survey import survey

logger = logging.getLogger(__name__)

MAX_HEAD = 8192  # bytes of request line and headers
REQUEST_TIMEOUT = 5.0  # to send them
MAX_CONNECTIONS = 32  # served at once; more are answered 503 at once
LOOKUP_TIMEOUT = 10.0  # for one survey of the DHT
REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 503: "Service Unavailable"}
WILDCARDS = ("0.0.0.0", "::")  # hosts that mean "every address of this machine"


def listen(host: str, port: int) -> tuple[socket.socket, str]:
    """A socket listening on ``host:port`` (port 0: one the OS picks), and that address as HOST:PORT. Bound before
    the node joins its swarm, so that a port that is taken stops the node before any peer has seen it."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    listening = socket.create_server(address, family=family)
    bound_host, bound_port = listening.getsockname()[:2]
    return listening, f"[{bound_host}]:{bound_port}" if family == socket.AF_INET6 else f"{bound_host}:{bound_port}"


class StatusServer:
    """Serves ``GET /peers`` (and ``HEAD``) on the node's event loop."""

    def __init__(self, node: DHTNode, run_id: str, refresh_interval: float):
        self.node, self.run_id, self.refresh_interval = node, run_id, refresh_interval
        # the last lookup: its monotonic time and the JSON it gave (None: it failed; 503 until the next one)
        self._looked: tuple[float, bytes | None] | None = None
        self._lookup = asyncio.Lock()  # concurrent requests wait for one lookup
        self._connections: set[asyncio.StreamWriter] = set()
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
        await finishes_within(self._server.wait_closed(), REQUEST_TIMEOUT)

    async def _body(self) -> bytes | None:
        """The survey's JSON, looked up afresh if the last lookup is older than the refresh interval; None if that
        lookup failed."""
        async with self._lookup:
            if self._looked is None or time.monotonic() - self._looked[0] >= self.refresh_interval:
                # not wait_for: a hivemind call into a daemon that hangs may not honour a cancellation
                looking = asyncio.ensure_future(survey(self.node, self.run_id))
                done, _ = await asyncio.wait({looking}, timeout=LOOKUP_TIMEOUT)
                self._looked = (time.monotonic(), None)
                if not done:
                    looking.cancel()
                    logger.warning(f"status endpoint: the DHT did not answer within {LOOKUP_TIMEOUT:.0f} s")
                elif looking.exception() is not None:  # a bug must not take the node down: say where it is
                    logger.error("status endpoint: the survey failed", exc_info=looking.exception())
                else:
                    self._looked = (time.monotonic(), json.dumps(peers_json(looking.result())).encode())
            return self._looked[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._connections.add(writer)
        try:
            busy = len(self._connections) > MAX_CONNECTIONS
            status, body, send_body = (503, b"busy\n", True) if busy else await self._answer(reader)
            head = (f"HTTP/1.1 {status} {REASONS[status]}\r\nContent-Type: "
                    f"{'application/json' if status == 200 else 'text/plain'}\r\nContent-Length: {len(body)}\r\n"
                    f"Cache-Control: no-store\r\nConnection: close\r\n\r\n")
            writer.write(head.encode() + (body if send_body else b""))
            await asyncio.wait_for(writer.drain(), REQUEST_TIMEOUT)
            writer.close()
        except (TimeoutError, ConnectionError):  # the client left or stopped reading: nothing is owed
            writer.transport.abort()  # close() would keep the unsent answer buffered for as long as it stalls
        finally:
            self._connections.discard(writer)

    async def _answer(self, reader: asyncio.StreamReader) -> tuple[int, bytes, bool]:
        """(HTTP status, body, whether to send the body) for the request ``reader`` carries."""
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_TIMEOUT)
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            return 400, b"send one HTTP/1.x request: GET /peers\n", True
        parts = head.split(b"\r\n", 1)[0].split(b" ")
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
            return 400, b"send one HTTP/1.x request: GET /peers\n", True
        method, path = parts[0], parts[1].split(b"?", 1)[0]
        if path != STATUS_PATH.encode():
            return 404, f"this node serves {STATUS_PATH} only\n".encode(), method != b"HEAD"
        if method not in (b"GET", b"HEAD"):
            return 405, b"GET or HEAD only\n", True
        body = await self._body()
        if body is None:
            return 503, b"the node could not survey its run just now; try again in a moment\n", True
        return 200, body, method == b"GET"
