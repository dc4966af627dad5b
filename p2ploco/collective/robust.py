"""Bounding every contribution before a reducer combines them, so one hostile or broken peer cannot
poison the aggregate (templar's defence for SparseLoCo: median-norm clipping).

The reducer of a span measures each contribution to it (the L2 norm of the values it carries over
the span) and scales down every contribution whose norm exceeds ``factor`` times the median norm of
the span's contributions. A peer that sends a well-formed update scaled by 1e6 thus moves the
global parameters no further than an honest peer with ``factor`` times the typical norm would.

Every peer must compute the same bits: the reducer for its span, and any recipient of a relayed
result, which recombines the contributions itself. So the arithmetic is fixed, in this order:

- norm: the float32 values widened to float64 (their squares are exact there), the squares summed
  by numpy's pairwise summation, whose order depends only on the length (numpy is pinned), and a
  float64 square root;
- median: the lower median (the ceil(n/2)-th smallest norm), so that in a group of two the larger
  contribution is bounded by the smaller one, whichever peer sent it;
- bound: ``factor * median`` in float64; scale: ``bound / norm`` rounded once to float32; every value
  of a clipped contribution is multiplied by that scale in float32.

A contribution within the bound is left untouched, so an honest round's aggregate keeps every bit.

Contributions are weighted by the tokens their peers trained (``token_scales``): a peer that fits a third of the
steps into the round's time budget moves the mean a third as far. The weights are the group's (the coordinator
lists every member's tokens), so every reducer and recipient uses the same ones; each is clamped to
``MAX_WEIGHT_SPREAD`` times the group's lower median first, so a peer that claims absurd tokens weighs no more
than that. A contribution's factor ``n * w_i / sum(w)`` is computed in float64 and, times its clipping scale,
rounded once to float32; equal weights give factors of exactly 1.0, and such a round's aggregate is the plain
mean to the bit.
A contribution whose norm reaches ``MAX_NORM`` is refused outright (PayloadError, its sender is dropped):
nothing trained in float32 produces it, and scaling it down would take factors near float32's
subnormal range, where the scaled values lose their precision. With every contribution below
``MAX_NORM``, a float32 sum of a group's clipped contributions cannot overflow.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from p2ploco.errors import PayloadError

MAX_NORM = 2.0**64
MAX_WEIGHT_SPREAD = 4  # a contribution weighs at most this many times the group's lower-median tokens


def norm(values: np.ndarray) -> float:
    """The L2 norm of a contribution's float32 values, the same on every peer; PayloadError if absurd."""
    wide = values.astype(np.float64).reshape(-1)
    result = math.sqrt(float(np.sum(wide * wide)))
    if not result < MAX_NORM:  # also catches NaN
        raise PayloadError(f"contribution of norm {result:.3g} is absurdly large (the limit is {MAX_NORM:.3g})")
    return result


def bound(norms: Sequence[float], factor: float) -> float | None:
    """The largest norm a contribution may keep: ``factor`` times the lower median of ``norms``. None when
    nothing is clipped (clipping off, or a zero median that would erase every contribution)."""
    if factor <= 0 or not norms:
        return None
    median = sorted(norms)[(len(norms) - 1) // 2]
    return factor * median if median > 0 else None


def token_scales(tokens: Sequence[int]) -> list[float]:
    """Each contribution's factor in the tokens-weighted mean of contributions that trained ``tokens``:
    ``n * w_i / sum(w)`` of the weights clamped to [1, MAX_WEIGHT_SPREAD x lower median]. All 1.0 when the
    weights are equal (or none are given)."""
    if len(set(tokens)) <= 1:
        return [1.0] * len(tokens)
    cap = MAX_WEIGHT_SPREAD * max(1, sorted(tokens)[(len(tokens) - 1) // 2])
    weights = [min(max(1, t), cap) for t in tokens]
    total = sum(weights)
    return [len(weights) * w / total for w in weights]


def clip(values: Sequence[np.ndarray], norms: Sequence[float], factor: float,
         scales: Sequence[float] | None = None) -> list[np.ndarray]:
    """The contributions, each one above the bound scaled down to it, and each times its token weight's factor
    (``token_scales``; none: all 1). One above the bound and weighted 1.0 is returned as it is."""
    limit = bound(norms, factor)
    scales = scales if scales is not None else [1.0] * len(values)
    out = []
    for v, n, s in zip(values, norms, scales, strict=True):
        factor_here = s * (limit / n) if limit is not None and n > limit else s
        out.append(v if factor_here == 1.0 else v * np.float32(factor_here))
    return out


def clipped(norms: Sequence[float], factor: float) -> list[int]:
    """Positions of the contributions that ``clip`` scales down."""
    limit = bound(norms, factor)
    return [] if limit is None else [i for i, n in enumerate(norms) if n > limit]
