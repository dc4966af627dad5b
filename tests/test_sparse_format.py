"""The SparseLoCo wire format: round trips, compactness, and every class of malformed payload refused."""

import struct

import numpy as np
import pytest
import torch

from p2ploco.collective.exchange import reduce_span
from p2ploco.collective.sparse import SparseExchange
from p2ploco.compression import sparse_format as fmt
from p2ploco.compression.bitcodes import rice_decode, rice_encode
from p2ploco.compression.chunking import chunk_grid
from p2ploco.compression.sparse_format import SparseLayout
from p2ploco.compression.topk import CompressedTensor, compress
from p2ploco.errors import PayloadError

SHAPES = [(128, 192), (257, 64), (192,), (96, 100)]


def compressed_replica(seed: int, layout: SparseLayout):
    generator = torch.Generator().manual_seed(seed)
    pairs = [compress(torch.randn(g.shape, generator=generator), g) for g in layout.grids]
    return [p[0] for p in pairs], [p[1] for p in pairs]


@pytest.fixture(scope="module")
def layout():
    return SparseLayout([chunk_grid(s, 64, 64) for s in SHAPES])


def test_contribution_round_trip_gives_the_senders_decoded_values(layout):
    compressed, decoded = compressed_replica(0, layout)
    expected = torch.cat([g.to_chunks(d).reshape(-1) for g, d in zip(layout.grids, decoded)]).numpy()
    exchange = SparseExchange(layout, compressed, "mean")
    for parts in (1, 3, 5):
        rebuilt = np.zeros(layout.total_numel, dtype=np.float32)
        for span in exchange.partition(parts):
            payload = exchange.encode(span)
            assert len(payload) <= layout.max_contribution_bytes(span)
            values = fmt.decode_contribution(layout, span, payload)
            start, _ = layout.element_range(span)
            rebuilt[start + values.positions] = values.values
        assert np.array_equal(rebuilt, expected)  # bit for bit: what the sender's error feedback subtracted


def test_spans_balance_elements_not_chunks(layout):
    exchange = SparseExchange(layout, compressed_replica(0, layout)[0], "mean")
    sizes = [layout.numel(span) for span in exchange.partition(3)]
    assert sum(sizes) == layout.total_numel
    assert max(sizes) - min(sizes) <= 4096  # at most one chunk apart


def test_index_coding_beats_twelve_bits_per_index():
    grid = chunk_grid((1024, 1024), 64, 64)
    layout = SparseLayout([grid])
    compressed, _ = compress(torch.randn(1024, 1024), grid)
    payload = fmt.encode_contribution(layout, range(layout.num_chunks), [compressed])
    indices = grid.chunks * grid.k
    index_bits = 8 * len(payload) - 2 * indices - 8 * (fmt.HEADER.size + fmt.SIDE.size + fmt.U32.size)
    assert index_bits / indices < 8.2  # the bound is ~7.4; fixed-width would be 12
    assert 8 * len(payload) / grid.numel < 0.16


def test_rice_coder_round_trip():
    rng = np.random.default_rng(1)
    gaps, widths = rng.integers(0, 300, 2000), rng.integers(0, 9, 2000)
    unary, remainders = rice_encode(gaps, widths)
    assert np.array_equal(rice_decode(unary, remainders, widths), gaps)
    with pytest.raises(PayloadError, match="holds 2000 codes, expected 1999"):
        rice_decode(unary, remainders, widths[:-1])


def receive_all(layout, compressed_list, results_for):
    """Every replica receives every span's result (with its receipt); returns their outputs."""
    outputs = []
    for rank, compressed in enumerate(compressed_list):
        exchange = SparseExchange(layout, compressed, "mean")
        for span, (result, receipt) in results_for(rank).items():
            exchange.receive(span, result, receipt)
        outputs.append(exchange.output)
    return outputs


@pytest.mark.parametrize("replicas, identical", [(3, False), (6, True)])
def test_relay_and_union_results_give_the_same_bits(layout, replicas, identical):
    compressed_list = [compressed_replica(0 if identical else seed, layout)[0] for seed in range(replicas)]
    exchanges = [SparseExchange(layout, c, "mean") for c in compressed_list]
    whole = range(layout.num_chunks)
    reduction = reduce_span(exchanges[0], whole, [(str(i), e.encode(whole)) for i, e in enumerate(exchanges)])
    aggregate = reduction.aggregate
    relay_outputs = receive_all(layout, compressed_list, lambda rank: {
        whole: (fmt.encode_relay(layout, [p for i, p in enumerate(aggregate.payloads) if i != rank]),
                reduction.receipt_for(str(rank)))})
    union_outputs = receive_all(layout, compressed_list,
                                lambda rank: {whole: (aggregate.union, reduction.receipt_for(str(rank)))})
    for out in relay_outputs + union_outputs:
        assert np.array_equal(out, relay_outputs[0])
    chosen = fmt.read_kind(layout, exchanges[0].result_for(aggregate, 0))
    # Independent selections: relaying 2 payloads is smaller; 6 identical ones: the union is.
    assert chosen == (fmt.UNION if identical else fmt.RELAY)
    assert len(aggregate.union) <= layout.max_union_bytes(whole)


