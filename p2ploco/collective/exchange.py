"""The seam between outer algorithms and transports.

An outer algorithm describes one all-reduce as an :class:`Exchange`: how this replica encodes its
contribution to a span, how a reducer checks and combines the contributions of a span, and how a
replica takes the combined result back. A :class:`Communicator` moves the bytes: in one process
(tests, benchmarks) or over hivemind (real nodes). Both run the very same encode / parse /
combine / receive code, so what a test measures in process is what the swarm does.
"""

from __future__ import annotations

import hashlib
import math
import struct
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np

from p2ploco.collective import robust
from p2ploco.errors import Failure, PayloadError

if TYPE_CHECKING:  # a round's slices, each an exchange: only named here
    from p2ploco.collective.sliced import SlicedExchange

Span = range  # a contiguous run of units; the i-th span of a group is reduced by its i-th peer
PIECE_BYTES = 4 << 20  # a span is reduced, and travels, in pieces of at most this much payload


def partition(num_units: int, parts: int) -> list[Span]:
    """Cut ``num_units`` equal units into ``parts`` contiguous spans of near-equal size."""
    bounds = [num_units * i // parts for i in range(parts + 1)]
    return [range(bounds[i], bounds[i + 1]) for i in range(parts)]


def pieces(exchange: Exchange, span: Span) -> list[Span]:
    """``span`` cut into the fewest near-equal runs of units whose payloads fit ``PIECE_BYTES`` (one for an empty
    span). Each piece is reduced on its own, so that a reducer combines one piece while the next arrives (a
    dense fp32 span of a large model is tens of megabytes); every member cuts every span alike."""
    count = min(max(1, math.ceil(exchange.max_payload_bytes(span) / PIECE_BYTES)), max(1, len(span)))
    return [range(span.start + len(span) * i // count, span.start + len(span) * (i + 1) // count)
            for i in range(count)]


class Exchange(ABC):
    """One replica's side of an all-reduce, and the rules by which a reducer combines replicas.

    Units are the pieces spans are cut from: single elements for dense values, whole chunks for
    chunked sparse ones. Every method is deterministic, so the one reducer of a span produces
    bytes that every replica can apply and end up bit-identical.
    """

    num_units: int

    def partition(self, parts: int) -> list[Span]:
        """The spans of a group of ``parts`` peers, balanced by elements: peer i reduces span i."""
        total = self.numel(range(self.num_units))
        bounds = [0] + [self.unit_at(total * i // parts) for i in range(1, parts)] + [self.num_units]
        return [range(bounds[i], bounds[i + 1]) for i in range(parts)]

    @abstractmethod
    def unit_at(self, element: int) -> int:
        """The unit that holds element number ``element`` (elements counted in unit order)."""

    @abstractmethod
    def fingerprint(self) -> str:
        """What all replicas of a round must share to exchange at all (kind, element type, layout)."""

    @abstractmethod
    def numel(self, span: Span) -> int:
        """Parameters covered by ``span`` (to price a dense fp32 exchange of the same values)."""

    @abstractmethod
    def max_payload_bytes(self, span: Span) -> int:
        """Largest valid contribution to ``span``: anything longer is refused unread."""

    @abstractmethod
    def max_result_bytes(self, span: Span, group_size: int) -> int:
        """Largest valid result for ``span`` in a group of ``group_size``: anything longer is refused unread."""

    def fit_group(self, holders: int) -> None:
        """The group is formed: ``holders`` members contribute to the spans (itself among them; a hub, which
        contributes nothing, is not counted: ``Group.contributors``).
        Called for each attempt's group (a redo's too), before anything is encoded for it. Only a ``SparseExchange``
        with resparsified results sends otherwise in a larger group (fewer values each, so that a result holds all
        of them)."""
        return None

    @abstractmethod
    def encode(self, span: Span) -> bytes:
        """This replica's contribution to ``span``."""

    @abstractmethod
    def parse(self, span: Span, payload: bytes) -> Any:
        """Check and decode a contribution from any replica; raise PayloadError if it is malformed."""

    policy: robust.Policy  # how a reducer bounds the contributions (part of the fingerprint)

    @abstractmethod
    def combine(self, span: Span, contributions: Sequence[Any], factors: Sequence[float]) -> Any:
        """The aggregate of parsed contributions, given in the group's canonical order, each one multiplied by its
        float32 factor first (``robust.mean_factors``: its weight in the mean times its clipping scale). A result that
        is quantized again is kept within ``limit`` of them (``robust.within``)."""

    def limit(self, factors: Sequence[float], norms: Sequence[float]) -> float:
        """The longest the aggregate of contributions of ``norms`` with these ``factors`` can be (a mean's bound)."""
        return robust.mean_limit(factors, norms)

    @abstractmethod
    def result_for(self, aggregate: Any, omit: int | None) -> bytes:
        """The result bytes for a replica whose own contribution is ``contributions[omit]`` (None: not
        among them). A result may leave out what the recipient already holds, such as its own payload."""

    @abstractmethod
    def receive(self, span: Span, result: bytes, receipt: Receipt) -> bytes:
        """Take a span's aggregate from ``result_for(..., omit=receipt.own)`` and return its digest (sha256 of the
        aggregate and the receipt: equal on every replica that took the same, whichever encoding brought it); raise
        PayloadError if it is malformed, longer than the contributions the reducer's ``receipt`` names allow, or
        points against this replica's own contribution (``check``)."""

    def check(self, span: Span, values: robust.Vector, receipt: Receipt) -> None:
        """PayloadError unless a reducer's result (``values``) is what its ``receipt`` allows: the norm it names for
        this replica's own contribution is the true one, the result is no longer than the combined contributions
        allow, and (``Policy.drop_opposed``) it does not point against this replica's own contribution (unless the
        reducer left that out, or the span had fewer than three contributions: two cannot tell which is wrong)."""
        factors, _ = robust.mean_factors(receipt.norms, receipt.tokens, self.policy.clip_factor)
        robust.check_result(values.values, self.limit(factors, receipt.norms))
        if receipt.own is None:
            return
        own = self.parse(span, self.encode(span))  # as any reducer decodes it
        if receipt.norms[receipt.own] != own.norm:
            raise PayloadError(f"a receipt that names norm {receipt.norms[receipt.own]:.6g} for this peer's "
                               f"contribution, which has norm {own.norm:.6g}")
        if self.policy.drop_opposed and len(receipt.norms) + receipt.opposed >= 3:
            robust.check_direction(own.vector, values)

    @abstractmethod
    def piece_digests(self) -> dict[Span, bytes]:
        """The digest of every non-empty span taken so far (``receive``), by span."""

    # Whether anyone holding a piece's contributions can work out its result (``expected``, ``taken``): members audit
    # such results (``sync/audit.py``). LoCo's depend on its reducer's own compensation; Streaming DiLoCo's 4-bit
    # ones are bounded by length and direction only.
    auditable = False

    def expected(self, span: Span, contributions: Sequence[Any], factors: Sequence[float]
                 ) -> tuple[robust.Vector, robust.Vector]:
        """What a reducer that combined these parsed ``contributions`` with these ``factors`` answers for ``span``,
        worked out here without touching this replica's state: the exact weighted mean and the result's values (the
        mean again where the result is exact). What ``audit`` checks a result against."""
        raise TypeError(f"{type(self).__name__} results are not audited")

    def taken(self, span: Span) -> robust.Vector:
        """The values of ``span``'s aggregate as this replica took it (``receive``)."""
        raise TypeError(f"{type(self).__name__} results are not audited")

    def aggregate_digest(self) -> str:
        """Hash of the whole received aggregate: equal on every replica that received the same one."""
        return aggregate_digest(self.piece_digests().items())


def aggregate_digest(pieces: Iterable[tuple[Span, bytes]]) -> str:
    """One digest of an aggregate from the digests of its spans (``Exchange.receive``), in span order: what a
    replica holds, and what a coordinator finds its members vote for from the spans' digests they list."""
    digest = hashlib.sha256()
    for span, piece in sorted(pieces, key=lambda item: item[0].start):
        digest.update(struct.pack("<qq", span.start, span.stop) + piece)
    return digest.hexdigest()


@dataclass(frozen=True)
class Receipt:
    """What a reducer's answer says of a span's aggregate besides its bytes, the same to every member: the norms of
    the contributions it combined and their tokens (canonical order), how many it left out as pointing against
    the others, and the digest of every contribution it weighed (``contribution_digest``: the combined ones, then
    those it left out, each in canonical order). A recipient checks the result against them (``Exchange.check``)
    and that the digest of its own contribution is the one it sent; their digest is part of the aggregate's, so all
    members that commit a round held the same receipt, and the contributions it names are the only ones its result
    can be checked against (``audit``). ``own``: the recipient's position among the combined contributions (None:
    not among them)."""

    norms: tuple[float, ...]
    tokens: tuple[int, ...]
    own: int | None
    opposed: int = 0
    contributions: tuple[bytes, ...] = ()

    def digest(self) -> bytes:
        """The receipt as every member must hold it (``own`` aside): count, norms (float64), tokens, opposed, and the
        contributions' digests."""
        return (struct.pack("<QQ", len(self.norms), self.opposed) + np.asarray(self.norms, "<f8").tobytes()
                + np.asarray(self.tokens, "<u8").tobytes() + b"".join(self.contributions))


CONTRIBUTION_DIGEST_BYTES = 16


def contribution_digest(payload: bytes) -> bytes:
    """What a receipt names a contribution by: 128 bits of its payload's sha256."""
    return hashlib.sha256(payload).digest()[:CONTRIBUTION_DIGEST_BYTES]


def supersede(received: dict[Span, Any], span: Span) -> None:
    """Before ``span``'s aggregate is stored: forget every span received earlier that it overlaps. A redo cuts
    the units among fewer peers, so a complete later attempt replaces all of an earlier one's spans."""
    for earlier in [s for s in received if s.start < span.stop and span.start < s.stop]:
        del received[earlier]


@dataclass
class SpanReduction:
    aggregate: Any  # the exchange's combined value; result_for turns it into bytes for a recipient
    included: list[str]  # senders whose contribution is in the aggregate, in canonical order
    norms: list[float]  # of the included contributions
    tokens: list[int]  # the included contributions' weights (tokens their senders trained)
    rejected: dict[str, str] = field(default_factory=dict)  # sender -> why it was dropped as malformed
    clipped: list[str] = field(default_factory=list)  # senders whose contribution was scaled down
    opposed: list[str] = field(default_factory=list)  # senders left out: their contribution pointed against the rest
    struck: list[str] = field(default_factory=list)  # of the opposed, those that earn a strike (robust.direction)
    # the payloads weighed, the included then the opposed, as the receipt names them: what an auditor is shown
    weighed: list[tuple[str, bytes]] = field(default_factory=list)

    def own_position(self, recipient: str) -> int | None:
        return self.included.index(recipient) if recipient in self.included else None

    @cached_property
    def contributions(self) -> tuple[bytes, ...]:
        """The digest of every contribution weighed, as the receipt names them."""
        return tuple(contribution_digest(payload) for _, payload in self.weighed)

    def receipt_for(self, recipient: str) -> Receipt:
        return Receipt(tuple(self.norms), tuple(self.tokens), self.own_position(recipient), len(self.opposed),
                       self.contributions)

    def result_for(self, exchange: Exchange, recipient: str) -> bytes:
        return exchange.result_for(self.aggregate, self.own_position(recipient))


def reduce_span(exchange: Exchange, span: Span, contributions: Sequence[tuple[str, bytes]],
                tokens: Mapping[str, int] | None = None) -> SpanReduction:
    """What the reducer of ``span`` does (``collective/robust.py``): parse every sender's payload and drop the
    malformed; leave out those that point against the others (``Policy.drop_opposed``); combine the rest, each
    weighted by the tokens its sender trained (``tokens``: sender -> tokens; none: equal weights) and clipped to the
    bound for its tokens.

    ``contributions`` come in the group's canonical order, which fixes the order of the sum.
    """
    w = weigh(exchange, span, contributions, tokens)
    if not w.kept:
        raise PayloadError(f"no valid contribution for span {span.start}:{span.stop}: {w.rejected}")
    return SpanReduction(exchange.combine(span, w.kept_parsed, w.factors), w.included, w.kept_norms, w.weights,
                         w.rejected, w.clipped, w.opposed, w.struck, w.weighed)


@dataclass(frozen=True)
class Weighing:
    """What a reducer makes of a span's contributions before it combines them (``weigh``)."""

    parsed: list[Any]  # the well-formed contributions, canonical order
    senders: list[str]  # theirs
    payloads: list[bytes]  # theirs
    rejected: dict[str, str]  # sender -> why its payload is malformed
    kept: list[int]  # positions in ``parsed`` of those combined
    opposed_at: list[int]  # positions of those left out as pointing against the others
    struck: list[str]  # of those, the senders that earn a strike
    weights: list[int]  # the kept ones' tokens
    factors: list[float]  # the kept ones' factors in the mean
    clipped: list[str]  # senders of the kept ones scaled down

    @property
    def included(self) -> list[str]:
        return [self.senders[i] for i in self.kept]

    @property
    def opposed(self) -> list[str]:
        return [self.senders[i] for i in self.opposed_at]

    @property
    def kept_parsed(self) -> list[Any]:
        return [self.parsed[i] for i in self.kept]

    @property
    def kept_norms(self) -> list[float]:
        return [self.parsed[i].norm for i in self.kept]

    @property
    def weighed(self) -> list[tuple[str, bytes]]:
        """The included then the opposed contributions, as a receipt names them."""
        return [(self.senders[i], self.payloads[i]) for i in [*self.kept, *self.opposed_at]]


def weigh(exchange: Exchange, span: Span, contributions: Sequence[tuple[str, bytes]],
          tokens: Mapping[str, int] | None = None) -> Weighing:
    """``reduce_span``'s steps before the combining: parse, leave out the malformed and those that point against the
    others, weigh and clip the rest (``collective/robust.py``)."""
    parsed, senders, payloads, rejected = [], [], [], {}
    for sender, payload in contributions:
        try:
            parsed.append(exchange.parse(span, payload))
            senders.append(sender)
            payloads.append(payload)
        except PayloadError as e:
            rejected[sender] = str(e)
    norms = [p.norm for p in parsed]
    direction = (robust.direction([p.vector for p in parsed], norms) if exchange.policy.drop_opposed
                 else robust.Direction([], []))
    kept = [i for i in range(len(parsed)) if i not in direction.opposed]
    weights = [tokens[senders[i]] if tokens else 1 for i in kept]
    factors, clipped = robust.mean_factors([norms[i] for i in kept], weights, exchange.policy.clip_factor)
    return Weighing(parsed, senders, payloads, rejected, kept, list(direction.opposed),
                    [senders[i] for i in direction.struck], weights, factors, [senders[kept[i]] for i in clipped])


# An audit's tolerance: a result may be this much farther from the exact mean of its contributions, in energy, than
# the auditor's own result of them: another device's Top-k breaks ties its own way, and its sums round their own way
# (``FLOAT_SLACK`` of the energies).
ERROR_EXCESS = 0.1
FLOAT_SLACK = 1e-9


def audit(exchange: Exchange, span: Span, contributions: Sequence[tuple[str, bytes]], tokens: Mapping[str, int],
          receipt: Receipt, values: robust.Vector) -> str | None:
    """Why the result ``values`` that a reducer answered for ``span`` with ``receipt`` is not what ``contributions``
    make (the payloads it weighed, each with its sender, in the receipt's order: the combined, then those left out);
    None if it is, within another device's arithmetic. ``tokens``: each sender's, as the group lists them. The
    checks: the payloads are those the receipt names (each member checked its own), they weigh and leave out as the
    receipt says, and the result is no farther from their exact mean than this replica's own result of them
    (``ERROR_EXCESS``): whatever a result adds where none of them selected a value, or beside their mean, counts
    in full. Only for an ``Exchange.auditable`` one."""
    if tuple(contribution_digest(payload) for _, payload in contributions) != receipt.contributions:
        return "the contributions it shows are not those its receipt names"
    order = sorted(range(len(contributions)), key=lambda i: contributions[i][0])  # canonical order: the sum's
    w = weigh(exchange, span, [contributions[i] for i in order], tokens)
    combined = sorted(sender for sender, _ in contributions[:len(receipt.norms)])
    if (w.rejected or w.included != combined
            or (tuple(w.kept_norms), tuple(w.weights), len(w.opposed)) != (receipt.norms, receipt.tokens,
                                                                             receipt.opposed)):
        return "its receipt is not what the contributions it names make of the span"
    mean, own = exchange.expected(span, w.kept_parsed, w.factors)
    slack = FLOAT_SLACK * (robust.energy(mean) + robust.energy(values))
    if robust.distance2(values, mean) > (1 + ERROR_EXCESS) * robust.distance2(own, mean) + slack:
        return "its result is farther from the mean of the contributions it names than a result of them can be"
    return None


@dataclass(frozen=True)
class Traffic:
    """What an all-reduce moved for this peer and how long it took (a redone round's attempts added up, a Streaming
    DiLoCo round's fragments too)."""

    bytes_sent: int = 0  # payload bytes this peer sent: contributions to reducers, results to senders
    bytes_received: int = 0
    dense_fp32_bytes: int = 0  # what a dense fp32 butterfly among the same peers would send + receive
    contribution_bytes: int = 0  # this peer's encoded contribution over all spans (what one replica uploads)
    params: int = 0  # parameters the all-reduce covered
    seconds: float = 0.0
    # bytes (sent + received) of each all-reduce the round was made of (Streaming DiLoCo: one per fragment);
    # empty: the round was one all-reduce
    sync_bytes: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class AllReduceResult:
    """How an all-reduce ended for this peer: whether the group committed its aggregate, who was left out and why,
    and its ``traffic``. The communicator builds it once the round is decided."""

    peers: list[str]  # the group that took part, in canonical order (just this peer when alone)
    # the group agreed on the aggregate this peer holds: it may apply it (False: late, aborted, dropped)
    committed: bool
    excluded: bool = False  # this peer was left out (late or dropped) while others went on: it must catch up
    dropped: list[str] = field(default_factory=list)  # peers left out of some span's aggregate
    clipped: list[str] = field(default_factory=list)  # peers whose contribution to this peer's span was scaled down
    opposed: list[str] = field(default_factory=list)  # peers this peer left out of its span: against the others'
    attempts: int = 1  # butterflies run: 2 when the round was redone
    failures: list[Failure] = field(default_factory=list)  # what went wrong here, one entry per event
    tokens: int = 0  # the weight this peer's contribution carried: tokens trained for it (0: it sent none)
    traffic: Traffic = field(default_factory=Traffic)
    # the committed aggregate's weights: each member whose contribution is in it, and its tokens as the group settled
    # them (a hub's 0 left out); empty when nothing was committed
    weights: dict[str, int] = field(default_factory=dict)
    refused_by: list[str] = field(default_factory=list)  # reducers that rejected this peer's contribution


def dense_fp32_bytes(exchange: Exchange, spans: Sequence[Span], my_index: int | None) -> int:
    """Send + receive of a dense fp32 butterfly: our values for others' spans, and n-1 copies of our span each way
    (``my_index`` None: we reduce no span, and send and receive every value once)."""
    others = sum(exchange.numel(span) for i, span in enumerate(spans) if i != my_index)
    mine = 0 if my_index is None else exchange.numel(spans[my_index])
    return 2 * 4 * (others + (len(spans) - 1) * mine)


@dataclass
class PendingAllReduce:
    """An all-reduce under way in the background (``Communicator.start_all_reduce``).

    ``result`` comes once the exchange holds the round's aggregate (or the round failed here); ``grouped`` is
    set once this peer knows whom it averages with (or that it averages with nobody): from then on the
    peer's public record may move on to its next round without changing how this one is formed.
    """

    result: Future[AllReduceResult]
    grouped: threading.Event

    def wait(self, timeout: float | None = None) -> AllReduceResult:
        """The result once the all-reduce has ended; its exception if it raised one."""
        return self.result.result(timeout)


class Communicator(ABC):
    @abstractmethod
    def all_reduce(self, exchange: Exchange | SlicedExchange, round_index: int, name: str) -> AllReduceResult:
        """Every replica of the round calls this with its own exchange; on return the exchange holds
        the same aggregate on every replica that took part. ``name`` tells apart the all-reduces of one
        round (parameter groups, fragments, stages)."""

    def start_all_reduce(self, exchange: Exchange | SlicedExchange, round_index: int, name: str
                         ) -> PendingAllReduce:
        """``all_reduce`` without waiting for it: the caller trains on and collects the result later. Here in
        a thread of its own (its group is known only when it ends); a transport that runs on an event loop
        schedules it there instead."""
        pending = PendingAllReduce(Future(), threading.Event())

        def run() -> None:
            if not pending.result.set_running_or_notify_cancel():
                return
            try:
                pending.result.set_result(self.all_reduce(exchange, round_index, name))
            except BaseException as e:  # handed to whoever waits for the result, like any Future
                pending.result.set_exception(e)
            finally:
                pending.grouped.set()

        threading.Thread(target=run, name=f"all-reduce {name} {round_index}", daemon=True).start()
        return pending


class SittingOut(Communicator):
    """The all-reduce of a round this peer sits out (``RoundSchedule.sit_out``): nothing is sent and nothing
    applied, so the outer algorithm keeps the round's work for a later contribution, as for any round not applied."""

    def __init__(self, me: str):
        self.me = me

    def all_reduce(self, exchange: Exchange | SlicedExchange, round_index: int, name: str) -> AllReduceResult:
        return AllReduceResult([self.me], committed=False)
