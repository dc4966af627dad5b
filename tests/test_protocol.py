"""The round protocol's rules as pure functions: the coordinator's decision, the rendezvous choice of the
coordinator, bans, and the parsers of every message (a malformed one is a PayloadError, never a crash)."""

import asyncio
import hashlib
import logging

import msgpack
import pytest
from hivemind.utils.crypto import RSAPrivateKey

from p2ploco.errors import PayloadError
from p2ploco.swarm import wire
from p2ploco.swarm.bans import Bans
from p2ploco.swarm.evidence import Claim, Signer, owner_of, result_statement
from p2ploco.swarm.messages import MAX_GROUP_HEADER, MAX_PEERS, MAX_REASON, decode
from p2ploco.sync.admission import admit
from p2ploco.sync.decide import DecisionAnswer, _Ballot, parse_decision, parse_vote
from p2ploco.sync.group import KEEP_PER_PEER, MAX_REDUCERS, Group, GroupBook, Member
from p2ploco.sync.join import (
    JoinAnswer,
    best_coordinator,
    group_answer,
    parse_group,
    parse_join,
    rendezvous,
)
from p2ploco.sync.reduce_values import Evidence, ReduceAnswer
from p2ploco.sync.tally import Cast, Outcome, Vote, decide, examine

A, B, C, D = "peerA", "peerB", "peerC", "peerD"
S = "stage0"


def group(peers=(A, B, C, D), attempt=0, holdings=None, pipelines=()):
    holdings = holdings or {p: (S,) for p in peers}
    return Group("g", 5, "params", tuple(peers), A, attempt, tuple((p, holdings[p]) for p in peers), pipelines,
                 tokens=tuple((p, 1) for p in peers))


GROUP = group()


def holds(digest="d", drops=()):
    return Cast(Vote.HOLDS, {S: digest}, drops=frozenset(drops))


MISSING, DROPPED = Cast(Vote.MISSING), Cast(Vote.DROPPED)


def refused_by(*reducers):
    return Cast(Vote.DROPPED, refused_by=frozenset(reducers))


def test_every_holder_agreeing_commits_and_the_dead_need_not_vote():
    decision = decide(GROUP, {A: holds(), B: holds(), C: holds()}, A)  # D died after delivering its span
    assert (decision.outcome, decision.digests) == (Outcome.COMMIT, {S: "d"})
    assert decision.applies({S: "d"}) and not decision.applies({S: "other"})
    # ... but only while the holders are a strict majority of the group: two of four decide nothing
    assert decide(group(attempt=1), {A: holds(), B: holds()}, A).outcome == Outcome.ABORT


def test_a_missing_span_means_a_redo_among_the_voters_not_known_dropped():
    votes = {A: holds(), B: MISSING, C: holds(), D: DROPPED}
    decision = decide(GROUP, votes, A)
    assert decision.outcome == Outcome.REDO and decision.redo.peers == (A, B, C) and decision.redo.attempt == 1
    assert decision.redo.coordinator == A and decision.redo.group_id != GROUP.group_id


def test_no_redo_among_survivors_of_whom_none_can_reduce_a_slice_or_contribute_to_it():
    """A hub (C, tokens 0) was the only member others can dial, and died: the NATed trainers who voted "missing"
    cannot redo the round among themselves (nobody to reduce it: they used to "redo" a butterfly of no spans, all
    hold the same empty aggregate, and commit it), and two hubs alone have nothing to reduce."""
    hubbed = Group("g", 5, "params", (A, B, C, D), C, 0, tuple((p, (S,)) for p in (A, B, C, D)),
                   tokens=((A, 100), (B, 100), (C, 0), (D, 0)), dial_out=(A, B))
    assert decide(hubbed, {A: MISSING, B: MISSING, D: MISSING}, C).outcome == Outcome.REDO  # D reduces
    assert decide(hubbed, {A: MISSING, B: MISSING}, C).outcome == Outcome.ABORT  # C and D died
    assert decide(hubbed, {C: MISSING, D: MISSING}, C).outcome == Outcome.ABORT  # the trainers died


