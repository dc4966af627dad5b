"""A round's outcome, the same for every survivor: commit, redo among the survivors, or abort.

After the butterfly every member votes on the version of the group it holds (its digest): it holds the aggregate of
every span of every slice it holds, some span's aggregate is missing (a link failed, or a reducer went on without
it), or a reducer rejected its contribution as malformed. Each vote also lists, for every piece it took, the piece's
digest and its reducer's signature of it (``swarm/evidence.py``), whom the voter rejected as malformed from its own
spans, whose result it refused, and which reducers rejected its contribution. The group's coordinator decides once,
when every member has voted, or ``timeout`` after the first vote. It does not wait for a member that two or more
voters are in conflict with (below: it is out, whatever it votes), nor for one whose daemon cannot be dialled any
more (the coordinator tries every few seconds: it crashed). A member whose link to some reducer broke is waited for:
it is alive, and votes "missing".

Before it decides, the coordinator looks for reducers that answered members different results: two digests of one
piece that the same reducer signed are a proof (``evidence.Proof``). A proven reducer is out of the round and of
the run, and the decision carries the proof, which every member checks and passes on; so do the proofs against
members that votes carry (a member that found its coordinator of another round handing out two versions of a
group). A vote whose evidence for a disputed piece does not hold (a signature its reducer did not make) is a liar's,
and does not count.

Refusals are conflicts between two members: a reducer that rejected a member's contribution, a member that refused
a reducer's result. Nobody can tell from one conflict which side is at fault, so a member in conflict with two or
more others is out (the most conflicted first: ``ACCUSERS``), and in a redo neither side of a remaining conflict
reduces anything (each stays a member; their spans go to the others). So a reducer that refuses every honest member is
out of the redo, never the one voter left; a lone liar costs a redo; and a reducer one member's audit caught, which
the next round's other members still take (an audit is no proof), reduces nothing in that round's redo either.

- commit, if every counted vote holds one digest of each slice, and those are a strict majority of the slice's
  holders in the group, by count and by the tokens they joined with (members that died after delivering their span
  need not vote, while the others are such a majority);
- otherwise, on a first attempt, redo among the members neither out nor silent, less the stage peers of a pipeline
  group that is no longer whole among them (a group acts as one replica or not at all), with both sides of the
  remaining conflicts passive (only their reducers where that leaves a slice nobody reduces): they run the
  butterfly again with the same pseudo-gradients and a fresh group id. A member that only missed a span (a broken
  stream) is in the redo: one broken stream costs a redo, never the round;
- otherwise commit, for every slice, the digest held by a strict majority of its holders in the group, by count and
  weight (a plurality, or the votes of those some reducer refused, decide nothing: ``consensus.plurality`` with the
  holders as its electorate), or abort if some slice has none: nobody applies anything this round.

A member applies the aggregate only if the decision names the digest it holds of each of its slices. The coordinator
judges every vote against its own record of the group it formed (or of the redo it decided), never against what a
voter claims the group is: a vote on another version of the group does not count. A decision that goes on without
some members comes with the reason, which every member logs. Only the coordinator decides. A member whose vote's
stream breaks asks again (the coordinator answers a second ask with the same decision); one that cannot reach it at
all applies nothing (as if aborted) and, if the others committed, catches up from them before the next round, unless
it can join the round where the others form it at the next coordinator (``SwarmCommunicator``: a formation already
open there, never one of its own). A second judge would let two halves of a group decide differently.

The vote request, a wire message (``swarm/wire.py``)::

    {v, group_id, version: the group's digest, vote: holds|missing|dropped, drops: [peers rejected as malformed],
     refused: [reducers whose result it refused], refused_by: [reducers that rejected its contribution],
     proofs: [proofs it holds against members]}
    + msgpack [[slice, start, stop, reducer's place in the group, digest, signature], ...]

and the decision: ``{v, outcome: commit|redo|abort, digests: {slice: digest}, reason, proofs: [...]}`` (+ ``group_id,
peers, passive, grant`` for a redo: the coordinator's signature of the redo's group).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any

from hivemind.p2p import P2P
from pydantic import Field, StringConstraints, model_validator

from p2ploco import faults
from p2ploco.aio import in_time
from p2ploco.errors import Failure, PayloadError, TransportError
from p2ploco.swarm import wire
from p2ploco.swarm.bans import Bans
from p2ploco.swarm.evidence import (
    MAX_SIGNATURE,
    Proof,
    Signer,
    group_statement,
    signed_by,
)
from p2ploco.swarm.messages import (
    MAX_GROUP_HEADER,
    MAX_PEERS,
    Digest,
    Message,
    PeerIds,
    Reason,
    SliceName,
    decode,
    status_of,
)
from p2ploco.sync.group import Group, GroupBook
from p2ploco.sync.liveness import Lost, gone
from p2ploco.sync.reduce_values import Evidence
from p2ploco.sync.tally import (
    MAX_PROOFS,
    Cast,
    Decision,
    Outcome,
    Vote,
    conflicts,
    decide,
    examine,
    in_conflict,
    slice_digests,
)

logger = logging.getLogger(__name__)

KEEP_BALLOTS = 16
MAX_PIECES = 1 << 16  # pieces one vote may list evidence for
PIECE_ENTRY_BYTES = 600  # a piece's evidence in a vote's payload, at most (a 256-byte signature: ~330)


@dataclass
class _Ballot:
    group: Group
    deadline: float
    votes: dict[str, Cast] = field(default_factory=dict)
    dead: set[str] = field(default_factory=set)  # members the coordinator could not reach while waiting for them
    answered: set[str] = field(default_factory=set)  # members handed the decision (their streams written)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    decided: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())

    def waiting_for(self) -> list[str]:
        """Members that have not voted, less those in conflict with two or more voters so far (``in_conflict``: out
        of the round whatever they vote; one reducer's word spares no wait, or a reducer that named every member
        would have the coordinator decide on its vote alone) and those the coordinator found dead (they cannot
        vote)."""
        out = in_conflict(conflicts(self.votes))
        return [p for p in self.group.peers if p not in self.votes and p not in out and p not in self.dead]

    def settled(self) -> bool:
        """Decided, and every member handed the decision but those found dead: a leaving coordinator may go."""
        return self.decided.done() and all(p in self.answered or p in self.dead for p in self.group.peers)


class RoundCommit:
    def __init__(self, p2p: P2P, me: str, run_id: str, timeout: float, book: GroupBook, bans: Bans, signer: Signer,
                 keys: Callable[[str], bytes | None], lost: Lost):
        """``book``: the groups this peer coordinates (the matchmaker adds them; redos decided here too); ``bans``:
        who is out here, and the proofs this peer holds; ``signer``: signs the redo groups it decides; ``keys``: a
        peer's public key as its record names it (None: unknown); ``lost``: those of the given peers behind NATs that
        are gone, and how that is known (``liveness.lost_behind_nats``)."""
        self.p2p, self.me, self.run_id, self.timeout, self.book = p2p, me, run_id, timeout, book
        self.bans, self.signer, self.keys, self.lost = bans, signer, keys, lost
        self.handler_name = f"p2ploco/{run_id}/vote"
        self._ballots: dict[str, _Ballot] = {}
        self._progress = asyncio.Event()  # set whenever a ballot is decided or hands a member its decision
        # (``coordinate_to_the_end`` waits on it)

    async def start(self) -> None:
        await self.p2p.add_binary_stream_handler(self.handler_name, self._serve_vote)

    async def vote(self, group: Group, vote: Vote, evidence: tuple[Evidence, ...], drops: set[str],
                   refused: set[str], refused_by: set[str]) -> tuple[Decision, Failure | None]:
        """Tell the coordinator what this member holds (``evidence``: every piece it took, signed by its reducer),
        whose contributions it rejected as malformed, whose results it refused and which reducers rejected its
        contribution; its decision, or abort (and what went wrong) if none arrives. A vote whose stream broke is
        asked again: the coordinator answers the same decision twice. The proofs a decision carries are checked
        here, and convict."""
        members = set(group.peers)
        request = {"group_id": group.group_id, "version": group.digest, "vote": vote,
                   "drops": sorted(drops & members), "refused": sorted(refused & members),
                   "refused_by": sorted(refused_by & members),  # and what this peer holds against members: passed on
                   "proofs": [p.to_value() for a, p in self.bans.proofs.items() if a in members][:MAX_PROOFS]}
        place = {peer: i for i, peer in enumerate(group.peers)}
        pieces = wire.pack([[e.slice, e.piece.start, e.piece.stop, place[e.reducer], e.digest, e.signature]
                            for e in evidence])
        coordinator = group.coordinator
        try:
            await faults.hit_async("commit.vote", group.round_index)
            if coordinator == self.me:
                response = await self._decide_here(self.me, request, pieces)
                self._handed(group.group_id, self.me)
            else:
                response, _ = await in_time(
                    wire.call(self.p2p, coordinator, self.handler_name, request, payload=pieces, attempts=2,
                              max_header=MAX_GROUP_HEADER),
                    2 * self.timeout + 5)
            decision = parse_decision(response, group, coordinator)
            if decision.redo is not None and coordinator != self.me and not signed_by(
                    self.keys(coordinator) or b"", group_statement(self.run_id, decision.redo.group_id,
                                                             bytes.fromhex(decision.redo.digest)), decision.redo.grant):
                raise PayloadError("a redo its coordinator's key did not sign")
        except (PayloadError, TransportError, TimeoutError) as e:  # unreachable or confused: apply nothing, catch up
            logger.warning(f"round {group.round_index}: no decision from the coordinator {coordinator[-8:]} ({e!r}); "
                           f"applying nothing")
            return Decision(Outcome.ABORT), wire.failure_of(e)
        for proof in decision.proofs:
            self.bans.convict(proof, group.round_index)
        return decision, None

    async def coordinate_to_the_end(self) -> None:
        """This peer is leaving: first decide the rounds of the groups it formed that are still voting (a peer that
        coordinates a round it does not train, standing by, would otherwise leave its members without a judge, and
        they would apply nothing). Returns once each has handed every member its decision (but members found dead);
        the caller bounds the wait."""
        while True:
            self._progress.clear()
            now = time.monotonic()
            # A group's first vote comes within its all-reduce, a transfer each way and the audit (``round_bound``;
            # one alone never votes); its ballot then waits its own timeout, and is not settled before every member
            # has its answer: the answers are written after the decision, and a shutdown in between cut a member's
            # off (it applied nothing). A member that votes after the ballot closed is answered the same decision
            # too. A ballot counts while its own time may run, not its group's: a slow all-reduce outlived that.
            unvoted = [g for g in self.book.since(3 * self.timeout)
                       if len(g.peers) > 1 and g.group_id not in self._ballots]
            voting = [b for b in self._ballots.values() if not b.settled() and b.deadline > now - 2 * self.timeout]
            if not unvoted and not voting:
                return
            with contextlib.suppress(TimeoutError):  # woken by a decision or an answer, or to look at the clock again
                await in_time(self._progress.wait(), 1.0)

    async def _serve_vote(self, stream_info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        voter = str(stream_info.peer_id)
        async with wire.serving(logger, "vote", voter, reader, writer, self.timeout):
            request, pieces = await in_time(
                wire.read_message(reader, max_payload=MAX_PIECES * PIECE_ENTRY_BYTES, max_header=MAX_GROUP_HEADER),
                self.timeout)
            await wire.write_message(writer, await self._decide_here(voter, request, pieces))
            self._handed(request["group_id"], voter)

    def _handed(self, group_id: str, member: str) -> None:
        """``member`` has been handed the decision on ``group_id`` (``coordinate_to_the_end`` waits for every
        member's)."""
        ballot = self._ballots.get(group_id)
        if ballot is not None:
            ballot.answered.add(member)
            self._progress.set()

    async def _decide_here(self, voter: str, request: dict[str, Any], pieces: bytes) -> dict[str, Any]:
        vote, entries = parse_vote(request, pieces)
        group = self.book.get(vote.group_id)
        if group is None:
            raise PayloadError("vote for a group this peer does not coordinate")
        if voter not in group.peers:
            raise PayloadError(f"{voter[-8:]} is not a member of the group it votes for")
        if vote.version != group.digest:  # it was handed another version (by whom, its reducers' answers tell)
            return {"outcome": Outcome.ABORT, "reason": "this peer votes on another version of the group than its "
                                                        "coordinator formed: its vote does not count"}
        for proof in vote.proofs:  # checked here: a voter's word convicts nobody
            self.bans.convict(proof, group.round_index)
        cast = cast_of(vote, entries, group)
        if cast.vote == Vote.HOLDS and set(cast.digests) != set(group.slices_of(voter)):
            raise PayloadError(f"{voter[-8:]} votes for other slices than it holds")
        ballot = self._ballots.get(group.group_id)
        if ballot is None:
            ballot = self._ballots[group.group_id] = _Ballot(group, time.monotonic() + self.timeout)
            asyncio.get_running_loop().create_task(self._close(ballot))
            for old in list(self._ballots)[:-KEEP_BALLOTS]:
                del self._ballots[old]
        if voter not in ballot.votes:
            ballot.votes[voter] = cast
        ballot.changed.set()
        decision: Decision = await in_time(asyncio.shield(ballot.decided), 2 * self.timeout)
        response: dict[str, Any] = {"outcome": decision.outcome, "digests": decision.digests,
                                    "reason": decision.reason, "proofs": [p.to_value() for p in decision.proofs]}
        if decision.redo is not None:
            response.update(group_id=decision.redo.group_id, peers=list(decision.redo.peers),
                            passive=list(decision.redo.passive), grant=decision.redo.grant)
        return response

    async def _close(self, ballot: _Ballot) -> None:
        prober = asyncio.get_running_loop().create_task(self._probe(ballot))
        try:
            while ballot.waiting_for() and time.monotonic() < ballot.deadline:
                ballot.changed.clear()
                try:
                    await in_time(ballot.changed.wait(), ballot.deadline - time.monotonic())
                except TimeoutError:
                    pass
        finally:
            prober.cancel()
            group = ballot.group
            proofs, liars = examine(self.run_id, group, ballot.votes, self.keys)
            for proof in proofs:
                self.bans.convict(proof, group.round_index)
            for liar in liars:
                self.bans.ban(liar, group.round_index, "its vote listed a result its reducer did not sign")
            deciding = faults.seam("coordinator.decide", self, decide)
            decision = deciding(group, {p: c for p, c in ballot.votes.items() if p not in liars}, self.me,
                                frozenset(p.accused for p in proofs) | self._convicted(group))
            decision = Decision(decision.outcome, decision.digests, self._granted(decision.redo), decision.reason,
                                tuple(self.bans.proofs[p] for p in group.peers if p in self.bans.proofs)[:MAX_PROOFS])
            if decision.redo is not None:
                self.book.add(decision.redo)
            ballot.decided.set_result(decision)
            self._progress.set()

    def _convicted(self, group: Group) -> frozenset[str]:
        """The members of ``group`` convicted here (a proof reached this peer since it formed the group)."""
        return frozenset(p for p in group.peers if p in self.bans.proofs)

    def _granted(self, redo: Group | None) -> Group | None:
        """``redo`` with this coordinator's signature of it."""
        if redo is None:
            return None
        return redo.among(redo.group_id, redo.peers, redo.coordinator, redo.passive, self.signer.sign(
            group_statement(self.run_id, redo.group_id, bytes.fromhex(redo.digest))))

    async def _probe(self, ballot: _Ballot) -> None:
        """Every PROBE_EVERY seconds, look at each member still awaited: one that crashed (after delivering its span,
        or nobody would wait for it) is not waited for until the deadline (``liveness.gone``)."""
        while True:
            await asyncio.sleep(wire.PROBE_EVERY)
            awaited = set(ballot.waiting_for()) - {self.me}
            for peer, reason in sorted((await gone(self.p2p, self.run_id, ballot.group, awaited, self.lost)).items()):
                logger.info(f"round {ballot.group.round_index}: not waiting for the vote of {peer[-8:]}: {reason}")
                ballot.dead.add(peer)
                ballot.changed.set()


Signature = Annotated[bytes, Field(max_length=MAX_SIGNATURE)]
PieceEntry = tuple[SliceName, Annotated[int, Field(ge=0, le=1 << 40)], Annotated[int, Field(ge=0, le=1 << 40)],
                   Annotated[int, Field(ge=0, lt=MAX_PEERS)], Annotated[bytes, Field(min_length=1, max_length=64)],
                   Signature]
GroupDigest = Annotated[str, StringConstraints(pattern="^[0-9a-f]{64}$")]


class VoteRequest(Message):
    group_id: Digest
    version: GroupDigest  # the digest of the group the voter holds
    vote: status_of(Vote)
    drops: PeerIds  # the members whose contributions the voter rejected as malformed from its spans
    refused: PeerIds  # the reducers whose results the voter refused
    refused_by: PeerIds  # the reducers that rejected the voter's contribution
    proofs: Annotated[list[Proof], Field(max_length=MAX_PROOFS)] = []  # against members, as the voter holds them


class VoteEvidence(Message):
    pieces: Annotated[list[PieceEntry], Field(max_length=MAX_PIECES)]


class DecisionAnswer(Message):
    outcome: status_of(Outcome)
    digests: Annotated[dict[SliceName, Digest], Field(max_length=64)] = {}  # with commit
    reason: Reason
    proofs: Annotated[list[Proof], Field(max_length=MAX_PROOFS)] = []
    group_id: Digest = ""  # with redo: the survivors' group, its passive members and the coordinator's signature
    peers: PeerIds = []
    passive: PeerIds = []
    grant: Signature = b""

    @model_validator(mode="after")
    def _complete(self) -> DecisionAnswer:
        if self.outcome == Outcome.REDO and not (self.group_id and self.peers and self.grant):
            raise ValueError("a redo without the survivors' signed group")
        return self


def parse_vote(request: dict[str, Any], pieces: bytes) -> tuple[VoteRequest, list[PieceEntry]]:
    """A vote request and its evidence (``cast_of`` reads them against the group); PayloadError if malformed."""
    vote = decode(VoteRequest, request)
    raw = wire.unpack(pieces, "a vote's evidence")
    # an entry is a msgpack array: a tuple to the strict model, which takes no list for one
    entries = decode(VoteEvidence, {"pieces": [tuple(e) if isinstance(e, list) else e for e in raw]
                                    if isinstance(raw, list) else raw}).pieces
    if any(start > stop for _, start, stop, *_ in entries):
        raise PayloadError("a vote's evidence names a piece that ends before it starts")
    return vote, entries


def cast_of(vote: VoteRequest, entries: list[PieceEntry], group: Group) -> Cast:
    """The vote as ``group``'s coordinator counts it: its evidence's reducers named by their places in the group, and,
    for holds, the digest of each slice it lists evidence for; PayloadError for a place beyond the group."""
    if any(place >= len(group.peers) for _, _, _, place, _, _ in entries):
        raise PayloadError("a vote's evidence names a reducer beyond the group")
    evidence = tuple(Evidence(name, range(start, stop), group.peers[place], digest, signature)
                     for name, start, stop, place, digest, signature in entries)
    return Cast(vote.vote, slice_digests(evidence) if vote.vote == Vote.HOLDS else {}, frozenset(vote.drops),
                frozenset(vote.refused), frozenset(vote.refused_by), evidence)


def parse_decision(response: dict[str, Any], group: Group, coordinator: str) -> Decision:
    """The coordinator's answer to a vote; PayloadError if malformed."""
    answer = decode(DecisionAnswer, response)
    proofs = tuple(answer.proofs)
    if answer.outcome == Outcome.REDO:
        if group.attempt >= 1:  # members redo a round once: a coordinator that answers "redo" forever stalls nobody
            raise PayloadError("a second redo of one round")
        if not set(answer.peers) <= set(group.peers) or not set(answer.passive) <= set(answer.peers):
            raise PayloadError("redo group names peers outside the round's group")
        return Decision(answer.outcome, redo=group.among(answer.group_id, tuple(answer.peers), coordinator,
                                                         tuple(answer.passive), answer.grant),
                        reason=answer.reason, proofs=proofs)
    return Decision(answer.outcome, answer.digests if answer.outcome == Outcome.COMMIT else {}, reason=answer.reason,
                    proofs=proofs)
