"""Catching up: which state to follow, and fetching it from several real donors (one of them stalled)."""

import asyncio
import hashlib
import logging
import math
import os
import random
import signal
import time

import pytest
import torch
from helpers import join_swarms
from hivemind.utils import ValueWithExpiration, get_dht_time
from safetensors.torch import save as save_tensors

from p2ploco import faults
from p2ploco.config import SwarmConfig
from p2ploco.errors import PayloadError, SwarmError
from p2ploco.metrics import state_digest
from p2ploco.swarm import state as state_module
from p2ploco.swarm import state_server
from p2ploco.swarm.bans import Bans
from p2ploco.swarm.consensus import (
    SwarmState,
    contested,
    plurality,
    ranked_states,
    ranking,
    round_state,
    settled,
    swarm_state,
    tally,
)
from p2ploco.swarm.directory import (
    FOREIGN_NAMED,
    KEY_READS,
    LOOKUPS_PER_ROUND,
    WATCHES_PER_HEARTBEAT,
    PeerDirectory,
    payload_bytes,
)
from p2ploco.swarm.records import PeerRecord, Phase, Reachability, RecordKeys
from p2ploco.swarm.state import BytesBlob, Snapshot
from p2ploco.swarm.state_fetch import MAX_DONORS, choose_donors
from p2ploco.sync.admission import admit
from p2ploco.sync.group import Member

CONFIG = SwarmConfig(matchmaking_timeout=5, allreduce_timeout=2, heartbeat_interval=0.5, peer_ttl=10)


S = "stage0"  # the one slice of a model not cut into stages


def record(peer, round_index, digest, state="training", fingerprint="cfg", slices=None):
    return PeerRecord(peer_id=peer, round=round_index, state=state, fingerprint=fingerprint, params_digest=digest,
                      slices=slices if slices is not None else ({S: digest} if digest else {}))


def test_a_state_digest_is_one_value_whatever_the_threads_and_moves_with_any_value_name_or_shape():
    """BLAKE3 spreads a large state over the torch threads: a 20 MB tensor gives one digest on 1 and on 2 threads, and
    the digest moves with its last value, a shared tensor's value, a name, or a shape that holds the same bytes."""
    generator = torch.Generator().manual_seed(0)
    params = {"embed": torch.randn(5 << 20, generator=generator), "bias": torch.randn(7, generator=generator)}
    shared = {"momentum.bias": torch.randn(7, generator=generator)}
    threads = torch.get_num_threads()
    try:
        digests = []
        for count in (1, 2):
            torch.set_num_threads(count)
            digests.append(state_digest(params, shared))
    finally:
        torch.set_num_threads(threads)
    assert digests[0] == digests[1]
    last = params["embed"].clone()
    last[-1] += 1.0
    changed = [state_digest({**params, "embed": last}, shared),
               state_digest(params, {"momentum.bias": shared["momentum.bias"] + 1.0}),
               state_digest({"embedding": params["embed"], "bias": params["bias"]}, shared),
               state_digest({**params, "embed": params["embed"].view(5, 1 << 20)}, shared)]
    assert len({digests[0], *changed}) == 5


def test_only_states_two_peers_vouch_for_are_followed():
    me = record("m", 3, "old")
    live = {r.peer_id: r for r in [record("a", 5, "x"), record("b", 5, "x"), record("c", 5, "y"),
                                   record("d", 9, "z", state="leaving"), record("e", 9, "z", fingerprint="other"),
                                   record("f", 4, "w"), record("g", 9, "", state="joining"),
                                   record("liar", 10**6, "forged")]}
    target = swarm_state(live, me, S)  # the state most peers hold, whatever round others claim
    assert (target.round, target.slice, target.state_digest, target.holders) == (5, S, "x", ("a", "b"))
    assert swarm_state({}, me, S) is None
    tie = {r.peer_id: r for r in [record("a", 5, "x"), record("c", 5, "y")]}
    assert swarm_state(tie, record("m", 5, "x"), S).holders == ("a", "m")  # my own state, vouched by "a"
    assert swarm_state(tie, record("m", 2, "q"), S) is None  # nobody agrees with anybody: nothing is vouched
    # Then every lone claim is ranked (furthest round, most holders, larger hash) for the caller to probe.
    ranked = ranked_states(tie, record("m", 2, "q"), S)
    assert [(s.round, s.state_digest, s.vouched) for s in ranked] == [(5, "y", False), (5, "x", False),
                                                                     (2, "q", False)]


def test_a_seeds_state_has_no_say_where_anyone_else_holds_the_slice():
    """Two newcomer stages of one slice moved to their groups' round 68 with the seed's state; the only other holder
    is a replica at round 68 whose last round was alone (unsettled). The seed's state, held by two settled records,
    ranked first, and their groups trained on it: the replica's trained slice is what they follow instead."""
    replica = record("replica", 68, "trained").model_copy(update={"unsettled": True})
    other_newcomer, newcomer = record("other", 68, "seed"), record("new", 68, "seed")
    live = {"replica": replica, "other": other_newcomer}
    assert ranked_states(live, newcomer, S)[0].state_digest == "seed"  # what they followed
    ranked = ranked_states(live, newcomer, S, seed="seed")
    assert [(s.state_digest, s.holders) for s in ranked] == [("trained", ("replica",))]
    assert ranked_states({"other": other_newcomer}, newcomer, S, seed="seed")[0].state_digest == "seed"  # run start


