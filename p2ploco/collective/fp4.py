"""Streaming DiLoCo's all-reduce: E3M0 4-bit float values up, an fp32-accumulated mean back in E3M0.

Units are whole blocks of ``compression/blockwise.py``'s layout, so a span's payload carries each block's
scale with its values (``compression/e3m0.py``). Each sender uploads its pseudo-gradient in E3M0. The
reducer of a span decodes every contribution, bounds it, sums them in float32 in the group's order and
divides by their number (``collective/blocked.py``), then quantizes that mean to E3M0 again and sends every
member, itself included, the same result bytes: everybody decodes the same bytes into the same float32
aggregate and ends bit-identical, and downloads stay 4-bit.

Wire format of a contribution or result for a span of blocks, little-endian::

    +------+---------+------+-------------+-------------+----------------+----------------------------+
    | "F4" | version | kind | first block | block count | scales         | values                     |
    | 2 B  | u8 (1)  | u8   | u32         | u32         | count x f32    | one E3M0 nibble per value, |
    |      |         |      |             |             |                | two a byte, high one first |
    +------+---------+------+-------------+-------------+----------------+----------------------------+

kind 1 is a sender's contribution, 2 a reducer's result. A scale is 0 or a finite float32 >= 2^-120. A block
whose scale is 0 holds only zero nibbles; any other holds at least one nibble of exponent 7 (its largest
value is its scale). The nibble 0b1000 (-0) is refused, and so is non-zero padding. Everything is checked
on parse, and the payload must have exactly the length its span implies.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np
import torch

from p2ploco.collective import robust
from p2ploco.collective.blocked import CONTRIBUTION, RESULT, BlockedMean, Parsed
from p2ploco.collective.exchange import Span
from p2ploco.compression import e3m0
from p2ploco.compression.blockwise import BlockLayout
from p2ploco.errors import PayloadError

MAGIC = b"F4"
VERSION = 1
HEADER = struct.Struct("<2sBBII")
BLOCK_SIZE = 128  # values per float32 scale: 0.25 extra bits per value
E3M0_LENGTHENING = 4 / 3 * (1 + 2**-20)  # the most E3M0 lengthens a vector (float32 rounding of its scale aside)
FLOAT32_INF = 0x7F800000  # bits of +inf: a non-negative finite float32 lies below it
MIN_SCALE_BITS = int(np.array(e3m0.MIN_SCALE, dtype=np.float32).view(np.int32))


class E3M0Mean(BlockedMean):
    def __init__(self, tensors: Sequence[torch.Tensor], policy: robust.Policy = robust.UNBOUNDED):
        """``tensors``: this replica's pseudo-gradient of the slice (float32, CPU); ``policy``: how reducers bound
        contributions (``collective/robust.py``)."""
        super().__init__(BlockLayout([t.shape for t in tensors], BLOCK_SIZE), policy)
        flat = torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.zeros(0)
        self.nibbles, self.scales = e3m0.quantize(flat, self.layout.lengths)

    def fingerprint(self) -> str:
        return f"e3m0/{self.layout.digest}/{self.policy.fingerprint()}/receipts"

    def max_payload_bytes(self, span: Span) -> int:
        return HEADER.size + 4 * len(span) + (self.numel(span) + 1) // 2

    def limit(self, factors: Sequence[float], norms: Sequence[float]) -> float:
        """A mean's bound, lengthened by what E3M0 may add: a value rounds to the nearer power of two of its block's
        scale, at most 4/3 of itself (0.75 x 2^e rounds up to 2^e)."""
        return robust.mean_limit(factors, norms) * E3M0_LENGTHENING

    def encode(self, span: Span) -> bytes:
        elements = self.layout.element_range(span)
        return self._encode(CONTRIBUTION, span, self.nibbles[elements.start : elements.stop],
                            self.scales[span.start : span.stop])

    def combine(self, span: Span, contributions: Sequence[Parsed], factors: Sequence[float]) -> bytes:
        mean = self.bounded_mean(contributions, factors)
        lengths = self.layout.lengths[span.start : span.stop]

        def quantize(scale: float) -> tuple[np.ndarray, tuple[np.ndarray, torch.Tensor]]:
            nibbles, block_scales = e3m0.quantize(mean if scale == 1.0 else mean * scale, lengths)
            return e3m0.decode(nibbles, block_scales, lengths).numpy(), (nibbles, block_scales)

        nibbles, block_scales = robust.within(self.limit(factors, [c.norm for c in contributions]), quantize)
        self.combined[span] = self._encode(RESULT, span, nibbles, block_scales)
        return self.combined[span]

    def _encode(self, kind: int, span: Span, nibbles: np.ndarray, scales: torch.Tensor) -> bytes:
        header = HEADER.pack(MAGIC, VERSION, kind, span.start, len(span))
        return header + scales.numpy().astype("<f4").tobytes() + e3m0.pack(nibbles)

    def decode(self, kind: int, span: Span, payload: bytes) -> np.ndarray:
        expected = self.max_payload_bytes(span)
        if len(payload) != expected:
            raise PayloadError(f"E3M0 payload of {len(payload)} bytes, expected {expected} for groups "
                               f"{span.start}:{span.stop}")
        header = HEADER.unpack_from(payload)
        if header != (MAGIC, VERSION, kind, span.start, len(span)):
            raise PayloadError(f"E3M0 payload header {header} does not match "
                               f"{(MAGIC, VERSION, kind, span.start, len(span))} "
                               f"(magic, version, kind, first group, group count)")
        count = len(span)
        scale_bits = np.frombuffer(payload, dtype="<i4", count=count, offset=HEADER.size)
        if (scale_bits < 0).any() or (scale_bits >= FLOAT32_INF).any():
            raise PayloadError("E3M0 payload has a negative, infinite or NaN scale")
        if ((scale_bits > 0) & (scale_bits < MIN_SCALE_BITS)).any():
            raise PayloadError("E3M0 payload has a non-zero scale below 2^-120")
        lengths = self.layout.lengths[span.start : span.stop]
        try:
            nibbles = e3m0.unpack(payload[HEADER.size + 4 * count :], self.numel(span))
        except ValueError as e:
            raise PayloadError(f"E3M0 payload: {e}") from None
        if len(nibbles):
            starts = (torch.cumsum(lengths, 0) - lengths).numpy()
            top = np.maximum.reduceat(nibbles & 0b111, starts)  # the largest exponent of each block
            if ((scale_bits == 0) != (top == 0)).any() or ((scale_bits > 0) & (top != e3m0.EXPONENT_BIAS)).any():
                raise PayloadError("E3M0 payload has a group whose values do not fit its scale (a zero scale needs "
                                   "zero values, any other a value of exponent 7)")
        scales = torch.from_numpy(scale_bits.view(np.float32).astype(np.float32))
        return e3m0.decode(nibbles, scales, lengths).numpy()
