"""Butterfly all-reduce over hivemind's p2p streams, returning the aggregate itself.

A round's exchange is made of named slices (``collective/sliced.py``), and each slice is reduced
among the members that hold it (the group lists them): with n holders that can be dialled (its reducers,
canonical order), the slice's units are cut into n spans and reducer i reduces span i. Every other holder
streams it its contribution to span i, reducer i combines the contributions in group order (each one bounded
and weighted by its sender's tokens first, ``collective/robust.py``) and sends the very same result bytes back
to each of them. A holder behind a NAT (``swarm/reachability.py``) reduces nothing: it only sends its
contributions and reads the results on the streams it opened. A full replica
thus reduces a span of every slice, a stage peer a span of its own. Every peer thus applies identical aggregates: unlike
hivemind's stock runner, which returns "average - own part" and leaves peers an ulp (or a codec
error) apart.

A reducer drops a sender from its span, at once and with the reason logged, when:

- its message is malformed (a header that is not a p2ploco map, a field of the wrong type, a span
  that is not ours, an oversized or undecodable payload, an absurd norm), or it is banned here (for
  such a message, or for what ``swarm/bans.py`` lists). The sender is *rejected*: it is out of the round (it votes
  "dropped") and banned here for ``swarm.ban_rounds`` rounds (``swarm/bans.py``), even if the message came before
  this peer knew the group, or named no group at all;
- its stream breaks or ends mid-message, this peer cannot reach it to deliver our own contribution,
  or it sends nothing within the round's transfer deadline (``swarm/deadlines.py``: an allowance measured from
  this reducer's recent all-reduces, within ``swarm.allreduce_timeout``, plus the round's payload at the slowest
  link the group reports, so that a slow but honest link is waited for). Its contribution is *missed*: no ban and
  no blame (it may have crashed, or its link broke once), it votes "missing", and a redo of the round takes it
  along.

The reducer always finishes its span with the contributions it has, and every member keeps sending
its contributions to the other reducers even after one refused it, so nobody waits for it in vain.

A span travels in pieces of at most ``PIECE_BYTES`` (``collective/exchange.py``) of payload: a dense
fp32 span of a large model is tens of megabytes. As hivemind's averager sends parts, a sender sends a
reducer its pieces one after another, and the reducer reduces each piece and sends its result back as
soon as every contribution to it is in, while the next pieces still arrive. Each piece is reduced on its
own (its own senders, norms and clipping bound), so a piece is what the rules above call a span; all
pieces of one span share one transfer deadline, so a silent sender costs one deadline, not one per
piece.

A reducer's result is checked, not trusted (``collective/robust.py``). Its answer names the norm of every
contribution it combined and whom it left out as pointing against the others; a member checks that the norm
named for its own is the true one, that the result is no longer than those contributions allow and does not
point against its own contribution (``Exchange.check``), and votes on a digest that covers the named norms, so
the members that commit held the same ones. After the butterfly each member audits one random piece another reducer
answered it (``sync/audit.py``: a result that adds a direction none of the contributions sent). A result that
fails is refused like a malformed one: the reducer is rejected from this member's spans, banned here, and accused
in its vote (two accusers and the reducer's vote no longer counts: the round is redone without it). A sender that
a reducer leaves out as pointing clearly against the others (``robust.direction``) is struck; ``STRIKES`` such
rounds within ``STRIKE_ROUNDS`` earn it a ban here (``swarm/bans.py``).

A contribution to a piece, a wire message (``swarm/wire.py``) on a stream of its own, whose payload is
the slice's encoding of the piece::

    {v, group_id, round, slice, span: [piece start, piece stop], coordinator, listen} + contribution

(``listen``: a hub's request for the piece's result, with no contribution: ``Group.contributors``; it is answered
as any member is, and never counted in the aggregate.)

answered ``{v, status: ok, included: [members in the aggregate], norms: [their contributions' norms], opposed:
[members left out as pointing against the others], contributions: [the digest of each contribution weighed, included
then opposed: each member checks its own], signature}`` + result (members by their places in the group's sorted list:
the answer stays ~12 B a member, 12 kB at 1,024), ``{v, status: rejected, reason}`` (malformed: out
of the round), or ``{v, status: missed, reason}`` (not in the aggregate through no fault of the sender's). The
sender closes the stream once it has read the answer (``wire.hang_up``).

A contribution may come before its reducer knows the group (the others learnt of it first): the reducer waits for
the group, at most ``swarm.allreduce_timeout``. Not when it never will know it: a member takes part in one group per
round, and one that takes part in this round at another coordinator than the one that formed the sender's group
(``sync/whereabouts.py``; the contribution names that coordinator) answers at once ``{v, status: missed, reason,
elsewhere: true}``, or as soon as it moves on while the contribution waits. Its sender stops waiting for that
member's own contributions; a member whose every other member answers so holds a dead group, and joins the round at
the next coordinator instead (``SwarmCommunicator``). Naming a made-up coordinator only gets its sender refused.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Annotated, Any

from hivemind.p2p import P2P
from pydantic import Field, StringConstraints, model_validator

from p2ploco import faults
from p2ploco.collective.exchange import (
    CONTRIBUTION_DIGEST_BYTES,
    Exchange,
    Receipt,
    Span,
    SpanReduction,
    Traffic,
    contribution_digest,
    dense_fp32_bytes,
    pieces,
    reduce_span,
)
from p2ploco.collective.robust import OpposedResult
from p2ploco.collective.sliced import SlicedExchange
from p2ploco.errors import Failure, PayloadError, ProtocolError, TransportError
from p2ploco.swarm import wire
from p2ploco.swarm.bans import Bans
from p2ploco.swarm.deadlines import TransferDeadline
from p2ploco.swarm.evidence import (
    MAX_SIGNATURE,
    Claim,
    Proof,
    Signed,
    Signer,
    result_statement,
    signed_by,
)
from p2ploco.swarm.messages import (
    MAX_PEERS,
    Digest,
    Message,
    Norm,
    PeerId,
    Positions,
    Reason,
    Round,
    SliceName,
    decode,
    status_of,
)
from p2ploco.sync.audit import Audits
from p2ploco.sync.clip_streaks import ClipStreaks
from p2ploco.sync.group import Group
from p2ploco.sync.whereabouts import Whereabouts

logger = logging.getLogger(__name__)

UNKNOWN_GROUPS_PER_PEER = 16  # pieces of groups this peer does not know yet that one sender may wait on
MAX_UNITS = 1 << 40  # units (values, or chunks) of a slice a span may name


class ReduceStatus(enum.StrEnum):
    OK = "ok"  # the span's aggregate follows
    REJECTED = "rejected"  # the sender's contribution was malformed: it is out of this round
    MISSED = "missed"  # the sender's contribution is not in the aggregate: its link failed, or it came too late


class AllReduceError(ProtocolError):
    """This peer could not obtain the aggregate of some span; the round's all-reduce failed for it.
    ``failure``: what went wrong, as the round's record counts it."""

    def __init__(self, message: str, failure: Failure):
        super().__init__(message)
        self.failure = failure


