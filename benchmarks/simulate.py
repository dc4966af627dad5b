"""A thousand peers and more: p2ploco's own protocol code in a simulated internet (``p2ploco/simulation/``).

One process, virtual time: every simulated peer runs the real record directory and heartbeat, the real matchmaking,
butterfly all-reduce, audits, vote and commit, bans and state transfer, and a real SparseLoCo over a small model
(``--params``); only the links, the DHT (a Kademlia model with hivemind's real record bytes and 5 replicas) and the
clock are simulated. Each peer gets a one-way latency of 10-80 ms, up and down links of 50-500 Mbit/s, and sits
behind a NAT with probability ``--nat`` (it dials out only). ``--churn`` of the peers leave every round (half of
them cleanly, half crashing) and as many newcomers join, catch up and train; ``--stragglers`` of them train 3x
slower.

For each N of ``--peers`` it prints, as each round ends, how many peers applied it, and then one row:

- rounds by all: rounds that every peer which synced them (and stayed) applied, all with one params digest;
- applied: the share of peer-rounds applied;
- round: the median virtual round time (``--inner-seconds`` of inner steps, then the sync), rounds 1..;
- all-reduce / wire / DHT per peer per round: the all-reduce payload (``Traffic``, as ``scale.py`` reports it),
  every byte the peer's streams carried (framing and other services included), and its DHT payload stored and
  read (``PeerDirectory.dht_bytes``, as ``scale.py``);
- streams: the streams a peer opened per round;
- coordinator bytes / CPU per round: what the round's coordinators' join and vote handlers carried and took;
- busiest DHT node: the bytes in and out of the DHT server that served the most, per heartbeat;
- newcomer: a newcomer's virtual time from its start to its first applied round (and how many joined);
- ban: with ``--attackers k``, k public peers answer the spans they reduce with their results scaled 8x from round 1:
  the virtual time from round 1's start until most honest peers have banned each (and how many were);
- wall and CPU: what the simulation itself took.

    python benchmarks/simulate.py                              # N = 64 256, 5 rounds, 1 % churn, 30 % NAT
    python benchmarks/simulate.py --peers 64 256 1024 --rounds 3 --json

Rows are comparable with each other and with ``scale.py``'s. ``--agreement`` runs the setting ``scale.py`` uses at
8 and 16 peers: no NAT, no churn, and the settings ``scale.py`` gives every node, before any ``--set``. Pass it that
run's config and the config's heartbeat, and the run's ``inner_seconds_median`` and ``outer_seconds_median``:

    python benchmarks/simulate.py --agreement --peers 8 --rounds 6 --config configs/tiny.yaml \
        --set swarm.heartbeat_interval=1 --inner-seconds 1.92 --outer-seconds 0.01

``--log FILE`` keeps every simulated peer's log lines, stamped with the virtual time and the peer's id: what a
person reads to trace why a round was redone or who waited for whom.

The simulation counts CPU time, never waits it: a virtual round takes what its messages need on the links, with
every peer's computation free.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

import scale  # benchmarks/scale.py: the settings its nodes get, for --agreement

from p2ploco.errors import ConfigError
from p2ploco.metrics import format_table, human_bytes
from p2ploco.simulation.clock import PeerStamp
from p2ploco.simulation.report import Report, simulate
from p2ploco.simulation.swarm import Scenario

HEADER = ("peers", "rounds by all", "applied", "round s", "all-reduce / wire / DHT per peer per round", "streams",
          "coordinator bytes / CPU", "busiest DHT node /hb", "newcomer s", "ban s", "wall s", "CPU s")


def row(r: Report) -> tuple:
    newcomer = "n/a" if r.newcomer_seconds is None else f"{r.newcomer_seconds:.0f} ({r.newcomers})"
    banned = "n/a" if r.ban_seconds is None else f"{r.ban_seconds:.0f} ({r.attackers_banned})"
    return (r.peers, f"{r.rounds_by_all}/{r.rounds}", f"{100 * r.applied_share:.1f}%", f"{r.round_seconds:.1f}",
            f"{human_bytes(r.allreduce_bytes)} / {human_bytes(r.wire_bytes)} / {human_bytes(r.dht_bytes)}",
            f"{r.streams:.0f}", f"{human_bytes(r.coordinator_bytes)} / {r.coordinator_cpu:.2f} s",
            human_bytes(r.busiest_dht_bytes), newcomer, banned, f"{r.wall_seconds:.0f}", f"{r.cpu_seconds:.0f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--churn", type=float, default=0.01, help="share of peers that leave (and join) per round")
    parser.add_argument("--nat", type=float, default=0.3, help="share of peers behind a NAT")
    parser.add_argument("--stragglers", type=float, default=0.0, help="share of peers that train 3x slower")
    parser.add_argument("--attackers", type=int, default=0,
                        help="public peers that answer the spans they reduce with their results scaled 8x")
    parser.add_argument("--params", type=int, default=1 << 16, help="parameters of the simulated model")
    parser.add_argument("--inner-seconds", type=float, default=60.0, help="virtual time of a round's inner steps")
    parser.add_argument("--outer-seconds", type=float, default=0.0,
                        help="virtual time from a round's sync to the next round's inner steps (a node's outer step "
                             "and round record; scale.py's outer_seconds_median, to compare with it)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--config", help="a config file: its settings, and its model's shapes (default: --params)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override")
    parser.add_argument("--agreement", action="store_true",
                        help="scale.py's setting: no NAT, no churn, every peer public, scale.py's node settings "
                             "(compare with scale.py)")
    parser.add_argument("--json", action="store_true", help="one JSON object per N instead of the table")
    parser.add_argument("--log", metavar="FILE",
                        help="write the simulated peers' log lines (INFO and above) to FILE, each with its virtual "
                             "time and the id of the peer that logged it")
    args = parser.parse_args()
    if min(args.peers) < 1 or args.rounds < 1:
        parser.error("--peers and --rounds must be at least 1")
    if args.attackers < 0 or args.params < 1:
        parser.error("--attackers must be at least 0 and --params at least 1")
    if args.inner_seconds <= 0 or args.outer_seconds < 0:
        parser.error("--inner-seconds must be above 0 and --outer-seconds at least 0")
    for name in ("churn", "nat", "stragglers"):
        if not 0 <= getattr(args, name) < 1:
            parser.error(f"--{name} must be in [0, 1)")
    console = logging.StreamHandler()
    console.setLevel(logging.ERROR)
    handlers: list[logging.Handler] = [console]
    if args.log:
        trace = logging.FileHandler(args.log, mode="w")
        trace.addFilter(PeerStamp())
        trace.setFormatter(logging.Formatter("%(virtual)10.3f %(peer)8s %(levelname)s %(name)s: %(message)s"))
        handlers.append(trace)
    logging.basicConfig(level=logging.INFO if args.log else logging.ERROR,
                        format="%(levelname)s %(name)s: %(message)s", handlers=handlers)
    settings = tuple(args.set)
    if args.agreement:
        args.churn = args.nat = 0.0
        settings = (*scale.SETTINGS, *settings)
    reports = []
    for peers in args.peers:
        scenario = Scenario(peers=peers, rounds=args.rounds, nat_share=args.nat, churn=args.churn,
                            stragglers=args.stragglers, params=args.params, inner_seconds=args.inner_seconds,
                            outer_seconds=args.outer_seconds, seed=args.seed, settings=settings,
                            config=args.config, attackers=args.attackers)

        def said(outcome, peers=peers) -> None:
            print(f"[N={peers}] round {outcome.round}: {outcome.applied} of {outcome.synced} applied it, "
                  f"{outcome.digests} digest(s)", file=sys.stderr, flush=True)

        try:
            reports.append(simulate(scenario, said))
        except ConfigError as e:  # --config or --set: one line, as the node says it
            parser.error(str(e))
        if args.json:
            print(json.dumps(reports[-1].to_json()), flush=True)
    if not args.json:
        print(format_table(HEADER, [row(r) for r in reports]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
