"""What the exchanges of block-quantized values share (LoCo's ``lowbit.py``, Streaming DiLoCo's ``fp4.py``).

Units are whole quantization blocks (``compression/blockwise.py``'s layout). A reducer decodes every
contribution, weighs and bounds it (``collective/robust.py``), sums them in float32 in the group's order, divides
by their number and quantizes that mean again (each subclass its own way), scaled down where the quantized result
would be longer than the contributions allow (``robust.within``: rounding can lengthen it, and so can LoCo's
compensation buffer); every member, the reducer too, gets the same result bytes and decodes them into the same
float32 aggregate.
"""

from __future__ import annotations

import hashlib
import threading
from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from p2ploco.collective import robust
from p2ploco.collective.exchange import Exchange, Receipt, Span, supersede
from p2ploco.compression.blockwise import BlockLayout

CONTRIBUTION, RESULT = 1, 2  # the kinds of payload: a sender's contribution, a reducer's result


@dataclass
class Parsed:
    values: np.ndarray  # float32, decoded
    norm: float  # of the values: what clipping compares

    @property
    def vector(self) -> robust.Vector:
        return robust.Vector(self.values)


class BlockedMean(Exchange):
    def __init__(self, layout: BlockLayout, policy: robust.Policy):
        self.layout, self.policy = layout, policy
        self.num_units = layout.num_blocks
        self.output = torch.full((layout.numel,), float("nan"))  # NaN marks spans not yet received
        self._digests: dict[Span, bytes] = {}  # sha256 of every span received (its receipt and result bytes)
        self.combined: dict[Span, bytes] = {}  # the result of every span this replica reduced (``combine`` fills it)
        self._taking = threading.Lock()  # spans are received in parallel (executor threads)

    @abstractmethod
    def decode(self, kind: int, span: Span, payload: bytes) -> np.ndarray:
        """The float32 values of a payload of ``kind`` for ``span``; PayloadError if anything about it is off."""

    def unit_at(self, element: int) -> int:
        return self.layout.block_of(element)

    def numel(self, span: Span) -> int:
        return len(self.layout.element_range(span))

    def max_result_bytes(self, span: Span, group_size: int) -> int:
        return self.max_payload_bytes(span)

    def parse(self, span: Span, payload: bytes) -> Parsed:
        values = self.decode(CONTRIBUTION, span, payload)
        return Parsed(values, robust.norm(values))

    def bounded_mean(self, contributions: Sequence[Parsed], factors: Sequence[float]) -> torch.Tensor:
        """The float32 mean of the contributions, each times its factor first, summed in their order."""
        bounded = [robust.scaled(c.values, f) for c, f in zip(contributions, factors, strict=True)]
        total = torch.from_numpy(bounded[0]).clone()
        for values in bounded[1:]:
            total.add_(torch.from_numpy(values))
        return total.div_(len(contributions))

    def result_for(self, aggregate: bytes, omit: int | None) -> bytes:
        return aggregate  # every recipient gets the same quantized mean

    def receive(self, span: Span, result: bytes, receipt: Receipt) -> bytes:
        """The span's digest: sha256 of its receipt and result bytes (every recipient of a span gets the same)."""
        values = self.decode(RESULT, span, result)
        if result != self.combined.get(span):  # not the result this replica made as the span's reducer
            self.check(span, robust.Vector(values), receipt)
        elements = self.layout.element_range(span)
        self.output[elements.start : elements.stop] = torch.from_numpy(values)
        digest = hashlib.sha256(receipt.digest() + result).digest()
        if len(span):  # an empty span holds nothing (a group larger than the units makes some)
            with self._taking:
                supersede(self._digests, span)
                self._digests[span] = digest
        return digest

    def piece_digests(self) -> dict[Span, bytes]:
        return dict(self._digests)

    def mean(self) -> list[torch.Tensor]:
        """The aggregate, shaped like the input tensors (float32, CPU)."""
        if torch.isnan(self.output).any():
            raise RuntimeError("all-reduce finished with spans missing")  # a communicator bug, not bad input
        return self.layout.split(self.output)