class DroppedFromRound(AllReduceError):
    """A reducer rejected this peer's contribution as malformed: it is out of this round, and must not block
    the others."""


class ReducerElsewhere(AllReduceError):
    """A reducer takes part in this round in a group another coordinator formed, or in another version of this
    group: it never takes part in this peer's group, sends it nothing, and reduces nothing for it."""


class OtherVersion(ReducerElsewhere):
    """A reducer holds another version of this peer's group: ``version`` (its digest), which the coordinator signed
    (``grant``) as it signed this peer's: with both, the coordinator is proven to have handed out two."""

    def __init__(self, message: str, version: str, grant: bytes):
        super().__init__(message, Failure.MISSED)
        self.version, self.grant = version, grant


@dataclass(frozen=True)
class Evidence:
    """A piece's aggregate as this peer took it: its reducer, its digest (``Exchange.receive``) and the reducer's
    signature of it (``evidence.result_statement``). A vote lists them, so that a reducer that answered members
    different results is caught by its own signatures."""

    slice: str
    span: Span
    reducer: str
    digest: bytes
    signature: bytes
    # what an auditor of the piece needs (``sync/audit.py``), where this peer took it from another reducer: the
    # receipt it came with, and the senders of the contributions the receipt names, in its order
    receipt: Receipt | None = field(default=None, compare=False)
    weighed: tuple[str, ...] = field(default=(), compare=False)


@dataclass(frozen=True)
class Delivery:
    """Our contribution to one piece, sent to its reducer, and what came of it."""

    reducer: str
    encoded: int  # bytes of our contribution
    sent: int = 0  # of them on the wire (0: it never went out)
    received: int = 0  # bytes of the aggregate that came back
    left_out: frozenset[str] = frozenset()  # contributors to the slice whose contributions are not in that aggregate
    combined: frozenset[str] = frozenset()  # members whose contributions are in it, as the reducer's answer names them
    opposed_ours: bool = False  # the reducer left our contribution out: it pointed against the others'
    accused: bool = False  # its answer was malformed, or its result pointed against our contribution
    error: AllReduceError | None = None  # None: we hold the piece's aggregate
    evidence: Evidence | None = None  # the piece's aggregate as we took it, with the reducer's signature


@dataclass(frozen=True)
class Attempt:
    """One butterfly among a group, as it went for this peer (``ButterflyAllReduce.run``)."""

    traffic: Traffic  # this attempt's bytes and parameters (the communicator times the whole round)
    dropped: frozenset[str]  # members left out of some span's aggregate
    rejected: frozenset[str]  # members whose contributions to our spans we rejected as malformed (or banned here)
    refused: frozenset[str]  # reducers whose result we refused (malformed, too long, against our contribution)
    # members whose contributions are in our aggregates, and reducers that sent us theirs: they took part with a
    # daemon of their own (a member the coordinator named that has none delivers nothing)
    delivered: frozenset[str]
    clipped: list[str]  # senders whose contribution to our spans was scaled down
    opposed: list[str]  # senders we left out of our spans: against the others'
    failures: list[Failure]  # what went wrong here, one entry per event
    error: AllReduceError | None = None  # None: the exchange holds the aggregate of every span
    elsewhere: frozenset[str] = frozenset()  # reducers that take part in this round in another group
    refused_by: frozenset[str] = frozenset()  # reducers that rejected our contribution as malformed
    evidence: tuple[Evidence, ...] = ()  # every non-empty piece's aggregate we took, in slice and span order


@dataclass(frozen=True)
class Reduced:
    """A piece this peer reduced: what it combined, and the result it answers every member, signed."""

    reduction: SpanReduction
    evidence: Evidence


@dataclass(frozen=True)
class _Plan:
    """One attempt's work for this peer: the pieces it reduces, and those it sends (with the pieces it reduces of
    the same slice, the reducer and the route to it)."""

    sessions: list[_ReducerSession]
    sends: list[tuple[list[_ReducerSession], str, _Route, Span]]
    dense_fp32_bytes: int  # what a dense fp32 butterfly among the same peers would send + receive
    params: int  # parameters the all-reduce covers


@dataclass
class _Route:
    """This peer's pieces of one slice to one reducer: sent one after another, and not tried again once it
    failed."""

    group: Group
    slice: str
    exchange: Exchange
    transfer: float  # seconds any one transfer to this reducer may take: the bound (``TransferDeadline.seconds``)
    turn: asyncio.Lock = field(default_factory=asyncio.Lock)
    failure: AllReduceError | None = None


