"""Bytes on the wire per peer per round, and codec speed, for dense fp32, dense fp16, SparseLoCo and LoCo.

Every replica compresses its own random pseudo-gradient of the ~150M model's shapes; the butterfly
among N peers is then sized exactly as the swarm runs it: span i reduced by peer i, each sender's
encoded contribution to every other span, each reducer's result (relay or union, whichever is
smaller) to every other peer. (Past ``group.MAX_REDUCERS`` = 32 reducers a group draws 32 of its members to
reduce: the bytes per peer below are then about what its members average, of which a drawn reducer carries N / 32
times a member's share of the contributions and results.) Dense rows are the fp32 / fp16 butterfly of the same
parameters. LoCo (``outer.loco`` defaults: 4-bit codes, a float32 scale per 128 values) is sized the same way: each
sender's low-bit contribution to every other span, each reducer's re-quantized mean back.

Peak bandwidth: Streaming DiLoCo syncs P fragments (``outer.streaming``) at different inner steps, so what
a link must carry at once is one fragment's all-reduce. The peak table sizes each fragment's butterfly
(E3M0 values, or float32) among N peers and reports the round's total and its largest single sync, next
to DiLoCo's one fp32 sync of everything (the claim: the peak falls ~P-fold).

Codec speed is in GB/s of fp32 pseudo-gradient (4 bytes per parameter of the whole model), per peer:

- compress: the sender's side, through SparseLoCo's own code: the pseudo-gradient (global - local,
  checked finite), error feedback, Top-k of every chunk, 2-bit values, the buffer update, and the
  encoding of its contributions to all N spans. On the CPU, and on CUDA where there is one (the
  encoding runs on the CPU either way).
- decode+aggregate: the receiver's side, on the CPU: reducing its own span (decoding the N - 1 others'
  contributions, clipping, aggregating, and the results for them), taking the N - 1 other spans'
  results (relays decoded and aggregated, or unions decoded), the aggregate's digest, and the
  aggregate per tensor as the outer step applies it. The other reducers' work is done beforehand.

Scaling (issue 22): per-peer bytes per round of SparseLoCo at N = 2 ... 1024 for today's butterfly with exact
results (``outer.sparseloco.result=exact``: the contributions relayed or their union) and for resparsified results
(the default: each reducer sends back the Top-k of its span's mean), next to what one peer sends in a dense fp32
butterfly of the same parameters. Resparsified sizes are real encodings at every N: peer j contributes replica
j mod R's compressed pseudo-gradient (R = ``--replicas``, each compressed for real as a group of N sends it: k =
min(topk, ``result_topk`` / N) values per chunk, at least 1), each span's result is its reducer's real
resparsified encoding of the mean of the N contributions. A result holds k values per chunk whatever the values,
min(``result_topk``, N x k), so its size hardly depends on how many distinct replicas went into the mean. Exact
results are encoded for real up to ``--real-up-to`` peers (distinct replicas; a union's size does depend on how
many). Beyond that they follow the scaling model of docs/design.md ("Hundreds of peers"): the bytes a peer
receives grow with n - 1, so they are extrapolated linearly in n - 1 from the largest measured n, and the
row says so.

    python benchmarks/comm.py                  # ~150M shapes, N = 2, 4, 8, densities 1/64 and 1/32
    python benchmarks/comm.py --config configs/tiny.yaml --peers 2 4
    python benchmarks/comm.py --scale-only --scale-peers 2 8 32 128 1024 --json   # the scaling rows alone
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
import torch

from p2ploco.collective.dense import DenseMean
from p2ploco.collective.exchange import Exchange, dense_fp32_bytes, reduce_span
from p2ploco.collective.fp4 import E3M0Mean
from p2ploco.collective.lowbit import LowBitMean
from p2ploco.collective.robust import Policy
from p2ploco.collective.sparse import SparseExchange
from p2ploco.compression.blockwise import BlockLayout, quantize
from p2ploco.compression.sparse_format import SparseLayout
from p2ploco.compression.topk import CompressedTensor
from p2ploco.config import LoCoConfig, SparseLoCoConfig, load_config
from p2ploco.metrics import format_table
from p2ploco.model import Transformer
from p2ploco.outer.sparseloco import SparseLoCo
from p2ploco.slices import group_by_slice

DEFENDED = Policy(clip_factor=2.0, drop_opposed=True)  # the default config's: what a reducer and a member check


def model_shapes(config_path: str) -> list[tuple[int, ...]]:
    with torch.device("meta"):
        model = Transformer(load_config(config_path).model, seed=0)
    return [tuple(p.shape) for p in model.parameters()]


def fragment_shapes(config_path: str, fragments: int) -> list[list[tuple[int, ...]]]:
    """The parameter shapes of each Streaming DiLoCo fragment of the model (``p2ploco/slices.py``)."""
    config = load_config(config_path)
    with torch.device("meta"):
        named = list(Transformer(config.model, seed=0).named_parameters())
    slices = group_by_slice([name for name, _ in named], config.model, 1, fragments)
    return [[tuple(named[i][1].shape) for i in positions] for positions in slices.values()]


def peak_rows(config_path: str, peers: list[int], fragment_counts: list[int]) -> list[tuple]:
    """Per group size: DiLoCo fp32 (one sync), then Streaming with each fragment count (E3M0, and fp32 at the
    largest count): MB per peer per round (sent + received, mean over peers), MB of its largest sync."""
    rows = []
    fragment_counts = [p for p in fragment_counts if p <= load_config(config_path).model.n_layer]  # a block each
    settings = [("DiLoCo fp32", 1, "float32")] + [("Streaming E3M0", p, "e3m0") for p in fragment_counts]
    settings.append(("Streaming fp32", max(fragment_counts), "float32"))
    for n in peers:
        baseline = None
        for name, count, values in settings:
            syncs = []
            for shapes in fragment_shapes(config_path, count):
                exchanges = []
                for seed in range(n):
                    generator = torch.Generator().manual_seed(seed)
                    deltas = [torch.randn(s, generator=generator) for s in shapes]
                    exchanges.append(E3M0Mean(deltas) if values == "e3m0" else DenseMean(deltas))
                sent, received = butterfly_bytes(exchanges)
                syncs.append((sum(sent) + sum(received)) / n)
            peak = max(syncs)
            baseline = baseline or peak
            rows.append((n, name, count, f"{sum(syncs) / 1e6:.2f}", f"{peak / 1e6:.2f}", f"{sum(syncs) / peak:.2f}",
                         f"{baseline / peak:.1f}x"))
    return rows


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def compress_replicas(shapes: list[tuple[int, ...]], topk: int, replicas: int, device: torch.device,
                      ) -> tuple[SparseLoCo, list[list[CompressedTensor]], list[float]]:
    """Each replica's compressed pseudo-gradient (one SparseLoCo, its error feedback emptied in between) and
    the seconds each compress took, after one warm-up."""
    zeros = [torch.zeros(s) for s in shapes]
    outer = SparseLoCo(zeros, SparseLoCoConfig(topk=topk), device)
    generator = torch.Generator(device=device).manual_seed(0)
    compressed, seconds = [], []
    for replica in range(replicas + 1):
        local = [torch.randn(s, generator=generator, device=device) for s in shapes]
        outer.reset_local_state()
        synchronize(device)
        started = time.perf_counter()
        sent, _ = outer.compress(local, outer.params)
        synchronize(device)
        if replica:  # the first is the warm-up
            seconds.append(time.perf_counter() - started)
            compressed.append(sent)
    return outer, compressed, seconds


def encode_seconds(exchange: SparseExchange, parts: int) -> float:
    """Seconds to encode one replica's contributions to every span of a group of ``parts``."""
    started = time.perf_counter()
    for span in exchange.partition(parts):
        exchange.encode(span)
    return time.perf_counter() - started


