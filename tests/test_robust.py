"""What one contribution, or a minority, can do to a span's aggregate (``collective/robust.py``): written-out
reference arithmetic, identical bits on every path, contributions that point against the others left out, clipping
for the tokens trained, and a reducer's result checked against what it combined."""

import logging
import math
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from p2ploco.collective import robust
from p2ploco.collective.dense import DenseMean, tensor_to_bytes
from p2ploco.collective.exchange import Receipt, reduce_span
from p2ploco.collective.robust import Policy
from p2ploco.collective.sparse import SparseExchange
from p2ploco.compression import sparse_format as fmt
from p2ploco.compression.chunking import chunk_grid
from p2ploco.compression.sparse_format import SparseLayout
from p2ploco.compression.topk import CompressedTensor, compress
from p2ploco.config import DiLoCoConfig
from p2ploco.errors import PayloadError
from p2ploco.outer.diloco import DiLoCo
from p2ploco.sync.clip_streaks import ClipStreaks
from p2ploco.testing.communicator import InProcessGroup

CLIP = Policy(clip_factor=2.0)
DEFENDED = Policy(clip_factor=2.0, drop_opposed=True)


def dense(values) -> bytes:
    return tensor_to_bytes(torch.tensor(values, dtype=torch.float32))


def test_the_largest_contribution_is_scaled_to_twice_the_median_norm():
    exchange = DenseMean([torch.tensor([3.0, 4.0])], policy=CLIP)  # a's
    span = range(2)
    contributions = [("a", dense([3.0, 4.0])), ("b", dense([6.0, 8.0])), ("c", dense([3e6, 4e6]))]
    reduction = reduce_span(exchange, span, contributions)
    assert reduction.included == ["a", "b", "c"] and reduction.clipped == ["c"] and not reduction.rejected
    exchange.receive(span, reduction.result_for(exchange, "a"), reduction.receipt_for("a"))
    # Written out: norms 5, 10, 5e6; lower median 10; bound 2 * 10 = 20; c scaled by float32(20 / 5e6).
    scale = np.float32(20.0 / 5e6)
    c = np.array([3e6, 4e6], dtype=np.float32) * scale
    total = np.array([3.0, 4.0], dtype=np.float32) + np.array([6.0, 8.0], dtype=np.float32) + c
    expected = total / np.float32(3)
    assert np.array_equal(exchange.mean()[0].numpy(), expected)
    assert math.isclose(float(np.linalg.norm(c)), 20.0, rel_tol=1e-6)


def test_in_a_group_of_two_the_larger_contribution_is_bounded_by_the_smaller():
    exchange = DenseMean([torch.tensor([0.3, 0.4])], policy=Policy(clip_factor=1.5, drop_opposed=True))  # h's
    honest, hostile = dense([0.3, 0.4]), dense([-3e5, 4e5])
    for order in (("h", honest), ("x", hostile)), (("x", hostile), ("h", honest)):
        reduction = reduce_span(exchange, range(2), list(order))
        assert reduction.clipped == ["x"] and reduction.opposed == []  # two cannot tell which one is wrong
        exchange.receive(range(2), reduction.result_for(exchange, "h"), reduction.receipt_for("h"))
        hostile_part = np.array([-3e5, 4e5], dtype=np.float32) * np.float32(1.5 * 0.5 / 5e5)
        parts = [np.array([0.3, 0.4], dtype=np.float32), hostile_part]
        if order[0][0] == "x":
            parts.reverse()
        assert np.array_equal(exchange.mean()[0].numpy(), (parts[0] + parts[1]) / np.float32(2))


def test_contributions_within_the_bound_keep_every_bit():
    generator = torch.Generator().manual_seed(0)
    common = torch.randn(1000, generator=generator)
    inputs = [common + 0.5 * torch.randn(1000, generator=generator) for _ in range(4)]
    span = range(1000)
    results = []
    for policy in (robust.UNBOUNDED, CLIP, DEFENDED):
        exchange = DenseMean([torch.zeros(1000)], policy=policy)
        reduction = reduce_span(exchange, span, [(f"p{i}", tensor_to_bytes(t)) for i, t in enumerate(inputs)])
        assert reduction.clipped == [] and reduction.opposed == []
        results.append(reduction.aggregate)
    assert results[0] == results[1] == results[2]


