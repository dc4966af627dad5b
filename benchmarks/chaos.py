"""Chaos: a local swarm of real nodes, one SIGKILLed and restarted every few rounds, against a calm run.

N node processes (each with its p2p daemon, on loopback) train R rounds. Every ``--kill-every`` rounds of
swarm progress, at a random moment of the round, one random node is SIGKILLed with its daemon (as a
machine crash would) and restarted at once with the same identity, with ``--resume`` (from its last
checkpoint) or without (from a fresh log dir: it fetches the swarm's state). Then the same swarm runs
the same number of rounds with no faults. Printed, per round and in a summary:

- hangs: gaps with no swarm progress longer than 3x the calm run's median round time;
- rounds whose applied parameter hashes differ between the nodes that averaged in a group (must be 0:
  rounds are all-or-nothing), and node-rounds a node spent alone (it found no peer; it applies its own
  update and catches up with the others' majority after);
- rounds dropped (no node applied them) and node-rounds not applied (a node left out catches up);
- the longest stall (the longest gap between two rounds' first completions), next to
  ``swarm.allreduce_timeout`` + the calm median round;
- final eval loss against the calm run's.

    python benchmarks/chaos.py                                # 6 nodes, 30 rounds, a kill every 3 rounds
    python benchmarks/chaos.py --nodes 3 --rounds 10 --kill-every 2 --rejoin-rounds 5 --json
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from p2ploco.config import load_config
from p2ploco.launch import TINY_CONFIG, Child, LocalSwarm
from p2ploco.metrics import format_table, read_summaries

POLL = 0.2  # seconds between looks at the nodes' metrics
KILL_JITTER = 3.0  # a kill lands up to this long after the swarm's progress reached its round


@dataclass
class Kill:
    node: str
    at_round: int  # the swarm's progress (rounds completed) when it was killed
    resume: bool  # restarted with --resume (else: a fresh log dir, state fetched from peers)
    seconds_into_round: float


@dataclass
class Run:
    label: str
    records: list[dict] = field(default_factory=list)  # every node-round record, all incarnations
    kills: list[Kill] = field(default_factory=list)
    started: float = 0.0
    exit_codes: dict[str, int] = field(default_factory=dict)

    def first_completion(self) -> dict[int, float]:
        """For each round, when the first node finished it."""
        done: dict[int, float] = {}
        for r in self.records:
            done[r["round"]] = min(done.get(r["round"], r["timestamp"]), r["timestamp"])
        return done

    def gaps(self) -> dict[int, float]:
        """Round -> seconds from the previous round's first completion (from the start for the first round)."""
        done = self.first_completion()
        out, previous = {}, self.started
        for round_index in sorted(done):
            out[round_index] = done[round_index] - previous
            previous = done[round_index]
        return out

    def final_eval(self, last: int) -> float | None:
        evals = [r["eval_loss"] for r in self.records if r["round"] == last and r["eval_loss"] is not None]
        return statistics.mean(evals) if evals else None


