"""The node's speed against the plain PyTorch loop it wraps, on whatever device it finds.

    python benchmarks/throughput.py                       # inner steps and whole runs, tiny.yaml and 21.4M
    python benchmarks/throughput.py --models 21m --parts inner --repeat 5
    python benchmarks/throughput.py --models 21m --parts outer --rounds 6
    python benchmarks/throughput.py --json

**Inner steps** (in this process, one device, ``training.threads`` threads): a bare loop (the model, AdamW with
the run's hyperparameters and weight-decay groups, the same micro-batches, backward, clipping at the run's norm,
step) against the node's inner loop (``build_replica``'s Worker: ``InnerTrainer.run_round``, as a node trains),
over the same number of steps after the same warm-up. Tokens per second, the median of ``--repeat`` runs (bare and
node alternate, so that what else the machine does weighs on both), and node / bare. This process sets the host
allocator as a node does (``host_memory.keep_freed_memory``), so the bare loop runs with it too.

**A round's outer parts** (``--parts outer``, in this process): one replica of a group of 1 or 2, each part of a
round outside the inner steps timed with the device synchronized after it (on CUDA, the outer step's timings as
the device sees them): contribute, its reducer's span, receive, prepare, take, hash, load.

**Whole runs** (``p2ploco demo``'s local swarm: real node processes, eval off; one thread a node on a CPU, the
cores shared among the nodes on a GPU): a lone node, and 2 nodes blocking and overlapped, at H = 3 and H = 30.
Tokens per wall second per node over rounds 1 .. R-2 (round 0 includes start-up, the last round the exit
checkpoint), against the bare loop's tokens per second at one thread and, on a CPU, against N bare loops run at once
(one process and one thread each, as N nodes share the cores: what is left of the gap is the nodes' own; the mean of
such a measure right before and right after the run, as a shared host's speed drifts); and the medians of round
seconds, inner seconds and round - inner.

On CUDA, MFU too: 6 x parameters x tokens per second (plus attention's 12 x layers x d_model x seq_len per
token) over the device's peak bf16 FLOPs (``--peak-tflops``, or a table of common GPUs).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

from p2ploco.budget import FixedSteps
from p2ploco.build import build_replica
from p2ploco.collective.exchange import reduce_span
from p2ploco.collective.sliced import reduce_alone
from p2ploco.config import Config, load_config
from p2ploco.data import ShardSampler, load_training_data
from p2ploco.demo import run_demo, scratch_folder, slices_agree
from p2ploco.host_memory import keep_freed_memory
from p2ploco.inner import autocast_for
from p2ploco.launch import REPO_ROOT, TINY_CONFIG
from p2ploco.machine import resolve_device
from p2ploco.metrics import format_table, read_summaries
from p2ploco.model import Transformer

MODELS = {  # a config file and --set on top of it
    "tiny": (TINY_CONFIG, []),
    "21m": (TINY_CONFIG, ["model.d_model=768", "model.n_layer=3", "model.n_head=12", "inner.batch_size=2",
                          "data.seq_len=64"]),
    "150m": (REPO_ROOT / "configs" / "150m.yaml", []),
}
# whole runs: nodes @ H, + overlap
WHOLE_RUNS = {"1@3": (1, 3, False), "1@3+overlap": (1, 3, True), "2@3": (2, 3, False), "2@3+overlap": (2, 3, True),
              "1@30": (1, 30, False), "2@30": (2, 30, False), "2@30+overlap": (2, 30, True)}
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0, "4090": 165.0}
WARMUP_STEPS = 2


def config_of(model: str, extra: list[str]) -> Config:
    path, sets = MODELS[model]
    return load_config(path, [*sets, "training.eval_every=100000", *extra])


def bare_loop(config: Config, sampler: ShardSampler, device: torch.device, steps: int,
              warmed: Callable[[], None] = lambda: None) -> float:
    """Tokens per second of plain PyTorch: the same model, optimizer groups, micro-batches and clipping. ``warmed``
    is called after the warm-up, before the timed steps."""
    c = config.inner
    model = Transformer(config.model, config.training.seed).to(device)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": c.weight_decay},
                                   {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                                  lr=c.lr, betas=tuple(c.betas), fused=True if device.type == "cuda" else None)
    model.train()

    def step(index: int) -> None:
        optimizer.zero_grad(set_to_none=True)
        for micro in range(c.grad_accum):
            inputs, targets = sampler.batch(index * c.grad_accum + micro)
            with autocast_for(device):
                loss = model(inputs.to(device), targets=targets.to(device)) / c.grad_accum
            loss.backward()
        if c.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, c.grad_clip)
        optimizer.step()

    for index in range(WARMUP_STEPS):
        step(index)
    synchronize(device)
    warmed()
    began = time.perf_counter()
    for index in range(WARMUP_STEPS, WARMUP_STEPS + steps):
        step(index)
    synchronize(device)
    return steps * c.grad_accum * c.batch_size * config.data.seq_len / (time.perf_counter() - began)


def bare_loops_side_by_side(model: str, extra: list[str], count: int, steps: int) -> float:
    """The median tokens per second of ``count`` bare loops on the CPU at once, one process and one thread each, their
    timed steps started together: what ``count`` nodes' compute gets of this machine, with no node around it."""
    context = multiprocessing.get_context("spawn")
    together, results = context.Barrier(count), context.Queue()
    loops = [context.Process(target=_bare_loop_process, args=(model, extra, steps, together, results))
             for _ in range(count)]
    for loop in loops:
        loop.start()
    try:
        rates = [results.get(timeout=600) for _ in loops]
    finally:
        for loop in loops:
            loop.join(60)
            if loop.is_alive():
                loop.kill()
                loop.join()
    return statistics.median(rates)


