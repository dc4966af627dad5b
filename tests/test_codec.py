"""The fast codec paths against plain written-out references: Top-k with a lower bound, blocked sparse
aggregation, Rice codes of one width, chunk-order offsets; a SparseExchange that decodes every contribution
once and builds the union only when it may win; SparseLoCo's chunk-order error feedback (checkpoint layout,
reset, exact give-back on an aborted round) and its sparse outer step."""

import threading

import numpy as np
import pytest
import torch

from p2ploco.collective.dense import DenseMean
from p2ploco.collective.exchange import AllReduceResult, Communicator, Exchange, reduce_span
from p2ploco.collective.sliced import reduce_alone
from p2ploco.collective.sparse import SparseExchange
from p2ploco.compression import sparse_format as fmt
from p2ploco.compression import topk
from p2ploco.compression.bitcodes import rice_decode, rice_encode
from p2ploco.compression.chunking import chunk_grid
from p2ploco.compression.sparse_format import SparseLayout, SparseValues
from p2ploco.compression.topk import compress, top_positions
from p2ploco.config import SparseLoCoConfig
from p2ploco.errors import TrainingError
from p2ploco.outer.base import all_finite
from p2ploco.outer.sparseloco import SparseLoCo
from p2ploco.testing.communicator import InProcessGroup

SHAPES = [(128, 192), (257, 64), (192,), (96, 100)]