def test_norms_weights_and_the_zero_median():
    assert robust.norm(np.array([3.0, 4.0], dtype=np.float32)) == 5.0
    # lower median of 1, 3, 5, 100 is 3: bound 6
    assert robust.mean_factors([5.0, 1.0, 3.0, 100.0], [1] * 4, 2.0) == ([1.0, 1.0, 1.0, float(np.float32(0.06))], [3])
    assert robust.mean_factors([5.0, 100.0], [1, 1], 0.0) == ([1.0, 1.0], [])  # clipping off
    assert robust.mean_factors([0.0, 0.0, 7.0], [1] * 3, 2.0) == ([1.0] * 3, [])  # a zero median erases nothing
    with pytest.raises(PayloadError, match="absurdly large"):
        robust.norm(np.array([3e38, 3e38], dtype=np.float32) * np.float32(1))
    with pytest.raises(PayloadError, match="absurdly large"):
        robust.norm(np.full(4, 2.0**63, dtype=np.float32))


def test_the_bound_grows_with_the_tokens_trained_so_neither_a_fast_nor_a_slow_peer_is_clipped():
    # 10, 3 and 1 steps: norms that grow slower than the steps (noise adds up as a square root)
    norms, tokens = [5.0, 2.16, 1.0], [10, 3, 1]
    factors, clipped = robust.mean_factors(norms, tokens, 2.0)
    assert clipped == []
    total = sum(tokens)
    assert factors == [float(np.float32(3 * t / total)) for t in tokens]  # weighed by tokens, nothing clipped
    # Against the norm alone (the bound it replaced: 2 x the lower median, 2.16) the fast one was clipped.
    assert 5.0 > 2 * sorted(norms)[1]
    # Two fast peers, a 3x and a 10x slower one, norms growing as the square root of the steps: nobody is clipped,
    # where a bound linear in the tokens (norm per token) would clip the slowest (1.0 against 2 x 3.16 / 10).
    norms, tokens = [math.sqrt(10), math.sqrt(10), math.sqrt(3), 1.0], [10, 10, 3, 1]
    assert robust.mean_factors(norms, tokens, 2.0)[1] == []
    assert 1.0 > 2 * sorted(c * 10 / t for c, t in zip(norms, tokens))[1] / 10
    # A peer that claims a full round's tokens for a sign-flipped, scaled-up update is held to a full round's norm.
    factors, clipped = robust.mean_factors([5.0, 5.0, 5.0, 400.0], [10, 10, 10, 10], 2.0)
    assert clipped == [3] and math.isclose(factors[3] * 400.0, 10.0, rel_tol=1e-6)


def test_an_absurd_contribution_drops_its_sender():
    exchange = DenseMean([torch.zeros(3)], policy=CLIP)
    reduction = reduce_span(exchange, range(3), [("a", dense([1.0, 2.0, 3.0])), ("b", dense([3e38, -3e38, 3e38])),
                                                 ("c", dense([2.0, 2.0, 2.0]))])
    assert reduction.included == ["a", "c"] and "absurdly large" in reduction.rejected["b"]


def honest_and_flipped(count: int, flipped: int, size: int = 4000, seed: int = 0) -> list[torch.Tensor]:
    """``count`` pseudo-gradients sharing a direction (cosine ~0.2 with each other), the last ``flipped`` of them
    negated and scaled to 1.9 times their length: inside the clip bound."""
    generator = torch.Generator().manual_seed(seed)
    common = torch.randn(size, generator=generator)
    out = [common + 2 * torch.randn(size, generator=generator) for _ in range(count)]
    return out[: count - flipped] + [-1.9 * t for t in out[count - flipped :]]


