"""What one contribution, or a minority of them, can do to a span's aggregate, and what a reducer's answer may be.

A reducer combines the contributions to its span in four steps, the same on every peer (the reducer for its span,
and a recipient of a relayed result, which recombines the contributions itself):

1. **Direction** (``opposed``). With three or more contributions, one that points against the others is left out:
   its *agreement*, the median of its cosines with each other contribution, is negative. Honest
   pseudo-gradients share the descent direction: on tiny.yaml, 8 replicas, 30 rounds, every pairwise cosine of two
   honest contributions to a span was positive (1,920 spans; at least 0.002 for SparseLoCo, 0.15 for DiLoCo), so
   an honest contribution's agreement is positive as long as at most half of the others oppose it, and a
   sign-flipped one's negative as long as fewer than half agree with it, however the hostile ones agree among
   themselves (a sum of cosines would let k copies of one vector outvote the honest ones' weak agreement). At most a
   minority, ``(n - 1) // 2``, the least agreeing first, is left out, so that a majority always decides. Every
   contribution counts once whatever its weight or norm: a key has one say. ``Policy.drop_opposed`` turns it on.
   One left out by more than ``STRIKE_SHARE`` of the kept ones' agreement earns its sender a strike
   (``swarm/bans.py``): an honest full replica beside pipeline groups is left out now and then, barely negative.
2. **Weight** (``weights``). Each kept contribution weighs the tokens its peer trained, as the group lists them,
   capped by what a contribution may weigh (``inner.steps`` of the run's batch on each of ``training.max_ranks``
   local ranks, 1 unless the run raises it; at the join: ``sync/form.py``), so that one key weighs at most
   that many full peers: its factor in the mean is ``m * w_i / sum(w)`` over the m kept.
3. **Norm for the tokens trained** (``weights``). A pseudo-gradient grows about as the square root of the steps
   behind it (the noise of H steps adds up so; measured on the pace suite, ``docs/design.md``), so a contribution
   may have at most ``clip_factor`` times the lower median of the kept contributions' norms scaled to the most
   tokens of the span (``norm * sqrt(top / tokens)``), times ``sqrt(tokens / top)`` of its own: a fast peer is not
   clipped for having trained more than a slow one, nor a slow one for having trained less, and a contribution that
   claims a full round's tokens may be as long as a full round's. With equal tokens the scale is exactly 1: the bound
   is ``clip_factor`` times the lower median norm and an honest uniform round keeps every bit. Above the bound a
   contribution is multiplied by ``bound / norm``; that, times its weight factor, is rounded once to float32.
4. **The result's bound** (``mean_limit``, ``selector_limit``). No aggregate of the kept, weighted, clipped
   contributions can be longer than their factors times their norms allow: ``sum(f_i * c_i) / m`` for a mean, and
   ``sqrt(sum((f_i * c_i)^2))`` for SparseLoCo's per-coordinate mean over the contributions that selected a
   coordinate (a convex combination of them at every coordinate). A reducer's answer names the norms it combined
   (``exchange.Receipt``), every member checks its own and the result against the bound (``check_result``), and
   the digest every member votes on covers the norms, so all members that commit held the same ones. A reducer
   whose result is longer, or points against the recipient's own contribution (``check_direction``), is refused as
   malformed: the recipient rejects and bans it, and accuses it in its vote.

The arithmetic is fixed so that every peer computes the same bits: float32 values widened to float64 (products of
two float32 values are exact there), sums in numpy's pairwise order, which depends only on the length (numpy is
pinned), and the float64 results compared or rounded once.

A contribution whose norm reaches ``MAX_NORM`` is refused outright (PayloadError, its sender is dropped):
nothing trained in float32 produces it, and scaling it down would take factors near float32's subnormal range,
where the scaled values lose their precision. With every contribution below ``MAX_NORM``, a float32 sum of a
group's clipped contributions cannot overflow.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from p2ploco.errors import PayloadError

MAX_NORM = 2.0**64
# A result may be this much longer than its bound: the float32 sums of a mean round, and a wire dtype's rounding
# (bfloat16: 2^-8 per value) adds to that. A hostile reducer gains this much beyond the bound (which, for a result
# that is quantized again, allows what its codec may lengthen: ``Exchange.limit``).
RESULT_TOLERANCE = 1 / 64
# A result whose cosine with the recipient's own contribution is below minus this points against it. An honest
# result is the mean of contributions that agree with each other, this one's included: measured at least 0 on
# tiny.yaml for SparseLoCo and DiLoCo, and once -0.036 for Streaming DiLoCo's 4-bit fragments at H = 5 with 8
# replicas (docs/design.md, "Robust aggregation"), against -0.1 and less flipped.
DIRECTION_TOLERANCE = 0.05
MAX_RESCALES = 4  # attempts of ``within`` to bring a quantized result under its bound
# A contribution left out for its direction earns its sender a strike if its agreement is below minus this share of
# the kept ones' median agreement. Measured on tiny-pipeline.yaml, one full replica beside two pipeline groups, 40
# rounds in process (240 spans of the replica): the replica's honest agreement was at least -0.14 of the others'
# median (it was left out of 4 spans), and its sign flip's below -0.2 of it in 68 % of the spans, which
# earns a flipper its ban in a few rounds (3 strikes of 10: swarm/bans.py).
STRIKE_SHARE = 0.2
GRAM_BLOCK = 1 << 16  # coordinates of dense contributions multiplied at once by ``gram``
T = TypeVar("T")


class OpposedResult(PayloadError):
    """A reducer's result points against this peer's own contribution: what a hostile reducer's does every time, and
    an honest one's might rarely (noise), so it is refused, and counted as a strike rather than banned at once."""


