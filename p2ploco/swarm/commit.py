"""A round's outcome, the same for every survivor: commit, redo among the survivors, or abort.

After the butterfly every member votes: it holds the aggregate of every span of every slice it holds
(and sends a digest per slice), some span's aggregate is missing (a link failed, or a reducer went on
without it), or a reducer rejected its contribution as malformed. Each vote also lists the peers the voter
rejected from its own spans for malformed data. The group's coordinator decides once, when every member has
voted, or ``timeout`` after the first vote. It does not wait for a member that some reducer rejected for
malformed data (it cannot hold every span), nor for one whose daemon cannot be dialled any more (the
coordinator tries every few seconds: it crashed). A member whose link to some reducer broke is waited for:
it is alive, and votes "missing".

- commit, if every counted vote holds, and all holders of each slice hold one digest of it; members
  that died after delivering their span do not vote and need not;
- otherwise, on a first attempt, redo among the counted voters (the dead cannot vote), less the stage
  peers of a pipeline group that is no longer whole among them (a group acts as one replica or not at
  all): they run the butterfly again with the same pseudo-gradients and a fresh group id. A member that
  only missed a span (a broken stream) is in the redo: one broken stream costs a redo, never the round;
- otherwise commit, for every slice, the digest held by a strict majority of its counted holders (a
  single liar that votes "missing" costs a redo, never the round; ``consensus.plurality`` with the holders as
  its electorate), or abort if some slice has none: nobody applies anything this round.

A member applies the aggregate only if the decision names the digest it holds of each of its slices.
The coordinator judges every vote against its own record of the group it formed (or of the redo it
decided), never against what a voter claims the group is. A vote is not counted if its voter says it was
rejected, or if two reducers report rejecting it: one accuser alone (a liar) cannot push an honest peer
out; it can only spare the others a wait. A redo or commit without some members comes with the reason,
which every member logs. Only the coordinator decides. A member whose vote's stream breaks asks again (the
coordinator answers a second ask with the same decision); one that cannot reach it at all applies nothing
(as if aborted) and, if the others committed, catches up from them before the next round, unless it can join the
round where the others form it at the next coordinator (``SwarmCommunicator``: a formation already open there,
never one of its own). A second judge would let two halves of a group decide differently.

The vote request, a wire message (``swarm/wire.py``) with no payload::

    {v, group_id, vote: holds|missing|dropped, digests: {slice: digest}, drops: [peers rejected as malformed]}

and the decision: ``{v, outcome: commit|redo|abort, digests: {slice: digest}, reason}`` (+ ``group_id,
peers`` for a redo).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hivemind.p2p import P2P
from pydantic import model_validator

from p2ploco import faults
from p2ploco.errors import Failure, PayloadError, TransportError
from p2ploco.swarm import wire
from p2ploco.swarm.consensus import Ballot, plurality
from p2ploco.swarm.group import Group, GroupBook
from p2ploco.swarm.messages import Digest, Digests, Message, PeerIds, Reason, decode, status_of

logger = logging.getLogger(__name__)

KEEP_BALLOTS = 16
PROBE_EVERY = 2.0  # seconds between looks at whether awaited voters are still reachable
ACCUSERS = 2  # reducers that must report rejecting a peer before its own vote stops counting


class Vote(enum.StrEnum):
    HOLDS = "holds"  # this member holds the aggregate of every span (its digest comes with the vote)
    MISSING = "missing"  # some span's aggregate did not arrive, or a reducer went on without this member
    DROPPED = "dropped"  # a reducer rejected this member's contribution as malformed: it is out of the round


class Outcome(enum.StrEnum):
    COMMIT = "commit"
    REDO = "redo"
    ABORT = "abort"


@dataclass(frozen=True)
class Decision:
    outcome: Outcome
    digests: dict[str, str] = field(default_factory=dict)  # with commit: the aggregate of each slice to apply
    redo: Group | None = None  # with redo: the survivors' group
    reason: str = ""  # why the decision leaves members out, or drops the round (empty: it does neither)

    def applies(self, digests: dict[str, str]) -> bool:
        """Whether a member that holds ``digests`` (per slice) applies this round."""
        return self.outcome == Outcome.COMMIT and all(self.digests.get(k) == v for k, v in digests.items())


@dataclass
class _Ballot:
    group: Group
    deadline: float
    votes: dict[str, tuple[Vote, dict[str, str]]] = field(default_factory=dict)  # voter -> (vote, digest per slice)
    accusers: dict[str, set[str]] = field(default_factory=dict)  # peer -> the voters that rejected it as malformed
    dead: set[str] = field(default_factory=set)  # members the coordinator could not reach while waiting for them
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    decided: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())

    def waiting_for(self) -> list[str]:
        """Members that have not voted, less those a reducer rejected as malformed (they cannot hold every span)
        and those the coordinator found dead (they cannot vote)."""
        return [p for p in self.group.peers if p not in self.votes and not self.accusers.get(p) and p not in self.dead]


class RoundCommit:
    def __init__(self, p2p: P2P, me: str, run_id: str, timeout: float, book: GroupBook):
        """``book``: the groups this peer coordinates (the matchmaker adds them; redos decided here too)."""
        self.p2p, self.me, self.timeout, self.book = p2p, me, timeout, book
        self.handler_name = f"p2ploco/{run_id}/vote"
        self._ballots: dict[str, _Ballot] = {}
        self._decided = asyncio.Event()  # set whenever a ballot is decided (``judge_to_the_end`` waits on it)

    async def start(self) -> None:
        await self.p2p.add_binary_stream_handler(self.handler_name, self._serve_vote)

    async def vote(self, group: Group, vote: Vote, digests: dict[str, str], malformed: set[str]
                   ) -> tuple[Decision, Failure | None]:
        """Tell the coordinator what this member holds (a digest per slice) and whom it rejected as malformed; its
        decision, or abort (and what went wrong) if none arrives. A vote whose stream broke is asked again: the
        coordinator answers the same decision twice."""
        request = {"group_id": group.group_id, "vote": vote, "digests": digests,
                   "drops": sorted(malformed & set(group.peers))}
        judge = group.coordinator
        try:
            await faults.hit_async("commit.vote", group.round_index)
            if judge == self.me:
                response = await self._decide_here(self.me, request)
            else:
                response, _ = await asyncio.wait_for(
                    wire.call(self.p2p, judge, self.handler_name, request, attempts=2), 2 * self.timeout + 5)
            return parse_decision(response, group, judge), None
        except (PayloadError, TransportError, TimeoutError) as e:  # unreachable or confused: apply nothing, catch up
            logger.warning(f"round {group.round_index}: no decision from the coordinator {judge[-8:]} ({e!r}); "
                           f"applying nothing")
            return Decision(Outcome.ABORT), wire.failure_of(e)

    async def judge_to_the_end(self) -> None:
        """This peer is leaving: first decide the rounds of the groups it formed that are still voting (a peer that
        coordinates a round it does not train, standing by, would otherwise leave its members without a judge, and
        they would apply nothing). Returns once none is open; the caller bounds the wait."""
        while True:
            self._decided.clear()
            # A group's votes come within its all-reduce, then its ballot's own timeout
            recent = [g for g in self.book.since(2 * self.timeout) if len(g.peers) > 1]  # one alone never votes
            if all(g.group_id in self._ballots and self._ballots[g.group_id].decided.done() for g in recent):
                return
            await self._decided.wait()

    async def _serve_vote(self, stream_info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        voter = str(stream_info.peer_id)
        async with wire.serving(logger, "vote", voter, reader, writer, self.timeout):
            request, _ = await asyncio.wait_for(wire.read_message(reader, max_payload=0), self.timeout)
            await wire.write_message(writer, await self._decide_here(voter, request))

    async def _decide_here(self, voter: str, request: dict[str, Any]) -> dict[str, Any]:
        group_id, vote, digests, drops = parse_vote(request)
        group = self.book.get(group_id)
        if group is None:
            raise PayloadError("vote for a group this peer does not coordinate")
        if voter not in group.peers:
            raise PayloadError(f"{voter[-8:]} is not a member of the group it votes for")
        if vote == Vote.HOLDS and set(digests) != set(group.slices_of(voter)):
            raise PayloadError(f"{voter[-8:]} votes for other slices than it holds")
        ballot = self._ballots.get(group.group_id)
        if ballot is None:
            ballot = self._ballots[group.group_id] = _Ballot(group, time.monotonic() + self.timeout)
            asyncio.get_running_loop().create_task(self._close(ballot))
            for old in list(self._ballots)[:-KEEP_BALLOTS]:
                del self._ballots[old]
        if voter not in ballot.votes:
            ballot.votes[voter] = (vote, digests)
            for peer in drops & set(group.peers):
                ballot.accusers.setdefault(peer, set()).add(voter)
        ballot.changed.set()
        decision: Decision = await asyncio.wait_for(asyncio.shield(ballot.decided), 2 * self.timeout)
        response: dict[str, Any] = {"outcome": decision.outcome, "digests": decision.digests,
                                    "reason": decision.reason}
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
            decision = decide(ballot.group, ballot.votes, ballot.accusers, self.me)
            if decision.redo is not None:
                self.book.add(decision.redo)
            ballot.decided.set_result(decision)
            self._decided.set()

    async def _probe(self, ballot: _Ballot) -> None:
        """Every PROBE_EVERY seconds, try to open a stream to each member still awaited: one whose daemon cannot
        be reached at all has crashed (after delivering its span, or nobody would wait for it), and is not
        waited for until the deadline. A member behind a NAT cannot be dialled at all: its vote is waited
        for."""
        while True:
            await asyncio.sleep(PROBE_EVERY)
            for peer in ballot.waiting_for():
                if peer == self.me or peer in ballot.group.dial_out:
                    continue
                if not await wire.reachable(self.p2p, peer, self.handler_name, PROBE_EVERY):
                    logger.info(f"round {ballot.group.round_index}: {peer[-8:]} cannot be reached; not waiting "
                                f"for its vote")
                    ballot.dead.add(peer)
                    ballot.changed.set()


def decide(group: Group, votes: dict[str, tuple[Vote, dict[str, str]]], accusers: dict[str, set[str]],
           me: str) -> Decision:
    """The coordinator's rule (module docstring), a pure function of the votes."""
    def out(peer: str) -> bool:
        return votes[peer][0] == Vote.DROPPED or len(accusers.get(peer, ())) >= ACCUSERS

    counted = {peer: v for peer, v in votes.items() if not out(peer)}
    left_out = _why_left_out(group, votes, out)
    held: dict[str, list[Ballot[str]]] = {}  # slice -> the digests its counted holders hold, all in good standing
    for peer, (vote, digests) in counted.items():
        for slice_name in group.slices_of(peer):
            if vote == Vote.HOLDS:
                held.setdefault(slice_name, []).append((digests[slice_name], True))
    holders = {name: sum(name in group.slices_of(peer) for peer in counted) for name in held}
    if counted and all(vote == Vote.HOLDS for vote, _ in counted.values()) and all(
            len({digest for digest, _ in ballots}) == 1 for ballots in held.values()):
        return Decision(Outcome.COMMIT, {name: ballots[0][0] for name, ballots in held.items()},
                        reason=f"committed without {left_out}" if left_out else "")
    if group.attempt == 0 and len(counted) >= 2:
        survivors = tuple(sorted(group.whole_pipeline_groups(set(counted))))
        redo = group.among(secrets.token_hex(8), survivors, me)
        # Every slice the survivors hold needs a survivor that can be dialled to reduce it, and a contributor: a redo
        # of NATed trainers whose only hub died would reduce nothing, and "commit" an aggregate nobody holds
        slices = {name for peer in survivors for name in group.slices_of(peer)}
        if len(survivors) >= 2 and all(redo.reducers(name) and redo.contributors(name) for name in slices):
            missing = sorted(p[-8:] for p in survivors if counted[p][0] != Vote.HOLDS)
            reason = (f"the all-reduce failed for {', '.join(missing) or 'nobody'} (a span did not arrive, or "
                      f"holders disagree); redoing it among {len(survivors)} of {len(group.peers)} peers"
                      + (f", without {left_out}" if len(survivors) < len(group.peers) else ""))
            logger.info(f"round {group.round_index}: {reason}")  # every member logs it at WARNING
            return Decision(Outcome.REDO, redo=redo, reason=reason)
    majority = {name: digest for name, ballots in held.items()
                if (digest := plurality(ballots, electorate=holders[name])) is not None}
    counted_slices = {name for peer in counted for name in group.slices_of(peer)}
    if majority and set(majority) == counted_slices:
        reason = "a majority of each slice's holders hold the same aggregate; committed for them, the others catch up"
        logger.info(f"round {group.round_index}: {reason}")  # every member logs it at WARNING
        return Decision(Outcome.COMMIT, majority, reason=reason)
    reason = "the all-reduce failed and no aggregate is held by a majority; the round is dropped by every survivor"
    logger.info(f"round {group.round_index}: {reason}")  # every member logs it at WARNING
    return Decision(Outcome.ABORT, reason=reason)


