"""LoCo: the group-wise low-bit codec, its wire format, the error-compensation invariant, and whole rounds
over the in-process group against the algorithm written out by hand, bit for bit; then real nodes."""

import math
import re
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers import CPU, TOKENS, run_outer_replicas, sampler, small_config

from p2ploco import checkpoint
from p2ploco.build import build_replica
from p2ploco.collective.exchange import AllReduceResult, Communicator, Exchange, reduce_span
from p2ploco.collective.lowbit import HEADER, LowBitMean
from p2ploco.collective.robust import UNBOUNDED, Policy
from p2ploco.collective.sliced import reduce_alone
from p2ploco.compression.blockwise import BlockLayout, compensate, quantize
from p2ploco.config import LoCoConfig, OuterConfig
from p2ploco.data import ShardSampler
from p2ploco.errors import PayloadError
from p2ploco.metrics import read_summaries
from p2ploco.outer.loco import LoCo
from p2ploco.schedules import RoundHooks
from p2ploco.schedules.blocking import BlockingRounds
from p2ploco.testing.communicator import InProcessGroup
from p2ploco.testing.threads import run_in_threads

SHAPES = [(33, 17), (17,), (5, 4, 3)]  # 561 = 35 x 16 + 1: groups of 16 and shorter tails


# ---- the algorithm written out: per group, in numpy, one float32 rounding per operation ---------------------

def reference_groups(shapes, group_size):
    """(start, stop) of every group in the concatenation: each tensor flattened and cut into runs of group_size."""
    groups, offset = [], 0
    for shape in shapes:
        n = math.prod(shape)
        groups += [(offset + a, offset + min(a + group_size, n)) for a in range(0, n, group_size)]
        offset += n
    return groups


def round_up_to_16_bits(x: np.float32) -> np.float32:
    """The smallest float32 >= x whose significand has 16 bits."""
    mantissa, exponent = math.frexp(float(x))  # x = mantissa * 2^exponent, mantissa in [0.5, 1)
    return np.float32(math.ldexp(math.ceil(mantissa * 2**16) / 2**16, exponent))


def reference_quantize(values: np.ndarray, groups, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes, scales, deQ) of float32 ``values`` cut into ``groups`` (start, stop) relative to ``values``."""
    q = 2 ** (bits - 1) - 1
    codes, scales, decoded = np.zeros(len(values), np.int64), [], np.zeros(len(values), np.float32)
    for a, b in groups:
        group = values[a:b]
        scale = round_up_to_16_bits(np.float32(float(np.abs(group).max()) / q))
        scale = scale if scale >= 2.0**-126 else np.float32(0)  # no subnormal scales: the group is sent as zeros
        if scale > 0:
            codes[a:b] = np.clip(np.rint(group / scale), -q, q)  # the float32 quotient, rounded half to even
        scales.append(scale)
        decoded[a:b] = codes[a:b].astype(np.float32) * scale
    return codes, np.array(scales, np.float32), decoded


def reference_compensate(values, error, beta, groups, bits):
    """One hop of LoCo: the decoded q = Q(g + e), and e' = beta*e + (1 - beta)*(g + e - deQ(q))."""
    compensated = values + error
    decoded = reference_quantize(compensated, groups, bits)[2]
    return decoded, error * np.float32(beta) + (compensated - decoded) * np.float32(1 - beta)