@dataclass
class _ReducerSession:
    """One piece of our span of one slice in one group's all-reduce, as the contributions come in."""

    group: Group
    slice: str
    span: Span
    exchange: Exchange
    senders: set[str]  # remote group members that owe us a contribution
    listeners: set[str]  # remote hubs (no contribution: ``Group.contributors``) that take the result all the same
    transfer: float  # seconds any one transfer to this reducer may take (``TransferDeadline.expected``)
    deadline: float  # time.monotonic() by which every contribution must be in (all pieces of a span alike)
    payloads: dict[str, bytes] = field(default_factory=dict)
    began: float = field(default_factory=time.monotonic)
    delivered_at: dict[str, float] = field(default_factory=dict)  # sender -> time.monotonic() its payload came in
    # senders not in, through no fault of theirs -> (what this reducer saw go wrong, or None where our own send to
    # them failed: that failure is counted once, by the send), why
    missed: dict[str, tuple[Failure | None, str]] = field(default_factory=dict)
    rejected: dict[str, str] = field(default_factory=dict)  # dropped for malformed data (or banned here)
    connected: set[str] = field(default_factory=set)  # senders that opened a stream to us
    settled: set[str] = field(default_factory=set)  # senders whose stream with us has ended
    bytes_in: int = 0
    bytes_out: int = 0
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    served: asyncio.Event = field(default_factory=asyncio.Event)
    result: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())

    def __post_init__(self) -> None:
        self._check()

    def deliver(self, sender: str, payload: bytes) -> None:
        self.payloads[sender] = payload
        self.delivered_at[sender] = time.monotonic()
        self._check()

    def arrivals(self) -> dict[str, float]:
        """Seconds from this piece's start to each sender's contribution; a sender that timed out counts as the
        whole transfer (so an allowance too short for everyone grows), one whose link failed not at all."""
        timed_out = {p: self.transfer for p, (failure, _) in self.missed.items() if failure == Failure.TIMEOUT}
        return {**timed_out, **{p: at - self.began for p, at in self.delivered_at.items()}}

    def miss(self, sender: str, failure: Failure | None, reason: str) -> None:
        """Go on without ``sender``'s contribution (its link failed, or it is too late), unless it is in already
        (it then counts). Not the sender's fault: it votes "missing", and a redo takes it along. A hub's link that
        failed: the result is not waited on to reach it."""
        if sender in self.listeners:
            self.settle(sender)
        elif self._pending(sender):
            self.missed[sender] = (failure, reason)
            logger.warning(f"round {self.group.round_index}: going on without {sender[-8:]}'s contribution to span "
                           f"{self.span.start}:{self.span.stop}: {reason}")
            self._check()

    def reject(self, sender: str, reason: str) -> None:
        """Drop ``sender`` for sending malformed data (or for being banned here): it is out of the round."""
        if self._pending(sender):
            self.rejected[sender] = reason
            logger.warning(f"round {self.group.round_index}: dropped {sender[-8:]} from span "
                           f"{self.span.start}:{self.span.stop}: {reason}")
            self._check()

    def refusal(self, sender: str) -> tuple[ReduceStatus, str] | None:
        """Why ``sender``'s contribution is not in this piece's aggregate (None: it is, or may still be)."""
        if sender in self.rejected:
            return ReduceStatus.REJECTED, self.rejected[sender]
        if sender in self.missed:
            return ReduceStatus.MISSED, self.missed[sender][1]
        return None

    def settle(self, sender: str) -> None:
        self.settled.add(sender)
        self._check()

    def _pending(self, sender: str) -> bool:
        return sender in self.senders and sender not in self.payloads and self.refusal(sender) is None

    def _check(self) -> None:
        out = set(self.missed) | set(self.rejected)
        if self.senders <= set(self.payloads) | out:
            self.arrived.set()
        if self.senders | self.listeners <= self.settled | (out - self.connected):
            self.served.set()


