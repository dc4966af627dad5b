"""A round's outcome, the same for every survivor: commit, redo among the survivors, or abort.

After the butterfly every member votes: it holds the aggregate of every span (and sends its
digest), some span's aggregate is missing, or a reducer dropped it. Each vote also lists the peers
the voter dropped from its own span (malformed, silent or unreachable). The group's coordinator
decides once, when every member that nobody reported dropped has voted, or ``timeout`` after the
first vote: a peer already known bad or dead is never waited for a second time, and one whose daemon
cannot be dialled any more (the coordinator tries every few seconds) is not waited for either.

- commit, if every vote (of a voter not known dropped) holds one digest; members that died after
  delivering their span do not vote and need not;
- otherwise, on a first attempt, redo among the voters not known dropped (the dead cannot vote):
  they run the butterfly again with the same pseudo-gradients and a fresh group id;
- otherwise commit the digest held by a strict majority of those voters (a single liar that votes
  "missing" costs a redo, never the round), or abort: nobody applies anything this round.

A member applies the aggregate only if the decision names the digest it holds. A voter counts as
known dropped if it says so, or if two reducers report dropping it: one accuser alone (a liar, or a
link that broke once) cannot push an honest peer out; it can only spare the others a wait. Only the
coordinator decides: a member that cannot reach it applies nothing (as if aborted) and, if the
others committed, catches up from them before the next round. A second judge
would let two halves of a group decide differently.

The vote request, a wire message (``swarm/wire.py``) with no payload::

    {v, group_id, round, name, peers, coordinator, attempt, vote: holds|missing|dropped, digest, drops}

and the decision: ``{v, outcome: commit|redo|abort, digest}`` (+ ``group_id, peers`` for a redo).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import secrets
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from hivemind.p2p import P2P

from p2ploco.errors import PayloadError
from p2ploco.swarm import wire
from p2ploco.swarm.rounds import Group

logger = logging.getLogger(__name__)

KEEP_BALLOTS = 16
PROBE_EVERY = 2.0  # seconds between looks at whether awaited voters are still reachable
ACCUSERS = 2  # reducers that must report dropping a peer before its own vote stops counting


class Vote(enum.StrEnum):
    HOLDS = "holds"  # this member holds the aggregate of every span (its digest comes with the vote)
    MISSING = "missing"  # some span's aggregate did not arrive or was malformed
    DROPPED = "dropped"  # a reducer refused this member's contribution: it is out of the round


class Outcome(enum.StrEnum):
    COMMIT = "commit"
    REDO = "redo"
    ABORT = "abort"


@dataclass(frozen=True)
class Decision:
    outcome: Outcome
    digest: str = ""  # with commit: the aggregate to apply; a member holding another one applies nothing
    redo: Group | None = None  # with redo: the survivors' group


@dataclass
class _Ballot:
    group: Group
    deadline: float
    votes: dict[str, tuple[Vote, str]] = field(default_factory=dict)  # voter -> (vote, digest)
    accusers: dict[str, set[str]] = field(default_factory=dict)  # peer -> the voters that report dropping it
    dead: set[str] = field(default_factory=set)  # members the coordinator could not reach while waiting for them
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    decided: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())

    def waiting_for(self) -> list[str]:
        """Members that have not voted, and that nobody reported dropped or found dead (those need not be waited
        for: they cannot hold every span, or cannot vote)."""
        return [p for p in self.group.peers if p not in self.votes and not self.accusers.get(p) and p not in self.dead]


class RoundCommit:
    def __init__(self, p2p: P2P, me: str, run_id: str, timeout: float):
        self.p2p, self.me, self.timeout = p2p, me, timeout
        self.handler_name = f"p2ploco/{run_id}/vote"
        self._ballots: dict[str, _Ballot] = {}

    async def start(self) -> None:
        await self.p2p.add_binary_stream_handler(self.handler_name, self._serve_vote)

    async def vote(self, group: Group, vote: Vote, digest: str, drops: set[str]) -> Decision:
        """Tell the coordinator what this member holds and whom it dropped; its decision (abort if unreachable)."""
        request = {"group_id": group.group_id, "round": group.round_index, "name": group.name,
                   "peers": list(group.peers), "coordinator": group.coordinator, "attempt": group.attempt,
                   "vote": vote, "digest": digest, "drops": sorted(drops & set(group.peers))}
        judge = group.coordinator
        try:
            if judge == self.me:
                response = await self._decide_here(self.me, request)
            else:
                response, _ = await asyncio.wait_for(wire.call(self.p2p, judge, self.handler_name, request),
                                                     2 * self.timeout + 5)
            return parse_decision(response, group, judge)
        except (PayloadError, *wire.TRANSPORT_ERRORS) as e:  # unreachable or confused: apply nothing, catch up
            logger.warning(f"round {group.round_index}: no decision from the coordinator {judge[-8:]} ({e!r}); "
                           f"applying nothing")
            return Decision(Outcome.ABORT)

    async def _serve_vote(self, stream_info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        voter = str(stream_info.peer_id)
        try:
            request, _ = await asyncio.wait_for(wire.read_message(reader, max_payload=0), self.timeout)
            await wire.write_message(writer, await self._decide_here(voter, request))
        except (PayloadError, *wire.TRANSPORT_ERRORS) as e:  # a malformed vote, or the voter went away
            logger.info(f"vote from {voter[-8:]} failed: {e!r}")
        except Exception:  # a bug: keep serving votes, and say where it is
            logger.exception(f"vote from {voter[-8:]} failed unexpectedly")
        finally:
            writer.close()

    async def _decide_here(self, voter: str, request: dict[str, Any]) -> dict[str, Any]:
        group, vote, digest, drops = parse_vote(request)
        if voter not in group.peers:
            raise PayloadError(f"{voter[-8:]} is not a member of the group it votes for")
        if group.coordinator != self.me:
            raise PayloadError("vote for a group this peer does not coordinate")
        ballot = self._ballots.get(group.group_id)
        if ballot is None:
            ballot = self._ballots[group.group_id] = _Ballot(group, time.monotonic() + self.timeout)
            asyncio.get_running_loop().create_task(self._close(ballot))
            for old in list(self._ballots)[:-KEEP_BALLOTS]:
                del self._ballots[old]
        elif ballot.group != group:
            raise PayloadError("vote names another membership for this group")
        if voter not in ballot.votes:
            ballot.votes[voter] = (vote, digest)
            for peer in drops & set(group.peers):
                ballot.accusers.setdefault(peer, set()).add(voter)
        ballot.changed.set()
        decision: Decision = await asyncio.wait_for(asyncio.shield(ballot.decided), 2 * self.timeout)
        response: dict[str, Any] = {"outcome": decision.outcome, "digest": decision.digest}
        if decision.redo is not None:
            response.update(group_id=decision.redo.group_id, peers=list(decision.redo.peers))
        return response

    async def _close(self, ballot: _Ballot) -> None:
        prober = asyncio.get_running_loop().create_task(self._probe(ballot))
        try:
            while ballot.waiting_for() and time.monotonic() < ballot.deadline:
                ballot.changed.clear()
                try:
                    await asyncio.wait_for(ballot.changed.wait(), ballot.deadline - time.monotonic())
                except TimeoutError:
                    pass
        finally:
            prober.cancel()
            ballot.decided.set_result(decide(ballot.group, ballot.votes, ballot.accusers, self.me))

    async def _probe(self, ballot: _Ballot) -> None:
        """Every PROBE_EVERY seconds, try to open a stream to each member still awaited: one whose daemon cannot
        be reached at all has crashed (after delivering its span, or nobody would wait for it), and is not
        waited for until the deadline."""
        while True:
            await asyncio.sleep(PROBE_EVERY)
            for peer in ballot.waiting_for():
                if peer != self.me and not await wire.reachable(self.p2p, peer, self.handler_name, PROBE_EVERY):
                    logger.info(f"round {ballot.group.round_index}: {peer[-8:]} cannot be reached; not waiting "
                                f"for its vote")
                    ballot.dead.add(peer)
                    ballot.changed.set()


def decide(group: Group, votes: dict[str, tuple[Vote, str]], accusers: dict[str, set[str]], me: str) -> Decision:
    """The coordinator's rule (module docstring), a pure function of the votes."""
    def out(peer: str) -> bool:
        return votes[peer][0] == Vote.DROPPED or len(accusers.get(peer, ())) >= ACCUSERS

    counted = {peer: v for peer, v in votes.items() if not out(peer)}
    held = Counter(digest for vote, digest in counted.values() if vote == Vote.HOLDS)
    if counted and len(held) == 1 and sum(held.values()) == len(counted):
        return Decision(Outcome.COMMIT, next(iter(held)))
    if group.attempt == 0 and len(counted) >= 2:
        survivors = tuple(sorted(counted))
        logger.warning(f"round {group.round_index}: all-reduce failed for some of {len(group.peers)} peers; "
                       f"redoing it among the {len(survivors)} that answered")
        return Decision(Outcome.REDO, redo=Group(secrets.token_hex(8), group.round_index, group.name, survivors, me, 1))
    if held:
        digest, count = max(held.items(), key=lambda item: (item[1], item[0]))
        if 2 * count > len(counted):
            logger.warning(f"round {group.round_index}: {count} of {len(counted)} peers hold the same aggregate; "
                           f"committed for them, the others catch up")
            return Decision(Outcome.COMMIT, digest)
    logger.warning(f"round {group.round_index}: all-reduce failed; the round is dropped by every survivor")
    return Decision(Outcome.ABORT)


def parse_vote(request: dict[str, Any]) -> tuple[Group, Vote, str, set[str]]:
    """A vote request's group, vote, digest and reported drops; PayloadError if malformed."""
    group = Group(wire.field(request, "group_id", str), wire.field(request, "round", int),
                  wire.field(request, "name", str), tuple(wire.peer_ids(request, "peers")),
                  wire.field(request, "coordinator", str), wire.field(request, "attempt", int))
    return group, wire.status(request, Vote, "vote"), wire.field(request, "digest", str), set(
        wire.peer_ids(request, "drops"))


def parse_decision(response: dict[str, Any], group: Group, judge: str) -> Decision:
    """The coordinator's answer to a vote; PayloadError if malformed."""
    outcome = wire.status(response, Outcome, "outcome")
    if outcome == Outcome.REDO:
        peers = wire.peer_ids(response, "peers")
        if not set(peers) <= set(group.peers):
            raise PayloadError("redo group names peers outside the round's group")
        return Decision(outcome, redo=Group(wire.field(response, "group_id", str), group.round_index, group.name,
                                            tuple(peers), judge, 1))
    return Decision(outcome, wire.field(response, "digest", str) if outcome == Outcome.COMMIT else "")
