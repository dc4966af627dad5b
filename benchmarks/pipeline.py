"""Pipelines: stage-boundary traffic, a stage peer's memory against a full replica, codec time.

Traffic is counted on a real in-process group (2 stages by default) running one inner step with the
1F1B schedule: the bytes the first stage sends (activations + token ids) and receives (gradients
with respect to what it sent), per token of one boundary, against an uncompressed bf16 boundary
(2 bytes x d_model per token). Memory is measured on the same group's workers after that step: every
tensor a peer keeps (parameters, gradients, AdamW moments, the outer algorithm's global copy and error
feedback, the frozen subspace tables), against a full replica of the same model. For a large config
(``--large``, default configs/1b.yaml) the same accounting is computed from the parameter shapes
without allocating. Codec time is one micro-batch's encode + decode, on the CPU (and CUDA if present).

    python benchmarks/pipeline.py                    # tiny-pipeline settings, plus 1b.yaml from shapes
    python benchmarks/pipeline.py --json             # one JSON object with the headline fields
    python benchmarks/pipeline.py --set pipeline.rank=4
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from p2ploco.config import Config, load_config, with_overrides
from p2ploco.metrics import format_table, human_bytes
from p2ploco.model import Transformer, stage_layers
from p2ploco.pipeline.subspace import Subspace
from p2ploco.testing.swarm import FULL, GROUP, build_swarm
from p2ploco.testing.threads import run_in_threads
from p2ploco.worker import Worker

CPU = torch.device("cpu")
BYTES_PER_PARAM = {"params": 4, "grads": 4, "adamw": 8, "outer": 8}  # fp32; outer: global copy + error feedback


def tensors_held(worker: Worker) -> dict[str, int]:
    """Bytes of every tensor a worker keeps, by what it is for (each storage counted once)."""
    seen: set[int] = set()

    def size(tensors) -> int:
        total = 0
        for t in tensors:
            if t is not None and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                total += t.untyped_storage().nbytes()
        return total

    params = list(worker.model.parameters())
    state = [v for slots in worker.inner.optimizer.state.values() for v in slots.values() if torch.is_tensor(v)]
    outer = [*worker.outer.params, *worker.outer.local_state().values(), *worker.outer.shared_state().values()]
    tables = list(worker.model.buffers())
    if worker.constraint is not None:
        tables += [worker.constraint.subspace.basis, worker.constraint.subspace.table]
    return {"params": size(params), "grads": size(p.grad for p in params), "adamw": size(state),
            "outer": size(outer), "tables": size(tables)}


def measured(config: Config, tokens: np.ndarray) -> tuple[dict, list[list]]:
    """One inner step of a full replica and of a group; traffic and memory of what they hold."""
    swarm = build_swarm(config, [FULL, GROUP], tokens)
    run_in_threads(len(swarm.workers), lambda rank: swarm.workers[rank].inner.step(0))
    (full,), stages = swarm.replicas
    c = config
    tokens_per_boundary = c.inner.grad_accum * c.inner.batch_size * c.data.seq_len
    first = swarm.transports[0]  # the group's first stage's
    held = {"full": tensors_held(full), **{f"stage {s}": tensors_held(w) for s, w in enumerate(stages)}}
    full_total = sum(held["full"].values())
    rows = [[c.run_id, worker, f"{sum(p.numel() for p in w.model.parameters()) / 1e6:.2f}M",
             human_bytes(h["params"]), human_bytes(sum(h.values()) - h["params"]),
             human_bytes(sum(h.values())), f"{sum(h.values()) / full_total:.2f}", "measured"]
            for (worker, h), w in zip(held.items(), [full, *stages])]
    figures = {
        "boundary_bytes_per_token": first.bytes_sent / tokens_per_boundary,
        "boundary_gradient_bytes_per_token": first.bytes_received / tokens_per_boundary,
        "dense_bf16_bytes_per_token": 2 * c.model.d_model,
        "stage_param_bytes": max(h["params"] for name, h in held.items() if name != "full"),
        "full_param_bytes": held["full"]["params"],
        "stage_memory_bytes": max(sum(h.values()) for name, h in held.items() if name != "full"),
        "full_memory_bytes": full_total,
    }
    figures["ratio"] = figures["dense_bf16_bytes_per_token"] / figures["boundary_bytes_per_token"]
    return figures, rows


def computed(config: Config) -> list[list]:
    """The same accounting from the parameter shapes of a large config (nothing allocated)."""
    c = config
    with torch.device("meta"):
        sizes = {"full": sum(p.numel() for p in Transformer(c.model, 0).parameters())}
        for s, layers in enumerate(stage_layers(c.model.n_layer, c.pipeline.stages)):
            sizes[f"stage {s}"] = sum(p.numel() for p in Transformer(c.model, 0, layers).parameters())
    table = 4 * c.model.vocab_size * c.model.d_model + 4 * c.model.d_model * c.pipeline.rank  # F and U
    per_param = sum(BYTES_PER_PARAM.values())
    rows = []
    for worker, count in sizes.items():
        tables = table if c.pipeline.compressed and (worker != "full" or c.pipeline.compression != "none") else 0
        total = per_param * count + tables
        rows.append([c.run_id, worker, f"{count / 1e6:.1f}M", human_bytes(4 * count),
                     human_bytes(total - 4 * count), human_bytes(total),
                     f"{total / (per_param * sizes['full'] + tables):.2f}", "from shapes"])
    return rows


def codec_seconds(config: Config, device: torch.device, repeats: int) -> float:
    """Seconds per micro-batch to encode at the sender and decode at the receiver."""
    c = config
    subspace = Subspace.derive(c.model, c.pipeline.rank, c.training.seed).to(device)
    ids = torch.randint(0, c.model.vocab_size, (c.inner.batch_size, c.data.seq_len), device=device)
    hidden = torch.randn(c.inner.batch_size, c.data.seq_len, c.model.d_model, device=device)
    subspace.decode(subspace.encode(hidden, ids), ids)  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(repeats):
        subspace.decode(subspace.encode(hidden, ids).to(torch.bfloat16).float(), ids)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - started) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/tiny-pipeline.yaml")
    parser.add_argument("--large", default="configs/1b.yaml", help="a config sized from shapes only")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    args = parser.parse_args()

    config = load_config(args.config, args.overrides)
    tokens = (np.arange(200_000) * 7919 % 256).astype(np.uint16)  # any tokens do: bytes do not depend on them
    figures, rows = measured(config, tokens)
    ratio = config.model.d_model // config.pipeline.rank  # the large config at the same d/k
    large = load_config(args.large)
    large = with_overrides(large, ["model.tie_embeddings=false", f"pipeline.stages={config.pipeline.stages}",
                                   f"pipeline.rank={large.model.d_model // ratio}"])
    rows += computed(large)
    devices = [CPU] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    codec = [[c.run_id, str(device), f"{c.inner.batch_size}x{c.data.seq_len}",
              f"{c.model.d_model}->{c.pipeline.rank}", f"{1e3 * codec_seconds(c, device, repeats):.2f}"]
             for c, repeats in ((config, 20), (large, 2)) for device in devices]
    figures["codec_ms_per_micro_batch"] = float(codec[0][-1])
    if args.json:
        print(json.dumps(figures))
        return
    c = config
    print(f"{c.run_id}: d_model {c.model.d_model}, rank k {c.pipeline.rank} (d/k = {ratio}), {c.pipeline.stages} "
          f"stages, wire {c.pipeline.wire_dtype}, token ids on the wire as uint16")
    print()
    print("Stage-boundary traffic per token (one boundary, one direction)")
    print(format_table(("message", "bytes/token", "uncompressed bf16", "ratio"), [
        ["activations + ids", f"{figures['boundary_bytes_per_token']:.2f}", figures["dense_bf16_bytes_per_token"],
         f"{figures['ratio']:.1f}x"],
        ["activation gradients", f"{figures['boundary_gradient_bytes_per_token']:.2f}",
         figures["dense_bf16_bytes_per_token"],
         f"{figures['dense_bf16_bytes_per_token'] / figures['boundary_gradient_bytes_per_token']:.1f}x"]]))
    print()
    print("Memory a peer keeps: parameters, and the rest (gradients, AdamW moments, outer copy + error feedback, "
          "frozen tables)")
    print(format_table(("config", "worker", "params", "param bytes", "other state", "total", "vs full", "how"),
                       rows))
    print()
    print("Codec time per micro-batch: encode at the sender + decode at the receiver (bf16 on the wire)")
    print(format_table(("config", "device", "micro-batch", "d -> k", "ms"), codec))


if __name__ == "__main__":
    main()