def test_one_liar_costs_a_redo_never_the_round():
    redo = group(attempt=1)
    liar = {A: holds(), B: holds(), C: holds(), D: MISSING}
    assert decide(GROUP, liar, A).outcome == Outcome.REDO
    decision = decide(redo, liar, A)  # it lies again in the redo: the majority commits
    assert (decision.outcome, decision.digests) == (Outcome.COMMIT, {S: "d"})
    forged = {A: holds(), B: holds(), C: holds(), D: holds("forged")}
    assert decide(redo, forged, A).digests == {S: "d"}
    split = {A: holds("x"), B: holds("y"), C: MISSING, D: MISSING}
    assert decide(redo, split, A).outcome == Outcome.ABORT  # no majority for anything


def test_a_member_whose_link_broke_is_waited_for_and_redone_with():
    """A reducer that lost B's stream reports nothing about B (it did nothing wrong): the coordinator waits for B's
    vote ("missing") and redoes the round with it. Only two voters that rejected B's data spare the wait: one that
    named every member would have the coordinator decide on its vote alone."""
    async def ballots():  # a ballot's decision is a future of the coordinator's event loop
        return _Ballot(GROUP, deadline=0.0), _Ballot(GROUP, deadline=0.0)

    ballot, rejected = asyncio.run(ballots())
    ballot.votes.update({A: holds(), C: holds(), D: holds()})
    assert ballot.waiting_for() == [B]
    ballot.votes[B] = MISSING
    assert decide(GROUP, ballot.votes, A).redo.peers == (A, B, C, D)
    rejected.votes.update({A: holds(drops={B, C, D})})
    assert rejected.waiting_for() == [B, C, D]  # one reducer's word against each: A is the one in conflict
    rejected.votes.clear()
    rejected.votes.update({A: holds(drops={B}), C: holds(drops={B})})
    assert rejected.waiting_for() == [D]  # two voters rejected B: it is out whatever it votes


def test_a_peer_in_conflict_with_two_others_is_out_and_one_conflict_costs_a_redo_in_which_neither_side_reduces():
    votes = {A: holds(drops={D}), B: holds(drops={D}), C: holds(), D: holds("garbage-sender's")}
    assert decide(GROUP, votes, A).outcome == Outcome.COMMIT  # D is out: the rest agree
    one = {A: holds(drops={D}), B: holds(), C: holds(), D: holds("garbage-sender's")}
    # one accuser: D's vote still counts, and neither A nor D reduces in the redo: A may be right (D's result failed
    # A's audit last round, and this round's coordinator did not draw that audit), and D would then fail B's and C's
    decision = decide(GROUP, one, A)
    assert decision.outcome == Outcome.REDO and decision.redo.peers == (A, B, C, D)
    assert decision.redo.passive == (A, D) and decision.redo.reducers(S) == (B, C)
    assert {A, D} <= set(decision.redo.contributors(S))
    two = group((A, B))  # both passive would leave nobody to reduce: only the rejecting reducer is
    assert decide(two, {A: holds(), B: holds("other", drops={A})}, A).redo.passive == (B,)


def test_a_reducer_that_refuses_every_honest_member_is_out_never_the_one_voter_left():
    """X answered A, B and C "banned here": each voted "dropped", and X's lone vote used to commit its own state for
    everyone. Now X is in conflict with three members: out of the redo, in which the honest three commit."""
    X = "peerX"
    four = group((A, B, C, X))
    votes = {A: refused_by(X), B: refused_by(X), C: refused_by(X), X: holds("x's own", drops={A, B, C})}
    decision = decide(four, votes, A)
    assert decision.outcome == Outcome.REDO and decision.redo.peers == (A, B, C) and X in decision.reason
    assert decide(group((A, B, C, X), attempt=1), votes, A).outcome == Outcome.ABORT  # never X's commit alone
    # a member the others do not dispute, refused by one reducer: a redo in which neither of the two reduces
    votes = {A: refused_by(X), B: holds(), C: holds(), X: holds(drops={A})}
    decision = decide(four, votes, A)
    assert decision.outcome == Outcome.REDO and decision.redo.passive == (A, X)


def test_a_commit_needs_a_strict_majority_of_the_groups_holders_by_count_and_by_weight():
    weighted = Group("g", 5, "params", (A, B, C, D), A, 1, tuple((p, (S,)) for p in (A, B, C, D)),
                     tokens=((A, 100), (B, 100), (C, 100), (D, 1000)))
    assert decide(weighted, {A: holds(), B: holds(), C: holds(), D: holds("e")}, A).outcome == Outcome.ABORT
    assert decide(weighted, {A: holds(), B: holds(), D: holds()}, A).digests == {S: "d"}
    # a proven equivocator is out: its vote neither counts nor blocks
    assert decide(group(attempt=1), {A: holds(), B: holds(), C: holds(), D: holds("e")}, A,
                  convicted=frozenset({D})).digests == {S: "d"}


