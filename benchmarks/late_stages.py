"""Stage peers that join one after another, on a busy machine: do they form their group, and what does it cost the
replica beside them (issue 60)?

Each run starts real processes on loopback: a bootstrap (``p2ploco dht --no-hub``), a full replica of
configs/tiny-pipeline.yaml, ``--busy-loops`` busy loops (``python -c "while True: pass"``) beside them, and, once the
replica has trained ``--baseline-rounds`` rounds alone, a stage peer; a second stage peer follows ``--late-seconds``
later. Per run it prints the replica's rounds from the second stage's arrival to the group's first round applied
with the replica (the two stages' trained round), and the replica's median round time while the stages were there
before that round, against its median round time alone (the ratio: what the assembling group cost it).

    python benchmarks/late_stages.py                       # 5 runs, the second stage 45 s after the first
    python benchmarks/late_stages.py --runs 1 --late-seconds 20 --json
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from p2ploco.demo import scratch_folder
from p2ploco.errors import SwarmError
from p2ploco.launch import REPO_ROOT, LocalSwarm
from p2ploco.metrics import format_table

CONFIG = REPO_ROOT / "configs" / "tiny-pipeline.yaml"
STAGE = ("--role", "stage")
TRAINED = re.compile(r"round\s+(\d+) \| peers 3 \|(?!.*NOT APPLIED)")


def run_once(workdir: Path, late_seconds: float, busy_loops: int, baseline_rounds: int, patience: float) -> dict:
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy_loops)]
    try:
        with LocalSwarm(workdir) as swarm:
            full = swarm.start_node("full", CONFIG)
            full.wait_for_line(re.compile(rf"round\s+{baseline_rounds} \|"), 180)
            first = swarm.start_node("first", CONFIG, *STAGE)
            time.sleep(late_seconds)  # the scenario's delay, not a synchronisation
            arrived = swarm.summaries("full")[-1]["round"] + 1  # the replica's round as the second stage starts
            second = swarm.start_node("second", CONFIG, *STAGE)
            trained = None
            try:
                trained = max(int(stage.wait_for_line(TRAINED, patience).group(1)) for stage in (first, second))
            except SwarmError:  # no trained round within ``patience``: the run says so
                pass
            replica = swarm.summaries("full")
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()
    alone = [r["round_seconds"] for r in replica[1:baseline_rounds]]
    before = [r["round_seconds"] for r in replica[baseline_rounds + 1:]
              if trained is None or r["round"] < trained]
    waited = sum(1 for line in (workdir / "full.log").read_text().splitlines() if "did not join within" in line)
    return {"trained_round": trained, "second_arrived_round": arrived,
            "rounds_to_train": None if trained is None else trained - arrived,
            "replica_round_alone": statistics.median(alone), "replica_round_with_stages": statistics.median(before),
            "ratio": statistics.median(before) / statistics.median(alone), "replica_waits_for_a_stage": waited}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--late-seconds", type=float, default=45.0, help="the second stage's delay after the first")
    parser.add_argument("--busy-loops", type=int, default=2)
    parser.add_argument("--baseline-rounds", type=int, default=8, help="rounds the replica trains alone first")
    parser.add_argument("--patience", type=float, default=180.0, help="seconds to wait for the group's first round")
    parser.add_argument("--json", action="store_true", help="print the runs as one JSON list")
    args = parser.parse_args()
    runs = []
    for index in range(args.runs):
        with scratch_folder("p2ploco-late-stages-") as workdir:
            runs.append(run_once(workdir, args.late_seconds, args.busy_loops, args.baseline_rounds, args.patience))
        print(f"run {index + 1}: {runs[-1]}", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(runs))
        return
    print(f"\nTwo stage peers {args.late_seconds:.0f} s apart beside a full replica and {args.busy_loops} busy loops "
          f"({CONFIG.name}), {args.runs} runs")
    rows = [(str(i + 1), str(r["second_arrived_round"]), "-" if r["trained_round"] is None else str(r["trained_round"]),
             "never" if r["rounds_to_train"] is None else str(r["rounds_to_train"]),
             f"{r['replica_round_alone']:.2f}", f"{r['replica_round_with_stages']:.2f}", f"{r['ratio']:.2f}",
             str(r["replica_waits_for_a_stage"])) for i, r in enumerate(runs)]
    print(format_table(("run", "2nd stage at round", "group trained round", "rounds to train",
                        "replica round alone, s", "with the stages, s", "ratio", "replica waited for a stage"), rows))


if __name__ == "__main__":
    main()
