"""What the exchanges of group-quantized values share (LoCo's ``lowbit.py``, Streaming DiLoCo's ``fp4.py``).

Units are whole quantization groups (``compression/groupwise.py``'s layout). A reducer decodes every
contribution, bounds it (``collective/robust.py``), sums them in float32 in the group's order, divides by
their number and quantizes that mean again (each subclass its own way); every member, the reducer too,
gets the same result bytes and decodes them into the same float32 aggregate.
"""

from __future__ import annotations

import hashlib
from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from p2ploco.collective import robust
from p2ploco.collective.exchange import Exchange, Span
from p2ploco.compression.groupwise import GroupLayout

CONTRIBUTION, RESULT = 1, 2  # the kinds of payload: a sender's contribution, a reducer's result


@dataclass
class Parsed:
    values: np.ndarray  # float32, decoded
    norm: float  # of the values: what clipping compares


class GroupedMean(Exchange):
    def __init__(self, layout: GroupLayout, clip_factor: float):
        self.layout, self.clip_factor = layout, clip_factor
        self.num_units = layout.num_groups
        self.output = torch.full((layout.numel,), float("nan"))  # NaN marks spans not yet received

    @abstractmethod
    def decode(self, kind: int, span: Span, payload: bytes) -> np.ndarray:
        """The float32 values of a payload of ``kind`` for ``span``; PayloadError if anything about it is off."""

    def unit_at(self, element: int) -> int:
        return self.layout.group_of(element)

    def numel(self, span: Span) -> int:
        return len(self.layout.element_range(span))

    def max_result_bytes(self, span: Span, group_size: int) -> int:
        return self.max_payload_bytes(span)

    def parse(self, span: Span, payload: bytes) -> Parsed:
        values = self.decode(CONTRIBUTION, span, payload)
        return Parsed(values, robust.norm(values))

    def bounded_mean(self, contributions: Sequence[Parsed], scales: Sequence[float] | None = None) -> torch.Tensor:
        """The float32 mean of the contributions, each clipped and weighted first, summed in their order."""
        bounded = robust.clip([c.values for c in contributions], [c.norm for c in contributions], self.clip_factor,
                              scales)
        total = torch.from_numpy(bounded[0]).clone()
        for values in bounded[1:]:
            total.add_(torch.from_numpy(values))
        return total.div_(len(contributions))

    def clipped(self, contributions: Sequence[Parsed]) -> list[int]:
        return robust.clipped([c.norm for c in contributions], self.clip_factor)

    def result_for(self, aggregate: bytes, omit: int | None) -> bytes:
        return aggregate  # every recipient gets the same quantized mean

    def receive(self, span: Span, result: bytes, own: int | None, scales: Sequence[float] | None = None) -> None:
        values = self.decode(RESULT, span, result)
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