class ButterflyAllReduce:
    def __init__(self, p2p: P2P, me: str, run_id: str, deadline: TransferDeadline, bans: Bans, signer: Signer,
                 keys: Callable[[str], bytes | None], rates: Callable[[Iterable[str]], list[float]] = lambda peers: [],
                 whereabouts: Whereabouts | None = None, audits: Audits | None = None):
        """``signer``: signs the results this peer answers; ``keys``: a peer's public key, as its record names it
        (None: unknown), which its signatures are checked with; ``rates``: the link rates (Mbit/s, 0: not stated) the
        given peers report; ``whereabouts``: where this peer takes part in each round (the matchmaker's notes), so
        that a contribution for a group it never takes part in is refused at once; ``audits``: what this peer shows
        auditors of its pieces, and how it audits one piece of another reducer after each attempt (None: neither)."""
        self.p2p, self.me, self.run_id, self.deadline, self.bans, self.rates = p2p, me, run_id, deadline, bans, rates
        self.signer, self.keys, self.audits = signer, keys, audits
        self.whereabouts = whereabouts if whereabouts is not None else Whereabouts()
        self.timeout = deadline.base  # for what does not grow with the payload: headers, answers, lookups
        self.handler_name = f"p2ploco/{run_id}/reduce"
        self._sessions: dict[tuple[str, str, int], asyncio.Future] = {}  # (group id, slice, piece start) -> session
        self._awaited_by: dict[tuple[str, str, int], str] = {}  # a session not known yet -> the sender that waits
        self.current_round = 0  # the round of the latest all-reduce here: malformed data is banned from it on
        self.clip_streaks = ClipStreaks()

    async def start(self) -> None:
        await self.p2p.add_binary_stream_handler(self.handler_name, self._serve)

    async def run(self, group: Group, exchange: SlicedExchange) -> Attempt:
        """All-reduce every slice of ``exchange`` among its holders in ``group``. Unless the attempt names an error,
        the exchange then holds the aggregate of every span; its traffic, failures and accusations count also when it
        failed here (the vote reports them). A bug in this peer is raised."""
        loop = asyncio.get_running_loop()
        self.current_round = group.round_index
        for slice_name, part in exchange.parts.items():  # off the event loop: it may compress again
            await loop.run_in_executor(None, part.fit_group, len(group.contributors(slice_name)))
        plan = self._plan(group, exchange)
        sessions = plan.sessions
        sends = [asyncio.create_task(self._contribute(*send)) for send in plan.sends]
        reduced: list[Reduced] = []
        own_bytes = 0
        error: AllReduceError | None = None
        try:
            for session in sessions:
                own = None
                if self.me in group.contributors(session.slice):
                    own = await loop.run_in_executor(None, session.exchange.encode, session.span)
                    own_bytes += len(own)
                reduced.append(await self._reduce(session, own))
            # Every contribution is delivered (or fails) before we report, even after a reducer refused us.
            await asyncio.gather(*sends, return_exceptions=True)
            for session in sessions:  # results handed to every sender
                await _bounded(session.served.wait(), session.transfer)
            arrivals: dict[str, float] = {}  # each sender's last piece, for the next rounds' deadlines
            for session in sessions:
                for sender, seconds in session.arrivals().items():
                    arrivals[sender] = max(seconds, arrivals.get(sender, 0.0))
            self.deadline.arrived(arrivals.values())
        except PayloadError as e:  # our own span could not be reduced (no valid contribution), or not received
            error = AllReduceError(f"{e!r}", Failure.MALFORMED)
        finally:
            for task in sends:
                task.cancel()
            outcomes = await asyncio.gather(*sends, return_exceptions=True)  # reap them
            for session in sessions:
                self._sessions.pop((group.group_id, session.slice, session.span.start), None)
        for outcome in outcomes:
            if isinstance(outcome, BaseException) and not isinstance(outcome, asyncio.CancelledError):
                raise outcome  # a bug in this peer, not a peer's fault
        deliveries = [outcome for outcome in outcomes if isinstance(outcome, Delivery)]
        if self.audits is not None and self.audits.checking and error is None:
            deliveries = await self._audit(group, exchange, deliveries)
        traffic = Traffic(sum(d.sent for d in deliveries) + sum(s.bytes_out for s in sessions),
                          sum(d.received for d in deliveries) + sum(s.bytes_in for s in sessions),
                          plan.dense_fp32_bytes, own_bytes + sum(d.encoded for d in deliveries), plan.params)
        return self._attempt(sessions, reduced, deliveries, traffic, error)

    def _plan(self, group: Group, exchange: SlicedExchange) -> _Plan:
        """Who reduces what among ``group``: our sessions for the pieces we reduce (open from now on to their
        senders), and the pieces we send."""
        loop = asyncio.get_running_loop()
        sessions: list[_ReducerSession] = []
        sends: list[tuple[list[_ReducerSession], str, _Route, Span]] = []
        dense, params = 0, 0
        # Every link carries about one whole contribution each way and phase (ours out to the reducers, the others'
        # in to our spans; then the results), and the slices move at once, so their sizes add up. Pieces interleave
        # the phases: the last pieces of the contributions share a link with the results of the first ones, so the
        # deadline by which every contribution must be in allows for both phases' bytes. Our wait for those is what
        # this peer measured (``TransferDeadline.expected``); our sends wait for their reducers' answers to the bound,
        # as the reducers decide when they answer.
        volume = sum(part.max_payload_bytes(range(part.num_units)) for part in exchange.parts.values())
        rates = self.rates(group.peers)
        transfer, answered = self.deadline.expected(2 * volume, rates), self.deadline.seconds(2 * volume, rates)
        deadline = time.monotonic() + transfer
        for slice_name, part in exchange.parts.items():
            holders, reducers = group.holders(slice_name), group.reducers(slice_name)
            contributors = set(group.contributors(slice_name))
            index = reducers.index(self.me) if self.me in reducers else None  # None: this peer only dials out
            spans = part.partition(len(reducers))
            ours = [] if index is None else [
                _ReducerSession(group, slice_name, piece, part, contributors - {self.me},
                                set(holders) - contributors - {self.me}, transfer, deadline)
                for piece in pieces(part, spans[index])]
            for session in ours:
                for peer in session.senders & self.bans.active(group.round_index):
                    session.reject(peer, f"banned here: {self.bans.reason(peer)}")
                pending = self._sessions.setdefault((group.group_id, slice_name, session.span.start),
                                                    loop.create_future())
                if not pending.done():
                    pending.set_result(session)
            sessions += ours
            dense += dense_fp32_bytes(part, spans, index)
            params += sum(part.numel(span) for span in spans)
            for peer, span in zip(reducers, spans):
                if peer != self.me:
                    route = _Route(group, slice_name, part, answered)
                    sends += [(ours, peer, route, piece) for piece in pieces(part, span)]
        return _Plan(sessions, sends, dense, params)

    async def _audit(self, group: Group, exchange: SlicedExchange, deliveries: list[Delivery]) -> list[Delivery]:
        """Audit one piece another reducer answered this peer, drawn at random (``sync/audit.py``): ``deliveries``
        with that one refused if it fails, its reducer banned here."""
        audited = [i for i, d in enumerate(deliveries) if d.evidence is not None and d.evidence.receipt is not None
                   and len(d.evidence.span) and exchange.parts[d.evidence.slice].auditable]
        if not audited:
            return deliveries
        at = audited[secrets.randbelow(len(audited))]
        delivery = deliveries[at]
        e = delivery.evidence
        part = exchange.parts[e.slice]
        transfer = self.deadline.seconds(self.audits.most_shown(part, e.span, e.weighed), self.rates([e.reducer]))
        why = await self.audits.check(group, part, e.slice, e.span, e.reducer, e.receipt, e.weighed, transfer)
        if why is None:
            return deliveries
        reason = f"it failed an audit of its result for span {e.span.start}:{e.span.stop}: {why}"
        logger.warning(f"round {group.round_index}: refused reducer {e.reducer[-8:]}: {reason}")
        self.bans.ban(e.reducer, group.round_index, reason)
        failed = replace(delivery, accused=True, evidence=None,
                         error=AllReduceError(f"no aggregate from reducer {e.reducer[-8:]}: {reason}",
                                              Failure.MALFORMED))
        return [*deliveries[:at], failed, *deliveries[at + 1:]]

    def _attempt(self, sessions: list[_ReducerSession], reduced: list[Reduced], deliveries: list[Delivery],
                traffic: Traffic, error: AllReduceError | None) -> Attempt:
        """The attempt as it went: who was left out or accused, what went wrong, and the error that decides this
        peer's vote (``error``: our own spans' failure, which outranks the others)."""
        reductions = [r.reduction for r in reduced]
        errors = [d.error for d in deliveries if d.error is not None]
        failures = [Failure.OPPOSED for d in deliveries if d.opposed_ours]
        failures += [failure for s in sessions for failure, _ in s.missed.values() if failure is not None]
        failures += [Failure.MALFORMED for s in sessions for _ in s.rejected]
        failures += [e.failure for e in ([error] if error is not None else []) + errors]
        if error is None and errors:  # being refused outranks a missing span: the coordinator must not wait for us
            error = next((e for e in errors if isinstance(e, DroppedFromRound)), errors[0])
        rejected = {p for s in sessions for p in s.rejected} | {p for r in reductions for p in r.rejected}
        failed = {d.reducer for d in deliveries if d.error is not None}
        return Attempt(
            traffic,
            dropped=frozenset(rejected | {p for s in sessions for p in s.missed}
                              | {p for d in deliveries for p in d.left_out}),
            rejected=frozenset(rejected), refused=frozenset(d.reducer for d in deliveries if d.accused),
            # A member that reduces nothing (behind a NAT) has only the reducers' word for who took part: without it
            # its partners would be the hubs that reduced for it alone, whose step times are none
            delivered=frozenset(({d.reducer for d in deliveries} - failed)
                                | {p for r in reductions for p in (*r.included, *r.opposed)}
                                | ({p for d in deliveries if d.error is None for p in d.combined} if not sessions
                                   else set())) - {self.me},
            clipped=sorted({p for r in reductions for p in r.clipped}),
            opposed=sorted({p for r in reductions for p in r.opposed}),
            failures=failures, error=error,
            elsewhere=frozenset(d.reducer for d in deliveries if isinstance(d.error, ReducerElsewhere)),
            refused_by=frozenset(d.reducer for d in deliveries if isinstance(d.error, DroppedFromRound)),
            evidence=tuple(sorted((e for e in [*(r.evidence for r in reduced), *(d.evidence for d in deliveries)]
                                   if e is not None and len(e.span)), key=lambda e: (e.slice, e.span.start))))

    async def _reduce(self, session: _ReducerSession, own: bytes | None) -> Reduced:
        """Combine the span's contributions (``own``: this peer's, None for a hub's, which sends none), take the result
        as every member does, and sign its digest: the one result this peer answers for the piece."""
        try:
            await asyncio.wait_for(session.arrived.wait(), max(0.0, session.deadline - time.monotonic()))
        except TimeoutError:
            for sender in session.senders | (session.listeners - session.connected):  # a hub not there by now: gone
                session.miss(sender, Failure.TIMEOUT, f"sent nothing within {session.transfer:.0f} s")
        contributions = [(p, own if p == self.me else session.payloads[p]) for p in session.group.peers
                         if (p == self.me and own is not None) or p in session.payloads]
        loop = asyncio.get_running_loop()
        try:
            reduction = await loop.run_in_executor(None, reduce_span, session.exchange, session.span, contributions,
                                                   session.group.tokens_of())
            digest = await loop.run_in_executor(None, session.exchange.receive, session.span,
                                                reduction.result_for(session.exchange, self.me),
                                                reduction.receipt_for(self.me))
        except PayloadError as e:
            session.result.set_exception(e)
            session.result.exception()  # retrieved here; handlers re-raise it to their senders
            raise
        if self.audits is not None:
            self.audits.keep(session.group, session.slice, session.span,
                             tuple(payload for _, payload in reduction.weighed))
        for sender, reason in reduction.rejected.items():
            logger.warning(f"round {session.group.round_index}: dropped {sender[-8:]} from the round: {reason}")
            if sender != self.me:
                self.bans.ban(sender, session.group.round_index, f"malformed contribution: {reason}")
        round_index, where = session.group.round_index, f"{session.span.start}:{session.span.stop}"
        for sender in reduction.clipped:  # for a few rounds at a time, no news (``clip_streaks.py``)
            logger.info(f"round {round_index}: clipped the contribution of {sender[-8:]} to span {where} to the "
                        f"span's bound (outer.clip_factor x the median norm, scaled to its tokens)")
            self.clip_streaks.clipped(sender, round_index)
        for sender in reduction.opposed:
            reason = f"its contribution to span {where} pointed against the others'"
            struck = sender != self.me and sender in reduction.struck
            logger.warning(f"round {round_index}: left out the contribution of {sender[-8:]}: {reason}"
                           + (" (clearly: a strike)" if struck else ""))
            if struck:
                self.bans.strike(sender, round_index, reason)
        await faults.hit_async("allreduce.reduce", session.group.round_index)
        span = session.span
        signature = self.signer.sign(result_statement(self.run_id, session.group.digest, session.slice, span.start,
                                                      span.stop, digest))
        reduced = Reduced(reduction, Evidence(session.slice, span, self.me, digest, signature))
        session.result.set_result(reduced)
        return reduced

    async def _contribute(self, ours: list[_ReducerSession], peer: str, route: _Route, span: Span) -> Delivery:
        """Send our contribution to the piece ``span`` to its reducer ``peer`` (after our earlier pieces to it) and
        take back the piece's aggregate. ``ours``: the pieces we reduce of the same slice, which ``peer`` owes
        contributions to."""
        delivery = await self._send_piece(ours, peer, route, span)
        # Refused, not gone: our other pieces still go out, so that it waits for none in vain. Unreachable, broken or
        # out of time: the next pieces would fare no better.
        if delivery.error is not None and not isinstance(delivery.error, DroppedFromRound) and route.failure is None:
            route.failure = delivery.error
        return delivery

    async def _send_piece(self, ours: list[_ReducerSession], peer: str, route: _Route, span: Span) -> Delivery:
        group, exchange = route.group, route.exchange
        loop = asyncio.get_running_loop()
        listens = self.me not in group.contributors(route.slice)  # a hub: it sends nothing, takes the result
        payload = b"" if listens else await loop.run_in_executor(None, exchange.encode, span)
        sent, received, left_out, combined, opposed_ours, accused = 0, 0, frozenset(), frozenset(), False, False
        error: AllReduceError | None = None
        evidence: Evidence | None = None
        writer: asyncio.StreamWriter | None = None
        try:
            async with route.turn:  # one piece on the wire to a reducer at a time: it reduces one as the next comes
                if route.failure is not None:
                    raise route.failure
                reader, writer = await asyncio.wait_for(wire.open_stream(self.p2p, peer, self.handler_name),
                                                        self.timeout)
                header = {"group_id": group.group_id, "round": group.round_index, "slice": route.slice,
                          "span": [span.start, span.stop], "coordinator": group.coordinator, "listen": listens,
                          "version": group.digest}
                await asyncio.wait_for(wire.write_message(writer, header, payload), route.transfer)
            sent = len(payload)
            await faults.hit_async("allreduce.contribute", group.round_index)
            # The reducer may wait a transfer's time for the slowest sender before it answers, and the answer
            # takes another.
            reply, result = await asyncio.wait_for(
                wire.read_message(reader, exchange.max_result_bytes(span, len(group.peers))), 2 * route.transfer)
            receipt, included, opposed, signature = parse_reply(reply, group, self.me, None if listens else payload)
            if receipt.own is None and not listens:
                opposed_ours = True
                logger.warning(f"round {group.round_index}: reducer {peer[-8:]} left this peer's contribution to span "
                               f"{span.start}:{span.stop} out: it points against the others'")
            digest = await loop.run_in_executor(None, exchange.receive, span, result, receipt)
            key = self.keys(peer)
            if key is None or not signed_by(key, result_statement(self.run_id, group.digest, route.slice, span.start,
                                                                  span.stop, digest), signature):
                raise PayloadError("a result that its reducer's key did not sign")
            evidence = Evidence(route.slice, span, peer, digest, signature, receipt, (*included, *opposed))
            received = len(result)
            left_out = frozenset(group.contributors(route.slice)) - set(included) - {self.me}
            combined = frozenset(included)
        except AllReduceError as e:  # the reducer refused our contribution or went on without it (or failed before)
            if isinstance(e, ReducerElsewhere):  # it sends us nothing either
                for piece in ours:
                    piece.miss(peer, None, "it takes part in this round in another group")
            if isinstance(e, OtherVersion):
                self._convict_coordinator(group, e)
            error = e
        except TransportError as e:  # the reducer crashed, or the link to it broke: it will not send us its part
            for piece in ours:
                piece.miss(peer, None, f"the link to it failed ({e})")
            error = AllReduceError(f"no aggregate from reducer {peer[-8:]}: {e}", wire.failure_of(e))
        except TimeoutError:  # slow is not dead: its own contributions may still come
            error = AllReduceError(f"no aggregate from reducer {peer[-8:]} in time", Failure.TIMEOUT)
        except OpposedResult as e:  # what an honest result does rarely, a hostile one always: refused and accused (a
            # reducer every member refuses is redone without), and struck rather than banned at once
            accused = True
            self.bans.strike(peer, group.round_index, f"its result for span {span.start}:{span.stop} pointed against "
                                                      f"this peer's own contribution")
            error = AllReduceError(f"no aggregate from reducer {peer[-8:]}: {e}", Failure.MALFORMED)
        except PayloadError as e:  # its answer or aggregate is malformed (or exceeds what it combined): it is out of
            # our spans too where its contribution is not in yet, banned here, and our vote accuses it
            reason = f"malformed answer to our contribution: {e}"
            for piece in ours:
                piece.reject(peer, reason)
            accused = True
            self.bans.ban(peer, group.round_index, reason)
            error = AllReduceError(f"no aggregate from reducer {peer[-8:]}: {e}", Failure.MALFORMED)
        finally:
            if writer is not None:
                writer.close()
        return Delivery(peer, len(payload), sent, received, left_out, combined, opposed_ours, accused, error, evidence)

    def _convict_coordinator(self, group: Group, other: OtherVersion) -> None:
        """A reducer answered that it holds another version of ``group``, signed by its coordinator as ours is: the
        two signatures prove that the coordinator handed out two versions of one group."""
        key = self.keys(group.coordinator)
        if key is None or not group.grant or group.coordinator == self.me:
            return
        proof = Proof(claim=Claim.GROUP, accused=group.coordinator, key=key, group_id=group.group_id,
                      first=Signed(digest=bytes.fromhex(group.digest), signature=group.grant),
                      second=Signed(digest=bytes.fromhex(other.version), signature=other.grant))
        self.bans.convict(proof, group.round_index)

    async def _serve(self, stream_info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A group member sends us its contribution to our span; answer with the span's aggregate."""
        sender = str(stream_info.peer_id)
        session: _ReducerSession | None = None
        try:
            header, length = await asyncio.wait_for(wire.read_header(reader), self.timeout)
            contribution = decode(Contribution, header)
            round_index, span = contribution.round, contribution.span
            session = await self._session_of(contribution, sender)
            session.connected.add(sender)
            if contribution.listen != (sender in session.listeners):
                raise PayloadError("a hub's contribution, or a member's request for the result without one")
            if contribution.listen and length:
                raise PayloadError("a request for the result that carries a payload")
            refusal = session.refusal(sender)
            if refusal is not None:  # dropped already (unreachable, banned, too late): no new offence
                raise _Refused(*refusal)
            if sender in session.payloads:
                raise PayloadError("second contribution to the same span")
            expected = [session.span.start, session.span.stop]
            if span != expected or round_index != session.group.round_index:
                raise PayloadError(f"contribution for span {span} of round {round_index}, this peer reduces "
                                   f"{expected} of round {session.group.round_index}")
            if not contribution.listen:
                limit = session.exchange.max_payload_bytes(session.span)
                payload = await asyncio.wait_for(wire.read_payload(reader, length, limit), session.transfer)
                session.bytes_in += len(payload)
                session.deliver(sender, payload)
            try:
                reduced: Reduced = await asyncio.wait_for(asyncio.shield(session.result), 2 * session.transfer)
            except PayloadError as e:  # this reducer could not combine its span at all: not the sender's fault
                raise _Refused(ReduceStatus.MISSED, f"the span could not be reduced: {e}") from None
            reduction = reduced.reduction
            refusal = session.refusal(sender) or (
                (ReduceStatus.REJECTED, reduction.rejected[sender]) if sender in reduction.rejected else None)
            if refusal is not None:
                raise _Refused(*refusal)
            reply, result = self.answer(session.group, session.exchange, reduced, sender)
            await asyncio.wait_for(wire.write_message(writer, reply, result), session.transfer)
            session.bytes_out += len(result)
        except _Refused as e:
            await _refuse(writer, e.status, e.reason)
        except _UnknownGroup as e:  # a group this peer never joined (it was late, or refused it), or another version
            await _refuse(writer, ReduceStatus.MISSED, str(e), e.elsewhere, e.version)
        except (TransportError, TimeoutError) as e:  # the sender's link failed, or it is too slow
            reason = f"its link failed ({e})" if isinstance(e, TransportError) else "it timed out"
            if session is not None:
                session.miss(sender, wire.failure_of(e), reason)
            await _refuse(writer, ReduceStatus.MISSED, reason)
        except PayloadError as e:  # malformed content: its sender is out of every span it owes us, and banned
            reason = f"malformed contribution: {e}"
            for pending in self._sessions.values():
                if pending.done() and sender in pending.result().senders:
                    pending.result().reject(sender, reason)
            self.bans.ban(sender, self.current_round, reason)
            await _refuse(writer, ReduceStatus.REJECTED, reason)
        except Exception:  # a bug: keep serving, miss the sender rather than wait for it, and say where it is
            logger.exception(f"contribution from {sender[-8:]} failed unexpectedly")
            if session is not None:
                session.miss(sender, Failure.MISSED, "this reducer failed on its contribution (see its log)")
        finally:
            if session is not None:
                session.settle(sender)
            await wire.hang_up(reader, writer, session.transfer if session is not None else self.timeout)

    def answer(self, group: Group, exchange: Exchange, reduced: Reduced, sender: str) -> tuple[dict[str, Any], bytes]:
        """What this reducer answers ``sender`` for a piece it ``reduced`` (the same result, receipt and signature for
        every member of ``group``): the answer's header and the result."""
        place = {peer: i for i, peer in enumerate(group.peers)}
        reduction = reduced.reduction
        reply = {"status": ReduceStatus.OK, "included": [place[p] for p in reduction.included],
                 "norms": reduction.norms, "opposed": [place[p] for p in reduction.opposed],
                 "contributions": list(reduction.contributions), "signature": reduced.evidence.signature}
        return reply, reduction.result_for(exchange, sender)

    async def _session_of(self, contribution: Contribution, sender: str) -> _ReducerSession:
        """Our session of the piece of the contribution's slice that begins where its span does, in its group, which
        ``sender`` belongs to, waiting (bounded) if the group's other members learnt of it first; _UnknownGroup at
        once if this peer takes part in the contribution's round elsewhere (module docstring), or moves there while
        it waits."""
        group_id, slice_name, start = contribution.group_id, contribution.slice, contribution.span[0]
        key = (group_id, slice_name, start)
        pending = self._sessions.get(key)
        if pending is None or not pending.done():
            self._refuse_if_elsewhere(contribution)
        if pending is None:  # its sender learnt of the group first: a few such slots per sender, so that one that
            # sends made-up group ids takes up its own slots only
            if sum(by == sender for by in self._awaited_by.values()) >= UNKNOWN_GROUPS_PER_PEER:
                raise _UnknownGroup(f"contribution for unknown group {group_id[:32]!r}: this peer holds "
                                    f"{UNKNOWN_GROUPS_PER_PEER} of the sender's already")
            pending = self._sessions[key] = asyncio.get_running_loop().create_future()
            self._awaited_by[key] = sender
        deadline = time.monotonic() + self.timeout
        try:
            while not pending.done():  # woken by the group, or by this peer moving to another coordinator
                moved = asyncio.ensure_future(self.whereabouts.moved().wait())
                try:
                    await asyncio.wait({pending, moved}, timeout=max(0.0, deadline - time.monotonic()),
                                       return_when=asyncio.FIRST_COMPLETED)
                finally:
                    moved.cancel()
                if not pending.done():
                    if time.monotonic() >= deadline:
                        raise _UnknownGroup(f"contribution for unknown group {group_id[:32]!r}, slice "
                                            f"{slice_name[:32]!r} or piece {start}")
                    self._refuse_if_elsewhere(contribution)
            session: _ReducerSession = pending.result()
        except _UnknownGroup:
            if not pending.done():
                self._sessions.pop(key, None)
            raise
        finally:
            self._awaited_by.pop(key, None)
        if contribution.version != session.group.digest:  # the coordinator handed out two versions of the group: the
            # sender's shows ours (signed) and the coordinator is proven; neither member is at fault
            session.miss(sender, None, "it holds another version of the group")
            raise _UnknownGroup(f"contribution for another version of group {group_id[:32]!r}", elsewhere=True,
                                version=session.group)
        if sender not in session.senders | session.listeners:
            raise PayloadError(f"{sender[-8:]} is not a member of this group")
        return session

    def _refuse_if_elsewhere(self, contribution: Contribution) -> None:
        """_UnknownGroup if this peer takes part in the contribution's round at another coordinator than the one that
        formed its group: it never takes part in that group."""
        if not contribution.coordinator:  # not named: the group may still come
            return
        at = self.whereabouts.elsewhere(contribution.round, contribution.coordinator)
        if at is not None:
            raise _UnknownGroup(f"contribution for a group this peer is not in: it takes part in round "
                                f"{contribution.round} at coordinator {at[-8:]}", elsewhere=True)


GroupDigest = Annotated[str, StringConstraints(pattern="^[0-9a-f]{64}$")]  # ``Group.digest``
Signature = Annotated[bytes, Field(max_length=MAX_SIGNATURE)]
ContributionDigest = Annotated[bytes, Field(min_length=CONTRIBUTION_DIGEST_BYTES, max_length=CONTRIBUTION_DIGEST_BYTES)]


class Contribution(Message):
    group_id: Digest
    round: Round
    slice: SliceName
    span: Annotated[list[Annotated[int, Field(ge=0, le=MAX_UNITS)]], Field(min_length=2, max_length=2)]  # [start, stop]
    coordinator: PeerId = ""  # who formed the sender's group ("": not said; the reducer waits for the group)
    listen: bool = False  # a hub's request for the span's result: no payload (``Group.contributors``)
    version: GroupDigest  # the digest of the group as the sender holds it: a reducer holding another refuses it


class ReduceAnswer(Message):
    status: status_of(ReduceStatus)
    reason: Reason = ""
    included: Positions = []  # with ok: the members whose contributions make up the aggregate that follows
    norms: Annotated[list[Norm], Field(max_length=MAX_PEERS)] = []  # of the included contributions, in order
    opposed: Positions = []  # with ok: members whose contributions it left out as pointing against the others
    # with ok: the digest of each contribution it weighed, the included then the opposed (``Receipt``)
    contributions: Annotated[list[ContributionDigest], Field(max_length=MAX_PEERS)] = []
    signature: Signature = b""  # with ok: the reducer's signature of the result (``evidence.result_statement``)
    elsewhere: bool = False  # with missed: the reducer takes part in this round in another group ...
    version: GroupDigest | None = None  # ... or in another version of this group, which its coordinator signed:
    grant: Signature = b""

    @model_validator(mode="after")
    def _aligned(self) -> ReduceAnswer:
        if len(self.norms) != len(self.included):
            raise ValueError("norms that do not name one norm per included contribution")
        if len(self.contributions) != len(self.included) + len(self.opposed):
            raise ValueError("contributions that do not name one digest per contribution weighed")
        if self.elsewhere and self.status != ReduceStatus.MISSED:
            raise ValueError("elsewhere, with another status than missed")
        if self.status == ReduceStatus.OK and not self.signature:
            raise ValueError("a result without its reducer's signature")
        if self.version is not None and not (self.elsewhere and self.grant):
            raise ValueError("another version of the group, not elsewhere or not signed")
        return self


def parse_reply(reply: dict[str, Any], group: Group, me: str, sent: bytes | None
                ) -> tuple[Receipt, list[str], list[str], bytes]:
    """What a reducer's answer says of the aggregate that follows it, the members whose contributions make it up and
    those it left out (each in canonical order), and the reducer's signature of it; DroppedFromRound if the reducer
    rejected ours as malformed, ReducerElsewhere if it takes part in this round in another group (OtherVersion: in
    another version of this one), AllReduceError if it went on without it, PayloadError if the answer is malformed:
    it leaves this peer out or names another contribution of this peer's than the one it ``sent`` (None: a hub,
    which sends none), names non-members, or leaves out as many contributions as it keeps (at most a minority may
    point against the others)."""
    answer = decode(ReduceAnswer, reply)
    if answer.status == ReduceStatus.REJECTED:
        raise DroppedFromRound(f"a reducer rejected this peer's contribution: {answer.reason[:200]}", Failure.REJECTED)
    if answer.version is not None and answer.version != group.digest:
        raise OtherVersion(f"a reducer holds another version of this peer's group: {answer.reason[:200]}",
                           answer.version, answer.grant)
    if answer.elsewhere:
        raise ReducerElsewhere(f"a reducer is not in this peer's group: {answer.reason[:200]}", Failure.MISSED)
    if answer.status == ReduceStatus.MISSED:
        raise AllReduceError(f"a reducer went on without this peer's contribution: {answer.reason[:200]}",
                             Failure.MISSED)
    if any(i >= len(group.peers) for i in (*answer.included, *answer.opposed)):
        raise PayloadError(f"an aggregate that names member places beyond the group's {len(group.peers)}")
    members = [group.peers[i] for i in answer.included]
    left_out = [group.peers[i] for i in answer.opposed]
    included, opposed = set(members), set(left_out)
    if (sent is not None and me not in included | opposed) or included & opposed:
        raise PayloadError("the aggregate leaves this peer out, or both keeps and leaves out a member")
    if sent is not None and answer.contributions[[*members, *left_out].index(me)] != contribution_digest(sent):
        raise PayloadError("an aggregate whose receipt names another contribution of this peer's than it sent")
    tokens = group.tokens_of()
    if any(tokens.get(p, 1) == 0 for p in included | opposed):
        raise PayloadError("an aggregate that names a contribution of a hub, which sends none")
    if len(opposed) > (len(included) + len(opposed) - 1) // 2:
        raise PayloadError(f"an aggregate that leaves out {len(opposed)} contributions as pointing against the "
                           f"others and keeps {len(included)}: only a minority may be left out")
    own = members.index(me) if me in included else None
    receipt = Receipt(tuple(answer.norms), tuple(tokens[p] for p in members), own, len(opposed),
                      tuple(answer.contributions))
    return receipt, members, left_out, answer.signature


class _Refused(Exception):
    """The reducer refuses the sender's contribution: rejected (malformed) or missed (its link, or too late)."""

    def __init__(self, status: ReduceStatus, reason: str):
        super().__init__(reason)
        self.status, self.reason = status, reason


class _UnknownGroup(Exception):
    """A contribution for a group this peer never joined (it was late, or refused it): not the sender's fault.
    ``elsewhere``: this peer takes part in the round in another group, and never joins that one; ``version``: the
    version of the sender's group that this peer holds, where it holds another."""

    def __init__(self, reason: str, elsewhere: bool = False, version: Group | None = None):
        super().__init__(reason)
        self.elsewhere, self.version = elsewhere, version


async def _refuse(writer: asyncio.StreamWriter, status: ReduceStatus, reason: str, elsewhere: bool = False,
                  version: Group | None = None) -> None:
    """Tell a sender why its contribution is not in the aggregate (``elsewhere``: this peer takes part in the round
    in another group; ``version``: in this version of the sender's group, signed by its coordinator); it may have
    hung up already."""
    answer: dict[str, Any] = {"status": status, "reason": reason[:200]}
    if elsewhere:
        answer["elsewhere"] = True
    if version is not None and version.grant:
        answer.update(version=version.digest, grant=version.grant)
    try:
        await asyncio.wait_for(wire.write_message(writer, answer), 1.0)
    except (TransportError, TimeoutError):
        pass


async def _bounded(awaitable: Any, timeout: float) -> None:
    try:
        await asyncio.wait_for(awaitable, timeout)
    except TimeoutError:
        logger.info("some senders did not collect the aggregate of our span in time")
