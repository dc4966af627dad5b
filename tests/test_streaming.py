"""Streaming DiLoCo: the E3M0 codec against its written-out rule and exact on its grid, malformed payloads
refused, fragments as strided slices, the degenerate setting equal to DiLoCo bit for bit, fragment syncs that
leave every replica bit-identical, checkpoints and joiners, and 3 real nodes."""

import json
import re
import struct
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch
from helpers import CPU, TOKENS, small_config

from p2ploco import checkpoint
from p2ploco.budget import FixedSteps
from p2ploco.build import build_replica
from p2ploco.collective.exchange import AllReduceResult, Communicator, Exchange, reduce_span
from p2ploco.collective.fp4 import BLOCK_SIZE, HEADER, E3M0Mean
from p2ploco.compression import e3m0
from p2ploco.compression.blockwise import BlockLayout
from p2ploco.data import ShardSampler
from p2ploco.errors import ConfigError, PayloadError
from p2ploco.outer.streaming import StreamingDiLoCo
from p2ploco.schedules import RoundHooks
from p2ploco.schedules.blocking import BlockingRounds
from p2ploco.schedules.streaming import StreamingRounds
from p2ploco.slices import group_by_slice
from p2ploco.testing.communicator import InProcessGroup


def reference_e3m0(values: np.ndarray) -> tuple[np.ndarray, np.float32]:
    """One group written out: the scale is the largest |value|; each value goes to the nearest of 0 and
    ±scale·2^k (k = -6..0), ties to the larger magnitude; returned as signed exponents (0: zero)."""
    scale = np.float32(np.abs(values).max())
    if scale < 2.0 ** -120:
        return np.zeros(len(values), dtype=np.int64), np.float32(0)
    grid = [0.0] + [float(scale) * 2.0 ** (e - 7) for e in range(1, 8)]
    codes = []
    for v in values:
        distances = [abs(abs(float(v)) - g) for g in grid]
        best = max(e for e, d in enumerate(distances) if d == min(distances))  # ties: the larger magnitude
        codes.append(-best if v < 0 and best else best)
    return np.array(codes), scale


def signed(nibbles: np.ndarray) -> np.ndarray:
    e = (nibbles & 0b111).astype(np.int64)
    return np.where(nibbles >> 3 == 1, -e, e)


def test_the_codec_follows_the_written_out_rule_and_is_exact_on_its_grid():
    generator = torch.Generator().manual_seed(1)
    values = torch.randn(1000, generator=generator) * torch.logspace(-4, 2, 1000)[torch.randperm(1000)]
    layout = BlockLayout([(1000,)], BLOCK_SIZE)
    nibbles, scales = e3m0.quantize(values, layout.lengths)
    for g, elements in enumerate(layout.element_range(range(i, i + 1)) for i in range(layout.num_blocks)):
        want_codes, want_scale = reference_e3m0(values[elements.start : elements.stop].numpy())
        assert np.array_equal(signed(nibbles[elements.start : elements.stop]), want_codes)
        assert scales[g].item() == want_scale
    decoded = e3m0.decode(nibbles, scales, layout.lengths)
    again, again_scales = e3m0.quantize(decoded, layout.lengths)
    assert np.array_equal(again, nibbles) and torch.equal(again_scales, scales)
    assert torch.equal(e3m0.decode(again, again_scales, layout.lengths), decoded)
    assert np.array_equal(e3m0.unpack(e3m0.pack(nibbles), len(nibbles)), nibbles)


def test_extreme_scales_round_trip_and_tiny_groups_become_zeros():
    lengths = torch.tensor([4, 4, 4, 3])
    values = torch.tensor([3e38, -3e38 / 64, 3e38 / 8, 0.0,  # the largest scales
                           2.0 ** -120, -(2.0 ** -126), 0.0, 2.0 ** -121,  # the smallest kept scale: all normal
                           1e-37, -1e-37, 0.0, 0.0,  # below 2^-120: zeros
                           -1.0, 0.74, 0.76])  # a tie-free rounding either side of 0.75 (2^-1 vs 1)
    nibbles, scales = e3m0.quantize(values, lengths)
    assert scales.tolist()[2] == 0.0 and not nibbles[8:12].any()
    assert signed(nibbles[12:]).tolist() == [-7, 6, 7]
    decoded = e3m0.decode(nibbles, scales, lengths)
    assert torch.isfinite(decoded).all() and decoded[4].item() == 2.0 ** -120 and decoded[5].item() == -(2.0 ** -126)
    again, again_scales = e3m0.quantize(decoded, lengths)
    assert np.array_equal(again, nibbles) and torch.equal(again_scales, scales)


