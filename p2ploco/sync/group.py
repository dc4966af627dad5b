"""A group: the peers that all-reduce together in one round, as the coordinator that formed it decided.

Every peer of a run must average with the same peers in a round, or their global parameters part ways, so a group
is one decision (``sync/form.py``) that each of its members holds alike: its id, the members in canonical
order, and for each member the parameter slices it holds (it contributes to every span of them), its pipeline
group if it is a stage peer, the tokens its contribution carries (its weight in the round's mean), and whether
others can dial it (one that only dials out reduces no span). It also lists the peers that joined or were expected
and are not in it, and why: a group smaller than that is the coordinator's decision, never an accident. The
all-reduce (``sync/reduce.py``) cuts each slice among its holders by it, and its coordinator judges the members'
commit votes against it (``sync/decide.py``).

Of more than ``max_reducers`` holders of a slice that can be dialled (the run's ``swarm.max_reducers``, MAX_REDUCERS
by default), a draw of that many reduces it: with every one reducing, each member opened a stream to each and read a
receipt naming every member from each, O(N) streams and O(N^2) receipt bytes a member a round
(``benchmarks/simulate.py``). Drawn, a member opens ``max_reducers`` streams; a reducer takes N / ``max_reducers``
times the bytes of its span that an undrawn butterfly's reducer takes.

A peer that coordinates remembers the groups it formed in its ``GroupBook``, by id and by the formation they closed.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType
from typing import Any, NamedTuple

from p2ploco.config.fields import MAX_REDUCERS

KEEP_PER_PEER = 16  # a group is remembered while it is among this many latest of one of its members' ...
KEEP_SECONDS = 600.0  # ... and at most this long


class _SliceRoles(NamedTuple):
    """A slice's members in a group, each in canonical order (``Group.holders``, ``contributors``, ``reducers``)."""

    holders: tuple[str, ...] = ()
    contributors: tuple[str, ...] = ()
    reducers: tuple[str, ...] = ()


_NOBODY = _SliceRoles()  # a slice nobody holds


