"""How a round's coordinator counts its members' votes (``sync/decide.py`` carries them): what each vote says
(``Cast``), whom the evidence proves or the refusals put out (``examine``, ``in_conflict``), and the one outcome for
all (``decide``: commit, redo among the survivors, or abort), by the rules ``sync/decide.py`` states."""

from __future__ import annotations

import enum
import logging
import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from p2ploco.collective.exchange import aggregate_digest
from p2ploco.swarm.consensus import Ballot, plurality
from p2ploco.swarm.evidence import (
    Claim,
    Proof,
    Signed,
    result_statement,
    signed_by,
)
from p2ploco.sync.group import Group
from p2ploco.sync.reduce_values import Evidence

logger = logging.getLogger(__name__)

ACCUSERS = 2  # members in conflict with a peer (refusals either way) that put it out of the round
MAX_PROOFS = 8  # proofs one decision may carry


class Vote(enum.StrEnum):
    HOLDS = "holds"  # this member holds the aggregate of every span (its evidence comes with the vote)
    MISSING = "missing"  # some span's aggregate did not arrive, or a reducer went on without this member
    DROPPED = "dropped"  # a reducer rejected this member's contribution as malformed: it is out of the round


class Outcome(enum.StrEnum):
    COMMIT = "commit"
    REDO = "redo"
    ABORT = "abort"


@dataclass(frozen=True)
class Cast:
    """One member's vote as its coordinator reads it."""

    vote: Vote
    digests: dict[str, str] = field(default_factory=dict)  # with holds: the aggregate of each slice it holds
    drops: frozenset[str] = frozenset()  # members whose contributions it rejected as malformed, as a reducer
    refused: frozenset[str] = frozenset()  # reducers whose results it refused (malformed, too long, opposed)
    refused_by: frozenset[str] = frozenset()  # reducers that rejected its contribution
    evidence: tuple[Evidence, ...] = ()  # the pieces it took, with their reducers' signatures


@dataclass(frozen=True)
class Decision:
    outcome: Outcome
    digests: dict[str, str] = field(default_factory=dict)  # with commit: the aggregate of each slice to apply
    redo: Group | None = None  # with redo: the survivors' group
    reason: str = ""  # why the decision leaves members out, or drops the round (empty: it does neither)
    proofs: tuple[Proof, ...] = ()  # reducers that answered members different results (they are out)

    def applies(self, digests: dict[str, str]) -> bool:
        """Whether a member that holds ``digests`` (per slice) applies this round."""
        return self.outcome == Outcome.COMMIT and all(self.digests.get(k) == v for k, v in digests.items())


def slice_digests(evidence: Iterable[Evidence]) -> dict[str, str]:
    """The digest of each slice's aggregate (``exchange.aggregate_digest``) from its pieces' evidence."""
    pieces: dict[str, list[tuple[range, bytes]]] = {}
    for e in evidence:
        pieces.setdefault(e.slice, []).append((e.piece, e.digest))
    return {name: aggregate_digest(spans) for name, spans in pieces.items()}