@pytest.mark.parametrize("flipped", [1, 2, 3])
def test_a_minority_of_sign_flipped_contributions_is_left_out(flipped):
    inputs = honest_and_flipped(8, flipped)
    names = [f"p{i}" for i in range(8)]
    exchange = DenseMean([inputs[0]], policy=DEFENDED)  # p0's
    reduction = reduce_span(exchange, range(4000), [(n, tensor_to_bytes(t)) for n, t in zip(names, inputs)])
    assert reduction.opposed == reduction.struck == names[8 - flipped :]
    assert reduction.included == names[: 8 - flipped]
    honest_mean = torch.stack(inputs[: 8 - flipped]).sum(0) / (8 - flipped)
    exchange.receive(range(4000), reduction.result_for(exchange, "p0"), reduction.receipt_for("p0"))
    assert torch.equal(exchange.mean()[0], honest_mean)  # the honest ones alone, to the bit
    undefended = DenseMean([torch.zeros(4000)], policy=CLIP)
    attacked = reduce_span(undefended, range(4000), [(n, tensor_to_bytes(t)) for n, t in zip(names, inputs)])
    assert attacked.opposed == [] and len(attacked.included) == 8


def test_a_majority_is_never_left_out():
    def left_out(inputs: list[torch.Tensor]) -> list[int]:
        return robust.direction([robust.Vector(t.numpy()) for t in inputs],
                                [robust.norm(t.numpy()) for t in inputs]).opposed

    # four of seven point one way, three the other: the three are left out, never the four
    assert left_out(honest_and_flipped(7, 3)) == [4, 5, 6]
    # four flipped of seven are the majority: they decide, and the three others are left out (at most (n - 1) // 2)
    assert left_out(honest_and_flipped(7, 4)) == [0, 1, 2]
    assert left_out(honest_and_flipped(2, 1)) == []  # two cannot tell which one is wrong


def test_an_honest_contribution_of_another_kind_left_out_barely_negative_earns_no_strike_and_its_flip_does():
    """A full replica beside two pipelines agrees with them less than they with each other (their updates
    share a subspace), and is left out now and then with an agreement near zero (the soak: an honest replica was
    struck in 3 of 10 rounds and banned, and lost 22 rounds). Left out, not struck; sign-flipped, struck."""
    generator = torch.Generator().manual_seed(11)
    common = torch.randn(4000, generator=generator)
    groups = [common + torch.randn(4000, generator=generator) for _ in range(2)]  # pairwise cosine ~0.5
    units = [g / g.norm() for g in groups]
    noise = torch.randn(4000, generator=generator)
    for unit in units:  # orthogonal to both groups (Gram-Schmidt over their span), then a hair against them
        noise -= (noise @ unit) * unit
    basis = units[1] - (units[1] @ units[0]) * units[0]
    noise -= (noise @ basis) / (basis @ basis) * basis
    replica = noise - 0.01 * noise.norm() * (units[0] + units[1])
    for contribution, struck in ((replica, []), (-groups[0], [2])):
        inputs = [*groups, contribution]
        vectors, norms = [robust.Vector(t.numpy()) for t in inputs], [robust.norm(t.numpy()) for t in inputs]
        assert robust.agreements(vectors, norms)[2] < 0
        assert robust.direction(vectors, norms) == robust.Direction(opposed=[2], struck=struck)


@pytest.mark.parametrize("colluders", [2, 3])
def test_hostile_keys_sending_one_vector_between_them_are_left_out_and_no_honest_one(colluders):
    """k keys agree perfectly with each other when they send one vector: a sum of cosines counted that k - 1 times
    against the honest contributions' weak agreement (a pairwise cosine of ~0.06, as SparseLoCo's), kept the hostile
    ones and left honest ones out. A median counts each key once."""
    generator = torch.Generator().manual_seed(5)
    common = torch.randn(20000, generator=generator)
    honest = [common + 4 * torch.randn(20000, generator=generator) for _ in range(8 - colluders)]
    for hostile in (-1.9 * honest[0], -common):  # copies of one flipped update; copies of the consensus, flipped
        inputs = honest + [hostile.clone() for _ in range(colluders)]
        norms = [robust.norm(t.numpy()) for t in inputs]
        assert robust.direction([robust.Vector(t.numpy()) for t in inputs], norms).opposed == list(
            range(8 - colluders, 8))


