"""The join: what a peer that is ready for a round asks its coordinator, and the answer, a group or why not.

A joiner says which slices it holds (with its exchange fingerprint and hash for each), for a stage peer its pipeline
group, how many tokens its contribution was trained on (its weight in the round's mean, ``budget.py``), at most what
a round can hold (``Config.round_tokens``: a coordinator refuses more, and a member refuses a group that gives anyone
more, so that one key weighs at most one full peer), and whether others can dial it (``swarm/reachability.py``); the
group lists both for every member, so every reducer weighs a member alike, and the members that only dial out reduce
no span.

A peer asks the round's coordinator: the peer with the smallest rendezvous score (``rendezvous``) among those it may
ask; one that knows a better one redirects it there. A join request, a wire message (``swarm/wire.py``) with no
payload::

    {v, round, name, config, state, slices: {slice: [exchange fingerprint, hash]}, pipeline,
     unreachable: [peer ids the joiner could not reach], tokens, dial_out, follows: group digest}

answered ``{v, status: group, group_id, peers, held: [slices], holdings: {peer: [slices]}, pipelines: {peer: group},
left_out: {peer: reason}, trained: tokens, tokens: {peer: tokens}, dial_out: [peers], grant}`` (``held`` and
``trained``: what most members hold and trained, said once; ``holdings`` and ``tokens`` name only the others;
``grant``: the coordinator's signature of the group, ``evidence.group_statement``, which a member checks and shows a
reducer that holds another version of it), ``{v, status: redirect, to}``, or ``{v, status: late|banned|leaving,
reason}``. A group lists every member, N ids in each of N answers: O(N^2) bytes at one coordinator a round (~50 kB an
answer at N = 1024 where most members hold and trained alike, 177 kB when each member's entry was listed). So a
joiner names the group it follows (the one
it applied its last round with, ``Matchmaker.follow``) by its digest (``Group.digest``: its id and every member's
entry), and where the coordinator follows that very version of it too it answers with the difference: ``{v, status:
group, group_id, base: that group's digest, changed: {peer: {holdings, pipeline, tokens, dial_out}}, removed: [peers],
left_out}``, the entries of the members that joined or changed and the ids of those that left, a few hundred bytes
a round whatever N (``JoinAnswer.on``).
"""

from __future__ import annotations

import enum
import hashlib
from collections import Counter
from typing import Annotated, Any

from pydantic import Field, model_validator

from p2ploco.errors import Failure, PayloadError
from p2ploco.swarm.evidence import MAX_SIGNATURE
from p2ploco.swarm.messages import (
    MAX_PEERS,
    MAX_SLICES,
    Digest,
    Message,
    Name,
    PeerId,
    PeerIds,
    Reason,
    Round,
    SliceName,
    Tokens,
    decode,
    status_of,
)
from p2ploco.sync.group import FormationKey, Group, Member

MAX_LEFT_OUT = 256  # peers a group answer may list as left out (a group names the first so many of them)


def join_handler(run_id: str) -> str:
    """The protocol a run's coordinators serve joins on."""
    return f"p2ploco/{run_id}/join"


def rendezvous(round_index: int, peer: str) -> bytes:
    """A peer's score for coordinating round ``round_index``; the smallest score wins. It depends on nothing a
    peer sends during the run: seeded by the round's starting state, a reducer could try low-bit variants of its
    span until the next round's hash made it coordinator, every round."""
    return hashlib.sha256(f"{round_index}/{peer}".encode()).digest()


def best_coordinator(candidates: set[str], round_index: int) -> str:
    """The peer of ``candidates`` that coordinates ``round_index``: the smallest rendezvous score."""
    return min(candidates, key=lambda peer: rendezvous(round_index, peer))


class JoinStatus(enum.StrEnum):
    GROUP = "group"  # the group formed: all-reduce with these peers
    REDIRECT = "redirect"  # another peer coordinates this round
    LATE = "late"  # the round started without the joiner: it applies nothing and catches up
    LEFT_OUT = "left out"  # the joiner holds another state than the others, or its pipeline group is incomplete
    BANNED = "banned"  # the coordinator caught the joiner sending malformed data; it sits this round out
    LEAVING = "leaving"  # the coordinator is leaving and forms no new group


