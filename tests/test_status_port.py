"""A node's status endpoint and its client against hostile clients and hostile answers: the real server on a real
event loop in this process, real sockets, the real client (``read_status``). No node process: the server serves a
survey of real peer records, handed to it as a node's DHT lookup hands it (``swarm/survey.py``, which the swarm
tests in test_inspect.py run against real nodes)."""

import asyncio
import ipaddress
import json
import socket
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager

import pytest
from hivemind.utils import MSGPackSerializer

from p2ploco.errors import SwarmError
from p2ploco.swarm import status
from p2ploco.swarm.loop import EventLoopThread
from p2ploco.swarm.records import PeerRecord
from p2ploco.swarm.schema import MAX_RECORD_BYTES
from p2ploco.swarm.status import MAX_CONNECTIONS, MAX_PER_ADDRESS, Host, StatusServer, Surveyed, listen
from p2ploco.swarm.status_client import MAX_ANSWER_HEAD, read_status
from p2ploco.swarm.status_document import MAX_STATUS_BYTES, STATUS_PATH, Survey, status_answer


def honest(i: int) -> PeerRecord:
    return PeerRecord(peer_id=f"12D3KooWHonest{i:04d}", round=1234, state="training", fingerprint="f" * 16,
                      params_digest="a" * 64, slices={"stage0": "b" * 64}, name=f"swift-otter-{i:04d}", device="cpu",
                      loss=2.884, addresses=[f"/ip4/10.0.0.{i % 250}/tcp/31337/p2p/12D3KooWHonest{i:04d}"],
                      eval_history=[[r, 2.5 + r / 1000] for r in range(16)])


def padded(i: int) -> PeerRecord:
    """A record the DHT accepts (under 4 KiB), every string of it control characters: six bytes of JSON each."""
    c = "\x01"
    record = PeerRecord(peer_id=f"12D3KooWPadded{i:06d}", round=3, state="training", fingerprint=c * 64,
                        params_digest=c * 64, version=c * 64, name=c * 64, device=c * 256, addresses=[c * 256] * 11,
                        group=c * 64, schedule=c * 64, slices={f"s{j}": c * 64 for j in range(2)})
    assert len(MSGPackSerializer.dumps(record.to_value())) <= MAX_RECORD_BYTES
    return record


HONEST = [honest(i) for i in range(20)]


def survey_of(peers: list[PeerRecord]) -> Survey:
    return Survey("tiny", peers, {p.peer_id: 9.5 for p in peers})


@contextmanager
def endpoint(peers: list[PeerRecord], host: str = "127.0.0.1", look: Callable | None = None):
    """A status server on its own event loop, serving the survey of ``peers`` (or what ``look`` gives); yields the
    loop, the server and the HOST:PORT it listens at."""
    async def survey() -> Survey:
        return survey_of(peers)

    loop = EventLoopThread("status-endpoint")
    server = StatusServer({STATUS_PATH: Surveyed(look or survey, refresh_interval=60.0)}, Host(host))
    listening, address = listen(host, 0)
    try:
        loop.run(server.start(listening), 10)
        yield loop, server, address
    finally:
        loop.run(server.stop(), 10)
        loop.stop()
        listening.close()