def test_agreement_is_the_same_for_a_sparse_vector_as_for_its_dense_copy():
    generator = torch.Generator().manual_seed(3)
    dense_vectors, sparse_vectors = [], []
    for _ in range(5):
        values = torch.randn(300, generator=generator).numpy()
        keep = np.sort(torch.randperm(300, generator=generator)[:40].numpy()).astype(np.int64)
        copy = np.zeros(300, dtype=np.float32)
        copy[keep] = values[keep]
        dense_vectors.append(robust.Vector(copy))
        sparse_vectors.append(robust.Vector(values[keep].astype(np.float32), keep))
    norms = [robust.norm(v.values) for v in sparse_vectors]
    assert np.allclose(robust.agreements(dense_vectors, norms), robust.agreements(sparse_vectors, norms),
                       rtol=1e-12, atol=1e-15)


@pytest.fixture(scope="module")
def layout():
    return SparseLayout([chunk_grid(s, 64, 64) for s in [(128, 192), (192,), (96, 100)]])


def replica(layout, seed, scale=1.0, common_seed=None):
    """One replica's compressed tensors; with ``common_seed``, the tensors share a direction with other replicas
    of the same ``common_seed`` (as honest pseudo-gradients do)."""
    generator = torch.Generator().manual_seed(seed)
    shared = torch.Generator().manual_seed(common_seed) if common_seed is not None else None
    out = []
    for g in layout.grids:
        values = torch.randn(g.shape, generator=generator) * scale
        if shared is not None:
            values = values + 2 * scale * torch.randn(g.shape, generator=shared)
        out.append(compress(values, g)[0])
    return out


def scaled(compressed, factor):
    """The same selection with every decoded value multiplied by ``factor`` (a poisoned, well-formed update)."""
    return [CompressedTensor(c.grid, c.indices, c.codes, np.float32(c.shift * factor), c.table * np.float32(factor))
            for c in compressed]


def test_sparse_clipping_equals_the_written_out_reference_on_every_result_path(layout):
    replicas = [replica(layout, 0), replica(layout, 1), scaled(replica(layout, 2), 1e6)]
    exchanges = [SparseExchange(layout, c, "mean", CLIP) for c in replicas]
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
        receipt = reduction.receipt_for("abc"[rank])
        exchange.receive(whole, relay, receipt)  # the recipient clips the relayed contributions itself
        assert np.array_equal(exchange.output, expected)
        union_receiver = SparseExchange(layout, replicas[rank], "mean", CLIP)
        union_receiver.receive(whole, reduction.aggregate.union, receipt)
        assert np.array_equal(union_receiver.output, expected)
    hostile = np.zeros(layout.total_numel, dtype=np.float32)
    hostile[decoded[2].positions] = decoded[2].values
    assert np.abs(expected).max() < 1e3 < np.abs(hostile).max() / 1e3  # the 1e6 scale did not get through


def test_a_sign_flipped_sparse_contribution_is_left_out_alike_by_the_reducer_and_every_recipient(layout):
    replicas = [replica(layout, seed, common_seed=99) for seed in range(4)] + [
        scaled(replica(layout, 4, common_seed=99), -1.9)]
    names = [f"p{i}" for i in range(5)]
    whole = range(layout.num_chunks)
    exchanges = [SparseExchange(layout, c, "mean", DEFENDED) for c in replicas]
    payloads = [e.encode(whole) for e in exchanges]
    reduction = reduce_span(exchanges[0], whole, list(zip(names, payloads)))
    assert reduction.opposed == ["p4"] and reduction.included == names[:4]
    outputs = []
    for rank in range(4):  # the honest recipients of a relay recombine the included four themselves
        relay = fmt.encode_relay(layout, [p for i, p in enumerate(payloads[:4]) if i != rank])
        exchanges[rank].receive(whole, relay, reduction.receipt_for(names[rank]))
        outputs.append(exchanges[rank].output)
        assert exchanges[rank].aggregate_digest() == exchanges[0].aggregate_digest()
    assert all(np.array_equal(o, outputs[0]) for o in outputs)