def _bare_loop_process(model: str, extra: list[str], steps: int, together, results) -> None:
    config, sampler = in_process(model, [*extra, "training.threads=1"])
    results.put(bare_loop(config, sampler, torch.device("cpu"), steps, warmed=lambda: together.wait(300)))


def node_loop(config: Config, sampler: ShardSampler, device: torch.device, steps: int) -> float:
    """Tokens per second of the node's inner loop: a replica's Worker, its rounds of ``steps`` steps."""
    timed = config.model_copy(update={"inner": config.inner.model_copy(update={"steps": steps})})
    worker = build_replica(timed, device, sampler)
    worker.inner.run_round(0, budget=FixedSteps(WARMUP_STEPS))  # the bare loop's warm-up: optimizer state, kernels
    synchronize(device)
    began = time.perf_counter()
    stats = worker.inner.run_round(1)
    synchronize(device)
    return stats.tokens / (time.perf_counter() - began)


OUTER_PHASES = ("contribute", "reduce", "receive", "prepare", "take", "hash", "load")


class Laps:
    """Seconds of the parts of one round, each from the end of the last (``start`` restarts the clock), the device
    synchronized at each mark."""

    def __init__(self, device: torch.device):
        self.device, self.seconds = device, {}
        self.start()

    def start(self) -> None:
        synchronize(self.device)
        self.at = time.perf_counter()

    def lap(self, phase: str) -> None:
        synchronize(self.device)
        now = time.perf_counter()
        self.seconds[phase], self.at = now - self.at, now


