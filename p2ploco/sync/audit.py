"""Audits: a member re-reduces one random piece of another reducer, and a result that adds a direction nobody sent is
caught.

A member's checks of a result (``Exchange.check``: its own norm, the length bound, the direction) bound how far a
result can go, not where: values at positions no contributor selected have cosine 0 with every member's
contribution, so a reducer could push its span in a chosen direction, round after round, and pass every check. A
result is a function of the contributions its receipt names (``collective/exchange.audit``), and the receipt names
each by its digest, which every member checked for its own; so after each butterfly every member picks one piece
that another reducer reduced, at random (``secrets``: nobody can tell which in advance), asks that reducer for the
payloads it weighed, and re-reduces them. A result farther from their exact mean than this member's own result of
them (beyond another device's rounding) fails; so does an answer with other payloads than the receipt names, or
none. Failed, the reducer is refused as a malformed result is (``sync/reduce.py``): banned here, and named in
this member's vote, so that a redo goes on with it reducing nothing, or without it where two members name it
(``sync/decide.py``). A member that names an honest reducer falsely costs at most the redo, as any refusal does.
A reducer that stalls its answer fails at the answer's deadline (``swarm/deadlines.py``: the round's base wait plus
its bytes at the slowest link allowed); its auditor may miss that round's vote, once for each ban.

With n reducers each member audits one of the n - 1 others: a reducer that steers every piece is audited by at least
one member in a round with probability 1 - (1 - 1/(n - 1))^(n - 1), 63 % or more, and then loses that round's span
and is banned by its auditors. Each audit downloads about one piece of every contribution: about one contribution's
bytes a member and round (``swarm.audit``: off for none). Only ``Exchange.auditable`` results are audited (SparseLoCo's
and DiLoCo's): LoCo's depend on its reducer's own compensation.

The request, a wire message (``swarm/wire.py``): ``{v, group_id, slice, span: [start, stop]}``, answered ``{v,
status: ok, lengths: [each payload's bytes]}`` + the payloads in the receipt's order, or ``{v, status: unknown,
reason}``. Only a member of the group may ask, ``AUDITS_PER_MEMBER`` times a group; a reducer keeps what it weighed for
its ``KEPT_GROUPS`` latest groups.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Annotated, Any

from hivemind.p2p import P2P
from pydantic import Field, model_validator

from p2ploco import faults
from p2ploco.aio import in_time
from p2ploco.collective.exchange import Exchange, Receipt, Span, audit
from p2ploco.errors import PayloadError, TransportError
from p2ploco.swarm import wire
from p2ploco.swarm.messages import MAX_PEERS, Digest, Message, Reason, SliceName, decode, status_of
from p2ploco.sync.group import Group

logger = logging.getLogger(__name__)

KEPT_GROUPS = 4  # groups whose weighed payloads a reducer keeps for auditors
AUDITS_PER_MEMBER = 2  # audits one member may ask of a reducer in one group
MAX_UNITS = 1 << 40


class AuditStatus(enum.StrEnum):
    OK = "ok"  # the payloads follow
    UNKNOWN = "unknown"  # this reducer holds no such piece of that group (any more), or the asker may not ask


class AuditRequest(Message):
    group_id: Digest
    slice: SliceName
    span: Annotated[list[Annotated[int, Field(ge=0, le=MAX_UNITS)]], Field(min_length=2, max_length=2)]


class AuditAnswer(Message):
    status: status_of(AuditStatus)
    reason: Reason = ""
    lengths: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_PEERS)] = []

    @model_validator(mode="after")
    def _complete(self) -> AuditAnswer:
        if self.status == AuditStatus.OK and not self.lengths:
            raise ValueError("an audit answer that shows no contribution")
        return self


@dataclass
class _Kept:
    """What a reducer weighed in one group, by (slice, piece start): the piece's stop and the payloads."""

    group: Group
    pieces: dict[tuple[str, int], tuple[int, tuple[bytes, ...]]] = field(default_factory=dict)
    asked: Counter = field(default_factory=Counter)  # audits each member asked for