def test_honest_sparse_rounds_are_untouched_by_clipping_and_the_direction_rule(layout):
    replicas = [replica(layout, seed, common_seed=7) for seed in range(4)]
    outputs = []
    for policy in (robust.UNBOUNDED, CLIP, DEFENDED):
        exchanges = [SparseExchange(layout, c, "mean", policy) for c in replicas]
        group = InProcessGroup(4)
        communicators = [group.communicator(rank) for rank in range(4)]
        with ThreadPoolExecutor(4) as pool:
            stats = list(pool.map(lambda c, e: c.all_reduce(e, 0, "params"), communicators, exchanges))
        assert all(s.clipped == [] and s.opposed == [] for s in stats)
        outputs.append(exchanges[0].output.copy())
    assert np.array_equal(outputs[0], outputs[1]) and np.array_equal(outputs[0], outputs[2])


def reduced_dense(inputs: list[torch.Tensor], policy: Policy = DEFENDED):
    names = [f"p{i}" for i in range(len(inputs))]
    exchanges = [DenseMean([t], policy=policy) for t in inputs]
    span = range(inputs[0].numel())
    reduction = reduce_span(exchanges[0], span, [(n, e.encode(span)) for n, e in zip(names, exchanges)])
    return exchanges, span, reduction


def test_a_reducers_result_scaled_beyond_what_it_combined_is_refused():
    exchanges, span, reduction = reduced_dense(honest_and_flipped(4, 0, size=500))
    honest = reduction.result_for(exchanges[0], "p1")
    exchanges[1].receive(span, honest, reduction.receipt_for("p1"))  # the honest result passes
    mean = np.frombuffer(honest, dtype=np.float32)
    for factor in (1e4, 2.0):  # the attack, and one just past the bound
        with pytest.raises(PayloadError, match="where the contributions it names allow at most"):
            exchanges[2].receive(span, (mean * np.float32(factor)).tobytes(), reduction.receipt_for("p2"))


def test_a_reducer_that_lies_about_a_members_norm_or_flips_the_result_is_refused():
    exchanges, span, reduction = reduced_dense(honest_and_flipped(4, 0, size=500))
    honest = reduction.result_for(exchanges[0], "p1")
    receipt = reduction.receipt_for("p1")
    inflated = Receipt(tuple(n * 4 for n in receipt.norms), receipt.tokens, receipt.own)  # room for a 4x result
    with pytest.raises(PayloadError, match="names norm"):
        exchanges[1].receive(span, (np.frombuffer(honest, dtype=np.float32) * np.float32(3)).tobytes(), inflated)
    flipped = (-np.frombuffer(honest, dtype=np.float32)).tobytes()
    with pytest.raises(PayloadError, match="points against this peer's own contribution"):
        exchanges[1].receive(span, flipped, receipt)


def test_a_digest_covers_the_receipt_so_members_told_different_norms_disagree():
    exchanges, span, reduction = reduced_dense(honest_and_flipped(3, 0, size=100))
    result = reduction.result_for(exchanges[0], "p1")
    exchanges[1].receive(span, result, reduction.receipt_for("p1"))
    receipt = reduction.receipt_for("p2")
    told_otherwise = Receipt((receipt.norms[0] * 2, *receipt.norms[1:]), receipt.tokens, receipt.own)
    exchanges[2].receive(span, result, told_otherwise)  # same bytes, another receipt: it checks out for p2 alone
    assert exchanges[1].aggregate_digest() != exchanges[2].aggregate_digest()


def test_a_non_finite_global_update_is_refused_and_nothing_changes():
    """A step that would overflow float32 (here through an outer lr of 1e21) is refused by every replica alike:
    params and momentum stay as they were, and nobody exits."""
    initial = [torch.zeros(4)]
    algorithm = DiLoCo(initial, DiLoCoConfig(lr=1e21, momentum=0.9), policy=CLIP)
    assert not algorithm.sync([initial[0] - 1e18], InProcessGroup(1).communicator(0), 0).applied
    assert torch.equal(algorithm.params[0], initial[0]) and torch.equal(algorithm.momentum[0], torch.zeros(4))
    sane = DiLoCo(initial, DiLoCoConfig(lr=0.7, momentum=0.9), policy=CLIP)
    assert sane.sync([initial[0] - 1e18], InProcessGroup(1).communicator(0), 0).applied