def outer_phases(config: Config, sampler: ShardSampler, device: torch.device, peers: int, rounds: int,
                 log) -> dict[str, float]:
    """Seconds of each part of a round outside the inner steps, for one of ``peers`` replicas in process (medians
    over ``rounds`` rounds after one warm-up round): its contribution (pseudo-gradient, error feedback, Top-k, on the
    device), its reducer's span of the butterfly (1 peer: ``reduce_alone``), taking every span's result, the outer
    step (CPU), taking it, hashing the published state and loading it into the model. The group's other replicas
    train, contribute, reduce and step too, untimed."""
    workers = [build_replica(config, device, sampler) for _ in range(peers)]
    names = [f"peer{i}" for i in range(peers)]
    times: dict[str, list[float]] = {phase: [] for phase in OUTER_PHASES}
    for round_index in range(rounds + 1):
        for worker in workers:
            worker.inner.run_round(round_index, budget=FixedSteps(1))
        laps = Laps(device)
        syncs = [workers[0].outer.contribute(list(workers[0].model.parameters()), round_index)]
        laps.lap("contribute")
        syncs += [worker.outer.contribute(list(worker.model.parameters()), round_index) for worker in workers[1:]]
        parts = [sync.exchange.parts["stage0"] for sync in syncs]
        if peers == 1:
            laps.start()
            reduce_alone(syncs[0].exchange)
            laps.lap("reduce")
            laps.lap("receive")
        else:
            for part in parts:
                part.fit_group(peers)
            spans = parts[0].partition(peers)
            reductions = []
            for j, span in enumerate(spans):  # reducer j reduces span j; replica 0's is timed
                payloads = [(name, part.encode(span)) for name, part in zip(names, parts)]
                laps.start()
                reductions.append(reduce_span(parts[j], span, payloads))
                if j == 0:
                    laps.lap("reduce")
            for i, part in enumerate(parts):
                laps.start()
                for span, reduction in zip(spans, reductions):
                    part.receive(span, reduction.result_for(part, names[i]), reduction.receipt_for(names[i]))
                if i == 0:
                    laps.lap("receive")
        for i, (worker, sync) in enumerate(zip(workers, syncs)):
            laps.start()
            step = worker.outer.prepare(sync)
            laps.lap("prepare")
            worker.outer.take(sync, step)
            laps.lap("take")
            worker.refresh_published()
            laps.lap("hash")
            worker.load_into_model()
            laps.lap("load")
            if i == 0 and round_index > 0:  # round 0 warms up
                for phase in OUTER_PHASES:
                    times[phase].append(laps.seconds[phase])
                log(f"[outer {peers} peer(s)] round {round_index}: "
                    + " ".join(f"{phase} {laps.seconds[phase]:.3f}" for phase in OUTER_PHASES))
    return {phase: round(statistics.median(seconds), 4) for phase, seconds in times.items()}


def in_process(model: str, extra: list[str]) -> tuple[Config, ShardSampler]:
    """``model``'s config and its batches, with this process set up as a node's (its host allocator and threads)."""
    config = config_of(model, extra)
    keep_freed_memory()  # as a node's process does
    if config.training.threads:
        torch.set_num_threads(config.training.threads)
    data = load_training_data(config)
    return config, ShardSampler(data.train, config.data.seq_len, config.inner.batch_size, config.run_id, "throughput")


def measure_outer(model: str, extra: list[str], peers: int, rounds: int, device: torch.device, log) -> dict:
    config, sampler = in_process(model, extra)
    phases = outer_phases(config, sampler, device, peers, rounds, log)
    return {"part": "outer", "model": model, "device": str(device), "peers": peers, "rounds": rounds,
            "threads": torch.get_num_threads(), "seconds": phases, "total_seconds": round(sum(phases.values()), 4)}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def flops_per_token(config: Config, params: int) -> float:
    m = config.model
    return 6 * params + 12 * m.n_layer * m.d_model * config.data.seq_len


def peak_flops(device: torch.device, given: float | None) -> float | None:
    if given:
        return given * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((tflops * 1e12 for key, tflops in PEAK_TFLOPS.items() if key in name), None)


def measure_inner(model: str, extra: list[str], steps: int, repeat: int, device: torch.device, peak: float | None,
                  log) -> dict:
    config, sampler = in_process(model, extra)
    bare, node = [], []
    for attempt in range(repeat):
        bare.append(bare_loop(config, sampler, device, steps))
        node.append(node_loop(config, sampler, device, steps))
        log(f"[inner {model}] run {attempt + 1}/{repeat}: bare {bare[-1]:,.0f} tok/s, node {node[-1]:,.0f} tok/s")
    params = sum(p.numel() for p in Transformer(config.model, 0).parameters())
    row = {"part": "inner", "model": model, "params": params, "device": str(device), "steps": steps,
           "threads": torch.get_num_threads(), "bare_tokens_per_second": round(statistics.median(bare)),
           "node_tokens_per_second": round(statistics.median(node))}
    row["node_vs_bare"] = round(row["node_tokens_per_second"] / row["bare_tokens_per_second"], 4)
    if peak is not None:
        row["mfu"] = round(row["node_tokens_per_second"] * flops_per_token(config, params) / peak, 4)
    return row


