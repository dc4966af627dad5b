"""The member's side of the butterfly (``sync/reduce.py``): send this peer's contribution to each piece to the piece's
reducer, and take back and check the piece's result. What came of each piece is a value (``Delivery``): a broken
link, a timeout or a malformed answer is turned into one here, at the edge, and what this peer does about the reducer
is left to ``ButterflyAllReduce._act_on``."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from hivemind.p2p import P2P

from p2ploco import faults
from p2ploco.aio import in_time
from p2ploco.collective.exchange import Exchange, Receipt, Span, contribution_digest
from p2ploco.collective.robust import OpposedResult
from p2ploco.errors import Failure, PayloadError, TransportError
from p2ploco.swarm import wire
from p2ploco.swarm.evidence import result_statement, signed_by
from p2ploco.swarm.messages import MAX_GROUP_HEADER, decode
from p2ploco.sync.group import Group
from p2ploco.sync.reduce_values import (
    AllReduceError,
    Delivery,
    DroppedFromRound,
    Evidence,
    OtherVersion,
    ReduceAnswer,
    ReducerElsewhere,
    ReduceStatus,
    TransferOutcome,
)

logger = logging.getLogger(__name__)


@dataclass
class Route:
    """This peer's pieces of one slice to one reducer: sent one after another, and not tried again once it
    failed."""

    group: Group
    slice: str
    exchange: Exchange
    transfer: float  # seconds any one transfer to this reducer may take: the bound (``TransferDeadline.seconds``)
    turn: asyncio.Lock = field(default_factory=asyncio.Lock)
    failure: AllReduceError | None = None


class Answered(NamedTuple):
    """What a reducer's answer says of the aggregate that follows it."""

    receipt: Receipt
    included: list[str]  # the members whose contributions make it up, in canonical order
    opposed: list[str]  # those it left out as pointing against the others, in canonical order
    signature: bytes  # the reducer's signature of it