def test_a_contribution_weighs_at_most_a_full_round_of_tokens():
    algorithm = DiLoCo([torch.zeros(4)], DiLoCoConfig(), max_tokens=1000)
    assert algorithm.tokens_behind(300) == 300
    algorithm.unapplied_tokens = 900  # a round not applied: its tokens are owed to the next contribution
    assert algorithm.tokens_behind(300) == 1000 and algorithm.unapplied_tokens == 0


def test_a_peer_clipped_for_a_few_rounds_is_no_news_and_one_clipped_round_after_round_is_named_once(caplog):
    streaks = ClipStreaks(rounds=4)
    with caplog.at_level(logging.WARNING, logger="p2ploco.sync.clip_streaks"):
        for round_index in (0, 1, 2, 4, 5, 6):  # a newcomer's catching up: 3 rounds, a gap, 3 more
            for _ in range(3):  # several spans of one round count once
                streaks.clipped("peer-a", round_index)
        assert caplog.records == []
        for round_index in range(7, 12):
            streaks.clipped("peer-a", round_index)
            streaks.clipped("peer-b", round_index)
    named = [record.getMessage() for record in caplog.records]
    assert named == [f"peer {peer}'s contribution was clipped to the span's bound (outer.clip_factor x the median "
                     f"norm) in each of the last 4 rounds: it moves the model more than the others every round (a "
                     f"far higher learning rate, or an attack); the clipping bounds it"
                     for peer in ("peer-a", "peer-b")]


@pytest.mark.parametrize("overlap", ["some", "none", "all", "one empty"])
def test_sparse_distance_and_cosine_are_those_of_the_dense_vectors(overlap):
    """distance2 and cosine of sparse vectors (sorted unique positions, some shared) equal those of the same vectors
    written out dense, whatever the positions share."""
    rng = np.random.default_rng(3)
    at_a = np.unique(rng.integers(0, 5000, 800))
    at_b = {"some": np.unique(np.concatenate([at_a[::3], rng.integers(0, 5000, 600)])),
            "none": np.setdiff1d(np.arange(5000), at_a)[:700],
            "all": at_a.copy(),
            "one empty": np.zeros(0, dtype=np.int64)}[overlap]
    a = robust.Vector(rng.standard_normal(len(at_a)).astype(np.float32), at_a)
    b = robust.Vector(rng.standard_normal(len(at_b)).astype(np.float32), at_b)
    dense_a, dense_b = np.zeros(5000), np.zeros(5000)
    dense_a[at_a], dense_b[at_b] = a.values, b.values
    assert robust.distance2(a, b) == pytest.approx(float((dense_a - dense_b) @ (dense_a - dense_b)), rel=1e-12)
    lengths = np.linalg.norm(dense_a) * np.linalg.norm(dense_b)
    assert robust.cosine(a, b) == pytest.approx(float(dense_a @ dense_b) / lengths if lengths else 0.0, abs=1e-12)


def test_the_gram_of_sparse_contributions_that_share_positions_is_their_dense_gram():
    """Eight contributions that select the same 20 positions (runs of 8 in the sorted whole) and some of their own:
    their pairs are counted in several batches (one n x n count per n * n pairs), and every product is in it once."""
    rng = np.random.default_rng(3)
    shared = np.sort(rng.choice(1000, 20, replace=False))
    vectors, dense = [], np.zeros((8, 1000))
    for i in range(8):
        positions = np.union1d(shared, rng.choice(1000, 30, replace=False)).astype(np.int64)
        values = rng.standard_normal(len(positions)).astype(np.float32)
        vectors.append(robust.Vector(values, positions))
        dense[i, positions] = values.astype(np.float64) * (i + 1)
    assert np.allclose(robust.gram(vectors, [float(i + 1) for i in range(8)]), dense @ dense.T, rtol=1e-12, atol=0)