def receive_seconds(exchanges: list[SparseExchange]) -> float:
    """Seconds peer 0 of the group takes to reduce its span and take every span's aggregate."""
    n = len(exchanges)
    names = [f"peer{i}" for i in range(n)]
    spans = exchanges[0].partition(n)
    payloads = [[e.encode(span) for span in spans] for e in exchanges]
    results = []
    for r, span in enumerate(spans[1:], start=1):  # the other reducers' work, not timed
        reduction = reduce_span(exchanges[r], span, list(zip(names, (p[r] for p in payloads))))
        results.append((span, reduction.result_for(exchanges[r], names[0]), reduction.receipt_for(names[0])))
    me = exchanges[0]
    started = time.perf_counter()
    reduction = reduce_span(me, spans[0], list(zip(names, (p[0] for p in payloads))))
    for peer in names[1:]:
        reduction.result_for(me, peer)
    me.receive(spans[0], reduction.result_for(me, names[0]), reduction.receipt_for(names[0]))
    for span, result, receipt in results:
        me.receive(span, result, receipt)
    me.aggregate_digest()
    me.updates()
    return time.perf_counter() - started


def butterfly_bytes(exchanges: list[Exchange]) -> tuple[list[int], list[int]]:
    """Sent and received payload bytes of each peer in one butterfly round."""
    n = len(exchanges)
    sent, received = [0] * n, [0] * n
    for reducer, span in enumerate(exchanges[0].partition(n)):
        payloads = [e.encode(span) for e in exchanges]
        aggregate = exchanges[reducer].combine(span, [exchanges[reducer].parse(span, p) for p in payloads], [1.0] * n)
        for peer in range(n):
            if peer != reducer:
                result = exchanges[reducer].result_for(aggregate, peer)
                sent[peer] += len(payloads[peer])
                received[reducer] += len(payloads[peer])
                sent[reducer] += len(result)
                received[peer] += len(result)
    return sent, received


