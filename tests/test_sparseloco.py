"""SparseLoCo: chunking, Top-k, 2-bit values, error feedback, and the aggregate against the paper's algorithm."""

import copy
import dataclasses
import math

import numpy as np
import pytest
import torch
from helpers import run_outer_replicas

from p2ploco.collective.exchange import reduce_span
from p2ploco.collective.sparse import MIN_FITTED_K, ResultLayouts, SparseExchange
from p2ploco.compression import sparse_format as fmt
from p2ploco.compression.chunking import chunk_grid
from p2ploco.compression.quantize import quantize
from p2ploco.compression.sparse_format import SparseLayout
from p2ploco.compression.topk import compress
from p2ploco.config import OuterConfig, SparseLoCoConfig
from p2ploco.outer.sparseloco import SparseLoCo, SparseSync
from p2ploco.swarm.messages import MAX_PEERS

SHAPES = [(128, 192), (257, 64), (192,), (96, 100)]


@pytest.mark.parametrize("shape, tile, k, chunks", [
    ((128, 128), (64, 64), 64, 4),
    ((257, 128), (1, 64), 1, 514),  # a prime dimension: 1-row tiles, k scaled to the tile
    ((384, 96), (64, 48), 48, 12),
    ((128,), (1, 64), 64, 2),  # vectors: runs, kept dense
    ((100,), (1, 50), 50, 2),
    ((4, 8, 16), (4, 64), 4, 2),  # more dims: rows x the rest
])
def test_chunk_geometry(shape, tile, k, chunks):
    grid = chunk_grid(shape, 64, 64)
    assert (grid.tile_rows, grid.tile_cols, grid.k, grid.chunks) == (*tile, k, chunks)
    tensor = torch.randn(shape)
    chunked = grid.to_chunks(tensor)
    assert chunked.shape == (chunks, tile[0] * tile[1])
    assert torch.equal(grid.from_chunks(chunked), tensor)


def test_chunks_are_tiles_in_row_major_tile_order():
    grid = chunk_grid((128, 128), 64, 64)
    tensor = torch.arange(128 * 128.0).view(128, 128)
    assert torch.equal(grid.to_chunks(tensor)[1], tensor[0:64, 64:128].reshape(-1))
    assert torch.equal(grid.to_chunks(tensor)[2], tensor[64:128, 0:64].reshape(-1))


def reference_quantize(values: torch.Tensor):
    """The reference statistics, written out."""
    shift = values.mean()
    centered = values - shift
    sigma = float(centered.norm()) / math.sqrt(values.numel() - 1)
    scale = 6.0 * sigma / 4
    scale = 1.0 if scale == 0 or not math.isfinite(scale) else scale
    codes = torch.clamp(torch.round(centered / scale + 2), 0, 3)
    table = torch.stack([centered[codes == b].mean() if (codes == b).any() else torch.tensor(0.0) for b in range(4)])
    return codes, shift, table


def test_quantizer_follows_the_reference_statistics():
    values = torch.randn(5000) * 3 + 0.5
    q = quantize(values)
    codes, shift, table = reference_quantize(values)
    assert torch.equal(q.codes.long(), codes.long())
    assert torch.equal(q.shift, shift)
    assert torch.equal(q.table, table)
    assert set(q.codes.unique().tolist()) == {0, 1, 2, 3}
    constant = quantize(torch.full((10,), 2.5))
    assert torch.equal(constant.decode(), torch.full((10,), 2.5))  # scale falls back to 1.0


def test_topk_keeps_the_largest_magnitudes_of_every_chunk():
    tensor = torch.randn(128, 192)
    grid = chunk_grid(tensor.shape, 64, 64)
    sent, decoded = compress(tensor, grid)
    chunked = grid.to_chunks(tensor)
    for c in range(grid.chunks):
        expected = set(torch.topk(chunked[c].abs(), 64).indices.tolist())
        assert set(sent.indices[c].tolist()) == expected
        assert list(sent.indices[c]) == sorted(sent.indices[c])
    decoded_chunks = grid.to_chunks(decoded)
    assert int((decoded_chunks != 0).sum()) <= grid.chunks * 64
    table, shift = torch.from_numpy(sent.table), torch.tensor(sent.shift)
    for c in (0, 5):
        idx = torch.from_numpy(sent.indices[c])
        assert torch.equal(decoded_chunks[c][idx], table[torch.from_numpy(sent.codes[c]).long()] + shift)
    again, _ = compress(tensor, grid)
    assert np.array_equal(again.indices, sent.indices) and np.array_equal(again.codes, sent.codes)


