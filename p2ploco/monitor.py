"""Looking at a swarm from outside: its peers' records, as a table, JSON, or a summary of the run.

``p2ploco peers`` lists the live peers of a run; ``p2ploco status`` sums the run up. Both read a ``Survey``
of the run, one of two ways:

- from the DHT (``swarm/survey.py``): the client joins in client mode (it serves and stores nothing) with the
  same record validator as the nodes, so records with a bad signature or schema are dropped before they are
  read. Starting a p2p daemon and looking up takes seconds (``benchmarks/peers_cli.py``).
- from a node's status endpoint (``--from HOST:PORT``, ``swarm/status.py``): one HTTP request to a node that
  already holds the records. This module and what it imports load neither hivemind nor torch, so that path
  answers in a fraction of a second. The node is trusted to report what it sees, but what it answers is read as
  anyone's: within STATUS_TIMEOUT in all (however slowly it is sent), at most MAX_STATUS_BYTES, and decoded by a
  strict, bounded model (``StatusDocument``), so a broken or hostile endpoint gets a one-line error, never a
  traceback (``benchmarks/fuzz.py`` drives ``parse_answer`` with mutated and malformed answers).

The status document, format 1: what ``GET /peers`` answers and ``p2ploco peers --json`` prints (``peers_json``)::

    {"format": 1, "run_id": RUN, "truncated": N, "peers": [{...a peer record..., "expires_in": SECONDS}, ...]}

``truncated`` counts the records a node left out to keep its answer within MAX_STATUS_BYTES (``status_answer``:
the largest go first); it is 0 from the DHT. A change that an older client would misread gets a new format.
Every string a record holds is anyone's: it is shown through ``errors.shown``.
"""

from __future__ import annotations

import http.client
import io
import json
import socket
import statistics
import time
from collections import Counter
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, StringConstraints

from p2ploco.errors import PayloadError, SwarmError, shown
from p2ploco.metrics import format_table, human_bytes
from p2ploco.swarm.messages import decode
from p2ploco.swarm.records import Amount, Count, PeerRecord

STATUS_PATH = "/peers"  # what a node's status endpoint serves: ``status_answer`` of its survey
STATUS_FORMAT = 1  # of the status document (above)
STATUS_TIMEOUT = 5.0  # for a whole request: connecting, sending it, and receiving the answer
# What a node's status answer holds at most, and what a client reads: about 3,500 honest records (about 1.2 KB of
# JSON each); records padded out to 24 KB each are left out first.
MAX_STATUS_BYTES = 4 << 20
MAX_ANSWER_HEAD = 64 << 10  # bytes of status line and headers a client reads before the body


@dataclass
class Survey:
    """One look at a run: its live peers (bootstrap peers included) and when each record lapses."""

    run_id: str
    peers: list[PeerRecord]
    expires_in: dict[str, float]  # peer id -> seconds until its record lapses
    truncated: int = 0  # records a node left out of its status answer (``status_answer``)

    @property
    def trainers(self) -> list[PeerRecord]:
        return [p for p in self.peers if p.role != "bootstrap"]

    @classmethod
    def from_json(cls, document: object) -> Survey:
        """The survey in ``peers_json``'s form; PayloadError names the first field that does not fit it."""
        served = decode(StatusDocument, document)
        return cls(served.run_id, list(served.peers), {p.peer_id: p.expires_in for p in served.peers},
                   served.truncated)


def _run_name(run_id: str) -> str:
    if "/" in run_id or not run_id.isprintable():
        raise ValueError("not a run's name")
    return run_id


def _status_format(number: int) -> int:
    if number != STATUS_FORMAT:
        raise ValueError(f"this p2ploco reads status format {STATUS_FORMAT}")
    return number


class ServedRecord(PeerRecord):
    """A peer record as a status document lists it: with the seconds until it lapses."""

    expires_in: Amount


