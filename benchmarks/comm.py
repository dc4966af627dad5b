"""Bytes on the wire per peer per round, and codec speed, for dense fp32, dense fp16, SparseLoCo and LoCo.

Every replica compresses its own random pseudo-gradient of the ~150M model's shapes; the butterfly
among N peers is then sized exactly as the swarm runs it: span i reduced by peer i, each sender's
encoded contribution to every other span, each reducer's result (relay or union, whichever is
smaller) to every other peer. Dense rows are the fp32 / fp16 butterfly of the same parameters. LoCo
(``outer.loco`` defaults: 4-bit codes, a float32 scale per 128 values) is sized the same way: each
sender's low-bit contribution to every other span, each reducer's re-quantized mean back.

    python benchmarks/comm.py                  # ~150M shapes, N = 2, 4, 8, densities 1/64 and 1/32
    python benchmarks/comm.py --config configs/tiny.yaml --peers 2 4
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from p2ploco.collective.exchange import Exchange, dense_fp32_bytes
from p2ploco.collective.lowbit import LowBitMean
from p2ploco.collective.sparse import SparseExchange
from p2ploco.compression import sparse_format as fmt
from p2ploco.compression.chunking import chunk_grid
from p2ploco.compression.groupwise import GroupLayout, quantize
from p2ploco.compression.sparse_format import SparseLayout
from p2ploco.compression.topk import compress
from p2ploco.config import LoCoConfig, load_config
from p2ploco.metrics import format_table
from p2ploco.model import Transformer


def model_shapes(config_path: str) -> list[tuple[int, ...]]:
    with torch.device("meta"):
        model = Transformer(load_config(config_path).model, seed=0)
    return [tuple(p.shape) for p in model.parameters()]


def compress_replica(layout: SparseLayout, seed: int, device: torch.device) -> tuple[list, float]:
    """One replica's compressed pseudo-gradient and the seconds compress() took."""
    generator = torch.Generator(device=device).manual_seed(seed)
    compressed, seconds = [], 0.0
    for grid in layout.grids:
        tensor = torch.randn(grid.shape, generator=generator, device=device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        compressed.append(compress(tensor, grid)[0])
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds += time.perf_counter() - started
    return compressed, seconds


def butterfly_bytes(exchanges: list[Exchange]) -> tuple[list[int], list[int]]:
    """Sent and received payload bytes of each peer in one butterfly round."""
    n = len(exchanges)
    sent, received = [0] * n, [0] * n
    for reducer, span in enumerate(exchanges[0].partition(n)):
        payloads = [e.encode(span) for e in exchanges]
        aggregate = exchanges[reducer].combine(span, [exchanges[reducer].parse(span, p) for p in payloads])
        for peer in range(n):
            if peer != reducer:
                result = exchanges[reducer].result_for(aggregate, peer)
                sent[peer] += len(payloads[peer])
                received[reducer] += len(payloads[peer])
                sent[reducer] += len(result)
                received[peer] += len(result)
    return sent, received


def loco_rows(shapes: list[tuple[int, ...]], peers: list[int], config: LoCoConfig) -> list[tuple]:
    """LoCo's bytes per peer per round for each group size in ``peers``, against the dense fp32 butterfly."""
    layout = GroupLayout(shapes, config.group_size)
    no_error = torch.zeros(layout.numel)  # the reducers' buffers: empty, as in a first round (the size is the same)
    exchanges = []
    for seed in range(max(peers)):
        values = torch.randn(layout.numel, generator=torch.Generator().manual_seed(seed))
        exchanges.append(LowBitMean(layout, config.bits, quantize(values, layout.lengths, config.bits), no_error,
                                    config.beta))
    rows = []
    for n in peers:
        sent, received = butterfly_bytes(exchanges[:n])
        spans = exchanges[0].partition(n)
        dense32 = sum(dense_fp32_bytes(exchanges[0], spans, i) / 2 for i in range(n)) / n  # each way
        mean_sent, mean_received = sum(sent) / n, sum(received) / n
        rows.append((n, f"{config.bits}-bit, {config.group_size} per scale",
                     f"{dense32 / 1e6:.1f} / {dense32 / 1e6:.1f}", f"{mean_sent / 1e6:.2f} / {mean_received / 1e6:.2f}",
                     f"{2 * dense32 / (mean_sent + mean_received):.1f}x", f"{8 * mean_sent / layout.numel:.3f}"))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/150m.yaml", help="model whose parameter shapes to use")
    parser.add_argument("--peers", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--topk", type=int, nargs="+", default=[64, 128], help="values kept per 64x64 chunk")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))

    shapes = model_shapes(args.config)
    params = sum(int(np.prod(s)) for s in shapes)
    print(f"parameter set: {args.config}, {params / 1e6:.1f}M parameters in {len(shapes)} tensors")
    rows, speed = [], []
    for topk in args.topk:
        layout = SparseLayout([chunk_grid(s, 64, topk) for s in shapes])
        replicas, compress_seconds = [], []
        for seed in range(max(args.peers)):
            compressed, seconds = compress_replica(layout, seed, torch.device("cpu"))
            replicas.append(compressed)
            compress_seconds.append(seconds)
        exchanges = [SparseExchange(layout, c, "mean") for c in replicas]
        whole = range(layout.num_chunks)
        payload = exchanges[0].encode(whole)
        started = time.perf_counter()
        fmt.decode_contribution(layout, whole, payload)
        decode_seconds = time.perf_counter() - started
        per_100m = 1e8 / params
        speed.append((f"1/{4096 // topk}", "cpu", f"{np.mean(compress_seconds) * per_100m:.2f}",
                      f"{decode_seconds * per_100m:.2f}", f"{8 * len(payload) / params:.3f}"))
        if torch.cuda.is_available():
            compress_replica(layout, 0, torch.device("cuda"))  # warm-up
            _, gpu_seconds = compress_replica(layout, 0, torch.device("cuda"))
            speed.append((f"1/{4096 // topk}", torch.cuda.get_device_name(), f"{gpu_seconds * per_100m:.2f}", "-", "-"))
        for n in args.peers:
            sent, received = butterfly_bytes(exchanges[:n])
            spans = exchanges[0].partition(n)
            dense32 = [dense_fp32_bytes(exchanges[0], spans, i) / 2 for i in range(n)]  # each way
            mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
            sparse_total = mean(sent) + mean(received)
            rows.append((n, f"1/{4096 // topk}",
                         f"{mean(dense32) / 1e6:.1f} / {mean(dense32) / 1e6:.1f}",
                         f"{mean(dense32) / 2e6:.1f} / {mean(dense32) / 2e6:.1f}",
                         f"{mean(sent) / 1e6:.2f} / {mean(received) / 1e6:.2f}",
                         f"{2 * mean(dense32) / sparse_total:.0f}x", f"{mean(dense32) / sparse_total:.0f}x",
                         f"{8 * mean(sent) / params:.3f}"))
    print()
    print("Bytes per peer per round, MB sent / received (mean over peers)")
    print(format_table(("peers", "density", "dense fp32", "dense fp16", "SparseLoCo", "vs fp32", "vs fp16",
                        "sent bits/param"), rows))
    print()
    print("LoCo: bytes per peer per round, MB sent / received (mean over peers)")
    print(format_table(("peers", "values", "dense fp32", "LoCo", "vs fp32", "sent bits/param"),
                       loco_rows(shapes, args.peers, LoCoConfig())))
    print()
    print("Codec speed, seconds per 100M parameters (one replica's whole pseudo-gradient)")
    print(format_table(("density", "device", "compress s", "decode s", "upload bits/param"), speed))


if __name__ == "__main__":
    main()
