"""What hostile reducers make of a span, for tests and benchmarks of what the others withstand: ``tests/hostile.py``
patches them into real nodes, ``benchmarks/quality.py`` into in-process replicas (``InProcessGroup``'s
``hostile``). SparseLoCo's resparsified results only."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from p2ploco.collective import robust
from p2ploco.collective.exchange import Span, SpanReduction
from p2ploco.collective.sparse import SparseExchange
from p2ploco.compression.sparse_format import SparseValues

STEER_STRIDE = 256  # a steering reducer pushes one value in this many of its span's


def steered(mean: SparseValues, numel: int, push: float) -> SparseValues:
    """A span's ``mean`` (of ``numel`` values) plus a direction nobody sent: at every ``STEER_STRIDE``-th position
    that no contribution selected, values of fixed signs that together are ``push`` x the mean's length. The same
    positions and signs every round, for a span of this size: a steady push, a backdoor's shape. Few and large, so
    that a result's Top-k keeps them."""
    where = np.setdiff1d(np.arange(numel // 2 % STEER_STRIDE, numel, STEER_STRIDE), mean.positions)
    if not len(where) or not len(mean.values):
        return mean
    signs = np.where(np.random.default_rng(numel).random(len(where)) < 0.5, -1.0, 1.0)
    added = (signs * push * robust.norm(mean.values) / len(where) ** 0.5).astype(np.float32)
    positions = np.concatenate([mean.positions, where])
    order = np.argsort(positions, kind="stable")
    return SparseValues(positions[order], np.concatenate([mean.values, added])[order])


class HostileReducer(ABC):
    """A reducer that combines its pieces honestly and answers what it likes (``InProcessGroup``'s ``hostile``)."""

    @abstractmethod
    def results(self, exchange: SparseExchange, span: Span, reduction: SpanReduction, recipients: Sequence[str]
                ) -> dict[str, bytes]:
        """What it answers each of ``recipients`` for the piece ``span`` that it reduced as ``reduction``."""


@dataclass(frozen=True)
class Steering(HostileReducer):
    """Answers every member the result of its span's mean ``steered`` by ``push``, compressed as an honest result is
    (the same length bound): every member's checks pass, an audit does not."""

    push: float

    def results(self, exchange: SparseExchange, span: Span, reduction: SpanReduction, recipients: Sequence[str]
                ) -> dict[str, bytes]:
        mean, limit = exact_mean(exchange, span, reduction)
        result = exchange.resparsify(span, steered(mean, exchange.numel(span), self.push), len(reduction.norms),
                                     limit).result
        return dict.fromkeys(recipients, result)


@dataclass(frozen=True)
class Equivocating(HostileReducer):
    """Answers every second member the result of its span's mean 1 % shorter, the others the honest one: every
    member's checks pass, and their digests of the piece differ."""

    def results(self, exchange: SparseExchange, span: Span, reduction: SpanReduction, recipients: Sequence[str]
                ) -> dict[str, bytes]:
        mean, limit = exact_mean(exchange, span, reduction)
        shorter = exchange.resparsify(span, SparseValues(mean.positions, mean.values * np.float32(0.99)),
                                      len(reduction.norms), limit).result
        return {r: shorter if i % 2 else reduction.result_for(exchange, r) for i, r in enumerate(recipients)}


def exact_mean(exchange: SparseExchange, span: Span, reduction: SpanReduction) -> tuple[SparseValues, float]:
    """The exact weighted mean of the contributions ``reduction`` combined, and the length its result may have."""
    factors, _ = robust.mean_factors(reduction.norms, reduction.tokens, exchange.policy.clip_factor)
    combined = [exchange.parse(span, payload) for _, payload in reduction.weighed[: len(reduction.norms)]]
    mean, _ = exchange.expected(span, combined, factors)
    return SparseValues(mean.positions, mean.values), exchange.limit(factors, reduction.norms)