def run_swarm(label: str, workdir: Path, nodes: int, rounds: int, extra: list[str], kill_every: int,
              rng: random.Random, timeout: float, resume_probability: float = 0.5, rejoin_rounds: int = 10) -> Run:
    run = Run(label)
    names = [f"n{i}" for i in range(nodes)]
    incarnations = {name: 0 for name in names}
    log_dirs: list[Path] = []

    started_at: dict[str, float] = {}
    current: dict[str, Path] = {}

    def start(swarm: LocalSwarm, name: str, resume: bool, restart: bool) -> Child:
        if not resume:
            incarnations[name] += 1
        log_dir = current[name] = workdir / f"{name}.{incarnations[name]}"
        log_dirs.append(log_dir)
        started_at[name] = time.time()
        args = ["--max-rounds", str(rounds), "--identity", str(workdir / f"{name}.key"),
                "--set", f"swarm.min_peers={1 if restart else nodes}", *extra] + (["--resume"] if resume else [])
        return swarm.start_node(name, TINY_CONFIG, *args, log_dir=log_dir)

    def progress() -> int:
        """Rounds the swarm has completed: one more than the highest round any node recorded."""
        return 1 + max((r["round"] for d in set(log_dirs) for r in read_summaries(d / "metrics.jsonl")), default=-1)

    with LocalSwarm(workdir) as swarm:
        run.started = time.time()
        children = {name: start(swarm, name, resume=False, restart=False) for name in names}
        deadline = time.monotonic() + timeout
        next_kill = kill_every
        while any(c.process.poll() is None for c in children.values()) and time.monotonic() < deadline:
            done = progress()
            # No kill in the last rounds: a node restarted then would find the others gone, and train alone.
            if kill_every and next_kill <= done <= rounds - rejoin_rounds:
                # A node that trains (it finished a round since it started): killed mid-round, not mid-start-up.
                victims = [n for n, c in children.items() if c.process.poll() is None
                           and any(r["timestamp"] > started_at[n]
                                   for r in read_summaries(current[n] / "metrics.jsonl"))]
                if victims:
                    victim = rng.choice(victims)
                    delay = rng.uniform(0.0, KILL_JITTER)  # somewhere in a round: inner steps, matchmaking, all-reduce
                    time.sleep(delay)
                    children[victim].signal(signal.SIGKILL)  # the node and its daemon, as a crash would
                    children[victim].process.wait()
                    saved = workdir / f"{victim}.{incarnations[victim]}" / "checkpoint" / "checkpoint.json"
                    resume = rng.random() < resume_probability and saved.exists()
                    run.kills.append(Kill(victim, done, resume, delay))
                    print(f"[{label}] round {done}: killed {victim}, restarting it "
                          f"{'with --resume' if resume else 'from a fresh log dir'}", flush=True)
                    children[victim] = start(swarm, victim, resume, restart=True)
                next_kill = done + kill_every
            time.sleep(POLL)
        for name, child in children.items():
            run.exit_codes[name] = child.process.wait(60) if child.process.poll() is None else child.process.returncode
    for log_dir in sorted(set(log_dirs)):
        run.records.extend(read_summaries(log_dir / "metrics.jsonl"))
    return run


def summarise(chaos: Run, calm: Run | None, rounds: int, allreduce_timeout: float) -> dict:
    normal = statistics.median(list((calm or chaos).gaps().values())[1:] or [0.0])
    gaps = chaos.gaps()
    by_round: dict[int, list[dict]] = {}
    for r in chaos.records:
        by_round.setdefault(r["round"], []).append(r)
    differing = [k for k, rs in by_round.items() if len(group_hashes(rs)) > 1]
    dropped = [k for k, rs in by_round.items() if not any(r["applied"] for r in rs)]
    stalls = {k: g for k, g in gaps.items() if k > 0}  # round 0 includes start-up
    longest = max(stalls.values(), default=0.0)
    return {
        "nodes": len(chaos.exit_codes), "rounds": rounds, "rounds_completed": len(by_round), "kills": len(chaos.kills),
        "kills_resumed": sum(k.resume for k in chaos.kills),
        "hangs": sum(g > 3 * normal for g in stalls.values()), "normal_round_seconds": round(normal, 2),
        "rounds_with_differing_hashes": len(differing), "rounds_dropped": len(dropped),
        "node_rounds_not_applied": sum(not r["applied"] for r in chaos.records),
        "node_rounds_alone": sum(r["peers"] == 1 for r in chaos.records),
        "longest_stall_seconds": round(longest, 2),
        "stall_bound_seconds": round(allreduce_timeout + normal, 2),
        "final_eval_loss": chaos.final_eval(rounds - 1), "calm_final_eval_loss": calm.final_eval(rounds - 1)
        if calm else None, "exit_codes": chaos.exit_codes,
    }


def group_hashes(records: list[dict]) -> set[str]:
    """The parameter hashes that nodes averaging in a group (not alone) applied."""
    return {r["params_digest"] for r in records if r["applied"] and r["peers"] > 1}