def test_records_that_claim_a_round_ahead_of_everyone_do_not_move_the_swarm():
    """One attacker with two keys publishes two records of round 10**6 holding its own state: the state three
    training peers hold wins (it used to be the furthest round any two records agreed on, which every joiner then
    fetched from the attacker). While the three move to the next round, a tie goes to the earlier round."""
    honest = [record(p, 5, "x") for p in "abc"]
    liars = [record(p, 10**6, "forged") for p in ("liar1", "liar2")]
    live = {r.peer_id: r for r in honest + liars}
    joiner = record("new", 0, "init")
    assert [(s.round, s.state_digest) for s in ranked_states(live, joiner, S)][:2] == [(5, "x"), (10**6, "forged")]
    moving = {**live, "a": record("a", 6, "x6"), "b": record("b", 6, "x6")}
    assert swarm_state(moving, joiner, S).state_digest == "x6"  # 2 against 2: the earlier round wins the tie
    moving["c"] = record("c", 6, "x6")
    assert swarm_state(moving, joiner, S).state_digest == "x6"


def test_states_are_followed_per_slice_and_the_round_state_combines_them():
    # a full replica holds both slices; stage peers one each, one of them a round behind
    full = record("full", 5, "all", slices={"stage0": "x0", "stage1": "x1"})
    live = {r.peer_id: r for r in [full, record("s0", 5, "x0", slices={"stage0": "x0"}),
                                   record("s1", 4, "old", slices={"stage1": "old"}),
                                   record("t1", 5, "x1", slices={"stage1": "x1"})]}
    joiner = record("new", 0, "init", slices={"stage1": "init"})
    target = swarm_state(live, joiner, "stage1")
    assert (target.round, target.state_digest, target.holders) == (5, "x1", ("full", "t1"))
    assert swarm_state(live, joiner, "stage0").holders == ("full", "s0")  # holders of each slice, whoever asks
    digest, chosen = round_state(live, full, 5)
    assert chosen == {"stage0": "x0", "stage1": "x1"}  # s1 is at round 4: not counted for round 5
    assert round_state(live, record("s0", 5, "x0", slices={"stage0": "x0"}), 5)[0] == digest  # every view alike
    assert round_state(live, full, 4)[1] == {"stage1": "old"}


def test_a_banned_peer_does_not_vote_on_the_state_a_round_starts_from():
    # The others still show the previous round; the banned peer, left out of it, shows its old state at this one.
    me = record("m", 5, "applied")
    live = {r.peer_id: r for r in [record("x", 5, "stale"), record("b", 4, "before")]}
    assert round_state(live, me, 5)[1] == {S: "stale"}  # a tie, and "stale" wins it on the hash
    assert round_state(live, me, 5, banned={"x"})[1] == {S: "applied"}
    assert contested(live, me, 5) and not contested(live, me, 5, banned={"x"})


def test_a_peer_that_missed_its_last_round_has_no_say_on_the_swarms_state():
    """b applied nothing in its last round (it was alone, or its decision never came) while a committed it: at the
    next round they hold different states, and a's wins whatever the hashes, for the round's formation (the
    coordinator keeps the members that hold it) and for the state b catches up to alike. With nobody settled,
    the hash decides, as it does for every peer with the same view."""
    a, b = record("a", 5, "aaa"), record("b", 5, "zzz").model_copy(update={"unsettled": True})
    live = {"a": a, "b": b}
    for me in (a, b):
        assert round_state(live, me, 5)[1] == {S: "aaa"}
        assert [s.state_digest for s in ranked_states(live, me, S)] == ["aaa", "zzz"]
    members = {"a": Member(((S, ("fp", "aaa")),)), "b": Member(((S, ("fp", "zzz")),))}
    assert set(admit(members, 1, round_state(live, b, 5)[1])[0]) == {"a"}
    # Two unsettled peers vouch for the stale state together, and still lose to the one that applied the round.
    c = record("c", 5, "zzz").model_copy(update={"unsettled": True})
    assert [s.state_digest for s in ranked_states({**live, "c": c}, b, S)] == ["aaa", "zzz"]
    assert round_state({**live, "c": c}, b, 5)[1] == {S: "aaa"}
    # Nobody settled: the greater hash, the same for both.
    unsure = {"a": a.model_copy(update={"unsettled": True}), "b": b}
    assert round_state(unsure, unsure["a"], 5)[1] == round_state(unsure, b, 5)[1] == {S: "zzz"}


def test_one_vote_rule_ranks_by_firm_ballots_then_ballots_then_value():
    """The rule ``round_state``, ``admit`` and ``commit.decide`` share: firm voters first, then
    every ballot, then the greater value; a commit's strict majority counts its abstainers."""
    ballots = [("a", True), ("z", False), ("z", False), ("m", True)]
    assert ranking(tally(ballots)) == ["m", "a", "z"]  # one firm ballot beats two others; "m" > "a"
    assert plurality(ballots) == "m"
    assert plurality([]) is None
    assert plurality([("x", True), ("x", True), ("y", True)], electorate=3) == "x"
    assert plurality([("x", True), ("x", True), ("y", True)], electorate=4) is None  # 2 of 4 is no majority
    assert plurality([("x", True), ("y", True)]) == "y"  # a tie goes to the greater value, on every peer
    # Catching up across rounds: among equal tallies a vouched state of the earlier round, a lone claim's later one.
    order = ranking(tally([((6, "b"), True), ((6, "b"), True), ((5, "a"), True), ((5, "a"), True), ((9, "c"), True),
                           ((8, "d"), True)]), order=lambda s, t: (-s[0] if t.total >= 2 else s[0], s[1]))
    assert order == [(5, "a"), (6, "b"), (9, "c"), (8, "d")]


ONE_KEY = RecordKeys(("run/peers",))  # the records of these tests' runs, under one DHT key


