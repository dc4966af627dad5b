"""A round's outcome, the same for every survivor: commit, redo among the survivors, or abort.

After the butterfly every member votes: it holds the aggregate of every span (and sends its
digest), or it does not, or a reducer dropped it for a malformed contribution. The group's
coordinator decides once, when every member has voted or ``timeout`` after the first vote. Dropped
members are out of the round and cannot block it. Commit if every other vote is a success with one
digest (members that died after delivering their span do not vote and need not); otherwise, on a
first attempt, a redo among the members that voted and were not dropped (the dead cannot vote);
otherwise abort, and nobody applies anything this round. Only the coordinator decides: a member that
cannot reach it applies nothing (as if aborted) and, if the others committed, catches up from them
before the next round. A second judge would let two halves of a group decide differently.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from hivemind.p2p import P2P

from p2ploco.errors import PayloadError
from p2ploco.swarm import wire
from p2ploco.swarm.rounds import Group

logger = logging.getLogger(__name__)

KEEP_BALLOTS = 16


@dataclass(frozen=True)
class Decision:
    outcome: str  # commit, redo or abort
    redo: Group | None = None  # with outcome redo: the survivors' group


@dataclass
class _Ballot:
    group: Group
    deadline: float
    votes: dict[str, tuple[bool, str]] = field(default_factory=dict)  # voter -> (holds every span, digest)
    dropped: set[str] = field(default_factory=set)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    decided: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class RoundCommit:
    def __init__(self, p2p: P2P, me: str, run_id: str, timeout: float):
        self.p2p, self.me, self.timeout = p2p, me, timeout
        self.handler_name = f"p2ploco/{run_id}/vote"
        self._ballots: dict[str, _Ballot] = {}

    async def start(self) -> None:
        await self.p2p.add_binary_stream_handler(self.handler_name, self._serve_vote)

    async def vote(self, group: Group, ok: bool, digest: str, dropped: bool = False) -> Decision:
        request = {"group_id": group.group_id, "round": group.round_index, "name": group.name,
                   "peers": list(group.peers), "coordinator": group.coordinator, "attempt": group.attempt,
                   "ok": ok, "digest": digest, "dropped": dropped}
        judge = group.coordinator
        try:
            if judge == self.me:
                response = await self._decide_here(self.me, request)
            else:
                response, _ = await asyncio.wait_for(wire.call(self.p2p, judge, self.handler_name, request),
                                                     2 * self.timeout + 5)
            return _parse_decision(response, group, judge)
        except Exception as e:  # an unreachable or confused judge: apply nothing, catch up after
            logger.warning(f"round {group.round_index}: no decision from the coordinator {judge[-8:]} ({e!r}); "
                           f"applying nothing")
            return Decision("abort")

    async def _serve_vote(self, stream_info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        voter = str(stream_info.peer_id)
        try:
            request, _ = await asyncio.wait_for(wire.read_message(reader, max_payload=0), self.timeout)
            await wire.write_message(writer, await self._decide_here(voter, request))
        except Exception as e:  # whatever a peer sends, the node keeps serving
            logger.info(f"vote from {voter[-8:]} failed: {e!r}")
        finally:
            writer.close()

    async def _decide_here(self, voter: str, request: dict[str, Any]) -> dict[str, Any]:
        peers = wire.field(request, "peers", list)
        group = Group(wire.field(request, "group_id", str), wire.field(request, "round", int),
                      wire.field(request, "name", str), tuple(p for p in peers if isinstance(p, str)),
                      wire.field(request, "coordinator", str), wire.field(request, "attempt", int))
        ok, digest, dropped = (wire.field(request, "ok", bool), wire.field(request, "digest", str),
                               wire.field(request, "dropped", bool))
        if voter not in group.peers or len(group.peers) != len(peers):
            raise PayloadError(f"{voter[-8:]} is not a member of the group it votes for")
        ballot = self._ballots.get(group.group_id)
        if ballot is None:
            ballot = self._ballots[group.group_id] = _Ballot(group, time.monotonic() + self.timeout)
            asyncio.get_running_loop().create_task(self._close(ballot))
            for old in list(self._ballots)[:-KEEP_BALLOTS]:
                del self._ballots[old]
        elif ballot.group != group:
            raise PayloadError("vote names another membership for this group")
        if dropped:
            ballot.dropped.add(voter)
        else:
            ballot.votes.setdefault(voter, (ok, digest))
        ballot.changed.set()
        decision: Decision = await asyncio.wait_for(asyncio.shield(ballot.decided), 2 * self.timeout)
        response = {"outcome": decision.outcome}
        if decision.redo is not None:
            response.update(group_id=decision.redo.group_id, peers=list(decision.redo.peers))
        return response

    async def _close(self, ballot: _Ballot) -> None:
        try:
            while (len(ballot.votes) + len(ballot.dropped) < len(ballot.group.peers)
                   and time.monotonic() < ballot.deadline):
                ballot.changed.clear()
                try:
                    await asyncio.wait_for(ballot.changed.wait(), ballot.deadline - time.monotonic())
                except TimeoutError:
                    pass
        finally:
            ballot.decided.set_result(self._decision(ballot))

    def _decision(self, ballot: _Ballot) -> Decision:
        group, votes = ballot.group, ballot.votes
        digests = {digest for ok, digest in votes.values() if ok}
        if votes and all(ok for ok, _ in votes.values()) and len(digests) == 1:
            return Decision("commit")
        if group.attempt == 0 and len(votes) >= 2:
            survivors = tuple(sorted(votes))
            logger.warning(f"round {group.round_index}: all-reduce failed for some of {len(group.peers)} peers; "
                           f"redoing it among the {len(survivors)} that answered")
            return Decision("redo", Group(secrets.token_hex(8), group.round_index, group.name, survivors, self.me, 1))
        logger.warning(f"round {group.round_index}: all-reduce failed; the round is dropped by every survivor")
        return Decision("abort")


def _parse_decision(response: dict[str, Any], group: Group, judge: str) -> Decision:
    outcome = response.get("outcome")
    if outcome in ("commit", "abort"):
        return Decision(outcome)
    peers, group_id = response.get("peers"), response.get("group_id")
    if (outcome == "redo" and isinstance(group_id, str) and isinstance(peers, list) and peers == sorted(set(peers))
            and all(isinstance(p, str) and p in group.peers for p in peers)):
        return Decision("redo", Group(group_id, group.round_index, group.name, tuple(peers), judge, 1))
    raise PayloadError(f"malformed decision {response!r}")
