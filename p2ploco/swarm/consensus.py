"""Which state of each slice the swarm holds: the one vote every peer casts alike.

Peers that start a round from different parameters part ways for good, so wherever the swarm must agree on the
hash of a slice, every peer that sees the same ballots must pick the same one. Three places pick:

- the state a round starts from, over the records of the peers at that round (``round_state``; it names the
  round's formation), and the state a lagging peer catches up to, over the records of every round
  (``ranked_states``);
- a coordinator closing a formation, over what its members say they hold (``sync/admission.py``, which then
  also leaves out the members that cannot take part: a pipeline group that does not bring every stage, the
  holders of a slice that only members behind NAT hold);
- a coordinator deciding a round whose members disagree, over their votes (``sync/tally.py``: ``decide``).

All three follow ``ranking``: a value ranks by the ballots of firm voters, then by all its ballots,
then by the value itself, the greater first (an arbitrary order, but the same on every peer). They differ only in
who is firm and in what a win takes:

- records: a peer whose last round settled. One left out of its last round, alone in it, or without its decision
  publishes its state as ``unsettled``: it may hold a state the others have moved past, and however many such
  peers agree, they never outvote one peer that applied the round (they still count once the settled are tied);
- a formation's members: a join does not say whether its peer settled, but the records at the round already
  decided that: a member stands if it holds the hash ``round_state`` chose, so that choice wins whenever some
  member holds it, and the members' plurality decides otherwise;
- commit votes: every counted vote stands (the coordinator has already set aside the votes of members rejected as
  malformed). A commit against a disagreement makes the losers catch up, so it takes a strict majority of the
  slice's counted holders, those that voted "missing" included (``plurality``'s ``electorate``): a plurality
  alone aborts the round instead.

Catching up spans rounds (``ranked_states``): among states of equal tallies, a vouched state (two or more holders)
of an earlier round comes first (while the swarm moves to the next round some of it is still at the last, and an
attacker's claim of the next round ties with the honest peers that moved already), and among lone claims the
furthest round (a swarm of two, one of them restarted, agrees on nothing); that is ``ranking``'s ``order``.

Before this module each place wrote its own rule: records ranked (settled holders, holders, greater hash), the
formation (holds the records' choice, holders, greater (fingerprint, hash)), the commit (holders, greater hash)
with a strict majority. They are the rule above, with the same winner in every case.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection, Hashable, Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

from p2ploco.swarm.records import PeerRecord

V = TypeVar("V", bound=Hashable)  # a value voted on: a hash, a (fingerprint, hash), a (round, hash); orderable
Ballot = tuple[V, bool]  # a value, and whether its voter is firm (its ballot counts first)


class Tally(NamedTuple):
    firm: int  # ballots for a value from firm voters
    total: int  # all its ballots


def tally(ballots: Iterable[Ballot[V]]) -> dict[V, Tally]:
    """The tally of every value cast."""
    counts: dict[V, Tally] = {}
    for value, firm in ballots:
        before = counts.get(value, Tally(0, 0))
        counts[value] = Tally(before.firm + firm, before.total + 1)
    return counts


def ranking(tallies: dict[V, Tally], order: Callable[[V, Tally], Any] | None = None) -> list[V]:
    """The values best first: by firm ballots, then all ballots, then ``order(value, tally)`` (by
    default the value itself), the greater first."""
    def key(value: V) -> tuple[Tally, Any]:
        return tallies[value], (order(value, tallies[value]) if order is not None else value)

    return sorted(tallies, key=key, reverse=True)


def plurality(ballots: Iterable[Ballot[V]], electorate: int | None = None) -> V | None:
    """The value ``ranking`` puts first; None without ballots, or, given ``electorate`` (everyone entitled to vote,
    abstainers included), unless more than half of it cast that value."""
    tallies = tally(ballots)
    if not tallies:
        return None
    best = ranking(tallies)[0]
    return best if electorate is None or 2 * tallies[best].total > electorate else None


# ---- the swarm's state, as the peers' records vote it ----------------------------------------------------------


@dataclass(frozen=True)
class SwarmState:
    """A state of one slice that some active peers hold: the round it starts and the hash of the slice's
    parameters, the peers that hold it (the donors a lagging peer fetches from), and whether two or more
    peers vouch for it."""

    round: int
    slice: str
    state_digest: str  # ``metrics.state_digest`` of the slice
    holders: tuple[str, ...]

    @property
    def vouched(self) -> bool:
        return len(self.holders) >= 2


def active_peers(live: dict[str, PeerRecord], me: PeerRecord) -> list[PeerRecord]:
    """The other peers of our config that train or average from a known state."""
    return [r for r in live.values() if r.peer_id != me.peer_id and r.fingerprint == me.fingerprint and r.active]


def ranked_states(live: dict[str, PeerRecord], me: PeerRecord, slice_name: str, seed: str = ""
                  ) -> list[SwarmState]:
    """The states of ``slice_name`` to follow, seen from ``me``, best first; empty when no other active peer of
    our config holds that slice. ``seed``: the hash of the slice as the run's seed makes it, a state nobody trained,
    which has no say where anyone holds another (two newcomer stages of a slice, seeded alike, outvoted its only
    trained holder, a replica whose last round had not settled; their groups trained on the seed and the swarm
    followed them).

    A state ranks by the peers whose signed records hold it (those whose last round settled first, then all),
    never by how far ahead it claims to be: records that claim a round ahead of everyone, from one attacker with a
    few keys, lose to the peers that actually train, as long as those are more. Among equals the earlier round
    (while the swarm moves to the next round, some of it is still at the last: an attacker's claim of the next
    round ties with the honest peers that moved already, and loses), then the hash, so that every peer with the
    same view ranks alike. A state two or more peers hold is vouched for; among lone claims the furthest round
    comes first instead (a swarm of two, one of them restarted, agrees on nothing), and the caller follows one
    only if its holder actually serves that state or a later one (a liar that serves nothing is passed over)."""
    peers = [r for r in active_peers(live, me) if slice_name in r.slices]
    if not peers:
        return []
    voters = peers + ([me] if me.active and slice_name in me.slices else [])
    if any(r.slices[slice_name] != seed for r in voters):
        voters = [r for r in voters if r.slices[slice_name] != seed]
    holders: dict[tuple[int, str], list[str]] = {}
    for r in voters:
        holders.setdefault((r.round, r.slices[slice_name]), []).append(r.peer_id)
    tallies = tally(((r.round, r.slices[slice_name]), not r.unsettled) for r in voters)
    ranked = ranking(tallies, order=lambda state, count: (-state[0] if count.total >= 2 else state[0], state[1]))
    return [SwarmState(round_index, slice_name, digest, tuple(sorted(holders[round_index, digest])))
            for round_index, digest in ranked]


def swarm_state(live: dict[str, PeerRecord], me: PeerRecord, slice_name: str) -> SwarmState | None:
    """The best state of ``slice_name`` that two or more peers vouch for (see ``ranked_states``), or None."""
    return next((state for state in ranked_states(live, me, slice_name) if state.vouched), None)


def round_state(live: dict[str, PeerRecord], me: PeerRecord, round_index: int, banned: Collection[str] = frozenset()
                ) -> tuple[str, dict[str, str]]:
    """The state the swarm starts ``round_index`` from, seen from ``me``: for every slice that an active peer of
    our config holds at that round (``me`` included), the hash its holders vote for (``plurality``; a holder whose
    last round did not settle is not firm), and one digest of them all. Every peer with the same view
    computes the same; it names the round's formation.
    Peers ``me`` has banned have no vote: while the others' records still show the previous
    round, one banned peer's stale hash would tie with ours and could win the tie."""
    ballots: dict[str, list[Ballot[str]]] = {}
    for r in _voters_at(live, me, round_index, banned):
        for name, digest in r.slices.items():
            ballots.setdefault(name, []).append((digest, not r.unsettled))
    chosen = {name: plurality(ballots[name]) for name in sorted(ballots)}
    combined = hashlib.sha256(";".join(f"{name}={digest}" for name, digest in chosen.items()).encode()).hexdigest()
    return combined, chosen


def contested(live: dict[str, PeerRecord], me: PeerRecord, round_index: int,
              banned: Collection[str] = frozenset()) -> bool:
    """Whether the peers that vote on ``round_index``'s starting state (``round_state``) hold more than one hash
    of some slice."""
    held: dict[str, set[str]] = {}
    for r in _voters_at(live, me, round_index, banned):
        for name, digest in r.slices.items():
            held.setdefault(name, set()).add(digest)
    return any(len(digests) > 1 for digests in held.values())


def _voters_at(live: dict[str, PeerRecord], me: PeerRecord, round_index: int, banned: Collection[str]
               ) -> list[PeerRecord]:
    """The peers voting on ``round_index``'s starting state: the active peers of our config at that round, ``me``
    included, those ``me`` has banned left out."""
    return [r for r in active_peers(live, me) + [me] if r.round == round_index and r.peer_id not in banned]


def settled(live: dict[str, PeerRecord], me: PeerRecord, round_index: int) -> bool:
    """Whether at least half of the other active peers of our config work past ``round_index`` (or there are
    none): a record stuck at an old round, honest or not, cannot hold the others up."""
    others = active_peers(live, me)
    return 2 * sum(r.round > round_index for r in others) >= len(others)