class _FakeNode:
    """Stores and lookups of one DHT key, in memory."""

    def __init__(self):
        self.stored = {}

    async def store(self, key, subkey, value, expiration_time):
        self.stored.setdefault(key, {})[subkey] = ValueWithExpiration(value, expiration_time)
        return True

    async def get_many(self, keys, sufficient_expiration_time=None):
        return {key: ValueWithExpiration(dict(self.stored.get(key, {})), get_dht_time() + 10) for key in keys}


class _CountingNode(_FakeNode):
    """A _FakeNode that lists the keys of every lookup, and when each began."""

    def __init__(self):
        super().__init__()
        self.reads, self.began = [], []

    async def get_many(self, keys, sufficient_expiration_time=None):
        self.reads.append(tuple(keys))
        self.began.append(time.monotonic())
        return await super().get_many(keys, sufficient_expiration_time)


def test_the_directory_counts_the_record_bytes_it_stores_and_reads():
    node = _FakeNode()
    me = record("m", 3, "x")
    directory = PeerDirectory(node, RecordKeys(("p2ploco/run/peers",)), b"owner", me, 1.0, 10.0, run_id="run")

    async def heartbeat():
        assert directory.dht_bytes == (0, 0)
        await directory.store_record(list_run=True)
        sent = payload_bytes(b"owner", me.to_value()) + payload_bytes("run", {"version": me.version})
        assert directory.dht_bytes == (sent, 0)
        await directory.refresh()
        assert directory.dht_bytes == (sent, payload_bytes(b"owner", me.to_value()))
        await directory.store_record()
        assert directory.dht_bytes[0] == sent + payload_bytes(b"owner", me.to_value())

    asyncio.run(heartbeat())


def test_a_peer_the_view_lacks_is_looked_up_under_its_record_key_alone_and_a_key_a_few_times_a_heartbeat():
    """A joiner named in a group, or asking a coordinator to join, is read from the one record key its id hashes
    to: ~N / keys records, where a whole lookup reads all N. Anyone can name made-up peers: however many ask at
    once, a key is read once, and at most KEY_READS times a heartbeat."""
    node, keys = _CountingNode(), RecordKeys(tuple(f"run/peers/{i}" for i in range(4)))
    me, others = record("m", 0, "x"), [record(f"p{i:02d}", 0, "x") for i in range(40)]
    for r in [me, *others]:
        node.stored.setdefault(keys.of(r.peer_id), {})[r.peer_id] = ValueWithExpiration(r.to_value(),
                                                                                        get_dht_time() + 60)
    heartbeat = 0.2
    directory = PeerDirectory(node, keys, b"owner", me, heartbeat, 10.0)
    joiner = others[7].peer_id
    under_its_key = {r.peer_id for r in [me, *others] if keys.of(r.peer_id) == keys.of(joiner)}
    neighbours = sorted(under_its_key - {joiner, "m"})

    async def looks() -> None:
        views = await asyncio.gather(*(directory.look_up([peer]) for peer in [joiner, *neighbours]))
        assert all(joiner in view for view in views) and node.reads == [(keys.of(joiner),)]
        assert set(directory.live) == under_its_key | {"m"} and len(under_its_key) < len(others) / 2
        assert directory.dht_bytes[1] == sum(payload_bytes(p, r.to_value()) for r in [me, *others]
                                             if (p := r.peer_id) in under_its_key)
        assert directory.refreshed_at == -math.inf  # no whole lookup happened
        for _ in range(KEY_READS):  # each asked after the last read began: read again, the last a heartbeat on
            await directory.look_up([joiner])
        assert node.reads == [(keys.of(joiner),)] * (KEY_READS + 1)
        assert node.began[KEY_READS] - node.began[0] >= heartbeat
        assert set(await directory.refresh()) == {r.peer_id for r in [me, *others]}

    asyncio.run(looks())


def test_a_whole_lookup_that_ends_after_a_key_read_keeps_what_the_read_found():
    """A member checks its group's members against its view, and reads the key of one it lacks (a joiner): the
    heartbeat's whole lookup, begun before the joiner stored its record and answered after the read, put the view
    back as it was before the read: the member no longer knew the joiner, waited a heartbeat to look again, and its
    contributions came too late for the reducers (the simulation of 256 peers: a redo of the whole group). Nor does
    that older answer take back a renewal the read found."""
    keys = RecordKeys(tuple(f"run/peers/{i}" for i in range(4)))
    me, old = record("m", 0, "x"), record("p00", 0, "x")
    joiner = next(f"j{i}" for i in range(100) if keys.of(f"j{i}") == keys.of(old.peer_id))
    stored_at = get_dht_time()

    class HeldNode(_FakeNode):
        """Answers a whole lookup with what it held when asked, once ``answer`` is set; a key read at once."""

        async def get_many(self, keys_read, sufficient_expiration_time=None):
            found = await super().get_many(keys_read, sufficient_expiration_time)
            if len(keys_read) > 1:
                await answer.wait()
            return found

    node = HeldNode()
    for r in (me, old):
        node.stored.setdefault(keys.of(r.peer_id), {})[r.peer_id] = ValueWithExpiration(r.to_value(), stored_at + 60)
    directory = PeerDirectory(node, keys, b"owner", me, 1.0, 10.0)

    async def race() -> None:
        nonlocal answer
        answer = asyncio.Event()
        answer.set()
        assert set(await directory.refresh()) == {"m", old.peer_id}
        answer.clear()
        whole = asyncio.ensure_future(directory.refresh())
        await asyncio.sleep(0)  # the whole lookup has asked
        for r in (record(joiner, 0, "x"), record(old.peer_id, 1, "x")):  # a joiner's first record, a renewal
            node.stored[keys.of(joiner)][r.peer_id] = ValueWithExpiration(r.to_value(), stored_at + 70)
        found = await directory.look_up([joiner])
        assert joiner in found and found[old.peer_id].round == 1
        answer.set()
        view = await whole
        assert joiner in view and view[old.peer_id].round == 1
        assert joiner in directory.live and directory.live[old.peer_id].round == 1

    answer = None
    asyncio.run(race())


