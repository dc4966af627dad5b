"""Scale: real p2ploco nodes on loopback, N = 2, 4, 8, 16, per-peer traffic and round time for two designs.

For each swarm size N (``--peers``) and design (``--designs``) the script starts a bootstrap peer (``p2ploco dht
--no-hub``) and N ``p2ploco node start`` processes, each with its own p2p daemon, all on 127.0.0.1 (port 0), with
configs/tiny.yaml (``--config``) and ``swarm.min_peers=N``, and lets them train ``--rounds`` outer rounds together.
A design is what each span's reducer sends back (``outer.sparseloco.result``):

- ``butterfly``: today's all-peer butterfly with exact results (``result=exact``): every peer gets every other
  peer's contribution to each span, so a peer's traffic grows linearly with N;
- ``resparsified``: the bounded design (``result=resparsified``, the default): the reducer sends the Top-k of the
  mean, so a peer's traffic should stay flat in N.

From the nodes' round records (``metrics.jsonl``, ``p2ploco.metrics.RoundSummary``) it prints one row per (N, design):

- bytes sent and received per peer per round (``bytes_sent``, ``bytes_received``: the all-reduce payload), means
  over every peer and the steady rounds (1 .. R-2: round 0 includes start-up, the last round evaluates and writes
  the exit checkpoint; with fewer than 3 rounds, rounds 1.., or all);
- DHT bytes sent and received per peer per round (``dht_bytes_sent``, ``dht_bytes_received``; "n/a" where the
  records have no such fields), the same means;
- the median round time (``round_seconds``) and all-reduce time (``comm_seconds``) over the steady node-rounds
  (with ``--json`` also the median inner time, and ``outer_seconds_median``: the time from one round's record to
  the next that is not the round's own, a node's outer step and record keeping; ``simulate.py --agreement`` takes
  both, as ``--inner-seconds`` and ``--outer-seconds``, to compare with this run);
- the rounds completed by all N (every node wrote its record of the round) out of R;
- hashes equal: in every one of the R rounds all N nodes applied it, in one group of N, and hold the same
  ``params_digest`` after it (``wan.hashes_agree``);
- the setting's wall time, start-up included.

Settings every node gets before any ``--set`` of yours (they change neither the traffic nor what is applied):
``training.threads=1``; ``inner.fixed_steps=true`` (every peer trains all H = 10 steps of tiny.yaml, whatever its
share of the CPU, so every round holds the same tokens); ``training.eval_every=1000`` and
``training.checkpoint_every=0`` (evaluate and checkpoint only at the start and the end);
``swarm.matchmaking_timeout=120``, ``swarm.allreduce_timeout=120``, ``swarm.peer_ttl=60`` and
``swarm.startup_timeout=600`` (N processes share the machine's cores: a peer starved of CPU for a few seconds
must not be taken for gone); and ``--reachability public`` (on loopback everyone can dial everyone: the dial-back
probe at start is skipped).

    python benchmarks/scale.py                                       # N = 2 4 8 16, both designs, 8 rounds
    python benchmarks/scale.py --peers 2 4 --designs butterfly --rounds 6
    python benchmarks/scale.py --peers 16 --rounds 10 --json          # one JSON object per (peers, design) line
    python benchmarks/scale.py --set inner.steps=5 --workdir /tmp/scale

Caveats: every process of a setting shares this machine's cores (2 on the development machine: 16 nodes get an
eighth of a core each), so round time here is bound by compute and by the start-up of N processes, not by the
network; loopback has no bandwidth limit to speak of. What a node does on a clock (its heartbeat stores its record
every ``swarm.heartbeat_interval``) then costs more per round at larger N only because the rounds last longer;
``--cpus-per-node F`` (as root, cgroup v1 cpu controller) gives every setting's swarm N x F cores, so that every
node has the same share of a CPU whatever N, as on volunteers' own machines, and rounds last about as long at
every N (``--cpus-per-node 0.125`` gives 16 nodes the 2 cores of the development machine). Read the bytes
columns for how traffic scales with N, and wan.py (capped links, one namespace per host) for what they cost in
time. Run one swarm at a time (the repository's test suite and other benchmarks start swarms too):
``flock /tmp/p2ploco-swarm.lock python benchmarks/scale.py``. Every child is reaped on return, on a failed node,
on a timeout (``--timeout`` seconds per setting), on Ctrl-C and on SIGTERM; a setting that fails or runs out of
time still gets its row, with the rounds it completed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

sys.path.insert(0, str(Path(__file__).resolve().parent))

import wan  # noqa: E402  (benchmarks/wan.py: hashes_agree, by_round, stop_all, count_params, ...)

from p2ploco.config import load_config  # noqa: E402
from p2ploco.errors import ConfigError, SwarmError  # noqa: E402
from p2ploco.launch import ADDRESS, LOOPBACK, TINY_CONFIG, Child, cli  # noqa: E402
from p2ploco.metrics import format_table, human_bytes, read_summaries, steady_rounds  # noqa: E402

DESIGNS = {"butterfly": "exact", "resparsified": "resparsified"}  # design -> outer.sparseloco.result
DEFAULT_DESIGN = "resparsified"
SETTINGS = [  # every node, before the user's --set (see the module docstring)
    "training.threads=1", "inner.fixed_steps=true", "training.eval_every=1000", "training.checkpoint_every=0",
    "swarm.matchmaking_timeout=120", "swarm.allreduce_timeout=120", "swarm.peer_ttl=60", "swarm.startup_timeout=600",
]
POLL = 1.0  # seconds between looks at the nodes' records
CPU_CGROUPS = Path("/sys/fs/cgroup/cpu")  # cgroup v1's cpu controller, for --cpus-per-node
CFS_PERIOD_US = 100_000
DHT_FIELDS = ("dht_bytes_sent", "dht_bytes_received")


@dataclass
class Outcome:
    peers: int
    design: str
    records: list[list[dict]]  # per node, its round records
    seconds: float  # the setting's wall time, start-up included
    error: str | None = None  # why it ended early (a node failed, time ran out), None when every node finished
    logs: Path = field(default_factory=Path)


def overrides_for(design: str, user: list[str]) -> list[str]:
    return [*SETTINGS, "outer.algorithm=sparseloco", f"outer.sparseloco.result={DESIGNS[design]}", *user]


class CpuShare:
    """A cgroup (v1 cpu controller) whose processes share ``cores`` cores at most; removed on ``close``."""

    def __init__(self, name: str, cores: float):
        self.path = CPU_CGROUPS / name
        try:
            self.path.mkdir(exist_ok=True)
            (self.path / "cpu.cfs_period_us").write_text(str(CFS_PERIOD_US))
            (self.path / "cpu.cfs_quota_us").write_text(str(max(1000, round(cores * CFS_PERIOD_US))))
        except OSError as e:
            raise SystemExit(f"error: --cpus-per-node needs root and cgroup v1's cpu controller at {CPU_CGROUPS} "
                             f"({e.strerror}): run as root, or leave the option out") from None

    def wrap(self, argv: list[str]) -> list[str]:
        """``argv`` started inside this cgroup (it and every process it starts, its p2p daemon included)."""
        return ["sh", "-c", f'echo $$ > {self.path / "cgroup.procs"} && exec "$@"', "sh", *argv]

    def close(self) -> None:
        try:
            self.path.rmdir()
        except OSError as e:  # a straggler still in it: the empty group is harmless, say so
            print(f"scale.py: could not remove {self.path} ({e.strerror})", file=sys.stderr)


def run_setting(peers: int, design: str, config: str, user: list[str], rounds: int, workdir: Path, timeout: float,
                progress: TextIO, cpus_per_node: float = 0.0) -> Outcome:
    """Start a bootstrap peer and ``peers`` nodes on loopback (within ``peers`` x ``cpus_per_node`` cores, if
    given), watch them train ``rounds`` rounds, and stop every child (whatever happens, Ctrl-C included). Returns
    their records, complete or not."""
    label = f"{design} N={peers}"
    share = CpuShare(f"p2ploco-scale-{os.getpid()}", peers * cpus_per_node) if cpus_per_node else None
    wrap = share.wrap if share else list
    children: list[Child] = []
    nodes: list[Child] = []
    started = time.monotonic()
    sets = [f"swarm.min_peers={peers}", *overrides_for(design, user)]
    try:
        # No hub: it would join the trainers' rounds once it has fetched their config (round 5 of 6 at N = 8), a
        # group of N + 1, and the rows measure N trainers
        bootstrap = Child("bootstrap", cli("dht", "--host-maddrs", LOOPBACK, "--no-hub"), workdir / "bootstrap.log")
        children.append(bootstrap)
        address = bootstrap.wait_for_line(ADDRESS, timeout=120).group(1)
        for i in range(peers):
            name = f"n{i:02d}"
            argv = cli("node", "start", "--config", config, "--initial-peers", address, "--host-maddrs", LOOPBACK,
                       "--log-dir", str(workdir / name), "--max-rounds", str(rounds), "--reachability", "public",
                       "--identity", str(workdir / f"{name}.key"), *[a for s in sets for a in ("--set", s)])
            child = Child(name, wrap(argv), workdir / f"{name}.log", metrics_dir=workdir / name)
            children.append(child)
            nodes.append(child)
        error = watch(label, nodes, rounds, started + timeout, progress)
    except SwarmError as e:  # the bootstrap peer never said where it listens
        error = str(e)
    finally:
        wan.stop_all(children)  # SIGTERM to all, then reap each (SIGKILL to its process group if it lingers)
        if share:
            share.close()
    records = [read_summaries(node.metrics_dir / "metrics.jsonl") for node in nodes]
    return Outcome(peers, design, records, time.monotonic() - started, error, workdir)


def watch(label: str, nodes: list[Child], rounds: int, deadline: float, progress: TextIO) -> str | None:
    """Wait until every node has exited; a line per round all nodes finished. Returns None when all exited with
    0, else why it stopped waiting (a node failed, or the deadline passed)."""
    shown: set[int] = set()
    while True:
        records = [read_summaries(node.metrics_dir / "metrics.jsonl") for node in nodes]
        for index in sorted(complete_rounds(records) - shown):
            rows = wan.by_round(records, index)
            agree = wan.hashes_agree(rows, len(nodes))
            print(f"[{label}] round {index}: round {wan.mean(r['round_seconds'] for r in rows):.1f} s, "
                  f"comm {wan.mean(r['comm_seconds'] for r in rows):.1f} s, "
                  f"sent {human_bytes(wan.mean(r['bytes_sent'] for r in rows))}/peer, "
                  f"{'same params everywhere' if agree else 'PARAMS DIFFER OR NOT APPLIED'}",
                  file=progress, flush=True)
            shown.add(index)
        codes = [node.process.poll() for node in nodes]
        for node, code, got in zip(nodes, codes, records):
            if code not in (None, 0):
                return (f"node {node.name} exited with code {code} after {len(got)} of {rounds} rounds: "
                        f"{wan.last_line(node.log_path)} (log: {node.log_path})")
        if all(code == 0 for code in codes):
            return None
        if time.monotonic() > deadline:
            return f"timed out with {len(shown)} of {rounds} rounds completed by all nodes"
        time.sleep(POLL)


def complete_rounds(records: list[list[dict]]) -> set[int]:
    """The rounds every node has a record of."""
    return set.intersection(*({r["round"] for r in got} for got in records)) if records else set()


def summarise(outcome: Outcome, rounds: int) -> dict:
    """The setting's row (see the module docstring); byte means are per peer per round."""
    n = outcome.peers
    done = sorted(complete_rounds(outcome.records))
    measured = steady_rounds(done)
    flat = [r for index in measured for r in wan.by_round(outcome.records, index)]
    agree = [wan.hashes_agree(wan.by_round(outcome.records, index), n) for index in done]

    def per_peer(key: str) -> float | None:
        if not flat or any(key not in r for r in flat):
            return None
        return round(statistics.mean(r[key] for r in flat))

    def median(key: str) -> float | None:
        return round(statistics.median(r[key] for r in flat), 3) if flat else None

    # a node's time outside its rounds' round_seconds (its outer step, evaluation, round record): from one round's
    # record to the next, less the next round's own time. Its DHT bytes are counted over the whole of it
    outside = [b["timestamp"] - a["timestamp"] - b["round_seconds"] for got in outcome.records
               for a, b in zip(got, got[1:]) if b["round"] in measured and "timestamp" in a and "timestamp" in b]

    return {
        "peers": n, "design": outcome.design, "result": DESIGNS[outcome.design],
        "rounds": rounds, "rounds_completed": len(done), "steady_rounds": measured,
        "bytes_sent_per_peer": per_peer("bytes_sent"), "bytes_received_per_peer": per_peer("bytes_received"),
        "dht_bytes_sent_per_peer": per_peer(DHT_FIELDS[0]), "dht_bytes_received_per_peer": per_peer(DHT_FIELDS[1]),
        "dense_fp32_bytes_per_peer": per_peer("dense_fp32_bytes"),
        "round_seconds_median": median("round_seconds"), "comm_seconds_median": median("comm_seconds"),
        "inner_seconds_median": median("inner_seconds"),
        "outer_seconds_median": round(statistics.median(outside), 3) if outside else None,
        "hashes_equal": len(done) == rounds and all(agree), "rounds_hashes_equal": sum(agree),
        "wall_seconds": round(outcome.seconds, 1), "error": outcome.error, "logs": str(outcome.logs),
    }


