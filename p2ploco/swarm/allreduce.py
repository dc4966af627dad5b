"""Butterfly all-reduce over hivemind's p2p streams, returning the aggregate itself.

In a group of n peers (canonical order), the exchange's units are cut into n spans and peer i
reduces span i: every other peer streams it its contribution to span i, peer i combines the
contributions in group order and sends the very same result bytes back to each of them. Every
peer thus applies identical aggregates: unlike hivemind's stock runner, which returns
"average - own part" and leaves peers an ulp (or a codec error) apart.

A contribution that is malformed (wrong size, bad values, truncated, oversized, not from a group
member) is dropped and its sender told so; a sender that does not deliver within the timeout is
dropped too. The reducer always finishes its span with the contributions it has.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from hivemind.p2p import P2P, PeerID

from p2ploco import faults
from p2ploco.collective.exchange import (
    AllReduceStats,
    Exchange,
    Span,
    SpanReduction,
    dense_fp32_bytes,
    reduce_span,
)
from p2ploco.errors import PayloadError
from p2ploco.swarm import wire
from p2ploco.swarm.rounds import Group

logger = logging.getLogger(__name__)

MAX_UNKNOWN_GROUPS = 64  # contributions may precede our own view of their group, but not without bound


class AllReduceError(Exception):
    """This peer could not obtain the aggregate of some span; the round's all-reduce failed for it."""


class DroppedFromRound(AllReduceError):
    """A reducer refused this peer's contribution: it is out of this round, and must not block the others."""


