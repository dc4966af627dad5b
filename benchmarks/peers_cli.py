"""How long `p2ploco peers --json` takes against a live swarm, both ways, and where the time goes.

Starts a bootstrap peer and ``--nodes`` tiny nodes on loopback (they train until the script ends; the first
serves its status with ``--status-port 0``), waits until every node has a record, then times ``--calls`` calls
of each path as a person runs them (a new process each time) and prints the medians:

- ``p2ploco peers --initial-peers BOOTSTRAP --json``: through the DHT, as a client;
- ``p2ploco peers --from HOST:PORT --json``: from the node's status endpoint (``swarm/status.py``).

Both must list the same peers. ``--phases`` also times, in one process, the steps of one look through the DHT:
Python imports, the client's p2p daemon and DHT node start, finding the run, the survey, and the shutdown.

    flock /tmp/p2ploco-swarm.lock python benchmarks/peers_cli.py
    python benchmarks/peers_cli.py --nodes 3 --calls 5 --phases
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from p2ploco.launch import TINY_CONFIG, LocalSwarm, cli  # noqa: E402
from p2ploco.metrics import format_table  # noqa: E402

PHASES = r"""
import time
started = time.perf_counter()
marks = {{}}
from p2ploco.cli.inspect import CLIENT_HOST_MADDRS
from p2ploco.swarm.survey import find_run, survey
from p2ploco.swarm.dht import start_dht_node
from p2ploco.swarm.loop import EventLoopThread, finishes_within
marks["imports"] = time.perf_counter()
loop = EventLoopThread()
node, _ = loop.run(start_dht_node(({address!r},), CLIENT_HOST_MADDRS, client_mode=True))
marks["daemon and DHT node start"] = time.perf_counter()
run = loop.run(find_run(node, None))
marks["find the run"] = time.perf_counter()
peers = loop.run(survey(node, run), 60)
marks["survey (records lookup)"] = time.perf_counter()
loop.run(finishes_within(node.shutdown(), 5), 10)
loop.stop()
marks["shutdown"] = time.perf_counter()
last = started
for name, at in marks.items():
    print(f"{{name}}\t{{at - last:.3f}}")
    last = at
"""


def wait_for_records(address: str, nodes: int, timeout: float) -> None:
    """Until ``peers --json`` lists ``nodes`` training peers (SystemExit after ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = subprocess.run(cli("peers", "--initial-peers", address, "--json"), capture_output=True, text=True,
                                timeout=120)
        if result.returncode == 0:
            listed = json.loads(result.stdout)
            if sum(p.get("role") != "bootstrap" for p in listed.get("peers", [])) >= nodes:
                return
        time.sleep(1.0)
    raise SystemExit(f"error: the {nodes} nodes did not all publish a record within {timeout:.0f} s")


def time_calls(where: list[str], calls: int) -> tuple[list[float], set[str]]:
    """Seconds of each of ``calls`` calls of ``peers --json`` with the options ``where``, and the peer ids the
    last call listed."""
    times, listed = [], set()
    for _ in range(calls):
        started = time.perf_counter()
        result = subprocess.run(cli("peers", *where, "--json"), capture_output=True, text=True, timeout=120)
        times.append(time.perf_counter() - started)
        if result.returncode != 0:
            raise SystemExit(f"error: peers {' '.join(where)} failed: {result.stderr.strip()}")
        listed = {p["peer_id"] for p in json.loads(result.stdout)["peers"]}
    return times, listed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=3, help="live tiny nodes [3]")
    parser.add_argument("--calls", type=int, default=5, help="timed calls; the median is reported [5]")
    parser.add_argument("--phases", action="store_true", help="also time the steps of one look")
    args = parser.parse_args()
    if not 1 <= args.nodes <= 16 or args.calls < 1:
        raise SystemExit("error: --nodes must be in [1, 16] and --calls at least 1")
    workdir = Path(tempfile.mkdtemp(prefix="p2ploco-peers-cli-"))
    with LocalSwarm(workdir) as swarm:
        nodes = [swarm.start_node(f"n{i}", TINY_CONFIG, "--set", "training.rounds=0", "--set", "training.threads=1",
                                  *(["--status-port", "0"] if i == 0 else [])) for i in range(args.nodes)]
        status_address = nodes[0].wait_for_line(re.compile(r"status served at http://(\S+)/peers"), 120).group(1)
        wait_for_records(swarm.bootstrap_address, args.nodes, 180)
        paths = {"DHT: --initial-peers BOOTSTRAP": ["--initial-peers", swarm.bootstrap_address],
                 "status endpoint: --from HOST:PORT": ["--from", status_address]}
        rows, listings = [], []
        for path, where in paths.items():
            times, listed = time_calls(where, args.calls)
            listings.append(listed)
            rows.append((path, f"{statistics.median(times):.2f}", f"{min(times):.2f}", f"{max(times):.2f}"))
        print(f"p2ploco peers --json against {args.nodes} live nodes on loopback, {args.calls} calls each "
              f"(a new process each)")
        print(format_table(("path", "median s", "min s", "max s"), rows))
        if listings[0] != listings[1]:
            raise SystemExit(f"error: the two paths listed different peers: {sorted(listings[0] ^ listings[1])}")
        if args.phases:
            result = subprocess.run([sys.executable, "-c", PHASES.format(address=swarm.bootstrap_address)],
                                    capture_output=True, text=True, timeout=120)
            if result.returncode != 0:
                raise SystemExit(f"error: timing the steps of one look failed: {result.stderr.strip()[-500:]}")
            phases = [line.split("\t") for line in result.stdout.splitlines() if "\t" in line]
            print("\none look, step by step")
            print(format_table(("step", "s"), phases))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("peers_cli.py: interrupted", file=sys.stderr)
        sys.exit(130)
