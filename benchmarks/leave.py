"""Leaving: does a clean Ctrl-C at any moment of a round cost the survivor a round?

A fresh local swarm for each trial: a bootstrap DHT peer and 2 real node processes on loopback (the tiny config,
short rounds). Once the leaver has finished a few rounds, it is Ctrl-C'd (SIGINT to its session, the node and its
p2p daemon, as a terminal sends it to the foreground process group) at a share of its round time into the next
round: 0 (as the round begins), 0.35 and 0.7, twice each by default. The survivor then trains on alone for a few
rounds. Per trial: whether the survivor lost a round (a record from the interrupted round on that it did not apply),
whether the leaver coordinated the interrupted round, how long the leaver took to exit, and its exit code.

    python benchmarks/leave.py                       # 0, 0.35 and 0.7 of a round, twice each: 6 trials
    python benchmarks/leave.py --at 0.5 --repeats 1 --json
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import statistics
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from p2ploco.launch import TINY_CONFIG, LocalSwarm
from p2ploco.metrics import format_table
from p2ploco.sync.form import best_coordinator

SHORT = ["--set", "inner.steps=5", "--set", "swarm.matchmaking_timeout=10", "--set", "swarm.allreduce_timeout=4",
         "--set", "swarm.heartbeat_interval=0.5", "--set", "swarm.min_peers=2", "--set", "training.checkpoint_every=0"]
WARM_ROUNDS = 3  # rounds the leaver finishes before it is interrupted: its round time is known by then
AFTER_ROUNDS = 2  # rounds the survivor records past the interrupted one before it is stopped
START_TIMEOUT = 240.0  # for the swarm to start and the leaver to finish its warm rounds
LEAVE_TIMEOUT = 90.0  # for the leaver to exit once interrupted (a clean leave may wait out its round)
SURVIVE_TIMEOUT = 120.0  # for the survivor to record its rounds after the leave


@dataclass
class Trial:
    at: float  # share of the leaver's round time into the round at which it was interrupted
    seconds_into_round: float
    round: int  # the round it was interrupted in
    coordinator: str  # of that round, while both were live: "leaver" or "survivor"
    leaver_rounds: int  # rounds the leaver recorded, the interrupted one included if it finished it
    exit_code: int | None
    exit_seconds: float  # from the signal to the leaver's exit
    lost: list[int]  # the survivor's rounds from the interrupted one on that it did not apply
    survivor_rounds: list[int]  # the survivor's rounds from the interrupted one on

    @property
    def cost(self) -> str:
        return f"lost {','.join(map(str, self.lost))}" if self.lost else "none"


def trial(workdir: Path, at: float) -> Trial:
    with LocalSwarm(workdir) as swarm:
        survivor = swarm.start_node("survivor", TINY_CONFIG, *SHORT)
        leaver = swarm.start_node("leaver", TINY_CONFIG, *SHORT)
        leaver.wait_for_line(re.compile(rf"round\s+{WARM_ROUNDS - 1} \|"), START_TIMEOUT)
        # its last round ended as that line was printed: the next one begins now
        began = time.monotonic()
        records = swarm.summaries("leaver")
        round_seconds = statistics.median(r["round_seconds"] for r in records[-WARM_ROUNDS:])
        time.sleep(max(0.0, at * round_seconds - (time.monotonic() - began)))
        into = time.monotonic() - began
        leaver.signal(signal.SIGINT)
        signalled = time.monotonic()
        try:
            code: int | None = leaver.process.wait(LEAVE_TIMEOUT)
        except subprocess.TimeoutExpired:
            code = None
        exit_seconds = time.monotonic() - signalled
        interrupted = WARM_ROUNDS
        deadline = time.monotonic() + SURVIVE_TIMEOUT
        while time.monotonic() < deadline and not any(r["round"] >= interrupted + AFTER_ROUNDS
                                                       for r in swarm.summaries("survivor")):
            if survivor.process.poll() is not None:
                break
            time.sleep(0.5)
        left, stayed = swarm.summaries("leaver"), swarm.summaries("survivor")
    ids = {records[0]["peer_id"], stayed[0]["peer_id"]} if stayed else set()
    coordinator = ("leaver" if ids and best_coordinator(ids, interrupted) == records[0]["peer_id"] else
                   "survivor" if ids else "?")
    after = [r for r in stayed if r["round"] >= interrupted]
    return Trial(at, round(into, 2), interrupted, coordinator, len(left), code, round(exit_seconds, 1),
                 [r["round"] for r in after if not r["applied"]], [r["round"] for r in after])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--at", type=float, nargs="+", default=[0.0, 0.35, 0.7],
                        help="shares of a round's time into the round at which the leaver is interrupted")
    parser.add_argument("--repeats", type=int, default=2, help="trials at each share")
    parser.add_argument("--json", action="store_true", help="one JSON object per trial, then the summary")
    parser.add_argument("--keep", type=Path, help="a folder to keep the trials' logs and metrics in")
    args = parser.parse_args()
    trials = []
    with tempfile.TemporaryDirectory(prefix="p2ploco-leave-") as tmp:
        for repeat in range(args.repeats):
            for at in args.at:
                trials.append(trial((args.keep or Path(tmp)) / f"{at}-{repeat}", at))
                if args.json:
                    print(json.dumps({**asdict(trials[-1]), "cost": trials[-1].cost}), flush=True)
    costly = sum(bool(t.lost) for t in trials)
    summary = (f"{costly} of {len(trials)} leaves cost the survivor a round; the leaver exited in "
               f"{statistics.median(t.exit_seconds for t in trials):.1f} s (median), "
               f"{max(t.exit_seconds for t in trials):.1f} s at most; exit codes "
               f"{sorted({t.exit_code for t in trials}, key=str)}")
    if args.json:
        print(json.dumps({"summary": summary, "costly": costly, "trials": len(trials)}))
        return
    print(format_table(("at", "s into round", "round", "coordinator", "leaver exit s", "rc", "survivor's rounds",
                        "cost to survivor"),
                       [(t.at, t.seconds_into_round, t.round, t.coordinator, t.exit_seconds, t.exit_code,
                         ",".join(map(str, t.survivor_rounds)), t.cost) for t in trials]))
    print(summary)


if __name__ == "__main__":
    main()
