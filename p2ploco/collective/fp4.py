"""Streaming DiLoCo's all-reduce: E3M0 4-bit float values up, an fp32-accumulated mean back in E3M0.

Units are whole groups of ``compression/groupwise.py``'s layout, so a span's payload carries each group's
scale with its values (``compression/e3m0.py``). Each sender uploads its pseudo-gradient in E3M0. The
reducer of a span decodes every contribution, bounds it (``collective/robust.py``), sums them in float32
in the group's order and divides by their number, then quantizes that mean to E3M0 again and sends every
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

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from p2ploco.collective import robust
from p2ploco.collective.exchange import Exchange, Span
from p2ploco.compression import e3m0
from p2ploco.compression.groupwise import GroupLayout
from p2ploco.errors import PayloadError

MAGIC = b"F4"
VERSION = 1
CONTRIBUTION, RESULT = 1, 2
HEADER = struct.Struct("<2sBBII")
GROUP_SIZE = 128  # values per float32 scale: 0.25 extra bits per value
FLOAT32_INF = 0x7F800000  # bits of +inf: a non-negative finite float32 lies below it
MIN_SCALE_BITS = int(np.array(e3m0.MIN_SCALE, dtype=np.float32).view(np.int32))


@dataclass
class _Parsed:
    values: np.ndarray  # float32, decoded
    norm: float  # of the values: what clipping compares


class E3M0Mean(Exchange):
    def __init__(self, tensors: Sequence[torch.Tensor], clip_factor: float = 0.0):
        """``tensors``: this replica's pseudo-gradient of the slice (float32, CPU); ``clip_factor``: bound on each
        contribution's norm, in multiples of the span's median (0: no clipping)."""
        self.layout = GroupLayout([t.shape for t in tensors], GROUP_SIZE)
        self.clip_factor = clip_factor
        flat = torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.zeros(0)
        self.nibbles, self.scales = e3m0.quantize(flat, self.layout.lengths)
        self.num_units = self.layout.num_groups
        self.output = torch.full((self.layout.numel,), float("nan"))  # NaN marks spans not yet received

    def fingerprint(self) -> str:
        return f"e3m0/{self.layout.digest}/clip{self.clip_factor:g}"

    def unit_at(self, element: int) -> int:
        return self.layout.group_of(element)

    def numel(self, span: Span) -> int:
        return len(self.layout.element_range(span))

    def max_payload_bytes(self, span: Span) -> int:
        return HEADER.size + 4 * len(span) + (self.numel(span) + 1) // 2

    def max_result_bytes(self, span: Span, group_size: int) -> int:
        return self.max_payload_bytes(span)

    def encode(self, span: Span) -> bytes:
        elements = self.layout.element_range(span)
        return self._encode(CONTRIBUTION, span, self.nibbles[elements.start : elements.stop],
                            self.scales[span.start : span.stop])

    def parse(self, span: Span, payload: bytes) -> _Parsed:
        values = self._decode(CONTRIBUTION, span, payload)
        return _Parsed(values, robust.norm(values))

    def combine(self, span: Span, contributions: Sequence[_Parsed]) -> bytes:
        bounded = robust.clip([c.values for c in contributions], [c.norm for c in contributions], self.clip_factor)
        total = torch.from_numpy(bounded[0]).clone()
        for values in bounded[1:]:
            total.add_(torch.from_numpy(values))
        mean = total.div_(len(contributions))
        nibbles, scales = e3m0.quantize(mean, self.layout.lengths[span.start : span.stop])
        return self._encode(RESULT, span, nibbles, scales)

    def clipped(self, contributions: Sequence[_Parsed]) -> list[int]:
        return robust.clipped([c.norm for c in contributions], self.clip_factor)

    def result_for(self, aggregate: bytes, omit: int | None) -> bytes:
        return aggregate  # every recipient gets the same quantized mean

    def receive(self, span: Span, result: bytes, own: int | None) -> None:
        values = self._decode(RESULT, span, result)
        robust.norm(values)  # a mean of bounded contributions is bounded too: refuse an absurd one
        elements = self.layout.element_range(span)
        self.output[elements.start : elements.stop] = torch.from_numpy(values)

    def aggregate_digest(self) -> str:
        return hashlib.sha256(self.output.numpy().tobytes()).hexdigest()

    def mean(self) -> list[torch.Tensor]:
        """The aggregate, shaped like the input tensors (float32, CPU)."""
        if torch.isnan(self.output).any():
            raise RuntimeError("all-reduce finished with spans missing")  # a communicator bug, not bad input
        return self.layout.split(self.output)

    def _encode(self, kind: int, span: Span, nibbles: np.ndarray, scales: torch.Tensor) -> bytes:
        header = HEADER.pack(MAGIC, VERSION, kind, span.start, len(span))
        return header + scales.numpy().astype("<f4").tobytes() + e3m0.pack(nibbles)

    def _decode(self, kind: int, span: Span, payload: bytes) -> np.ndarray:
        """The float32 values of a payload for ``span``; PayloadError if anything about it is off."""
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