def test_a_member_whose_record_lapsed_in_the_view_is_looked_up_with_the_joiners_not_a_heartbeat_later():
    """The view keeps a lapsed record until its next heartbeat or read: a group check that counted such a member
    as known looked up a joiner first, that read dropped the lapsed member from the view, and the check waited a
    heartbeat to look it up (11 s late in the simulation of 256 peers: a redo of the whole group)."""
    node = _FakeNode()
    me, member = record("m", 0, "x"), record("p0", 0, "x")
    node.stored["run/peers"] = {"m": ValueWithExpiration(me.to_value(), get_dht_time() + 60),
                                "p0": ValueWithExpiration(member.to_value(), get_dht_time() + 0.3)}
    directory = PeerDirectory(node, ONE_KEY, b"owner", me, 10.0, 10.0)

    async def check() -> None:
        assert set(await directory.refresh()) == {"m", "p0"} and directory.lacks(["m", "p0", "j"]) == {"j"}
        await asyncio.sleep(0.4)  # p0's record lapses; p0 renews it, and a joiner stores its first
        assert "p0" in directory.live and directory.lacks(["m", "p0", "j"]) == {"p0", "j"}
        # a group's check counts a record seen live within the formation's bound: all members at once reading every
        # key in a first round of 2,048 was more than the keys' replicas could answer in a record's life
        assert directory.lacks(["m", "p0", "j"], lapsed_within=10.0) == {"j"}
        for r in (member, record("j", 0, "x")):
            node.stored["run/peers"][r.peer_id] = ValueWithExpiration(r.to_value(), get_dht_time() + 60)
        await directory.look_up(directory.lacks(["m", "p0", "j"]))
        assert directory.lacks(["m", "p0", "j"]) == set()

    asyncio.run(check())


@pytest.mark.parametrize("peers", [4, 16, 64])
def test_a_peer_that_follows_its_group_reads_about_as_many_records_per_round_whatever_the_swarm_size(peers):
    node = _FakeNode()
    me, others = record("m", 0, "x"), [record(f"p{i}", 0, "x") for i in range(peers - 1)]
    for r in [me, *others]:  # N records under the run's key, this peer's own included
        node.stored.setdefault("run/peers", {})[r.peer_id] = ValueWithExpiration(r.to_value(), get_dht_time() + 60)
    directory = PeerDirectory(node, ONE_KEY, b"owner", me, 1.0, 10.0)
    one_record = payload_bytes(others[0].peer_id, others[0].to_value())

    async def rounds() -> list[int]:
        await directory.view()  # a peer that follows no group looks
        assert directory.watching and set(directory.live) == {r.peer_id for r in others} | {"m"}
        directory.follow([r.peer_id for r in others], vouched=[r.peer_id for r in others], coordinator="p0")
        assert not directory.watching  # the heartbeat only stores ...
        directory.watchers.add(asyncio.Event())
        assert directory.watching  # ... unless a formation this peer coordinates waits on its lookups
        directory.watchers.clear()
        read = []
        for round_index in range(1, 33):
            directory.update_soon(round=round_index)
            before = directory.dht_bytes[1]
            view = await directory.view()
            assert set(view) == {r.peer_id for r in others} | {"m"}
            read.append(directory.dht_bytes[1] - before)
        return read

    read = asyncio.run(rounds())
    # Every round one record's worth is read on average when 4 peers each look every round, 16 peers every 4th,
    # 64 peers every 16th: LOOKUPS_PER_ROUND records per round whatever N, and every peer still looks now and then.
    assert sum(read) / len(read) == pytest.approx(LOOKUPS_PER_ROUND * one_record, rel=0.05)
    assert sum(1 for b in read if b) == len(read) * LOOKUPS_PER_ROUND // peers
    directory.follow(())
    assert directory.watching


@pytest.mark.parametrize("peers", [WATCHES_PER_HEARTBEAT, 3 * WATCHES_PER_HEARTBEAT])
def test_a_peer_that_follows_no_group_looks_every_heartbeat_in_a_small_run_and_now_and_then_in_a_large_one(peers):
    """In a run's first round no peer follows a group: had each looked up all N records every heartbeat, a record
    key's replicas would send N^2 / keys records a heartbeat (at 2,048 simulated peers, longer than a record lives:
    views emptied). Each looks once every ceil(N / WATCHES_PER_HEARTBEAT) heartbeats, and its join still acts on a
    view no older than the records' fresh window."""
    heartbeats, period = 12, math.ceil(peers / WATCHES_PER_HEARTBEAT)

    class Node(_CountingNode):
        stores = 0

        async def store(self, key, subkey, value, expiration_time):
            if subkey == b"owner":
                self.stores += 1
                if self.stores == heartbeats:
                    stored.set()
            return await super().store(key, subkey, value, expiration_time)

    node = Node()
    me = record("m", 0, "x")
    for r in [me, *(record(f"p{i}", 0, "x") for i in range(peers - 1))]:
        node.stored.setdefault("run/peers", {})[r.peer_id] = ValueWithExpiration(r.to_value(), get_dht_time() + 600)
    interval = 0.02
    directory = PeerDirectory(node, ONE_KEY, b"owner", me, interval, 6 * interval)  # fresh: 3 heartbeats

    async def run() -> None:
        assert len(await directory.refresh()) == peers
        directory.start_heartbeat()
        await stored.wait()  # the heartbeat's lookups begin with its store: those of `heartbeats` heartbeats are in
        assert len(node.reads) - 1 == heartbeats // period
        # a join acts on a view looked up within the fresh window, and looks afresh after it
        its_node = _CountingNode()
        its_node.stored = node.stored
        joiner = PeerDirectory(its_node, ONE_KEY, b"owner", record("j", 0, "x"), interval, 6 * interval)
        await joiner.refresh()
        await joiner.view()
        assert len(its_node.reads) == 1
        await asyncio.sleep(3 * interval)
        await joiner.view()
        assert len(its_node.reads) == 2

    stored = asyncio.Event()
    asyncio.run(run())