def reference_spans(groups, holders):
    """Span j (a run of groups) of ``holders`` peers: from the group holding element total*j/holders."""
    total = groups[-1][1]
    ends = [b for _, b in groups]
    bounds = [0] + [sum(1 for e in ends if e <= total * j // holders) for j in range(1, holders)] + [len(groups)]
    return [range(bounds[j], bounds[j + 1]) for j in range(holders)]


def reference_loco(initial, locals_per_round, config: LoCoConfig, slices):
    """Every replica's sender buffer and every reducer's buffer, the mean of each span re-quantized by its
    reducer (replica j reduces span j), and Nesterov momentum on the decoded aggregate."""
    replicas = len(locals_per_round[0])
    params = [p.clone() for p in initial]
    bufs = [torch.zeros_like(p) for p in initial]
    sizes = {name: sum(initial[i].numel() for i in positions) for name, positions in slices.items()}
    sender = [{name: np.zeros(n, np.float32) for name, n in sizes.items()} for _ in range(replicas)]
    reducer = [{name: np.zeros(n, np.float32) for name, n in sizes.items()} for _ in range(replicas)]
    for round_index, local_params in enumerate(locals_per_round):
        if round_index % config.reset_every == 0:
            for buffers in sender + reducer:
                for buffer in buffers.values():
                    buffer[:] = 0
        aggregate = [None] * len(params)
        for name, positions in slices.items():
            groups = reference_groups([initial[i].shape for i in positions], config.group_size)
            sent = []
            for r in range(replicas):
                g = torch.cat([(params[i] - local_params[r][i]).reshape(-1) for i in positions]).numpy()
                decoded, sender[r][name] = reference_compensate(g, sender[r][name], config.beta, groups, config.bits)
                sent.append(decoded)
            mean_of_slice = np.zeros(sizes[name], np.float32)
            for j, span in enumerate(reference_spans(groups, replicas)):
                if not len(span):
                    continue
                a, b = groups[span.start][0], groups[span.stop - 1][1]
                total = sent[0][a:b].copy()
                for r in range(1, replicas):
                    total = total + sent[r][a:b]
                mean = total / np.float32(replicas)
                local_groups = [(s - a, e - a) for s, e in groups[span.start : span.stop]]
                mean_of_slice[a:b], reducer[j][name][a:b] = reference_compensate(
                    mean, reducer[j][name][a:b], config.beta, local_groups, config.bits)
            offset = 0
            for i in positions:
                n = initial[i].numel()
                aggregate[i] = torch.from_numpy(mean_of_slice[offset : offset + n].copy()).view(initial[i].shape)
                offset += n
        for i, p in enumerate(params):
            bufs[i] = bufs[i] * config.momentum + aggregate[i]
            params[i] = p - (bufs[i] * config.momentum + aggregate[i]) * config.lr
    return params, bufs, sender, reducer


# ---- the codec ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [2, 4, 8])
def test_the_quantizer_follows_the_written_out_rule_and_is_exact_on_its_grid(bits):
    layout = BlockLayout(SHAPES, 16)
    generator = torch.Generator().manual_seed(bits)
    values = torch.randn(layout.numel, generator=generator) * torch.exp(4 * torch.randn(layout.numel,
                                                                                         generator=generator))
    values[96:112] = 0.0  # group 6, all zeros: scale 0, codes 0
    quantized = quantize(values, layout.lengths, bits)
    codes, scales, decoded = reference_quantize(values.numpy(), reference_groups(SHAPES, 16), bits)
    assert np.array_equal(quantized.codes.numpy(), codes) and np.array_equal(quantized.scales.numpy(), scales)
    assert np.array_equal(quantized.decode().numpy(), decoded)
    q = 2 ** (bits - 1) - 1
    per_value = quantized.scales.repeat_interleave(layout.lengths)
    assert bool(((values - quantized.decode()).abs() <= per_value / 2).all())  # round to nearest
    assert int(quantized.codes.abs().max()) == q and float(quantized.scales[6]) == 0.0
    # On its own grid the codec is exact: decoded values quantize to the very same codes and scales.
    again = quantize(quantized.decode(), layout.lengths, bits)
    assert torch.equal(again.codes, quantized.codes) and torch.equal(again.scales, quantized.scales)
    assert torch.equal(again.decode(), quantized.decode())


def test_a_grid_of_extreme_scales_round_trips_exactly():
    generator = torch.Generator().manual_seed(1)
    lengths = torch.full((400,), 8)
    codes = torch.randint(-7, 8, (3200,), generator=generator, dtype=torch.int8)
    codes[::8] = 7  # every group reaches the largest code, as the quantizer's own output does
    significands = torch.randint(1 << 15, 1 << 16, (400,), generator=generator).double()
    exponents = torch.randint(-125, 100, (400,), generator=generator).double()  # every normal magnitude
    scales = (significands * 2.0 ** (exponents - 16)).float()
    values = codes.float() * scales.repeat_interleave(lengths)
    again = quantize(values, lengths, 4)
    assert torch.equal(again.codes, codes) and torch.equal(again.scales, scales)
    tiny = quantize(torch.full((8,), 1e-38), lengths[:1], 4)  # a subnormal scale would lose exactness: zeros
    assert float(tiny.scales[0]) == 0.0 and not tiny.codes.any()


def exchange_of(values: torch.Tensor, bits: int = 4, policy: Policy = UNBOUNDED) -> LowBitMean:
    layout = BlockLayout(SHAPES, 16)
    return LowBitMean(layout, bits, quantize(values, layout.lengths, bits), torch.zeros(layout.numel), 0.8, policy)


SPAN = range(30, 37)  # groups of 16, the tensor's 1-value tail, and the next tensor's: an odd count of values


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_payloads_round_trip_to_the_decoded_values(bits):
    values = torch.randn(BlockLayout(SHAPES, 16).numel, generator=torch.Generator().manual_seed(2))
    exchange = exchange_of(values, bits)
    elements = exchange.layout.element_range(SPAN)
    assert len(elements) % 2 == 1
    payload = exchange.encode(SPAN)
    assert len(payload) == HEADER.size + 4 * len(SPAN) + (len(elements) * bits + 7) // 8
    assert np.array_equal(exchange.parse(SPAN, payload).values, exchange.sent.decode()[elements.start:elements.stop])


def with_scale(payload: bytes, index: int, bits_of_scale: int) -> bytes:
    at = HEADER.size + 4 * index
    return payload[:at] + struct.pack("<I", bits_of_scale) + payload[at + 4:]


def codes_at(payload: bytes, offset_from_end: int, byte: int) -> bytes:
    data = bytearray(payload)
    data[len(data) - offset_from_end] = byte
    return bytes(data)


def malformed(good: bytes, result: bytes) -> list[tuple[bytes, str]]:
    header = list(HEADER.unpack_from(good))

    def header_with(field: int, value) -> bytes:
        changed = list(header)
        changed[field] = value
        return HEADER.pack(*changed) + good[HEADER.size:]

    codes_start = HEADER.size + 4 * len(SPAN)
    return [
        (good[:-1], "bytes, expected"),  # truncated
        (good + b"\0", "bytes, expected"),  # too long
        (b"", "bytes, expected"),
        (header_with(0, b"SL"), "header"),  # another format's magic
        (header_with(1, 2), "header"),  # a future version
        (result, "header"),  # a reducer's result where a contribution belongs
        (header_with(3, 8), "header"),  # other bits
        (header_with(4, SPAN.start + 1), "header"),  # another span
        (header_with(5, len(SPAN) - 1), "header"),
        (with_scale(good, 2, 0x7FC00000), "negative, infinite or NaN scale"),
        (with_scale(good, 0, 0x7F800000), "negative, infinite or NaN scale"),
        (with_scale(good, 1, 0xBF800000), "negative, infinite or NaN scale"),  # -1.0
        (with_scale(good, 1, 0x3F800001), "more than 16 significant bits"),
        (with_scale(good, 1, 0x00000100), "subnormal scale"),
        (good[:codes_start] + b"\xff" + good[codes_start + 1:], "code above 14"),  # stored 15: out of range
        (codes_at(good, 1, good[-1] | 0x01), "non-zero padding"),
    ]


def test_malformed_contributions_and_results_are_refused():
    values = torch.randn(BlockLayout(SHAPES, 16).numel, generator=torch.Generator().manual_seed(3))
    exchange = exchange_of(values)
    good = exchange.encode(SPAN)
    reduction = reduce_span(exchange, SPAN, [("me", good)])
    result, receipt = reduction.result_for(exchange, "me"), reduction.receipt_for("me")
    for bad, why in malformed(good, result):
        with pytest.raises(PayloadError, match=why):
            exchange.parse(SPAN, bad)
    for bad, why in malformed(result, good):  # the same checks on a result, which must say it is one
        with pytest.raises(PayloadError, match=why):
            exchange.receive(SPAN, bad, receipt)
    huge = with_scale(result, 0, 0x7F000000)  # 1.7e38: a norm no mean of bounded contributions has
    with pytest.raises(PayloadError, match="absurdly large"):
        exchange.receive(SPAN, huge, receipt)
    assert torch.isnan(exchange.output).all()  # nothing malformed was stored
    exchange.receive(SPAN, result, receipt)


def test_a_reducer_drops_a_malformed_sender_and_clips_a_huge_one():
    layout = BlockLayout(SHAPES, 16)
    generator = torch.Generator().manual_seed(4)
    honest = [exchange_of(torch.randn(layout.numel, generator=generator), policy=Policy(2.0)) for _ in range(3)]
    hostile = exchange_of(torch.randn(layout.numel, generator=generator) * 1e6, policy=Policy(2.0))
    whole = range(layout.num_blocks)
    contributions = [(f"p{i}", e.encode(whole)) for i, e in enumerate(honest)]
    contributions += [("huge", hostile.encode(whole)), ("garbage", b"LQ" + b"\0" * 40)]
    reduction = reduce_span(honest[0], whole, contributions)
    assert reduction.included == ["p0", "p1", "p2", "huge"] and list(reduction.rejected) == ["garbage"]
    assert reduction.clipped == ["huge"]
    honest[0].receive(whole, reduction.result_for(honest[0], "p0"), reduction.receipt_for("p0"))
    mean = torch.cat([t.reshape(-1) for t in honest[0].mean()])
    typical = max(float(e.sent.decode().norm()) for e in honest)
    assert float(mean.norm()) < 2 * typical  # the 1e6 contribution counted as at most twice the median


# ---- the invariant: what was not sent is carried, decayed by beta, and reset on schedule ----------------------

def test_the_buffer_carries_what_was_not_sent_and_decays_by_beta():
    lengths = BlockLayout(SHAPES, 16).lengths
    generator = torch.Generator().manual_seed(5)
    g = torch.randn(int(lengths.sum()), generator=generator)
    # Nothing carried yet: the buffer is (1 - beta) x exactly what quantization dropped.
    quantized, error = compensate(g, torch.zeros_like(g), 0.8, lengths, 4)
    assert torch.equal(error, (g - quantized.decode()) * (1 - 0.8))
    assert bool((error != 0).any())
    # A pseudo-gradient that cancels the buffer: nothing is sent, and the buffer decays by exactly beta.
    quantized, decayed = compensate(-error, error, 0.8, lengths, 4)
    assert not bool(quantized.codes.any()) and torch.equal(decayed, error * 0.8)
    # The buffer is compensated before quantizing: what is sent is Q(g + e), not Q(g).
    sent_with, _ = compensate(g, error, 0.8, lengths, 4)
    assert torch.equal(sent_with.codes, quantize(g + error, lengths, 4).codes)


@pytest.mark.parametrize("replicas", [1, 3, 4])
def test_in_process_loco_equals_the_written_out_algorithm_exactly(replicas):
    config = LoCoConfig(group_size=16, reset_every=3, momentum=0.9, lr=0.7)
    initial, locals_per_round, algorithms, stats = run_outer_replicas(
        OuterConfig(algorithm="loco", loco=config), SHAPES, replicas, 7, 0.01)
    params, momentum, sender, reducer = reference_loco(initial, locals_per_round, config, {"stage0": [0, 1, 2]})
    for rank, algorithm in enumerate(algorithms):
        assert all(torch.equal(got, want) for got, want in zip(algorithm.params, params))
        assert all(torch.equal(got, want) for got, want in zip(algorithm.momentum, momentum))
        assert np.array_equal(algorithm.errors["stage0"].numpy(), sender[rank]["stage0"])
        assert np.array_equal(algorithm.reducer_errors["stage0"].numpy(), reducer[rank]["stage0"])
        assert bool(algorithm.errors["stage0"].any())
        # alone, a replica re-quantizes its own decoded values, which lie on the grid: nothing is dropped
        assert bool(algorithm.reducer_errors["stage0"].any()) == (replicas > 1)
    numel = sum(math.prod(s) for s in SHAPES)
    for rank_stats in stats:
        assert all(s.applied and not s.all_reduce.clipped for s in rank_stats)
        traffic = rank_stats[0].all_reduce.traffic
        bits = 8 * traffic.contribution_bytes / numel  # 4-bit codes, a float32 scale per 16, headers
        assert 4 + 32 / 16 < bits < 4 + 32 / 16 + 1  # 13-byte headers weigh on 638 parameters
        if replicas > 1:  # results are low-bit too: ~6.5 of 32 bits per value both ways, so ~5x below dense fp32
            assert 4 * (traffic.bytes_sent + traffic.bytes_received) < traffic.dense_fp32_bytes


def test_the_buffers_are_reset_on_schedule():
    """With reset_every = 3, round 3 starts from empty buffers: its sender buffer is (1 - beta) x what quantizing
    round 3's pseudo-gradient alone dropped, whatever rounds 0-2 left; without the reset it is not."""
    runs = {}
    for reset_every in (3, 100):
        config = LoCoConfig(group_size=16, reset_every=reset_every)
        runs[reset_every] = run_outer_replicas(OuterConfig(algorithm="loco", loco=config), SHAPES, 2, 4, 0.01)
    _, _, after_three, _ = run_outer_replicas(OuterConfig(algorithm="loco", loco=LoCoConfig(group_size=16)), SHAPES,
                                              2, 3, 0.01)  # the same first three rounds: the params round 3 starts at
    _, locals_per_round, algorithms, _ = runs[3]
    assert bool(after_three[0].errors["stage0"].any())  # rounds 0-2 did leave something behind
    g = torch.cat([(p - local).reshape(-1) for p, local in zip(after_three[0].params, locals_per_round[3][0])]).numpy()
    _, expected = reference_compensate(g, np.zeros_like(g), 0.8, reference_groups(SHAPES, 16), 4)
    assert np.array_equal(algorithms[0].errors["stage0"].numpy(), expected)
    assert not np.array_equal(runs[100][2][0].errors["stage0"].numpy(), expected)


def test_in_process_loco_over_named_slices_equals_the_written_out_algorithm():
    config = LoCoConfig(group_size=8, bits=2, beta=0.5, reset_every=2)
    slices = {"stage0": [0, 2], "stage1": [1]}
    initial, locals_per_round, algorithms, _ = run_outer_replicas(
        OuterConfig(algorithm="loco", loco=config), SHAPES, 3, 4, 0.01, slices=slices)
    params, _, sender, reducer = reference_loco(initial, locals_per_round, config, slices)
    for rank, algorithm in enumerate(algorithms):
        assert all(torch.equal(got, want) for got, want in zip(algorithm.params, params))
        for name in slices:
            assert np.array_equal(algorithm.errors[name].numpy(), sender[rank][name])
            assert np.array_equal(algorithm.reducer_errors[name].numpy(), reducer[rank][name])


class Refused(Communicator):
    """A round whose vote fails after the all-reduce ran (this peer reduced and received everything)."""

    def all_reduce(self, exchange: Exchange, round_index: int, name: str) -> AllReduceResult:
        reduce_alone(exchange)
        return AllReduceResult(["me"], committed=False)


def test_a_round_not_applied_changes_no_state_and_local_state_is_live():
    config = LoCoConfig(group_size=16, reset_every=1000)
    initial, locals_per_round, algorithms, _ = run_outer_replicas(
        OuterConfig(algorithm="loco", loco=config), SHAPES, 1, 2, 0.01)
    loco: LoCo = algorithms[0]
    before = {k: v.clone() for k, v in {**loco.local_state(), **loco.shared_state()}.items()}
    params = [p.clone() for p in loco.params]
    assert not loco.sync(locals_per_round[0][0], Refused(), 2).applied
    assert all(torch.equal(a, b) for a, b in zip(loco.params, params))
    assert all(torch.equal(v, before[k]) for k, v in {**loco.local_state(), **loco.shared_state()}.items())
    # Checkpoints hold per-parameter views of the buffers: loading them loads the buffers; a reset clears both.
    state = loco.local_state()
    assert sorted(state) == sorted([f"error.{i}" for i in range(3)] + [f"reducer_error.{i}" for i in range(3)])
    assert state["error.1"].shape == (17,) and sorted(loco.shared_state()) == [f"momentum.{i}" for i in range(3)]
    loco.load_local_state({k: torch.full_like(v, 0.5) for k, v in state.items()})
    assert bool((loco.errors["stage0"] == 0.5).all()) and bool((loco.reducer_errors["stage0"] == 0.5).all())
    loco.reset_local_state()
    assert not bool(loco.errors["stage0"].any()) and not bool(loco.reducer_errors["stage0"].any())


# ---- real nodes ----------------------------------------------------------------------------------------------

@pytest.mark.timeout(240)
def test_three_real_nodes_train_with_loco_and_agree_every_round(tmp_path):
    result = subprocess.run([sys.executable, "-m", "p2ploco.cli", "demo", "--replicas", "3", "--rounds", "6",
                             "--workdir", str(tmp_path), "--set", "outer.algorithm=loco", "--set", "inner.steps=4"],
                            capture_output=True, text=True, timeout=220)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "identical global parameters on all 3 nodes after every round: yes" in result.stdout
    assert re.search(r"round\s+5 \| peers 3 \|", result.stdout)
    runs = [read_summaries(tmp_path / f"node{i}" / "metrics.jsonl") for i in range(3)]
    for records in runs:
        assert [r["round"] for r in records] == list(range(6)) and all(r["applied"] for r in records)
        assert records[-1]["eval_loss"] < records[0]["eval_loss"]
        for r in records:  # 4-bit values and a float32 scale per 128 both ways: ~7.5x below dense fp32
            assert 4.2 < r["bits_per_param"] < 4.3
            assert 6 * (r["bytes_sent"] + r["bytes_received"]) < r["dense_fp32_bytes"]
    for round_index in range(6):
        assert len({records[round_index]["params_digest"] for records in runs}) == 1


def test_a_worker_checkpoints_its_buffers_and_drops_them_when_it_takes_the_swarms_state(tmp_path):
    config = small_config("outer.algorithm=loco", "pipeline.stages=1", "outer.loco.group_size=32",
                          "inner.steps=2")
    samplers = [ShardSampler(TOKENS, config.data.seq_len, config.inner.batch_size, "run", f"replica-{i}")
                for i in range(2)]
    workers = [build_replica(config, CPU, samplers[i]) for i in range(2)]
    group = InProcessGroup(2, timeout=60)

    def replica(rank: int) -> None:
        schedule = BlockingRounds(workers[rank])
        for round_index in range(2):
            assert schedule.run(round_index, group.communicator(rank), RoundHooks()).comm.applied

    run_in_threads(2, replica)
    worker = workers[0]
    assert worker.params_digest == workers[1].params_digest
    local = {k: v.clone() for k, v in worker.outer.local_state().items()}
    assert any(bool(v.any()) for k, v in local.items() if k.startswith("reducer_error."))
    checkpoint.save(tmp_path, worker.checkpoint(2), "run", "fp")
    resumed = build_replica(config, CPU, sampler(config))
    resumed.restore(checkpoint.load(tmp_path, "run", "fp"), tmp_path)
    assert resumed.params_digest == worker.params_digest
    assert all(torch.equal(v, local[k]) for k, v in resumed.outer.local_state().items())
    assert all(torch.equal(v, worker.outer.shared_state()[k]) for k, v in resumed.outer.shared_state().items())
    joiner = build_replica(config, CPU, sampler(config))
    joiner.outer.load_local_state(local)
    joiner.adopt({s.slice: s for s in worker.snapshots(2)})  # newer state from a peer: the buffers no longer apply
    assert joiner.params_digest == worker.params_digest
    assert not any(bool(v.any()) for v in joiner.outer.local_state().values())
    assert all(torch.equal(v, worker.outer.shared_state()[k]) for k, v in joiner.outer.shared_state().items())