def _why_left_out(group: Group, votes: dict[str, tuple[Vote, dict[str, str]]], out: Callable[[str], bool]) -> str:
    """The members a decision goes on without, and why ("" if none)."""
    reasons = [f"{peer[-8:]} (" + ("it did not vote" if peer not in votes else "it was rejected as malformed") + ")"
               for peer in group.peers if peer not in votes or out(peer)]
    return ", ".join(reasons)


class VoteRequest(Message):
    group_id: Digest
    vote: status_of(Vote)
    digests: Digests  # with holds: the aggregate of each slice the voter holds
    drops: PeerIds  # the members the voter rejected as malformed from its spans


class DecisionAnswer(Message):
    outcome: status_of(Outcome)
    digests: Digests = {}  # with commit
    reason: Reason
    group_id: Digest = ""  # with redo: the survivors' group
    peers: PeerIds = []

    @model_validator(mode="after")
    def _complete(self) -> DecisionAnswer:
        if self.outcome == Outcome.REDO and not (self.group_id and self.peers):
            raise ValueError("a redo without the survivors' group")
        return self


def parse_vote(request: dict[str, Any]) -> tuple[str, Vote, dict[str, str], set[str]]:
    """A vote request's group id, vote, digest per slice and reported drops; PayloadError if malformed."""
    vote = decode(VoteRequest, request)
    return vote.group_id, vote.vote, vote.digests, set(vote.drops)


def parse_decision(response: dict[str, Any], group: Group, judge: str) -> Decision:
    """The coordinator's answer to a vote; PayloadError if malformed."""
    answer = decode(DecisionAnswer, response)
    if answer.outcome == Outcome.REDO:
        if group.attempt >= 1:  # members redo a round once: a coordinator that answers "redo" forever stalls nobody
            raise PayloadError("a second redo of one round")
        if not set(answer.peers) <= set(group.peers):
            raise PayloadError("redo group names peers outside the round's group")
        return Decision(answer.outcome, redo=group.among(answer.group_id, tuple(answer.peers), judge),
                        reason=answer.reason)
    return Decision(answer.outcome, answer.digests if answer.outcome == Outcome.COMMIT else {}, reason=answer.reason)