@dataclass(frozen=True)
class Group:
    """The peers that all-reduce together in one round (or, with ``attempt`` 1, in the redo among its survivors)."""

    group_id: str
    round_index: int
    name: str
    peers: tuple[str, ...]  # canonical order: sorted peer ids
    coordinator: str  # who formed the group; it also decides the round's outcome
    attempt: int = 0  # 1 for the redo of a failed all-reduce among its survivors
    holdings: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (peer, the slices it holds), in peer order
    pipelines: tuple[tuple[str, str], ...] = ()  # (stage peer, its pipeline group), in peer order
    left_out: tuple[tuple[str, str], ...] = ()  # (peer, why): joined or expected, and not in the group
    # (peer, tokens its contribution carries: its weight; 0: a hub's, which sends none), in peer order
    tokens: tuple[tuple[str, int], ...] = ()
    dial_out: tuple[str, ...] = ()  # members that can only dial out: they reduce no span
    # members that reduce no span in this attempt (a redo's: each refused members it has shown no reason for)
    passive: tuple[str, ...] = ()
    # in a redo, per slice, the members its first attempt drew to reduce it (``_drawn``); none reduces it in the redo
    # but of these: drawn afresh, k hostile keys took turns, one in each attempt, and the round was lost
    reducing: tuple[tuple[str, tuple[str, ...]], ...] = ()
    max_reducers: int = MAX_REDUCERS  # the run's ``swarm.max_reducers``: a slice of more reducers draws this many
    # the coordinator's signature of this group under its id (``evidence.group_statement``): what a member shows a
    # reducer that holds another version of the group, which together prove that the coordinator handed out two
    grant: bytes = field(default=b"", compare=False, repr=False)

    @cached_property
    def digest(self) -> str:
        """The group as one value: a hash of its id, round, sync, attempt, coordinator, passive members and
        ``max_reducers``, and of every member's entry (holdings, pipeline group, tokens, dial-out). A join names the
        group it follows by it, an answer relative to that group its base, a contribution and a vote the version of
        the group they are for, and the coordinator signs it. A hostile coordinator may hand its members versions of
        one group id that differ in some entry (a victim's tokens); named by its id alone, they passed
        for each other."""
        drawn = [[name, list(peers)] for name, peers in self.reducing]
        return hashlib.sha256(json.dumps([self.group_id, self.round_index, self.name, self.attempt, self.coordinator,
                                          list(self.passive), self.max_reducers, self.entries(),
                                          *([drawn] if drawn else [])],
                                         sort_keys=True).encode()).hexdigest()

    def entries(self) -> Mapping[str, Mapping[str, Any]]:
        """Each member's entry: what a group answer says of it (``sync/join.py``), and what ``digest`` hashes. Made
        once a group, and shared (read them only): a coordinator's answer to each joiner, and a member's group, read
        them."""
        return self._entries

    @cached_property
    def _entries(self) -> Mapping[str, Mapping[str, Any]]:
        holdings, pipelines, tokens, dial_out = (dict(self.holdings), dict(self.pipelines), dict(self.tokens),
                                                 frozenset(self.dial_out))
        return {peer: {"holdings": list(holdings[peer]), "pipeline": pipelines.get(peer, ""), "tokens": tokens[peer],
                       "dial_out": peer in dial_out} for peer in self.peers}

    def without(self) -> str:
        """Who the coordinator left out and why, as a member logs it ("" if nobody)."""
        return ", ".join(f"{peer[-8:]} ({why})" for peer, why in self.left_out)

    def holders(self, slice_name: str) -> tuple[str, ...]:
        """The members that hold ``slice_name``, in canonical order: each contributes to every span of it."""
        return self._of_slice.get(slice_name, _NOBODY).holders

    @cached_property
    def _of_slice(self) -> dict[str, _SliceRoles]:
        """Per slice, its holders, contributors and reducers, found once: a round asks for them per piece, and a scan
        of the group each time made that O(N^2) per member (found by ``benchmarks/simulate.py``)."""
        tokens, reducing_none, drawn = dict(self.tokens), set(self.dial_out) | set(self.passive), dict(self.reducing)
        holders: dict[str, list[str]] = {}
        for peer, slices in self.holdings:
            for name in slices:
                holders.setdefault(name, []).append(peer)
        return {name: _SliceRoles(tuple(peers), tuple(p for p in peers if tokens.get(p, 1) > 0),
                                  self._drawn(name, [p for p in peers if p not in reducing_none
                                                     and (name not in drawn or p in drawn[name])]))
                for name, peers in holders.items()}

    def _drawn(self, slice_name: str, eligible: list[str]) -> tuple[str, ...]:
        """At most ``max_reducers`` of ``eligible``, in canonical order: those whose hash with the group id and the
        slice is lowest. Every member draws alike from the group it holds; the group id is drawn by the coordinator when
        the formation closes, after the joins, so no joiner can choose a key that reduces. A redo draws nobody anew:
        its eligible are the first attempt's drawn (``reducing``), never more than ``max_reducers``."""
        if len(eligible) <= self.max_reducers:
            return tuple(eligible)
        rank = {p: hashlib.sha256(f"{self.group_id}/{slice_name}/{p}".encode()).digest() for p in eligible}
        drawn = set(sorted(eligible, key=rank.__getitem__)[:self.max_reducers])
        return tuple(p for p in eligible if p in drawn)

    def contributors(self, slice_name: str) -> tuple[str, ...]:
        """The holders of ``slice_name`` that send a contribution to each of its spans, in canonical order: all but
        the hubs (``roles.py``: a public peer that trains nothing joins with no tokens; it reduces spans and takes
        the results, and sends nothing of its own)."""
        return self._of_slice.get(slice_name, _NOBODY).contributors  # no tokens listed: every holder contributes

    def reducers(self, slice_name: str) -> tuple[str, ...]:
        """The holders of ``slice_name`` that others can dial, in canonical order, less the passive ones, and of more
        than ``max_reducers`` a draw of that many (``_drawn``): the i-th reduces span i. A member that can only dial out
        sends its contributions and reads the results on streams it opened; a passive one and one not drawn do so
        too (a redo's refusers: ``commit.decide``)."""
        return self._of_slice.get(slice_name, _NOBODY).reducers

    def tokens_of(self) -> Mapping[str, int]:
        """Each member's weight: the tokens its contribution carries (read-only: made once a group, each member's
        every result and audit reads it)."""
        return self._tokens

    @cached_property
    def _tokens(self) -> Mapping[str, int]:
        return MappingProxyType(dict(self.tokens))

    def slices_of(self, peer: str) -> tuple[str, ...]:
        return dict(self.holdings).get(peer, ())

    def among(self, group_id: str, peers: tuple[str, ...], coordinator: str, passive: tuple[str, ...] = (),
              grant: bytes = b"") -> Group:
        """The redo of this round among ``peers`` (each keeps its holdings), of whom ``passive`` reduce nothing, nor
        does any member the first attempt did not draw (``reducing``); ``grant``: the coordinator's signature of it."""
        kept = set(peers)
        drawn = self.reducing if self.attempt else tuple((name, self.reducers(name)) for name in sorted(self._of_slice))
        return Group(group_id, self.round_index, self.name, tuple(sorted(kept)), coordinator, 1,
                     tuple(h for h in self.holdings if h[0] in kept),
                     tuple(p for p in self.pipelines if p[0] in kept),
                     tokens=tuple(t for t in self.tokens if t[0] in kept),
                     dial_out=tuple(p for p in self.dial_out if p in kept),
                     passive=tuple(sorted(kept & set(passive))), reducing=drawn,
                     max_reducers=self.max_reducers, grant=grant)

    def whole_pipelines(self, peers: set[str]) -> set[str]:
        """``peers`` less the stage peers of a pipeline group that is not whole among them."""
        pipelines = dict(self.pipelines)
        broken = {name for peer, name in self.pipelines if any(
            other not in peers for other, other_name in self.pipelines if other_name == name)}
        return {peer for peer in peers if pipelines.get(peer) not in broken}


