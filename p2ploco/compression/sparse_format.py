"""The versioned wire format of SparseLoCo payloads, and the aggregate they describe.

Every payload starts ``b"SL" | version u8 | kind u8 | layout digest (4 bytes)``; the digest names
the tensor shapes, chunking and k, so a payload meant for another model or setting is refused.

- contribution (kind 0), one replica's chunks of a span: per tensor touched, its side info
  (shift and 4-entry decode table, float32); ``u32`` length of the Rice unary stream, the unary
  stream, the remainder stream, then the 2-bit value codes, 4 per byte. Chunks that keep all their
  values (vector runs) send no indices.
- relay (kind 1), a reducer's result made of the included contributions: ``u16`` count, ``u32``
  lengths, the payloads. The recipient's own contribution is left out; it re-inserts its own.
- union (kind 2), a reducer's result as the aggregate itself: ``u16`` count per chunk, Rice-coded
  positions, float32 values. Exact, so it needs no error compensation.
- resparsified (kind 3), a reducer's result as the Top-k of its span's mean, in the contribution's format
  (side info per tensor touched, indices, 2-bit codes): the size of one contribution whatever the number
  of peers. What it leaves out stays in the reducer's error feedback (``collective/sparse.py``).

Every length is implied by the layout or checked against it: decoding rejects truncated or
over-long payloads, out-of-range indices, and non-finite values with a PayloadError.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from p2ploco.compression.bitcodes import (
    max_unary_bits,
    pack_2bit,
    rice_decode,
    rice_encode,
    rice_parameter,
    unpack_2bit,
)
from p2ploco.compression.chunking import ChunkGrid
from p2ploco.compression.topk import CompressedTensor
from p2ploco.errors import PayloadError

MAGIC, VERSION = b"SL", 1
CONTRIBUTION, RELAY, UNION, RESPARSIFIED = 0, 1, 2, 3
_KIND_NAMES = {CONTRIBUTION: "contribution", RELAY: "relay", UNION: "union", RESPARSIFIED: "resparsified result"}
HEADER = struct.Struct("<2sBB4s")
SIDE = struct.Struct("<5f")  # shift, then the decode table
SAFE_SUM = 2.0**127  # below half of float32's largest value: a shift plus a table value this small cannot overflow
U16, U32 = struct.Struct("<H"), struct.Struct("<I")
MAX_RICE_WIDTH = 16


@dataclass(frozen=True)
class TensorSlice:
    """The chunks [first, stop) of one tensor that fall in a span."""

    tensor: int
    grid: ChunkGrid
    rice_width: int
    first: int
    stop: int
    offset: int  # element offset of chunk `first` from the span's first element

    @property
    def chunks(self) -> int:
        return self.stop - self.first

    @property
    def sends_indices(self) -> bool:
        return self.grid.k < self.grid.chunk_numel


@dataclass
class SparseValues:
    """Values at positions counted from a span's first element (chunk-major, ascending in each chunk)."""

    positions: np.ndarray  # int64
    values: np.ndarray  # float32


