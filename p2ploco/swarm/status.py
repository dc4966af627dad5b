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
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from hivemind.dht.node import DHTNode

from p2ploco.monitor import STATUS_PATH, peers_json
from p2ploco.swarm.survey import survey

logger = logging.getLogger(__name__)

MAX_HEAD = 8192  # bytes of request line and headers
REQUEST_TIMEOUT = 5.0  # to send them
MAX_CONNECTIONS = 32  # served at once; more are closed at once
REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 500: "Internal Server Error",
           503: "Service Unavailable"}


class StatusServer:
    """Serves ``GET /peers`` (and ``HEAD``) on the node's event loop."""

    def __init__(self, node: DHTNode, run_id: str, refresh_interval: float):
        self.node, self.run_id, self.refresh_interval = node, run_id, refresh_interval
        self._looked: tuple[float, bytes] | None = None  # (monotonic time of the lookup, the JSON it gave)
        self._lookup = asyncio.Lock()  # concurrent requests wait for one lookup
        self._open = 0
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> str:
        """Listen on ``host:port`` (port 0: one the OS picks); the address it listens on, as HOST:PORT."""
        self._server = await asyncio.start_server(self._serve, host, port, limit=MAX_HEAD)
        bound_host, bound_port = self._server.sockets[0].getsockname()[:2]
        return f"[{bound_host}]:{bound_port}" if ":" in bound_host else f"{bound_host}:{bound_port}"

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()

    async def _body(self) -> bytes:
        async with self._lookup:
            if self._looked is None or time.monotonic() - self._looked[0] >= self.refresh_interval:
                found = await survey(self.node, self.run_id)
                self._looked = (time.monotonic(), json.dumps(peers_json(found)).encode())
            return self._looked[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._open += 1
        try:
            status, body, send_body = await self._answer(reader) if self._open <= MAX_CONNECTIONS else (503, b"", True)
            head = (f"HTTP/1.1 {status} {REASONS[status]}\r\nContent-Type: "
                    f"{'application/json' if status == 200 else 'text/plain'}\r\nContent-Length: {len(body)}\r\n"
                    f"Cache-Control: no-store\r\nConnection: close\r\n\r\n")
            writer.write(head.encode() + (body if send_body else b""))
            await asyncio.wait_for(writer.drain(), REQUEST_TIMEOUT)
        except (TimeoutError, ConnectionError):
            pass  # the client left or stopped reading: nothing is owed to it
        finally:
            self._open -= 1
            writer.close()

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
        try:
            return 200, await self._body(), method == b"GET"
        except Exception:  # a bug of the survey must not take the node down: say where it is, answer 500
            logger.exception("status endpoint: the survey failed")
            return 500, b"the node could not survey its run; see its log\n", True