def corrupt(payload: bytes, offset: int, value: bytes) -> bytes:
    return payload[:offset] + value + payload[offset + len(value):]


@pytest.fixture(scope="module")
def payload(layout):
    compressed, _ = compressed_replica(3, layout)
    return fmt.encode_contribution(layout, range(layout.num_chunks), compressed)


SIDE_AT = fmt.HEADER.size  # the first tensor's shift, then its table


@pytest.mark.parametrize("mutate, message", [
    (lambda p: b"", "shorter than its header"),
    (lambda p: p[:5], "shorter than its header"),
    (lambda p: p[:fmt.HEADER.size + 7], "truncated in its side info"),
    (lambda p: p[: len(p) // 2], "truncated"),
    (lambda p: p[:-1], "truncated in its values"),
    (lambda p: p + b"\0", "1 unexpected trailing bytes"),
    (lambda p: corrupt(p, 0, b"XX"), "not a SparseLoCo v1 payload"),
    (lambda p: corrupt(p, 2, b"\x07"), "not a SparseLoCo v1 payload"),
    (lambda p: corrupt(p, 3, b"\x09"), "unknown sparse payload kind"),
    (lambda p: corrupt(p, 3, b"\x01"), "expected a contribution"),
    (lambda p: corrupt(p, 4, b"\0\0\0\0"), "layout digest differs"),
    (lambda p: corrupt(p, SIDE_AT, struct.pack("<f", float("nan"))), "NaN or Inf side info"),
    (lambda p: corrupt(p, SIDE_AT + 8, struct.pack("<f", float("inf"))), "NaN or Inf side info"),
    (lambda p: corrupt(p, SIDE_AT, struct.pack("<ff", 3e38, 3e38)), "NaN or Inf side info"),  # overflows when decoded
])
def test_malformed_contributions_are_refused(layout, payload, mutate, message):
    with pytest.raises(PayloadError, match=message):
        fmt.decode_contribution(layout, range(layout.num_chunks), mutate(payload))


def test_index_out_of_range_and_bad_streams_are_refused(layout):
    compressed, _ = compressed_replica(5, layout)
    whole = range(layout.num_chunks)
    bad = list(compressed)
    first = compressed[0]
    shifted = first.indices.copy()
    shifted[0, -1] = first.grid.chunk_numel + 10  # past the end of its 64x64 chunk
    bad[0] = CompressedTensor(first.grid, shifted, first.codes, first.shift, first.table)
    with pytest.raises(PayloadError, match="index beyond its chunk"):
        fmt.decode_contribution(layout, whole, fmt.encode_contribution(layout, whole, bad))
    good = fmt.encode_contribution(layout, whole, compressed)
    unary_len_at = fmt.HEADER.size + fmt.SIDE.size * len(layout.grids)
    (unary_len,) = struct.unpack_from("<I", good, unary_len_at)
    with pytest.raises(PayloadError):  # a stream length that does not fit the payload
        fmt.decode_contribution(layout, whole, corrupt(good, unary_len_at, struct.pack("<I", unary_len + 3)))
    with pytest.raises(PayloadError, match="non-zero padding|holds"):
        fmt.decode_contribution(layout, whole, good[:-1] + bytes([good[-1] | 0xFF]))


def test_malformed_results_are_refused(layout):
    compressed_list = [compressed_replica(seed, layout)[0] for seed in range(3)]
    exchanges = [SparseExchange(layout, c, "mean") for c in compressed_list]
    whole = range(layout.num_chunks)
    reduction = reduce_span(exchanges[0], whole, [(str(i), e.encode(whole)) for i, e in enumerate(exchanges)])
    aggregate = reduction.aggregate
    relay = fmt.encode_relay(layout, aggregate.payloads[1:])
    receiver = exchanges[0]
    cases = {
        "relay truncated": relay[:-3],
        "relay count too high": corrupt(relay, fmt.HEADER.size, struct.pack("<H", 9)),
        "relay payload oversized": corrupt(relay, fmt.HEADER.size + 2, struct.pack("<I", 1 << 30)),
        "relayed garbage": fmt.encode_relay(layout, [b"SLgarbage"]),
        "union truncated": aggregate.union[:-4],
        "union NaN value": aggregate.union[:-4] + struct.pack("<f", float("nan")),
        "union chunk overfull": corrupt(aggregate.union, fmt.HEADER.size, struct.pack("<H", 60000)),
    }
    accepted = []
    for name, result in cases.items():
        try:
            receiver.receive(whole, result, reduction.receipt_for("0"))
        except PayloadError:
            continue
        accepted.append(name)
    assert accepted == []


def test_an_empty_span_encodes_and_decodes_to_nothing_in_every_result_kind():
    """A group larger than the units cuts empty spans: their union (and resparsified) results must round-trip."""
    layout = SparseLayout([chunk_grid((64, 64), 64, 64)])
    empty = range(1, 1)
    nothing = fmt.SparseValues(np.zeros(0, np.int64), np.zeros(0, np.float32))
    assert len(fmt.decode_union(layout, empty, fmt.encode_union(layout, empty, nothing)).positions) == 0
    assert len(fmt.decode_resparsified(layout, empty, fmt.encode_resparsified(layout, empty, [])).positions) == 0
