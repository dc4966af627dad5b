"""Whom a closing formation admits: the members that hold the state the round starts from, of pipeline groups that
bring every stage, and of slices that a member others can dial can reduce; at most MAX_PEERS of them. The vote is
``swarm/consensus.py``'s."""

from __future__ import annotations

from p2ploco.swarm.consensus import Ballot, plurality
from p2ploco.swarm.messages import MAX_PEERS
from p2ploco.sync.group import Member


def admit(members: dict[str, Member], stages: int, recorded: dict[str, str] | None = None
          ) -> tuple[dict[str, Member], dict[str, str]]:
    """The members a closing formation keeps, and the others with the reason: for every slice, the (fingerprint,
    hash) its members vote for (``plurality``), where a member is in good standing if it holds the hash
    the records at this round chose (``recorded``: slice -> hash, ``round_state``: a member left out of
    the last round, which publishes its state as unsettled, never outvotes those that applied it). So the records'
    choice wins if some member holds it, and otherwise the value most members hold (ties to the greater); a member
    that holds another one catches up instead. Past MAX_PEERS members, the last to join (``members`` is in the order
    they joined) catch up too. Then a pipeline group whose kept members do not bring all ``stages`` slices is left
    out whole."""
    recorded = recorded or {}
    ballots: dict[str, list[Ballot[tuple[str, str]]]] = {}
    for member in members.values():
        for name, held in member.slices:
            ballots.setdefault(name, []).append((held, held[1] == recorded.get(name)))
    chosen = {name: plurality(votes) for name, votes in ballots.items()}
    refused = {peer: f"it holds another state of {next(n for n, held in m.slices if chosen[n] != held)} than the "
                     f"others: it catches up" for peer, m in members.items()
               if any(chosen[name] != held for name, held in m.slices)}
    kept = {peer: m for peer, m in members.items() if peer not in refused}
    for peer in list(kept)[MAX_PEERS:]:  # every message that names a group's members is bounded so
        refused[peer] = f"the group is full ({MAX_PEERS} members joined first): it catches up"
        del kept[peer]
    brought: dict[str, set[str]] = {}
    for m in kept.values():
        if m.pipeline:
            brought.setdefault(m.pipeline, set()).update(name for name, _ in m.slices)
    incomplete = {name for name, slices in brought.items() if len(slices) < stages}
    for peer, m in list(kept.items()):
        if m.pipeline in incomplete:
            refused[peer] = f"its pipeline group {m.pipeline} did not bring all {stages} stages to this round"
            del kept[peer]
    # A slice needs a member others can dial to reduce it; members that only dial out cannot reduce for each other.
    reducible = {name for m in kept.values() if not m.dial_out for name, _ in m.slices}
    for peer, m in list(kept.items()):
        unreduced = sorted(name for name, _ in m.slices if name not in reducible)
        if unreduced:
            refused[peer] = (f"no member that holds {unreduced[0]} can be dialled to reduce it (all of them are "
                             f"behind NAT): it needs a public peer, or a relay")
            del kept[peer]
    return kept, refused
