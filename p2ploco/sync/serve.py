"""The reducer's side of the butterfly (``sync/reduce.py``): the pieces of this peer's spans as their contributions
come in, combining each into the one result every member is answered, and the steps of taking one contribution. What
came of a contribution is a value (``Served``): what this peer does about its sender is left to
``ButterflyAllReduce._act_on``."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from p2ploco import faults
from p2ploco.aio import in_time
from p2ploco.collective.exchange import Exchange, Span, SpanReduction, reduce_span
from p2ploco.errors import Failure, PayloadError, TransportError
from p2ploco.swarm import wire
from p2ploco.swarm.bans import Bans
from p2ploco.swarm.evidence import Signer, result_statement
from p2ploco.sync.audit import Audits
from p2ploco.sync.clip_streaks import ClipStreaks
from p2ploco.sync.group import Group
from p2ploco.sync.reduce_values import Contribution, Evidence, Reduced, ReduceStatus, TransferOutcome
from p2ploco.sync.whereabouts import Whereabouts

logger = logging.getLogger(__name__)

UNKNOWN_GROUPS_PER_PEER = 16  # pieces of groups this peer does not know yet that one sender may wait on


@dataclass
class Inbox:
    """One piece of our span of one slice in one group's all-reduce, as the contributions come in."""

    group: Group
    slice: str
    piece: Span
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
    closed_streams: set[str] = field(default_factory=set)  # senders whose stream with us has ended
    bytes_in: int = 0
    bytes_out: int = 0
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    served: asyncio.Event = field(default_factory=asyncio.Event)
    result: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())

    def __post_init__(self) -> None:
        # kept as they change, so that each of N senders' events costs O(1), not a pass over the N (O(N^2) a piece):
        # the senders whose contribution may still come, and the senders and hubs this piece's result still waits on
        # (their stream is open, or may open: a sender left out that connected anyway is answered its refusal)
        self._owed = set(self.senders)
        self._unserved = self.senders | self.listeners
        self._check()

    def connect(self, sender: str) -> None:
        """``sender`` opened a stream to this piece: its stream is waited on until it ends."""
        self.connected.add(sender)
        if (sender in self.senders or sender in self.listeners) and sender not in self.closed_streams:
            self._unserved.add(sender)

    def deliver(self, sender: str, payload: bytes) -> None:
        self.payloads[sender] = payload
        self.delivered_at[sender] = time.monotonic()
        self._owed.discard(sender)
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
            self.close_stream(sender)
        elif self._pending(sender):
            self.missed[sender] = (failure, reason)
            self._left_out(sender)
            logger.warning(f"round {self.group.round_index}: going on without {sender[-8:]}'s contribution to span "
                           f"{self.piece.start}:{self.piece.stop}: {reason}")
            self._check()

    def reject(self, sender: str, reason: str) -> None:
        """Drop ``sender`` for sending malformed data (or for being banned here): it is out of the round."""
        if self._pending(sender):
            self.rejected[sender] = reason
            self._left_out(sender)
            logger.warning(f"round {self.group.round_index}: dropped {sender[-8:]} from span "
                           f"{self.piece.start}:{self.piece.stop}: {reason}")
            self._check()

    def refusal(self, sender: str) -> Refusal | None:
        """Why ``sender``'s contribution is not in this piece's aggregate (None: it is, or may still be)."""
        if sender in self.rejected:
            return Refusal(ReduceStatus.REJECTED, self.rejected[sender])
        if sender in self.missed:
            return Refusal(ReduceStatus.MISSED, self.missed[sender][1])
        return None

    def owing(self) -> set[str]:
        """The senders whose contribution may still come."""
        return set(self._owed)

    def close_stream(self, sender: str) -> None:
        self.closed_streams.add(sender)
        self._unserved.discard(sender)
        self._check()

    def _pending(self, sender: str) -> bool:
        return sender in self._owed

    def _left_out(self, sender: str) -> None:
        """``sender`` is missed or rejected: owed no more, and not waited on unless its stream is open."""
        self._owed.discard(sender)
        if sender not in self.connected:
            self._unserved.discard(sender)

    def _check(self) -> None:
        if not self._owed:
            self.arrived.set()
        if not self._unserved:
            self.served.set()