@dataclass
class _ReducerSession:
    """Our span of one group's all-reduce, as the contributions come in."""

    group: Group
    span: Span
    exchange: Exchange
    senders: set[str]  # remote group members that owe us a contribution
    payloads: dict[str, bytes] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
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

    def fail(self, sender: str, reason: str) -> None:
        if sender in self.senders and sender not in self.payloads:
            self.failed.setdefault(sender, reason)
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
    def __init__(self, p2p: P2P, me: str, run_id: str, timeout: float):
        self.p2p, self.me, self.timeout = p2p, me, timeout
        self.handler_name = f"p2ploco/{run_id}/reduce"
        self._sessions: dict[str, asyncio.Future] = {}

    async def start(self) -> None:
        await self.p2p.add_binary_stream_handler(self.handler_name, self._serve)

    async def run(self, group: Group, exchange: Exchange, stats: AllReduceStats) -> None:
        """All-reduce ``exchange`` within ``group``; on return it holds the aggregate of every span. Traffic
        is added to ``stats`` as it happens, so a failed attempt is counted too."""
        loop = asyncio.get_running_loop()
        index = group.peers.index(self.me)
        spans = exchange.partition(len(group.peers))
        session = _ReducerSession(group, spans[index], exchange, set(group.peers) - {self.me})
        pending = self._sessions.setdefault(group.group_id, loop.create_future())
        if not pending.done():
            pending.set_result(session)
        stats.peers = list(group.peers)
        stats.dense_fp32_bytes += dense_fp32_bytes(exchange, spans, index)
        stats.params = sum(exchange.numel(span) for span in spans)
        stats.contribution_bytes = 0
        dropped: set[str] = set()
        senders = [asyncio.create_task(self._contribute(group, peer, span, exchange, stats, dropped))
                   for peer, span in zip(group.peers, spans) if peer != self.me]
        try:
            own = await loop.run_in_executor(None, exchange.encode, session.span)
            stats.contribution_bytes += len(own)
            reduction = await self._reduce(session, own)
            dropped.update(reduction.rejected)
            result = reduction.result_for(exchange, self.me)
            await loop.run_in_executor(None, exchange.receive, session.span, result, reduction.own_position(self.me))
            await asyncio.gather(*senders)
            await _bounded(session.served.wait(), self.timeout)  # results handed to every sender
        except (TimeoutError, PayloadError, OSError) as e:
            raise AllReduceError(f"{e!r}") from None
        finally:
            for task in senders:
                task.cancel()
            await asyncio.gather(*senders, return_exceptions=True)  # reap them; their errors are reported above
            self._sessions.pop(group.group_id, None)
            stats.bytes_sent += session.bytes_out
            stats.bytes_received += session.bytes_in
        stats.dropped = sorted(dropped)

    async def _reduce(self, session: _ReducerSession, own: bytes) -> SpanReduction:
        try:
            await asyncio.wait_for(session.arrived.wait(), self.timeout)
        except TimeoutError:
            for sender in session.senders:
                session.fail(sender, f"sent nothing within {self.timeout:.0f} s")
        contributions = [(p, own if p == self.me else session.payloads[p])
                         for p in session.group.peers if p == self.me or p in session.payloads]
        try:
            reduction = await asyncio.get_running_loop().run_in_executor(
                None, reduce_span, session.exchange, session.span, contributions)
        except PayloadError as e:
            session.result.set_exception(e)
            session.result.exception()  # retrieved here; handlers re-raise it to their senders
            raise
        reduction.rejected.update(session.failed)
        for sender, reason in reduction.rejected.items():
            logger.warning(f"round {session.group.round_index}: dropped {sender[-8:]} from the round: {reason}")
        await faults.hit_async("allreduce.reduce", session.group.round_index)
        session.result.set_result(reduction)
        return reduction

    async def _contribute(self, group: Group, peer: str, span: Span, exchange: Exchange, stats: AllReduceStats,
                          dropped: set[str]) -> None:
        """Send our contribution for ``span`` to its reducer and take back the span's aggregate."""
        loop = asyncio.get_running_loop()
        payload = await loop.run_in_executor(None, exchange.encode, span)
        stats.contribution_bytes += len(payload)
        try:
            _, reader, writer = await asyncio.wait_for(
                self.p2p.call_binary_stream_handler(PeerID.from_base58(peer), self.handler_name), self.timeout)
        except Exception as e:  # the daemon reports an unreachable peer through several exception types
            raise AllReduceError(f"could not reach reducer {peer[-8:]}: {e!r}") from None
        try:
            header = {"group_id": group.group_id, "round": group.round_index, "span": [span.start, span.stop]}
            await asyncio.wait_for(wire.write_message(writer, header, payload), self.timeout)
            stats.bytes_sent += len(payload)
            await faults.hit_async("allreduce.contribute", group.round_index)
            # The reducer may wait `timeout` for the slowest sender before it answers.
            reply, result = await asyncio.wait_for(
                wire.read_message(reader, exchange.max_result_bytes(span, len(group.peers))), 2 * self.timeout)
            if reply.get("status") != "ok":
                reason = reply.get("reason", reply.get("status"))
                raise DroppedFromRound(f"reducer {peer[-8:]} dropped this peer: {reason}")
            included = reply.get("included")
            if not isinstance(included, list) or self.me not in included or not set(included) <= set(group.peers):
                raise AllReduceError(f"reducer {peer[-8:]} sent a malformed reply")
            await loop.run_in_executor(None, exchange.receive, span, result, included.index(self.me))
            stats.bytes_received += len(result)
            dropped.update(set(group.peers) - set(included))
        except (TimeoutError, PayloadError, OSError, ConnectionError) as e:
            raise AllReduceError(f"no aggregate from reducer {peer[-8:]}: {e!r}") from None
        finally:
            writer.close()

    async def _serve(self, stream_info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A group member sends us its contribution to our span; answer with the span's aggregate."""
        sender = str(stream_info.peer_id)
        session: _ReducerSession | None = None
        try:
            header, length = await asyncio.wait_for(wire.read_header(reader), self.timeout)
            session = await self._session_of(wire.field(header, "group_id", str))
            if sender not in session.senders:
                session = None
                raise PayloadError(f"{sender[-8:]} is not a member of this group")
            session.connected.add(sender)
            if sender in session.payloads or sender in session.failed:
                raise PayloadError("second contribution to the same span")
            if header.get("span") != [session.span.start, session.span.stop]:
                raise PayloadError(f"contribution for span {header.get('span')}, this peer reduces "
                                   f"{session.span.start}:{session.span.stop}")
            limit = session.exchange.max_payload_bytes(session.span)
            payload = await asyncio.wait_for(wire.read_payload(reader, length, limit), self.timeout)
            session.bytes_in += len(payload)
            session.deliver(sender, payload)
            reduction: SpanReduction = await asyncio.wait_for(asyncio.shield(session.result), 2 * self.timeout)
            if sender in reduction.rejected:
                raise PayloadError(reduction.rejected[sender])
            reply = {"status": "ok", "included": reduction.included}
            result = reduction.result_for(session.exchange, sender)
            await asyncio.wait_for(wire.write_message(writer, reply, result), self.timeout)
            session.bytes_out += len(result)
        except (TimeoutError, PayloadError) as e:
            reason = str(e) or "timed out"
            logger.warning(f"dropped {sender[-8:]} from the round: {reason}")
            if session is not None:
                session.fail(sender, reason)
            try:
                await asyncio.wait_for(wire.write_message(writer, {"status": "rejected", "reason": reason}), 1.0)
            except (TimeoutError, OSError, ConnectionError):
                pass
        except Exception as e:  # a lost connection, or anything else: the node keeps serving
            if session is not None:
                session.fail(sender, f"connection lost: {e!r}")
        finally:
            if session is not None:
                session.settle(sender)
            writer.close()

    async def _session_of(self, group_id: str) -> _ReducerSession:
        """Our session of ``group_id``, waiting (bounded) if the group's other members learnt of it first."""
        pending = self._sessions.get(group_id)
        if pending is None:
            if len(self._sessions) >= MAX_UNKNOWN_GROUPS:
                raise PayloadError("too many contributions for unknown groups")
            pending = self._sessions[group_id] = asyncio.get_running_loop().create_future()
        try:
            return await asyncio.wait_for(asyncio.shield(pending), self.timeout)
        except TimeoutError:
            if not pending.done():
                self._sessions.pop(group_id, None)
            raise PayloadError(f"contribution for unknown group {group_id!r}") from None


async def _bounded(awaitable: Any, timeout: float) -> None:
    try:
        await asyncio.wait_for(awaitable, timeout)
    except TimeoutError:
        logger.info("some senders did not collect the aggregate of our span in time")
