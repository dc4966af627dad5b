"""Looking at a swarm from outside: a DHT client reads the peers' signed records and shows them.

``p2ploco peers`` lists the live peers of a run; ``p2ploco status`` sums the run up. The client joins
the DHT in client mode (it serves and stores nothing) with the same record validator as the nodes,
so records with a bad signature or schema are dropped before they are read.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from hivemind.dht.node import DHTNode
from hivemind.utils import get_dht_time

from p2ploco.errors import SwarmError
from p2ploco.metrics import format_table, human_bytes
from p2ploco.swarm.records import BOOTSTRAP_KEY, RUNS_KEY, PeerRecord, parse_records, peers_key
from p2ploco.swarm.schema import RecordSchema

T = TypeVar("T")
LOOKUP_PATIENCE = 3.0  # a client that just joined may need a few lookups before the DHT answers in full


@dataclass
class Survey:
    """One look at a run: its live peers (bootstrap peers included) and when each record lapses."""

    run_id: str
    peers: list[PeerRecord]
    expires_in: dict[str, float]  # peer id -> seconds until its record lapses

    @property
    def trainers(self) -> list[PeerRecord]:
        return [p for p in self.peers if p.role != "bootstrap"]


async def _patiently(look: Callable[[], Awaitable[T]], enough: Callable[[T], bool]) -> T:
    """``look`` again every 0.3 s until its answer is ``enough`` or LOOKUP_PATIENCE has passed; the last answer."""
    deadline = time.monotonic() + LOOKUP_PATIENCE
    while not enough(answer := await look()) and time.monotonic() < deadline:
        await asyncio.sleep(0.3)
    return answer


async def _runs(node: DHTNode) -> list[str]:
    found = await node.get(RUNS_KEY, latest=True)
    value = getattr(found, "value", None)
    return sorted(k for k in value if isinstance(k, str)) if isinstance(value, dict) else []


async def find_run(node: DHTNode, run_id: str | None) -> str:
    """The run to look at: ``run_id`` if someone trains it, or the only run being trained. Its records are
    schema-checked by ``node`` from here on."""
    runs = await _patiently(lambda: _runs(node), lambda runs: bool(runs) and (run_id is None or run_id in runs))
    if run_id is not None and run_id not in runs:
        if runs:
            raise SwarmError(f"no run '{run_id}' in this swarm; runs training now: {', '.join(runs)}")
        raise SwarmError(f"no peers yet: nothing is training in this swarm (looked for run '{run_id}')")
    if run_id is None:
        if not runs:
            raise SwarmError("no peers yet: nothing is training in this swarm; is this the bootstrap address "
                             "your nodes use?")
        if len(runs) > 1:
            raise SwarmError(f"several runs train in this swarm ({', '.join(runs)}): pass --run-id")
        run_id = runs[0]
    node.protocol.record_validator.extend([RecordSchema([peers_key(run_id)])])
    return run_id


async def survey(node: DHTNode, run_id: str) -> Survey:
    """The live records of ``run_id`` and of the bootstrap peers, as the DHT holds them now."""
    async def look() -> tuple[dict[str, tuple[PeerRecord, float]], float]:
        now = get_dht_time()
        found = await asyncio.gather(node.get(peers_key(run_id), latest=True), node.get(BOOTSTRAP_KEY, latest=True))
        records = {}
        for item in found:
            records.update(parse_records(getattr(item, "value", None), now))
        return records, now

    records, now = await _patiently(look, lambda answer: any(r.role != "bootstrap" for r, _ in answer[0].values()))
    peers = sorted((r for r, _ in records.values()), key=lambda r: (r.role != "bootstrap", r.name, r.peer_id))
    return Survey(run_id, peers, {p: round(e - now, 1) for p, (_, e) in records.items()})


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
    return rows


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
    from rich.table import Table

    rows = peer_rows(s)
    # a cell's text, a space of padding on each side, and one for the column separator
    needed = {c: max(len(c), *(len(row[i]) for row in rows)) + 3 for i, c in enumerate(COLUMNS)}
    fitting, used = set(), 1
    for column in PRIORITY:
        if used + needed[column] <= width:
            fitting.add(column)
            used += needed[column]
    shown = [i for i, c in enumerate(COLUMNS) if c in fitting]
    table = Table(title=f"run [bold]{s.run_id}[/]: {len(s.trainers)} training peer(s)", title_justify="left",
                  box=box.SIMPLE_HEAD, pad_edge=False)
    styles = {"training": "green", "averaging": "cyan", "joining": "yellow", "standby": "yellow", "leaving": "red",
              "serving": "dim"}
    for i in shown:
        left = COLUMNS[i] in ("name", "peer", "role", "group", "state", "reach", "device", "address")
        table.add_column(COLUMNS[i], no_wrap=True, justify="left" if left else "right")
    for record, row in zip(s.peers, rows):
        table.add_row(*(row[i] for i in shown), style=styles.get(record.state))
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