def exchange_of(values: torch.Tensor) -> E3M0Mean:
    return E3M0Mean([values])


def malformed(good: bytes, count: int) -> list[tuple[bytes, str]]:
    """Payloads that differ from ``good`` (a contribution of ``count`` groups from group 0) in one field each."""
    def header_with(index: int, value) -> bytes:
        fields = list(HEADER.unpack_from(good))
        fields[index] = value
        return HEADER.pack(*fields) + good[HEADER.size :]

    def scale_bits(index: int, bits: int) -> bytes:
        at = HEADER.size + 4 * index
        return good[:at] + struct.pack("<I", bits) + good[at + 4 :]

    codes = HEADER.size + 4 * count
    return [
        (good[:-1], "truncated"), (good + b"\0", "a trailing byte"), (b"", "empty"),
        (header_with(0, b"LQ"), "another magic"), (header_with(1, 2), "another version"),
        (header_with(2, 2), "a result where a contribution is due"), (header_with(3, 1), "another first group"),
        (header_with(4, count - 1), "another group count"),
        (scale_bits(0, 0xBF800000), "a negative scale"), (scale_bits(0, 0x7FC00000), "a NaN scale"),
        (scale_bits(0, 0x7F800000), "an infinite scale"), (scale_bits(0, 0x00000001), "a subnormal scale"),
        (scale_bits(0, 0), "a zero scale over non-zero values"),
        (good[:codes] + bytes([0x88]) + good[codes + 1 :], "-0 nibbles"),
        (good[:-1] + bytes([good[-1] | 0x01]), "non-zero padding"),
    ]