@dataclass(frozen=True)
class Policy:
    """How a reducer bounds contributions: ``clip_factor`` times the lower median norm for the tokens trained (0: no
    clipping), and whether the direction counts (``drop_opposed``): a reducer leaves out contributions that point
    against the others, and a member refuses a result that points against its own contribution. Every member of a
    round must share it (it is part of the exchange's fingerprint)."""

    clip_factor: float = 0.0
    drop_opposed: bool = False

    def fingerprint(self) -> str:
        return f"clip{self.clip_factor:g}" + ("/opposed" if self.drop_opposed else "")


UNBOUNDED = Policy()  # no clipping, nothing left out: the plain (weighted) mean


@dataclass(frozen=True)
class Vector:
    """A contribution's values over a span: dense (``positions`` None: every element of the span, in order) or
    sparse (float32 ``values`` at the sorted, unique int64 ``positions``)."""

    values: np.ndarray
    positions: np.ndarray | None = None


def norm(values: np.ndarray) -> float:
    """The L2 norm of a contribution's float32 values, the same on every peer; PayloadError if absurd."""
    wide = values.astype(np.float64).reshape(-1)
    result = math.sqrt(float(np.sum(wide * wide)))
    if not result < MAX_NORM:  # also catches NaN
        raise PayloadError(f"contribution of norm {result:.3g} is absurdly large (the limit is {MAX_NORM:.3g})")
    return result


@dataclass(frozen=True)
class Direction:
    """What the direction rule makes of a span's contributions (positions, in order): the ``opposed``, left out, and
    of those the ``struck``, whose sender earns a strike (``swarm/bans.py``)."""

    opposed: list[int]
    struck: list[int]