def connect(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def pushed_out(connection: socket.socket) -> bool:
    """Whether the server has dropped ``connection`` (a client that sent nothing), looked at without waiting."""
    connection.setblocking(False)
    try:
        return connection.recv(1) == b""
    except BlockingIOError:  # nothing yet: still held
        return False
    except ConnectionResetError:  # aborted by the server
        return True


def fetch(address: str) -> bytes:
    """The body of the server's answer to ``GET /peers``, read to the end."""
    with connect(address) as connection:
        connection.sendall(b"GET /peers HTTP/1.1\r\nHost: localhost\r\n\r\n")
        answer = b""
        while piece := connection.recv(1 << 20):
            answer += piece
    head, body = answer.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 200 "), head
    return body


def test_a_request_for_another_host_than_the_one_served_is_refused():
    """A page of another site whose name a browser was made to resolve to this node (DNS rebinding) names its own
    host: refused. Loopback names, the address served, and any IP address where every address is served, pass."""
    assert all(Host("127.0.0.1").serves(h) for h in ("localhost:80", "LOCALHOST", "a.localhost:1", "127.0.0.1:8765",
                                                      "[::1]:8765", "127.0.0.2"))
    assert not any(Host("127.0.0.1").serves(h) for h in ("rebound.example:8765", "10.0.0.1:8765", "", "[fe80::1]:1"))
    assert Host("0.0.0.0").serves("203.0.113.7:8765") and Host("::").serves("[2001:db8::1]:80")
    assert not Host("0.0.0.0").serves("rebound.example:8765")
    assert Host("node.example").serves("Node.Example:8765") and not Host("node.example").serves("other.example")
    with endpoint(HONEST) as (_, _, address):
        for host, code in ((b"rebound.example", b"403"), (address.encode(), b"200"), (b"localhost", b"200")):
            with connect(address) as connection:
                connection.sendall(b"GET /peers HTTP/1.1\r\nHost: " + host + b"\r\n\r\n")
                assert connection.recv(64).startswith(b"HTTP/1.1 " + code), host


def test_idle_sockets_from_one_address_do_not_deny_another_client(monkeypatch):
    """Every local client connects from 127.0.0.1: MAX_CONNECTIONS + 8 sockets that send nothing take every
    slot, and a client that sends its request still gets the survey, pushing the oldest idle one out."""
    monkeypatch.setattr(status, "HEAD_TIMEOUT", 60.0)  # the idle sockets stay idle for the whole test
    with endpoint(HONEST) as (_, _, address):
        idle = [connect(address) for _ in range(MAX_CONNECTIONS + 8)]
        try:
            survey = read_status(address)
            assert [p.peer_id for p in survey.peers] == [p.peer_id for p in HONEST]
            # 8 pushed out by the idle ones that came after them, one by the client: the oldest, in order
            assert [pushed_out(c) for c in idle] == [True] * 9 + [False] * (MAX_CONNECTIONS - 1)
        finally:
            for connection in idle:
                connection.close()


def own_address() -> str | None:
    """A non-loopback IPv4 address of this machine (a UDP connect sends nothing), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))
        except OSError:  # no route: no such address
            return None
        address = probe.getsockname()[0]
    return None if ipaddress.ip_address(address).is_loopback else address


def test_a_remote_address_holds_at_most_its_share_of_slots_and_loopback_clients_keep_theirs(monkeypatch):
    remote = own_address()
    if remote is None:
        pytest.skip("this machine has no address but loopback to connect from")
    monkeypatch.setattr(status, "HEAD_TIMEOUT", 60.0)
    with endpoint(HONEST, host="0.0.0.0") as (_, _, address):
        port = address.rsplit(":", 1)[1]
        from_remote = [connect(f"{remote}:{port}") for _ in range(MAX_PER_ADDRESS + 3)]
        from_loopback = [connect(f"127.0.0.1:{port}") for _ in range(MAX_CONNECTIONS - MAX_PER_ADDRESS)]
        try:
            assert len(read_status(f"{remote}:{port}").peers) == len(HONEST)
            # the remote address kept MAX_PER_ADDRESS slots, the client's included; loopback lost none
            assert [pushed_out(c) for c in from_remote] == [True] * 4 + [False] * (MAX_PER_ADDRESS - 1)
            assert not any(pushed_out(c) for c in from_loopback)
        finally:
            for connection in from_remote + from_loopback:
                connection.close()


def test_when_every_slot_waits_on_a_survey_a_newcomer_is_answered_503_at_once():
    """Clients that sent their request are never pushed out; beyond MAX_CONNECTIONS of them, a newcomer gets 503
    without waiting, and all are answered once the survey is there."""
    surveyed = asyncio.Event()  # bound to the server's loop when first awaited there

    async def slow_lookup() -> Survey:
        await surveyed.wait()
        return survey_of(HONEST)

    async def waiting_on_the_node(server: StatusServer) -> int:
        return sum(not c.on_client for c in server._connections.values())

    with endpoint(HONEST, look=slow_lookup) as (loop, server, address):
        waiting = [connect(address) for _ in range(MAX_CONNECTIONS)]
        for connection in waiting:
            connection.sendall(b"GET /peers HTTP/1.1\r\n\r\n")
        deadline = time.monotonic() + 30
        while loop.run(waiting_on_the_node(server)) < MAX_CONNECTIONS:  # their heads are read
            assert time.monotonic() < deadline
        with connect(address) as newcomer:
            newcomer.sendall(b"GET /peers HTTP/1.1\r\n\r\n")
            assert newcomer.recv(1 << 16).startswith(b"HTTP/1.1 503 ")
        loop.loop.call_soon_threadsafe(surveyed.set)
        for connection in waiting:
            with connection:
                assert connection.recv(1 << 16).startswith(b"HTTP/1.1 200 ")


def test_a_survey_a_few_intervals_old_is_served_while_a_newer_one_is_looked_up_in_the_background(monkeypatch):
    """A page refreshing every few seconds never waits on the DHT: past one interval, the last survey is served at
    once while one lookup runs behind it; past STALE_INTERVALS, a request waits for a lookup of its own."""
    lookups: list[int] = []
    let_through = threading.Event()  # the second lookup hangs until the test lets it through
    second_began = threading.Event()  # the answer may come back before the loop has run the task it started

    async def look() -> Survey:
        lookups.append(len(lookups) + 1)
        if len(lookups) == 2:
            second_began.set()
            await asyncio.get_running_loop().run_in_executor(None, let_through.wait, 30)
        return survey_of(HONEST[:len(lookups)])  # as many peers as lookups so far

    def peers(answer: status.Answer) -> int:
        assert answer.status == 200, answer
        return len(json.loads(answer.body)["peers"])

    loop = EventLoopThread("surveyed")
    route = Surveyed(look, refresh_interval=1.0)
    try:
        assert peers(loop.run(route(""), 10)) == 1
        time.sleep(1.1)  # the survey ages past one interval: the age is what is tested, not a wait for something
        assert peers(loop.run(route(""), 10)) == 1  # at once, the second lookup hanging
        assert second_began.wait(10) and lookups == [1, 2]
        assert peers(loop.run(route(""), 10)) == 1 and lookups == [1, 2]  # one lookup behind, not one a request
        let_through.set()
        loop.run(asyncio.wait({route._refreshing}), 30)
        assert peers(loop.run(route(""), 10)) == 2 and lookups == [1, 2]
        monkeypatch.setattr(status, "STALE_INTERVALS", 1)  # no answer is served stale any more
        time.sleep(1.1)
        assert peers(loop.run(route(""), 10)) == 3 and lookups == [1, 2, 3]  # it waited for its own lookup
    finally:
        let_through.set()
        loop.run(route.close(), 10)
        loop.stop()


def test_a_request_head_sent_a_byte_at_a_time_is_cut_off_at_the_head_timeout(monkeypatch):
    monkeypatch.setattr(status, "HEAD_TIMEOUT", 1.0)
    with endpoint(HONEST) as (_, _, address), connect(address) as slow:
        stop = threading.Event()

        def trickle() -> None:  # a header that never ends, one byte every 50 ms: each read is quick, the whole is not
            try:
                slow.sendall(b"GET /peers HTTP/1.1\r\nX-Slow: ")
                while not stop.wait(0.05):
                    slow.sendall(b"a")
            except OSError:  # the server dropped it
                pass

        started = time.monotonic()
        sender = threading.Thread(target=trickle)
        sender.start()
        try:
            answer = slow.recv(1 << 16)
            elapsed = time.monotonic() - started
        finally:
            stop.set()
            sender.join(10)
    assert answer.startswith(b"HTTP/1.1 400 ")
    assert status.HEAD_TIMEOUT <= elapsed < status.HEAD_TIMEOUT + 2.0


@contextmanager
def answering(answer: bytes | Callable[[socket.socket], None]):
    """Not a p2ploco node: a server at 127.0.0.1 that reads a request head and writes ``answer`` (or lets ``answer``
    write), then closes; yields its HOST:PORT."""
    listening = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                connection, _ = listening.accept()
            except OSError:  # shut down: the test is over
                return
            with connection:
                try:
                    connection.settimeout(10)
                    head = b""
                    while b"\r\n\r\n" not in head and (piece := connection.recv(4096)):
                        head += piece
                    answer(connection) if callable(answer) else connection.sendall(answer)
                except OSError:  # the client gave up on it
                    pass

    server = threading.Thread(target=serve)
    server.start()
    try:
        yield f"127.0.0.1:{listening.getsockname()[1]}"
    finally:
        listening.shutdown(socket.SHUT_RDWR)
        listening.close()
        server.join(10)


def test_the_client_gives_up_on_an_answer_sent_a_byte_at_a_time_within_its_timeout():
    def trickle(connection: socket.socket) -> None:
        for byte in b"HTTP/1.1 200 OK\r\n" + b"X-Slow: a\r\n" * 1000:
            connection.sendall(bytes([byte]))
            time.sleep(0.02)

    with answering(trickle) as address:
        started = time.monotonic()
        with pytest.raises(SwarmError, match=f"^http://{address}/peers did not answer within 1 s$"):
            read_status(address, timeout=1.0)
        assert time.monotonic() - started < 2.0


def ok(body: bytes, head: bytes = b"HTTP/1.1 200 OK\r\nConnection: close\r\n") -> bytes:
    return head + b"\r\n" + body


VALID = json.loads(status_answer(survey_of(HONEST[:1])))


def document(**changes: object) -> bytes:
    return json.dumps({**VALID, **changes}).encode()


@pytest.mark.parametrize("answer, why", [
    (ok(document(peers=[{**VALID["peers"][0], "expires_in": 10**400}])), "(StatusDocument: peers.0.expires_in: "),
    (ok(document(peers=[{**VALID["peers"][0], "loss": 10**400}])), "(StatusDocument: peers.0.loss: "),
    (ok(document(truncated=-1)), "(StatusDocument: truncated: "),
    (ok(document(run_id=7)), "(StatusDocument: run_id: Input should be a valid string)"),
    (ok(document(format=2)), "(StatusDocument: format: Value error, this p2ploco reads status format 1)"),
    (ok(document(format=True)), "(StatusDocument: format: Input should be a valid integer)"),
    (ok(document(peers={"a": 1})), "(StatusDocument: peers: Input should be a valid list)"),
    (ok(b"[1, 2]"), "(StatusDocument: the message: Input should be a valid dictionary"),
    (ok(b"\xff\xfe{\x00"), "did not answer with a p2ploco status ("),  # not UTF-8
    (ok(b"[" * 100_000), "did not answer with a p2ploco status ("),  # nested past Python's recursion limit
    (ok(b"1" * 5000), "did not answer with a p2ploco status (Exceeds the limit (4300 digits)"),
    (ok(b" " * (MAX_ANSWER_HEAD + MAX_STATUS_BYTES)), "answered more than 4 MiB: not a p2ploco status"),
    (ok(b"{}", b"HTTP/1.1 200 OK\r\nContent-Length: " + str(10**30).encode() + b"\r\n"),
     f"announced {10**30} bytes: a p2ploco status is at most 4 MiB"),
    (ok(document(), b"HTTP/1.1 200 OK\r\nContent-Length: 99999\r\n"), "did not answer in HTTP (IncompleteRead)"),
    (ok(b"", b"HTTP/1.1 302 Found\r\nLocation: http://169.254.169.254/\r\n"), "answered 302 Found: is this a"),
    (ok(b"", b"HTTP/1.1 500 \x1b[2J\x1b]0;owned\x07\r\n"), "answered 500 \\x1b[2J\\x1b]0;owned\\x07: is this a"),
    (ok(b"{}", b"HTTP/1.1 200 OK\r\n" + b"X: y\r\n" * 200), "did not answer in HTTP (HTTPException)"),
    (b"\x00\xff garbage\r\n\r\n", "did not answer in HTTP (BadStatusLine)"),
    (b"", "did not answer in HTTP (RemoteDisconnected)"),
])
def test_a_hostile_answer_is_one_printable_line(answer, why):
    with answering(answer) as address:
        with pytest.raises(SwarmError) as refused:
            read_status(address)
    message = str(refused.value)
    assert message.startswith(f"http://{address}/peers ") and why in message, message
    assert message.isprintable() and len(message) < 400


async def current_thread() -> threading.Thread:
    return threading.current_thread()


def test_a_survey_of_padded_records_is_capped_and_built_off_the_loop(monkeypatch):
    """1,800 records padded with control characters, as a DHT lookup may hold them (42 MB of JSON whole): the
    answer stays under the cap, keeps every honest record, counts what it left out, and is built on a thread other
    than the loop's (building it on the loop held the loop 165-680 ms here: docs/design.md, "Inspection")."""
    peers = HONEST[:10] + [padded(i) for i in range(1800)] + HONEST[10:]
    built_on: list[threading.Thread] = []

    def recorded(survey: Survey) -> bytes:
        built_on.append(threading.current_thread())
        return status_answer(survey)

    monkeypatch.setattr(status, "status_answer", recorded)
    with endpoint(peers) as (loop, _, address):
        loop_thread = loop.run(current_thread(), 10)
        body = fetch(address)  # the first request: the answer is built now
        survey = read_status(address)
    assert len(built_on) == 1 and built_on[0] is not loop_thread
    assert len(body) <= MAX_STATUS_BYTES
    kept = json.loads(body)
    assert kept["truncated"] == len(peers) - len(kept["peers"]) > 0
    assert survey.truncated == kept["truncated"] and {h.peer_id for h in HONEST} <= {p.peer_id for p in survey.peers}
