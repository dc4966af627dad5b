"""How long `p2ploco peers` and `p2ploco status` take against a running swarm on loopback.

Starts a bootstrap peer and N training nodes (configs/tiny.yaml), waits until they train, then runs
each command several times as a user would (a fresh process: Python start-up, p2p daemon, DHT
bootstrap, lookups, shutdown) and prints the wall times.

    python benchmarks/peers_cli.py                 # 3 nodes, 5 runs per command
    python benchmarks/peers_cli.py --nodes 5 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from p2ploco.launch import TINY_CONFIG, LocalSwarm, cli
from p2ploco.metrics import format_table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    rows = []
    with tempfile.TemporaryDirectory() as folder, LocalSwarm(Path(folder)) as swarm:
        nodes = [swarm.start_node(f"n{i}", TINY_CONFIG, "--set", f"swarm.min_peers={args.nodes}")
                 for i in range(args.nodes)]
        for node in nodes:
            node.wait_for_line(re.compile(r"round\s+1 \|"), 180)
        for command in (["peers", "--json"], ["peers"], ["status", "--json"]):
            seconds, listed = [], set()
            for _ in range(args.repeats):
                started = time.perf_counter()
                result = subprocess.run(cli(*command, "--initial-peers", swarm.bootstrap_address),
                                        capture_output=True, text=True, timeout=120)
                seconds.append(time.perf_counter() - started)
                if result.returncode != 0:
                    raise SystemExit(f"p2ploco {' '.join(command)} failed: {result.stderr.strip()}")
                if command == ["peers", "--json"]:
                    listed.add(sum(p["role"] != "bootstrap" for p in json.loads(result.stdout)["peers"]))
            rows.append((f"p2ploco {' '.join(command)}", args.nodes, f"{min(seconds):.2f}",
                         f"{statistics.median(seconds):.2f}", f"{max(seconds):.2f}",
                         ", ".join(map(str, sorted(listed))) or "-"))
    print(f"\nInspection commands against a running swarm of {args.nodes} tiny nodes on loopback "
          f"({args.repeats} runs each; wall time of a fresh process)")
    print(format_table(("command", "nodes", "min s", "median s", "max s", "peers listed"), rows))


if __name__ == "__main__":
    main()
