"""The dashboard's documents, its page as a status server serves it, and the relay of ``p2ploco dashboard --from``:
real servers on real event loops, real sockets, real round records. The page in a real browser over a real swarm,
and the command as a process, are test_inspect.py's."""

import json
import socket
import threading
from contextlib import contextmanager
from importlib.resources import files

import pytest

from p2ploco.dashboard import documents
from p2ploco.dashboard.documents import ROUNDS_DOCUMENT, RUN_STATUS, RoundsFeed, outcome_of, run_status
from p2ploco.dashboard.page import page_routes
from p2ploco.dashboard.relay import relay_routes
from p2ploco.metrics import RoundSummary
from p2ploco.swarm.loop import EventLoopThread
from p2ploco.swarm.status import Answer, Host, Route, StatusServer, constant, listen


def record(round_index: int, **changes: object) -> RoundSummary:
    fields = {"peers": 3, "loss": 3.0 - round_index / 10, "eval_loss": None, "params_digest": "a" * 64,
              "round_seconds": 1.5, "tokens": 100, "inner_seconds": 1.0, "comm_seconds": 0.5,
              "aggregate_tokens": 250, **changes}
    return RoundSummary(round=round_index, **fields)


def test_the_rounds_document_pages_forward_from_a_round_and_holds_only_what_json_holds(monkeypatch):
    records = [record(r) for r in range(4)]
    records.append(record(4, loss=float("nan"), eval_loss=float("inf"), applied=False, excluded=True,
                          failures={"late": 1}, aggregate_tokens=0))
    weights = {"peer-a": 100, "peer-b": 50, "peer-c": 100}
    feed = RoundsFeed("peer-a", records, lambda: weights)
    whole = json.loads(feed.answer(-1))
    assert whole["format"] == 1 and whole["peer_id"] == "peer-a" and whole["more"] is False
    assert [r["round"] for r in whole["rounds"]] == [0, 1, 2, 3, 4]
    assert whole["rounds"][4]["loss"] is None and whole["rounds"][4]["eval_loss"] is None  # not NaN: no JSON
    assert whole["rounds"][4]["outcome"] == "not applied: late" and whole["rounds"][4]["aggregate_tokens"] == 0
    assert whole["rounds"][3]["aggregate_tokens"] == 250 and whole["rounds"][3]["outcome"] == "applied"
    assert whole["weights"] == {"peer-a": 100, "peer-b": 50, "peer-c": 100}  # the newest aggregate applied
    assert [r["round"] for r in json.loads(feed.answer(2))["rounds"]] == [3, 4]
    assert json.loads(feed.answer(4))["rounds"] == []
    records.append(record(7))  # rounds may skip (a node that caught up)
    weights = {"peer-a": 10}
    assert [r["round"] for r in json.loads(feed.answer(4))["rounds"]] == [7]
    assert json.loads(feed.answer(5))["weights"] == {"peer-a": 10}  # as the node holds them when asked
    monkeypatch.setattr(documents, "MAX_ROUNDS_PER_ANSWER", 2)
    pages, after = [], -1
    while True:  # as the page asks, a long run's rounds in several answers
        answer = json.loads(feed.answer(after))
        pages.append([r["round"] for r in answer["rounds"]])
        if not answer["more"]:
            break
        after = pages[-1][-1]
    assert pages == [[0, 1], [2, 3], [4, 7]]


@pytest.mark.parametrize("changes, outcome", [
    ({}, "applied"),
    ({"peers": 1}, "applied alone"),
    ({"attempts": 2}, "applied after a redo"),
    ({"sat_out": True, "applied": False}, "sat out"),
    ({"applied": False, "excluded": True}, "not applied: others went on without it"),
    ({"applied": False, "failures": {"timeout": 2, "aborted": 1}}, "not applied: aborted, timeout"),
    ({"applied": False}, "not applied: no aggregate"),
])
def test_a_rounds_outcome_says_how_it_ended_in_a_few_words(changes, outcome):
    assert outcome_of(record(3, **changes)) == outcome


@contextmanager
def serving(routes: dict[str, Route]):
    """A status server with ``routes`` on its own event loop; yields its HOST:PORT."""
    loop = EventLoopThread("dashboard-server")
    server = StatusServer(routes, Host("127.0.0.1"))
    listening, address = listen("127.0.0.1", 0)
    try:
        loop.run(server.start(listening), 10)
        yield address
    finally:
        loop.run(server.stop(), 10)
        loop.stop()
        listening.close()