def run_sparseloco(replicas: int, rounds: int, config: SparseLoCoConfig, seed: int = 0):
    outer = OuterConfig(algorithm="sparseloco", sparseloco=config)
    return run_outer_replicas(outer, SHAPES, replicas, rounds, 0.05, seed)


def reference_sparseloco(initial, locals_per_round, config: SparseLoCoConfig):
    """The paper's algorithm on dense tensors: explicit tiles, Top-k, reference 2-bit values, error
    feedback, and the aggregate as a per-coordinate mean over the replicas that selected it."""
    params = [p.clone() for p in initial]
    replicas = len(locals_per_round[0])
    errors = [[torch.zeros_like(p) for p in initial] for _ in range(replicas)]
    for local_params in locals_per_round:
        deltas = [[p - local_params[r][i] for i, p in enumerate(params)] for r in range(replicas)]
        aggregate = reference_sparse_aggregate(deltas, errors, config)
        params = [p - a * config.lr for p, a in zip(params, aggregate)]
    return params, errors


def sent_grid(shape, config: SparseLoCoConfig, replicas: int):
    """How a replica of a group of ``replicas`` chunks a tensor and how many values it sends per chunk: topk, or with
    resparsified results where the replicas' values may not fit a result's chunk, the result's k // replicas (at
    least MIN_FITTED_K)."""
    grid = chunk_grid(shape, config.chunk_size, config.topk)
    cap = chunk_grid(shape, config.chunk_size, config.result_topk).k
    if config.result == "exact" or min(replicas * grid.k, grid.chunk_numel) <= cap:
        return grid
    return dataclasses.replace(grid, k=min(grid.k, max(MIN_FITTED_K, cap // replicas)))


def reference_sparse_aggregate(deltas, errors, config: SparseLoCoConfig):
    """One round from every replica's pseudo-gradients ``deltas[r][i]``: each replica's error feedback
    ``errors[r]`` (updated in place), its Top-k tiles with 2-bit values, and the aggregate of each tensor."""
    replicas = len(deltas)
    decoded_all = []
    for r in range(replicas):
        decoded_r = []
        for i, delta in enumerate(deltas[r]):
            errors[r][i] = errors[r][i] * config.error_decay + delta * config.lr
            grid = sent_grid(tuple(delta.shape), config, replicas)
            matrix = errors[r][i].reshape(grid.rows, grid.cols)
            tiles = [(a, b) for a in range(0, grid.rows, grid.tile_rows)
                     for b in range(0, grid.cols, grid.tile_cols)]
            blocks = [matrix[a:a + grid.tile_rows, b:b + grid.tile_cols].reshape(-1) for a, b in tiles]
            chosen = [torch.topk(block.abs(), grid.k).indices.sort().values for block in blocks]
            codes, shift, table = reference_quantize(torch.stack([blk[ix] for blk, ix in zip(blocks, chosen)]))
            decoded = torch.zeros(grid.rows, grid.cols)
            for (a, b), ix, code_row in zip(tiles, chosen, codes):
                tile = torch.zeros(grid.tile_rows * grid.tile_cols)
                tile[ix] = table[code_row.long()] + shift
                decoded[a:a + grid.tile_rows, b:b + grid.tile_cols] = tile.view(grid.tile_rows, grid.tile_cols)
            decoded = decoded.reshape(delta.shape)
            errors[r][i] = errors[r][i] - decoded
            decoded_r.append(decoded)
        decoded_all.append(decoded_r)
    aggregates = []
    for i, delta in enumerate(deltas[0]):
        total = torch.zeros_like(delta)
        count = torch.zeros_like(delta)
        for r in range(replicas):
            total = total + decoded_all[r][i]
            count = count + (decoded_all[r][i] != 0).float()
        divisor = count if config.aggregate == "mean" else torch.full_like(delta, float(replicas))
        aggregates.append(torch.where(count > 0, total / divisor.clamp(min=1), torch.zeros_like(delta)))
    return aggregates


def tiles_of(grid, tensor: torch.Tensor):
    """The chunks of ``tensor`` as views of its tiles, in chunk order, written out."""
    matrix = tensor.view(grid.rows, grid.cols)
    return [matrix[a:a + grid.tile_rows, b:b + grid.tile_cols] for a in range(0, grid.rows, grid.tile_rows)
            for b in range(0, grid.cols, grid.tile_cols)]


def reference_resparsified(aggregates, spans, config: SparseLoCoConfig):
    """What every replica applies with resparsified results: reducer j of the chunks in ``spans[j]`` (chunks of
    every tensor in one numbering) keeps the Top-k of every chunk of the mean in 2 bits (one decode table per tensor
    within the span): k is ``result_topk`` (scaled to the chunk), or every value the replicas can have sent if that
    is fewer; the rest is dropped."""
    out = [torch.zeros_like(a) for a in aggregates]
    first_chunk = 0
    for i, mean in enumerate(aggregates):
        selected = len(spans) * sent_grid(tuple(mean.shape), config, len(spans)).k
        grid = chunk_grid(tuple(mean.shape), config.chunk_size, config.result_topk)
        grid = dataclasses.replace(grid, k=min(grid.k, selected))
        for span in spans:
            chunks = [c for c in range(grid.chunks) if first_chunk + c in span]
            if not chunks:
                continue
            blocks = [tiles_of(grid, mean)[c].clone() for c in chunks]
            chosen = [torch.topk(block.reshape(-1).abs(), grid.k).indices.sort().values for block in blocks]
            codes, shift, table = reference_quantize(torch.stack([b.reshape(-1)[ix] for b, ix in zip(blocks, chosen)]))
            for c, block, ix, code_row in zip(chunks, blocks, chosen, codes):
                sent = torch.zeros(block.numel())
                sent[ix] = table[code_row.long()] + shift
                tiles_of(grid, out[i])[c].copy_(sent.view(block.shape))
        first_chunk += grid.chunks
    return out


def test_a_result_keeps_what_its_contributions_selected_up_to_the_cap():
    """k per chunk is n x the contributions' k while that fits under the cap, then the cap's, whatever count a
    receipt names (a hostile one cannot make a peer build a layout per count)."""
    contributions = SparseLayout([chunk_grid(shape, 64, 64) for shape in SHAPES])
    results = ResultLayouts(contributions, SparseLayout([chunk_grid(shape, 64, 256) for shape in SHAPES]))
    full = contributions.grids[0]  # (128, 192): whole 64 x 64 tiles, 64 each
    assert [results.for_contributions(n).grids[0].k for n in (1, 2, 3, 4, 5)] == [64, 128, 192, 256, 256]
    counts = {id(results.for_contributions(n)) for n in [*range(-1, 50), 10**9]}
    assert len(counts) == results.saturated == 4 and full.k == 64
    assert results.for_contributions(10**9).digest == results.cap.digest  # the cap itself


def test_a_large_group_sends_fewer_values_each_so_that_a_result_holds_them_all():
    """From the group size at which n x topk passes the result's cap, each holder sends cap // n values per chunk,
    so a result of all n keeps every value sent, down to MIN_FITTED_K per chunk (beyond cap / MIN_FITTED_K holders
    the result keeps the cap's k of them); chunks sent whole always fit."""
    contributions = SparseLayout([chunk_grid(shape, 64, 64) for shape in SHAPES])
    results = ResultLayouts(contributions, SparseLayout([chunk_grid(shape, 64, 256) for shape in SHAPES]))
    assert results.shared(1) is results and results.shared(3) is results
    assert [g.k for g in results.shared(4).contributions.grids] == [64, 1, 64, 37]  # 4 x 38 would pass 150
    assert [results.shared(n).contributions.grids[0].k for n in (5, 16, 64, 65, 300)] == [51, 16, 4, 4, 4]
    for n in (5, 16, 64):
        shared = results.shared(n)
        assert all(min(grid.k * n, grid.chunk_numel) <= most.k or grid.k in (1, MIN_FITTED_K)
                   for grid, most in zip(shared.contributions.grids, shared.cap.grids))
        assert shared.for_contributions(n).grids[0].k == n * shared.contributions.grids[0].k
    assert results.shared(100).for_contributions(100).grids[0].k == 256  # 100 x 4 values: the cap's 256 kept
    assert results.shared(16).contributions.grids[2].k == 64  # a vector's chunks: sent whole, they fit any group


@pytest.mark.parametrize("holders, k", [(3, 32), (MAX_PEERS, MIN_FITTED_K)])
def test_a_contribution_fitted_to_its_group_sends_fewer_values_loses_none_and_fits_each_group_again(holders, k):
    """Fitted to 3 holders under a cap of 96, a contribution sends 32 values per chunk; to a group a coordinator padded
    to the most members a group may have, MIN_FITTED_K: either way its buffer plus what it sends is what the
    buffer held before, and the exchange's fingerprint (what joiners compare) stays. Fitted then to a group of 2
    (its first group died, and the next coordinator's has 2 holders), it sends 48, bit for bit what a peer whose
    first group that is sends, and still loses nothing; a round not applied gives every value back."""
    generator = torch.Generator().manual_seed(3)
    params = [torch.randn(s, generator=generator) for s in SHAPES]
    local = [p + 0.05 * torch.randn(p.shape, generator=generator) for p in params]
    before = [(p - q) * SparseLoCoConfig().lr for p, q in zip(params, local)]  # an empty buffer's content

    def fitted(holders: int) -> tuple[SparseLoCo, SparseSync, SparseExchange]:
        outer = SparseLoCo(params, SparseLoCoConfig(result_topk=96), torch.device("cpu"))
        sync = outer.contribute(local, 0)
        part = sync.exchange.parts["stage0"]
        part.fit_group(holders)
        return outer, sync, part

    def assert_nothing_lost(outer: SparseLoCo, part: SparseExchange) -> None:
        span = range(part.num_units)
        sent = fmt.decode_contribution(part.layout, span, part.encode(span))
        dense = torch.zeros(part.layout.total_numel)  # what was sent, in chunk order
        dense[torch.from_numpy(sent.positions)] = torch.from_numpy(sent.values)
        for i, grid in enumerate(outer.grids):
            lo = sum(g.numel for g in outer.grids[:i])
            held = outer.feedback[i] + dense[lo : lo + grid.numel].view(grid.chunks, grid.chunk_numel)
            assert torch.allclose(grid.from_chunks(held), before[i], atol=1e-6)

    outer, sync, part = fitted(holders)
    fingerprint, span = part.fingerprint(), range(part.num_units)
    assert part.layout.grids[0].k == k and sync.taken[0].indices.shape[1] == k
    assert_nothing_lost(outer, part)
    part.fit_group(2)
    assert part.layout.grids[0].k == 48 and sync.taken[0].indices.shape[1] == 48
    assert part.fingerprint() == fingerprint
    assert_nothing_lost(outer, part)
    assert part.encode(span) == fitted(2)[2].encode(span)
    outer.give_back(sync)
    assert all(torch.allclose(e, b, atol=1e-6) for e, b in zip(outer.errors, before))


def test_a_checkpoints_error_feedback_is_each_buffer_as_if_the_round_in_flight_were_not_applied():
    """What a checkpoint saves of the buffers while a round is in flight: each in its parameter's shape, with what
    the round took put back, bit for bit the buffers a round not applied leaves; each made (a copy) when asked for,
    so that writing them holds one buffer's copy at a time."""
    generator = torch.Generator().manual_seed(5)
    params = [torch.randn(s, generator=generator) for s in SHAPES]
    outer = SparseLoCo(params, SparseLoCoConfig(), torch.device("cpu"))
    for round_index in range(2):  # the second round's buffers hold what the first one left
        sync = outer.contribute([p + 0.05 * torch.randn(p.shape, generator=generator) for p in params], round_index)
        sync.exchange.parts["stage0"].fit_group(2)
    saved = outer.local_state_with(sync)
    assert {k: (tuple(d.shape), d.dtype) for k, d in saved.items()} == {
        f"error.{i}": (s, torch.float32) for i, s in enumerate(SHAPES)}
    applied = outer.local_state_with(None)
    assert not all(torch.equal(saved[k].make(), applied[k].make()) for k in saved)  # the round took something
    made = {k: d.make() for k, d in saved.items()}
    copied = copy.deepcopy(saved)  # a deep copy holds the tensors, made as of the copy
    assert all(torch.equal(copied[k], made[k]) for k in made)
    outer.give_back(sync)
    assert all(torch.equal(made[k], e) for k, e in outer.local_state().items())
    made["error.0"].add_(1.0)
    assert torch.equal(outer.local_state()["error.0"], saved["error.0"].make())  # a copy, not the live buffer


@pytest.mark.parametrize("aggregate, result_topk", [("mean", 96), ("sum", 96), ("mean", 256), ("mean", 2)])
def test_resparsified_results_equal_a_written_out_reference(aggregate, result_topk):
    """Each reducer compresses its span's mean again, keeping result_topk values per chunk or all that 3 replicas can
    have sent if fewer: with 256 they send 64 each (192 in all); with 96, 32 each (3 x 64 would not fit); with 2,
    MIN_FITTED_K (4) each, and the result keeps 2 of up to 12. Every replica applies the same bits, and no
    reducer keeps a buffer: a result is a function of the contributions alone."""
    config = SparseLoCoConfig(aggregate=aggregate, result="resparsified", result_topk=result_topk)
    replicas = 3
    initial, locals_per_round, algorithms, _ = run_sparseloco(replicas, 3, config)
    (layout,) = algorithms[0].layouts.values()
    spans = SparseExchange(layout, [], aggregate).partition(replicas)  # how the chunks are cut: geometry
    params = [p.clone() for p in initial]
    errors = [[torch.zeros_like(p) for p in initial] for _ in range(replicas)]
    for local_params in locals_per_round:
        deltas = [[p - local_params[r][i] for i, p in enumerate(params)] for r in range(replicas)]
        means = reference_sparse_aggregate(deltas, errors, config)
        applied = reference_resparsified(means, spans, config)
        params = [p - a * config.lr for p, a in zip(params, applied)]
    for rank, algorithm in enumerate(algorithms):
        assert all(torch.equal(got, want) for got, want in zip(algorithm.params, params))
        assert all(torch.equal(got, want) for got, want in zip(algorithm.errors, errors[rank]))
        assert sorted(algorithm.local_state()) == [f"error.{i}" for i in range(len(initial))]


@pytest.mark.parametrize("aggregate", ["mean", "sum"])
def test_all_reduce_equals_the_papers_algorithm(aggregate):
    config = SparseLoCoConfig(aggregate=aggregate, result="exact")
    initial, locals_per_round, algorithms, stats = run_sparseloco(3, 3, config)
    expected_params, expected_errors = reference_sparseloco(initial, locals_per_round, config)
    for rank, algorithm in enumerate(algorithms):  # exactly, and so every replica holds the same bits
        assert all(torch.equal(got, want) for got, want in zip(algorithm.params, expected_params))
        assert all(torch.equal(got, want) for got, want in zip(algorithm.errors, expected_errors[rank]))


@pytest.mark.parametrize("algorithm", ["sparseloco", "diloco"])
def test_the_update_norm_is_how_far_the_round_moved_the_global_params(algorithm):
    outer = OuterConfig(algorithm=algorithm, sparseloco=SparseLoCoConfig(lr=0.7))
    initial, _, algorithms, _ = run_outer_replicas(outer, SHAPES, 3, 1, 0.05)
    moved = math.sqrt(sum(float((p - q).double().square().sum()) for p, q in zip(algorithms[0].params, initial)))
    assert moved > 0 and algorithms[0].take_update_norm() == pytest.approx(moved, rel=1e-5)
    assert algorithms[0].take_update_norm() == 0.0  # taken: the next round starts from nothing


def test_error_feedback_keeps_exactly_what_was_not_sent():
    generator = torch.Generator().manual_seed(4)
    error = torch.randn(128, 192, generator=generator)
    before = error.clone()
    grid = chunk_grid(tuple(error.shape), 64, 64)
    sent, decoded = compress(error, grid)
    error.sub_(decoded)
    assert torch.equal(error, before - decoded)
    chosen = torch.zeros(grid.chunks, grid.chunk_numel, dtype=torch.bool)
    chosen.scatter_(1, torch.from_numpy(sent.indices), True)
    assert torch.equal(grid.to_chunks(error)[~chosen], grid.to_chunks(before)[~chosen])  # untouched off the Top-k


def test_bytes_and_density_at_one_sixty_fourth():
    _, _, algorithms, stats = run_sparseloco(3, 1, SparseLoCoConfig())
    params = sum(torch.Size(s).numel() for s in SHAPES)
    assert abs(algorithms[0].density - 1 / 64) < 0.01
    for s in stats:
        traffic = s[0].all_reduce.traffic
        bits = 8 * traffic.contribution_bytes / params
        assert 0.05 < bits < 0.25  # Rice-coded indices: ~8 bits each, plus 2 bits of value, per 64 params
        assert 50 * (traffic.bytes_sent + traffic.bytes_received) < traffic.dense_fp32_bytes


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compression_on_cuda_is_deterministic_and_decodes_on_cpu_to_the_same_bits():
    from p2ploco.compression import sparse_format as fmt
    from p2ploco.compression.sparse_format import SparseLayout

    tensor = torch.randn(256, 192, device="cuda")
    grid = chunk_grid(tuple(tensor.shape), 64, 64)
    first, decoded = compress(tensor, grid)
    second, _ = compress(tensor, grid)
    assert np.array_equal(first.indices, second.indices) and np.array_equal(first.codes, second.codes)
    layout = SparseLayout([grid])
    whole = range(layout.num_chunks)
    values = fmt.decode_contribution(layout, whole, fmt.encode_contribution(layout, whole, [first]))
    rebuilt = np.zeros(grid.numel, dtype=np.float32)
    rebuilt[values.positions] = values.values
    assert np.array_equal(rebuilt, grid.to_chunks(decoded).reshape(-1).cpu().numpy())


def test_a_member_whose_contribution_is_left_out_applies_the_same_resparsified_aggregate():
    """Every member takes the same result bytes whether or not its own contribution is in them: a member whose
    contributions every reducer refused ends with the aggregate of the others, bit for bit, as they do."""
    config = SparseLoCoConfig(result="resparsified")
    generator = torch.Generator().manual_seed(7)
    params = [torch.randn(s, generator=generator) for s in SHAPES]
    replicas = [SparseLoCo(params, config, torch.device("cpu")) for _ in range(3)]
    exchanges = [replica.contribute([p + 0.05 * torch.randn(p.shape, generator=generator) for p in params], 0)
                 .exchange.parts["stage0"] for replica in replicas]
    names = ["a", "b", "c"]
    for reducer, span in enumerate(exchanges[0].partition(3)):
        payloads = [e.encode(span) for e in exchanges]
        payloads[2] = payloads[2][:-1]  # c's contribution is truncated: refused
        reduction = reduce_span(exchanges[reducer], span, list(zip(names, payloads)))
        assert reduction.included == ["a", "b"] and "c" in reduction.rejected
        for name, exchange in zip(names, exchanges):
            exchange.receive(span, reduction.result_for(exchanges[reducer], name), reduction.receipt_for(name))
    assert len({e.aggregate_digest() for e in exchanges}) == 1  # one aggregate, c's included
    assert np.array_equal(exchanges[0].output, exchanges[2].output)
    assert np.count_nonzero(exchanges[2].output) > 0


def test_checkpointed_buffers_load_across_result_settings_and_a_reducers_old_buffer_is_dropped():
    """The error buffers round-trip through local state whatever the result setting; a checkpoint written when
    reducers kept a buffer of their own (``reducer_error.*``) loads, that buffer dropped; a misshapen one is refused."""
    params = [torch.zeros(s) for s in SHAPES]
    kept, exact = (SparseLoCo(params, SparseLoCoConfig(result=result), torch.device("cpu"))
                   for result in ("resparsified", "exact"))
    for buffer in kept.feedback:
        buffer.normal_()
    state = kept.local_state()
    exact.load_local_state(state | {f"reducer_error.{i}": torch.ones(s) for i, s in enumerate(SHAPES)})
    assert all(torch.equal(a, b) for a, b in zip(exact.errors, kept.errors))
    assert sorted(exact.local_state()) == sorted(state)
    with pytest.raises(ValueError):
        exact.load_local_state(state | {"error.0": torch.zeros(3)})


@pytest.mark.parametrize("result_topk, fitted, relabelled", [(256, True, True), (32, True, True), (32, False, False)])
def test_a_span_of_one_contribution_is_its_own_result(result_topk, fitted, relabelled):
    """Of two contributions one is malformed, so the reducer combines one: its result is that contribution's bytes
    under the result's kind, and both peers take exactly its values. Only where the cap keeps fewer values than a
    contribution holds (one never fitted to a group, as a lone peer's: 64 against 32) is the result a Top-k again."""
    generator = torch.Generator().manual_seed(5)
    params = [torch.randn(s, generator=generator) for s in SHAPES]
    config = SparseLoCoConfig(result_topk=result_topk)
    a, b = (SparseLoCo(params, config, torch.device("cpu")) for _ in range(2))
    syncs = [outer.contribute([p + 0.05 * torch.randn(p.shape, generator=generator) for p in params], 0)
             for outer in (a, b)]
    parts = [sync.exchange.parts["stage0"] for sync in syncs]
    for part in parts if fitted else []:
        part.fit_group(2)
    span = range(parts[0].num_units)
    own = parts[0].encode(span)
    reduction = reduce_span(parts[0], span, [("a", own), ("b", b"\x00" * 40)])
    assert reduction.included == ["a"] and list(reduction.rejected) == ["b"]
    result = reduction.result_for(parts[0], "b")
    assert (result == fmt.as_resparsified(own)) is relabelled
    for part, name in zip(parts, "ab"):
        part.receive(span, reduction.result_for(part, name), reduction.receipt_for(name))
    assert parts[0].aggregate_digest() == parts[1].aggregate_digest()
    sent = fmt.decode_contribution(parts[0].layout, span, own)
    taken = np.concatenate([index for index, _ in parts[1].updates()])
    if relabelled:
        assert len(taken) == len(sent.positions)
        assert np.array_equal(parts[1].output[sent.positions], sent.values)
    else:
        assert len(taken) < len(sent.positions)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_a_reducer_selects_on_the_training_device_and_answers_the_largest_of_the_mean(device):
    """A reducer's Top-k runs where its replica trains (on CUDA, the GPU's): every chunk of its result holds the
    largest magnitudes of the span's mean (the per-coordinate mean of the two contributions), and both members take
    the same bits."""
    generator = torch.Generator().manual_seed(11)
    params = [torch.randn(s, generator=generator) for s in SHAPES]
    outers = [SparseLoCo(params, SparseLoCoConfig(), torch.device(device)) for _ in range(2)]
    syncs = [outer.contribute([(p + 0.05 * torch.randn(p.shape, generator=generator)).to(device) for p in params], 0)
             for outer in outers]
    parts = [sync.exchange.parts["stage0"] for sync in syncs]
    for part in parts:
        part.fit_group(2)
    assert parts[0].selecting == torch.device(device)
    span = range(parts[0].num_units)  # one reducer, every chunk
    reduction = reduce_span(parts[0], span, [(name, part.encode(span)) for name, part in zip("ab", parts)])
    result = reduction.result_for(parts[0], "b")
    for part, name in zip(parts, "ab"):
        part.receive(span, reduction.result_for(part, name), reduction.receipt_for(name))
    assert parts[0].aggregate_digest() == parts[1].aggregate_digest()
    layout = parts[0].results.for_contributions(2)
    sent = fmt.decode_resparsified(layout, span, result)
    mean = fmt.aggregate(parts[0].numel(span), [fmt.decode_contribution(parts[0].layout, span, part.encode(span))
                                                for part in parts], "mean")
    dense = np.zeros(parts[0].numel(span), dtype=np.float32)
    dense[mean.positions] = mean.values
    checked = 0
    for s in layout.slices(span):
        n, k = s.grid.chunk_numel, s.grid.k
        lo, hi = np.searchsorted(sent.positions, [s.offset, s.offset + s.chunks * n])
        local = torch.from_numpy(sent.positions[lo:hi] - s.offset).view(s.chunks, k) % n
        rows = torch.from_numpy(dense[s.offset : s.offset + s.chunks * n]).view(s.chunks, n)
        if k < n:
            chosen = torch.gather(rows.abs(), 1, local)  # a Top-k: none left out is larger than one kept (ties aside)
            left = rows.abs().scatter(1, local, -1.0)
            assert bool((chosen.amin(dim=1) >= left.amax(dim=1)).all())
            checked += 1
    assert checked == 3  # the three matrices; the vector's chunks are sent whole
