"""Streaming DiLoCo's all-reduce: E3M0 4-bit float values up, an fp32-accumulated mean back in E3M0.

Units are whole groups of ``compression/groupwise.py``'s layout, so a span's payload carries each group's
scale with its values (``compression/e3m0.py``). Each sender uploads its pseudo-gradient in E3M0. The
reducer of a span decodes every contribution, bounds it, sums them in float32 in the group's order and
divides by their number (``collective/grouped.py``), then quantizes that mean to E3M0 again and sends every
member, itself included, the same result bytes: everybody decodes the same bytes into the same float32
aggregate and ends bit-identical, and downloads stay 4-bit.

Wire format of a contribution or result for a span of groups, little-endian::

    +------+---------+------+-------------+-------------+----------------+----------------------------+
    | "F4" | version | kind | first group | group count | scales         | values                     |
    | 2 B  | u8 (1)  | u8   | u32         | u32         | count x f32    | one E3M0 nibble per value, |
    |      |         |      |             |             |                | two a byte, high one first |
    +------+---------+------+-------------+-------------+----------------+----------------------------+

kind 1 is a sender's contribution, 2 a reducer's result. A scale is 0 or a finite float32 >= 2^-120. A group
whose scale is 0 holds only zero nibbles; any other holds at least one nibble of exponent 7 (its largest
value is its scale). The nibble 0b1000 (-0) is refused, and so is non-zero padding. Everything is checked
on parse, and the payload must have exactly the length its span implies.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np
import torch

from p2ploco.collective.exchange import Span
from p2ploco.collective.grouped import CONTRIBUTION, RESULT, GroupedMean, Parsed
from p2ploco.compression import e3m0
from p2ploco.compression.groupwise import GroupLayout
from p2ploco.errors import PayloadError

MAGIC = b"F4"
VERSION = 1
HEADER = struct.Struct("<2sBBII")
GROUP_SIZE = 128  # values per float32 scale: 0.25 extra bits per value
FLOAT32_INF = 0x7F800000  # bits of +inf: a non-negative finite float32 lies below it
MIN_SCALE_BITS = int(np.array(e3m0.MIN_SCALE, dtype=np.float32).view(np.int32))


class E3M0Mean(GroupedMean):
    def __init__(self, tensors: Sequence[torch.Tensor], clip_factor: float = 0.0):
        """``tensors``: this replica's pseudo-gradient of the slice (float32, CPU); ``clip_factor``: bound on each
        contribution's norm, in multiples of the span's median (0: no clipping)."""
        super().__init__(GroupLayout([t.shape for t in tensors], GROUP_SIZE), clip_factor)
        flat = torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.zeros(0)
        self.nibbles, self.scales = e3m0.quantize(flat, self.layout.lengths)

    def fingerprint(self) -> str:
        return f"e3m0/{self.layout.digest}/clip{self.clip_factor:g}"

    def max_payload_bytes(self, span: Span) -> int:
        return HEADER.size + 4 * len(span) + (self.numel(span) + 1) // 2

    def encode(self, span: Span) -> bytes:
        elements = self.layout.element_range(span)
        return self._encode(CONTRIBUTION, span, self.nibbles[elements.start : elements.stop],
                            self.scales[span.start : span.stop])

    def combine(self, span: Span, contributions: Sequence[Parsed], scales: Sequence[float] | None = None) -> bytes:
        nibbles, group_scales = e3m0.quantize(self.bounded_mean(contributions, scales),
                                              self.layout.lengths[span.start : span.stop])
        return self._encode(RESULT, span, nibbles, group_scales)

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
            top = np.maximum.reduceat(nibbles & 0b111, starts)  # the largest exponent of each group
            if ((scale_bits == 0) != (top == 0)).any() or ((scale_bits > 0) & (top != e3m0.EXPONENT_BIAS)).any():
                raise PayloadError("E3M0 payload has a group whose values do not fit its scale (a zero scale needs "
                                   "zero values, any other a value of exponent 7)")
        scales = torch.from_numpy(scale_bits.view(np.float32).astype(np.float32))
        return e3m0.decode(nibbles, scales, lengths).numpy()
