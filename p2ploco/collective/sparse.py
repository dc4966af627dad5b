"""Sparse all-reduce of SparseLoCo contributions.

Units are whole chunks, so a reducer owns every value of the chunks in its span. It checks each
sender's contribution and answers each recipient with whichever result encoding is smaller: the
included contributions relayed (without the recipient's own, which it re-inserts) or their union
with the aggregated float32 values. Both are exact and both end in the same bits: the aggregate is
computed by the same function, over the same contributions, in the same order. Before they are
combined, contributions above ``clip_factor`` times the span's median norm are scaled down to it
(``collective/robust.py``); a recipient of a relayed result clips them exactly as the reducer did.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from p2ploco.collective import robust
from p2ploco.collective.exchange import Exchange, Span
from p2ploco.compression import sparse_format as fmt
from p2ploco.compression.sparse_format import SparseLayout, SparseValues
from p2ploco.compression.topk import CompressedTensor


@dataclass
class _Parsed:
    payload: bytes
    values: SparseValues
    norm: float  # of the values: what clipping compares


@dataclass
class _Aggregate:
    payloads: list[bytes]  # the included contributions, canonical order
    union: bytes  # the aggregate itself, union-encoded


class SparseExchange(Exchange):
    def __init__(self, layout: SparseLayout, compressed: Sequence[CompressedTensor], mode: str,
                 clip_factor: float = 0.0):
        """``clip_factor``: bound on each contribution's norm, in multiples of the span's median (0: no clipping)."""
        self.layout, self.compressed, self.mode, self.clip_factor = layout, list(compressed), mode, clip_factor
        self.num_units = layout.num_chunks
        self.output = np.full(layout.total_numel, np.nan, dtype=np.float32)  # NaN: span not received yet
        self._encoded: dict[Span, bytes] = {}

    def unit_at(self, element: int) -> int:
        return int(np.searchsorted(self.layout.chunk_element_ends, element, side="right"))

    def fingerprint(self) -> str:
        return f"sparse/{self.layout.digest.hex()}/{self.mode}/clip{self.clip_factor:g}"

    def numel(self, span: Span) -> int:
        return self.layout.numel(span)

    def max_payload_bytes(self, span: Span) -> int:
        return self.layout.max_contribution_bytes(span)

    def max_result_bytes(self, span: Span, group_size: int) -> int:
        relay = fmt.HEADER.size + fmt.U16.size + (group_size - 1) * (fmt.U32.size + self.max_payload_bytes(span))
        return max(relay, self.layout.max_union_bytes(span))

    def encode(self, span: Span) -> bytes:
        if span not in self._encoded:
            self._encoded[span] = fmt.encode_contribution(self.layout, span, self.compressed)
        return self._encoded[span]

    def parse(self, span: Span, payload: bytes) -> _Parsed:
        values = fmt.decode_contribution(self.layout, span, payload)
        return _Parsed(payload, values, robust.norm(values.values))

    def combine(self, span: Span, contributions: Sequence[_Parsed]) -> _Aggregate:
        union = self._aggregate(span, [c.values for c in contributions], [c.norm for c in contributions])
        return _Aggregate([c.payload for c in contributions], fmt.encode_union(self.layout, span, union))

    def clipped(self, contributions: Sequence[_Parsed]) -> list[int]:
        return robust.clipped([c.norm for c in contributions], self.clip_factor)

    def _aggregate(self, span: Span, contributions: Sequence[SparseValues], norms: Sequence[float]) -> SparseValues:
        """The span's aggregate of bounded contributions: one function for the reducer and every recipient."""
        values = robust.clip([c.values for c in contributions], norms, self.clip_factor)
        bounded = [SparseValues(c.positions, v) for c, v in zip(contributions, values)]
        return fmt.aggregate(self.numel(span), bounded, self.mode)

    def result_for(self, aggregate: _Aggregate, omit: int | None) -> bytes:
        relay = fmt.encode_relay(self.layout, [p for i, p in enumerate(aggregate.payloads) if i != omit])
        return relay if len(relay) <= len(aggregate.union) else aggregate.union

    def receive(self, span: Span, result: bytes, own: int | None) -> None:
        if fmt.read_kind(self.layout, result) == fmt.RELAY:
            payloads = fmt.decode_relay(self.layout, result, self.max_payload_bytes(span))
            if own is not None:
                payloads.insert(own, self.encode(span))
            contributions = [fmt.decode_contribution(self.layout, span, p) for p in payloads]
            union = self._aggregate(span, contributions, [robust.norm(c.values) for c in contributions])
        else:
            union = fmt.decode_union(self.layout, span, result)
            robust.norm(union.values)  # a mean of bounded contributions is bounded too: refuse an absurd one
        start, stop = self.layout.element_range(span)
        part = self.output[start:stop]
        part[:] = 0.0
        part[union.positions] = union.values

    def aggregate_digest(self) -> str:
        return hashlib.sha256(self.output.tobytes()).hexdigest()

    def aggregate(self) -> list[torch.Tensor]:
        """The aggregate, one dense float32 CPU tensor per input tensor."""
        if np.isnan(self.output).any():
            raise RuntimeError("all-reduce finished with spans missing")  # a communicator bug, not bad input
        out = torch.from_numpy(self.output)
        return [grid.from_chunks(out[int(start) : int(start) + grid.numel].view(grid.chunks, grid.chunk_numel))
                for grid, start in zip(self.layout.grids, self.layout.element_starts)]
