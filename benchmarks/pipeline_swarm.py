"""A heterogeneous swarm on loopback: one full replica next to one pipeline of 2 stage peers.

Real processes (a bootstrap peer, ``p2ploco node start`` for the replica and for each stage, as
``p2ploco demo --replicas 1 --groups 1`` starts them) train for ``--rounds`` rounds; the table is read
from their round records, leaving out the first round (it includes forming the group):

- tokens/s of each replica: the full replica's, and the group's (the tokens its first stage feeds in)
  over the round's wall time, communication included;
- boundary bytes per token: what stage 0 sends (activations and token ids) plus what it receives
  (gradients), per token, against the same messages with uncompressed bf16 activations (d_model values);
- each round's time split: inner compute, stage transfers (time a stage spends sending to or waiting for
  the other stage, part of its inner time), the all-reduce, and the rest (catch-up, publishing).

    python benchmarks/pipeline_swarm.py                       # configs/tiny-pipeline.yaml, 5 rounds
    python benchmarks/pipeline_swarm.py --rounds 8 --set pipeline.rank=16 --json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
from pathlib import Path

from p2ploco.config import load_config, with_overrides
from p2ploco.demo import run_demo, scratch_folder
from p2ploco.metrics import format_table, read_summaries
from p2ploco.pipeline.transport import id_dtype

REPLICA, STAGES = "node0", ("g0s0", "g0s1")


def median(records: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in records)


def measure(config_path: Path, rounds: int, overrides: list[str], workdir: Path, scratch: bool) -> dict:
    """Run the swarm and reduce its round records to the benchmark's figures (``scratch``: ``workdir`` is a
    ``scratch_folder``)."""
    config = with_overrides(load_config(config_path), overrides)
    if config.pipeline.stages != 2:
        raise SystemExit(f"error: {config_path} has pipeline.stages={config.pipeline.stages}; this benchmark runs "
                         f"a 2-stage group (use configs/tiny-pipeline.yaml or --set pipeline.stages=2)")
    ok = run_demo(1, 1, 2, rounds, config_path, workdir, overrides, out=lambda line: print(line, flush=True),
                  scratch=scratch)
    if not ok:
        raise SystemExit(f"error: the swarm did not finish every round with identical slices; logs in {workdir}")
    records = {name: [r for r in read_summaries(workdir / name / "metrics.jsonl") if r["round"] > 0]
               for name in (REPLICA, *STAGES)}
    replica, first, last = records[REPLICA], records[STAGES[0]], records[STAGES[1]]
    wire_bytes = id_dtype(config.model.vocab_size).itemsize
    per_token_ids = wire_bytes * (config.data.seq_len + 1) / config.data.seq_len  # a window carries T + 1 ids
    uncompressed = 2 * config.model.d_model * 2 + per_token_ids  # bf16 activations forward, gradients back
    boundary = sum(r["boundary_bytes_sent"] + r["boundary_bytes_received"] for r in first) / sum(
        r["tokens"] for r in first)

    def slowest_stage(key: str) -> float:  # the group's round waits for its slower stage
        return max(median(first, key), median(last, key))

    return {
        "rounds": len(replica),
        "replica_tokens_per_second": sum(r["tokens"] for r in replica) / sum(r["round_seconds"] for r in replica),
        "group_tokens_per_second": sum(r["tokens"] for r in first) / sum(r["round_seconds"] for r in first),
        "boundary_bytes_per_token": boundary,
        "uncompressed_boundary_bytes_per_token": uncompressed,
        "replica_round": {"inner": median(replica, "inner_seconds"), "stage_transfers": 0.0,
                          "allreduce": median(replica, "comm_seconds"), "round": median(replica, "round_seconds")},
        "pipeline_round": {"inner": slowest_stage("inner_seconds"),
                           "stage_transfers": slowest_stage("boundary_seconds"),
                        "allreduce": slowest_stage("comm_seconds"), "round": slowest_stage("round_seconds")},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=Path("configs/tiny-pipeline.yaml"))
    parser.add_argument("--rounds", type=int, default=5, help="rounds to run (the first is left out of the figures)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    parser.add_argument("--workdir", type=Path, help="keep logs and metrics here (default: a temporary folder)")
    args = parser.parse_args()
    if args.rounds < 2:
        parser.error("--rounds must be at least 2 (the first round is left out of the figures)")
    with contextlib.nullcontext(args.workdir) if args.workdir else scratch_folder("p2ploco-pipeline-swarm-") as workdir:
        figures = measure(args.config, args.rounds, args.overrides, workdir, scratch=args.workdir is None)
    if args.json:
        print(json.dumps(figures))
        return
    print(f"\nHeterogeneous swarm on loopback ({args.config.name}): 1 full replica + 1 group of 2 stage peers, "
          f"medians over rounds 1..{figures['rounds']}")
    throughput = [("full replica", f"{figures['replica_tokens_per_second']:.0f}"),
                  ("pipeline", f"{figures['group_tokens_per_second']:.0f}")]
    print(format_table(("replica", "tokens/s"), throughput))
    compressed, plain = figures["boundary_bytes_per_token"], figures["uncompressed_boundary_bytes_per_token"]
    print(format_table(("boundary", "bytes/token (forward + backward)", "ratio"),
                       [("compressed (measured)", f"{compressed:.1f}", f"{plain / compressed:.1f}x"),
                        ("uncompressed bf16", f"{plain:.1f}", "1.0x")]))
    split = []
    for who, key in (("full replica", "replica_round"), ("pipeline", "pipeline_round")):
        t = figures[key]
        compute = t["inner"] - t["stage_transfers"]
        rest = t["round"] - t["inner"] - t["allreduce"]
        split.append((who, f"{compute:.2f}", f"{t['stage_transfers']:.2f}", f"{t['allreduce']:.2f}", f"{rest:.2f}",
                      f"{t['round']:.2f}"))
    print(format_table(("round time, s", "inner compute", "stage transfers", "all-reduce", "other", "round"), split))


if __name__ == "__main__":
    main()