def test_everyone_dropped_or_silent_aborts():
    assert decide(GROUP, {A: DROPPED, B: DROPPED}, A).outcome == Outcome.ABORT
    assert decide(GROUP, {A: MISSING}, A).outcome == Outcome.ABORT


# a full replica A holds both slices; a pipeline of B (stage 0) and C (stage 1); another full replica D
MIXED = group(holdings={A: ("stage0", "stage1"), B: ("stage0",), C: ("stage1",), D: ("stage0", "stage1")},
              pipelines=((B, "g0"), (C, "g0")))


def test_each_slice_is_judged_among_its_holders():
    full, s0, s1 = (Cast(Vote.HOLDS, {"stage0": "x", "stage1": "y"}), Cast(Vote.HOLDS, {"stage0": "x"}),
                    Cast(Vote.HOLDS, {"stage1": "y"}))
    decision = decide(MIXED, {A: full, B: s0, C: s1, D: full}, A)
    assert decision.digests == {"stage0": "x", "stage1": "y"} and decision.applies({"stage1": "y"})
    # a stage of the group misses its slice's aggregate: the redo leaves the whole group out, not just C
    decision = decide(MIXED, {A: full, B: s0, C: MISSING, D: full}, A)
    assert decision.outcome == Outcome.REDO and decision.redo.peers == (A, B, C, D)  # C voted: it is counted
    accused = {A: Cast(Vote.HOLDS, full.digests, drops=frozenset({C})), B: s0,
               D: Cast(Vote.HOLDS, full.digests, drops=frozenset({C}))}
    decision = decide(MIXED, accused, A)  # C accused twice: out, with its group
    assert decision.outcome == Outcome.COMMIT  # the full replicas and B agree on every slice they hold
    redo = decide(MIXED, {A: full, B: s0, C: DROPPED, D: Cast(Vote.HOLDS, {"stage0": "x", "stage1": "z"})}, A).redo
    assert redo.peers == (A, D) and redo.holders("stage1") == (A, D) and redo.pipelines == ()


def test_a_closing_formation_keeps_the_majority_state_and_whole_pipeline_groups():
    def member(pipeline="", **slices):
        return Member(tuple(sorted((k, ("fp", v)) for k, v in slices.items())), pipeline)

    members = {A: member(stage0="x", stage1="y"), B: member("g0", stage0="x"), C: member("g0", stage1="y"),
               D: member("g1", stage0="x"), "peerE": member(stage0="stale", stage1="y")}
    kept, refused = admit(members, stages=2)
    assert set(kept) == {A, B, C}
    assert "pipeline group g1 did not bring all 2 stages" in refused[D]
    assert "another state of stage0" in refused["peerE"]
    # a tie goes to the state the records show at this round, not to the greater hash
    tied = {A: member(stage0="aaa"), B: member(stage0="zzz")}
    assert set(admit(tied, stages=1)[0]) == {B}
    assert set(admit(tied, stages=1, recorded={"stage0": "aaa"})[0]) == {A}


def test_the_coordinator_is_a_rendezvous_winner_of_the_round_not_the_smallest_id():
    peers = {f"12D3KooW{i:03d}" for i in range(50)}
    chosen = {best_coordinator(peers, r) for r in range(40)}
    assert len(chosen) > 10  # every round picks anew: no id wins every round
    assert best_coordinator(peers, 7) == min(peers, key=lambda p: hashlib.sha256(f"7/{p}".encode()).digest())
    assert rendezvous(7, "p") == rendezvous(7, "p") != rendezvous(8, "p")


def test_bans_are_local_and_bounded():
    bans = Bans(rounds=3)
    bans.ban(B, 10, "garbage")
    assert [bans.banned(B, r) for r in (9, 10, 11, 13, 14)] == [True, True, True, True, False]
    assert bans.active(12) == {B} and bans.active(14) == set()
    assert not Bans(rounds=0).banned(B, 10)


