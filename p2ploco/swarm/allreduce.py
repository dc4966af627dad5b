"""Butterfly all-reduce over hivemind's p2p streams, returning the aggregate itself.

A round's exchange is made of named slices (``collective/sliced.py``), and each slice is reduced
among the members that hold it (the group lists them): with n holders (canonical order), the slice's
units are cut into n spans and holder i reduces span i. Every other holder streams it its
contribution to span i, holder i combines the contributions in group order (each one bounded first,
``collective/robust.py``) and sends the very same result bytes back to each of them. A full replica
thus reduces a span of every slice, a stage peer a span of its own. Every peer thus applies identical aggregates: unlike
hivemind's stock runner, which returns "average - own part" and leaves peers an ulp (or a codec
error) apart.

A reducer drops a sender from its span, at once and with the reason logged, when:

- its message is malformed (a header that is not a p2ploco map, a field of the wrong type, a span
  that is not ours, an oversized or undecodable payload, an absurd norm). The sender is also banned
  here for ``swarm.ban_rounds`` rounds (``swarm/bans.py``), even if the message came before this
  peer knew the group, or named no group at all;
- its stream ends mid-message, or this peer cannot reach it to deliver our own contribution (it
  crashed): no ban, a restarted peer is welcome;
- it is banned here already, or it sends nothing within the round's transfer deadline
  (``swarm/deadlines.py``: ``swarm.allreduce_timeout`` plus the round's payload at the slowest link the
  group reports, so that a slow but honest link is waited for).

The reducer always finishes its span with the contributions it has, and every member keeps sending
its contributions to the other reducers even after one refused it, so nobody waits for it in vain.

A contribution, a wire message (``swarm/wire.py``) whose payload is the slice's encoding::

    {v, group_id, round, slice, span: [start, stop]} + contribution

answered ``{v, status: ok, included: [peer ids in the aggregate]}`` + result, or
``{v, status: rejected, reason}``.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from hivemind.p2p import P2P

from p2ploco import faults
from p2ploco.collective.exchange import (
    AllReduceStats,
    Exchange,
    Span,
    SpanReduction,
    dense_fp32_bytes,
    reduce_span,
)
from p2ploco.collective.sliced import SlicedExchange
from p2ploco.errors import PayloadError
from p2ploco.swarm import wire
from p2ploco.swarm.bans import Bans
from p2ploco.swarm.deadlines import TransferDeadline
from p2ploco.swarm.rounds import Group

logger = logging.getLogger(__name__)

MAX_UNKNOWN_GROUPS = 64  # contributions may precede our own view of their group, but not without bound


class ReduceStatus(enum.StrEnum):
    OK = "ok"  # the span's aggregate follows
    REJECTED = "rejected"  # the sender's contribution was refused: it is out of this round


class AllReduceError(Exception):
    """This peer could not obtain the aggregate of some span; the round's all-reduce failed for it."""


class DroppedFromRound(AllReduceError):
    """A reducer refused this peer's contribution: it is out of this round, and must not block the others."""


@dataclass
class _ReducerSession:
    """Our span of one slice in one group's all-reduce, as the contributions come in."""

    group: Group
    slice: str
    span: Span
    exchange: Exchange
    senders: set[str]  # remote group members that owe us a contribution
    transfer: float  # seconds any one transfer of this round may take (``swarm/deadlines.py``)
    payloads: dict[str, bytes] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    lost: set[str] = field(default_factory=set)  # members whose stream with us broke: presumed dead, reported
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
        self._check()

    def lose(self, peer: str, reason: str) -> None:
        """``peer`` cannot be reached, or its stream broke: it is dead as far as we know. Stop waiting for its
        contribution, and tell the coordinator not to wait for its vote either."""
        self.lost.add(peer)
        self.fail(peer, reason)

    def fail(self, sender: str, reason: str) -> None:
        """Drop ``sender`` from this span, unless its contribution is in already (it then counts)."""
        if sender in self.senders and sender not in self.payloads and sender not in self.failed:
            self.failed[sender] = reason
            logger.warning(f"round {self.group.round_index}: dropped {sender[-8:]} from span "
                           f"{self.span.start}:{self.span.stop}: {reason}")
            self._check()

    def settle(self, sender: str) -> None:
        self.settled.add(sender)
        self._check()

    def _check(self) -> None:
        if self.senders <= set(self.payloads) | set(self.failed):
            self.arrived.set()
        if self.senders <= self.settled | (set(self.failed) - self.connected):
            self.served.set()


