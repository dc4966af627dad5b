"""Compute utilisation on loopback: real nodes, one core each, without and with overlapped rounds.

    python benchmarks/utilisation.py                       # 2 nodes of the 21.4M setting, 22 rounds each way
    python benchmarks/utilisation.py --nodes 3 --rounds 12 --settings none eager naive
    python benchmarks/utilisation.py --algorithm diloco --json

For every setting (``none``: blocking rounds; ``eager``/``naive``: ``outer.<algorithm>.overlap`` with that
update) ``p2ploco demo``'s local swarm (a bootstrap peer and node processes, ``training.threads=1``) trains on
the embedded corpus with eval off. From the nodes' round records it prints medians over rounds 1 .. R-2 of
every node (the first round includes start-up, and when overlapped lands nothing; the last one evaluates and
writes the exit checkpoint): inner seconds, round seconds, round - inner, and compute utilisation (inner seconds
over the wall seconds since the node's previous record), and whether every node held the same global params
after every round. The model is the 21.4M-parameter setting of issues 12 and 20 unless ``--set`` says
otherwise. Timings are this machine's: the nodes, their p2p daemons and their background threads share its
cores.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from p2ploco.demo import run_demo, scratch_folder, slices_agree
from p2ploco.launch import TINY_CONFIG
from p2ploco.metrics import format_table, read_summaries

SETTING_21M = ["model.d_model=768", "model.n_layer=3", "model.n_head=12", "inner.steps=3", "inner.batch_size=2",
               "data.seq_len=64", "training.eval_every=1000"]


def measure(setting: str, algorithm: str, nodes: int, rounds: int, overrides: list[str], log) -> dict:
    overlap = [] if setting == "none" else [f"outer.{algorithm}.overlap=true",
                                            f"outer.{algorithm}.overlap_update={setting}"]
    with scratch_folder("p2ploco-utilisation-") as workdir:
        ok = run_demo(nodes, 0, 1, rounds, TINY_CONFIG, workdir,
                      [*SETTING_21M, f"outer.algorithm={algorithm}", *overlap, *overrides], out=log, scratch=True)
        records = {f"node{i}": read_summaries(workdir / f"node{i}" / "metrics.jsonl") for i in range(nodes)}
        middle = [r for rs in records.values() for r in rs if 1 <= r["round"] <= rounds - 2]
        if not ok or not middle:
            raise SystemExit(f"the {setting} run did not complete (see the lines above; its nodes' logs in {workdir})")

    def median(key) -> float:
        return statistics.median(key(r) for r in middle)

    return {"setting": "no overlap" if setting == "none" else f"overlap:{setting}", "algorithm": algorithm,
            "nodes": nodes, "rounds_measured": len(middle) // nodes,
            "inner_seconds": round(median(lambda r: r["inner_seconds"]), 3),
            "round_seconds": round(median(lambda r: r["round_seconds"]), 3),
            "round_minus_inner": round(median(lambda r: r["round_seconds"] - r["inner_seconds"]), 3),
            "utilisation": round(median(lambda r: r["compute_utilisation"]), 3),
            "applied_by_all": all(r["applied"] for r in middle), "hashes_equal": all(slices_agree(records).values())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=22, help="rounds per run (medians over rounds 1 .. R-2)")
    parser.add_argument("--algorithm", default="sparseloco", choices=["sparseloco", "diloco", "loco"])
    parser.add_argument("--settings", nargs="+", default=["none", "eager"], choices=["none", "eager", "naive"])
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--json", action="store_true", help="print the rows as a JSON list (progress on stderr)")
    args = parser.parse_args()
    if args.rounds < 3:
        raise SystemExit("--rounds must be at least 3: the first and the last round are not measured")

    def log(line: str) -> None:
        print(line, file=sys.stderr if args.json else sys.stdout, flush=True)

    rows = [measure(setting, args.algorithm, args.nodes, args.rounds, args.overrides, log)
            for setting in args.settings]
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print()
    print(f"Medians over rounds 1 .. {args.rounds - 2} of {args.nodes} nodes ({args.algorithm})")
    print(format_table(("setting", "rounds", "inner s", "round s", "round - inner s", "utilisation",
                        "applied by all", "hashes equal"),
                       [(r["setting"], r["rounds_measured"], f"{r['inner_seconds']:.2f}", f"{r['round_seconds']:.2f}",
                         f"{r['round_minus_inner']:.2f}", f"{r['utilisation']:.2f}",
                         "yes" if r["applied_by_all"] else "no", "yes" if r["hashes_equal"] else "NO")
                        for r in rows]))


if __name__ == "__main__":
    main()
