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

A reducer drops a sender from its span (from each piece of it, below), at once and with the reason logged, when:

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
own (its own senders, norms and clipping bound): the rules above hold piece by piece. All pieces of one
span share one transfer deadline, so a silent sender costs one deadline, not one per piece.

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

    {v, group_id, round, slice, span: [piece start, piece stop], coordinator, listen, version} + contribution

(the wire's ``span`` names the piece)

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

The member's side is ``sync/contribute.py``, the reducer's ``sync/serve.py``, the values both hand back
``sync/reduce_values.py``: each transfer of a piece ends in an ``Outcome``, and what this peer does about the other
side (miss, reject, ban, strike, convict) is decided in one place, ``ButterflyAllReduce._act_on``.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

from hivemind.p2p import P2P

from p2ploco import faults
from p2ploco.aio import in_time
from p2ploco.collective.exchange import Exchange, Span, Traffic, dense_fp32_bytes, pieces
from p2ploco.collective.sliced import SlicedExchange
from p2ploco.errors import Failure, PayloadError, TransportError
from p2ploco.swarm import wire
from p2ploco.swarm.bans import Bans
from p2ploco.swarm.deadlines import TransferDeadline
from p2ploco.swarm.evidence import Claim, Proof, Signed, Signer
from p2ploco.swarm.messages import decode
from p2ploco.sync.audit import Audits
from p2ploco.sync.contribute import Contributor, Route
from p2ploco.sync.group import Group
from p2ploco.sync.liveness import ELSEWHERE, Lost, gone
from p2ploco.sync.reduce_values import (
    AllReduceError,
    Attempt,
    Contribution,
    Delivery,
    DroppedFromRound,
    OtherVersion,
    Reduced,
    ReducerElsewhere,
    ReduceStatus,
    TransferOutcome,
)
from p2ploco.sync.serve import Inbox, Reducer, Refusal, Served, broken, malformed, refuse, refused, take
from p2ploco.sync.whereabouts import Whereabouts

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Plan:
    """One attempt's work for this peer: the pieces it reduces, and those it sends (with the pieces it reduces of
    the same slice, the reducer and the route to it)."""

    inboxes: list[Inbox]
    sends: list[tuple[list[Inbox], str, Route, Span]]
    dense_fp32_bytes: int  # what a dense fp32 butterfly among the same peers would send + receive
    params: int  # parameters the all-reduce covers


class ButterflyAllReduce:
    def __init__(self, p2p: P2P, me: str, run_id: str, deadline: TransferDeadline, bans: Bans, signer: Signer,
                 keys: Callable[[str], bytes | None], rates: Callable[[Iterable[str]], list[float]],
                 lost: Lost,
                 whereabouts: Whereabouts | None = None, audits: Audits | None = None):
        """``signer``: signs the results this peer answers; ``keys``: a peer's public key, as its record names it
        (None: unknown), which its signatures are checked with; ``rates``: the link rates (Mbit/s, 0: not stated) the
        given peers report; ``lost``: those of the given peers behind NATs that are gone, and how that is known
        (``liveness.lost_behind_nats``);
        ``whereabouts``: where this peer takes part in each round (the matchmaker's notes), so
        that a contribution for a group it never takes part in is refused at once; ``audits``: what this peer shows
        auditors of its pieces, and how it audits one piece of another reducer after each attempt (None: neither)."""
        self.p2p, self.me, self.run_id, self.deadline, self.bans, self.rates = p2p, me, run_id, deadline, bans, rates
        self.lost = lost
        self.signer, self.keys, self.audits = signer, keys, audits
        self.whereabouts = whereabouts if whereabouts is not None else Whereabouts()
        self.timeout = deadline.base  # for what does not grow with the payload: headers, answers, lookups
        self.handler_name = f"p2ploco/{run_id}/reduce"
        self.contributor = Contributor(p2p, me, run_id, self.handler_name, self.timeout, keys)
        self.reducer = Reducer(me, run_id, self.timeout, bans, signer, self.whereabouts, audits)
        self.current_round = 0  # the round of the latest all-reduce here: malformed data is banned from it on

    async def start(self) -> None:
        await self.p2p.add_binary_stream_handler(self.handler_name,
                                                 faults.seam("answer.contributions", self, self._serve))

    async def run(self, group: Group, exchange: SlicedExchange) -> Attempt:
        """All-reduce every slice of ``exchange`` among its holders in ``group``. Unless the attempt names an error,
        the exchange then holds the aggregate of every span; its traffic, failures and accusations count also when it
        failed here (the vote reports them). A bug in this peer is raised."""
        loop = asyncio.get_running_loop()
        self.current_round = group.round_index
        for slice_name, part in exchange.parts.items():  # off the event loop: it may compress again
            await loop.run_in_executor(None, part.fit_group, len(group.contributors(slice_name)))
        plan = self._plan(group, exchange)
        contribute = faults.seam("reduce.contribute", self, self._contribute)
        sends = [asyncio.create_task(contribute(*send)) for send in plan.sends]
        probe = asyncio.create_task(self._probe_owing(plan.inboxes, group))
        reduced: list[Reduced] = []
        own_bytes = 0
        error: AllReduceError | None = None
        try:
            for inbox in plan.inboxes:
                own = None
                if self.me in group.contributors(inbox.slice):
                    own = await loop.run_in_executor(None, inbox.exchange.encode, inbox.piece)
                    own_bytes += len(own)
                reduced.append(await self.reducer.reduce(inbox, own))
            # Every contribution is delivered (or fails) before we report, even after a reducer refused us.
            await asyncio.gather(*sends, return_exceptions=True)
            for inbox in plan.inboxes:  # results handed to every sender
                await _bounded(inbox.served.wait(), inbox.transfer)
            self._measure(plan.inboxes)
        except PayloadError as e:  # our own span could not be reduced (no valid contribution), or not received
            error = AllReduceError(f"{e!r}", Failure.MALFORMED)
        finally:
            for task in [*sends, probe]:
                task.cancel()
            outcomes = await asyncio.gather(*sends, probe, return_exceptions=True)  # reap them
            for inbox in plan.inboxes:
                self.reducer.close(inbox)
        for outcome in outcomes:
            if isinstance(outcome, BaseException) and not isinstance(outcome, asyncio.CancelledError):
                raise outcome  # a bug in this peer, not a peer's fault
        deliveries = [outcome for outcome in outcomes if isinstance(outcome, Delivery)]
        if self.audits is not None and self.audits.checking and error is None:
            deliveries = await self._audit(group, exchange, deliveries)
        traffic = Traffic(sum(d.sent for d in deliveries) + sum(i.bytes_out for i in plan.inboxes),
                          sum(d.received for d in deliveries) + sum(i.bytes_in for i in plan.inboxes),
                          plan.dense_fp32_bytes, own_bytes + sum(d.encoded for d in deliveries), plan.params)
        return self._attempt(plan.inboxes, reduced, deliveries, traffic, error)

    async def _probe_owing(self, inboxes: list[Inbox], group: Group) -> None:
        """Every PROBE_EVERY seconds, look at each member that owes one of our pieces a contribution and has not
        begun to send it (one that began sends on a stream whose end tells): one that crashed (after it answered our
        own contributions, or our send to it would have failed) is not waited for until the deadline
        (``liveness.gone``)."""
        while True:
            await asyncio.sleep(wire.PROBE_EVERY)
            silent = {p for inbox in inboxes for p in inbox.owing() - inbox.connected}
            for peer, reason in sorted((await gone(self.p2p, self.run_id, group, silent, self.lost)).items()):
                if reason == ELSEWHERE:  # not its link's failure: it refused the group, or never got it
                    self._act_on(peer, TransferOutcome.ELSEWHERE, reason, inboxes, group.round_index)
                else:
                    self._act_on(peer, TransferOutcome.MISSED, reason, inboxes, group.round_index, Failure.UNREACHABLE)

    def _measure(self, inboxes: list[Inbox]) -> None:
        """Each sender's last piece, for the next rounds' deadlines."""
        arrivals: dict[str, float] = {}
        for inbox in inboxes:
            for sender, seconds in inbox.arrivals().items():
                arrivals[sender] = max(seconds, arrivals.get(sender, 0.0))
        self.deadline.arrived(arrivals.values())

    def _plan(self, group: Group, exchange: SlicedExchange) -> _Plan:
        """Who reduces what among ``group``: our inboxes for the pieces we reduce (open from now on to their senders),
        and the pieces we send."""
        inboxes: list[Inbox] = []
        sends: list[tuple[list[Inbox], str, Route, Span]] = []
        dense, params = 0, 0
        # Every link carries about one whole contribution each way and phase (ours out to the reducers, the others'
        # in to our spans; then the results), and the slices move at once, so their sizes add up. Pieces interleave
        # the phases: the last pieces of the contributions share a link with the results of the first ones, so the
        # deadline by which every contribution must be in allows for both phases' bytes. Our wait for those is what
        # this peer measured (``TransferDeadline.expected``); our sends wait for their reducers' answers to the bound,
        # as the reducers decide when they answer.
        # A drawn reducer of a large group (``group.MAX_REDUCERS``) takes that many senders' pieces of a span of that
        # size: its link carries their share of a whole contribution.
        volume = int(sum(part.max_payload_bytes(range(part.num_units))
                         * max(1.0, len(group.contributors(name)) / max(1, len(group.reducers(name))))
                         for name, part in exchange.parts.items()))
        rates = self.rates(group.peers)
        transfer, answered = self.deadline.expected(2 * volume, rates), self.deadline.seconds(2 * volume, rates)
        deadline = time.monotonic() + transfer
        for slice_name, part in exchange.parts.items():
            holders, reducers = group.holders(slice_name), group.reducers(slice_name)
            contributors = set(group.contributors(slice_name))
            index = reducers.index(self.me) if self.me in reducers else None  # None: this peer only dials out
            spans = part.partition(len(reducers))
            ours = [] if index is None else [
                Inbox(group, slice_name, piece, part, contributors - {self.me}, set(holders) - contributors - {self.me},
                      transfer, deadline)
                for piece in pieces(part, spans[index])]
            for inbox in ours:
                for peer in inbox.senders & self.bans.active(group.round_index):
                    inbox.reject(peer, f"banned here: {self.bans.reason(peer)}")
                self.reducer.open(inbox)
            inboxes += ours
            dense += dense_fp32_bytes(part, spans, index)
            params += sum(part.numel(span) for span in spans)
            for peer, span in zip(reducers, spans):
                if peer != self.me:
                    route = Route(group, slice_name, part, answered)
                    sends += [(ours, peer, route, piece) for piece in pieces(part, span)]
        return _Plan(inboxes, sends, dense, params)

    async def _audit(self, group: Group, exchange: SlicedExchange, deliveries: list[Delivery]) -> list[Delivery]:
        """Audit one piece another reducer answered this peer, drawn at random (``sync/audit.py``): ``deliveries``
        with that one refused if it fails, its reducer banned here."""
        audited = [i for i, d in enumerate(deliveries) if d.evidence is not None and d.evidence.receipt is not None
                   and len(d.evidence.piece) and exchange.parts[d.evidence.slice].auditable]
        if not audited:
            return deliveries
        at = audited[secrets.randbelow(len(audited))]
        delivery = deliveries[at]
        e = delivery.evidence
        part = exchange.parts[e.slice]
        transfer = self.deadline.seconds(self.audits.most_shown(part, e.piece, e.weighed), self.rates([e.reducer]))
        why = await self.audits.check(group, part, e.slice, e.piece, e.reducer, e.receipt, e.weighed, transfer)
        if why is None:
            return deliveries
        reason = f"it failed an audit of its result for span {e.piece.start}:{e.piece.stop}: {why}"
        logger.warning(f"round {group.round_index}: refused reducer {e.reducer[-8:]}: {reason}")
        failed = replace(delivery, outcome=TransferOutcome.MALFORMED, reason=reason, evidence=None,
                         error=AllReduceError(f"no aggregate from reducer {e.reducer[-8:]}: {reason}",
                                              Failure.MALFORMED))
        self._act_on(e.reducer, failed.outcome, failed.reason, (), group.round_index)
        return [*deliveries[:at], failed, *deliveries[at + 1:]]

    def _attempt(self, inboxes: list[Inbox], reduced: list[Reduced], deliveries: list[Delivery], traffic: Traffic,
                 error: AllReduceError | None) -> Attempt:
        """The attempt as it went: who was left out or accused, what went wrong, and the error that decides this
        peer's vote (``error``: our own spans' failure, which outranks the others)."""
        reductions = [r.reduction for r in reduced]
        errors = [d.error for d in deliveries if d.error is not None]
        failures = [Failure.OPPOSED for d in deliveries if d.opposed_ours]
        failures += [failure for i in inboxes for failure, _ in i.missed.values() if failure is not None]
        failures += [Failure.MALFORMED for i in inboxes for _ in i.rejected]
        failures += [e.failure for e in ([error] if error is not None else []) + errors]
        if error is None and errors:  # being refused outranks a missing span: the coordinator must not wait for us
            error = next((e for e in errors if isinstance(e, DroppedFromRound)), errors[0])
        rejected = {p for i in inboxes for p in i.rejected} | {p for r in reductions for p in r.rejected}
        failed = {d.reducer for d in deliveries if d.error is not None}
        return Attempt(
            traffic,
            dropped=frozenset(rejected | {p for i in inboxes for p in i.missed}
                              | {p for d in deliveries for p in d.left_out}),
            rejected=frozenset(rejected), refused=frozenset(d.reducer for d in deliveries if d.accused),
            # A member that reduces nothing (behind a NAT) has only the reducers' word for who took part: without it
            # its partners would be the hubs that reduced for it alone, whose step times are none
            delivered=frozenset(({d.reducer for d in deliveries} - failed)
                                | {p for r in reductions for p in (*r.included, *r.opposed)}
                                | ({p for d in deliveries if d.error is None for p in d.combined} if not inboxes
                                   else set())) - {self.me},
            clipped=sorted({p for r in reductions for p in r.clipped}),
            opposed=sorted({p for r in reductions for p in r.opposed}),
            failures=failures, error=error,
            elsewhere=frozenset(d.reducer for d in deliveries if isinstance(d.error, ReducerElsewhere)),
            refused_by=frozenset(d.reducer for d in deliveries if isinstance(d.error, DroppedFromRound)),
            evidence=tuple(sorted((e for e in [*(r.evidence for r in reduced), *(d.evidence for d in deliveries)]
                                   if e is not None and len(e.piece)), key=lambda e: (e.slice, e.piece.start))))

    def _act_on(self, peer: str, outcome: TransferOutcome, reason: str, inboxes: Iterable[Inbox], round_index: int,
                failure: Failure | None = None, proof: Proof | None = None) -> None:
        """What this peer does about ``peer``, the other side of a transfer of a piece, for what came of it: the one
        place that misses, rejects, bans, strikes and convicts. ``inboxes``: our pieces that ``peer`` owes
        contributions to and that go on without it; ``failure``: what a miss counts (None: counted once, elsewhere);
        ``proof``: that the group's coordinator handed out two versions of it."""
        # no blame for a miss: it votes "missing", and a redo takes it along
        if outcome in (TransferOutcome.MISSED, TransferOutcome.ELSEWHERE):
            for inbox in inboxes:
                inbox.miss(peer, failure, reason)
        elif outcome == TransferOutcome.MALFORMED:  # out of every piece it owes us, banned here; a reducer is accused
            for inbox in inboxes:
                inbox.reject(peer, reason)
            self.bans.ban(peer, round_index, reason)
        elif outcome == TransferOutcome.OPPOSED:  # what an honest result does rarely, a hostile one always: refused
            # and accused (a reducer every member refuses is redone without), and struck rather than banned at once
            self.bans.strike(peer, round_index, reason)
        if proof is not None:
            self.bans.convict(proof, round_index)

    async def _contribute(self, ours: list[Inbox], peer: str, route: Route, piece: Span) -> Delivery:
        """Send our contribution to ``piece`` to its reducer ``peer`` (after our earlier pieces to it) and take back
        the piece's aggregate. ``ours``: the pieces we reduce of the same slice, which ``peer`` owes contributions
        to."""
        delivery = await self.contributor.send(peer, route, piece)
        proof = self._two_versions(route.group, delivery.error) if isinstance(delivery.error, OtherVersion) else None
        self._act_on(peer, delivery.outcome, delivery.reason, ours, route.group.round_index, proof=proof)
        # Refused, not gone: our other pieces still go out, so that it waits for none in vain. Unreachable, broken or
        # out of time: the next pieces would fare no better.
        if delivery.error is not None and not isinstance(delivery.error, DroppedFromRound) and route.failure is None:
            route.failure = delivery.error
        return delivery

    def _two_versions(self, group: Group, other: OtherVersion) -> Proof | None:
        """A reducer answered that it holds another version of ``group``, signed by its coordinator as ours is: the
        two signatures prove that the coordinator handed out two versions of one group (None: we cannot show it)."""
        key = self.keys(group.coordinator)
        if key is None or not group.grant or group.coordinator == self.me:
            return None
        return Proof(claim=Claim.GROUP, accused=group.coordinator, key=key, group_id=group.group_id,
                     first=Signed(digest=bytes.fromhex(group.digest), signature=group.grant),
                     second=Signed(digest=bytes.fromhex(other.version), signature=other.grant))

    async def _serve(self, stream_info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A group member sends us its contribution to a piece of our span; answer with the piece's aggregate."""
        sender = str(stream_info.peer_id)
        inbox: Inbox | None = None
        try:
            try:
                header, length = await in_time(wire.read_header(reader), self.timeout)
                contribution = decode(Contribution, header)
                found = await self.reducer.find(contribution, sender)
                if isinstance(found, Served):
                    served = found
                else:
                    inbox = found
                    served = (await take(inbox, contribution, length, sender, reader)
                              or await self._answer_result(inbox, sender, writer))
            except (TransportError, TimeoutError) as e:  # the sender's link failed, or it is too slow
                served = broken(e, inbox)
            except PayloadError as e:  # malformed content
                served = malformed(str(e))
            except Exception:  # a bug: keep serving, miss the sender rather than wait for it, and say where it is
                logger.exception(f"contribution from {sender[-8:]} failed unexpectedly")
                served = Served(outcome=TransferOutcome.MISSED, failure=Failure.MISSED, inbox=inbox,
                                reason="this reducer failed on its contribution (see its log)")
            inboxes = (self.reducer.owed_by(sender) if served.outcome == TransferOutcome.MALFORMED
                       else [served.inbox] if served.inbox is not None else [])
            self._act_on(sender, served.outcome, served.reason, inboxes, self.current_round, served.failure)
            if served.refusal is not None:
                await refuse(writer, served.refusal)
        finally:
            if inbox is not None:
                inbox.close_stream(sender)
            await wire.hang_up(reader, writer, inbox.transfer if inbox is not None else self.timeout)

    async def _answer_result(self, inbox: Inbox, sender: str, writer: asyncio.StreamWriter) -> Served:
        """Answer ``sender`` the result of ``inbox``'s piece once it is reduced, unless its contribution is not in
        it."""
        try:
            reduced: Reduced = await in_time(asyncio.shield(inbox.result), 2 * inbox.transfer)
        except PayloadError as e:  # this reducer could not combine its piece at all: not the sender's fault
            return refused(Refusal(ReduceStatus.MISSED, f"the span could not be reduced: {e}"))
        rejected = reduced.reduction.rejected
        refusal = inbox.refusal(sender) or (
            Refusal(ReduceStatus.REJECTED, rejected[sender]) if sender in rejected else None)
        if refusal is not None:
            return refused(refusal)
        reply, result = self.answer(inbox.group, inbox.exchange, reduced, sender)
        await in_time(wire.write_message(writer, reply, result), inbox.transfer)
        inbox.bytes_out += len(result)
        return Served(outcome=TransferOutcome.DELIVERED)

    def answer(self, group: Group, exchange: Exchange, reduced: Reduced, sender: str) -> tuple[dict[str, Any], bytes]:
        """What this reducer answers ``sender`` for a piece it ``reduced`` (the same result, receipt and signature for
        every member of ``group``): the answer's header and the result."""
        place = {peer: i for i, peer in enumerate(group.peers)}
        reduction = reduced.reduction
        reply = {"status": ReduceStatus.OK, "included": [place[p] for p in reduction.included],
                 "norms": reduction.norms, "opposed": [place[p] for p in reduction.opposed],
                 "contributions": list(reduction.contributions), "signature": reduced.evidence.signature}
        return reply, reduction.result_for(exchange, sender)


async def _bounded(awaitable: Any, timeout: float) -> None:
    try:
        await in_time(awaitable, timeout)
    except TimeoutError:
        logger.info("some senders did not collect the aggregate of our span in time")