@pytest.mark.parametrize("n, k", [(4096, 64), (4096, 128), (3072, 48), (4096, 16), (64, 1)])
def test_top_positions_are_the_topk_of_every_row(n, k, monkeypatch):
    monkeypatch.setattr(topk, "ROWS_PER_BLOCK", 64)  # 5 blocks of rows
    generator = torch.Generator().manual_seed(n + k)
    rows = torch.randn(300, n, generator=generator) * torch.rand(300, 1, generator=generator) * 10
    rows[3] = 0.0  # every value tied: more candidates than the bounded path takes
    rows[4, : n // 2] = 1.0  # ties at the k-th largest
    rows[5, -n // 8 :] = 50.0 + torch.arange(n // 8)  # the whole Top-k in one corner of the chunk
    rows[6, 5] = float("nan")  # NaN counts as the largest, as in torch.topk
    rows[7, torch.arange(min(k, 8)) * (n // 8) + 3] = float("nan")  # NaNs in several groups, at most k of them
    got = top_positions(rows, k)
    expected = torch.topk(rows.abs(), k, dim=1).indices.sort(dim=1).values
    assert got.shape == (300, k) and bool((got.diff(dim=1) > 0).all())  # sorted, no repeats
    distinct = [r for r in range(300) if r not in (3, 4)]  # tied rows may pick any of the equal values
    assert torch.equal(got[distinct], expected[distinct])
    for r in (3, 4):
        magnitudes = rows[r].abs()
        assert torch.equal(magnitudes[got[r]].sort().values, magnitudes[expected[r]].sort().values)


def test_rice_codes_of_one_width_round_trip_at_every_width():
    rng = np.random.default_rng(2)
    for width in (1, 5, 8, 9, 13, 16):
        gaps = rng.integers(0, 1 << (width + 2), 999)
        widths = np.full(999, width)
        unary, remainders = rice_encode(gaps, widths)
        assert len(remainders) == (999 * width + 7) // 8
        assert np.array_equal(rice_decode(unary, remainders, widths), gaps)


def test_flat_index_maps_chunk_order_to_row_major():
    for shape in [(128, 192), (257, 64), (192,), (96, 100), (4, 8, 16)]:
        grid = chunk_grid(shape, 64, 64)
        row_major = torch.arange(grid.numel).view(shape)
        chunk_order = grid.to_chunks(row_major).reshape(-1).numpy()  # element j of the chunk order sits here
        assert np.array_equal(grid.flat_index(np.arange(grid.numel)), chunk_order)


def dense_reference(numel, contributions, mode):
    """The aggregate written out densely: sums from 0.0 in contribution order, counts, then the division."""
    total, count = np.zeros(numel, np.float32), np.zeros(numel, np.float32)
    for c in contributions:
        total[c.positions] += c.values
        count[c.positions] += 1
    selected = np.flatnonzero(count)
    divisor = count[selected] if mode == "mean" else np.float32(len(contributions))
    return selected, total[selected] / divisor


@pytest.mark.parametrize("mode", ["mean", "sum"])
@pytest.mark.parametrize("block", [1 << 20, 1000])  # one block, and many with positions across their edges
def test_blocked_aggregate_equals_the_dense_reference(monkeypatch, mode, block):
    monkeypatch.setattr(fmt, "AGGREGATE_BLOCK", block)
    rng = np.random.default_rng(3)
    numel = 50_000
    contributions = []
    for _ in range(5):
        positions = np.unique(rng.integers(0, numel, 4000))
        contributions.append(SparseValues(positions, rng.standard_normal(len(positions)).astype(np.float32)))
    contributions.append(SparseValues(contributions[0].positions, -contributions[0].values))  # cancels exactly
    got = fmt.aggregate(numel, contributions, mode)
    want_positions, want_values = dense_reference(numel, contributions, mode)
    assert np.array_equal(got.positions, want_positions)
    assert np.array_equal(got.values.view(np.uint32), want_values.view(np.uint32))  # bits, signed zeros too


@pytest.fixture(scope="module")
def layout():
    return SparseLayout([chunk_grid(s, 64, 64) for s in SHAPES])


def replica(layout, seed, shared=None):
    """A replica's compressed tensors; ``shared``: this replica's selection equals that one's (full overlap)."""
    generator = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(g.shape, generator=generator) for g in layout.grids]
    return [compress(t, g)[0] for t, g in zip(shared or tensors, layout.grids)]


def counting(monkeypatch, name):
    calls = []
    original = getattr(fmt, name)
    monkeypatch.setattr(fmt, name, lambda *args: calls.append(1) or original(*args))
    return calls


def test_the_reducer_decodes_each_contribution_once_and_never_its_own(layout, monkeypatch):
    exchanges = [SparseExchange(layout, replica(layout, seed), "mean") for seed in range(3)]
    whole = range(layout.num_chunks)
    payloads = [e.encode(whole) for e in exchanges]
    decoded = counting(monkeypatch, "decode_contribution")
    reducer = exchanges[1]
    reduction = reduce_span(reducer, whole, list(zip("abc", payloads)))
    assert len(decoded) == 2  # the others' contributions; its own is read from its compressed tensors
    reducer.receive(whole, reduction.result_for(reducer, "b"), reduction.receipt_for("b"))
    assert len(decoded) == 2  # its own span's aggregate as it combined it: nothing decoded again
    exchanges[0].receive(whole, reduction.result_for(reducer, "a"), reduction.receipt_for("a"))
    assert len(decoded) == 4  # a relay recipient decodes the two contributions it lacks, once each
    assert np.array_equal(exchanges[0].output, reducer.output)
    assert exchanges[0].aggregate_digest() == reducer.aggregate_digest()


def test_the_union_is_built_only_when_it_may_be_smaller(layout, monkeypatch):
    whole = range(layout.num_chunks)
    built = counting(monkeypatch, "encode_union")
    independent = [SparseExchange(layout, replica(layout, seed), "mean") for seed in range(3)]
    aggregate = independent[0].combine(whole, [independent[0].parse(whole, e.encode(whole)) for e in independent],
                                       [1.0] * 3)
    assert not aggregate.union_may_win and built == []
    assert fmt.read_kind(layout, independent[0].result_for(aggregate, 0)) == fmt.RELAY
    generator = torch.Generator().manual_seed(9)
    tensors = [torch.randn(g.shape, generator=generator) for g in layout.grids]
    identical = [SparseExchange(layout, replica(layout, seed, tensors), "mean") for seed in range(6)]
    aggregate = identical[0].combine(whole, [identical[0].parse(whole, e.encode(whole)) for e in identical],
                                     [1.0] * 6)
    assert aggregate.union_may_win and len(built) == 1
    assert fmt.read_kind(layout, identical[0].result_for(aggregate, 0)) == fmt.UNION
    assert len(built) == 1  # built once, for every recipient


def test_relay_and_union_recipients_hold_the_same_digest(layout):
    """The digest hashes the sparse aggregate, whichever encoding brought it; a different aggregate differs."""
    generator = torch.Generator().manual_seed(9)
    tensors = [torch.randn(g.shape, generator=generator) for g in layout.grids]
    exchanges = [SparseExchange(layout, replica(layout, seed, tensors if seed else None), "mean")
                 for seed in range(4)]
    whole = range(layout.num_chunks)
    reduction = reduce_span(exchanges[0], whole, [(str(i), e.encode(whole)) for i, e in enumerate(exchanges)])
    aggregate = reduction.aggregate
    by_relay, by_union = exchanges[1], exchanges[2]
    by_relay.receive(whole, fmt.encode_relay(layout, [p for i, p in enumerate(aggregate.payloads) if i != 1]),
                     reduction.receipt_for("1"))
    by_union.receive(whole, aggregate.union, reduction.receipt_for("2"))
    assert by_relay.aggregate_digest() == by_union.aggregate_digest()
    other = SparseExchange(layout, replica(layout, 0), "mean")
    reduce_alone(other)
    assert other.aggregate_digest() != by_relay.aggregate_digest()


def test_sparse_updates_equal_the_dense_aggregate(layout):
    exchanges = [SparseExchange(layout, replica(layout, seed), "mean") for seed in range(3)]
    group = InProcessGroup(3)
    threads = [threading.Thread(target=group.communicator(r).all_reduce, args=(e, 0, "params"))
               for r, e in enumerate(exchanges)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for exchange in exchanges:
        for dense, (index, values) in zip(exchange.aggregate(), exchange.updates()):
            rebuilt = torch.zeros(dense.numel())
            rebuilt[torch.from_numpy(index)] = torch.from_numpy(values)
            assert torch.equal(rebuilt.view(dense.shape), dense)
    assert len({e.aggregate_digest() for e in exchanges}) == 1


def test_dense_digests_agree_on_the_same_results_and_differ_otherwise():
    tensors = [torch.randn(10), torch.randn(10)]
    exchanges = [DenseMean([t]) for t in tensors]
    spans = exchanges[0].partition(2)
    reductions = [reduce_span(exchanges[i], span, [(str(j), e.encode(span)) for j, e in enumerate(exchanges)])
                  for i, span in enumerate(spans)]
    for j, exchange in enumerate(exchanges):
        for span, reduction in zip(spans, reductions):
            exchange.receive(span, reduction.result_for(exchange, str(j)), reduction.receipt_for(str(j)))
    assert exchanges[0].aggregate_digest() == exchanges[1].aggregate_digest()
    alone = DenseMean([tensors[0]])
    reduce_alone(alone)
    assert alone.aggregate_digest() != exchanges[0].aggregate_digest()


def test_all_finite_is_exact_where_a_sum_overflows():
    assert all_finite(torch.full((4,), 3e38))  # the sum is inf, every element finite
    assert not all_finite(torch.tensor([1.0, float("nan"), 2.0]))
    assert not all_finite(torch.tensor([float("inf"), -float("inf")]))


class Aborting(Communicator):
    """Runs the exchange alone, as a real round would, then reports the round aborted by the vote."""

    def all_reduce(self, exchange: Exchange, round_index: int, name: str) -> AllReduceResult:
        reduce_alone(exchange)
        return AllReduceResult(["me"], committed=False)


def sparseloco(seed: int = 0) -> tuple[SparseLoCo, list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=generator) for s in SHAPES]
    return SparseLoCo(params, SparseLoCoConfig(lr=0.7, error_decay=0.95), torch.device("cpu")), params


def test_an_aborted_round_gives_the_buffer_back_exactly():
    outer, params = sparseloco()
    outer.sync([p + 0.1 for p in params], InProcessGroup(1).communicator(0), 0)  # a committed round first
    before = [e.clone() for e in outer.errors]
    generator = torch.Generator().manual_seed(1)
    local = [p - 0.05 * torch.randn(p.shape, generator=generator) for p in outer.params]
    kept = [p.clone() for p in outer.params]
    assert not outer.sync(local, Aborting(), 1).applied
    assert all(torch.equal(p, k) for p, k in zip(outer.params, kept))
    for error, old, param, trained in zip(outer.errors, before, kept, local):
        # e = beta * e + alpha * delta, and nothing taken out of it
        assert torch.equal(error, old * 0.95 + (param - trained) * 0.7)


def test_error_feedback_checkpoints_in_parameter_shapes_and_resets():
    outer, params = sparseloco()
    outer.sync([p + 0.1 for p in params], InProcessGroup(1).communicator(0), 0)
    state = outer.local_state()
    assert [tuple(state[f"error.{i}"].shape) for i in range(len(SHAPES))] == SHAPES
    restored, _ = sparseloco(seed=5)
    restored.load_local_state(state)
    assert all(torch.equal(a, b) for a, b in zip(restored.errors, outer.errors))
    assert all(torch.equal(a, b) for a, b in zip(restored.feedback, outer.feedback))
    with pytest.raises(ValueError, match="does not fit"):
        restored.load_local_state({**state, "error.0": torch.zeros(3)})
    restored.reset_local_state()
    assert all(not bool(e.any()) for e in restored.errors)


def test_a_non_finite_pseudo_gradient_is_refused():
    outer, params = sparseloco()
    local = [p.clone() for p in params]
    local[2][7] = float("nan")
    with pytest.raises(TrainingError, match="training diverged"):
        outer.sync(local, InProcessGroup(1).communicator(0), 0)
    outer.params[1][0, 0] = float("inf")
    with pytest.raises(TrainingError, match="global parameters hold NaN or Inf"):
        outer.sync(params, InProcessGroup(1).communicator(0), 0)


def receive_round(exchanges: list[Exchange], parts: int) -> None:
    """One butterfly among the first ``parts`` exchanges, every result delivered to every one of them."""
    members = exchanges[:parts]
    for reducer, span in zip(members, members[0].partition(parts)):
        reduction = reduce_span(reducer, span, [(str(i), e.encode(span)) for i, e in enumerate(members)])
        for i, exchange in enumerate(members):
            exchange.receive(span, reduction.result_for(reducer, str(i)), reduction.receipt_for(str(i)))


@pytest.mark.parametrize("kind", ["sparse", "dense"])
def test_a_redo_among_fewer_peers_replaces_the_first_attempts_spans(layout, kind):
    """A redo cuts the units anew: after it, digest and aggregate are those of the redo alone, whatever spans
    of the first attempt a peer got."""
    def exchanges():
        if kind == "sparse":
            return [SparseExchange(layout, replica(layout, seed), "mean") for seed in range(4)]
        return [DenseMean([torch.randn(300, generator=torch.Generator().manual_seed(seed))]) for seed in range(4)]

    redone, fresh = exchanges(), exchanges()
    receive_round(redone, 4)  # the first attempt (its outcome is thrown away)
    receive_round(redone, 3)
    receive_round(fresh, 3)
    for a, b in zip(redone[:3], fresh[:3]):
        assert a.aggregate_digest() == b.aggregate_digest()
        if kind == "sparse":
            assert all(np.array_equal(x[0], y[0]) and np.array_equal(x[1], y[1])
                       for x, y in zip(a.updates(), b.updates()))