def test_strikes_ban_a_peer_caught_in_three_of_ten_rounds_however_many_spans(caplog):
    bans = Bans(rounds=3)
    for round_index in (10, 10, 10, 14):  # several spans of one round count once
        bans.strike(B, round_index, "its contribution pointed against the others'")
    assert not bans.banned(B, 14)
    bans.strike(B, 25, "its contribution pointed against the others'")  # 10 and 14 are too old to count
    assert not bans.banned(B, 25)
    with caplog.at_level(logging.WARNING, logger="p2ploco.swarm.bans"):
        for round_index in (27, 30):
            bans.strike(B, round_index, "its contribution pointed against the others'")
    assert bans.banned(B, 30) and bans.active(33) == {B}
    # what a reducer that drops B says (it used to say "for sending malformed data" whatever the ban was for)
    assert bans.reason(B) == "its contribution pointed against the others', and so in 3 of the last 10 rounds"
    assert bans.active(34) == set()
    assert caplog.records[-1].getMessage() == (f"round 30: leaving {B[-8:]} out of this node's rounds until round 34: "
                                               f"its contribution pointed against the others', and so in 3 of the "
                                               f"last 10 rounds")


JOIN = {"round": 1, "name": "p", "config": "c", "state": "s", "slices": {S: ["fp", "h"]}, "pipeline": "",
        "unreachable": [], "tokens": 10240, "dial_out": False, "follows": ""}


@pytest.mark.parametrize("request_, message", [
    ({**JOIN, "round": -1}, "JoinRequest: round: Input should be greater than or equal to 0"),
    ({**JOIN, "unreachable": "x"}, "JoinRequest: unreachable: Input should be a valid list"),
    ({**JOIN, "unreachable": ["b", "a"]}, "JoinRequest: unreachable: Value error, not a sorted list"),
    ({**JOIN, "round": "1"}, "JoinRequest: round: Input should be a valid integer"),
    ({**JOIN, "round": True}, "JoinRequest: round: Input should be a valid integer"),
    ({**JOIN, "round": 1.0}, "JoinRequest: round: Input should be a valid integer"),
    ({**JOIN, "slices": {}}, "JoinRequest: slices: Dictionary should have at least 1 item"),
    ({**JOIN, "slices": {S: ["fp"]}}, "JoinRequest: slices.stage0: List should have at least 2 items"),
    ({**JOIN, "pipeline": 3}, "JoinRequest: pipeline: Input should be a valid string"),
    ({**JOIN, "pipeline": b"g0"}, "JoinRequest: pipeline: Input should be a valid string"),
    ({k: v for k, v in JOIN.items() if k != "state"}, "JoinRequest: state: Field required"),
    ({**JOIN, "tokens": -1}, "JoinRequest: tokens: Input should be greater than or equal to 0"),
    ({**JOIN, "tokens": 1 << 60}, "JoinRequest: tokens: Input should be less than or equal to"),
    ({**JOIN, "dial_out": "yes"}, "JoinRequest: dial_out: Input should be a valid boolean"),
    ({**JOIN, "follows": "f" * 129}, "JoinRequest: follows: String should have at most 128 characters"),
    ({**JOIN, "follows": b"f"}, "JoinRequest: follows: Input should be a valid string"),
])
def test_malformed_join_requests_are_payload_errors(request_, message):
    with pytest.raises(PayloadError, match=message):
        parse_join(request_)


def test_a_formation_admits_at_most_max_peers_members_the_first_that_joined():
    """Every message that names a group's members is bounded by MAX_PEERS: a formation that more peers joined
    keeps the first MAX_PEERS to join (not the smallest ids) and the others catch up, told why. A group of 2,034
    in the simulation was refused by every member when the bound was 1,024."""
    full = Member(((S, ("fp", "x")),))
    joined = [f"12D3KooW{MAX_PEERS + 1 - i:044d}" for i in range(MAX_PEERS + 2)]  # later joiners: smaller ids
    kept, refused = admit(dict.fromkeys(joined, full), stages=1)
    assert list(kept) == joined[:MAX_PEERS]
    assert refused == dict.fromkeys(joined[MAX_PEERS:], f"the group is full ({MAX_PEERS} members joined first): it "
                                                        f"catches up")


