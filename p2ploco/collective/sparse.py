"""Sparse all-reduce of SparseLoCo contributions.

Units are whole chunks, so a reducer owns every value of the chunks in its span. It checks each
sender's contribution and answers each recipient with whichever result encoding is smaller: the
included contributions relayed (without the recipient's own, which it re-inserts) or their union
with the aggregated float32 values. Both are exact and both end in the same bits: the aggregate is
computed by the same function, over the same contributions, in the same order.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from p2ploco.collective.exchange import Exchange, Span
from p2ploco.compression import sparse_format as fmt
from p2ploco.compression.sparse_format import SparseLayout, SparseValues
from p2ploco.compression.topk import CompressedTensor


@dataclass
class _Parsed:
    payload: bytes
    values: SparseValues


@dataclass
class _Aggregate:
    payloads: list[bytes]  # the included contributions, canonical order
    union: bytes  # the aggregate itself, union-encoded


class SparseExchange(Exchange):
    def __init__(self, layout: SparseLayout, compressed: Sequence[CompressedTensor], mode: str):
        self.layout, self.compressed, self.mode = layout, list(compressed), mode
        self.num_units = layout.num_chunks
        self.output = np.full(layout.total_numel, np.nan, dtype=np.float32)  # NaN: span not received yet
        self._encoded: dict[Span, bytes] = {}

    def unit_at(self, element: int) -> int:
        return int(np.searchsorted(self.layout.chunk_element_ends, element, side="right"))

    def fingerprint(self) -> str:
        return f"sparse/{self.layout.digest.hex()}/{self.mode}"

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
        return _Parsed(payload, fmt.decode_contribution(self.layout, span, payload))

    def combine(self, span: Span, contributions: Sequence[_Parsed]) -> _Aggregate:
        union = fmt.aggregate(self.numel(span), [c.values for c in contributions], self.mode)
        return _Aggregate([c.payload for c in contributions], fmt.encode_union(self.layout, span, union))

    def result_for(self, aggregate: _Aggregate, omit: int | None) -> bytes:
        relay = fmt.encode_relay(self.layout, [p for i, p in enumerate(aggregate.payloads) if i != omit])
        return relay if len(relay) <= len(aggregate.union) else aggregate.union

    def receive(self, span: Span, result: bytes, own: int | None) -> None:
        if fmt.read_kind(self.layout, result) == fmt.RELAY:
            payloads = fmt.decode_relay(self.layout, result, self.max_payload_bytes(span))
            if own is not None:
                payloads.insert(own, self.encode(span))
            contributions = [fmt.decode_contribution(self.layout, span, p) for p in payloads]
            union = fmt.aggregate(self.numel(span), contributions, self.mode)
        else:
            union = fmt.decode_union(self.layout, span, result)
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