def examine(run_id: str, group: Group, votes: dict[str, Cast], keys: Callable[[str], bytes | None]
            ) -> tuple[list[Proof], set[str]]:
    """The reducers proven to have answered members different results for a piece (``Proof``), and the voters whose
    evidence for such a piece does not hold (liars). Only disputed pieces are checked: a signature is checked where
    two digests of one piece meet."""
    held: dict[tuple[str, int, int], dict[tuple[str, bytes], list[tuple[str, bytes]]]] = {}
    for voter, cast in votes.items():
        for e in cast.evidence:
            held.setdefault((e.slice, e.piece.start, e.piece.stop), {}).setdefault((e.reducer, e.digest), []).append(
                (voter, e.signature))
    proofs: dict[str, Proof] = {}
    liars: set[str] = set()
    for (slice_name, start, stop), claims in held.items():
        if len({digest for _, digest in claims}) < 2:
            continue
        signed: dict[str, list[Signed]] = {}  # reducer -> the different digests it signed for this piece
        for (reducer, digest), voters in sorted(claims.items()):
            key = keys(reducer)
            if key is None:  # its record left this view: nothing to check it by
                continue
            statement = result_statement(run_id, group.digest, slice_name, start, stop, digest)
            valid = [(voter, signature) for voter, signature in voters if signed_by(key, statement, signature)]
            # a voter that names a result its reducer did not sign lies (or names another reducer than the piece's)
            liars |= {voter for voter, _ in voters} - {voter for voter, _ in valid}
            if valid:
                signed.setdefault(reducer, []).append(Signed(digest=digest, signature=valid[0][1]))
        for reducer, results in signed.items():
            if len(results) >= 2 and reducer not in proofs:
                proofs[reducer] = Proof(claim=Claim.RESULT, accused=reducer, key=keys(reducer), group_id=group.group_id,
                                        group=group.digest, slice=slice_name, span=[start, stop], first=results[0],
                                        second=results[1])
    return list(proofs.values())[:MAX_PROOFS], liars - set(proofs)


def conflicts(votes: dict[str, Cast]) -> set[tuple[str, str]]:
    """The (reducer, member) pairs in conflict, as either side's vote says: the reducer rejected the member's
    contribution, or the member refused the reducer's result."""
    pairs = set()
    for voter, cast in votes.items():
        pairs |= {(voter, member) for member in cast.drops}
        pairs |= {(reducer, voter) for reducer in cast.refused | cast.refused_by}
    return {(r, m) for r, m in pairs if r != m}


def in_conflict(pairs: set[tuple[str, str]]) -> set[str]:
    """The peers in conflict with ``ACCUSERS`` or more others, the most conflicted first: after they are set aside,
    the conflicts left are counted again (a reducer that rightly rejected two garbage senders is in conflict with two,
    but they with every honest reducer)."""
    out: set[str] = set()
    while True:
        others: dict[str, set[str]] = {}
        for a, b in pairs:
            if a not in out and b not in out:
                others.setdefault(a, set()).add(b)
                others.setdefault(b, set()).add(a)
        most = max((len(v) for v in others.values()), default=0)
        if most < ACCUSERS:
            return out
        out |= {peer for peer, v in others.items() if len(v) == most}


def decide(group: Group, votes: dict[str, Cast], me: str, convicted: frozenset[str] = frozenset()) -> Decision:
    """The coordinator's rule (module docstring), a pure function of the votes; ``convicted``: members proven to have
    told members different things, out of the round."""
    pairs = conflicts(votes)
    out = set(convicted) | in_conflict(pairs) | {p for p, c in votes.items() if c.vote == Vote.DROPPED
                                                 and not c.refused_by}  # it says it was dropped, naming nobody
    counted = {peer: cast for peer, cast in votes.items() if peer not in out}
    left_out = _why_left_out(group, votes, out, convicted)
    majority = _majority(group, counted)
    counted_slices = {name for peer in counted for name in group.slices_of(peer)}
    held = {name: {c.digests[name] for p, c in counted.items() if c.vote == Vote.HOLDS and name in c.digests}
            for name in counted_slices}
    if counted and all(c.vote == Vote.HOLDS for c in counted.values()) and all(len(d) == 1 for d in held.values()) \
            and set(majority) == counted_slices:
        return Decision(Outcome.COMMIT, majority, reason=f"committed without {left_out}" if left_out else "")
    if group.attempt == 0:
        survivors = tuple(sorted(group.whole_pipelines(set(counted))))
        redo = _redo(group, survivors, {(r, m) for r, m in pairs if r in survivors and m in survivors}, me)
        if redo is not None:
            missing = sorted(p[-8:] for p in survivors if counted[p].vote != Vote.HOLDS)
            reason = (f"the all-reduce failed for {', '.join(missing) or 'nobody'} (a span did not arrive, or "
                      f"holders disagree); redoing it among {len(survivors)} of {len(group.peers)} peers"
                      + (f", without {left_out}" if len(survivors) < len(group.peers) else "")
                      + (f"; {', '.join(p[-8:] for p in redo.passive)} reduce nothing in it (in a conflict "
                         f"without a proof)" if redo.passive else ""))
            logger.info(f"round {group.round_index}: {reason}")  # every member logs it at WARNING
            return Decision(Outcome.REDO, redo=redo, reason=reason)
    if majority and set(majority) == counted_slices:
        reason = ("a majority of each slice's holders hold the same aggregate; committed for them, the others catch up"
                  + (f" (without {left_out})" if left_out else ""))
        logger.info(f"round {group.round_index}: {reason}")  # every member logs it at WARNING
        return Decision(Outcome.COMMIT, majority, reason=reason)
    reason = ("the all-reduce failed and no aggregate is held by a majority of the group; the round is dropped by "
              "every survivor" + (f" (without {left_out})" if left_out else ""))
    logger.info(f"round {group.round_index}: {reason}")  # every member logs it at WARNING
    return Decision(Outcome.ABORT, reason=reason)