def test_a_receipt_a_vote_and_a_redo_that_name_every_member_of_the_largest_group_fit_a_group_header():
    """A reducer's receipt names every contribution to its span, a vote may name every member it rejected, a redo
    every survivor: at MAX_PEERS members each is past the 64 KiB of an ordinary header, and within MAX_GROUP_HEADER,
    which their readers allow."""
    peers = sorted(f"12D3KooW{i:044d}" for i in range(MAX_PEERS))
    receipt = {"status": "ok", "included": list(range(MAX_PEERS)), "norms": [1.0] * MAX_PEERS,
               "contributions": [bytes(16)] * MAX_PEERS, "signature": bytes(256)}
    vote = {"group_id": "g", "version": "0" * 64, "vote": "holds", "drops": peers, "refused": [], "refused_by": []}
    redo = {"outcome": "redo", "reason": "", "group_id": "g2", "peers": peers, "passive": [], "grant": bytes(256)}
    for message in (receipt, vote, redo):
        assert wire.MAX_HEADER_BYTES < len(wire.pack(message)) < MAX_GROUP_HEADER
    assert decode(ReduceAnswer, receipt).contributions == [bytes(16)] * MAX_PEERS
    assert parse_vote(vote, wire.pack([]))[0].drops == peers
    assert decode(DecisionAnswer, redo).peers == peers


def test_a_group_answered_in_full_says_what_most_members_hold_and_trained_once_and_lists_the_others():
    """A joiner that follows no group (all do in a run's first round) is answered every member: by its id alone
    where it holds and trained what most do, ~50 bytes a member where each used to take ~170."""
    peers = [f"12D3KooW{i:044d}" for i in range(1024)]  # 52 characters, as a libp2p peer id
    stage, slow = peers[5], peers[9]
    now = Group("now", 5, "params", tuple(peers), peers[0], 0,
                tuple((p, ("stage0",) if p == stage else ("stage0", "stage1")) for p in peers),
                tokens=tuple((p, 5120 if p == slow else 10240) for p in peers), grant=b"s" * 256)
    answer = group_answer(now)
    assert (answer["held"], answer["holdings"], answer["trained"], answer["tokens"]) == (
        ["stage0", "stage1"], {stage: ["stage0"]}, 10240, {slow: 5120})
    assert len(msgpack.packb(answer)) < 55 * len(peers)
    given = parse_group(decode(JoinAnswer, answer), 5, "params", peers[0], MAX_REDUCERS)
    assert given.digest == now.digest and given.tokens_of()[slow] == 5120 and given.holders("stage1") == tuple(
        p for p in peers if p != stage)


def test_a_group_answered_relative_to_the_group_the_joiner_follows_is_small_and_the_same_group():
    peers = [f"12D3KooW{i:044d}" for i in range(MAX_PEERS)]  # 52 characters, as a libp2p peer id
    last = Group("last", 4, "params", tuple(peers[:-1]), peers[0], 0, tuple((p, (S,)) for p in peers[:-1]),
                 tokens=tuple((p, 10240) for p in peers[:-1]))
    members = peers[1:]  # the first has left, the last has joined, one trained fewer tokens
    now = Group("now", 5, "params", tuple(members), peers[1], 0, tuple((p, (S,)) for p in members),
                tokens=tuple((p, 5120 if p == peers[7] else 10240) for p in members), dial_out=(peers[-1],),
                grant=b"s" * 256)
    full, relative = group_answer(now), group_answer(now, last, last.digest)
    assert len(msgpack.packb(full)) > 200_000 and len(msgpack.packb(relative)) < 800  # O(N) against O(changes)
    # the whole group is past any other message's header limit, and within a group answer's
    assert wire.MAX_HEADER_BYTES < len(msgpack.packb(full)) < MAX_GROUP_HEADER
    as_given = parse_group(decode(JoinAnswer, relative).on(last), 5, "params", peers[1], MAX_REDUCERS)
    assert as_given == parse_group(decode(JoinAnswer, full).on(None), 5, "params", peers[1], MAX_REDUCERS)
    assert as_given.tokens_of()[peers[7]] == 5120 and as_given.reducers(S) == now.reducers(S)
    assert peers[-1] not in as_given.reducers(S)  # the dial-out joiner
    # Relative to a group this joiner does not follow, it is refused: the coordinator went by another one.
    with pytest.raises(PayloadError, match="relative to another group"):
        decode(JoinAnswer, relative).on(now)
    with pytest.raises(PayloadError, match="relative to another group"):
        decode(JoinAnswer, relative).on(None)


