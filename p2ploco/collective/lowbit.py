"""LoCo's all-reduce: block-wise low-bit values up, an error-compensated low-bit mean back down.

Units are whole quantization blocks (``compression/blockwise.py``), so a span's payload carries each of
its blocks' scale with the block's codes. Each sender uploads its own compensated, quantized
pseudo-gradient. The reducer of a span decodes every contribution, bounds it (``collective/blocked.py``),
sums them in float32 in the group's order and divides by their number, then **re-quantizes** that
mean with its own compensation buffer for the span (LoCo at the second hop), and sends every member,
itself included, the same result bytes. Every peer decodes the same bytes into the same float32
aggregate, so all end bit-identical, and downloads stay low-bit: with an exact fp32 result the
download would be 8x the upload at 4 bits, with a relay of the contributions it would grow with n.

The reducer's new buffer for its span is only staged here (``reduced``): the outer algorithm keeps it
if the round commits. Each attempt of a round (a redo runs the butterfly again among fewer peers)
makes a member the reducer of exactly one span of each slice it holds, so the staged update of the
latest ``combine`` is that of the attempt whose outcome ``AllReduceResult.committed`` reports.

Wire format of a contribution or result for a span of blocks, little-endian::

    +------+---------+------+------+-------------+-------------+--------------------+--------------------+
    | "LQ" | version | kind | bits | first block | block count | scales             | codes              |
    | 2 B  | u8 (1)  | u8   | u8   | u32         | u32         | count x f32        | one per value      |
    +------+---------+------+------+-------------+-------------+--------------------+--------------------+

kind 1 is a sender's contribution, 2 a reducer's result. A scale is 0 or a normal float32 >= 2^-126, finite,
with a 16-bit significand (its low 8 bits are zero). A code c in [-q, q] is stored as c + q in ``bits`` bits, packed
first code in the high bits, the last byte padded with zero bits. Everything is checked on parse.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from p2ploco.collective import robust
from p2ploco.collective.blocked import CONTRIBUTION, RESULT, BlockedMean, Parsed
from p2ploco.collective.exchange import Span
from p2ploco.compression.blockwise import SCALE_SPARE_BITS, BlockLayout, Quantized, compensate, max_code
from p2ploco.errors import PayloadError

MAGIC = b"LQ"
VERSION = 1
HEADER = struct.Struct("<2sBBBII")
FLOAT32_INF = 0x7F800000  # bits of +inf: a non-negative finite float32 lies below it
FLOAT32_TINY = 0x00800000  # bits of 2^-126, the smallest normal float32


@dataclass
class ReducerUpdate:
    """The reducer's compensation buffer for the span it reduced, as it will be if the round commits."""

    elements: range  # of the slice's concatenated values
    error: torch.Tensor


