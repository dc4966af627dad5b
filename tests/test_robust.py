"""Median-norm clipping of contributions: written-out reference arithmetic, identical bits on every path,
absurd contributions dropped, and a non-finite global update refused without an exit."""

import math
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from p2ploco.collective import robust
from p2ploco.collective.dense import DenseMean, tensor_to_bytes
from p2ploco.collective.exchange import reduce_span
from p2ploco.collective.inprocess import InProcessGroup
from p2ploco.collective.sparse import SparseExchange
from p2ploco.compression import sparse_format as fmt
from p2ploco.compression.chunking import chunk_grid
from p2ploco.compression.sparse_format import SparseLayout
from p2ploco.compression.topk import CompressedTensor, compress
from p2ploco.config import DiLoCoConfig
from p2ploco.errors import PayloadError
from p2ploco.outer.diloco import DiLoCo


def dense(values) -> bytes:
    return tensor_to_bytes(torch.tensor(values, dtype=torch.float32))


def test_the_largest_contribution_is_scaled_to_twice_the_median_norm():
    exchange = DenseMean([torch.zeros(2)], clip_factor=2.0)
    span = range(2)
    contributions = [("a", dense([3.0, 4.0])), ("b", dense([6.0, 8.0])), ("c", dense([3e6, 4e6]))]
    reduction = reduce_span(exchange, span, contributions)
    assert reduction.included == ["a", "b", "c"] and reduction.clipped == ["c"] and not reduction.rejected
    exchange.receive(span, reduction.result_for(exchange, "a"), 0)
    # Written out: norms 5, 10, 5e6; lower median 10; bound 2 * 10 = 20; c scaled by float32(20 / 5e6).
    scale = np.float32(20.0 / 5e6)
    c = np.array([3e6, 4e6], dtype=np.float32) * scale
    total = np.array([3.0, 4.0], dtype=np.float32) + np.array([6.0, 8.0], dtype=np.float32) + c
    expected = total / np.float32(3)
    assert np.array_equal(exchange.mean()[0].numpy(), expected)
    assert math.isclose(float(np.linalg.norm(c)), 20.0, rel_tol=1e-6)


def test_in_a_group_of_two_the_larger_contribution_is_bounded_by_the_smaller():
    exchange = DenseMean([torch.zeros(2)], clip_factor=1.5)
    honest, hostile = dense([0.3, 0.4]), dense([-3e5, 4e5])
    for order in (("h", honest), ("x", hostile)), (("x", hostile), ("h", honest)):
        reduction = reduce_span(exchange, range(2), list(order))
        assert reduction.clipped == ["x"]
        exchange.receive(range(2), reduction.result_for(exchange, "h"), None)
        hostile_part = np.array([-3e5, 4e5], dtype=np.float32) * np.float32(1.5 * 0.5 / 5e5)
        parts = [np.array([0.3, 0.4], dtype=np.float32), hostile_part]
        if order[0][0] == "x":
            parts.reverse()
        assert np.array_equal(exchange.mean()[0].numpy(), (parts[0] + parts[1]) / np.float32(2))


def test_contributions_within_the_bound_keep_every_bit():
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randn(1000, generator=generator) for _ in range(4)]
    span = range(1000)
    results = []
    for factor in (0.0, 2.0):
        exchange = DenseMean([torch.zeros(1000)], clip_factor=factor)
        reduction = reduce_span(exchange, span, [(f"p{i}", tensor_to_bytes(t)) for i, t in enumerate(inputs)])
        assert reduction.clipped == []
        results.append(reduction.aggregate)
    assert results[0] == results[1]


def test_norms_bounds_and_the_zero_median():
    assert robust.norm(np.array([3.0, 4.0], dtype=np.float32)) == 5.0
    assert robust.bound([5.0, 1.0, 3.0, 100.0], 2.0) == 6.0  # lower median of 1, 3, 5, 100 is 3
    assert robust.bound([5.0, 1.0], 0.0) is None  # clipping off
    assert robust.bound([0.0, 0.0, 7.0], 2.0) is None  # a zero median would erase the one real contribution
    with pytest.raises(PayloadError, match="absurdly large"):
        robust.norm(np.array([3e38, 3e38], dtype=np.float32) * np.float32(1))
    with pytest.raises(PayloadError, match="absurdly large"):
        robust.norm(np.full(4, 2.0**63, dtype=np.float32))