def test_a_joiner_that_follows_another_version_of_the_coordinators_group_is_answered_in_full():
    """A hostile coordinator gave this joiner a version of group "last" in which C's contribution weighs 2**40
    tokens, and the other members the honest one. Named by its id, the next (honest) coordinator answered relative
    to its own version, left C's unchanged entry out, and the joiner kept the hostile weight. Named by its digest,
    the versions differ: the answer lists every member, and the joiner ends with the honest coordinator's tokens."""
    members = (A, B, C, D)

    def version(tokens_of_c):
        return Group("last", 4, "params", members, D, 0, tuple((p, (S,)) for p in members),
                     tokens=tuple((p, tokens_of_c if p == C else 10240) for p in members))

    hostile, honest = version(1 << 40), version(10240)
    now = Group("now", 5, "params", members, A, 0, tuple((p, (S,)) for p in members),
                tokens=tuple((p, 10240) for p in members), grant=b"signed")
    assert hostile.digest != honest.digest and honest.digest == version(10240).digest
    _, _, joiner = parse_join({**JOIN, "follows": hostile.digest})
    answer = decode(JoinAnswer, group_answer(now, honest, joiner.follows))
    assert not answer.base and answer.peers == list(members)
    assert parse_group(answer.on(hostile), 5, "params", A, MAX_REDUCERS).tokens_of()[C] == 10240
    # The answer relative to the honest version leaves C out as unchanged; on the hostile version it is refused.
    relative = decode(JoinAnswer, group_answer(now, honest, honest.digest))
    assert relative.base == honest.digest and C not in relative.changed
    assert (parse_group(relative.on(honest), 5, "params", A, MAX_REDUCERS)
            == parse_group(answer.on(None), 5, "params", A, MAX_REDUCERS))
    with pytest.raises(PayloadError, match="relative to another group \\(or version of it\\)"):
        relative.on(hostile)


def test_a_large_group_draws_at_most_max_reducers_of_its_dialable_holders_by_its_id():
    peers = tuple(sorted(f"peer{i:03d}" for i in range(3 * MAX_REDUCERS)))

    def drawn(group_id, passive=()):
        return Group(group_id, 5, "params", peers, peers[0], 0, tuple((p, (S,)) for p in peers),
                     tokens=tuple((p, 1) for p in peers), dial_out=peers[::2], passive=passive)

    reducers = drawn("g1").reducers(S)
    assert len(set(reducers)) == MAX_REDUCERS and reducers == tuple(sorted(reducers))
    assert not set(reducers) & set(peers[::2])  # none that only dials out
    assert drawn("g1").reducers(S) == reducers  # every member holding the group draws alike
    assert drawn("g2").reducers(S) != reducers  # another group draws anew
    # ... but a redo only from those its first attempt drew: the members an attempt refused reduce nothing in it,
    # and no hostile key left undrawn gets its turn in the redo
    assert drawn("g1").among("redo", peers, peers[0], passive=reducers[:3]).reducers(S) == reducers[3:]
    assert not set(drawn("g1", passive=reducers[:3]).reducers(S)) & set(reducers[:3])
    assert drawn("g1").contributors(S) == peers  # every member still contributes to every span
    small = Group("g", 5, "params", peers[:MAX_REDUCERS], peers[0], 0,
                  tuple((p, (S,)) for p in peers[:MAX_REDUCERS]), tokens=tuple((p, 1) for p in peers[:MAX_REDUCERS]))
    assert small.reducers(S) == peers[:MAX_REDUCERS]



def test_a_run_that_sets_max_reducers_draws_that_many_and_its_groups_say_so():
    peers = tuple(sorted(f"peer{i:03d}" for i in range(40)))

    def group(max_reducers):
        return Group("g1", 5, "params", peers, peers[0], 0, tuple((p, (S,)) for p in peers),
                     tokens=tuple((p, 1) for p in peers), max_reducers=max_reducers)

    eight = group(8)
    # the same hash order draws both: the run's 8 are the lowest 8 of the default's 32
    assert len(set(eight.reducers(S))) == 8 and set(eight.reducers(S)) < set(group(MAX_REDUCERS).reducers(S))
    assert eight.digest != group(MAX_REDUCERS).digest  # a group of another run's draw is another version
    redo = eight.among("redo", peers, peers[0], passive=eight.reducers(S)[:2])
    assert redo.max_reducers == 8 and redo.reducers(S) == eight.reducers(S)[2:]