def test_peers_of_other_configs_are_named_once_each_as_they_come_into_view_and_never_more_than_a_few(caplog):
    """Nodes of an older p2ploco (another protocol version) or another model join the run's key without training
    with this node: it says so in one line when each config first comes into view, not only when it joins, and
    records anyone can publish under as many fingerprints as they like cannot flood its log."""
    node, me = _FakeNode(), record("m", 0, "x")
    directory = PeerDirectory(node, ONE_KEY, b"owner", me, 1.0, 10.0, run_id="run")

    def publish(*records: PeerRecord) -> None:
        for r in records:
            node.stored.setdefault("run/peers", {})[r.peer_id] = ValueWithExpiration(r.to_value(), get_dht_time() + 60)

    def named() -> list[str]:
        return [m.getMessage() for m in caplog.records if "has peers of another config" in m.getMessage()]

    async def looks() -> None:
        publish(me, record("a", 0, "x"))
        await directory.refresh()
        assert named() == []  # one config: nothing to say
        publish(record("old", 0, "x", fingerprint="older"))
        await directory.refresh()
        await directory.refresh()
        assert len(named()) == 1 and "fingerprint older, yours cfg" in named()[0] and "protocol version" in named()[0]
        publish(*(record(f"junk{i}", 0, "x", fingerprint=f"junk{i:02d}") for i in range(40)))
        await directory.refresh()
        assert len(named()) == 2 and named()[1].count("junk") == FOREIGN_NAMED - 1
        publish(record("late", 0, "x", fingerprint="another"))
        await directory.refresh()
        assert len(named()) == 2

    with caplog.at_level(logging.WARNING, logger="p2ploco.swarm.directory"):
        asyncio.run(looks())


def _following_directory(peers: int) -> tuple[PeerDirectory, list[str]]:
    """A directory whose lookups return ``peers`` records of round 0 (its own included), and the others' ids."""
    node = _FakeNode()
    others = [f"p{i:02d}" for i in range(peers - 1)]
    for peer in [*others, "m"]:
        node.stored.setdefault("run/peers", {})[peer] = ValueWithExpiration(record(peer, 0, "x").to_value(),
                                                                            get_dht_time() + 60)
    return PeerDirectory(node, ONE_KEY, b"owner", record("m", 0, "x"), 1.0, 10.0), others


async def _rounds_looked(directory: PeerDirectory, rounds: range) -> list[int]:
    """The rounds in ``rounds`` at which the directory's view is a fresh lookup."""
    looked = []
    for round_index in rounds:
        directory.update_soon(round=round_index)
        before = directory.refreshed_at
        await directory.view()
        if directory.refreshed_at != before:
            looked.append(round_index)
    return looked


def test_a_group_padded_with_members_that_delivered_nothing_is_followed_one_round_at_a_time():
    """A hostile coordinator names, beside its victim and itself, 15 Sybils that have records and no daemon: only a
    member that delivered this peer a contribution or an aggregate counts towards how long it goes without a
    lookup, so it looks every round (and meets the honest coordinators again) instead of every 4th."""
    directory, others = _following_directory(16)

    async def rounds() -> tuple[list[int], list[int]]:
        await directory.refresh()
        directory.follow(others, vouched=others, coordinator=others[0])  # an honest round: everyone delivered
        honest = await _rounds_looked(directory, range(1, 17))
        directory.follow(others, vouched=others[:1], coordinator=others[0])  # only the coordinator delivered
        return honest, await _rounds_looked(directory, range(17, 25))

    honest, padded = asyncio.run(rounds())
    assert len(honest) == 4 and padded == list(range(17, 25))
    assert directory.vouched == {others[0]}


def test_a_group_whose_coordinator_the_last_lookup_did_not_return_is_followed_one_round_before_a_lookup():
    """Every member delivered, but the coordinator (reached through a redirect to a peer outside this view) or a
    member is not in the last lookup: the next round looks, and then the group is followed as usual."""
    directory, others = _following_directory(16)

    async def rounds() -> tuple[list[int], list[int]]:
        await directory.refresh()
        directory.follow(others, vouched=others, coordinator="stranger")
        assert directory.doubted
        stranger = await _rounds_looked(directory, range(1, 17))
        directory.follow([*others, "ghost"], vouched=others, coordinator=others[0])  # a member the lookup lacks
        return stranger, await _rounds_looked(directory, range(17, 33))

    stranger, ghost = asyncio.run(rounds())
    # at once, then on its turns, every 4th round (this peer's id puts them at 2 mod 4)
    assert stranger == [1, 2, 6, 10, 14] and ghost == [17, 18, 22, 26, 30]
    assert not directory.doubted