class LowBitMean(BlockedMean):
    def __init__(self, layout: BlockLayout, bits: int, sent: Quantized, reducer_error: torch.Tensor, beta: float,
                 policy: robust.Policy = robust.UNBOUNDED):
        """``sent``: this replica's quantized contribution over the whole slice; ``reducer_error``: its
        compensation buffer for the slice as a reducer (read, never written here); ``policy``: how reducers bound
        contributions (``collective/robust.py``)."""
        super().__init__(layout, policy)
        self.bits, self.sent, self.beta, self.reducer_error = bits, sent, beta, reducer_error
        self.q = max_code(bits)
        self.reduced: ReducerUpdate | None = None

    def fingerprint(self) -> str:
        return f"lowbit/{self.bits}/{self.layout.digest}/{self.policy.fingerprint()}/receipts"

    def max_payload_bytes(self, span: Span) -> int:
        return HEADER.size + 4 * len(span) + (self.numel(span) * self.bits + 7) // 8

    def limit(self, factors: Sequence[float], norms: Sequence[float]) -> float:
        """A mean's bound, lengthened by what quantizing it may add: a value moves by at most half its block's scale
        (at most its largest magnitude over q, rounded up to 16 significant bits), so a block of L values by at most
        sqrt(L) / (2q) of its norm."""
        spread = math.sqrt(self.layout.group_size) / (2 * self.q) * (1 + 2**-14)
        return robust.mean_limit(factors, norms) * (1 + spread)

    def encode(self, span: Span) -> bytes:
        elements = self.layout.element_range(span)
        return self._encode(CONTRIBUTION, span, self.sent.codes[elements.start : elements.stop],
                            self.sent.scales[span.start : span.stop])

    def combine(self, span: Span, contributions: Sequence[Parsed], factors: Sequence[float]) -> bytes:
        mean = self.bounded_mean(contributions, factors)
        # LoCo at the reducer: its own buffer for this span compensates the re-quantization of the mean (and keeps
        # what the bound on the result leaves out, as it keeps what quantization drops).
        elements = self.layout.element_range(span)
        buffer = self.reducer_error[elements.start : elements.stop]
        lengths = self.layout.lengths[span.start : span.stop]

        def quantize(scale: float) -> tuple[np.ndarray, tuple[Quantized, torch.Tensor]]:
            quantized, error = compensate(mean, buffer, self.beta, lengths, self.bits, scale)
            return quantized.decode().numpy(), (quantized, error)

        quantized, error = robust.within(self.limit(factors, [c.norm for c in contributions]), quantize)
        self.reduced = ReducerUpdate(elements, error)
        self.combined[span] = self._encode(RESULT, span, quantized.codes, quantized.scales)
        return self.combined[span]

    def _encode(self, kind: int, span: Span, codes: torch.Tensor, scales: torch.Tensor) -> bytes:
        header = HEADER.pack(MAGIC, VERSION, kind, self.bits, span.start, len(span))
        return header + scales.numpy().astype("<f4").tobytes() + pack_codes(codes.numpy(), self.bits, self.q)

    def decode(self, kind: int, span: Span, payload: bytes) -> np.ndarray:
        expected = self.max_payload_bytes(span)
        if len(payload) != expected:
            raise PayloadError(f"low-bit payload of {len(payload)} bytes, expected {expected} for groups "
                               f"{span.start}:{span.stop}")
        magic, version, got_kind, bits, first, count = HEADER.unpack_from(payload)
        if (magic, version, got_kind, bits, first, count) != (MAGIC, VERSION, kind, self.bits, span.start, len(span)):
            raise PayloadError(f"low-bit payload header {(magic, version, got_kind, bits, first, count)} does not "
                               f"match {(MAGIC, VERSION, kind, self.bits, span.start, len(span))} "
                               f"(magic, version, kind, bits, first group, group count)")
        scale_bits = np.frombuffer(payload, dtype="<i4", count=count, offset=HEADER.size)
        if (scale_bits < 0).any() or (scale_bits >= FLOAT32_INF).any():
            raise PayloadError("low-bit payload has a negative, infinite or NaN scale")
        if ((scale_bits > 0) & (scale_bits < FLOAT32_TINY)).any():
            raise PayloadError("low-bit payload has a subnormal scale")
        if (scale_bits & ((1 << SCALE_SPARE_BITS) - 1)).any():
            raise PayloadError("low-bit payload has a scale with more than 16 significant bits")
        numel = self.numel(span)
        codes = unpack_codes(payload[HEADER.size + 4 * count :], numel, self.bits, self.q)
        scales = torch.from_numpy(scale_bits.view(np.float32).astype(np.float32))
        return Quantized(torch.from_numpy(codes), scales, self.layout.lengths[span.start : span.stop]).decode().numpy()


def pack_codes(codes: np.ndarray, bits: int, q: int) -> bytes:
    """Codes in [-q, q] stored as code + q in ``bits`` bits each, first code in the high bits of a byte."""
    per_byte = 8 // bits
    stored = np.zeros(-(-len(codes) // per_byte) * per_byte, dtype=np.uint8)
    stored[: len(codes)] = codes.astype(np.int16) + q
    lanes = stored.reshape(-1, per_byte)
    packed = np.zeros(len(lanes), dtype=np.uint8)
    for lane in range(per_byte):
        packed |= lanes[:, lane] << (8 - bits * (lane + 1))
    return packed.tobytes()


def unpack_codes(data: bytes, count: int, bits: int, q: int) -> np.ndarray:
    """The int8 codes of ``pack_codes``; PayloadError on a stored value above 2q or non-zero padding."""
    per_byte = 8 // bits
    if len(data) != -(-count // per_byte):
        raise PayloadError(f"low-bit code stream of {len(data)} bytes, expected {-(-count // per_byte)}")
    packed = np.frombuffer(data, dtype=np.uint8)
    mask = (1 << bits) - 1
    stored = np.stack([packed >> (8 - bits * (lane + 1)) & mask for lane in range(per_byte)], axis=1).reshape(-1)
    if stored[count:].any():
        raise PayloadError("low-bit code stream has non-zero padding")
    stored = stored[:count]
    if (stored > 2 * q).any():
        raise PayloadError(f"low-bit code stream holds a code above {2 * q} (codes are value + {q}, at most {2 * q})")
    return (stored.astype(np.int16) - q).astype(np.int8)