@dataclass(frozen=True)
class Member:
    """What a joiner says of itself: its slices (name -> (exchange fingerprint, hash)), pipeline group, the tokens
    its contribution carries, and whether others can dial it (one that only dials out reduces no span)."""

    slices: tuple[tuple[str, tuple[str, str]], ...]
    pipeline: str = ""
    tokens: int = 1
    dial_out: bool = False
    follows: str = ""  # the digest of the group it applied its last round with ("" if none): answered relative to it
    rejoins: bool = False  # its group of this round died: it joins only a formation open at this coordinator


# A formation, the joins a coordinator gathers into one group, is named by the round, the all-reduce's name, the
# config fingerprint and the digest of the state the round starts from (``consensus.round_state``).
FormationKey = tuple[int, str, str, str]


class GroupBook:
    """The groups this peer coordinated (and the redos it decided), by id and by formation: votes are judged
    against them, and a straggler is told "late" (or, if it is a member whose answer was lost, given its group
    again). A group is kept while it is among the KEEP_PER_PEER latest of some member's (and for at most
    KEEP_SECONDS), so junk cannot push a real group out: a peer that opens formation after formation only ages
    its own groups. (Only peers with a live record of the run may join at all: ``Coordinator._refusal``.)"""

    def __init__(self) -> None:
        self._groups: dict[str, tuple[Group, float]] = {}  # group id -> (group, when it was added)
        self._latest: dict[str, deque[str]] = {}  # peer -> the ids of its latest groups
        self._closed: dict[FormationKey, str] = {}  # formation -> the group id it closed with

    def add(self, group: Group, key: FormationKey | None = None) -> None:
        """Remember ``group``; ``key``: the formation it closed (none for a redo)."""
        now = time.monotonic()
        self._groups[group.group_id] = (group, now)
        for peer in group.peers:
            self._latest.setdefault(peer, deque(maxlen=KEEP_PER_PEER)).append(group.group_id)
        if key is not None:
            self._closed[key] = group.group_id
        kept = {gid for ids in self._latest.values() for gid in ids}
        self._groups = {gid: entry for gid, entry in self._groups.items()
                        if gid in kept and now - entry[1] < KEEP_SECONDS}
        self._latest = {peer: ids for peer, ids in self._latest.items() if any(gid in self._groups for gid in ids)}
        self._closed = {key: gid for key, gid in self._closed.items() if gid in self._groups}

    def since(self, seconds: float) -> list[Group]:
        """The groups added in the last ``seconds``."""
        now = time.monotonic()
        return [group for group, added in self._groups.values() if now - added < seconds]

    def get(self, group_id: str) -> Group | None:
        entry = self._groups.get(group_id)
        return entry[0] if entry is not None else None

    def closed(self, key: FormationKey) -> Group | None:
        """The group formation ``key`` closed with, if this peer still remembers it."""
        return self.get(self._closed[key]) if key in self._closed else None

    def formations(self) -> dict[FormationKey, Group]:
        """Every formation this peer remembers closing, and its group."""
        return {key: self._groups[gid][0] for key, gid in self._closed.items()}