def direction(vectors: Sequence[Vector], norms: Sequence[float]) -> Direction:
    """The contributions that point against the others: those whose agreement (the median of their cosines with
    the other contributions, ``agreements``) is negative, at most ``(n - 1) // 2`` of them, the least agreeing
    first. None among fewer than three contributions: two that disagree cannot tell which one is wrong.

    Of those, the ones that point against the others by at least ``STRIKE_SHARE`` of the kept ones' median agreement
    are struck. An honest contribution of another kind than most (a full replica beside pipeline groups, whose
    updates share a subspace) agrees with them less and is left out now and then with an agreement near zero, while
    a sign-flipped one points against them about as clearly as they agree (``STRIKE_SHARE``'s measurement)."""
    n = len(vectors)
    if n < 3:
        return Direction([], [])
    agreement = agreements(vectors, norms)
    against = sorted((a, i) for i, a in enumerate(agreement) if a < 0)
    opposed = sorted(i for _, i in against[: (n - 1) // 2])
    kept = float(np.median([a for i, a in enumerate(agreement) if i not in opposed]))
    return Direction(opposed, [i for i in opposed if kept > 0 and agreement[i] < -STRIKE_SHARE * kept])


def agreements(vectors: Sequence[Vector], norms: Sequence[float]) -> list[float]:
    """For each contribution, the median of its cosines with each other contribution (the upper one of an even count:
    a contribution half the others oppose is kept; 0 with a zero contribution). A median, not a sum: k hostile keys
    that send one vector between them agree perfectly with each other, and a sum of cosines would count that k - 1
    times against the honest contributions' weak agreement (a pairwise cosine of 0.06 for SparseLoCo); a median
    counts every other key once, by its sign."""
    cosines = gram([v for v in vectors], [1.0 / c if c > 0 else 0.0 for c in norms])
    n = len(vectors)
    return [float(np.sort(np.delete(cosines[i], i))[(n - 1) // 2]) for i in range(n)]


def gram(vectors: Sequence[Vector], scales: Sequence[float]) -> np.ndarray:
    """The (n, n) matrix of dot products of the vectors, each times its scale, in float64. Dense vectors in blocks of
    coordinates (the float64 copies stay small); sparse ones where their positions meet (each vector's positions are
    unique and sorted, so equal positions pair up within one run of the sorted whole)."""
    n = len(vectors)
    out = np.zeros((n, n))
    if all(v.positions is None for v in vectors):
        for start in range(0, len(vectors[0].values), GRAM_BLOCK):
            block = np.stack([v.values[start : start + GRAM_BLOCK].astype(np.float64) * s
                              for v, s in zip(vectors, scales)])
            out += block @ block.T
        return out
    positions = np.concatenate([v.positions for v in vectors])
    owner = np.concatenate([np.full(len(v.positions), i) for i, v in enumerate(vectors)])
    values = np.concatenate([v.values.astype(np.float64) * s for v, s in zip(vectors, scales)])
    order = np.argsort(positions, kind="stable")
    positions, owner, values = positions[order], owner[order], values[order]
    np.add.at(out, (np.arange(n), np.arange(n)), np.bincount(owner, weights=values * values, minlength=n))
    # The pairs of each distance are counted together once they are as many as the matrix has entries, not once a
    # distance: where a thousand contributions select the same positions, runs are a thousand long, and an n x n
    # count per distance made one Gram of 1,012 contributions take 4 s (every member's audit repeats a reducer's)
    pairs: list[np.ndarray] = []
    products: list[np.ndarray] = []
    held = 0  # pairs gathered and not counted yet
    for distance in range(1, n):  # pairs that share a position lie at most n - 1 apart in the sorted whole
        same = positions[distance:] == positions[:-distance]
        if not same.any():  # no run is longer than this distance: none is longer than the next either
            break
        pairs.append(owner[:-distance][same] * n + owner[distance:][same])
        products.append(values[:-distance][same] * values[distance:][same])
        held += len(pairs[-1])
        if held >= n * n:
            out += _counted(pairs, products, n)
            pairs, products, held = [], [], 0
    return out + _counted(pairs, products, n) if pairs else out


def _counted(pairs: list[np.ndarray], products: list[np.ndarray], n: int) -> np.ndarray:
    """The (n, n) sums of ``products`` at their ``pairs`` (i * n + j, i before j in the sorted whole), both ways."""
    half = np.bincount(np.concatenate(pairs), weights=np.concatenate(products), minlength=n * n).reshape(n, n)
    return half + half.T


def mean_factors(norms: Sequence[float], tokens: Sequence[int], clip_factor: float) -> tuple[list[float], list[int]]:
    """Each contribution's factor in the mean, rounded to float32 (its weight factor ``n * w_i / sum(w)`` times its
    clipping scale), and the positions of those clipped to ``clip_factor`` times the lower median norm for the
    tokens trained (scaled by the square root of the tokens, module docstring).
    Factors are exactly 1.0 for contributions of equal tokens within the bound: such a round is the plain mean."""
    n = len(norms)
    if not n:
        return [], []
    total = sum(tokens)
    scales = [1.0] * n if len(set(tokens)) <= 1 else [n * t / total for t in tokens]
    top = max(tokens)
    bound = None
    if clip_factor > 0:
        per_token = sorted(c * math.sqrt(top / t) for c, t in zip(norms, tokens))  # as if trained on the most tokens
        median = per_token[(n - 1) // 2]
        bound = clip_factor * median if median > 0 else None  # a zero median would erase every contribution
    exact, clipped = [], []
    for i, (c, t, s) in enumerate(zip(norms, tokens, scales, strict=True)):
        limit = None if bound is None else bound * math.sqrt(t / top)
        if limit is not None and c > limit:
            clipped.append(i)
            s *= limit / c
        exact.append(s)
    return np.array(exact, dtype=np.float32).tolist(), clipped  # each rounded as np.float32(s) rounds it


def scaled(values: np.ndarray, factor: float) -> np.ndarray:
    """``values`` times a float32 ``factor`` (the very array when it is 1.0: an honest uniform round keeps its bits)."""
    return values if factor == 1.0 else values * np.float32(factor)


def mean_limit(factors: Sequence[float], norms: Sequence[float]) -> float:
    """The longest a mean of contributions of these norms, weighted and clipped by these factors, can be."""
    return sum(f * c for f, c in zip(factors, norms, strict=True)) / max(1, len(norms))


def selector_limit(factors: Sequence[float], norms: Sequence[float]) -> float:
    """The longest a per-coordinate mean over the contributions that selected each coordinate can be: at every
    coordinate a convex combination of theirs, so its square is at most the sum of their squares."""
    return math.sqrt(sum((f * c) ** 2 for f, c in zip(factors, norms, strict=True)))


def within(limit: float, quantize: Callable[[float], tuple[np.ndarray, T]]) -> T:
    """What ``quantize(scale)`` makes (``(decoded values, result)``) at the largest scale, 1 at most, whose decoded
    values are no longer than ``limit``: a reducer that quantizes its span's mean again must not answer more than its
    contributions allow, and rounding (E3M0's nearer power of two lengthens a value by up to 4/3, a group scale rounded
    up) or a reducer's own error buffer (LoCo's, SparseLoCo's) can lengthen a result. Each retry scales by the excess
    (quantization is nearly linear in its input's scale), so one or two are enough; zero as a last resort."""
    scale = 1.0
    for _ in range(MAX_RESCALES):
        decoded, result = quantize(scale)
        length = norm(decoded)
        if length <= limit:
            return result
        scale *= limit / length * (1 - 2**-10)
    return quantize(0.0)[1]


def check_result(values: np.ndarray, limit: float) -> float:
    """The norm of a reducer's result; PayloadError if it is longer than the contributions it names allow."""
    length = norm(values)
    if length > limit * (1 + RESULT_TOLERANCE):
        raise PayloadError(f"an aggregate of norm {length:.4g} where the contributions it names allow at most "
                           f"{limit:.4g}")
    return length


def cosine(a: Vector, b: Vector) -> float:
    """The cosine of two vectors over one span (0 if either is zero)."""
    if a.positions is None and b.positions is None:
        dot = float(np.sum(a.values.astype(np.float64) * b.values.astype(np.float64)))
    else:
        at_a, at_b = common_positions(positions_of(a), positions_of(b))
        dot = float(np.sum(a.values[at_a].astype(np.float64) * b.values[at_b].astype(np.float64)))
    lengths = norm(a.values) * norm(b.values)
    return dot / lengths if lengths > 0 else 0.0


def positions_of(v: Vector) -> np.ndarray:
    return v.positions if v.positions is not None else np.arange(len(v.values))


def energy(v: Vector) -> float:
    """The squared length of ``v`` (float64)."""
    values = v.values.astype(np.float64)
    return float(values @ values)


def distance2(a: Vector, b: Vector) -> float:
    """The squared distance between two vectors over one span (float64)."""
    if a.positions is None and b.positions is None:
        d = a.values.astype(np.float64) - b.values.astype(np.float64)
        return float(d @ d)
    at_a, at_b = common_positions(positions_of(a), positions_of(b))
    d, rest = a.values.astype(np.float64), b.values.astype(np.float64)
    d[at_a] -= rest[at_b]  # where both hold a value; elsewhere each one's own
    only_b = np.ones(len(rest), dtype=bool)
    only_b[at_b] = False
    rest = rest[only_b]
    return float(d @ d + rest @ rest)


def common_positions(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where the sorted, unique positions ``a`` and ``b`` hold the same one: the indices into each, in order. A binary
    search of one in the other, not the sort of both together that numpy's set routines make: an audit at 150M
    compares spans of millions of positions, and the sort held its all-reduce for seconds on two cores."""
    if not len(a) or not len(b):
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    at = np.minimum(np.searchsorted(b, a), len(b) - 1)
    hit = b[at] == a
    return np.flatnonzero(hit), at[hit]


def check_direction(own: Vector, result: Vector) -> None:
    """OpposedResult if a reducer's result points against the recipient's own contribution to the span."""
    c = cosine(own, result)
    if c < -DIRECTION_TOLERANCE:
        raise OpposedResult(f"an aggregate that points against this peer's own contribution (cosine {c:.3f})")