class Refusal(NamedTuple):
    """What a sender is told when its contribution is not in a piece's aggregate (``elsewhere``: this peer takes part
    in the round in another group; ``version``: in this version of the sender's group, signed by its coordinator)."""

    status: ReduceStatus
    reason: str
    elsewhere: bool = False
    version: Group | None = None


@dataclass(frozen=True, kw_only=True)
class Served:
    """What came of one contribution to a piece of ours."""

    outcome: TransferOutcome
    reason: str = ""  # what this peer records against the sender (a miss's or a ban's reason)
    failure: Failure | None = None  # MISSED: what the miss counts
    inbox: Inbox | None = None  # MISSED, ELSEWHERE: the piece that goes on without the sender
    refusal: Refusal | None = None  # what the sender is told (None: its answer went out, or none goes)


def malformed(what: str) -> Served:
    """A malformed contribution (``what`` is wrong with it): its sender is out of every piece it owes us, and
    banned."""
    reason = f"malformed contribution: {what}"
    return Served(outcome=TransferOutcome.MALFORMED, reason=reason, refusal=Refusal(ReduceStatus.REJECTED, reason))


def broken(error: TransportError | TimeoutError, inbox: Inbox | None) -> Served:
    """The sender's link failed, or it is too slow: ``inbox`` goes on without it."""
    reason = f"its link failed ({error})" if isinstance(error, TransportError) else "it timed out"
    return Served(outcome=TransferOutcome.MISSED, reason=reason, failure=wire.failure_of(error), inbox=inbox,
                  refusal=Refusal(ReduceStatus.MISSED, reason))


def refused(refusal: Refusal) -> Served:
    """The sender is out of the piece already (unreachable, banned, too late) or was never in it: no new offence."""
    return Served(outcome=TransferOutcome.REFUSED, refusal=refusal)


async def take(inbox: Inbox, contribution: Contribution, length: int, sender: str,
               reader: asyncio.StreamReader) -> Served | None:
    """Check ``sender``'s ``contribution`` to ``inbox``'s piece (``length`` bytes of payload follow its header) and read
    its payload in: None once it is in (or, from a hub, none is due), else what came of it."""
    inbox.connect(sender)
    if contribution.listen != (sender in inbox.listeners):
        return malformed("a hub's contribution, or a member's request for the result without one")
    if contribution.listen and length:
        return malformed("a request for the result that carries a payload")
    refusal = inbox.refusal(sender)
    if refusal is not None:  # dropped already (unreachable, banned, too late): no new offence
        return refused(refusal)
    if sender in inbox.payloads:
        return malformed("second contribution to the same span")
    expected = [inbox.piece.start, inbox.piece.stop]
    if contribution.span != expected or contribution.round != inbox.group.round_index:
        return malformed(f"contribution for span {contribution.span} of round {contribution.round}, this peer "
                         f"reduces {expected} of round {inbox.group.round_index}")
    if not contribution.listen:
        limit = inbox.exchange.max_payload_bytes(inbox.piece)
        payload = await in_time(wire.read_payload(reader, length, limit), inbox.transfer)
        inbox.bytes_in += len(payload)
        inbox.deliver(sender, payload)
    return None


async def refuse(writer: asyncio.StreamWriter, refusal: Refusal) -> None:
    """Tell a sender why its contribution is not in the aggregate; it may have hung up already."""
    answer: dict[str, Any] = {"status": refusal.status, "reason": refusal.reason[:200]}
    if refusal.elsewhere:
        answer["elsewhere"] = True
    if refusal.version is not None and refusal.version.grant:
        answer.update(version=refusal.version.digest, grant=refusal.version.grant)
    try:
        await in_time(wire.write_message(writer, answer), 1.0)
    except (TransportError, TimeoutError):
        pass