def test_group_vote_and_decision_parsers_refuse_what_an_honest_peer_never_sends():
    answer = {"status": "group", "group_id": "g", "peers": [A, B], "holdings": {A: [S], B: [S]}, "pipelines": {},
              "left_out": {C: "it did not join within 20 s"}, "tokens": {A: 3000, B: 1000}, "dial_out": [B],
              "grant": b"signed"}
    group = parse_group(decode(JoinAnswer, answer), 1, "params", A, MAX_REDUCERS)
    assert group.holders(S) == (A, B) and group.without() == "peerC (it did not join within 20 s)"
    assert group.reducers(S) == (A,) and group.tokens_of() == {A: 3000, B: 1000}
    for bad in ({**answer, "peers": []}, {**answer, "peers": [B, A]},  # empty, not in canonical order
                {**answer, "holdings": {A: [S]}}, {**answer, "holdings": {A: [S], B: []}},  # B's slices not given
                {**answer, "holdings": {A: [S], B: [S], C: [S]}, "held": [S]},  # a non-member's slices
                {**answer, "pipelines": {"intruder": "g0"}}, {**answer, "left_out": {A: "a member"}},
                {**answer, "left_out": {C: 3}}, {**answer, "status": "grouped"}, {**answer, "status": ["group"]},
                {**answer, "tokens": {A: 3000}}, {**answer, "tokens": {A: 3000, B: -1}},  # a member of negative weight
                {**answer, "tokens": {A: 3000, C: 1}, "trained": 1000},  # a non-member's tokens
                {**answer, "dial_out": [C]},  # a non-member behind a NAT
                {**answer, "grant": b""},  # a group its coordinator did not sign
                {"status": "redirect"}):
        with pytest.raises(PayloadError, match="^JoinAnswer: "):
            decode(JoinAnswer, bad)
    relative = {"status": "group", "group_id": "h", "base": "g", "changed": {}, "removed": [], "left_out": {},
                "grant": b"signed"}
    for bad in ({**relative, "peers": [A]}, {**relative, "status": "late"},  # a relative answer lists no member
                {**relative, "changed": {C: {"holdings": [], "pipeline": "", "tokens": 1, "dial_out": False}}}):
        with pytest.raises(PayloadError, match="^JoinAnswer: "):
            decode(JoinAnswer, bad)
    vote = {"group_id": "g", "version": "f" * 64, "vote": "holds", "drops": [B], "refused": [], "refused_by": []}
    pieces = wire.pack([[S, 0, 10, 1, b"d" * 32, b"s" * 256]])
    parsed, entries = parse_vote(vote, pieces)
    assert (parsed.group_id, parsed.vote, parsed.drops, entries) == ("g", Vote.HOLDS, [B], [(S, 0, 10, 1, b"d" * 32,
                                                                                                b"s" * 256)])
    with pytest.raises(PayloadError, match="VoteRequest: vote: Value error, not one of holds, missing, dropped"):
        parse_vote({**vote, "vote": "maybe"}, pieces)
    with pytest.raises(PayloadError, match="VoteRequest: version: String should match pattern"):
        parse_vote({**vote, "version": "g"}, pieces)
    for bad, message in ((wire.pack([[S, 0, 10, 1, "d", b"s"]]), "pieces.0.4: Input should be a valid bytes"),
                         (wire.pack([[S, 10, 0, 1, b"d", b"s"]]), "a piece that ends before it starts"),
                         (wire.pack([[S, 0, 10, 1, b"d", b"s" * 600]]), "pieces.0.5: Data should have at most 512"),
                         (wire.pack({"a": 1}), "pieces: Input should be a valid list"), (b"\xc1", "not valid msgpack")):
        with pytest.raises(PayloadError, match=message):
            parse_vote(vote, bad)
    with pytest.raises(PayloadError, match="outside the round's group"):
        parse_decision({"outcome": "redo", "group_id": "h", "peers": ["intruder"], "reason": "", "grant": b"s"},
                       GROUP, A)
    with pytest.raises(PayloadError, match="a redo without the survivors' signed group"):
        parse_decision({"outcome": "redo", "group_id": "h", "peers": [A, B], "reason": ""}, GROUP, A)
    assert parse_decision({"outcome": "commit", "digests": {S: "d"}, "reason": ""}, GROUP, A).digests == {S: "d"}
    with pytest.raises(PayloadError, match="DecisionAnswer: reason: Field required"):
        parse_decision({"outcome": "abort", "digests": {}}, GROUP, A)