class StatusDocument(BaseModel):
    """The status document (format 1, above), as a client decodes it: strict and bounded, since anyone may answer
    at an address (a JSON integer may have thousands of digits; ``Amount`` refuses what no float holds)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    format: Annotated[int, AfterValidator(_status_format)]
    run_id: Annotated[str, StringConstraints(min_length=1, max_length=64), AfterValidator(_run_name)]
    truncated: Count
    peers: list[ServedRecord]


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
    """The survey a node serves at ``address`` (HOST:PORT, its ``--status-port``), read within ``timeout`` in all.
    A plain socket, not urllib: a node is dialled directly, never through a proxy the environment names, and a
    redirect is not followed."""
    host, port = _host_and_port(address)
    url = f"http://{address}{STATUS_PATH}"
    try:
        received = _receive(host, port, address, time.monotonic() + timeout)
    except TimeoutError:
        raise SwarmError(f"{url} did not send its status within {timeout:.0f} s") from None
    except (OSError, UnicodeError) as e:  # refused, unreachable, unknown host (or one IDNA cannot encode)
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise SwarmError(f"cannot read {url} ({shown(why, 200)}): is a node started with --status-port {port} "
                         f"running there?") from None
    if received is None:
        raise SwarmError(f"{url} answered more than {MAX_STATUS_BYTES >> 20} MiB: not a p2ploco status")
    return parse_answer(url, received)


def _receive(host: str, port: int, address: str, deadline: float) -> bytes | None:
    """What the node at ``host``, ``port`` answers to ``GET STATUS_PATH``, up to the end of the connection (a node
    closes it after its answer); None if that is more than a status answer may be. TimeoutError at ``deadline``:
    the bound is on the whole answer, not on each read (a server that sends a byte at a time would otherwise hold
    the client for as long as it likes)."""
    def left() -> float:
        seconds = deadline - time.monotonic()
        if seconds <= 0:
            raise TimeoutError
        return seconds

    received = bytearray()
    with socket.create_connection((host, port), timeout=left()) as connection:
        connection.settimeout(left())
        connection.sendall(f"GET {STATUS_PATH} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n".encode())
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
        return Survey.from_json(json.loads(body))
    except (ValueError, RecursionError, PayloadError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise SwarmError(f"{url} did not answer with a p2ploco status ({shown(str(e), 200)})") from None


def _duration(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{seconds:02d}s"


def _number(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


COLUMNS = ("name", "peer", "role", "group", "stage", "state", "reach", "round", "step", "loss", "eval", "tok/s", "sent",
           "recv", "ratio", "uptime", "device", "address")


def peer_rows(s: Survey) -> list[tuple[str, ...]]:
    rows = []
    for p in s.peers:
        trains = p.role != "bootstrap"
        staged = p.role == "stage"
        rows.append((p.name, p.peer_id[-8:], p.role, p.group if staged else "-", str(p.stage) if staged else "-",
                     p.state, str(p.reachability), str(p.round) if trains else "-",
                     str(p.inner_step) if trains else "-", _number(p.loss), _number(p.eval_loss),
                     f"{p.tokens_per_second / 1e3:.1f}k" if trains else "-",
                     human_bytes(p.bytes_sent) if trains else "-", human_bytes(p.bytes_received) if trains else "-",
                     f"{p.compression:.0f}x" if p.compression else "-", _duration(p.uptime), p.device or "-",
                     p.addresses[0] if p.addresses else "-"))
    return [tuple(map(shown, row)) for row in rows]  # a record's strings are anyone's


def _left_out(s: Survey) -> str:
    """What a title says of the records a node left out of its status answer (``status_answer``)."""
    return f"; {s.truncated} more left out by the node (over {MAX_STATUS_BYTES >> 20} MiB)" if s.truncated else ""


def peers_text(s: Survey) -> str:
    title = (f"run '{shown(s.run_id)}': {len(s.trainers)} training peer(s), {len(s.peers) - len(s.trainers)} "
             f"bootstrap{_left_out(s)}")
    return title + "\n" + format_table(COLUMNS, peer_rows(s))


# Columns in the order they are given up when a terminal is too narrow for all (last first).
PRIORITY = ("name", "state", "round", "loss", "eval", "tok/s", "reach", "role", "group", "stage", "step", "ratio",
            "uptime",
            "sent", "recv", "peer", "device", "address")


def peers_rich(s: Survey, width: int) -> Any:
    """The same table for a terminal of ``width`` columns, with rich: as many columns as fit, the most
    telling first (--json and piped output always have them all)."""
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    rows = peer_rows(s)
    # a cell's text, a space of padding on each side, and one for the column separator
    needed = {c: max([len(c), *(len(row[i]) for row in rows)]) + 3 for i, c in enumerate(COLUMNS)}
    fitting, used = set(), 1
    for column in PRIORITY:
        if used + needed[column] <= width:
            fitting.add(column)
            used += needed[column]
    visible = [i for i, c in enumerate(COLUMNS) if c in fitting]
    table = Table(title=f"run [bold]{escape(shown(s.run_id))}[/]: {len(s.trainers)} training peer(s){_left_out(s)}",
                  title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    styles = {"training": "green", "averaging": "cyan", "joining": "yellow", "standby": "yellow", "leaving": "red",
              "serving": "dim"}
    for i in visible:
        left = COLUMNS[i] in ("name", "peer", "role", "group", "state", "reach", "device", "address")
        table.add_column(COLUMNS[i], no_wrap=True, justify="left" if left else "right")
    for record, row in zip(s.peers, rows):
        table.add_row(*(escape(row[i]) for i in visible), style=styles.get(record.state))
    return table


def _served(p: PeerRecord, s: Survey) -> dict[str, Any]:
    return {**p.to_value(), "expires_in": s.expires_in[p.peer_id]}


def peers_json(s: Survey) -> dict[str, Any]:
    """The status document of ``s`` (format 1, above)."""
    return {"format": STATUS_FORMAT, "run_id": s.run_id, "truncated": s.truncated, "peers": [_served(p, s)
                                                                                              for p in s.peers]}


def status_answer(s: Survey, limit: int = MAX_STATUS_BYTES) -> bytes:
    """``peers_json(s)`` as UTF-8 JSON of at most ``limit`` bytes: what a node's status endpoint serves.

    Records are serialized one at a time: a node runs this in a thread, and json.dumps holds the GIL for all it
    serializes in one call (a whole survey of 1,800 padded records in one call stalled the node's event loop for
    as long as from the loop itself). When the records do not all fit, the smallest are kept (listed in the
    survey's order) and ``truncated`` counts the others: an honest record is about 1.2 KB of JSON, one padded with
    control characters (six bytes of JSON each) up to 24 KB, so it is padding that is left out first."""
    def opening(truncated: int) -> bytes:  # the document up to its list of records, as json.dumps writes it
        head = {"format": STATUS_FORMAT, "run_id": s.run_id, "truncated": truncated}
        return json.dumps(head, ensure_ascii=False).encode()[:-1] + b', "peers": ['

    records = [json.dumps(_served(p, s), ensure_ascii=False).encode() for p in s.peers]
    room = limit - len(opening(len(records))) - len(b"]}")  # the largest count takes the most room
    kept = set()
    for i in sorted(range(len(records)), key=lambda i: len(records[i])):
        if len(records[i]) + 2 > room:  # with its separator
            break
        kept.add(i)
        room -= len(records[i]) + 2
    return opening(len(records) - len(kept)) + b", ".join(r for i, r in enumerate(records) if i in kept) + b"]}"


def _eval_trend(trainers: list[PeerRecord]) -> list[tuple[int, float]]:
    """Eval loss per round over the peers' recent histories (the median where peers differ)."""
    by_round: dict[int, list[float]] = {}
    for p in trainers:
        for round_index, loss in p.eval_history:
            by_round.setdefault(int(round_index), []).append(loss)
    return [(r, statistics.median(losses)) for r, losses in sorted(by_round.items())]


def status_json(s: Survey) -> dict[str, Any]:
    trainers = s.trainers
    working = [p for p in trainers if p.state in ("training", "averaging")] or trainers
    reported = [p for p in trainers if p.round_seconds]
    return {
        "run_id": s.run_id,
        "round": max((p.round for p in working), default=None),
        "peers": len(trainers),
        "truncated": s.truncated,
        "roles": dict(Counter(p.role for p in s.peers)),
        "states": dict(Counter(p.state for p in trainers)),
        "reachability": dict(Counter(str(p.reachability) for p in trainers)),
        "tokens_per_second": round(sum(p.tokens_per_second for p in trainers), 1),
        "last_round": {
            "seconds": round(statistics.median(p.round_seconds for p in reported), 2) if reported else None,
            "bytes_sent": round(statistics.mean(p.bytes_sent for p in reported)) if reported else None,
            "bytes_received": round(statistics.mean(p.bytes_received for p in reported)) if reported else None,
            "compression": round(statistics.median(p.compression for p in reported), 1) if reported else None,
        },
        "eval_loss": [[r, round(loss, 4)] for r, loss in _eval_trend(trainers)],
    }


def status_text(s: Survey) -> str:
    j = status_json(s)
    roles = ", ".join(f"{count} {role}" for role, count in sorted(j["roles"].items()))
    states = ", ".join(f"{count} {state}" for state, count in sorted(j["states"].items())) or "-"
    last = j["last_round"]
    evals = j["eval_loss"][-8:]
    if len(evals) >= 2:
        change = evals[-1][1] - evals[0][1]
        trend = (f"{' -> '.join(f'{loss:.3f}' for _, loss in evals)} (rounds {evals[0][0]}-{evals[-1][0]}, "
                 f"{'falling' if change < 0 else 'not falling'}: {change:+.3f})")
    else:
        trend = f"{evals[0][1]:.3f} (round {evals[0][0]})" if evals else "-"
    rows = [
        ("run", shown(s.run_id)),
        ("round", "-" if j["round"] is None else str(j["round"])),
        ("peers", f"{roles} ({states}){_left_out(s)}"),
        ("reachability", ", ".join(f"{count} {reach}" for reach, count in sorted(j["reachability"].items())) or "-"),
        ("throughput", f"{j['tokens_per_second'] / 1e3:.1f}k tokens/s in total"),
        ("last round", "-" if last["seconds"] is None else
         f"{last['seconds']:.1f} s; per peer sent {human_bytes(last['bytes_sent'])}, received "
         f"{human_bytes(last['bytes_received'])} ({last['compression']:.0f}x under dense fp32)"),
        ("eval loss", trend),
    ]
    return format_table(("swarm", "now"), rows)
