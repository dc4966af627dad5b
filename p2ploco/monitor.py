"""Looking at a swarm from outside: its peers' records, as a table, JSON, or a summary of the run.

``p2ploco peers`` lists the live peers of a run; ``p2ploco status`` sums the run up. Both read a ``Survey``
of the run, one of two ways:

- from the DHT (``swarm/survey.py``): the client joins in client mode (it serves and stores nothing) with the
  same record validator as the nodes, so records with a bad signature or schema are dropped before they are
  read. Starting a p2p daemon and looking up takes seconds (``benchmarks/peers_cli.py``).
- from a node's status endpoint (``--from HOST:PORT``, ``swarm/status.py``): one HTTP request to a node that
  already holds the records. This module and what it imports load neither hivemind nor torch, so that path
  answers in a fraction of a second. The node is trusted to report what it sees; each record is still checked
  against the record schema, so a broken or hostile endpoint gets a one-line error, not a traceback.
"""

from __future__ import annotations

import http.client
import json
import statistics
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from p2ploco.errors import SwarmError
from p2ploco.metrics import format_table, human_bytes
from p2ploco.swarm.records import PeerRecord

STATUS_PATH = "/peers"  # what a node's status endpoint serves: ``peers_json`` of its survey
STATUS_TIMEOUT = 5.0
MAX_STATUS_BYTES = 16 << 20  # a survey of thousands of peers fits well within this


@dataclass
class Survey:
    """One look at a run: its live peers (bootstrap peers included) and when each record lapses."""

    run_id: str
    peers: list[PeerRecord]
    expires_in: dict[str, float]  # peer id -> seconds until its record lapses

    @property
    def trainers(self) -> list[PeerRecord]:
        return [p for p in self.peers if p.role != "bootstrap"]

    @classmethod
    def from_json(cls, document: object) -> Survey:
        """The survey in ``peers_json``'s form; ValueError says what does not fit it."""
        if not isinstance(document, dict) or not isinstance(document.get("peers"), list):
            raise ValueError("not an object with a run_id and a list of peers")
        run_id = document.get("run_id")
        if not isinstance(run_id, str) or not 0 < len(run_id) <= 64 or "/" in run_id or not run_id.isprintable():
            raise ValueError("its run_id is not a run's name")
        peers, expires_in = [], {}
        for item in document["peers"]:
            record = PeerRecord.parse(item)
            expires = item.get("expires_in") if isinstance(item, dict) else None
            if record is None or not isinstance(expires, int | float) or isinstance(expires, bool):
                raise ValueError(f"peer {len(peers)} is not a valid peer record with expires_in")
            peers.append(record)
            expires_in[record.peer_id] = float(expires)
        return cls(run_id, peers, expires_in)


def _host_and_port(address: str) -> tuple[str, int]:
    """The host (an IPv6 one without its brackets) and port of ``address``, HOST:PORT."""
    host, _, port = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host or not host.isascii() or not host.isprintable() or any(c in host for c in " /?#@[]") \
            or not (port.isascii() and port.isdigit() and 0 < int(port) < 65536):
        raise SwarmError(f"--from {address}: give the HOST:PORT of a node's --status-port, e.g. 127.0.0.1:8765")
    return host, int(port)


def read_status(address: str) -> Survey:
    """The survey a node serves at ``address`` (HOST:PORT, its ``--status-port``), read within STATUS_TIMEOUT.
    http.client, not urllib: a node is dialled directly, never through a proxy the environment names, and a
    redirect is not followed."""
    host, port = _host_and_port(address)
    url = f"http://{address}{STATUS_PATH}"
    deadline = time.monotonic() + STATUS_TIMEOUT
    connection = None
    try:
        connection = http.client.HTTPConnection(host, port, timeout=STATUS_TIMEOUT)
        connection.request("GET", STATUS_PATH)
        answer = connection.getresponse()
        if answer.status != 200:
            raise SwarmError(f"{url} answered {answer.status} {answer.reason}: is this a p2ploco node's "
                             f"--status-port?")
        body = b""
        while (piece := answer.read1(1 << 16)) and len(body) <= MAX_STATUS_BYTES:
            body += piece
            if time.monotonic() > deadline:
                raise SwarmError(f"{url} did not send its status within {STATUS_TIMEOUT:.0f} s")
    except http.client.HTTPException as e:  # not HTTP, or not a host http.client can dial
        raise SwarmError(f"{url} did not answer in HTTP ({type(e).__name__}): is this a p2ploco node's "
                         f"--status-port?") from None
    except OSError as e:  # refused, unreachable, unknown host, timed out
        raise SwarmError(f"cannot read {url} ({e.strerror or e}): is a node started with --status-port {port} "
                         f"running there?") from None
    finally:
        if connection is not None:
            connection.close()
    if len(body) > MAX_STATUS_BYTES:
        raise SwarmError(f"{url} answered more than {MAX_STATUS_BYTES >> 20} MiB: not a p2ploco status")
    try:
        return Survey.from_json(json.loads(body))
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise SwarmError(f"{url} did not answer with a p2ploco status ({str(e)[:200]})") from None


def _duration(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{seconds:02d}s"


def _number(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


COLUMNS = ("name", "peer", "role", "group", "stage", "state", "reach", "round", "step", "loss", "eval", "tok/s", "sent",
           "recv", "ratio", "uptime", "device", "address")


def _shown(text: str) -> str:
    """``text`` with what a terminal would act on (escape sequences, line breaks) as "?": a record's strings are
    anyone's."""
    return "".join(c if c.isprintable() else "?" for c in text)


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
    return [tuple(map(_shown, row)) for row in rows]


def peers_text(s: Survey) -> str:
    title = f"run '{s.run_id}': {len(s.trainers)} training peer(s), {len(s.peers) - len(s.trainers)} bootstrap"
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
    shown = [i for i, c in enumerate(COLUMNS) if c in fitting]
    table = Table(title=f"run [bold]{escape(s.run_id)}[/]: {len(s.trainers)} training peer(s)", title_justify="left",
                  box=box.SIMPLE_HEAD, pad_edge=False)
    styles = {"training": "green", "averaging": "cyan", "joining": "yellow", "standby": "yellow", "leaving": "red",
              "serving": "dim"}
    for i in shown:
        left = COLUMNS[i] in ("name", "peer", "role", "group", "state", "reach", "device", "address")
        table.add_column(COLUMNS[i], no_wrap=True, justify="left" if left else "right")
    for record, row in zip(s.peers, rows):
        table.add_row(*(escape(row[i]) for i in shown), style=styles.get(record.state))
    return table


def peers_json(s: Survey) -> dict[str, Any]:
    return {"run_id": s.run_id, "peers": [{**p.to_value(), "expires_in": s.expires_in[p.peer_id]} for p in s.peers]}


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
        ("run", s.run_id),
        ("round", "-" if j["round"] is None else str(j["round"])),
        ("peers", f"{roles} ({states})"),
        ("reachability", ", ".join(f"{count} {reach}" for reach, count in sorted(j["reachability"].items())) or "-"),
        ("throughput", f"{j['tokens_per_second'] / 1e3:.1f}k tokens/s in total"),
        ("last round", "-" if last["seconds"] is None else
         f"{last['seconds']:.1f} s; per peer sent {human_bytes(last['bytes_sent'])}, received "
         f"{human_bytes(last['bytes_received'])} ({last['compression']:.0f}x under dense fp32)"),
        ("eval loss", trend),
    ]
    return format_table(("swarm", "now"), rows)
