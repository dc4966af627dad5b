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
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from soak import summarise

from p2ploco.launch import REPO_ROOT, TINY_CONFIG, LocalSwarm
from p2ploco.metrics import format_table

# -P: the working directory is not put first on sys.path, so each node imports p2ploco from its PYTHONPATH
PROGRAM = [sys.executable, "-P", "-m", "p2ploco.cli"]
REFUSAL = "has peers of another config"  # peer.py's line, in both versions
RENAMED = {"params_sha256": "params_digest", "slice_sha256": "slice_digest"}  # record fields before PROTOCOL_VERSION 9
SETTINGS = ["--set", "inner.steps=5", "--set", "swarm.matchmaking_timeout=10", "--set", "swarm.allreduce_timeout=6",
            "--set", "swarm.heartbeat_interval=0.5", "--set", "swarm.startup_timeout=60",
            "--set", "training.checkpoint_every=0"]


def version_of(checkout: Path) -> str:
    """The protocol version of the p2ploco a node started with ``checkout`` imports, and where it imports it from:
    what the node runs, not what the folder holds."""
    found = subprocess.run([*PROGRAM[:2], "-c", "import p2ploco; print(p2ploco.PROTOCOL_VERSION, p2ploco.__file__)"],
                           env={**os.environ, "PYTHONPATH": str(checkout)}, capture_output=True, text=True, check=True)
    version, _, where = found.stdout.strip().partition(" ")
    return f"protocol {version}, from {Path(where).parent.parent}"


def in_current_names(record: dict) -> dict:
    """A record of either version with this version's field names."""
    return {RENAMED.get(key, key): value for key, value in record.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--other", type=Path, required=True, help="a checkout of the other commit")
    parser.add_argument("--other-nodes", type=int, default=2, help="nodes of the other checkout [2]")
    parser.add_argument("--this-nodes", type=int, default=1, help="nodes of this checkout [1]")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workdir", type=Path, help="where logs go [a temporary folder]")
    args = parser.parse_args()
    if not (args.other / "p2ploco" / "__init__.py").is_file():
        parser.error(f"--other {args.other}: not a p2ploco checkout (no p2ploco/__init__.py there)")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="p2ploco-versions-"))
    checkouts = {f"other{i}": args.other.resolve() for i in range(args.other_nodes)}
    checkouts |= {f"this{i}": REPO_ROOT for i in range(args.this_nodes)}
    print(f"{args.other_nodes} node(s) of {args.other} ({version_of(args.other)}) and {args.this_nodes} of this "
          f"checkout ({version_of(REPO_ROOT)}), {args.rounds} rounds; logs in {workdir}", flush=True)
    started = time.monotonic()
    with LocalSwarm(workdir) as swarm:
        nodes = {name: swarm.start_node(name, TINY_CONFIG, *SETTINGS, "--max-rounds", str(args.rounds),
                                        "--set", f"swarm.min_peers={len(checkouts)}", program=PROGRAM,
                                        env={"PYTHONPATH": str(checkout)})
                 for name, checkout in checkouts.items()}
        codes = {name: node.process.wait(120 + 60 * args.rounds) for name, node in nodes.items()}
        records = {name: [in_current_names(r) for r in swarm.summaries(name)] for name in nodes}
    refusals = {name: line for name in nodes for line in (workdir / f"{name}.log").read_text().splitlines()
                if REFUSAL in line}
    # One swarm if nobody refused anyone; else two, each of which must agree within itself.
    sides = [list(nodes)] if not refusals else [[n for n in nodes if n.startswith(side)] for side in ("other", "this")]
    soaks = [summarise("+".join(side), args.rounds, {name: records[name] for name in side},
                       time.monotonic() - started, all(codes[name] == 0 for name in side)) for side in sides if side]
    rows = [(k, *(next((f"{r['peers']} {'applied' if r['applied'] else 'NOT applied'} {r['params_digest'][:8]}"
                         for r in records[name] if r["round"] == k), "-") for name in nodes))
            for k in range(args.rounds)]
    print(format_table(("round", *nodes), rows))
    print("\n" + ("trained together" if not refusals else "refused each other") + "; exit codes "
          + ", ".join(f"{name} {code}" for name, code in codes.items()))
    for soak in soaks:
        print(f"{soak.run}: rounds applied by all {soak.applied_by_all} of {args.rounds}, splits {soak.splits}")
    for name, line in refusals.items():
        print(f"{name} refused: {line.strip()}")
    sys.exit(0 if all(soak.exit_ok and not soak.splits for soak in soaks) else 1)


if __name__ == "__main__":
    main()