class SparseLayout:
    """Every tensor's chunks in one numbering (the butterfly's units); elements in chunk order."""

    def __init__(self, grids: Sequence[ChunkGrid]):
        self.grids = list(grids)
        self.rice_widths = [rice_parameter(g.chunk_numel, g.k) for g in self.grids]
        self.chunk_starts = np.cumsum([0] + [g.chunks for g in self.grids])
        self.element_starts = np.cumsum([0] + [g.numel for g in self.grids])
        self.num_chunks = int(self.chunk_starts[-1])
        sizes = np.repeat([g.chunk_numel for g in self.grids], [g.chunks for g in self.grids])
        self.chunk_element_ends = np.cumsum(sizes)  # the butterfly balances spans by elements
        self.total_numel = int(self.element_starts[-1])
        described = ";".join(f"{g.shape}/{g.tile_rows}x{g.tile_cols}/{g.k}" for g in self.grids)
        self.digest = hashlib.sha256(described.encode()).digest()[:4]
        self.density = sum(g.k * g.chunks for g in self.grids) / max(1, self.total_numel)

    def slices(self, span: range) -> list[TensorSlice]:
        out, offset = [], 0
        for t, grid in enumerate(self.grids):
            start, stop = max(span.start, int(self.chunk_starts[t])), min(span.stop, int(self.chunk_starts[t + 1]))
            if start < stop:
                first = start - int(self.chunk_starts[t])
                out.append(TensorSlice(t, grid, self.rice_widths[t], first, first + stop - start, offset))
                offset += (stop - start) * grid.chunk_numel
        return out

    def element_range(self, span: range) -> tuple[int, int]:
        """Where the span's elements sit in the flat chunk-order numbering of all tensors."""
        ends = self.chunk_element_ends
        start = int(ends[span.start - 1]) if span.start > 0 else 0
        return start, int(ends[span.stop - 1]) if span.stop > span.start else start

    def numel(self, span: range) -> int:
        start, stop = self.element_range(span)
        return stop - start

    def max_contribution_bytes(self, span: range) -> int:
        slices = self.slices(span)
        unary = sum(s.chunks * max_unary_bits(s.grid.chunk_numel, s.grid.k, s.rice_width)
                    for s in slices if s.sends_indices)
        remainder = sum(s.chunks * s.grid.k * s.rice_width for s in slices if s.sends_indices)
        values = sum(s.chunks * s.grid.k for s in slices)
        return (HEADER.size + SIDE.size * len(slices) + U32.size + (unary + 7) // 8 + (remainder + 7) // 8
                + (values + 3) // 4)

    def max_union_bytes(self, span: range) -> int:
        slices = self.slices(span)
        chunks, elements = sum(s.chunks for s in slices), self.numel(span)
        # at most 2 unary bits and MAX_RICE_WIDTH remainder bits per position, plus a float32 value
        return HEADER.size + U16.size * chunks + U32.size + (2 * elements + 7) // 8 + (
            MAX_RICE_WIDTH * elements + 7) // 8 + 4 * elements


def _header(layout: SparseLayout, kind: int) -> bytes:
    return HEADER.pack(MAGIC, VERSION, kind, layout.digest)


def read_kind(layout: SparseLayout, payload: bytes) -> int:
    if len(payload) < HEADER.size:
        raise PayloadError(f"sparse payload of {len(payload)} bytes is shorter than its header")
    magic, version, kind, digest = HEADER.unpack_from(payload)
    if magic != MAGIC or version != VERSION:
        raise PayloadError(f"not a SparseLoCo v{VERSION} payload (magic {magic!r}, version {version})")
    if digest != layout.digest:
        raise PayloadError("sparse payload is for another model or chunking (layout digest differs)")
    if kind not in (CONTRIBUTION, RELAY, UNION, RESPARSIFIED):
        raise PayloadError(f"unknown sparse payload kind {kind}")
    return kind


class _Reader:
    """Bounds-checked cursor over a payload."""

    def __init__(self, payload: bytes, offset: int):
        self.payload, self.offset = payload, offset

    def take(self, size: int, what: str) -> bytes:
        if size < 0 or self.offset + size > len(self.payload):
            raise PayloadError(f"sparse payload truncated in its {what}")
        chunk = self.payload[self.offset : self.offset + size]
        self.offset += size
        return chunk

    def finish(self) -> None:
        if self.offset != len(self.payload):
            raise PayloadError(f"sparse payload has {len(self.payload) - self.offset} unexpected trailing bytes")


def _gaps(positions: np.ndarray) -> np.ndarray:
    """Row-wise gaps of sorted positions: first position, then differences minus one."""
    previous = np.concatenate([np.full((positions.shape[0], 1), -1, dtype=np.int64), positions[:, :-1]], axis=1)
    return positions - previous - 1


def _rows(compressed: CompressedTensor, s: TensorSlice) -> CompressedTensor:
    """The chunks of ``compressed`` (a whole tensor's) that ``s`` covers."""
    return CompressedTensor(compressed.grid, compressed.indices[s.first : s.stop], compressed.codes[s.first : s.stop],
                            compressed.shift, compressed.table)


def encode_contribution(layout: SparseLayout, span: range, compressed: Sequence[CompressedTensor]) -> bytes:
    """One replica's chunks of ``span``, from its compressed tensors (whole tensors)."""
    slices = layout.slices(span)
    return _encode(layout, CONTRIBUTION, slices, [_rows(compressed[s.tensor], s) for s in slices])


def encode_resparsified(layout: SparseLayout, span: range, parts: Sequence[CompressedTensor]) -> bytes:
    """A reducer's Top-k of ``span``'s mean: ``parts`` holds the chunks of each tensor slice of the span, compressed."""
    return _encode(layout, RESPARSIFIED, layout.slices(span), parts)


