"""Soak: real nodes on loopback for many rounds, with busy CPUs beside them, and nothing else going wrong.

No fault is injected: every node is healthy, so every round should be applied by every node with one
hash. What a busy machine does to the swarm anyway shows in the table, one row per run:

- rounds, and the rounds every node applied (an overlapped run's first round lands, so applies, nothing);
- rounds redone (some all-reduce failed, and the coordinator ran it again among the same peers);
- rounds lost per node (applied by some node, but not by that one: not applied, or no record of it);
- splits: rounds after which two nodes that applied the round hold different parameters (per slice);
- failures counted by kind, summed over the nodes (``RoundSummary.failures``: stream closed, stream broke,
  unreachable, timeout, late, left out, smaller group, no decision, alone, ...).

A run is an algorithm (``sparseloco``, ``diloco``, ``loco``, ``streaming``; ``+overlap`` runs its rounds
overlapped) among ``--replicas`` full replicas and ``--groups`` two-stage pipelines (then with
configs/tiny-pipeline.yaml). ``--cpu-hogs K`` runs K busy loops (``python -c "while True: pass"``) for the
whole run, as other work on a volunteer's machine would. Every node prints its progress as the demo does,
a line per round; the table comes at the end, and ``--json`` prints its rows as one JSON list.

    python benchmarks/soak.py --rounds 200 --cpu-hogs 2 --algorithm sparseloco diloco loco streaming \\
        sparseloco+overlap
    python benchmarks/soak.py --rounds 200 --cpu-hogs 2 --replicas 1 --groups 1
    python benchmarks/soak.py --rounds 200 --cpu-hogs 2 --replicas 1 --groups 2 --replace-stages 2

``--replace-stages K`` kills stage 1 of every group K times, evenly spaced over the rounds (SIGKILL, as a crash), and
starts a newcomer for the slot at once; a table then gives, per replacement, the replica's round under way when the
newcomer started (the first it recorded after; the kill ends that round for the group), the newcomer's first round
and the first round its group applied whole again (the newcomer's first applied round: a stage applies a round only
with its whole group).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from p2ploco.demo import run_demo
from p2ploco.launch import REPO_ROOT, TINY_CONFIG, LocalSwarm
from p2ploco.metrics import format_table, read_summaries

PIPELINE_CONFIG = REPO_ROOT / "configs" / "tiny-pipeline.yaml"
ALGORITHMS = ("sparseloco", "diloco", "loco", "streaming")
POLL_SECONDS = 0.5  # how often a soak that replaces stages looks at the replica's records
PROGRESS_ROUNDS = 10  # a progress line every this many of the replica's rounds
STRAGGLER_SECONDS = 120.0  # how long stages may run on after the replicas finished before they count as stuck


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
    evals: tuple[float, float] | None = None  # the first replica's eval loss, first and last
    eval_rise: float = 0.0  # the largest rise of that eval loss from one evaluation to the next (a state lost)

    def row(self) -> tuple[object, ...]:
        kinds = ", ".join(f"{kind} {count}" for kind, count in sorted(self.failures.items(), key=lambda kv: -kv[1]))
        return (self.run, self.nodes, self.rounds, self.applied_by_all, self.redone,
                "/".join(str(self.lost[n]) for n in sorted(self.lost)), self.splits, kinds or "-",
                f"{self.evals[0]:.3f} -> {self.evals[1]:.3f}" if self.evals else "-", f"{self.eval_rise:+.3f}",
                f"{self.seconds:.0f}", "yes" if self.exit_ok else "NO")


HEADER = ("run", "nodes", "rounds", "applied by all", "redone", "lost per node", "splits", "failures by kind",
          "eval", "largest eval rise", "wall s", "clean exit")


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
    replica = next((name for name in sorted(records) if name.startswith("node")), None)  # stages evaluate nothing
    evals = [r["eval_loss"] for r in records.get(replica, []) if r.get("eval_loss") is not None]
    if evals:
        soak.evals = (evals[0], evals[-1])
        soak.eval_rise = max((b - a for a, b in zip(evals, evals[1:])), default=0.0)
    for k in range(rounds):
        got = [by_node[name].get(k) for name in records]
        if all(r is not None and r["applied"] for r in got):
            soak.applied_by_all += 1
        if any(r is not None and r.get("attempts", 1) > 1 for r in got):
            soak.redone += 1
        hashes: dict[str, set[str]] = {}
        for r in got:
            if r is not None and r["applied"]:
                for slice_name, digest in r["slice_digest"].items():
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


@dataclass
class Replacement:
    """One stage of a pipeline killed and replaced by a newcomer, as the records tell it."""

    group: str
    killed: str  # the node killed (SIGKILL, as a crash)
    newcomer: str
    started: float  # when the newcomer was started (time.time(), as the records' timestamps)
    started_in: int | None = None  # the full replica's round under way then: the first it recorded after
    joined: int | None = None  # the newcomer's first recorded round (after its catch-up)
    whole: int | None = None  # the first round its group applied whole again, with the newcomer

    def row(self) -> tuple[object, ...]:
        after = "never" if self.whole is None or self.started_in is None else f"{self.whole - self.started_in}"
        return (self.group, self.killed, self.newcomer, "-" if self.started_in is None else self.started_in,
                "-" if self.joined is None else self.joined, "never" if self.whole is None else self.whole, after)


REPLACEMENT_HEADER = ("group", "killed", "newcomer", "started in round", "its first round", "group whole again at",
                      "rounds after the one it started in")


def run_with_replacements(replicas: int, groups: int, rounds: int, times: int, workdir: Path, settings: list[str]
                          ) -> tuple[bool, dict[str, list[dict]], list[Replacement]]:
    """The soak's swarm, in which stage 1 of every pipeline is killed (SIGKILL) ``times`` times, evenly spaced
    over the rounds, and replaced at once by a newcomer for the same slot. Returns whether every node that was not
    killed exited 0, every node's records, and the replacements."""
    members = [(f"node{i}", ()) for i in range(replicas)]
    members += [(f"g{g}s{s}", ("--role", "stage", "--group", f"g{g}", "--stage", str(s)))
                for g in range(groups) for s in range(2)]
    common = ["--max-rounds", str(rounds), "--set", f"swarm.min_peers={len(members)}",
              *(arg for item in settings for arg in ("--set", item))]
    at = [rounds * (i + 1) // (times + 1) for i in range(times)]
    replacements: list[Replacement] = []
    killed: set[str] = set()
    with LocalSwarm(workdir) as swarm:
        for name, role in members:
            swarm.start_node(name, PIPELINE_CONFIG, *role, *common)
        current = {f"g{g}": f"g{g}s1" for g in range(groups)}
        stragglers: float | None = None  # when the replicas were done: a stage still running later is stuck
        stuck: list[str] = []
        shown = 0
        while any(child.process.poll() is None for name, child in swarm.nodes.items() if name not in killed):
            if stragglers is None and all(swarm.nodes[f"node{i}"].process.poll() is not None for i in range(replicas)):
                stragglers = time.monotonic()
            if stragglers is not None and time.monotonic() - stragglers > STRAGGLER_SECONDS:
                stuck = [name for name, child in swarm.nodes.items() if child.process.poll() is None]
                print(f"{', '.join(stuck)} still running {STRAGGLER_SECONDS:.0f} s after the replicas finished: "
                      f"stopped", flush=True)
                for name in stuck:
                    swarm.nodes[name].stop()
                break
            replica_round = max((r["round"] for r in swarm.summaries("node0")), default=-1)
            if replica_round >= shown + PROGRESS_ROUNDS:
                shown = replica_round
                print(f"round {replica_round} of {rounds} (node0)", flush=True)
            if at and replica_round >= at[0]:
                at.pop(0)
                for group, victim in current.items():
                    swarm.nodes[victim].signal(signal.SIGKILL)
                    swarm.nodes[victim].process.wait()
                    killed.add(victim)
                    newcomer = f"{group}s1-{len(replacements) // groups + 1}"
                    swarm.start_node(newcomer, PIPELINE_CONFIG, "--role", "stage", "--group", group, "--stage", "1",
                                     *common)
                    replacements.append(Replacement(group, victim, newcomer, time.time()))
                    current[group] = newcomer
                    print(f"round {replica_round}: killed {victim}, started {newcomer} in its place", flush=True)
            time.sleep(POLL_SECONDS)
        codes = {name: child.process.returncode for name, child in swarm.nodes.items()}
        records = {name: swarm.summaries(name) for name in swarm.nodes}
    for replacement in replacements:
        replacement.started_in = next((r["round"] for r in records["node0"] if r["timestamp"] > replacement.started),
                                      None)
        mine = records[replacement.newcomer]
        replacement.joined = mine[0]["round"] if mine else None
        whole = [r["round"] for r in mine if r["applied"]]  # a stage applies a round only with its whole group
        replacement.whole = whole[0] if whole else None
    ok = not stuck and all(code == 0 for name, code in codes.items() if name not in killed)
    return ok, records, replacements


def soak(run: str, replicas: int, groups: int, rounds: int, hogs: int, workdir: Path, overrides: list[str],
         replace: int = 0) -> tuple[Soak, list[Replacement]]:
    algorithm, _, overlap = run.partition("+")
    settings = [f"outer.algorithm={algorithm}", *([f"outer.{algorithm}.overlap=true"] if overlap else []),
                "training.checkpoint_every=0", *overrides]
    config = PIPELINE_CONFIG if groups else TINY_CONFIG
    print(f"\n== {run}: {replicas} replica(s)" + (f" and {groups} two-stage group(s)" if groups else "")
          + f", {rounds} rounds, {hogs} busy loop(s) beside them; logs in {workdir}", flush=True)
    started = time.monotonic()
    replacements: list[Replacement] = []
    with cpu_hogs(hogs):
        if replace:
            ok, records, replacements = run_with_replacements(replicas, groups, rounds, replace, workdir, settings)
            # A killed node and its newcomer hold one slot: their records together, lost rounds counted for the slot
            slots: dict[str, list[dict]] = {}
            for name, rs in records.items():
                slots.setdefault(name.split("-")[0], []).extend(rs)
            records = slots
        else:
            ok = run_demo(replicas, groups, 2, rounds, config, workdir, settings)
            names = [f"node{i}" for i in range(replicas)] + [f"g{g}s{s}" for g in range(groups) for s in range(2)]
            records = {name: read_summaries(workdir / name / "metrics.jsonl") for name in names}
    return summarise(run, rounds, records, time.monotonic() - started, ok), replacements


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algorithm", nargs="+", default=["sparseloco"], metavar="RUN",
                        help=f"runs, one after another: {', '.join(ALGORITHMS)}, each optionally +overlap")
    parser.add_argument("--replicas", type=int, default=3, help="full replicas per run [3]")
    parser.add_argument("--groups", type=int, default=0, help="two-stage pipelines per run [0]")
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--cpu-hogs", type=int, default=0, help="busy-loop processes beside the nodes [0]")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="config override for every node (repeatable)")
    parser.add_argument("--workdir", type=Path, help="where logs go [a temporary folder]")
    parser.add_argument("--replace-stages", type=int, default=0, metavar="K",
                        help="kill stage 1 of every pipeline K times, evenly spaced, each time replaced at once "
                             "by a newcomer for its slot [0]")
    parser.add_argument("--json", action="store_true", help="also print the rows as one JSON list")
    args = parser.parse_args()
    for run in args.algorithm:
        algorithm, _, overlap = run.partition("+")
        if algorithm not in ALGORITHMS or overlap not in ("", "overlap"):
            parser.error(f"unknown run {run!r}: use one of {', '.join(ALGORITHMS)}, optionally with +overlap")
    if args.replicas + 2 * args.groups < 2:
        parser.error("a soak needs at least two nodes: raise --replicas or --groups")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="p2ploco-soak-"))
    if args.replace_stages and (not args.groups or not args.replicas):
        parser.error("--replace-stages needs --groups and --replicas of at least 1 (rounds are counted on node0)")
    ran = [soak(run, args.replicas, args.groups, args.rounds, args.cpu_hogs, workdir / run.replace("+", "-"),
                args.overrides, args.replace_stages) for run in args.algorithm]
    results = [result for result, _ in ran]
    print(f"\nSoak: {args.replicas} replica(s), {args.groups} pipeline(s), {args.rounds} rounds, "
          f"{args.cpu_hogs} busy loop(s); lost per node in node order ({', '.join(sorted(results[0].lost))}"
          f"{'; a killed stage and its newcomers count as one node' if args.replace_stages else ''})")
    print(format_table(HEADER, [r.row() for r in results]))
    for (result, replacements) in ran:
        if replacements:
            print(f"\n{result.run}: stages killed and replaced (whole again: the first round the newcomer applied: a "
                  f"stage applies a round only with its whole group)")
            print(format_table(REPLACEMENT_HEADER, [r.row() for r in replacements]))
    if args.json:
        print(json.dumps([{**asdict(result), "replacements": [asdict(r) for r in replacements]}
                          for result, replacements in ran]))


if __name__ == "__main__":
    main()
