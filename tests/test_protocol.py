"""The round protocol's rules as pure functions: the coordinator's decision, the rendezvous choice of the
coordinator, bans, and the parsers of every message (a malformed one is a PayloadError, never a crash)."""

import hashlib

import pytest

from p2ploco.errors import PayloadError
from p2ploco.swarm.bans import Bans
from p2ploco.swarm.commit import Outcome, Vote, decide, parse_decision, parse_vote
from p2ploco.swarm.rounds import Group, best_coordinator, parse_group, parse_join, rendezvous

A, B, C, D = "peerA", "peerB", "peerC", "peerD"
GROUP = Group("g", 5, "params", (A, B, C, D), A)


def holds(digest="d"):
    return (Vote.HOLDS, digest)


def test_every_holder_agreeing_commits_and_the_dead_need_not_vote():
    decision = decide(GROUP, {A: holds(), B: holds(), C: holds()}, {}, A)  # D died after delivering its span
    assert (decision.outcome, decision.digest) == (Outcome.COMMIT, "d")


def test_a_missing_span_means_a_redo_among_the_voters_not_known_dropped():
    votes = {A: holds(), B: (Vote.MISSING, ""), C: holds(), D: (Vote.DROPPED, "")}
    decision = decide(GROUP, votes, {}, A)
    assert decision.outcome == Outcome.REDO and decision.redo.peers == (A, B, C) and decision.redo.attempt == 1
    assert decision.redo.coordinator == A and decision.redo.group_id != GROUP.group_id


def test_one_liar_costs_a_redo_never_the_round():
    redo = Group("r", 5, "params", (A, B, C, D), A, attempt=1)
    liar = {A: holds(), B: holds(), C: holds(), D: (Vote.MISSING, "")}
    assert decide(GROUP, liar, {}, A).outcome == Outcome.REDO
    decision = decide(redo, liar, {}, A)  # it lies again in the redo: the majority commits
    assert (decision.outcome, decision.digest) == (Outcome.COMMIT, "d")
    forged = {A: holds(), B: holds(), C: holds(), D: holds("forged")}
    assert decide(redo, forged, {}, A).digest == "d"
    split = {A: holds("x"), B: holds("y"), C: (Vote.MISSING, ""), D: (Vote.MISSING, "")}
    assert decide(redo, split, {}, A).outcome == Outcome.ABORT  # no majority for anything


def test_two_accusers_push_a_peer_out_one_only_spares_a_wait():
    votes = {A: holds(), B: holds(), C: holds(), D: holds("garbage-sender's")}
    assert decide(GROUP, votes, {D: {A, B}}, A).outcome == Outcome.COMMIT  # D is out: the rest agree
    assert decide(GROUP, votes, {D: {A}}, A).outcome == Outcome.REDO  # one accuser: D's vote still counts
    two = Group("g", 5, "params", (A, B), A)
    assert decide(two, {A: holds(), B: holds("other")}, {B: {A}}, A).redo.peers == (A, B)


def test_everyone_dropped_or_silent_aborts():
    assert decide(GROUP, {A: (Vote.DROPPED, ""), B: (Vote.DROPPED, "")}, {}, A).outcome == Outcome.ABORT
    assert decide(GROUP, {A: (Vote.MISSING, "")}, {}, A).outcome == Outcome.ABORT


def test_the_coordinator_is_a_rendezvous_winner_not_the_smallest_id():
    peers = {f"12D3KooW{i:03d}" for i in range(50)}
    chosen = {best_coordinator(peers, 7, f"state{s}") for s in range(40)}
    assert len(chosen) > 10  # every starting state picks anew: no id wins every round
    assert best_coordinator(peers, 7, "state0") == min(
        peers, key=lambda p: hashlib.sha256(f"7/state0/{p}".encode()).digest())
    assert rendezvous(7, "s", "p") == rendezvous(7, "s", "p") != rendezvous(8, "s", "p")


def test_bans_are_local_and_bounded():
    bans = Bans(rounds=3)
    bans.ban(B, 10, "garbage")
    assert [bans.banned(B, r) for r in (9, 10, 11, 13, 14)] == [True, True, True, True, False]
    assert bans.active(12) == {B} and bans.active(14) == set()
    assert not Bans(rounds=0).banned(B, 10)


@pytest.mark.parametrize("request_, message", [
    ({"round": -1, "name": "p", "config": "c", "exchange": "e", "state": "s", "unreachable": []}, "negative"),
    ({"round": 1, "name": "p", "config": "c", "exchange": "e", "state": "s", "unreachable": "x"}, "unreachable"),
    ({"round": 1, "name": "p", "config": "c", "exchange": "e", "state": "s", "unreachable": ["b", "a"]}, "sorted"),
    ({"round": "1", "name": "p", "config": "c", "exchange": "e", "state": "s", "unreachable": []}, "'round'"),
])
def test_malformed_join_requests_are_payload_errors(request_, message):
    with pytest.raises(PayloadError, match=message):
        parse_join(request_)


def test_group_vote_and_decision_parsers_refuse_what_an_honest_peer_never_sends():
    with pytest.raises(PayloadError):
        parse_group({"group_id": "g", "peers": []}, 1, "params", A)
    with pytest.raises(PayloadError):
        parse_group({"group_id": "g", "peers": [B, A]}, 1, "params", A)  # not in canonical order
    vote = {"group_id": "g", "round": 5, "name": "params", "peers": [A, B], "coordinator": A, "attempt": 0,
            "vote": "holds", "digest": "d", "drops": [B]}
    assert parse_vote(vote)[1:] == (Vote.HOLDS, "d", {B})
    with pytest.raises(PayloadError, match="'vote' is not one of"):
        parse_vote({**vote, "vote": "maybe"})
    with pytest.raises(PayloadError, match="outside the round's group"):
        parse_decision({"outcome": "redo", "group_id": "h", "peers": ["intruder"]}, GROUP, A)
    assert parse_decision({"outcome": "commit", "digest": "d"}, GROUP, A).digest == "d"
