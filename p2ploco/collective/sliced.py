"""A round's named parameter slices as one exchange.

An outer algorithm builds one exchange per slice it holds (``stage0``, ``stage1``, ...; a full replica
holds them all, a stage peer one) and hands the round over as one :class:`SlicedExchange`. Its units
are the slices' units concatenated in slice order, so a butterfly among peers that hold the same
slices cuts spans across slice borders as if the slices were one tensor list. A communicator whose
members hold different slices (a pipeline group next to full replicas) reduces each slice among its
holders instead, through ``parts``.

A payload or result for a span is the pieces of the slices the span touches, in slice order:

    +-------------+--------------------+-------------+--------------------+----
    | u32 length  | slice a's piece    | u32 length  | slice b's piece    | ...
    +-------------+--------------------+-------------+--------------------+----

each length little-endian, checked against that slice's largest valid piece before it is read, and
the pieces must fill the payload exactly.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from p2ploco.collective.exchange import Exchange, Span
from p2ploco.errors import PayloadError

LENGTH = struct.Struct("<I")


@dataclass
class _SlicedParsed:
    exchanges: list[Exchange]  # the slices a span touches, in order
    pieces: list[Any]  # each slice's parsed piece


@dataclass
class _SlicedAggregate:
    exchanges: list[Exchange]  # the slices a span touches, in order
    aggregates: list[Any]  # each slice's combined value


class SlicedExchange(Exchange):
    def __init__(self, parts: Mapping[str, Exchange], tokens: int = 1):
        """``tokens``: what this replica trained for the contribution (its weight in the round's mean)."""
        if not parts:
            raise ValueError("a sliced exchange needs at least one slice")
        self.parts, self.tokens = dict(parts), tokens
        self._exchanges = list(self.parts.values())
        self.unit_starts = np.cumsum([0] + [e.num_units for e in self._exchanges])
        self.element_starts = np.cumsum([0] + [e.numel(range(e.num_units)) for e in self._exchanges])
        self.num_units = int(self.unit_starts[-1])

    def pieces(self, span: Span) -> list[tuple[Exchange, Span]]:
        """The slices ``span`` touches, each with the span of its own units."""
        out = []
        for exchange, start in zip(self._exchanges, self.unit_starts):
            first, stop = max(span.start - int(start), 0), min(span.stop - int(start), exchange.num_units)
            if first < stop:
                out.append((exchange, range(first, stop)))
        return out

    def unit_at(self, element: int) -> int:
        index = int(np.searchsorted(self.element_starts, element, side="right")) - 1
        index = min(index, len(self._exchanges) - 1)
        return int(self.unit_starts[index]) + self._exchanges[index].unit_at(element - int(self.element_starts[index]))

    def fingerprint(self) -> str:
        return "sliced(" + ";".join(f"{name}={e.fingerprint()}" for name, e in self.parts.items()) + ")"

    def numel(self, span: Span) -> int:
        return sum(e.numel(part) for e, part in self.pieces(span))

    def max_payload_bytes(self, span: Span) -> int:
        return sum(LENGTH.size + e.max_payload_bytes(part) for e, part in self.pieces(span))

    def max_result_bytes(self, span: Span, group_size: int) -> int:
        return sum(LENGTH.size + e.max_result_bytes(part, group_size) for e, part in self.pieces(span))

    def encode(self, span: Span) -> bytes:
        return _join(e.encode(part) for e, part in self.pieces(span))

    def parse(self, span: Span, payload: bytes) -> _SlicedParsed:
        pieces = self.pieces(span)
        data = _split(payload, [e.max_payload_bytes(part) for e, part in pieces])
        return _SlicedParsed([e for e, _ in pieces], [e.parse(part, piece) for (e, part), piece in zip(pieces, data)])

    def combine(self, span: Span, contributions: Sequence[_SlicedParsed], scales: Sequence[float] | None = None
                ) -> _SlicedAggregate:
        pieces = self.pieces(span)
        return _SlicedAggregate([e for e, _ in pieces], [e.combine(part, [c.pieces[i] for c in contributions], scales)
                                                         for i, (e, part) in enumerate(pieces)])

    def clipped(self, contributions: Sequence[_SlicedParsed]) -> list[int]:
        """Contributions clipped in any of the slices (each slice bounds its own piece)."""
        if not contributions:
            return []
        exchanges = contributions[0].exchanges
        return sorted({i for j, e in enumerate(exchanges) for i in e.clipped([c.pieces[j] for c in contributions])})

    def result_for(self, aggregate: _SlicedAggregate, omit: int | None) -> bytes:
        return _join(e.result_for(a, omit) for e, a in zip(aggregate.exchanges, aggregate.aggregates))

    def receive(self, span: Span, result: bytes, own: int | None, scales: Sequence[float] | None = None) -> None:
        pieces = self.pieces(span)
        # the whole result was bounded by max_result_bytes already; each slice checks its own piece
        for (e, part), piece in zip(pieces, _split(result, [len(result)] * len(pieces))):
            e.receive(part, piece, own, scales)

    def aggregate_digest(self) -> str:
        digest = hashlib.sha256()
        for name, exchange in self.parts.items():
            digest.update(f"{name}={exchange.aggregate_digest()};".encode())
        return digest.hexdigest()


def as_sliced(exchange: Exchange, name: str) -> SlicedExchange:
    """The all-reduce as named slices: a sliced exchange itself, or any other exchange as one slice ``name``."""
    return exchange if isinstance(exchange, SlicedExchange) else SlicedExchange({name: exchange})


def _join(pieces: Iterable[bytes]) -> bytes:
    return b"".join(LENGTH.pack(len(piece)) + piece for piece in pieces)


def _split(payload: bytes, limits: list[int]) -> list[bytes]:
    """The length-prefixed pieces of ``payload``, one per limit, each at most its limit; PayloadError otherwise."""
    pieces, offset = [], 0
    for limit in limits:
        if offset + LENGTH.size > len(payload):
            raise PayloadError(f"sliced payload truncated: {len(pieces)} of {len(limits)} pieces")
        (length,) = LENGTH.unpack_from(payload, offset)
        offset += LENGTH.size
        if length > limit or offset + length > len(payload):
            raise PayloadError(f"sliced payload piece {len(pieces)} of {length} bytes is too long or truncated")
        pieces.append(payload[offset : offset + length])
        offset += length
    if offset != len(payload):
        raise PayloadError(f"sliced payload has {len(payload) - offset} unexpected trailing bytes")
    return pieces