def as_resparsified(contribution: bytes) -> bytes:
    """A (parsed, valid) contribution as the resparsified result that holds exactly its values, for a result layout
    that chunks and keeps as the contribution's does: the same bytes under the result's kind."""
    magic, version, _, digest = HEADER.unpack_from(contribution)
    return HEADER.pack(magic, version, RESPARSIFIED, digest) + contribution[HEADER.size :]


def _encode(layout: SparseLayout, kind: int, slices: Sequence[TensorSlice], parts: Sequence[CompressedTensor]
            ) -> bytes:
    side, gaps, widths, codes = [], [], [], []
    for s, c in zip(slices, parts, strict=True):
        side.append(SIDE.pack(float(c.shift), *map(float, c.table)))
        if s.sends_indices:
            block = _gaps(c.indices).reshape(-1)
            gaps.append(block)
            widths.append(np.full(len(block), s.rice_width, dtype=np.int64))
        codes.append(c.codes.reshape(-1))
    unary, remainders = rice_encode(np.concatenate(gaps or [np.zeros(0, np.int64)]),
                                    np.concatenate(widths or [np.zeros(0, np.int64)]))
    packed = pack_2bit(np.concatenate(codes or [np.zeros(0, np.uint8)]))
    return b"".join([_header(layout, kind), *side, U32.pack(len(unary)), unary, remainders, packed])


def _checked_side(side: np.ndarray) -> tuple[np.float32, np.ndarray]:
    """(shift, decode table) of one tensor's side info; PayloadError if a value could decode to NaN or Inf."""
    shift, table = side[0], side[1:]
    if not np.isfinite(side).all():
        raise PayloadError("sparse payload holds NaN or Inf side info")
    # a value decodes to table[code] + shift: float32, as on the sender. Where no sum can come near float32's
    # largest value it cannot overflow, and numpy's error state (costly to enter for a table of 4) is left alone
    if abs(float(shift)) + max(map(abs, table.tolist()), default=0.0) >= SAFE_SUM:
        with np.errstate(over="ignore", invalid="ignore"):  # overflow is caught just below
            decoded_table = table + shift
        if not np.isfinite(decoded_table).all():
            raise PayloadError("sparse payload holds NaN or Inf side info")
    return shift, table


