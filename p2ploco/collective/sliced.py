"""A round's named parameter slices, each with its own exchange.

An outer algorithm builds one exchange per slice it holds (``stage0``, ``stage1``, ...; a full replica holds
them all, a stage peer one; Streaming DiLoCo's fragments) and hands the round over as one
:class:`SlicedExchange`, with the tokens its contribution was trained on. A communicator reduces each slice among
the members that hold it: every slice is cut into spans and reduced on its own (its own norms, clipping and
results), so that full replicas and pipeline groups, which hold different slices, share one round.
"""

from __future__ import annotations

from collections.abc import Mapping

from p2ploco.collective.exchange import Exchange, reduce_span


class SlicedExchange:
    def __init__(self, parts: Mapping[str, Exchange], tokens: int = 1):
        """``parts``: slice name -> its exchange; ``tokens``: what this replica trained for the contribution (its
        weight in every slice's mean)."""
        if not parts:
            raise ValueError("a sliced exchange needs at least one slice")
        self.parts, self.tokens = dict(parts), tokens

    def numel(self) -> int:
        """Parameters of every slice."""
        return sum(part.numel(range(part.num_units)) for part in self.parts.values())


def reduce_alone(exchange: Exchange | SlicedExchange) -> int:
    """A replica with no partner: its aggregate of every slice is its own contribution, through the same codec.
    Returns the size of those contributions."""
    uploaded = 0
    for part in as_sliced(exchange, "alone").parts.values():
        whole = range(part.num_units)
        payload = part.encode(whole)
        reduction = reduce_span(part, whole, [("self", payload)])
        part.receive(whole, reduction.result_for(part, "self"), reduction.receipt_for("self"))
        uploaded += len(payload)
    return uploaded


def as_sliced(exchange: Exchange | SlicedExchange, name: str) -> SlicedExchange:
    """The all-reduce as named slices: a sliced exchange itself, or any other exchange as one slice ``name``."""
    return exchange if isinstance(exchange, SlicedExchange) else SlicedExchange({name: exchange})
