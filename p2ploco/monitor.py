"""Looking at a swarm from outside, on a terminal: its peers' records as a table, or a summary of the run.

``p2ploco peers`` lists the live peers of a run; ``p2ploco status`` sums the run up. Both render a ``Survey``
(``swarm/status_document.py``) read one of two ways:

- from the DHT (``swarm/survey.py``): the client joins in client mode (it serves and stores nothing) with the
  same record validator as the nodes, so records with a bad signature or schema are dropped before they are
  read. Starting a p2p daemon and looking up takes seconds (``benchmarks/peers_cli.py``).
- from a node's status endpoint (``--from HOST:PORT``, ``swarm/status_client.py``): one HTTP request to a node
  that already holds the records; this module, like that one, loads neither hivemind nor torch.

Every string a record holds is anyone's: it is shown through ``errors.shown``.
"""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Any

from p2ploco.errors import shown
from p2ploco.metrics import format_table, human_bytes
from p2ploco.swarm.records import PeerRecord, PeerRole
from p2ploco.swarm.status_document import MAX_STATUS_BYTES, Survey


def _duration(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{seconds:02d}s"


def _number(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


COLUMNS = ("name", "peer", "role", "group", "stage", "state", "reach", "takes part", "round", "step", "loss", "eval",
           "tok/s", "sent", "recv", "ratio", "uptime", "ranks", "device", "address")


def peer_rows(s: Survey) -> list[tuple[str, ...]]:
    rows = []
    for p in s.peers:
        trains = p.role != PeerRole.BOOTSTRAP
        staged = p.role == PeerRole.STAGE
        rows.append((p.name, p.peer_id[-8:], p.role, p.group if staged else "-", str(p.stage) if staged else "-",
                     p.state, str(p.reachability), s.takes_part(p), str(p.round) if trains else "-",
                     str(p.inner_step) if trains else "-", _number(p.loss), _number(p.eval_loss),
                     f"{p.tokens_per_second / 1e3:.1f}k" if trains else "-",
                     human_bytes(p.bytes_sent) if trains else "-", human_bytes(p.bytes_received) if trains else "-",
                     f"{p.compression:.0f}x" if p.compression else "-", _duration(p.uptime),
                     str(p.ranks) if trains else "-", p.device or "-",
                     p.addresses[0] if p.addresses else "-"))
    return [tuple(map(shown, row)) for row in rows]  # a record's strings are anyone's


def _hubs(s: Survey) -> str:
    """What a title says of the run's hubs ("" where it has none)."""
    return f", {len(s.hubs)} hub(s)" if s.hubs else ""


def _left_out(s: Survey) -> str:
    """What a title says of the records a node left out of its status answer (``status_answer``)."""
    return f"; {s.truncated} more left out by the node (over {MAX_STATUS_BYTES >> 20} MiB)" if s.truncated else ""


def peers_text(s: Survey) -> str:
    title = (f"run '{shown(s.run_id)}': {len(s.trainers)} training peer(s){_hubs(s)}, "
             f"{len(s.peers) - len(s.trainers) - len(s.hubs)} bootstrap{_left_out(s)}")
    return title + "\n" + format_table(COLUMNS, peer_rows(s))


# Columns in the order they are given up when a terminal is too narrow for all (last first).
PRIORITY = ("name", "state", "round", "loss", "eval", "tok/s", "takes part", "reach", "role", "group", "stage", "step",
            "ratio",
            "uptime",
            "sent", "recv", "peer", "ranks", "device", "address")


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
    table = Table(title=f"run [bold]{escape(shown(s.run_id))}[/]: {len(s.trainers)} training peer(s){_hubs(s)}"
                        f"{_left_out(s)}",
                  title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    styles = {"training": "green", "averaging": "cyan", "joining": "yellow", "standby": "yellow", "leaving": "red",
              "serving": "dim"}
    for i in visible:
        left = COLUMNS[i] in ("name", "peer", "role", "group", "state", "reach", "takes part", "device", "address")
        table.add_column(COLUMNS[i], no_wrap=True, justify="left" if left else "right")
    for record, row in zip(s.peers, rows):
        table.add_row(*(escape(row[i]) for i in visible), style=styles.get(record.state))
    return table


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
        "takes_part": dict(Counter(s.takes_part(p) for p in trainers)),
        "coordinators": len(s.coordinators),  # peers that can coordinate and reduce: hubs and public trainers
        "ranks": sum(p.ranks for p in trainers),  # local ranks (devices) training, over all peers
        "devices": dict(Counter(p.device or "?" for p in trainers)),  # peers by what they train on
        "tokens_per_second": round(sum(p.tokens_per_second for p in trainers), 1),
        "last_round": {
            "seconds": round(statistics.median(p.round_seconds for p in reported), 2) if reported else None,
            "bytes_sent": round(statistics.mean(p.bytes_sent for p in reported)) if reported else None,
            "bytes_received": round(statistics.mean(p.bytes_received for p in reported)) if reported else None,
            "compression": round(statistics.median(p.compression for p in reported), 1) if reported else None,
        },
        "eval_loss": [[r, round(loss, 4)] for r, loss in _eval_trend(trainers)],
        "hubs": [hub_load(p) for p in s.hubs],
    }


def hub_load(hub: PeerRecord) -> dict[str, Any]:
    """What a hub's last round took of its link: its bytes, and the busier direction's share of the link's rate over
    the round (``link_use``; None where its operator stated no rate, ``swarm.bandwidth_mbit``)."""
    busier = max(hub.bytes_sent, hub.bytes_received)
    use = (busier * 8 / (hub.bandwidth_mbit * 1e6 * hub.round_seconds)
           if hub.bandwidth_mbit and hub.round_seconds else None)
    return {"name": hub.name, "peer_id": hub.peer_id, "bytes_per_round": hub.bytes_sent + hub.bytes_received,
            "round_seconds": hub.round_seconds, "bandwidth_mbit": hub.bandwidth_mbit,
            "link_use": None if use is None else round(use, 4)}


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
        ("takes part", ", ".join(f"{count} {how}" for how, count in sorted(j["takes_part"].items())) or "-"),
        ("devices", f"{j['ranks']} local rank(s) on {j['peers']} peer(s): "
                    + ", ".join(f"{count} on {shown(device)}" for device, count in sorted(j["devices"].items()))
         if j["peers"] else "-"),
        ("throughput", f"{j['tokens_per_second'] / 1e3:.1f}k tokens/s in total"),
        ("last round", "-" if last["seconds"] is None else
         f"{last['seconds']:.1f} s; per peer sent {human_bytes(last['bytes_sent'])}, received "
         f"{human_bytes(last['bytes_received'])} ({last['compression']:.0f}x under dense fp32)"),
        ("eval loss", trend),
        ("hubs", "; ".join(
            f"{shown(h['name'])}: {human_bytes(h['bytes_per_round'])} a round"
            + (f", {100 * h['link_use']:.0f}% of its {h['bandwidth_mbit']:g} Mbit/s" if h["link_use"] is not None
               else " (its link's rate not stated)") for h in j["hubs"]) or "-"),
    ]
    table = format_table(("swarm", "now"), rows)
    if j["peers"] and not j["coordinators"]:
        table += (f"\nwarning: {j['peers']} trainer(s), none of which can be dialled, and no hub: nobody can "
                  f"coordinate a round, and none of them applies one. Start a hub (`p2ploco dht` hosts one unless "
                  f"--no-hub; or `p2ploco node start --role hub` on a machine others can dial), a trainer others can "
                  f"dial, or forward a port to one")
    return table