class ButterflyAllReduce:
    def __init__(self, p2p: P2P, me: str, run_id: str, deadline: TransferDeadline, bans: Bans,
                 rates: Callable[[Iterable[str]], list[float]] = lambda peers: []):
        """``rates``: the link rates (Mbit/s, 0: not stated) the given peers report."""
        self.p2p, self.me, self.deadline, self.bans, self.rates = p2p, me, deadline, bans, rates
        self.timeout = deadline.base  # for what does not grow with the payload: headers, answers, lookups
        self.handler_name = f"p2ploco/{run_id}/reduce"
        self._sessions: dict[tuple[str, str], asyncio.Future] = {}  # (group id, slice) -> our session
        self.current_round = 0  # the round of the latest all-reduce here: malformed data is banned from it on

    async def start(self) -> None:
        await self.p2p.add_binary_stream_handler(self.handler_name, self._serve)

    async def run(self, group: Group, exchange: SlicedExchange, stats: AllReduceStats, drops: set[str]) -> None:
        """All-reduce every slice of ``exchange`` among its holders in ``group``; on return it holds the aggregate
        of every span. Traffic is added to ``stats`` as it happens, so a failed attempt is counted too; the peers
        this one dropped from its own spans are added to ``drops``, also when the all-reduce fails here."""
        loop = asyncio.get_running_loop()
        self.current_round = group.round_index
        stats.peers = list(group.peers)
        stats.contribution_bytes, stats.params, stats.clipped = 0, 0, []
        sessions: list[_ReducerSession] = []
        senders: list[asyncio.Task] = []
        dropped: set[str] = set()
        # Every link carries about one whole contribution per phase (ours out to the reducers, or the others' to
        # our spans in): the slices move at once, so their sizes add up.
        volume = sum(part.max_payload_bytes(range(part.num_units)) for part in exchange.parts.values())
        transfer = self.deadline.seconds(volume, self.rates(group.peers))
        for slice_name, part in exchange.parts.items():
            holders = group.holders(slice_name)
            index = holders.index(self.me)
            spans = part.partition(len(holders))
            session = _ReducerSession(group, slice_name, spans[index], part, set(holders) - {self.me}, transfer)
            for peer in session.senders & self.bans.active(group.round_index):
                session.fail(peer, "banned here for sending malformed data")
            pending = self._sessions.setdefault((group.group_id, slice_name), loop.create_future())
            if not pending.done():
                pending.set_result(session)
            sessions.append(session)
            stats.dense_fp32_bytes += dense_fp32_bytes(part, spans, index)
            stats.params += sum(part.numel(span) for span in spans)
            senders += [asyncio.create_task(self._contribute(session, peer, span, stats, dropped))
                        for peer, span in zip(holders, spans) if peer != self.me]
        reductions: list[SpanReduction] = []
        try:
            for session in sessions:
                own = await loop.run_in_executor(None, session.exchange.encode, session.span)
                stats.contribution_bytes += len(own)
                reduction = await self._reduce(session, own)
                reductions.append(reduction)
                dropped.update(reduction.rejected)
                stats.clipped = sorted(set(stats.clipped) | set(reduction.clipped))
                result = reduction.result_for(session.exchange, self.me)
                await loop.run_in_executor(None, session.exchange.receive, session.span, result,
                                           reduction.own_position(self.me))
            # Every contribution is delivered (or fails) before we report, even after a reducer refused us.
            errors = [e for e in await asyncio.gather(*senders, return_exceptions=True) if e is not None]
            for session in sessions:  # results handed to every sender
                await _bounded(session.served.wait(), session.transfer)
        except (TimeoutError, PayloadError) as e:
            raise AllReduceError(f"{e!r}") from None
        finally:
            for task in senders:
                task.cancel()
            await asyncio.gather(*senders, return_exceptions=True)  # reap them; their errors are reported below
            for session in sessions:
                self._sessions.pop((group.group_id, session.slice), None)
                stats.bytes_sent += session.bytes_out
                stats.bytes_received += session.bytes_in
                drops.update(session.failed, session.lost)
        for reduction in reductions:
            drops.update(reduction.rejected)
        stats.dropped = sorted(dropped)
        for error in errors:
            if not isinstance(error, AllReduceError):
                raise error  # a bug in this peer, not a peer's fault
        if errors:  # being refused outranks a missing span: the coordinator must not wait for this peer
            raise next((e for e in errors if isinstance(e, DroppedFromRound)), errors[0])

    async def _reduce(self, session: _ReducerSession, own: bytes) -> SpanReduction:
        try:
            await asyncio.wait_for(session.arrived.wait(), session.transfer)
        except TimeoutError:
            for sender in session.senders:
                session.fail(sender, f"sent nothing within {session.transfer:.0f} s")
        contributions = [(p, own if p == self.me else session.payloads[p])
                         for p in session.group.peers if p == self.me or p in session.payloads]
        try:
            reduction = await asyncio.get_running_loop().run_in_executor(
                None, reduce_span, session.exchange, session.span, contributions)
        except PayloadError as e:
            session.result.set_exception(e)
            session.result.exception()  # retrieved here; handlers re-raise it to their senders
            raise
        for sender, reason in reduction.rejected.items():
            logger.warning(f"round {session.group.round_index}: dropped {sender[-8:]} from the round: {reason}")
            if sender != self.me:
                self.bans.ban(sender, session.group.round_index, reason)
        for sender in reduction.clipped:
            logger.warning(f"round {session.group.round_index}: clipped the contribution of {sender[-8:]} to the "
                           f"span's bound (outer.clip_factor x the median norm)")
        reduction.rejected.update(session.failed)
        await faults.hit_async("allreduce.reduce", session.group.round_index)
        session.result.set_result(reduction)
        return reduction

    async def _contribute(self, session: _ReducerSession, peer: str, span: Span, stats: AllReduceStats,
                          dropped: set[str]) -> None:
        """Send our contribution for ``span`` to its reducer ``peer`` and take back the span's aggregate."""
        group, exchange = session.group, session.exchange
        loop = asyncio.get_running_loop()
        payload = await loop.run_in_executor(None, exchange.encode, span)
        stats.contribution_bytes += len(payload)
        try:
            reader, writer = await asyncio.wait_for(wire.open_stream(self.p2p, peer, self.handler_name),
                                                    self.timeout)
        except (PayloadError, *wire.TRANSPORT_ERRORS) as e:
            # A peer we cannot reach will not send us its contribution either (it crashed): stop waiting for it.
            session.lose(peer, f"unreachable ({e!r})")
            raise AllReduceError(f"could not reach reducer {peer[-8:]}: {e!r}") from None
        try:
            header = {"group_id": group.group_id, "round": group.round_index, "slice": session.slice,
                      "span": [span.start, span.stop]}
            try:
                await asyncio.wait_for(wire.write_message(writer, header, payload), session.transfer)
            except wire.TRANSPORT_ERRORS as e:
                reason = None if isinstance(e, TimeoutError) else await _refusal_left_behind(reader)
                if reason is None:
                    raise
                raise DroppedFromRound(f"reducer {peer[-8:]} dropped this peer: {reason}") from None
            stats.bytes_sent += len(payload)
            await faults.hit_async("allreduce.contribute", group.round_index)
            # The reducer may wait a transfer's time for the slowest sender before it answers, and the answer
            # takes another.
            reply, result = await asyncio.wait_for(
                wire.read_message(reader, exchange.max_result_bytes(span, len(group.peers))), 2 * session.transfer)
            included = parse_reply(reply, group, self.me)
            if included is None:
                raise DroppedFromRound(f"reducer {peer[-8:]} dropped this peer: {str(reply.get('reason'))[:200]}")
            await loop.run_in_executor(None, exchange.receive, span, result, included.index(self.me))
            stats.bytes_received += len(result)
            dropped.update(set(group.holders(session.slice)) - set(included))
        except (wire.StreamClosed, *wire.TRANSPORT_ERRORS) as e:
            if not isinstance(e, TimeoutError):  # a reducer that hangs up mid-answer has crashed, not dawdled
                session.lose(peer, f"its stream broke ({e!r})")
            raise AllReduceError(f"no aggregate from reducer {peer[-8:]}: {e!r}") from None
        except PayloadError as e:
            raise AllReduceError(f"no aggregate from reducer {peer[-8:]}: {e!r}") from None
        finally:
            writer.close()

    async def _serve(self, stream_info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A group member sends us its contribution to our span; answer with the span's aggregate."""
        sender = str(stream_info.peer_id)
        session: _ReducerSession | None = None
        try:
            header, length = await asyncio.wait_for(wire.read_header(reader), self.timeout)
            round_index = wire.field(header, "round", int)
            session = await self._session_of(wire.field(header, "group_id", str), wire.field(header, "slice", str),
                                             sender)
            session.connected.add(sender)
            if sender in session.failed:  # dropped already (unreachable, banned, too late): no new offence
                raise _Refused(session.failed[sender])
            if sender in session.payloads:
                raise PayloadError("second contribution to the same span")
            span, expected = header.get("span"), [session.span.start, session.span.stop]
            if span != expected or round_index != session.group.round_index:
                raise PayloadError(f"contribution for span {span} of round {round_index}, this peer reduces "
                                   f"{expected} of round {session.group.round_index}")
            limit = session.exchange.max_payload_bytes(session.span)
            payload = await asyncio.wait_for(wire.read_payload(reader, length, limit), session.transfer)
            session.bytes_in += len(payload)
            session.deliver(sender, payload)
            try:
                reduction: SpanReduction = await asyncio.wait_for(asyncio.shield(session.result),
                                                                  2 * session.transfer)
            except PayloadError as e:  # this reducer could not combine its span at all: not the sender's fault
                raise _Refused(f"the span could not be reduced: {e}") from None
            if sender in reduction.rejected:
                raise _Refused(reduction.rejected[sender])
            reply = {"status": ReduceStatus.OK, "included": reduction.included}
            result = reduction.result_for(session.exchange, sender)
            await asyncio.wait_for(wire.write_message(writer, reply, result), session.transfer)
            session.bytes_out += len(result)
        except (_Refused, _UnknownGroup, wire.StreamClosed, TimeoutError) as e:
            if session is not None:
                session.fail(sender, str(e) or "timed out")
            await _refuse(writer, str(e) or "timed out")
        except PayloadError as e:  # malformed content: its sender is out of every span it owes us, and banned
            reason = f"malformed contribution: {e}"
            for pending in self._sessions.values():
                if pending.done() and sender in pending.result().senders:
                    pending.result().fail(sender, reason)
            self.bans.ban(sender, self.current_round, reason)
            await _refuse(writer, reason)
        except wire.TRANSPORT_ERRORS as e:  # the sender's link broke: fail it at once (no ban: it may have crashed)
            if session is not None:
                session.fail(sender, f"connection lost: {e!r}")
        except Exception:  # a bug: keep serving, fail the sender rather than wait for it, and say where it is
            logger.exception(f"contribution from {sender[-8:]} failed unexpectedly")
            if session is not None:
                session.fail(sender, "this reducer failed on its contribution (see its log)")
        finally:
            if session is not None:
                session.settle(sender)
            writer.close()

    async def _session_of(self, group_id: str, slice_name: str, sender: str) -> _ReducerSession:
        """Our session of ``slice_name`` in ``group_id`` that ``sender`` belongs to, waiting (bounded) if the group's
        other members learnt of it first."""
        key = (group_id, slice_name)
        pending = self._sessions.get(key)
        if pending is None:
            if len(self._sessions) >= MAX_UNKNOWN_GROUPS:
                raise _UnknownGroup("too many contributions for unknown groups")
            pending = self._sessions[key] = asyncio.get_running_loop().create_future()
        try:
            session: _ReducerSession = await asyncio.wait_for(asyncio.shield(pending), self.timeout)
        except TimeoutError:
            if not pending.done():
                self._sessions.pop(key, None)
            raise _UnknownGroup(f"contribution for unknown group {group_id[:32]!r} or slice {slice_name[:32]!r}"
                                ) from None
        if sender not in session.senders:
            raise PayloadError(f"{sender[-8:]} is not a member of this group")
        return session


def parse_reply(reply: dict[str, Any], group: Group, me: str) -> list[str] | None:
    """The members whose contributions make up the aggregate that follows a reducer's answer, or None if the
    reducer refused ours; PayloadError if the answer is malformed."""
    if wire.status(reply, ReduceStatus) == ReduceStatus.REJECTED:
        return None
    included = wire.peer_ids(reply, "included")
    if me not in included or not set(included) <= set(group.peers):
        raise PayloadError("the aggregate leaves this peer out, or names non-members")
    return included


class _Refused(Exception):
    """The reducer refused the sender's contribution (its reason is the message)."""


class _UnknownGroup(Exception):
    """A contribution for a group this peer never joined (it was late, or refused it): not the sender's fault."""


async def _refuse(writer: asyncio.StreamWriter, reason: str) -> None:
    """Tell a sender it is out of the round; it may have hung up already."""
    try:
        await asyncio.wait_for(wire.write_message(writer, {"status": ReduceStatus.REJECTED, "reason": reason}), 1.0)
    except wire.TRANSPORT_ERRORS:
        pass


async def _refusal_left_behind(reader: asyncio.StreamReader) -> str | None:
    """The reason a reducer gave for refusing our contribution, if it answered before our write broke: it refuses
    on the header alone (say, a payload longer than the span can need) and hangs up without reading the rest, so
    the broken write is its refusal, not its crash. None if no such answer is there."""
    try:
        reply, _ = await asyncio.wait_for(wire.read_message(reader, 0), 1.0)
        if wire.status(reply, ReduceStatus) == ReduceStatus.REJECTED:
            return str(reply.get("reason"))[:200]
    except (PayloadError, *wire.TRANSPORT_ERRORS):
        pass
    return None


async def _bounded(awaitable: Any, timeout: float) -> None:
    try:
        await asyncio.wait_for(awaitable, timeout)
    except TimeoutError:
        logger.info("some senders did not collect the aggregate of our span in time")