class Reducer:
    def __init__(self, me: str, run_id: str, timeout: float, bans: Bans, signer: Signer, whereabouts: Whereabouts,
                 audits: Audits | None):
        """``timeout``: how long a contribution waits for a group this peer does not know yet; ``signer``: signs the
        results this peer answers; ``whereabouts``: where this peer takes part in each round; ``audits``: what this
        peer shows auditors of its pieces (None: nothing)."""
        self.me, self.run_id, self.timeout, self.bans, self.signer = me, run_id, timeout, bans, signer
        self.whereabouts, self.audits = whereabouts, audits
        self.clip_streaks = ClipStreaks()
        self._inboxes: dict[tuple[str, str, int], asyncio.Future] = {}  # (group id, slice, piece start) -> Inbox
        self._awaited_by: dict[tuple[str, str, int], str] = {}  # an inbox not known yet -> the sender that waits

    def open(self, inbox: Inbox) -> None:
        """Take contributions to ``inbox``'s piece from now on (also those that came before)."""
        pending = self._inboxes.setdefault((inbox.group.group_id, inbox.slice, inbox.piece.start),
                                           asyncio.get_running_loop().create_future())
        if not pending.done():
            pending.set_result(inbox)

    def close(self, inbox: Inbox) -> None:
        self._inboxes.pop((inbox.group.group_id, inbox.slice, inbox.piece.start), None)

    def owed_by(self, sender: str) -> list[Inbox]:
        """Our open pieces that ``sender`` owes a contribution to."""
        return [pending.result() for pending in self._inboxes.values()
                if pending.done() and sender in pending.result().senders]

    async def find(self, contribution: Contribution, sender: str) -> Inbox | Served:
        """Our inbox of the piece of the contribution's slice that begins where its span does, in its group, which
        ``sender`` belongs to, waiting (bounded) if the group's other members learnt of it first; at once what came of
        it if this peer takes part in the contribution's round elsewhere (``sync/reduce.py``), or moves there while
        it waits."""
        key = (contribution.group_id, contribution.slice, contribution.span[0])
        pending = self._inboxes.get(key)
        elsewhere = self._elsewhere(contribution) if pending is None or not pending.done() else None
        if elsewhere is not None:
            return elsewhere
        if pending is None:  # its sender learnt of the group first: a few such slots per sender, so that one that
            # sends made-up group ids takes up its own slots only
            if sum(by == sender for by in self._awaited_by.values()) >= UNKNOWN_GROUPS_PER_PEER:
                return refused(Refusal(ReduceStatus.MISSED, f"contribution for unknown group {key[0][:32]!r}: this "
                                       f"peer holds {UNKNOWN_GROUPS_PER_PEER} of the sender's already"))
            pending = self._inboxes[key] = asyncio.get_running_loop().create_future()
            self._awaited_by[key] = sender
        try:
            unknown = await self._wait(pending, contribution)
        finally:
            self._awaited_by.pop(key, None)
        if unknown is not None:
            if not pending.done():
                self._inboxes.pop(key, None)
            return unknown
        inbox: Inbox = pending.result()
        if contribution.version != inbox.group.digest:  # the coordinator handed out two versions of the group: the
            # sender's shows ours (signed) and the coordinator is proven; neither member is at fault
            return Served(outcome=TransferOutcome.ELSEWHERE, reason="it holds another version of the group",
                          inbox=inbox,
                          refusal=Refusal(ReduceStatus.MISSED, f"contribution for another version of group "
                                          f"{key[0][:32]!r}", elsewhere=True, version=inbox.group))
        if sender not in inbox.senders | inbox.listeners:
            return malformed(f"{sender[-8:]} is not a member of this group")
        return inbox

    async def _wait(self, pending: asyncio.Future, contribution: Contribution) -> Served | None:
        """Wait for the inbox ``pending`` of a group this peer does not know yet: None once it is there, else what
        came of the contribution (the wait ran out, or this peer moved to another coordinator)."""
        deadline = time.monotonic() + self.timeout
        while not pending.done():  # woken by the group, or by this peer moving to another coordinator
            moved = asyncio.ensure_future(self.whereabouts.moved().wait())
            try:
                await asyncio.wait({pending, moved}, timeout=max(0.0, deadline - time.monotonic()),
                                   return_when=asyncio.FIRST_COMPLETED)
            finally:
                moved.cancel()
            if not pending.done():
                if time.monotonic() >= deadline:
                    return refused(Refusal(ReduceStatus.MISSED, f"contribution for unknown group "
                                           f"{contribution.group_id[:32]!r}, slice {contribution.slice[:32]!r} or "
                                           f"piece {contribution.span[0]}"))
                elsewhere = self._elsewhere(contribution)
                if elsewhere is not None:
                    return elsewhere
        return None

    def _elsewhere(self, contribution: Contribution) -> Served | None:
        """A refusal if this peer takes part in the contribution's round at another coordinator than the one that
        formed its group: it never takes part in that group."""
        if not contribution.coordinator:  # not named: the group may still come
            return None
        at = self.whereabouts.elsewhere(contribution.round, contribution.coordinator)
        if at is None:
            return None
        return refused(Refusal(ReduceStatus.MISSED, f"contribution for a group this peer is not in: it takes part in "
                               f"round {contribution.round} at coordinator {at[-8:]}", elsewhere=True))

    async def reduce(self, inbox: Inbox, own: bytes | None) -> Reduced:
        """Combine the piece's contributions (``own``: this peer's, None for a hub's, which sends none), take the
        result as every member does, and sign its digest: the one result this peer answers for the piece."""
        try:
            await in_time(inbox.arrived.wait(), max(0.0, inbox.deadline - time.monotonic()))
        except TimeoutError:
            for sender in inbox.senders | (inbox.listeners - inbox.connected):  # a hub not there by now: gone
                inbox.miss(sender, Failure.TIMEOUT, f"sent nothing within {inbox.transfer:.0f} s")
        contributions = [(p, own if p == self.me else inbox.payloads[p]) for p in inbox.group.peers
                         if (p == self.me and own is not None) or p in inbox.payloads]
        loop = asyncio.get_running_loop()
        try:
            reduction = await loop.run_in_executor(None, reduce_span, inbox.exchange, inbox.piece, contributions,
                                                   inbox.group.tokens_of())
            digest = await loop.run_in_executor(None, inbox.exchange.receive, inbox.piece,
                                                reduction.result_for(inbox.exchange, self.me),
                                                reduction.receipt_for(self.me))
        except PayloadError as e:
            inbox.result.set_exception(e)
            inbox.result.exception()  # retrieved here; handlers answer it to their senders
            raise
        if self.audits is not None:
            self.audits.keep(inbox.group, inbox.slice, inbox.piece, tuple(payload for _, payload in reduction.weighed))
        self._record(inbox, reduction)
        await faults.hit_async("allreduce.reduce", inbox.group.round_index)
        piece = inbox.piece
        signature = self.signer.sign(result_statement(self.run_id, inbox.group.digest, inbox.slice, piece.start,
                                                      piece.stop, digest))
        reduced = Reduced(reduction, Evidence(inbox.slice, piece, self.me, digest, signature))
        inbox.result.set_result(reduced)
        return reduced

    def _record(self, inbox: Inbox, reduction: SpanReduction) -> None:
        """What the reduction of ``inbox``'s piece says of its senders: the malformed are banned, the clipped noted,
        those clearly against the others struck."""
        for sender, reason in reduction.rejected.items():
            logger.warning(f"round {inbox.group.round_index}: dropped {sender[-8:]} from the round: {reason}")
            if sender != self.me:
                self.bans.ban(sender, inbox.group.round_index, f"malformed contribution: {reason}")
        round_index, where = inbox.group.round_index, f"{inbox.piece.start}:{inbox.piece.stop}"
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