def test_a_reducer_that_signed_two_results_for_one_piece_is_proven_and_a_voter_naming_an_unsigned_one_lies():
    """Two members hold different results of one piece, each signed by the piece's reducer X: a proof against X that
    anyone checks with X's key. A third names a result X did not sign: its vote does not count, and X is not
    accused by it (a proof needs X's own signatures)."""
    signer = Signer(RSAPrivateKey())
    X = owner_of(signer.public_key)
    four = group((A, B, C, X))

    def signed(digest):
        return Evidence(S, range(0, 10), X, digest, signer.sign(result_statement("run", four.digest, S, 0, 10,
                                                                                   digest)))

    keys = {X: signer.public_key}.get
    votes = {A: Cast(Vote.HOLDS, evidence=(signed(b"1" * 32),)), B: Cast(Vote.HOLDS, evidence=(signed(b"2" * 32),)),
             C: Cast(Vote.HOLDS, evidence=(Evidence(S, range(0, 10), X, b"3" * 32, b"forged"),))}
    proofs, liars = examine("run", four, votes, keys)
    assert [p.accused for p in proofs] == [X] and proofs[0].claim == Claim.RESULT and liars == {C}
    assert proofs[0].holds("run") and not proofs[0].holds("another run")
    assert not proofs[0].model_copy(update={"accused": A}).holds("run")  # X's key is no other peer's
    # one result, one signature each: nobody is accused, and no honest reducer can be framed
    assert examine("run", four, {A: votes[A], B: Cast(Vote.HOLDS, evidence=(signed(b"1" * 32),))}, keys) == ([], set())
    _, liars = examine("run", four, {A: votes[A], C: votes[C]}, keys)
    assert liars == {C}


def test_a_coordinator_that_asks_for_a_second_redo_is_not_followed():
    """Members redo a round once: a coordinator answering "redo" forever used to keep its group redoing."""
    redo = {"outcome": "redo", "group_id": "h", "peers": [A, B], "reason": "again", "grant": b"signed"}
    assert parse_decision(redo, GROUP, A).redo.attempt == 1
    with pytest.raises(PayloadError, match="a second redo of one round"):
        parse_decision(redo, group(attempt=1), A)


def test_junk_groups_of_one_peer_never_push_another_peers_group_out_of_the_book():
    """33 junk formations used to push the real group out of a 32-group book, and every vote for it failed. A
    group is kept while it is among the latest few of one of its members: the junk only ages the junker's own."""
    book = GroupBook()
    real = group((A, B, C))
    book.add(real, (5, "params", "cfg", "s"))
    for i in range(1000):
        book.add(Group(f"junk{i}", 5, "params", (D,), D), (5, "params", "cfg", f"made-up{i}"))
    assert book.get(real.group_id) == real and book.closed((5, "params", "cfg", "s")) == real
    assert book.get("junk0") is None and book.get("junk999") is not None
    assert len(book.formations()) <= 1 + KEEP_PER_PEER


def test_a_peers_text_reaches_the_log_escaped_bounded_and_in_one_line(caplog):
    """A coordinator's reason and the keys of a malformed message are anyone's: what a node logs of them can neither
    drive a terminal (ANSI escapes), nor forge a log line (line breaks), nor run on for pages."""
    hostile = "\x1b[2J\x1b[31mevery peer is banned\n12:00:00 WARNING p2ploco: a forged line\u202e" + "x" * 5000
    decision = parse_decision({"outcome": "abort", "digests": {}, "reason": hostile}, GROUP, A)
    assert decision.reason.startswith("\\x1b[2J\\x1b[31mevery peer is banned\\n12:00:00 WARNING p2ploco: a forged "
                                      "line\\u202exxx")
    assert decision.reason.isprintable() and len(decision.reason) == MAX_REASON
    vote = {"group_id": "g", "version": "f" * 64, "vote": "holds", "drops": [], "refused": [], "refused_by": []}
    with pytest.raises(PayloadError) as malformed:
        parse_vote(vote, wire.pack([["\x1b[2J\n" * 10, 0, 1, 0, b"d", b"s"]]))
    with caplog.at_level(logging.WARNING, logger="p2ploco.swarm.bans"):
        Bans(rounds=3).ban(B, 10, str(malformed.value))
    logged = caplog.records[-1].getMessage()
    assert logged.endswith(": VoteEvidence: pieces.0.0: String should have at most 32 characters")
    assert logged.isprintable()
    # a peer id is base58 text, whose tail a node logs: one with a terminal's escape in it is no peer id
    with pytest.raises(PayloadError, match="^VoteRequest: drops.0: String should match pattern"):
        parse_vote({**vote, "drops": ["\x1b[2J"]}, wire.pack([]))
