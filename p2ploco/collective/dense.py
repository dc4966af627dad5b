"""Dense mean of a list of tensors: the all-reduce of DiLoCo and of every-step data parallelism."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from p2ploco.collective import robust
from p2ploco.collective.exchange import Exchange, Receipt, Span, supersede
from p2ploco.errors import PayloadError

WIRE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def tensor_to_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(torch.uint8).numpy().tobytes()


def bytes_to_tensor(payload: bytes, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(payload, dtype=np.uint8).copy()).view(dtype)


@dataclass
class _Parsed:
    values: torch.Tensor  # float32
    norm: float  # of the values: what clipping compares

    @property
    def vector(self) -> robust.Vector:
        return robust.Vector(self.values.numpy())


class DenseMean(Exchange):
    """Units are single elements of the flattened tensors. Values travel as ``wire_dtype``; the reducer
    weighs and bounds each contribution as ``policy`` says (``collective/robust.py``), sums them in float32, in the
    group's order, divides by the count and sends the mean as ``wire_dtype``."""

    auditable = True

    def __init__(self, tensors: Sequence[torch.Tensor], wire_dtype: str = "float32",
                 policy: robust.Policy = robust.UNBOUNDED):
        self.policy = policy
        self.shapes = [t.shape for t in tensors]
        self.wire_dtype = WIRE_DTYPES[wire_dtype]
        self.itemsize = torch.empty(0, dtype=self.wire_dtype).element_size()
        self.values = torch.cat([t.detach().reshape(-1).to("cpu", torch.float32) for t in tensors])
        self.output = torch.full_like(self.values, float("nan"))  # NaN marks spans not yet received
        self.num_units = self.values.numel()
        self._digests: dict[Span, bytes] = {}  # sha256 of every span's result as received
        self._combined: dict[Span, bytes] = {}  # the result of every span this replica reduced
        self._taking = threading.Lock()  # spans are received in parallel (executor threads)

    def fingerprint(self) -> str:
        return f"dense-mean/{self.wire_dtype}/{self.num_units}/{self.policy.fingerprint()}/digest3"

    def unit_at(self, element: int) -> int:
        return element

    def numel(self, span: Span) -> int:
        return len(span)

    def max_payload_bytes(self, span: Span) -> int:
        return len(span) * self.itemsize

    def max_result_bytes(self, span: Span, group_size: int) -> int:
        return len(span) * self.itemsize

    def encode(self, span: Span) -> bytes:
        return tensor_to_bytes(self.values[span.start : span.stop].to(self.wire_dtype))

    def parse(self, span: Span, payload: bytes) -> _Parsed:
        values = self._decode(span, payload)
        return _Parsed(values, robust.norm(values.numpy()))

    def _decode(self, span: Span, payload: bytes) -> torch.Tensor:
        if len(payload) != len(span) * self.itemsize:
            raise PayloadError(f"dense payload of {len(payload)} bytes, expected {len(span) * self.itemsize}")
        values = bytes_to_tensor(payload, self.wire_dtype).float()
        if not torch.isfinite(values).all():
            raise PayloadError("dense payload holds NaN or Inf values")
        return values

    def combine(self, span: Span, contributions: Sequence[_Parsed], factors: Sequence[float]) -> bytes:
        self._combined[span] = tensor_to_bytes(self._mean(contributions, factors).to(self.wire_dtype))
        return self._combined[span]

    @staticmethod
    def _mean(contributions: Sequence[_Parsed], factors: Sequence[float]) -> torch.Tensor:
        """The weighted mean, summed in float32 in the contributions' order: one function for reducer and auditor."""
        bounded = [robust.scaled(c.values.numpy(), f) for c, f in zip(contributions, factors, strict=True)]
        total = torch.from_numpy(bounded[0]).clone()
        for values in bounded[1:]:
            total.add_(torch.from_numpy(values))
        return total.div_(len(contributions))

    def expected(self, span: Span, contributions: Sequence[_Parsed], factors: Sequence[float]
                 ) -> tuple[robust.Vector, robust.Vector]:
        mean = self._mean(contributions, factors)
        return robust.Vector(mean.numpy()), robust.Vector(mean.to(self.wire_dtype).float().numpy())

    def taken(self, span: Span) -> robust.Vector:
        return robust.Vector(self.output[span.start : span.stop].numpy())

    def result_for(self, aggregate: bytes, omit: int | None) -> bytes:
        return aggregate  # every recipient gets the same mean

    def receive(self, span: Span, result: bytes, receipt: Receipt) -> bytes:
        """The span's digest: sha256 of its receipt and result bytes (every recipient of a span gets the same), hashed
        as they arrive, in parallel, and in the wire dtype, rather than the whole float32 output at the end."""
        values = self._decode(span, result)
        if result != self._combined.get(span):  # not the mean this replica made as the span's reducer
            self.check(span, robust.Vector(values.numpy()), receipt)
        self.output[span.start : span.stop] = values
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
        parts = self.output.split([shape.numel() for shape in self.shapes])
        return [part.view(shape) for part, shape in zip(parts, self.shapes)]