def test_the_followed_group_stays_in_view_when_its_records_lapse_and_the_others_leave_it():
    node = _FakeNode()
    for peer in ("a", "b"):
        node.stored.setdefault("run/peers", {})[peer] = ValueWithExpiration(record(peer, 1, "x").to_value(),
                                                                            get_dht_time() + 0.2)
    directory = PeerDirectory(node, ONE_KEY, b"owner", record("m", 1, "x"), 1.0, 10.0)

    async def lapse() -> set[str]:
        await directory.refresh()
        assert set(directory.live) == {"a", "b", "m"}
        directory.follow(["a", "m"])
        assert directory.followed == {"a"}  # never itself
        await asyncio.sleep(0.3)
        return set(await directory.refresh())

    assert asyncio.run(lapse()) == {"a", "m"}


def test_a_record_stuck_in_the_past_does_not_hold_the_others_up():
    me = record("m", 4, "x")
    live = {r.peer_id: r for r in [record("a", 5, "x"), record("b", 5, "x"), record("stuck", 0, "old")]}
    assert settled(live, me, 4) and not settled(live, me, 5)
    assert not settled({"a": record("a", 4, "x"), "b": record("b", 4, "x"), "c": record("c", 5, "x")}, me, 4)
    assert settled({}, me, 4)


def test_fault_specs_parse_and_reject_typos():
    parsed = faults.parse("allreduce.contribute@3=kill, inner.step=stall:2.5,commit.vote@1=fail,"
                          "allreduce.reduce@2=fail:1")
    assert parsed[("allreduce.contribute", 3)] == faults.Fault("kill")
    assert parsed[("inner.step", None)] == faults.Fault("stall", 2.5)
    assert parsed[("commit.vote", 1)] == faults.Fault("fail") and parsed[("allreduce.reduce", 2)].times == 1
    for bad in ("nowhere@1=kill", "inner.step=explode", "inner.step=stall", "commit.vote=fail:0", "commit.vote=kill:2"):
        with pytest.raises(ValueError):
            faults.parse(bad)


@pytest.fixture(scope="module")
def donors_and_joiner():
    swarms = []
    try:
        join_swarms("state-test", 4, CONFIG, swarms)
        yield swarms[:3], swarms[3]
    finally:
        for s in swarms:
            s.leave()


def big_snapshot(round_index: int) -> Snapshot:
    generator = torch.Generator().manual_seed(round_index)
    params = {f"layer{i}.weight": torch.randn(512, 1024, generator=generator) for i in range(5)}  # 10 MB, 3 parts
    shared = {"momentum.0": torch.randn(64, generator=generator)}
    return Snapshot(round_index, S, params, shared, state_digest(params, shared))


def tensor_bytes(snapshot: Snapshot) -> int:
    return sum(t.numel() * t.element_size() for t in [*snapshot.params.values(), *snapshot.shared.values()])


def test_a_tensor_blob_is_the_safetensors_file_of_its_tensors_read_range_by_range_and_received_back():
    """A snapshot's blob, read from its tensors, is byte for byte what safetensors' own ``save`` writes (peers
    that serialized it whole describe the same manifest), any range of it reads as that file's range, its
    manifest hashes that file, and a receiver that writes the ranges into the tensors it allocated for the header
    gets the same state."""
    snapshot = big_snapshot(3)
    snapshot.params["bias"] = torch.randn(7)  # a tensor of an odd size: ranges end inside tensors
    snapshot.params["empty"] = torch.zeros(0)
    blob = snapshot.blob()
    whole = save_tensors({**{f"param/{k}": v for k, v in snapshot.params.items()},
                          **{f"shared/{k}": v for k, v in snapshot.shared.items()}})
    assert blob.total == len(whole) and blob.read(0, blob.total) == whole
    for offset, length in ((0, 5), (3, 100), (state_module.RANGE_BYTES - 3, 9), (len(whole) - 5, 100)):
        assert blob.read(offset, length) == whole[offset:offset + length]
    assert blob.manifest() == b"".join(hashlib.sha256(whole[at:at + state_module.RANGE_BYTES]).digest()
                                       for at in range(0, len(whole), state_module.RANGE_BYTES))
    received = state_module.TensorBlob.receive(whole[:state_module.PART_BYTES], len(whole))
    for at in reversed(range(0, len(whole), state_module.RANGE_BYTES)):  # ranges come in any order
        received.write(at, whole[at:at + state_module.RANGE_BYTES])
    fetched = Snapshot.of_blob(3, S, received)
    assert fetched.state_digest == state_digest(snapshot.params, snapshot.shared)


def test_the_round_before_is_served_from_the_next_ones_tensors_with_what_its_step_changed_put_back():
    """Once a later round is served, the earlier one (still served to a joiner that started on it) lets its
    tensors go where the step changed few of their elements: its bytes and manifest stay exactly its own."""
    earlier = big_snapshot(4)
    earlier.params["bias"] = torch.randn(7)
    later_params = {name: t.clone() for name, t in earlier.params.items()}
    flat = later_params["layer0.weight"].view(-1)
    flat[torch.arange(0, flat.numel(), 97)] += 1.0  # a sparse step: 1 % of one tensor
    later_params["layer1.weight"] = torch.randn(512, 1024)  # a dense one
    later_params["layer2.weight"] = earlier.params["layer2.weight"]  # a tensor the step did not touch
    later = Snapshot(5, S, later_params, earlier.shared, state_digest(later_params, earlier.shared))
    was = state_server.Served(4, S, earlier.state_digest, earlier.blob())
    served = state_server.demoted(was, state_server.Served(5, S, later.state_digest, later.blob()))
    blob = served.blob
    def held(name: str) -> int:
        return blob.base.tensors[blob.base.names.index(f"param/{name}")].data_ptr()

    assert held("layer0.weight") == later_params["layer0.weight"].data_ptr()
    assert held("layer1.weight") == earlier.params["layer1.weight"].data_ptr()
    whole = earlier.blob().read(0, earlier.blob().total)
    assert blob.total == len(whole)
    for offset, length in ((0, blob.total), (state_module.RANGE_BYTES - 2, 4099), (blob.total - 9, 50)):
        assert blob.read(offset, length) == whole[offset:offset + length]
    assert blob.manifest() == earlier.blob().manifest()


