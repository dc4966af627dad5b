"""Two versions in one swarm: nodes of another checkout (an earlier commit) beside nodes of this one.

Peers of one run must speak one protocol. Nodes of two commits that share the protocol version train together:
every round is applied by every node with one hash. Nodes of two versions refuse each other in one line each
(their config fingerprints differ: ``PROTOCOL_VERSION`` is part of them), and each side trains without the other.
The table shows which, one row per round, and the refusal lines if there are any.

    git worktree add /tmp/previous 4ed5170
    python benchmarks/versions.py --other /tmp/previous --rounds 5
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from soak import summarise

from p2ploco.launch import REPO_ROOT, TINY_CONFIG, LocalSwarm, cli
from p2ploco.metrics import format_table

REFUSAL = "has peers of another config"  # swarm/runtime.py's line, in both versions
SETTINGS = ["--set", "inner.steps=5", "--set", "swarm.matchmaking_timeout=10", "--set", "swarm.allreduce_timeout=6",
            "--set", "swarm.heartbeat_interval=0.5", "--set", "swarm.startup_timeout=60",
            "--set", "training.checkpoint_every=0"]


def version_of(checkout: Path) -> str:
    """The protocol version a checkout speaks (``p2ploco/__init__.py``)."""
    for line in (checkout / "p2ploco" / "__init__.py").read_text().splitlines():
        if line.startswith("PROTOCOL_VERSION"):
            return line.partition("=")[2].strip()
    return "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--other", type=Path, required=True, help="a checkout of the other commit")
    parser.add_argument("--other-nodes", type=int, default=2, help="nodes of the other checkout [2]")
    parser.add_argument("--this-nodes", type=int, default=1, help="nodes of this checkout [1]")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workdir", type=Path, help="where logs go [a temporary folder]")
    args = parser.parse_args()
    if not (args.other / "p2ploco" / "cli.py").is_file():
        parser.error(f"--other {args.other}: not a p2ploco checkout (no p2ploco/cli.py there)")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="p2ploco-versions-"))
    checkouts = {f"other{i}": args.other.resolve() for i in range(args.other_nodes)}
    checkouts |= {f"this{i}": REPO_ROOT for i in range(args.this_nodes)}
    print(f"{args.other_nodes} node(s) of {args.other} (protocol {version_of(args.other)}) and {args.this_nodes} of "
          f"{REPO_ROOT} (protocol {version_of(REPO_ROOT)}), {args.rounds} rounds; logs in {workdir}", flush=True)
    started = time.monotonic()
    with LocalSwarm(workdir) as swarm:
        nodes = {name: swarm.start_node(name, TINY_CONFIG, *SETTINGS, "--max-rounds", str(args.rounds),
                                        "--set", f"swarm.min_peers={len(checkouts)}", program=cli(),
                                        env={"PYTHONPATH": str(checkout)})
                 for name, checkout in checkouts.items()}
        codes = {name: node.process.wait(120 + 60 * args.rounds) for name, node in nodes.items()}
        records = {name: swarm.records(name) for name in nodes}
    refusals = {name: line for name in nodes for line in (workdir / f"{name}.log").read_text().splitlines()
                if REFUSAL in line}
    soak = summarise("mixed", args.rounds, records, time.monotonic() - started, all(c == 0 for c in codes.values()))
    rows = [(k, *(next((f"{r['peers']} {'applied' if r['applied'] else 'NOT applied'} {r['params_sha256'][:8]}"
                         for r in records[name] if r["round"] == k), "-") for name in nodes))
            for k in range(args.rounds)]
    print(format_table(("round", *nodes), rows))
    print(f"\nrounds applied by all {soak.applied_by_all} of {args.rounds}, splits {soak.splits}, exit codes "
          + ", ".join(f"{name} {code}" for name, code in codes.items()))
    for name, line in refusals.items():
        print(f"{name} refused: {line.strip()}")
    sys.exit(0 if soak.exit_ok and not soak.splits else 1)


if __name__ == "__main__":
    main()