def parse_reply(reply: dict[str, Any], group: Group, me: str, sent: bytes | None) -> Answered | AllReduceError:
    """What a reducer's answer says of the aggregate that follows it, or why there is none: DroppedFromRound if the
    reducer rejected ours as malformed, ReducerElsewhere if it takes part in this round in another group
    (OtherVersion: in another version of this one), AllReduceError if it went on without it. PayloadError is raised if
    the answer is malformed: it leaves this peer out or names another contribution of this peer's than the one it
    ``sent`` (None: a hub, which sends none), names non-members, or leaves out as many contributions as it keeps (at
    most a minority may point against the others)."""
    answer = decode(ReduceAnswer, reply)
    if answer.status == ReduceStatus.REJECTED:
        return DroppedFromRound(f"a reducer rejected this peer's contribution: {answer.reason[:200]}", Failure.REJECTED)
    if answer.version is not None and answer.version != group.digest:
        return OtherVersion(f"a reducer holds another version of this peer's group: {answer.reason[:200]}",
                            answer.version, answer.grant)
    if answer.elsewhere:
        return ReducerElsewhere(f"a reducer is not in this peer's group: {answer.reason[:200]}", Failure.MISSED)
    if answer.status == ReduceStatus.MISSED:
        return AllReduceError(f"a reducer went on without this peer's contribution: {answer.reason[:200]}",
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
    return Answered(receipt, members, left_out, answer.signature)


def answered_without(reducer: str, encoded: int, error: AllReduceError, sent: int = 0) -> Delivery:
    """A reducer's answer that holds no aggregate (``error``: it refused our contribution, went on without it, or
    takes part in the round elsewhere), or a route that failed before."""
    if isinstance(error, ReducerElsewhere):  # it sends us nothing either
        return Delivery(reducer=reducer, encoded=encoded, sent=sent, outcome=TransferOutcome.ELSEWHERE, error=error,
                        reason="it takes part in this round in another group")
    return Delivery(reducer=reducer, encoded=encoded, sent=sent, outcome=TransferOutcome.REFUSED, error=error)


class Contributor:
    def __init__(self, p2p: P2P, me: str, run_id: str, handler_name: str, timeout: float,
                 keys: Callable[[str], bytes | None]):
        """``handler_name``: the reducers' stream handler; ``timeout``: for what does not grow with the payload;
        ``keys``: a peer's public key (None: unknown), which its signatures are checked with."""
        self.p2p, self.me, self.run_id, self.handler_name, self.timeout, self.keys = (
            p2p, me, run_id, handler_name, timeout, keys)

    async def send(self, peer: str, route: Route, piece: Span) -> Delivery:
        """Send our contribution to ``piece`` to its reducer ``peer`` (after our earlier pieces to it) and take back
        the piece's aggregate: what came of it."""
        group, exchange = route.group, route.exchange
        listens = self.me not in group.contributors(route.slice)  # a hub: it sends nothing, takes the result
        payload = (b"" if listens else
                   await asyncio.get_running_loop().run_in_executor(None, exchange.encode, piece))
        sent, writer = 0, None
        try:
            async with route.turn:  # one piece on the wire to a reducer at a time: it reduces one as the next comes
                if route.failure is not None:
                    return answered_without(peer, len(payload), route.failure)
                reader, writer = await in_time(wire.open_stream(self.p2p, peer, self.handler_name),
                                               self.timeout)
                header = {"group_id": group.group_id, "round": group.round_index, "slice": route.slice,
                          "span": [piece.start, piece.stop], "coordinator": group.coordinator, "listen": listens,
                          "version": group.digest}
                await in_time(wire.write_message(writer, header, payload), route.transfer)
            sent = len(payload)
            await faults.hit_async("allreduce.contribute", group.round_index)
            return await self._take(peer, route, piece, reader, None if listens else payload)
        except TransportError as e:  # the reducer crashed, or the link to it broke: it will not send us its part
            return Delivery(reducer=peer, encoded=len(payload), sent=sent, outcome=TransferOutcome.MISSED,
                            reason=f"the link to it failed ({e})",
                            error=AllReduceError(f"no aggregate from reducer {peer[-8:]}: {e}", wire.failure_of(e)))
        except TimeoutError:  # slow is not dead: its own contributions may still come
            return Delivery(reducer=peer, encoded=len(payload), sent=sent, outcome=TransferOutcome.LATE,
                            error=AllReduceError(f"no aggregate from reducer {peer[-8:]} in time", Failure.TIMEOUT))
        except OpposedResult as e:  # what an honest result does rarely, a hostile one always
            return Delivery(reducer=peer, encoded=len(payload), sent=sent, outcome=TransferOutcome.OPPOSED,
                            reason=f"its result for span {piece.start}:{piece.stop} pointed against this peer's own "
                                   f"contribution",
                            error=AllReduceError(f"no aggregate from reducer {peer[-8:]}: {e}", Failure.MALFORMED))
        except PayloadError as e:  # its answer or aggregate is malformed (or exceeds what it combined)
            return Delivery(reducer=peer, encoded=len(payload), sent=sent, outcome=TransferOutcome.MALFORMED,
                            reason=f"malformed answer to our contribution: {e}",
                            error=AllReduceError(f"no aggregate from reducer {peer[-8:]}: {e}", Failure.MALFORMED))
        finally:
            if writer is not None:
                writer.close()

    async def _take(self, peer: str, route: Route, piece: Span, reader: asyncio.StreamReader,
                    payload: bytes | None) -> Delivery:
        """Read the reducer's answer to our contribution ``payload`` (None: a hub's request), check the piece's result
        and take it into the exchange; raises PayloadError (or OpposedResult) where the answer fails a check."""
        group, exchange = route.group, route.exchange
        encoded, sent = len(payload or b""), len(payload or b"")
        # The reducer may wait a transfer's time for the slowest sender before it answers, and the answer takes another.
        reply, result = await in_time(
            wire.read_message(reader, exchange.max_result_bytes(piece, len(group.peers)), MAX_GROUP_HEADER),
            2 * route.transfer)
        answer = parse_reply(reply, group, self.me, payload)
        if isinstance(answer, AllReduceError):  # the reducer refused our contribution or went on without it
            return answered_without(peer, encoded, answer, sent)
        receipt, included, opposed, signature = answer
        opposed_ours = receipt.own is None and payload is not None
        if opposed_ours:
            logger.warning(f"round {group.round_index}: reducer {peer[-8:]} left this peer's contribution to span "
                           f"{piece.start}:{piece.stop} out: it points against the others'")
        digest = await asyncio.get_running_loop().run_in_executor(None, exchange.receive, piece, result, receipt)
        key = self.keys(peer)
        if key is None or not signed_by(key, result_statement(self.run_id, group.digest, route.slice, piece.start,
                                                              piece.stop, digest), signature):
            raise PayloadError("a result that its reducer's key did not sign")
        return Delivery(reducer=peer, encoded=encoded, sent=sent, received=len(result), opposed_ours=opposed_ours,
                        left_out=frozenset(group.contributors(route.slice)) - set(included) - {self.me},
                        combined=frozenset(included),
                        evidence=Evidence(route.slice, piece, peer, digest, signature, receipt, (*included, *opposed)))