def saving(row: dict) -> str:
    moved = (row["bytes_sent_per_peer"] or 0) + (row["bytes_received_per_peer"] or 0)
    return f"{row['dense_fp32_bytes_per_peer'] / moved:.0f}x" if moved and row["dense_fp32_bytes_per_peer"] else "n/a"


def table_row(row: dict) -> tuple:
    def size(key: str) -> str:
        return "n/a" if row[key] is None else human_bytes(row[key])

    def seconds(key: str) -> str:
        return "n/a" if row[key] is None else f"{row[key]:.1f}"

    return (row["peers"], row["design"], f"{row['rounds_completed']}/{row['rounds']}",
            f"{size('bytes_sent_per_peer')} / {size('bytes_received_per_peer')}",
            f"{size('dht_bytes_sent_per_peer')} / {size('dht_bytes_received_per_peer')}",
            saving(row), seconds("round_seconds_median"), seconds("comm_seconds_median"),
            "yes" if row["hashes_equal"] else f"NO ({row['rounds_hashes_equal']}/{row['rounds']})",
            f"{row['wall_seconds']:.0f}")


HEADER = ("peers", "design", "rounds by all", "sent / received per peer per round", "DHT sent / received",
          "vs dense", "round s (median)", "comm s (median)", "hashes equal", "wall s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, nargs="+", default=[2, 4, 8, 16], metavar="N",
                        help="swarm sizes, one setting each [2 4 8 16]")
    parser.add_argument("--designs", nargs="+", default=["butterfly", DEFAULT_DESIGN], choices=list(DESIGNS),
                        help="butterfly (result=exact, today's) and/or resparsified (the bounded default)")
    parser.add_argument("--rounds", type=int, default=8, help="outer rounds per setting [8]")
    parser.add_argument("--config", default=str(TINY_CONFIG), help="run config [configs/tiny.yaml]")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="config override for every node, after the script's own (repeatable)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds a setting may take at most [1800]")
    parser.add_argument("--workdir", type=Path, help="where logs and records go [a temporary folder]")
    parser.add_argument("--cpus-per-node", type=float, default=0.0, metavar="F",
                        help="give each setting's nodes N x F cores in all (root, cgroup v1), so that a node's share "
                             "of a CPU is the same at every N [off: they share the machine]")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object per (peers, design) on stdout (progress goes to stderr)")
    args = parser.parse_args()
    if any(not 2 <= n <= 64 for n in args.peers) or args.rounds < 1 or not 0 <= args.cpus_per_node <= 64:
        raise SystemExit("error: --peers must be in [2, 64], --rounds at least 1 and --cpus-per-node in [0, 64]")
    try:
        for design in args.designs:
            load_config(args.config, overrides_for(design, args.overrides))
        params = wan.count_params(args.config, args.overrides)
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None
    progress = sys.stderr if args.json else sys.stdout
    wan.stop_on_sigterm()  # SIGTERM ends the run as Ctrl-C does: every child is reaped
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="p2ploco-scale-"))
    print(f"scale: {params / 1e6:.2f}M parameters ({Path(args.config).name}"
          f"{' ' + ' '.join(args.overrides) if args.overrides else ''}), {args.rounds} rounds per setting, "
          f"N = {' '.join(map(str, args.peers))}, designs {' '.join(args.designs)}"
          f"{f', {args.cpus_per_node:g} cores per node' if args.cpus_per_node else ''}; logs in {workdir}",
          file=progress, flush=True)
    rows: list[dict] = []
    try:
        for n in args.peers:
            for design in args.designs:
                where = workdir / f"{design}-{n}"
                where.mkdir(parents=True, exist_ok=True)
                outcome = run_setting(n, design, args.config, args.overrides, args.rounds, where, args.timeout,
                                      progress, args.cpus_per_node)
                row = summarise(outcome, args.rounds)
                rows.append(row)
                print(f"[{design} N={n}] done in {row['wall_seconds']:.0f} s: {row['rounds_completed']}/{args.rounds}"
                      f" rounds by all, hashes equal {'yes' if row['hashes_equal'] else 'NO'}"
                      f"{f'; failed: {outcome.error}' if outcome.error else ''}", file=progress, flush=True)
                if args.json:
                    print(json.dumps(row), flush=True)
    except KeyboardInterrupt:
        print(f"scale.py: interrupted; every child is stopped ({len(rows)} setting(s) finished)", file=sys.stderr)
        if rows and not args.json:
            print(format_table(HEADER, [table_row(row) for row in rows]))
        return 130
    if not args.json:
        print(f"\n{params / 1e6:.2f}M parameters; per peer per round: means over the peers and the steady rounds "
              f"(1 .. R-2), medians over the same node-rounds; vs dense: what a dense fp32 butterfly among the same "
              f"peers would send + receive, over what was sent + received")
        print(format_table(HEADER, [table_row(row) for row in rows]))
    failed = [f"{row['design']} N={row['peers']}" for row in rows if row["error"] or not row["hashes_equal"]]
    if failed:
        print(f"error: {len(failed)} setting(s) failed or disagreed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # during start-up, before the settings' loop
        print("scale.py: interrupted", file=sys.stderr)
        sys.exit(130)
