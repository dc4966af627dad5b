"""``p2ploco dashboard --from HOST:PORT``: the dashboard served from this machine (a laptop), its documents read from
the node whose status port is at HOST:PORT (``swarm/status_client.py``: within its timeout, at most its bytes).

The page and its files are this package's own. A document is read from the node at most once per RELAY_INTERVAL
for each query, however many pages ask, and passed on only as JSON this process wrote again: what the node
answers is read as anyone's, and an answer that is not a document becomes a one-line 502. The same server as a
node's (``swarm/status.py``) serves it, with the same limits on clients. Neither hivemind nor torch is loaded.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

from p2ploco.dashboard.documents import DOCUMENT_FORMAT, ROUNDS_DOCUMENT, RUN_STATUS, parse_after
from p2ploco.dashboard.page import PAGE_PATH, page_routes
from p2ploco.errors import SwarmError, shown
from p2ploco.swarm.status import Answer, Host, Route, StatusServer, listen, why_not_listening
from p2ploco.swarm.status_client import answer_json, read_answer
from p2ploco.swarm.status_document import PEERS_DOCUMENT

RELAY_INTERVAL = 1.0  # seconds an answer of the node is passed on before it is read again
MAX_QUERIES = 64  # answers kept, by query (pages ask for the rounds after the newest they hold)


class Relayed:
    """The route of ``path`` that passes on what the node at ``address`` answers there, for the queries ``accepts``."""

    def __init__(self, address: str, path: str, accepts: Callable[[str], bool]):
        self.address, self.path, self.accepts = address, path, accepts
        self._answers: dict[str, tuple[float, Answer]] = {}  # query -> when it was read, and the answer
        self._reading = asyncio.Lock()

    async def __call__(self, query: str) -> Answer:
        if not self.accepts(query):  # never forwarded: the node sees only queries this page sends
            return Answer.error(400, f"{self.path} takes no such query")
        async with self._reading:
            read = self._answers.get(query)
            if read is None or time.monotonic() - read[0] >= RELAY_INTERVAL:
                answer = await asyncio.get_running_loop().run_in_executor(None, self.read, query)
                self._answers.pop(query, None)
                while len(self._answers) >= MAX_QUERIES:
                    del self._answers[next(iter(self._answers))]  # the oldest
                read = self._answers[query] = time.monotonic(), answer
            return read[1]

    def read(self, query: str) -> Answer:
        target = f"{self.path}?{query}" if query else self.path
        try:
            document = read_document(self.address, target)
        except SwarmError as e:
            return Answer.error(502, str(e))
        try:
            return Answer(200, json.dumps(document, allow_nan=False).encode())
        except ValueError:  # Python reads NaN and Infinity; a browser's JSON.parse does not
            return Answer.error(502, f"http://{self.address}{target} holds a number that JSON has not (NaN or "
                                     f"Infinity): is that node a p2ploco of this version?")


def read_document(address: str, target: str) -> dict:
    """The document (format DOCUMENT_FORMAT) the node at ``address`` serves at ``target``; SwarmError in one line."""
    url = f"http://{address}{target}"
    document = answer_json(url, read_answer(address, target))
    if not isinstance(document, dict) or document.get("format") != DOCUMENT_FORMAT:
        found = document.get("format") if isinstance(document, dict) else None
        raise SwarmError(f"{url} is not a p2ploco document of format {DOCUMENT_FORMAT} (format "
                         f"{shown(str(found), 20)}): is that node a p2ploco of this version?")
    return document


def relay_routes(address: str) -> dict[str, Route]:
    """The dashboard of the node at ``address``: the page from here, its documents from there."""
    return {**page_routes(), PEERS_DOCUMENT: Relayed(address, PEERS_DOCUMENT, lambda query: not query),
            ROUNDS_DOCUMENT: Relayed(address, ROUNDS_DOCUMENT, lambda query: parse_after(query) is not None),
            RUN_STATUS: Relayed(address, RUN_STATUS, lambda query: not query)}


def serve_dashboard(address: str, host: str, port: int, out: Callable[[str], None]) -> None:
    """Serve the dashboard of the node at ``address`` on ``host:port`` until interrupted. The node is read once
    first, so that a wrong address is one line at once, not a page that says so."""
    run = read_document(address, RUN_STATUS)
    try:
        listening, served_at = listen(host, port)
    except OSError as e:
        raise SwarmError(f"--host {host} --port {port}: cannot listen there ({why_not_listening(e)}); pick another "
                         f"port (0: any free one) or host") from None

    async def serve() -> None:
        server = StatusServer(relay_routes(address), Host(host))
        await server.start(listening)
        out(f"dashboard of run '{shown(str(run.get('run_id')), 64)}' (the node at {address}) at "
            f"http://{served_at}{PAGE_PATH}; Ctrl-C stops it")
        try:
            await asyncio.Event().wait()  # until interrupted
        finally:
            await server.stop()

    try:
        asyncio.run(serve())
    finally:
        listening.close()