def _redo(group: Group, survivors: tuple[str, ...], pairs: set[tuple[str, str]], me: str) -> Group | None:
    """The redo among ``survivors`` in which neither side of a conflict reduces: one of the two is at fault, and a
    reducer an audit caught is the member its accuser refused, so it must not reduce the redo either. Where that leaves
    a slice nobody can reduce, only each conflict's reducer is passive; None where even that leaves one (every slice
    the survivors hold needs a survivor that can be dialled to reduce it, and a contributor: a redo of NATed trainers
    whose only hub died would reduce nothing, and "commit" an aggregate nobody holds)."""
    if len(survivors) < 2:
        return None
    group_id = secrets.token_hex(8)
    slices = {name for peer in survivors for name in group.slices_of(peer)}
    for passive in ({peer for pair in pairs for peer in pair}, {r for r, _ in pairs}):
        redo = group.among(group_id, survivors, me, tuple(sorted(passive)))
        if all(redo.reducers(name) and redo.contributors(name) for name in slices):
            return redo
    return None


def _majority(group: Group, counted: dict[str, Cast]) -> dict[str, str]:
    """For each slice, the digest its counted voters hold that a strict majority of the slice's holders in the group
    hold, by count and by the tokens they joined with (a hub's 0 counts by count alone)."""
    tokens = group.tokens_of()
    majority = {}
    for name in sorted({name for peer in group.peers for name in group.slices_of(peer)}):
        holders = group.holders(name)
        ballots: list[Ballot[str]] = [(c.digests[name], True) for p, c in counted.items()
                                      if c.vote == Vote.HOLDS and name in c.digests]
        digest = plurality(ballots, electorate=len(holders))
        if digest is None:
            continue
        weight = sum(tokens.get(p, 1) for p, c in counted.items() if c.vote == Vote.HOLDS and c.digests.get(name) ==
                     digest)
        total = sum(tokens.get(p, 1) for p in holders)
        if 2 * weight > total or total == 0:
            majority[name] = digest
    return majority


def _why_left_out(group: Group, votes: dict[str, Cast], out: set[str], convicted: frozenset[str]) -> str:
    """The members a decision goes on without, and why ("" if none)."""
    def why(peer: str) -> str:
        if peer in convicted:
            return "it answered members different results, as its own signatures show"
        if peer not in votes:
            return "it did not vote"
        if votes[peer].vote == Vote.DROPPED and not votes[peer].refused_by:
            return "it was rejected as malformed"
        return f"it is in conflict with {ACCUSERS} or more members: refusals without a proof"

    return ", ".join(f"{peer[-8:]} ({why(peer)})" for peer in group.peers if peer not in votes or peer in out)