def _span_values(s: TensorSlice, side: np.ndarray, local: np.ndarray, codes: np.ndarray,
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Positions from the span's first element, and float32 values, of one tensor's chunks in a span."""
    shift, table = _checked_side(side)
    positions = (s.offset + np.arange(s.chunks)[:, None] * s.grid.chunk_numel + local).reshape(-1)
    return positions, table[codes] + shift


def decode_contribution(layout: SparseLayout, span: range, payload: bytes) -> SparseValues:
    return _decode(layout, span, payload, CONTRIBUTION)


def decode_resparsified(layout: SparseLayout, span: range, payload: bytes) -> SparseValues:
    return _decode(layout, span, payload, RESPARSIFIED)


def _decode(layout: SparseLayout, span: range, payload: bytes, kind: int) -> SparseValues:
    if read_kind(layout, payload) != kind:
        raise PayloadError(f"expected a {_KIND_NAMES[kind]} payload")
    slices = layout.slices(span)
    reader = _Reader(payload, HEADER.size)
    sides = [np.array(SIDE.unpack(reader.take(SIDE.size, "side info")), dtype=np.float32) for _ in slices]
    indexed = [s for s in slices if s.sends_indices]
    widths = np.concatenate([np.full(s.chunks * s.grid.k, s.rice_width, np.int64) for s in indexed] or
                            [np.zeros(0, np.int64)])
    (unary_len,) = U32.unpack(reader.take(U32.size, "index length"))
    unary = reader.take(unary_len, "index stream")
    remainders = reader.take((int(widths.sum()) + 7) // 8, "index remainders")
    count = sum(s.chunks * s.grid.k for s in slices)
    codes = unpack_2bit(reader.take((count + 3) // 4, "values"), count)
    reader.finish()
    gaps = rice_decode(unary, remainders, widths)

    positions, values, gap_at, code_at = [], [], 0, 0
    for s, side in zip(slices, sides):
        n, k = s.grid.chunk_numel, s.grid.k
        if s.sends_indices:
            local = np.cumsum(gaps[gap_at : gap_at + s.chunks * k].reshape(s.chunks, k) + 1, axis=1) - 1
            gap_at += s.chunks * k
            if s.chunks and local[:, -1].max() >= n:
                raise PayloadError(f"sparse payload has an index beyond its chunk of {n}")
        else:
            local = np.arange(n)
        where, what = _span_values(s, side, local, codes[code_at : code_at + s.chunks * k])
        code_at += s.chunks * k
        positions.append(where)
        values.append(what)
    return _joined(positions, values)


def contribution_values(layout: SparseLayout, span: range, compressed: Sequence[CompressedTensor]) -> SparseValues:
    """What ``decode_contribution`` returns for the contribution ``encode_contribution`` makes of ``compressed``,
    read from the compressed tensors instead of decoded from the bytes: the same positions, the same float32
    values, the same side-info check. A replica takes its own contribution this way."""
    slices = layout.slices(span)
    return _values(slices, [_rows(compressed[s.tensor], s) for s in slices])


def resparsified_values(layout: SparseLayout, span: range, parts: Sequence[CompressedTensor]) -> SparseValues:
    """What ``decode_resparsified`` returns for ``encode_resparsified(layout, span, parts)``: how a reducer takes
    its own result."""
    return _values(layout.slices(span), parts)


def _values(slices: Sequence[TensorSlice], parts: Sequence[CompressedTensor]) -> SparseValues:
    positions, values = [], []
    for s, c in zip(slices, parts, strict=True):
        side = np.array([c.shift, *c.table], dtype=np.float32)
        where, what = _span_values(s, side, c.indices, c.codes.reshape(-1))
        positions.append(where)
        values.append(what)
    return _joined(positions, values)


def _joined(positions: list[np.ndarray], values: list[np.ndarray]) -> SparseValues:
    return SparseValues(np.concatenate(positions or [np.zeros(0, np.int64)]).astype(np.int64, copy=False),
                        np.concatenate(values or [np.zeros(0, np.float32)]).astype(np.float32, copy=False))


AGGREGATE_BLOCK = 1 << 20  # coordinates combined at once: the running sums and counts stay in the cache


def aggregate(numel: int, contributions: Sequence[SparseValues], mode: str) -> SparseValues:
    """Per-coordinate mean over the contributions that selected it ("mean", the reference), or the sum
    divided by all contributions ("sum"); summed in float32 from 0.0 in the given order, so every peer gets
    the same bits. Dense sums and counts over one block of coordinates at a time (reset where touched); the
    selected coordinates are the ones each contribution is the first to touch, sorted."""
    block = min(numel, AGGREGATE_BLOCK)
    total = np.zeros(block, dtype=np.float32)
    count = np.zeros(block, dtype=np.uint16 if len(contributions) < 1 << 16 else np.uint32)
    edges = np.arange(0, numel + block, block) if numel else np.zeros(1, np.int64)
    bounds = [np.searchsorted(c.positions, edges) for c in contributions]
    positions, values = [], []
    for b, start in enumerate(edges[:-1]):
        firsts = []
        for i, (c, (lo, hi)) in enumerate(zip(contributions, (bound[b : b + 2] for bound in bounds))):
            local = c.positions[lo:hi] - start  # unique within one contribution
            firsts.append(local if i == 0 else local[count[local] == 0])
            total[local] += c.values[lo:hi]
            count[local] += 1
        selected = np.concatenate(firsts or [np.zeros(0, np.int64)])
        selected.sort()
        divisor = count[selected].astype(np.float32) if mode == "mean" else np.float32(len(contributions))
        values.append(total[selected] / divisor)
        positions.append(selected + start)
        total[selected] = 0.0
        count[selected] = 0
    return _joined(positions, values)


def encode_relay(layout: SparseLayout, payloads: Sequence[bytes]) -> bytes:
    lengths = b"".join(U32.pack(len(p)) for p in payloads)
    return b"".join([_header(layout, RELAY), U16.pack(len(payloads)), lengths, *payloads])


def decode_relay(layout: SparseLayout, result: bytes, max_payload: int) -> list[bytes]:
    if read_kind(layout, result) != RELAY:
        raise PayloadError("expected a relay result")
    reader = _Reader(result, HEADER.size)
    (count,) = U16.unpack(reader.take(U16.size, "relay count"))
    lengths = [U32.unpack(reader.take(U32.size, "relay lengths"))[0] for _ in range(count)]
    if any(length > max_payload for length in lengths):
        raise PayloadError("relayed contribution longer than any valid one")
    payloads = [reader.take(length, "relayed contribution") for length in lengths]
    reader.finish()
    return payloads


@functools.cache
def _rice_width_table(n: int) -> np.ndarray:
    return np.array([rice_parameter(n, count) for count in range(n + 1)], dtype=np.int64)


def _rice_widths(n: int, counts: np.ndarray) -> np.ndarray:
    """The remainder width of each chunk of ``n`` positions holding ``counts`` of them (each at most n)."""
    return _rice_width_table(n)[counts]


def union_bytes_at_least(layout: SparseLayout, span: range, count: int) -> int:
    """A lower bound on the size of a union result of ``count`` positions, known without encoding it: its
    header and chunk counts, one unary bit and a float32 value per position."""
    chunks = sum(s.chunks for s in layout.slices(span))
    return HEADER.size + U16.size * chunks + U32.size + (count + 7) // 8 + 4 * count


def encode_union(layout: SparseLayout, span: range, union: SparseValues) -> bytes:
    counts, gaps, widths = [], [], []
    for s in layout.slices(span):
        n = s.grid.chunk_numel
        lo, hi = np.searchsorted(union.positions, [s.offset, s.offset + s.chunks * n])
        local = union.positions[lo:hi] - s.offset
        chunk, inner = local // n, local % n
        per_chunk = np.bincount(chunk, minlength=s.chunks)
        first = np.ones(len(inner), dtype=bool)
        first[1:] = chunk[1:] != chunk[:-1]
        previous = np.where(first, -1, np.concatenate([[-1], inner[:-1]]))
        counts.append(per_chunk)
        gaps.append(inner - previous - 1)
        widths.append(_rice_widths(n, per_chunk)[chunk])
    none = [np.zeros(0, np.int64)]  # an empty span (a group larger than the units makes some) touches no tensor
    unary, remainders = rice_encode(np.concatenate(gaps or none), np.concatenate(widths or none))
    count_bytes = np.concatenate(counts or none).astype("<u2").tobytes()
    return b"".join([_header(layout, UNION), count_bytes, U32.pack(len(unary)), unary, remainders,
                     union.values.astype("<f4").tobytes()])


def decode_union(layout: SparseLayout, span: range, result: bytes) -> SparseValues:
    if read_kind(layout, result) != UNION:
        raise PayloadError("expected a union result")
    slices = layout.slices(span)
    reader = _Reader(result, HEADER.size)
    chunks = sum(s.chunks for s in slices)
    counts = np.frombuffer(reader.take(U16.size * chunks, "union counts"), dtype="<u2").astype(np.int64)
    widths, bases, limits, at = [], [], [], 0
    for s in slices:
        n = s.grid.chunk_numel
        per_chunk = counts[at : at + s.chunks]
        at += s.chunks
        if (per_chunk > n).any():
            raise PayloadError(f"union chunk claims more than its {n} positions")
        widths.append(np.repeat(_rice_widths(n, per_chunk), per_chunk))
        bases.append(np.repeat(s.offset + np.arange(s.chunks) * n, per_chunk))
        limits.append(np.repeat(np.full(s.chunks, n), per_chunk))
    widths_all = np.concatenate(widths or [np.zeros(0, np.int64)])
    (unary_len,) = U32.unpack(reader.take(U32.size, "index length"))
    unary = reader.take(unary_len, "index stream")
    remainders = reader.take((int(widths_all.sum()) + 7) // 8, "index remainders")
    total = int(counts.sum())
    values = np.frombuffer(reader.take(4 * total, "values"), dtype="<f4").astype(np.float32)
    reader.finish()
    if not np.isfinite(values).all():
        raise PayloadError("union result holds NaN or Inf values")
    gaps = rice_decode(unary, remainders, widths_all)
    # positions restart in every chunk: a running sum of (gap + 1), minus its value at the chunk's start
    steps = np.cumsum(gaps + 1)
    chunk_of = np.repeat(np.arange(len(counts)), counts)
    chunk_start = np.concatenate([[0], np.cumsum(counts)[:-1]])
    before = np.concatenate([[0], steps])[chunk_start[chunk_of]] if total else np.zeros(0, np.int64)
    inner = steps - before - 1
    if total and (inner >= np.concatenate(limits)).any():
        raise PayloadError("union result has an index beyond its chunk")
    return SparseValues(np.concatenate(bases or [np.zeros(0, np.int64)]) + inner, values)