def get(address: str, target: str, method: str = "GET") -> tuple[int, dict[str, str], bytes]:
    """The status, headers and body of the server's answer to ``method target``."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as connection:
        connection.sendall(f"{method} {target} HTTP/1.1\r\nHost: localhost\r\n\r\n".encode())
        answer = b""
        while piece := connection.recv(1 << 20):
            answer += piece
    head, body = answer.split(b"\r\n\r\n", 1)
    status_line, *lines = head.decode().split("\r\n")
    return int(status_line.split(" ")[1]), dict(line.split(": ", 1) for line in lines), body


RUN = run_status("tiny", "peer-a", "<b>bold</b>", 10.0, "p2ploco node start --run-id tiny", [("run", "tiny")])


def node_routes(records: list[RoundSummary]) -> dict[str, Route]:
    return {**page_routes(), ROUNDS_DOCUMENT: RoundsFeed("peer-a", records, dict),
            RUN_STATUS: constant(Answer(200, RUN))}


def test_the_page_and_its_documents_are_served_with_a_policy_that_runs_only_the_pages_own_scripts():
    static = files("p2ploco.dashboard") / "static"
    with serving(node_routes([record(r) for r in range(3)])) as address:
        status, headers, page = get(address, "/")
        assert status == 200 and headers["Content-Type"] == "text/html; charset=utf-8"
        assert page == (static / "index.html").read_bytes()
        for _, headers, _ in (get(address, "/"), get(address, ROUNDS_DOCUMENT)):  # on every answer
            assert "script-src 'self';" in headers["Content-Security-Policy"]
            assert "default-src 'none';" in headers["Content-Security-Policy"]
            assert headers["X-Content-Type-Options"] == "nosniff"
        status, headers, script = get(address, "/static/uPlot.iife.min.js")
        assert status == 200 and headers["Content-Type"].startswith("text/javascript")
        assert script == (static / "uPlot.iife.min.js").read_bytes()
        status, _, body = get(address, f"{ROUNDS_DOCUMENT}?after=0")
        assert status == 200 and [r["round"] for r in json.loads(body)["rounds"]] == [1, 2]
        for query in ("after=-1", "after=1e3", "round=1", "after=" + "9" * 20):
            status, _, body = get(address, f"{ROUNDS_DOCUMENT}?{query}")
            assert (status, body) == (400, b"ask /api/v1/rounds?after=ROUND (the newest round held) or for all "
                                           b"rounds\n"), query
        status, _, body = get(address, "/../etc/passwd")
        assert status == 404 and body.startswith(b"this node serves /, /api/v1/rounds, /api/v1/run, /static/")
        status, headers, body = get(address, "/", method="HEAD")
        assert status == 200 and body == b"" and int(headers["Content-Length"]) == len(page)


@contextmanager
def answering(answer: bytes):
    """A server that answers ``answer`` to whatever it is sent, then closes; yields its HOST:PORT."""
    listening = socket.create_server(("127.0.0.1", 0))
    address = f"127.0.0.1:{listening.getsockname()[1]}"

    def serve() -> None:
        while True:
            try:
                connection, _ = listening.accept()
            except OSError:  # closed: the test is over
                return
            with connection:
                connection.recv(1 << 16)
                connection.sendall(answer)

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    try:
        yield address
    finally:
        listening.shutdown(socket.SHUT_RDWR)
        listening.close()
        server.join(10)


def recording(route: Route, queries: list[str]) -> Route:
    """``route``, keeping each query it is asked."""
    async def recorded(query: str) -> Answer:
        queries.append(query)
        return await route(query)

    return recorded


def test_the_relay_passes_on_the_nodes_documents_and_only_the_queries_the_page_sends():
    queries: list[str] = []
    routes = node_routes([record(r) for r in range(5)])
    routes[ROUNDS_DOCUMENT] = recording(routes[ROUNDS_DOCUMENT], queries)
    with serving(routes) as node, serving(relay_routes(node)) as relay:
        status, headers, page = get(relay, "/")
        assert status == 200 and page == get(node, "/")[2]
        assert json.loads(get(relay, RUN_STATUS)[2]) == json.loads(RUN)
        assert [r["round"] for r in json.loads(get(relay, f"{ROUNDS_DOCUMENT}?after=2")[2])["rounds"]] == [3, 4]
        assert get(relay, f"{ROUNDS_DOCUMENT}?after=2%0d%0aX-Evil:%201")[0] == 400
        assert get(relay, f"{RUN_STATUS}?x=1")[0] == 400
        assert queries == ["after=2"]  # what the relay refused never reached the node


def broken(body: bytes, head: bytes = b"HTTP/1.1 200 OK\r\nConnection: close\r\n") -> bytes:
    return head + b"\r\n" + body


@pytest.mark.parametrize("answer, why", [
    (broken(b"<script>alert(1)</script>"), "did not answer with a p2ploco status (Expecting value"),
    (broken(b'{"format": 2}'), "is not a p2ploco document of format 1 (format 2)"),
    (broken(b"[1]"), "is not a p2ploco document of format 1 (format None)"),
    (broken(b'{"format": 1, "x": NaN}'), "holds a number that JSON has not (NaN or Infinity)"),
    (broken(b"", b"HTTP/1.1 500 \x1b[2J\r\n"), "answered 500 \\x1b[2J: is this a p2ploco node's --status-port?"),
    (b"\x00 garbage\r\n\r\n", "did not answer in HTTP (BadStatusLine)"),
])
def test_a_node_that_answers_anything_but_a_document_is_one_line_from_the_relay(answer, why):
    with answering(answer) as node, serving(relay_routes(node)) as relay:
        status, headers, body = get(relay, RUN_STATUS)
    message = body.decode()
    assert status == 502 and headers["Content-Type"].startswith("text/plain")
    assert message.startswith(f"http://{node}{RUN_STATUS} ") and why in message, message
    assert message.endswith("\n") and message[:-1].isprintable() and len(message) < 400


def test_a_relay_whose_node_is_gone_says_so_and_serves_the_page_still():
    with socket.create_server(("127.0.0.1", 0)) as placeholder:
        gone = f"127.0.0.1:{placeholder.getsockname()[1]}"
    with serving(relay_routes(gone)) as relay:
        status, _, body = get(relay, ROUNDS_DOCUMENT)
        assert status == 502 and body.startswith(f"cannot read http://{gone}/api/v1/rounds (".encode())
        assert get(relay, "/")[0] == 200  # the page says what is wrong, and tries again