@dataclass
class ScaleRow:
    peers: int
    design: str  # "butterfly": exact results; "resparsified": the default
    bytes_sent_per_peer: float
    bytes_received_per_peer: float
    dense_fp32_bytes_per_peer: float  # one peer's send in a dense fp32 butterfly of the same parameters
    extrapolated: bool  # from the scaling model rather than encoded


def shared_exchanges(shapes: list[tuple[int, ...]], topk: int, result_topk: int, replicas: int, n: int
                     ) -> list[SparseExchange]:
    """``replicas`` distinct SparseLoCo contributions with resparsified results, each as a group of ``n`` holders
    sends it (``fit_group``: fewer values per chunk once n x topk passes the result's cap)."""
    zeros = [torch.zeros(s) for s in shapes]
    outer = SparseLoCo(zeros, SparseLoCoConfig(topk=topk, result_topk=result_topk), torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    exchanges = []
    for _ in range(replicas):
        outer.reset_local_state()
        (part,) = outer.contribute([torch.randn(s, generator=generator) for s in shapes], 0).exchange.parts.values()
        part.fit_group(n)
        exchanges.append(part)
    return exchanges


def resparsified_bytes(exchanges: list[SparseExchange], n: int) -> tuple[float, float]:
    """Mean sent and received bytes per peer of a butterfly among ``n`` peers with resparsified results, peer j
    contributing ``exchanges[j % len(exchanges)]``'s (each fitted to a group of n): every contribution to every span
    and every result encoded."""
    spans = exchanges[0].partition(n)
    distinct = len(exchanges)
    to_span = np.zeros((distinct, n))  # bytes of replica r's contribution to span i
    result = np.zeros(n)
    for i, span in enumerate(spans):
        reducer = exchanges[i % distinct]
        # n contributions, R of them distinct: a result's k is that of n contributions (``ResultLayouts``), and its
        # bytes hardly depend on how many distinct values it picks from (Rice-coded positions, 2-bit values); each
        # distinct one is encoded and parsed once (n^2 of them at N = 1024 would take hours at 150M)
        payloads = [exchanges[r].encode(span) for r in range(min(n, distinct))]
        to_span[: len(payloads), i] = [len(p) for p in payloads]
        parsed = [reducer.parse(span, p) for p in payloads]
        combined = reducer.combine(span, [parsed[j % len(parsed)] for j in range(n)], [1.0] * n)
        result[i] = len(reducer.result_for(combined, None))
    own = np.array([to_span[j % distinct] for j in range(n)])  # (peers, spans)
    sent = own.sum(axis=1) - own.diagonal() + (n - 1) * result
    received = (result.sum() - result) + (own.sum(axis=0) - own.diagonal())
    return float(sent.mean()), float(received.mean())


def scale_rows(layout: SparseLayout, replicas: list[list[CompressedTensor]],
               fitted: Callable[[int], list[SparseExchange]], peers: list[int], real_up_to: int) -> list[ScaleRow]:
    """Per-peer bytes per round of the exact butterfly (``replicas``' contributions) and of resparsified results
    (``fitted(n)``: the distinct contributions as a group of n sends them), for each group size."""
    rows, measured = [], None
    geometry = SparseExchange(layout, [], "mean")  # spans and element counts only
    for n in peers:
        spans = geometry.partition(n)
        dense = sum(dense_fp32_bytes(geometry, spans, i) / 2 for i in range(n)) / n
        if n <= min(real_up_to, len(replicas)):
            sent, received = butterfly_bytes([SparseExchange(layout, c, "mean") for c in replicas[:n]])
            measured = n, sum(sent) / n, sum(received) / n
            rows.append(ScaleRow(n, "butterfly", measured[1], measured[2], dense, False))
        elif measured is not None:
            base, base_sent, base_received = measured
            factor = (n - 1) / (base - 1)
            rows.append(ScaleRow(n, "butterfly", base_sent * factor, base_received * factor, dense, True))
        sent, received = resparsified_bytes(fitted(n), n)
        rows.append(ScaleRow(n, "resparsified", sent, received, dense, False))
    return rows


def scale_table(rows: list[ScaleRow]) -> str:
    by_peers: dict[int, dict[str, ScaleRow]] = {}
    for row in rows:
        by_peers.setdefault(row.peers, {})[row.design] = row
    reference = 8 if 8 in by_peers else rows[0].peers  # the yardstick: N = 1024 against N = 8
    smallest = {design: by_peers[reference][design] for design in ("butterfly", "resparsified")}
    table = []
    for n, designs in by_peers.items():
        for design, row in designs.items():
            total = row.bytes_sent_per_peer + row.bytes_received_per_peer
            first = smallest[design]
            table.append((n, design + (" (model)" if row.extrapolated else ""),
                          f"{row.bytes_sent_per_peer / 1e6:.2f} / {row.bytes_received_per_peer / 1e6:.2f}",
                          f"{row.dense_fp32_bytes_per_peer / 1e6:.1f}",
                          f"{2 * row.dense_fp32_bytes_per_peer / total:.0f}x",
                          f"{total / (first.bytes_sent_per_peer + first.bytes_received_per_peer):.2f}"))
    return format_table(("peers", "design", "MB sent / received", "dense fp32 MB sent", "vs dense fp32",
                         f"vs N={reference}"), table)


def loco_rows(shapes: list[tuple[int, ...]], peers: list[int], config: LoCoConfig) -> list[tuple]:
    """LoCo's bytes per peer per round for each group size in ``peers``, against the dense fp32 butterfly."""
    layout = BlockLayout(shapes, config.group_size)
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
    parser.add_argument("--fragments", type=int, nargs="+", default=[1, 2, 4],
                        help="Streaming DiLoCo fragment counts for the peak table")
    parser.add_argument("--scale-peers", type=int, nargs="+",
                        help="group sizes of the scaling table (default with --scale-only or --json: 2 8 32 128 1024; "
                             "otherwise no scaling table: it takes minutes at 150M)")
    parser.add_argument("--real-up-to", type=int, default=128,
                        help="largest group whose exact butterfly is encoded for real (one compressed replica each)")
    parser.add_argument("--replicas", type=int, default=8,
                        help="distinct compressed replicas the resparsified rows cycle through")
    parser.add_argument("--result-topk", type=int, default=SparseLoCoConfig().result_topk,
                        help="values per 64x64 chunk of a resparsified result (outer.sparseloco.result_topk)")
    parser.add_argument("--scale-only", action="store_true", help="print the scaling table alone")
    parser.add_argument("--json", action="store_true",
                        help="print the scaling rows as JSON, one object per (peers, design), and nothing else")
    args = parser.parse_args()

    shapes = model_shapes(args.config)
    params = sum(int(np.prod(s)) for s in shapes)
    log = (lambda *a, **k: None) if args.json else print  # noqa: E731 (the JSON alone on stdout)
    log(f"parameter set: {args.config}, {params / 1e6:.1f}M parameters in {len(shapes)} tensors; "
        f"{torch.get_num_threads()} CPU threads")
    if args.scale_peers is None and (args.scale_only or args.json):
        args.scale_peers = [2, 8, 32, 128, 1024]
    if args.scale_peers:
        scaling(args, shapes)
    if not args.scale_only and not args.json:
        tables(args, shapes, params)


def scaling(args: argparse.Namespace, shapes: list[tuple[int, ...]]) -> None:
    """The scaling table (or its JSON rows) for ``--scale-peers``."""
    topk = args.topk[0]
    exact_replicas = min(args.real_up_to, max(n for n in args.scale_peers))
    outer, replicas, _ = compress_replicas(shapes, topk, exact_replicas, torch.device("cpu"))
    rows = scale_rows(outer.layouts["stage0"], replicas,
                      lambda n: shared_exchanges(shapes, topk, args.result_topk, args.replicas, n),
                      args.scale_peers, args.real_up_to)
    del replicas
    if args.json:
        for row in rows:
            print(json.dumps(asdict(row)))
        return
    print()
    print(f"Scaling, density 1/{4096 // topk}, results 1/{4096 // args.result_topk}: bytes per peer per round, exact "
          f"butterfly vs resparsified results (model: extrapolated from the largest encoded N)")
    print(scale_table(rows))


def tables(args: argparse.Namespace, shapes: list[tuple[int, ...]], params: int) -> None:
    """Bytes, LoCo, peak bandwidth and codec speed tables for ``--peers`` and ``--topk``."""
    gigabytes = 4 * params / 1e9  # the fp32 pseudo-gradient
    rows, speed = [], []
    for topk in args.topk:
        density = f"1/{4096 // topk}"
        outer, replicas, compress_seconds = compress_replicas(shapes, topk, max(args.peers), torch.device("cpu"))
        layout = outer.layouts["stage0"]
        gpu_seconds = None
        if torch.cuda.is_available():
            gpu_seconds = float(np.median(compress_replicas(shapes, topk, 3, torch.device("cuda"))[2]))
        for n in args.peers:
            exchanges = [SparseExchange(layout, c, "mean", DEFENDED) for c in replicas[:n]]
            encoding = float(np.median([encode_seconds(SparseExchange(layout, c, "mean"), n) for c in replicas[:n]]))
            receiving = receive_seconds(exchanges)
            upload = 8 * sum(len(exchanges[0].encode(span)) for span in exchanges[0].partition(n)) / params
            cpu = float(np.median(compress_seconds)) + encoding
            speed.append((density, n, "cpu", f"{gigabytes / cpu:.3g}", f"{gigabytes / receiving:.3g}", f"{upload:.3f}"))
            if gpu_seconds is not None:
                speed.append((density, n, torch.cuda.get_device_name(), f"{gigabytes / (gpu_seconds + encoding):.3g}",
                              "-", f"{upload:.3f}"))

            sent, received = butterfly_bytes([SparseExchange(layout, c, "mean") for c in replicas[:n]])
            spans = exchanges[0].partition(n)
            dense32 = [dense_fp32_bytes(exchanges[0], spans, i) / 2 for i in range(n)]  # each way
            mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
            sparse_total = mean(sent) + mean(received)
            rows.append((n, density,
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
    print("Peak bandwidth: MB per peer per round (sent + received) and in its largest single sync")
    print(format_table(("peers", "algorithm", "fragments", "MB/round", "peak MB/sync", "round / peak",
                        "peak vs DiLoCo fp32"), peak_rows(args.config, args.peers, args.fragments)))
    print()
    print("Codec speed, GB/s of fp32 pseudo-gradient per peer (compress: sender side; decode+aggregate: "
          "receiver side)")
    print(format_table(("density", "peers", "device", "compress GB/s", "decode+aggregate GB/s", "upload bits/param"),
                       speed))


if __name__ == "__main__":
    main()