def test_an_absurd_contribution_drops_its_sender():
    exchange = DenseMean([torch.zeros(3)], clip_factor=2.0)
    reduction = reduce_span(exchange, range(3), [("a", dense([1.0, 2.0, 3.0])), ("b", dense([3e38, -3e38, 3e38])),
                                                 ("c", dense([2.0, 2.0, 2.0]))])
    assert reduction.included == ["a", "c"] and "absurdly large" in reduction.rejected["b"]


@pytest.fixture(scope="module")
def layout():
    return SparseLayout([chunk_grid(s, 64, 64) for s in [(128, 192), (192,), (96, 100)]])


def replica(layout, seed, scale=1.0):
    generator = torch.Generator().manual_seed(seed)
    return [compress(torch.randn(g.shape, generator=generator) * scale, g)[0] for g in layout.grids]


def scaled(compressed, factor):
    """The same selection with every decoded value multiplied by ``factor`` (a poisoned, well-formed update)."""
    return [CompressedTensor(c.grid, c.indices, c.codes, np.float32(c.shift * factor), c.table * np.float32(factor))
            for c in compressed]


def test_sparse_clipping_equals_the_written_out_reference_on_every_result_path(layout):
    replicas = [replica(layout, 0), replica(layout, 1), scaled(replica(layout, 2), 1e6)]
    exchanges = [SparseExchange(layout, c, "mean", clip_factor=2.0) for c in replicas]
    whole = range(layout.num_chunks)
    payloads = [e.encode(whole) for e in exchanges]
    reduction = reduce_span(exchanges[0], whole, list(zip("abc", payloads)))
    assert reduction.clipped == ["c"]

    # Reference: decode, float64 norms, lower median, float32 scale, per-coordinate mean over selectors.
    decoded = [fmt.decode_contribution(layout, whole, p) for p in payloads]
    norms = [math.sqrt(sum(float(v) ** 2 for v in d.values.astype(np.float64))) for d in decoded]
    limit = 2.0 * sorted(norms)[1]
    total = np.zeros(layout.total_numel, dtype=np.float32)
    count = np.zeros(layout.total_numel, dtype=np.float32)
    for d, n in zip(decoded, norms):
        values = d.values * np.float32(limit / n) if n > limit else d.values
        total[d.positions] += values
        count[d.positions] += 1
    expected = np.zeros(layout.total_numel, dtype=np.float32)
    expected[count > 0] = total[count > 0] / count[count > 0]

    for rank, exchange in enumerate(exchanges):
        relay = fmt.encode_relay(layout, [p for i, p in enumerate(payloads) if i != rank])
        exchange.receive(whole, relay, rank)  # the recipient clips the relayed contributions itself
        assert np.array_equal(exchange.output, expected)
        union_receiver = SparseExchange(layout, replicas[rank], "mean", clip_factor=2.0)
        union_receiver.receive(whole, reduction.aggregate.union, rank)
        assert np.array_equal(union_receiver.output, expected)
    hostile = np.zeros(layout.total_numel, dtype=np.float32)
    hostile[decoded[2].positions] = decoded[2].values
    assert np.abs(expected).max() < 1e3 < np.abs(hostile).max() / 1e3  # the 1e6 scale did not get through


def test_honest_sparse_rounds_are_untouched_by_clipping(layout):
    replicas = [replica(layout, seed) for seed in range(4)]
    outputs = []
    for factor in (0.0, 2.0):
        exchanges = [SparseExchange(layout, c, "mean", clip_factor=factor) for c in replicas]
        group = InProcessGroup(4)
        communicators = [group.communicator(rank) for rank in range(4)]
        with ThreadPoolExecutor(4) as pool:
            stats = list(pool.map(lambda c, e: c.all_reduce(e, 0, "params"), communicators, exchanges))
        assert all(s.clipped == [] for s in stats)
        outputs.append(exchanges[0].output.copy())
    assert np.array_equal(outputs[0], outputs[1])


def test_a_non_finite_global_update_is_refused_and_nothing_changes():
    """A step that would overflow float32 (here through an outer lr of 1e21) is refused by every replica alike:
    params and momentum stay as they were, and nobody exits."""
    initial = [torch.zeros(4)]
    algorithm = DiLoCo(initial, DiLoCoConfig(lr=1e21, momentum=0.9), clip_factor=2.0)
    stats = algorithm.sync([initial[0] - 1e18], InProcessGroup(1).communicator(0), 0)
    assert not stats.committed
    assert torch.equal(algorithm.params[0], initial[0]) and torch.equal(algorithm.momentum[0], torch.zeros(4))
    sane = DiLoCo(initial, DiLoCoConfig(lr=0.7, momentum=0.9), clip_factor=2.0)
    assert sane.sync([initial[0] - 1e18], InProcessGroup(1).communicator(0), 0).committed