@pytest.mark.parametrize("forge", ["other dtype", "gap", "unknown section", "too short", "not json", "total"])
def test_a_received_blob_header_that_is_not_a_states_is_refused(forge):
    """Whatever a donor's header says, a receiver allocates only what a state blob of the described size holds,
    and only for a header in the one form honest donors write."""
    tensors = {"param/w": torch.ones(4, 4), "shared/momentum.w": torch.zeros(3)}
    whole = save_tensors(tensors)
    total = len(whole)
    if forge == "other dtype":
        whole = save_tensors({"param/w": torch.ones(4, 4, dtype=torch.float64), "shared/momentum.w": torch.zeros(6)})
    elif forge == "gap":
        whole = whole.replace(b'"data_offsets":[64,76]', b'"data_offsets":[68,80]')
    elif forge == "unknown section":
        whole = save_tensors({"param/w": torch.ones(4, 4), "other/momentum.w": torch.zeros(3)})
    elif forge == "too short":
        whole = whole[:4]
    elif forge == "not json":
        whole = whole[:8] + b"\xff" * (len(whole) - 8)
    elif forge == "total":
        total *= 1000
    with pytest.raises(PayloadError):
        state_module.TensorBlob.receive(whole, total)


def test_state_comes_from_several_donors_and_a_stalled_one_is_routed_around(donors_and_joiner):
    donors, joiner = donors_and_joiner
    snapshot = big_snapshot(5)
    for donor in donors:
        donor.serve_state([big_snapshot(5)])
        donor.announce_progress(5, Phase.TRAINING, snapshot.state_digest, {S: snapshot.state_digest})
        assert donor.flush()  # records go out in the background: the joiner must see them
    donors[0].loop.loop.call_soon_threadsafe(time.sleep, 8)  # this donor's event loop hangs: a stalled peer
    target = joiner.swarm_state(0, {S: "fresh"})[S]
    assert target.round == 5 and set(target.holders) == {d.peer_id for d in donors}
    started = time.monotonic()
    fetched = joiner.fetch_state(target, tensor_bytes(snapshot))
    assert time.monotonic() - started < 8  # did not wait for the stalled donor to wake up
    assert fetched.state_digest == snapshot.state_digest
    assert all(torch.equal(fetched.params[k], snapshot.params[k]) for k in snapshot.params)
    assert torch.equal(fetched.shared["momentum.0"], snapshot.shared["momentum.0"])
    assert state_module.PART_BYTES * 2 < snapshot.blob().total  # really fetched in several parts


def test_a_state_many_hold_is_fetched_from_a_few_reachable_unbanned_holders_drawn_anew_each_time():
    """A state all N hold is fetched from MAX_DONORS of them, not described N times to each newcomer: none behind
    a NAT that has no connection to this peer, none banned here, and another draw when the fetch is tried again."""
    node, holders = _FakeNode(), [f"p{i:02d}" for i in range(40)]
    natted, banned = set(holders[:10]), holders[10]
    for peer in holders:
        reach = Reachability.CLIENT if peer in natted else Reachability.PUBLIC
        node.stored.setdefault("run/peers", {})[peer] = ValueWithExpiration(
            record(peer, 5, "x").model_copy(update={"reachability": reach}).to_value(), get_dht_time() + 60)
    directory = PeerDirectory(node, ONE_KEY, b"owner", record("m", 5, "x"), 1.0, 10.0)
    bans = Bans(2, "run")
    bans.ban(banned, 5, "served a false state")
    target = SwarmState(5, S, "x", tuple([*holders, "m"]))

    class Unconnected:  # a daemon holding no direct connection: no peer behind a NAT can donate
        async def list_peers(self):
            return []

    async def draws() -> list[list[str]]:
        await directory.refresh()
        return [await choose_donors(Unconnected(), target, "m", bans, directory, random.Random(seed))
                for seed in range(2)]

    first, second = asyncio.run(draws())
    for donors in (first, second):
        assert len(set(donors)) == len(donors) == MAX_DONORS and set(donors) <= set(holders[11:])
    assert set(first) != set(second)


def test_a_state_nobody_holds_is_refused(donors_and_joiner):
    donors, joiner = donors_and_joiner
    size = tensor_bytes(big_snapshot(5))
    with pytest.raises(SwarmError, match="no donor served stage0 of round 5 with the vouched hash"):
        joiner.fetch_state(SwarmState(5, S, "f" * 64, tuple(d.peer_id for d in donors[1:])), size)
    with pytest.raises(SwarmError, match="no donor served stage1 of round 5"):  # a slice they do not hold
        joiner.fetch_state(SwarmState(5, "stage1", big_snapshot(5).state_digest, tuple(d.peer_id for d in donors)),
                           size)