def measure_run(model: str, extra: list[str], nodes: int, steps: int, overlap: bool, rounds: int,
                device: torch.device, log) -> dict:
    path, sets = MODELS[model]
    # On a CPU one thread a node (the bare loop's, and 2 nodes share 2 cores); on a GPU the CPU does the outer step
    # and its reducer's work: each node gets its share of the cores.
    threads = 1 if device.type == "cpu" else max(1, (os.cpu_count() or 1) // nodes)
    sets = [*sets, f"inner.steps={steps}", f"training.threads={threads}", f"training.device={device}",
            "training.eval_every=100000", *extra]
    if overlap:
        sets.append("outer.sparseloco.overlap=true")
    with scratch_folder("p2ploco-throughput-") as workdir:
        ok = run_demo(nodes, 0, 1, rounds, path, workdir, sets, out=log, scratch=True)
        runs = [read_summaries(path) for path in sorted(workdir.glob("node*/metrics.jsonl"))]
        if not ok or len(runs) != nodes:
            raise SystemExit(f"error: the run of {nodes} node(s), H={steps}{', overlapped' if overlap else ''} "
                             f"failed (its log above; its nodes' logs in {workdir})")
    rates, middle = [], []
    for records in runs:
        records = sorted(records, key=lambda r: r["round"])[: rounds - 1]  # to R-2 (the last writes the checkpoint)
        rates.append(sum(r["tokens"] for r in records[1:]) / (records[-1]["timestamp"] - records[0]["timestamp"]))
        middle += records[1:]
    return {"part": "run", "model": model, "nodes": nodes, "H": steps, "overlap": overlap, "rounds": rounds,
            "threads": threads,
            "tokens_per_second_per_node": round(statistics.median(rates)),
            "round_seconds": round(statistics.median(r["round_seconds"] for r in middle), 3),
            "inner_seconds": round(statistics.median(r["inner_seconds"] for r in middle), 3),
            "round_minus_inner": round(statistics.median(r["round_seconds"] - r["inner_seconds"] for r in middle), 3),
            "params_agree": all(slices_agree({f"node{i}": rs for i, rs in enumerate(runs)}).values())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "21m"], choices=list(MODELS),
                        help="tiny.yaml, the 21.4M setting, 150m.yaml (a GPU's) [tiny 21m]")
    parser.add_argument("--parts", nargs="+", default=["inner", "runs"], choices=["inner", "outer", "runs"],
                        help="inner steps against a bare loop; a round's outer parts timed in process; whole runs "
                             "[inner runs]")
    parser.add_argument("--outer-peers", nargs="+", type=int, default=[1, 2], metavar="N",
                        help="group sizes of the outer part [1 2]")
    parser.add_argument("--repeat", type=int, default=3, help="inner-step runs per model (medians) [3]")
    parser.add_argument("--steps", type=int, default=20, help="timed inner steps per inner-step run [20]")
    parser.add_argument("--rounds", type=int, default=12, help="rounds per whole run (rounds 1..R-2 count) [12]")
    parser.add_argument("--whole-runs", nargs="+", default=list(WHOLE_RUNS), choices=list(WHOLE_RUNS),
                        metavar="NODES@H[+overlap]", help=f"which whole runs [{' '.join(WHOLE_RUNS)}]")
    parser.add_argument("--device", default="auto", help="auto (CUDA if present), cpu or cuda[:N] [auto]")
    parser.add_argument("--peak-tflops", type=float, help="the device's peak bf16 TFLOP/s, for MFU [a table]")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--json", action="store_true", help="print the rows as a JSON list (progress on stderr)")
    args = parser.parse_args()
    if args.repeat < 1 or args.steps < 1 or args.rounds < 4:
        raise SystemExit("error: --repeat and --steps must be at least 1, --rounds at least 4")
    device = resolve_device(args.device)
    peak = peak_flops(device, args.peak_tflops)

    def log(line: str) -> None:
        print(line, file=sys.stderr if args.json else sys.stdout, flush=True)

    rows = []
    for model in args.models:
        if "inner" in args.parts:
            rows.append(measure_inner(model, args.overrides, args.steps, args.repeat, device, peak, log))
        if "outer" in args.parts:
            rows += [measure_outer(model, args.overrides, peers, args.rounds, device, log)
                     for peers in args.outer_peers]
        if "runs" in args.parts:
            bare = next((r["bare_tokens_per_second"] for r in rows if r["part"] == "inner" and r["model"] == model),
                        None)
            for nodes, steps, overlap in (WHOLE_RUNS[name] for name in args.whole_runs):
                # A shared host's speed drifts by more than the gap measured: N bare loops run right before and
                # right after the run, and the run is held against their mean.
                side_by_side = device.type == "cpu" and nodes > 1
                before = bare_loops_side_by_side(model, args.overrides, nodes, args.steps) if side_by_side else 0.0
                row = measure_run(model, args.overrides, nodes, steps, overlap, args.rounds, device, log)
                if bare is not None and torch.get_num_threads() == 1:
                    row["vs_bare"] = round(row["tokens_per_second_per_node"] / bare, 3)
                if side_by_side:
                    after = bare_loops_side_by_side(model, args.overrides, nodes, args.steps)
                    log(f"[runs {model}] {nodes} bare loops side by side: {before:,.0f} tok/s each before the run, "
                        f"{after:,.0f} after")
                    row["bare_side_by_side_tokens_per_second"] = round((before + after) / 2)
                    row["vs_bare_side_by_side"] = round(row["tokens_per_second_per_node"] * 2 / (before + after), 3)
                rows.append(row)
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    inner = [r for r in rows if r["part"] == "inner"]
    if inner:
        print(f"\ninner steps alone on {device} (tokens/s, medians of {args.repeat} runs of {args.steps} steps)")
        print(format_table(("model", "params", "threads", "bare loop", "node", "node / bare", "MFU"),
                           [(r["model"], f"{r['params'] / 1e6:.1f}M", r["threads"], f"{r['bare_tokens_per_second']:,}",
                             f"{r['node_tokens_per_second']:,}", f"{r['node_vs_bare']:.3f}",
                             f"{r['mfu']:.3f}" if "mfu" in r else "-") for r in inner]))
    outer = [r for r in rows if r["part"] == "outer"]
    if outer:
        print(f"\na round's parts outside the inner steps on {device}, one replica of a group of N in process "
              f"(seconds, medians of {args.rounds} rounds, the device synchronized after each part)")
        print(format_table(("model", "N", "threads", *OUTER_PHASES, "total"),
                           [(r["model"], r["peers"], r["threads"], *(f"{r['seconds'][p]:.3f}" for p in OUTER_PHASES),
                             f"{r['total_seconds']:.3f}") for r in outer]))
    runs = [r for r in rows if r["part"] == "run"]
    if runs:
        print(f"\nwhole runs (real nodes on {device}; rounds 1..{args.rounds - 2}; per node; vs bare: against the bare "
              f"loop at 1 thread, where it ran so; vs bare xN: against N bare loops at once, one a node, on a CPU)")
        print(format_table(("model", "nodes", "threads", "H", "overlap", "tok/s", "vs bare", "vs bare xN", "round s",
                            "inner s", "round - inner s", "params agree"),
                           [(r["model"], r["nodes"], r["threads"], r["H"], "yes" if r["overlap"] else "no",
                             f"{r['tokens_per_second_per_node']:,}", f"{r['vs_bare']:.2f}" if "vs_bare" in r else "-",
                             f"{r['vs_bare_side_by_side']:.2f}" if "vs_bare_side_by_side" in r else "-",
                             f"{r['round_seconds']:.2f}", f"{r['inner_seconds']:.2f}", f"{r['round_minus_inner']:.2f}",
                             "yes" if r["params_agree"] else "NO") for r in runs]))


if __name__ == "__main__":
    main()
