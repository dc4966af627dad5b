"""Reading a node's status endpoint (``p2ploco peers --from HOST:PORT``): one HTTP request to a node that already
holds its run's records (``swarm/status.py`` serves them).

This module and what it imports load neither hivemind nor torch, so that path answers in a fraction of a second
(the DHT path, ``swarm/survey.py``, takes seconds: ``benchmarks/peers_cli.py``). The node is trusted to report what
it sees, but what it answers is read as anyone's: within STATUS_TIMEOUT in all (however slowly it is sent), at most
MAX_STATUS_BYTES, and decoded by a strict, bounded model (``status_document.StatusDocument``), so a broken or
hostile endpoint gets a one-line error, never a traceback (``benchmarks/fuzz.py`` drives ``parse_answer`` with
mutated and malformed answers).
"""

from __future__ import annotations

import http.client
import io
import json
import socket
import time

from p2ploco.errors import PayloadError, SwarmError, shown
from p2ploco.swarm.status_document import MAX_STATUS_BYTES, STATUS_PATH, Survey

STATUS_TIMEOUT = 5.0  # for a whole request: connecting, sending it, and receiving the answer
MAX_ANSWER_HEAD = 64 << 10  # bytes of status line and headers a client reads before the body


def _host_and_port(address: str) -> tuple[str, int]:
    """The host (an IPv6 one without its brackets) and port of ``address``, HOST:PORT."""
    host, _, port = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host or not host.isascii() or not host.isprintable() or any(c in host for c in " /?#@[]") \
            or not (port.isascii() and port.isdigit() and 0 < int(port) < 65536):
        raise SwarmError(f"--from {shown(address, 100)}: give the HOST:PORT of a node's --status-port, e.g. "
                         f"127.0.0.1:8765")
    return host, int(port)


def read_status(address: str, timeout: float = STATUS_TIMEOUT) -> Survey:
    """The survey a node serves at ``address`` (HOST:PORT, its ``--status-port``), read within ``timeout`` in all."""
    return parse_answer(f"http://{address}{STATUS_PATH}", read_answer(address, STATUS_PATH, timeout))


def read_answer(address: str, target: str, timeout: float = STATUS_TIMEOUT) -> bytes:
    """The whole HTTP answer of the node at ``address`` (HOST:PORT) to ``GET target`` (a path and its query), read
    within ``timeout`` in all; SwarmError in one line if there is none to read. A plain socket, not urllib: a node is
    dialled directly, never through a proxy the environment names, and a redirect is not followed."""
    host, port = _host_and_port(address)
    url = f"http://{address}{target}"
    try:
        received = _receive(host, port, target, time.monotonic() + timeout)
    except TimeoutError:
        raise SwarmError(f"{url} did not answer within {timeout:.0f} s") from None
    except (OSError, UnicodeError) as e:  # refused, unreachable, unknown host (or one IDNA cannot encode)
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise SwarmError(f"cannot read {url} ({shown(why, 200)}): is a node started with --status-port {port} "
                         f"running there?") from None
    if received is None:
        raise SwarmError(f"{url} answered more than {MAX_STATUS_BYTES >> 20} MiB: not a p2ploco status")
    return received


def _receive(host: str, port: int, target: str, deadline: float) -> bytes | None:
    """What the node at ``host``, ``port`` answers to ``GET target``, up to the end of the connection (a node closes
    it after its answer); None if that is more than a status answer may be. TimeoutError at ``deadline``: the bound
    is on the whole answer, not on each read (a server that sends a byte at a time would otherwise hold the client
    for as long as it likes)."""
    def left() -> float:
        seconds = deadline - time.monotonic()
        if seconds <= 0:
            raise TimeoutError
        return seconds

    received = bytearray()
    with socket.create_connection((host, port), timeout=left()) as connection:
        connection.settimeout(left())
        # The address dialled, not a name: a node answers only the address it serves (``status.Host``)
        ip = connection.getpeername()[0]
        named = f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
        connection.sendall(f"GET {target} HTTP/1.1\r\nHost: {named}\r\nConnection: close\r\n\r\n".encode())
        while len(received) <= MAX_ANSWER_HEAD + MAX_STATUS_BYTES:
            connection.settimeout(left())
            if not (piece := connection.recv(1 << 16)):
                return bytes(received)
            received += piece
    return None


class _Received:
    """What http.client reads an answer from: the bytes received."""

    def __init__(self, data: bytes):
        self.data = data

    def makefile(self, mode: str) -> io.BytesIO:
        return io.BytesIO(self.data)


def parse_answer(url: str, received: bytes) -> Survey:
    """The survey in ``received``, the whole HTTP answer a node at ``url`` gave; SwarmError in one line if it is
    not one."""
    try:
        return Survey.from_json(answer_json(url, received))
    except PayloadError as e:
        raise SwarmError(f"{url} did not answer with a p2ploco status ({shown(str(e), 200)})") from None


def answer_json(url: str, received: bytes) -> object:
    """The JSON document in ``received``, the whole HTTP answer a node at ``url`` gave; SwarmError in one line if it
    is not a 200 answer of JSON within MAX_STATUS_BYTES."""
    try:
        answer = http.client.HTTPResponse(_Received(received))  # type: ignore[arg-type]
        answer.begin()
        if answer.status != 200:
            raise SwarmError(f"{url} answered {answer.status} {shown(answer.reason, 100)}: is this a p2ploco "
                             f"node's --status-port?")
        if answer.length is not None and answer.length > MAX_STATUS_BYTES:
            raise SwarmError(f"{url} announced {answer.length} bytes: a p2ploco status is at most "
                             f"{MAX_STATUS_BYTES >> 20} MiB")
        body = answer.read()
    except http.client.HTTPException as e:  # not HTTP, or cut short
        raise SwarmError(f"{url} did not answer in HTTP ({type(e).__name__}): is this a p2ploco node's "
                         f"--status-port?") from None
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise SwarmError(f"{url} did not answer with a p2ploco status ({shown(str(e), 200)})") from None