def test_malformed_contributions_and_results_are_refused():
    values = torch.randn(3 * BLOCK_SIZE - 1, generator=torch.Generator().manual_seed(2))  # an odd count: padding
    exchange = exchange_of(values)
    whole = range(exchange.num_units)
    good = exchange.encode(whole)
    assert np.array_equal(exchange.parse(whole, good).values, e3m0.decode(exchange.nibbles, exchange.scales,
                                                                          exchange.layout.lengths).numpy())
    for payload, why in malformed(good, exchange.num_units):
        with pytest.raises(PayloadError):
            exchange.parse(whole, payload)
            pytest.fail(f"accepted a payload with {why}")
    # a group whose largest exponent is below 7: not what any encoder sends
    low = bytearray(good)
    stream = HEADER.size + 4 * exchange.num_units
    for i in range(stream, stream + BLOCK_SIZE // 2):  # the first group's nibbles
        nibbles = [low[i] >> 4, low[i] & 0xF]
        low[i] = (min(nibbles[0] & 7, 6) | nibbles[0] & 8) << 4 | (min(nibbles[1] & 7, 6) | nibbles[1] & 8)
    with pytest.raises(PayloadError, match="do not fit its scale"):
        exchange.parse(whole, bytes(low))
    reduction = reduce_span(exchange, whole, [("me", good)])
    result, receipt = reduction.result_for(exchange, "me"), reduction.receipt_for("me")
    exchange.receive(whole, result, receipt)
    with pytest.raises(PayloadError):
        exchange.receive(whole, good, receipt)  # a contribution where a result is due
    with pytest.raises(PayloadError):
        exchange.receive(whole, result[:-1], receipt)


def test_the_reducer_averages_in_float32_and_everyone_decodes_the_same_bytes():
    generator = torch.Generator().manual_seed(3)
    exchanges = [exchange_of(torch.randn(500, generator=generator)) for _ in range(3)]
    span = range(exchanges[0].num_units)
    parsed = [exchanges[0].parse(span, e.encode(span)) for e in exchanges]
    reduction = reduce_span(exchanges[1], span, [(str(i), e.encode(span)) for i, e in enumerate(exchanges)])
    result = reduction.result_for(exchanges[1], "1")
    mean = (torch.from_numpy(parsed[0].values) + torch.from_numpy(parsed[1].values)
            + torch.from_numpy(parsed[2].values)) / 3
    nibbles, scales = e3m0.quantize(mean, exchanges[0].layout.lengths)
    for i, e in enumerate(exchanges):
        e.receive(span, result, reduction.receipt_for(str(i)))
        assert torch.equal(e.mean()[0], e3m0.decode(nibbles, scales, e.layout.lengths))
    assert len({e.aggregate_digest() for e in exchanges}) == 1


def test_fragments_are_strided_blocks_with_embedding_first_and_head_last():
    names = ["embed.weight"] + [f"blocks.{i}.mlp.weight" for i in range(5)] + ["norm.weight", "lm_head.weight"]
    config = small_config("model.n_layer=5").model
    slices = group_by_slice(names, config, 1, fragments=2)
    assert slices == {"fragment0": [0, 1, 3, 5], "fragment1": [2, 4, 6, 7]}
    assert group_by_slice(names, config, 1, fragments=1) == {"fragment0": list(range(8))}


@pytest.mark.parametrize(("override", "message"), [
    ("outer.streaming.delay=2", r"delay \(2\) must be in \[0, inner.steps / fragments = 2\)"),
    ("outer.streaming.fragments=5", r"fragments \(5\) must be in \[1, model.n_layer=4\]"),
    ("outer.streaming.alpha=1.5", r"alpha \(1.5\) must be in \[0, 1\]"),
    ("outer.streaming.bits=8", r"bits \(8\) must be 4 \(E3M0\) or 32"),
    ("pipeline.stages=2", r"streaming needs pipeline.stages=1 \(got 2\)"),
])
def test_bad_streaming_settings_get_a_one_line_error(override, message):
    with pytest.raises(ConfigError, match=message) as caught:
        small_config("outer.algorithm=streaming", "pipeline.stages=1", "inner.steps=4", "outer.streaming.fragments=2",
                     override)
    assert "\n" not in str(caught.value)


def test_the_fragment_schedule_binds_only_streaming_runs():
    config = small_config("inner.steps=2", "outer.streaming.fragments=8")  # no streaming: nothing to schedule
    assert config.outer.algorithm == "sparseloco"
    with pytest.raises(ConfigError, match=r"fragments \(8\) must be in \[1, model.n_layer=4\]"):
        small_config("inner.steps=2", "outer.streaming.fragments=8", "outer.algorithm=streaming", "pipeline.stages=1")


# ---- whole workers over the in-process communicator ------------------------------------------------------------

def replicas(count: int, *overrides: str):
    config = small_config("pipeline.stages=1", "inner.steps=4", *overrides)
    return [build_replica(config, CPU, ShardSampler(TOKENS, config.data.seq_len, config.inner.batch_size, "run",
                                                    f"replica-{i}")) for i in range(count)]


def schedule_of(worker):
    """The round schedule a node runs for ``worker``: Streaming DiLoCo's, or the blocking one (DiLoCo)."""
    if isinstance(worker.outer, StreamingDiLoCo):
        return StreamingRounds(worker, worker.outer)
    return BlockingRounds(worker)


def train_rounds(workers, rounds: int, group=None, start: int = 0):
    """``rounds`` rounds of every worker in its own thread; each round's stats and params_digest per worker."""
    group = group or InProcessGroup(len(workers), timeout=60)
    stats, hashes = [[] for _ in workers], [[] for _ in workers]
    errors = []

    def run(rank: int) -> None:
        schedule = schedule_of(workers[rank])
        try:
            for r in range(start, start + rounds):
                stats[rank].append(schedule.run(r, group.communicator(rank), RoundHooks()).comm)
                hashes[rank].append(workers[rank].params_digest)
        except BaseException as e:
            errors.append(e)
            group.abort()
            raise

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(len(workers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return stats, hashes


def test_one_fragment_no_delay_no_alpha_and_float32_is_diloco_exactly():
    streaming = replicas(2, "outer.algorithm=streaming", "outer.streaming.fragments=1", "outer.streaming.delay=0",
                         "outer.streaming.alpha=0", "outer.streaming.bits=32", "outer.streaming.lr=0.7",
                         "outer.streaming.momentum=0.9")
    diloco = replicas(2, "outer.algorithm=diloco", "outer.diloco.lr=0.7", "outer.diloco.momentum=0.9")
    initial = [p.clone() for p in streaming[0].outer.params]
    train_rounds(streaming, 3)
    train_rounds(diloco, 3)
    assert not all(torch.equal(a, b) for a, b in zip(initial, streaming[0].outer.params))
    for s, d in zip(streaming, diloco):
        assert all(torch.equal(a, b) for a, b in zip(s.outer.params, d.outer.params))
        assert all(torch.equal(a, b) for a, b in zip(s.outer.momentum, d.outer.momentum))
        assert all(torch.equal(a, b) for a, b in zip(s.model.parameters(), d.model.parameters()))


class Recording(Communicator):
    """An in-process member that notes, per all-reduce, its name and the inner step its worker had reached."""

    def __init__(self, inner, worker):
        self.inner, self.worker, self.log = inner, worker, []

    def all_reduce(self, exchange: Exchange, round_index: int, name: str) -> AllReduceResult:
        self.log.append((round_index, name, self.worker.inner.step_in_round, sorted(exchange.parts)))
        return self.inner.all_reduce(exchange, round_index, name)


def test_fragments_sync_on_schedule_overlapped_and_every_replica_ends_bit_identical():
    workers = replicas(3, "outer.algorithm=streaming", "outer.streaming.fragments=2", "outer.streaming.delay=1")
    group = InProcessGroup(3, timeout=60)
    recorders = [Recording(group.communicator(rank), w) for rank, w in enumerate(workers)]

    class Members:
        def communicator(self, rank):
            return recorders[rank]

        def abort(self):
            group.abort()

    before = [p.clone() for p in workers[0].outer.params]
    stats, hashes = train_rounds(workers, 3, Members())
    # fragment p starts after inner step 2p + 1 (its thread may see the next step under way: training goes on)
    for log in (r.log for r in recorders):
        assert [(r, name, parts) for r, name, _, parts in log] == [
            (r, f"fragment{p}", [f"fragment{p}"]) for r in range(3) for p in range(2)]
        assert all(step in (2 * int(name[-1]), 2 * int(name[-1]) + 1) for _, name, step, _ in log)
    for rank_stats in stats:
        for s in rank_stats:
            traffic = s.all_reduce.traffic
            assert s.applied and len(traffic.sync_bytes) == 2
            assert sum(traffic.sync_bytes) == traffic.bytes_sent + traffic.bytes_received
            assert max(traffic.sync_bytes) < 0.6 * sum(traffic.sync_bytes)  # the peak: about half the round's traffic
    for r in range(3):
        assert len({worker_hashes[r] for worker_hashes in hashes}) == 1
    assert all(all(torch.equal(a, b) for a, b in zip(w.outer.params, workers[0].outer.params)) for w in workers)
    assert not all(torch.equal(a, b) for a, b in zip(before, workers[0].outer.params))
    # the local copies keep their own progress: not the global params
    assert not all(torch.equal(p, g) for p, g in zip(workers[0].model.parameters(), workers[0].outer.params))


def test_fragments_of_a_round_they_do_not_divide_sync_at_its_floor_points_and_both_land():
    workers = replicas(2, "inner.steps=5", "outer.algorithm=streaming", "outer.streaming.fragments=2",
                       "outer.streaming.delay=1")
    assert workers[0].outer.schedule_for(5) == {"fragment0": (1, 2), "fragment1": (4, 5)}  # ⌊5/2⌋ = 2, then 5
    group = InProcessGroup(2, timeout=60)
    recorders = [Recording(group.communicator(rank), w) for rank, w in enumerate(workers)]
    outcomes = [None, None]

    def run(rank):
        outcomes[rank] = schedule_of(workers[rank]).run(0, recorders[rank], RoundHooks())

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for recorder, outcome in zip(recorders, outcomes):
        assert [name for _, name, _, _ in recorder.log] == ["fragment0", "fragment1"]
        # started after inner steps 1 and 4 (as in the test above, the next step may be under way)
        assert recorder.log[0][2] in (0, 1) and recorder.log[1][2] in (3, 4)
        assert outcome.comm.applied and outcome.inner.steps == 5
    assert workers[0].params_digest == workers[1].params_digest


def test_a_peer_whose_budget_fits_fewer_steps_spreads_its_fragment_syncs_over_them_and_weighs_its_tokens():
    """H = 8, 2 fragments, delay 1: the fast replica syncs after steps 3 and 7 of 8; the one whose budget fits 4
    steps syncs after steps 1 and 3 of its 4 (as far into its round), both land, and its contributions weigh half."""
    workers = replicas(2, "inner.steps=8", "outer.algorithm=streaming", "outer.streaming.fragments=2",
                       "outer.streaming.delay=1")
    assert workers[1].outer.fewest_steps == 4
    group = InProcessGroup(2, timeout=60)
    recorders = [Recording(group.communicator(rank), w) for rank, w in enumerate(workers)]
    budgets = [None, FixedSteps(4)]
    outcomes = [None, None]

    def run(rank):
        outcomes[rank] = schedule_of(workers[rank]).run(0, recorders[rank], RoundHooks(budget=budgets[rank]))

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    per_step = workers[0].inner.gradients.tokens_per_step
    assert [outcome.inner.steps for outcome in outcomes] == [8, 4]
    assert [outcome.comm.all_reduce.tokens for outcome in outcomes] == [8 * per_step, 4 * per_step]
    # each fragment's sync started after the steps it was due at, 3 and 7 of 8, 1 and 3 of 4 (step_in_round: the
    # index of the step done, or of the next one under way)
    starts = [[step for _, _, step, _ in recorder.log] for recorder in recorders]
    assert starts[0][0] in (2, 3) and starts[0][1] in (6, 7) and starts[1][0] in (0, 1) and starts[1][1] in (2, 3)
    assert all(outcome.comm.applied for outcome in outcomes)
    assert workers[0].params_digest == workers[1].params_digest


def test_more_fragments_than_inner_steps_get_a_one_line_error():
    with pytest.raises(ConfigError, match=r"fragments \(3\) must be at most inner.steps \(2\)") as caught:
        small_config("outer.algorithm=streaming", "pipeline.stages=1", "inner.steps=2", "outer.streaming.fragments=3")
    assert "\n" not in str(caught.value)


def test_a_stop_request_takes_effect_at_the_end_of_the_round_not_between_fragments():
    worker = replicas(1, "outer.algorithm=streaming", "outer.streaming.fragments=2")[0]
    before = [p.clone() for p in worker.outer.params]
    group = InProcessGroup(1, timeout=60)
    outcome = schedule_of(worker).run(0, group.communicator(0), RoundHooks(stopping=lambda: True))
    assert outcome is not None  # all 4 steps, both fragments
    synced = outcome.comm
    assert synced.applied and len(synced.all_reduce.traffic.sync_bytes) == 2
    assert all(not torch.equal(a, b) for a, b in zip(before, worker.outer.params))  # every fragment moved


def test_checkpoints_and_joiners_get_every_fragments_state(tmp_path):
    workers = replicas(2, "outer.algorithm=streaming", "outer.streaming.fragments=2")
    train_rounds(workers, 2)
    worker = workers[0]
    assert set(worker.slice_digest) == {"fragment0", "fragment1"}
    checkpoint.save(tmp_path, worker.checkpoint(2), "run", "fp")
    resumed = replicas(1, "outer.algorithm=streaming", "outer.streaming.fragments=2")[0]
    resumed.restore(checkpoint.load(tmp_path, "run", "fp"), tmp_path)
    joiner = replicas(1, "outer.algorithm=streaming", "outer.streaming.fragments=2")[0]
    joiner.adopt({s.slice: s for s in worker.snapshots(2)})
    for other in (resumed, joiner):
        assert other.params_digest == worker.params_digest and other.slice_digest == worker.slice_digest
        assert all(torch.equal(a, b) for a, b in zip(other.outer.momentum, worker.outer.momentum))
        assert any(bool(m.any()) for m in other.outer.momentum)
        assert all(torch.equal(p, g) for p, g in zip(other.model.parameters(), other.outer.params))
    # and they go on with the swarm, bit-identical
    _, hashes = train_rounds([workers[1], joiner], 1, start=2)
    assert hashes[0] == hashes[1] and hashes[0] != [worker.params_digest]


# ---- real nodes ----------------------------------------------------------------------------------------------

@pytest.mark.timeout(240)
def test_three_real_nodes_stream_fragments_and_agree_every_round(tmp_path):
    result = subprocess.run([sys.executable, "-m", "p2ploco.cli", "demo", "--replicas", "3", "--rounds", "6",
                             "--workdir", str(tmp_path), "--set", "outer.algorithm=streaming", "--set", "inner.steps=4",
                             "--set", "outer.streaming.fragments=2", "--set", "outer.streaming.delay=1"],
                            capture_output=True, text=True, timeout=220)
    assert result.returncode == 0, result.stdout + result.stderr
    for fragment in ("fragment0", "fragment1"):
        assert f"identical global parameters on all 3 holders of {fragment} after every round: yes" in result.stdout
    assert re.search(r"round\s+5 \| peers 3 \|", result.stdout)
    runs = [[json.loads(line) for line in (tmp_path / f"node{i}" / "metrics.jsonl").read_text().splitlines()]
            for i in range(3)]
    for records in runs:
        assert [r["round"] for r in records] == list(range(6)) and all(r["applied"] for r in records)
        assert records[-1]["eval_loss"] < records[0]["eval_loss"]
        for r in records:
            assert len(r["fragment_bytes"]) == 2 and r["peak_sync_bytes"] == max(r["fragment_bytes"])
            assert sum(r["fragment_bytes"]) == r["bytes_sent"] + r["bytes_received"]
            assert 4.2 < r["bits_per_param"] < 4.3  # E3M0 values and a float32 scale per 128
    for round_index in range(6):
        assert len({records[round_index]["params_digest"] for records in runs}) == 1
