"""Soak: real nodes on loopback for many rounds, with busy CPUs beside them, and nothing else going wrong.

No fault is injected: every node is healthy, so every round should be applied by every node with one
hash. What a busy machine does to the swarm anyway shows in the table, one row per run:

- rounds, and the rounds every node applied (an overlapped run's first round lands, so applies, nothing);
- rounds redone (some all-reduce failed, and the coordinator ran it again among the same peers);
- rounds lost per node (applied by some node, but not by that one: not applied, or no record of it);
- splits: rounds after which two nodes that applied the round hold different parameters (per slice);
- failures counted by kind, summed over the nodes (``RoundRecord.failures``: stream closed, stream broke,
  unreachable, timeout, late, left out, smaller group, no decision, alone, ...).

A run is an algorithm (``sparseloco``, ``diloco``, ``loco``, ``streaming``; ``+overlap`` runs its rounds
overlapped) among ``--replicas`` full replicas and ``--groups`` two-stage pipeline groups (then with
configs/tiny-pipeline.yaml). ``--cpu-hogs K`` runs K busy loops (``python -c "while True: pass"``) for the
whole run, as other work on a volunteer's machine would. Every node prints its progress as the demo does,
a line per round; the table comes at the end, and ``--json`` prints its rows as one JSON list.

    python benchmarks/soak.py --rounds 200 --cpu-hogs 2 --algorithm sparseloco diloco loco streaming \\
        sparseloco+overlap
    python benchmarks/soak.py --rounds 200 --cpu-hogs 2 --replicas 1 --groups 1
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from p2ploco.demo import run_demo
from p2ploco.launch import REPO_ROOT, TINY_CONFIG
from p2ploco.metrics import format_table, read_records

PIPELINE_CONFIG = REPO_ROOT / "configs" / "tiny-pipeline.yaml"
ALGORITHMS = ("sparseloco", "diloco", "loco", "streaming")


@dataclass
class Soak:
    run: str
    nodes: int
    rounds: int
    applied_by_all: int = 0
    redone: int = 0
    lost: dict[str, int] = field(default_factory=dict)  # node -> rounds it did not apply
    splits: int = 0
    failures: dict[str, int] = field(default_factory=dict)  # kind -> events, all nodes together
    seconds: float = 0.0
    exit_ok: bool = True

    def row(self) -> tuple[object, ...]:
        kinds = ", ".join(f"{kind} {count}" for kind, count in sorted(self.failures.items(), key=lambda kv: -kv[1]))
        return (self.run, self.nodes, self.rounds, self.applied_by_all, self.redone,
                "/".join(str(self.lost[n]) for n in sorted(self.lost)), self.splits, kinds or "-",
                f"{self.seconds:.0f}", "yes" if self.exit_ok else "NO")


HEADER = ("run", "nodes", "rounds", "applied by all", "redone", "lost per node", "splits", "failures by kind",
          "wall s", "clean exit")


def summarise(run: str, rounds: int, records: dict[str, list[dict]], seconds: float, exit_ok: bool) -> Soak:
    """The soak's figures for one run, from every node's round records."""
    soak = Soak(run, len(records), rounds, seconds=seconds, exit_ok=exit_ok)
    by_node = {name: {r["round"]: r for r in rs} for name, rs in records.items()}
    failures: Counter = Counter()
    applied_by_some = {k for rs in records.values() for r in rs if r["applied"] for k in [r["round"]]}
    for name, rs in records.items():
        soak.lost[name] = sum(1 for k in applied_by_some if k not in by_node[name] or not by_node[name][k]["applied"])
        for r in rs:
            failures.update(r.get("failures", {}))
    soak.failures = dict(failures)
    for k in range(rounds):
        got = [by_node[name].get(k) for name in records]
        if all(r is not None and r["applied"] for r in got):
            soak.applied_by_all += 1
        if any(r is not None and r.get("attempts", 1) > 1 for r in got):
            soak.redone += 1
        hashes: dict[str, set[str]] = {}
        for r in got:
            if r is not None and r["applied"]:
                for slice_name, digest in r["slice_sha256"].items():
                    hashes.setdefault(slice_name, set()).add(digest)
        soak.splits += any(len(digests) > 1 for digests in hashes.values())
    return soak


@contextlib.contextmanager
def cpu_hogs(count: int) -> Iterator[None]:
    """``count`` busy loops for the duration, each a process of its own; always killed and reaped."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
        for hog in hogs:
            hog.wait()


def soak(run: str, replicas: int, groups: int, rounds: int, hogs: int, workdir: Path, overrides: list[str]) -> Soak:
    algorithm, _, overlap = run.partition("+")
    settings = [f"outer.algorithm={algorithm}", *([f"outer.{algorithm}.overlap=true"] if overlap else []),
                "training.checkpoint_every=0", *overrides]
    config = PIPELINE_CONFIG if groups else TINY_CONFIG
    print(f"\n== {run}: {replicas} replica(s)" + (f" and {groups} two-stage group(s)" if groups else "")
          + f", {rounds} rounds, {hogs} busy loop(s) beside them; logs in {workdir}", flush=True)
    started = time.monotonic()
    with cpu_hogs(hogs):
        ok = run_demo(replicas, groups, 2, rounds, config, workdir, settings)
    names = [f"node{i}" for i in range(replicas)] + [f"g{g}s{s}" for g in range(groups) for s in range(2)]
    records = {name: read_records(workdir / name / "metrics.jsonl") for name in names}
    return summarise(run, rounds, records, time.monotonic() - started, ok)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algorithm", nargs="+", default=["sparseloco"], metavar="RUN",
                        help=f"runs, one after another: {', '.join(ALGORITHMS)}, each optionally +overlap")
    parser.add_argument("--replicas", type=int, default=3, help="full replicas per run [3]")
    parser.add_argument("--groups", type=int, default=0, help="two-stage pipeline groups per run [0]")
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--cpu-hogs", type=int, default=0, help="busy-loop processes beside the nodes [0]")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="config override for every node (repeatable)")
    parser.add_argument("--workdir", type=Path, help="where logs go [a temporary folder]")
    parser.add_argument("--json", action="store_true", help="also print the rows as one JSON list")
    args = parser.parse_args()
    for run in args.algorithm:
        algorithm, _, overlap = run.partition("+")
        if algorithm not in ALGORITHMS or overlap not in ("", "overlap"):
            parser.error(f"unknown run {run!r}: use one of {', '.join(ALGORITHMS)}, optionally with +overlap")
    if args.replicas + 2 * args.groups < 2:
        parser.error("a soak needs at least two nodes: raise --replicas or --groups")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="p2ploco-soak-"))
    results = [soak(run, args.replicas, args.groups, args.rounds, args.cpu_hogs, workdir / run.replace("+", "-"),
                    args.overrides) for run in args.algorithm]
    print(f"\nSoak: {args.replicas} replica(s), {args.groups} pipeline group(s), {args.rounds} rounds, "
          f"{args.cpu_hogs} busy loop(s); lost per node in node order ({', '.join(sorted(results[0].lost))})")
    print(format_table(HEADER, [r.row() for r in results]))
    if args.json:
        print(json.dumps([asdict(r) for r in results]))


if __name__ == "__main__":
    main()