def test_a_lone_claim_is_followed_only_if_its_holder_serves_it(donors_and_joiner):
    """No two peers agree: the joiner passes over a far-future round nobody serves and a state its lone holder
    does not serve, and follows the lone holder that really serves what its record claims."""
    donors, joiner = donors_and_joiner
    served = big_snapshot(6)
    donors[0].serve_state([served])
    donors[0].announce_progress(6, Phase.TRAINING, served.state_digest, {S: served.state_digest})
    donors[1].announce_progress(10**6, Phase.TRAINING, "f" * 64, {S: "f" * 64})  # a liar: claims a round far ahead
    donors[2].announce_progress(8, Phase.TRAINING, "e" * 64, {S: "e" * 64})  # serves round 5 at most, not this
    assert all(donor.flush() for donor in donors)
    target = joiner.swarm_state(0, {S: "fresh"})[S]
    assert (target.round, target.state_digest, target.holders) == (6, served.state_digest, (donors[0].peer_id,))
    assert joiner.fetch_state(target, tensor_bytes(served)).state_digest == served.state_digest
    # the lone holder refused its contribution in its last round: its word is no state to follow (here: its own)
    assert joiner.swarm_state(0, {S: "fresh"}, distrusted={donors[0].peer_id})[S].holders == (joiner.peer_id,)


def test_a_lone_holder_past_its_record_is_followed_to_the_round_it_serves(donors_and_joiner):
    """A run of one peer whose rounds are shorter than its record takes to reach the DHT: by the time the joiner
    asks, the holder has moved two rounds past what its record says and no longer holds that state. The joiner
    follows the latest state the holder serves, not its own round 0."""
    donors, joiner = donors_and_joiner
    claimed = big_snapshot(10)
    donors[0].serve_state([claimed])
    donors[0].announce_progress(10, Phase.TRAINING, claimed.state_digest, {S: claimed.state_digest})
    for other in donors[1:]:
        other.announce_progress(3, Phase.TRAINING, "d" * 64, {S: other.peer_id[-8:] * 8})  # lone, behind
    assert all(donor.flush() for donor in donors)
    donors[0].serve_state([big_snapshot(11)])
    donors[0].serve_state([latest := big_snapshot(12)])  # round 10 is no longer held (KEEP_SNAPSHOTS = 2)
    target = joiner.swarm_state(0, {S: "fresh"})[S]
    assert (target.round, target.state_digest, target.holders) == (12, latest.state_digest, (donors[0].peer_id,))
    assert joiner.fetch_state(target, tensor_bytes(latest)).state_digest == latest.state_digest


def test_a_donor_that_dies_mid_transfer_is_routed_around(monkeypatch):
    """One donor's p2p daemon is SIGKILLed as the donor is asked for its first range: the joiner gets that
    range from the others and the state arrives whole."""
    swarms, killed = [], []
    try:
        join_swarms("state-crash", 4, CONFIG, swarms)
        donors, joiner = swarms[:3], swarms[3]
        snapshot = big_snapshot(7)
        for donor in donors:
            donor.serve_state([big_snapshot(7)])
            donor.announce_progress(7, Phase.TRAINING, snapshot.state_digest, {S: snapshot.state_digest})
            assert donor.flush()

        async def victim_dies(point: str, round_index: int) -> None:
            if point == "state.serve" and asyncio.get_running_loop() is donors[1].loop.loop and not killed:
                killed.append(round_index)
                os.kill(donors[1].node.protocol.p2p._child.pid, signal.SIGKILL)
                raise ConnectionError("the donor is gone")

        monkeypatch.setattr(faults, "hit_async", victim_dies)  # each donor runs on its own event loop
        target = joiner.swarm_state(0, {S: "fresh"})[S]
        assert set(target.holders) == {d.peer_id for d in donors}
        fetched = joiner.fetch_state(target, tensor_bytes(snapshot))
        assert killed == [7] and fetched.state_digest == snapshot.state_digest
        assert all(torch.equal(fetched.params[k], snapshot.params[k]) for k in snapshot.params)
    finally:
        for s in swarms:
            s.leave()


def test_a_donor_that_serves_or_describes_the_state_falsely_is_banned_and_routed_around():
    """Three donors hold round 9. One flips a byte in every range it serves (its manifest is the true one), one
    describes a blob of its own (a manifest nobody else does): the joiner checks every range against the manifest
    most donors describe, takes the flipped ones from the honest donor, and bans both liars (one flipped byte, or
    one donor describing the state differently, used to fail every catch-up, and nobody was blamed)."""
    swarms = []
    try:
        join_swarms("state-blame", 4, CONFIG, swarms)
        (flipper, inventor, honest), joiner = swarms[:3], swarms[3]
        true = big_snapshot(9)
        corrupted = bytearray(true.blob().read(0, true.blob().total))
        for at in range(64, len(corrupted), state_module.RANGE_BYTES):
            corrupted[at] ^= 1
        flipped = big_snapshot(9)
        flipped.served = BytesBlob(bytes(corrupted), true.blob().manifest())
        invented = big_snapshot(9)
        invented.served = BytesBlob(bytes(corrupted))
        for donor, snapshot in ((flipper, flipped), (inventor, invented), (honest, big_snapshot(9))):
            donor.serve_state([snapshot])
            donor.announce_progress(9, Phase.TRAINING, true.state_digest, {S: true.state_digest})
            assert donor.flush()
        target = joiner.swarm_state(0, {S: "fresh"})[S]
        assert set(target.holders) == {flipper.peer_id, inventor.peer_id, honest.peer_id}
        fetched = joiner.fetch_state(target, tensor_bytes(true))
        assert fetched.blob().read(0, true.blob().total) == true.blob().read(0, true.blob().total)
        assert fetched.state_digest == true.state_digest
        assert joiner.bans.banned(flipper.peer_id, 9) and joiner.bans.banned(inventor.peer_id, 9)
        assert not joiner.bans.banned(honest.peer_id, 9)
    finally:
        for s in swarms:
            s.leave()