def round_table(chaos: Run, normal: float) -> str:
    gaps = chaos.gaps()
    kills = {}
    for k in chaos.kills:
        kills.setdefault(k.at_round, []).append(f"{k.node}{' (resume)' if k.resume else ''}")
    rows = []
    for round_index in sorted(gaps):
        rs = [r for r in chaos.records if r["round"] == round_index]
        applied = [r for r in rs if r["applied"]]
        evals = [r["eval_loss"] for r in rs if r["eval_loss"] is not None]
        rows.append((round_index, f"{len(applied)}/{len(rs)}", len(group_hashes(rs)),
                     max((r["peers"] for r in rs), default=0), sum(r["peers"] == 1 for r in rs),
                     f"{gaps[round_index]:.1f}",
                     "HANG" if round_index > 0 and gaps[round_index] > 3 * normal else "",
                     f"{statistics.mean(evals):.3f}" if evals else "-", ", ".join(kills.get(round_index, []))))
    headers = ("round", "applied", "hashes", "group", "alone", "gap s", "", "eval", "killed at this progress")
    return format_table(headers, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--kill-every", type=int, default=3, help="rounds of swarm progress between kills")
    parser.add_argument("--rejoin-rounds", type=int, default=10,
                        help="rounds left after the last kill, for the restarted node to start up and rejoin")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--resume-probability", type=float, default=0.5,
                        help="share of restarts with --resume (the others start from a fresh log dir)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="config override for every node (repeatable)")
    parser.add_argument("--no-calm", action="store_true", help="skip the fault-free run")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds each run may take at most")
    parser.add_argument("--workdir", type=Path, help="where logs go [a temporary folder]")
    parser.add_argument("--json", action="store_true", help="also print the summary as JSON")
    args = parser.parse_args()
    overrides = ["training.checkpoint_every=1", *args.overrides]  # a --resume restart finds a recent checkpoint
    extra = [item for o in overrides for item in ("--set", o)]
    allreduce_timeout = load_config(TINY_CONFIG, overrides).swarm.allreduce_timeout
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="p2ploco-chaos-"))
    print(f"chaos: {args.nodes} nodes, {args.rounds} rounds of {TINY_CONFIG.name}, a SIGKILL + restart every "
          f"{args.kill_every} rounds; logs in {workdir}", flush=True)
    started = time.monotonic()
    chaos = run_swarm("chaos", workdir / "chaos", args.nodes, args.rounds, extra, args.kill_every,
                      random.Random(args.seed), args.timeout, args.resume_probability, args.rejoin_rounds)
    calm = None if args.no_calm else run_swarm("calm", workdir / "calm", args.nodes, args.rounds, extra, 0,
                                               random.Random(args.seed), args.timeout)
    summary = summarise(chaos, calm, args.rounds, allreduce_timeout)
    print("\nChaos run, round by round (gap: seconds since the previous round's first completion)")
    print(round_table(chaos, summary["normal_round_seconds"]))
    rows = [
        ("nodes / rounds", f"{summary['nodes']} / {args.rounds} ({summary['rounds_completed']} recorded)"),
        ("kills (restarted with --resume)", f"{summary['kills']} ({summary['kills_resumed']})"),
        ("hangs (> 3x the calm median round)", summary["hangs"]),
        ("rounds with differing applied hashes", summary["rounds_with_differing_hashes"]),
        ("rounds dropped by every node", summary["rounds_dropped"]),
        ("node-rounds not applied / spent alone",
         f"{summary['node_rounds_not_applied']} / {summary['node_rounds_alone']}"),
        ("calm median round", f"{summary['normal_round_seconds']:.1f} s"),
        ("longest stall", f"{summary['longest_stall_seconds']:.1f} s (bound: allreduce_timeout {allreduce_timeout:.0f}"
                          f" s + one round = {summary['stall_bound_seconds']:.1f} s)"),
        ("final eval loss (calm run)", f"{summary['final_eval_loss']:.3f} ({summary['calm_final_eval_loss']:.3f})"
         if summary["final_eval_loss"] and summary["calm_final_eval_loss"] else str(summary["final_eval_loss"])),
        ("exit codes", " ".join(f"{n}={c}" for n, c in summary["exit_codes"].items())),
        ("wall time", f"{time.monotonic() - started:.0f} s"),
    ]
    print("\nSummary")
    print(format_table(("", "chaos"), rows))
    if args.json:
        print(json.dumps({**summary, "kill_log": [asdict(k) for k in chaos.kills]}))


if __name__ == "__main__":
    main()