JOIN_FAILURES = {JoinStatus.LATE: Failure.LATE, JoinStatus.LEFT_OUT: Failure.LEFT_OUT,
                 JoinStatus.BANNED: Failure.REJECTED}


class JoinRequest(Message):
    round: Round
    name: Name
    config: Digest  # the joiner's config fingerprint
    state: Digest  # the digest of the state the joiner starts the round from (``consensus.round_state``)
    slices: Annotated[dict[SliceName, Annotated[list[Digest], Field(min_length=2, max_length=2)]],
                      Field(min_length=1, max_length=MAX_SLICES)]  # slice -> [exchange fingerprint, hash]
    pipeline: Name
    unreachable: PeerIds
    tokens: Tokens  # what the joiner trained for its contribution: its weight in the round's mean
    dial_out: bool  # others cannot dial the joiner (it is behind NAT): it reduces no span
    follows: Digest = ""  # Group.digest of the group the joiner applied its last round with ("": answered in full)
    rejoin: bool = False  # the joiner's group of this round died: it joins a formation open here, and opens none


Held = Annotated[list[SliceName], Field(min_length=1, max_length=MAX_SLICES)]  # the slices a member holds


class MemberEntry(Message):
    """One member's entry in a group answer given relative to another group."""

    holdings: Held
    pipeline: Name
    tokens: Tokens
    dial_out: bool


class JoinAnswer(Message):
    status: status_of(JoinStatus)
    reason: Reason = ""
    to: PeerId = ""  # with redirect
    group_id: Digest = ""  # with group, and the members' holdings and pipeline groups, and whom it leaves out
    peers: PeerIds = []
    held: Annotated[list[SliceName], Field(max_length=MAX_SLICES)] = []  # the slices of the members not in holdings
    holdings: Annotated[dict[PeerId, Held], Field(max_length=MAX_PEERS)] = {}
    pipelines: Annotated[dict[PeerId, Name], Field(max_length=MAX_PEERS)] = {}
    left_out: Annotated[dict[PeerId, Reason], Field(max_length=MAX_LEFT_OUT)] = {}
    trained: Tokens | None = None  # the tokens of the members not in tokens
    tokens: Annotated[dict[PeerId, Tokens], Field(max_length=MAX_PEERS)] = {}
    dial_out: PeerIds = []
    grant: Annotated[bytes, Field(max_length=MAX_SIGNATURE)] = b""  # with group: the coordinator's signature of it
    base: Digest = ""  # a group given relative to the group of this digest (``on``): its members' changes follow
    changed: Annotated[dict[PeerId, MemberEntry], Field(max_length=MAX_PEERS)] = {}
    removed: PeerIds = []

    @model_validator(mode="after")
    def _complete(self) -> JoinAnswer:
        if self.status == JoinStatus.REDIRECT and not self.to:
            raise ValueError("a redirect names no peer")
        if self.base and (self.status != JoinStatus.GROUP or self.peers or self.held or self.holdings
                          or self.pipelines or self.trained is not None or self.tokens or self.dial_out):
            raise ValueError("an answer relative to another group that is no group, or lists members in full")
        if self.status == JoinStatus.GROUP and not self.grant:
            raise ValueError("a group its coordinator did not sign")
        if self.status == JoinStatus.GROUP and not self.base:
            if not self.group_id or not self.peers:
                raise ValueError("a group without id or members")
            members = set(self.peers)
            if not set(self.holdings) <= members or (len(self.holdings) < len(members) and not self.held):
                raise ValueError("a group whose holdings name non-members, or do not give every member's slices")
            if not set(self.pipelines) <= members or set(self.left_out) & members:
                raise ValueError("a group whose pipeline groups name non-members, or that leaves out members")
            if not set(self.tokens) <= members or (len(self.tokens) < len(members) and self.trained is None):
                raise ValueError("a group whose tokens name non-members, or do not give every member's")
            if not set(self.dial_out) <= members:
                raise ValueError("a group whose dial-out peers are not members")
        return self

    def on(self, base: Group | None) -> JoinAnswer:
        """This answer with every member listed: as it is, or applied to ``base``, the group the joiner named
        (PayloadError if it is relative to another one, or makes a group that does not hold together)."""
        if not self.base:
            return self
        if base is None or self.base != base.digest:
            raise PayloadError("a group relative to another group (or version of it) than the one this peer follows")
        entries = {peer: entry for peer, entry in base.entries().items() if peer not in self.removed}
        entries.update((peer, entry.model_dump()) for peer, entry in self.changed.items())
        peers = sorted(entries)
        return decode(JoinAnswer, {
            "status": JoinStatus.GROUP.value, "group_id": self.group_id, "peers": peers, "grant": self.grant,
            "holdings": {p: entries[p]["holdings"] for p in peers}, "left_out": dict(self.left_out),
            "pipelines": {p: entries[p]["pipeline"] for p in peers if entries[p]["pipeline"]},
            "tokens": {p: entries[p]["tokens"] for p in peers},
            "dial_out": [p for p in peers if entries[p]["dial_out"]]})