class Audits:
    def __init__(self, p2p: P2P, run_id: str, timeout: float, checking: bool = True):
        """``timeout``: what a request may take to arrive; ``checking``: whether this peer audits others' pieces (it
        shows its own either way)."""
        self.p2p, self.timeout, self.checking = p2p, timeout, checking
        self.handler_name = f"p2ploco/{run_id}/audit"
        self._kept: OrderedDict[str, _Kept] = OrderedDict()  # group id -> what this reducer weighed in it

    async def start(self) -> None:
        await self.p2p.add_binary_stream_handler(self.handler_name, self._serve)

    def keep(self, group: Group, slice_name: str, span: Span, payloads: tuple[bytes, ...]) -> None:
        """What this reducer weighed for a piece, as its receipt names them: shown to auditors of ``group``."""
        kept = self._kept.get(group.group_id)
        if kept is None:
            kept = self._kept[group.group_id] = _Kept(group)
            while len(self._kept) > KEPT_GROUPS:
                self._kept.popitem(last=False)
        kept.pieces[(slice_name, span.start)] = (span.stop, payloads)

    async def _serve(self, stream_info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        asker = str(stream_info.peer_id)
        async with wire.serving(logger, "audit", asker, reader, writer, self.timeout):
            header, _ = await in_time(wire.read_message(reader, 0), self.timeout)
            request = decode(AuditRequest, header)
            payloads, why = self._shown(asker, request)
            if payloads is None:
                await wire.write_message(writer, {"status": AuditStatus.UNKNOWN, "reason": why})
                return
            await wire.write_message(writer, {"status": AuditStatus.OK, "lengths": [len(p) for p in payloads]},
                                     b"".join(payloads))

    def _shown(self, asker: str, request: AuditRequest) -> tuple[tuple[bytes, ...] | None, str]:
        """The payloads ``request`` asks for, or None and why not."""
        kept = self._kept.get(request.group_id)
        if kept is None or asker not in kept.group.peers:
            return None, "no group of this id with the asker in it is kept here"
        if kept.asked[asker] >= AUDITS_PER_MEMBER:
            return None, f"the asker audited this group {AUDITS_PER_MEMBER} times already"
        kept.asked[asker] += 1
        start, stop = request.span
        piece = kept.pieces.get((request.slice, start))
        if piece is None or piece[0] != stop:
            return None, "no such piece was reduced here in that group"
        return piece[1], ""

    def most_shown(self, exchange: Exchange, span: Span, weighed: tuple[str, ...]) -> int:
        """The most bytes an honest answer to an audit of ``span`` can hold."""
        return exchange.max_payload_bytes(span) * len(weighed)

    async def check(self, group: Group, exchange: Exchange, slice_name: str, span: Span, reducer: str,
                    receipt: Receipt, weighed: tuple[str, ...], transfer: float) -> str | None:
        """Audit the piece ``span`` of ``slice_name`` that ``reducer`` answered this peer with ``receipt`` (which
        weighed the contributions of ``weighed``, in its order), as this peer took it: why it fails, or None.
        ``transfer``: the deadline of its answer (``most_shown`` bytes: a reducer that stalls it fails)."""
        limit = self.most_shown(exchange, span, weighed)
        try:
            reply, blob = await in_time(
                wire.call(self.p2p, reducer, self.handler_name,
                          {"group_id": group.group_id, "slice": slice_name, "span": [span.start, span.stop]},
                          max_payload=limit), transfer)
            answer = decode(AuditAnswer, reply)
        except (TransportError, TimeoutError) as e:
            return f"it did not show the contributions it reduced ({e!r})"
        except PayloadError as e:
            return f"its answer to an audit is malformed: {e}"
        if answer.status != AuditStatus.OK:
            return f"it did not show the contributions it reduced: {answer.reason[:200]}"
        if len(answer.lengths) != len(weighed) or sum(answer.lengths) != len(blob):
            return "it showed other contributions than its receipt names"
        payloads, at = [], 0
        for length in answer.lengths:
            payloads.append(blob[at : at + length])
            at += length
        loop = asyncio.get_running_loop()
        checking = faults.seam("audit.check", self, audit)
        return await loop.run_in_executor(None, checking, exchange, span, list(zip(weighed, payloads)),
                                          group.tokens_of(), receipt, exchange.taken(span))