def parse_join(request: dict[str, Any]) -> tuple[FormationKey, set[str], Member]:
    """A join request's formation key, the peers the joiner could not reach, and what the joiner holds;
    PayloadError if malformed."""
    join = decode(JoinRequest, request)
    member = Member(tuple(sorted((k, (v[0], v[1])) for k, v in join.slices.items())), join.pipeline, join.tokens,
                    join.dial_out, join.follows, join.rejoin)
    return (join.round, join.name, join.config, join.state), set(join.unreachable), member


def group_answer(group: Group, base: Group | None = None, follows: str = "") -> dict[str, Any]:
    """The answer that gives a joiner ``group`` (signed by its coordinator: ``Group.grant``): relative to ``base``
    (the group this coordinator follows) if the joiner follows that very version of it (``follows``: its
    ``Group.digest``), else in full."""
    if base is not None and base.digest == follows:
        entries, before = group.entries(), base.entries()
        return {"status": JoinStatus.GROUP, "group_id": group.group_id, "base": base.digest, "grant": group.grant,
                "changed": {peer: entry for peer, entry in entries.items() if before.get(peer) != entry},
                "removed": sorted(set(before) - set(entries)), "left_out": dict(group.left_out)}
    # What most members hold and trained, once: a full answer names each member by its id alone, where it used to
    # list its slices and tokens too (~170 bytes a member; ~50 now), N answers of N members in a run's first round
    held = Counter(slices for _, slices in group.holdings).most_common(1)[0][0]
    trained = Counter(tokens for _, tokens in group.tokens).most_common(1)[0][0]
    return {"status": JoinStatus.GROUP, "group_id": group.group_id, "peers": list(group.peers), "held": list(held),
            "holdings": {peer: list(slices) for peer, slices in group.holdings if slices != held},
            "pipelines": dict(group.pipelines), "left_out": dict(group.left_out), "trained": trained,
            "tokens": {peer: tokens for peer, tokens in group.tokens if tokens != trained},
            "dial_out": list(group.dial_out), "grant": group.grant}


def parse_group(answer: JoinAnswer, round_index: int, name: str, coordinator: str, max_reducers: int) -> Group:
    """The group in a coordinator's answer (its status is ``group``), with the coordinator's signature as given (the
    joiner checks it: ``Matchmaker``); ``max_reducers``: the run's, which the answer does not carry (every member
    of a formation holds the run's config)."""
    held = tuple(sorted(set(answer.held)))
    return Group(answer.group_id, round_index, name, tuple(answer.peers), coordinator, 0,
                 tuple((p, tuple(sorted(set(answer.holdings[p]))) if p in answer.holdings else held)
                       for p in answer.peers),
                 tuple((p, answer.pipelines[p]) for p in answer.peers if p in answer.pipelines),
                 tuple(sorted(answer.left_out.items())),
                 tuple((p, answer.tokens.get(p, answer.trained)) for p in answer.peers),
                 tuple(answer.dial_out), max_reducers=max_reducers, grant=answer.grant)
