"""Deadlines that follow what a peer measures: the transfer and formation rules (bounds respected, measurements
tighten and loosen them, hostile claims bounded), and a slow but honest link over real p2p daemons."""

import asyncio
from concurrent.futures import ThreadPoolExecutor

import msgpack
import pytest
import torch
from helpers import join_swarms

from p2ploco.collective.dense import DenseMean
from p2ploco.config import SwarmConfig
from p2ploco.swarm import wire
from p2ploco.swarm.deadlines import (
    ALLOWANCE_MARGIN,
    ARRIVAL_STEPS,
    ARRIVALS,
    MIN_ALLOWANCE,
    ROUND_WAITS,
    TransferDeadline,
    formation_wait,
    round_bound,
    round_wait,
)
from p2ploco.swarm.records import Phase
from p2ploco.testing.communicator import InProcessGroup

RULE = TransferDeadline(base=30.0, min_mbit=10.0, cap=600.0)


def test_a_deadline_is_the_base_plus_the_payload_at_the_slowest_reported_link():
    assert RULE.seconds(0) == 30.0
    assert RULE.seconds(10**6, [80.0, 100.0, 20.0]) == pytest.approx(30.0 + 8e6 / 20e6)  # the slowest link counts
    assert RULE.seconds(125 * 10**6, [100.0]) == pytest.approx(40.0)  # 1 Gbit over 100 Mbit/s: 10 s more
    assert RULE.seconds(2 * 10**6, [100.0]) < RULE.seconds(4 * 10**6, [100.0])  # grows with the payload


def test_unstated_or_implausibly_slow_links_count_as_the_floor_and_the_cap_bounds_everything():
    floor = RULE.seconds(10**7, [10.0])
    assert RULE.seconds(10**7) == RULE.seconds(10**7, [0.0, 0.0]) == floor  # nobody states a rate
    assert RULE.seconds(10**7, [0.001, 100.0]) == floor  # a claimed crawl cannot stretch it past the floor
    assert RULE.seconds(10**7, [1000.0]) < floor  # fast links: a dead peer is given up on sooner
    assert RULE.seconds(10**12, [1000.0]) == 600.0


def test_a_reducer_waits_the_bound_until_it_has_measured_then_what_its_senders_took():
    rule = TransferDeadline(base=300.0, min_mbit=10.0, cap=900.0)
    assert rule.allowance() == 300.0 and rule.expected(10**6) == rule.seconds(10**6)  # nothing measured: the bound
    rule.arrived([0.2, 0.3])  # a loopback round
    assert rule.allowance() == MIN_ALLOWANCE  # tightened, to the floor
    assert rule.expected(10**6) == pytest.approx(MIN_ALLOWANCE + 0.8)  # the payload still counts
    assert rule.expected(10**6) < rule.seconds(10**6)
    rule.arrived([])  # an all-reduce with no sender here (alone, or only dialling out) measures nothing
    assert rule.allowance() == MIN_ALLOWANCE
    rule.arrived([9.0, 10.0, 11.0])  # a slow uplink: the allowance loosens with it
    assert rule.allowance() == ALLOWANCE_MARGIN * 10.0
    for _ in range(ARRIVALS):  # the slow rounds pass out of memory: it tightens again
        rule.arrived([0.5])
    assert rule.allowance() == MIN_ALLOWANCE
    rule.arrived([200.0, 250.0])
    assert rule.allowance() == 300.0  # never past the bound
    assert rule.expected(10**12) == rule.seconds(10**12) == 900.0  # nor past the cap


def test_one_late_sender_does_not_stretch_the_others_deadlines_nor_does_a_fast_claim_shorten_a_slow_link():
    rule = TransferDeadline(base=300.0, min_mbit=10.0, cap=900.0)
    rule.arrived([0.4, 299.0])  # one of two senders held its pieces to the last moment: the lower median counts
    rule.arrived([0.5, 0.3, 299.0])
    assert rule.allowance() == MIN_ALLOWANCE
    honest_slow = rule.expected(10**7, [10.0])
    assert rule.expected(10**7, [10.0, 1000.0, 1000.0]) == honest_slow  # liars' fast links: the slow one counts
    assert rule.expected(10**7, [10.0, 0.001]) == honest_slow  # a claimed crawl: no slower than the floor


def test_a_sender_that_timed_out_counts_as_the_whole_wait_so_a_too_short_allowance_grows():
    rule = TransferDeadline(base=300.0, min_mbit=10.0, cap=900.0)
    rule.arrived([0.1])
    short = rule.allowance()
    rule.arrived([short, short])  # every sender missed it (``Inbox.arrivals``): the link is slower
    assert rule.allowance() == min(300.0, ALLOWANCE_MARGIN * short) > short


SLACK = max(MIN_ALLOWANCE, 2 * 1.0)  # formation_wait's slack at a heartbeat of 1 s


def test_a_formation_waits_the_bound_until_this_peer_has_a_round_then_for_the_slowest_expected_step():
    assert formation_wait(300.0, 1.0, 0.0, [0.1, 0.2]) == 300.0  # nothing measured yet: the bound
    assert formation_wait(300.0, 1.0, 8.0, [0.1, 0.2]) == pytest.approx(SLACK + ARRIVAL_STEPS * 0.2)
    assert formation_wait(300.0, 1.0, 8.0, [0.1, 2.0]) == pytest.approx(SLACK + ARRIVAL_STEPS * 2.0)  # a slow peer
    assert formation_wait(300.0, 10.0, 8.0, [0.1]) == pytest.approx(20.0 + ARRIVAL_STEPS * 0.1)  # old records
    assert formation_wait(300.0, 1.0, 8.0, []) == SLACK
    assert formation_wait(6.0, 1.0, 8.0, [2.0]) == 6.0  # never past the bound
    # a joiner that coordinates before its own first round goes by its peers' rounds (one key's claim moves nothing)
    assert formation_wait(300.0, 1.0, 0.0, [1e6, 1e6], [8.0, 9.0, 1e6]) == pytest.approx(SLACK + 9.0)
    assert formation_wait(300.0, 1.0, 0.0, [0.2], [0.0, 0.0]) == 300.0  # nobody has finished a round


def test_a_claimed_slow_step_costs_at_most_a_round_and_a_fast_one_only_its_own_claims_allowance():
    own_round = 8.0
    assert formation_wait(300.0, 1.0, own_round, [0.1, 1e6]) == SLACK + own_round  # no longer than a round's work
    assert formation_wait(300.0, 1.0, own_round, [0.1, 0.0]) == SLACK + own_round  # a joiner: nothing measured yet
    honest = formation_wait(300.0, 1.0, own_round, [0.2, 1.5])
    assert formation_wait(300.0, 1.0, own_round, [0.2, 1.5, 1e-300]) == honest  # a liar's fast step changes nothing


@pytest.mark.timeout(120)
def test_a_coordinator_waits_by_the_steps_its_peers_publish_and_a_liars_claim_costs_at_most_its_own_round():
    """The formation rule as a coordinator applies it to real records (``Swarm.formation_wait``): the bound before
    anyone has a round, then by the published steps; a claimed crawl is held to this peer's own round, and a banned
    peer's claim is not read."""
    config = SwarmConfig(matchmaking_timeout=60, allreduce_timeout=5, heartbeat_interval=0.5, peer_ttl=10)
    slack = max(MIN_ALLOWANCE, 2 * config.heartbeat_interval)
    swarms = []
    try:
        join_swarms("formation-wait", 3, config, swarms)
        me, _, liar = swarms

        def published() -> float:
            assert all(s.flush() for s in swarms)
            me.loop.run(me.directory.refresh(), 10)
            return me.formation_wait(1)

        for s in swarms:
            s.update_record(step_seconds=0.2)
            s.announce_progress(1, Phase.TRAINING, "start", {"params": "start"})
        assert published() == 60.0  # nobody has finished a round: nothing measured
        me.update_record(round_seconds=4.0)
        assert published() == pytest.approx(slack + ARRIVAL_STEPS * 0.2)
        liar.update_record(step_seconds=1e6)
        assert published() == pytest.approx(slack + 4.0)  # one round's work at most
        me.bans.ban(liar.peer_id, 1, "a test")
        assert published() == pytest.approx(slack + ARRIVAL_STEPS * 0.2)
    finally:
        for s in swarms:
            s.leave()


SHAPES = [(100, 250)]  # 100 kB of float32 per peer
SLOW_SECONDS = 2.5  # how long the slow peer's link takes to carry one contribution
BASE = 1.0  # swarm.allreduce_timeout: far below that


def run_round_with_a_slow_link(min_bandwidth_mbit: float, run_id: str, monkeypatch):
    """Three real peers all-reduce once; the contributions of the first (in peer order) trickle out over
    SLOW_SECONDS (the bytes arrive in pieces, as over a slow link). Returns the inputs, the exchanges, each peer's
    stats (in peer order) and the slow peer's id."""
    config = SwarmConfig(matchmaking_timeout=10, allreduce_timeout=BASE, heartbeat_interval=0.5, peer_ttl=10,
                         ban_rounds=0, min_bandwidth_mbit=min_bandwidth_mbit, max_transfer_timeout=60)
    swarms = []
    try:
        join_swarms(run_id, 3, config, swarms)
        swarms.sort(key=lambda s: s.peer_id)
        slow = swarms[0]
        for s in swarms:
            s.announce_progress(0, Phase.JOINING, "start", {"params": "start"})
        assert all(s.wait_for_peers(3, 30) == 3 for s in swarms)
        real_write = wire.write_message

        async def trickle(writer, header, payload=b""):
            if not (payload and "span" in header and asyncio.get_running_loop() is slow.loop.loop):
                return await real_write(writer, header, payload)
            head = msgpack.packb({"v": wire.PROTOCOL_VERSION, **header}, use_bin_type=True)
            message, pieces = wire.PREFIX.pack(len(head), len(payload)) + head + payload, 10
            for i in range(pieces):
                if i:
                    await asyncio.sleep(SLOW_SECONDS / pieces)  # stands for the link's rate, not for synchronisation
                writer.write(message[len(message) * i // pieces: len(message) * (i + 1) // pieces])
                await writer.drain()

        monkeypatch.setattr(wire, "write_message", trickle)
        inputs = [[torch.randn(shape, generator=torch.Generator().manual_seed(seed)) for shape in SHAPES]
                  for seed in range(3)]
        exchanges = [DenseMean(t) for t in inputs]
        for s in swarms:
            s.announce_progress(0, Phase.AVERAGING, "start", {"params": "start"})
        with ThreadPoolExecutor(3) as pool:
            futures = [pool.submit(s.communicator.all_reduce, e, 0, "params") for s, e in zip(swarms, exchanges)]
            stats = [f.result(timeout=120) for f in futures]
        return inputs, exchanges, stats, slow.peer_id
    finally:
        monkeypatch.undo()
        for s in swarms:
            s.leave()


def test_a_slow_but_honest_link_is_waited_for_when_its_payload_needs_the_time(monkeypatch):
    """100 kB at a floor of 0.1 Mbit/s allows 8 s on top of the 1 s base: the 2.5 s contribution counts, every
    peer applies the exact mean of all three."""
    inputs, exchanges, stats, _ = run_round_with_a_slow_link(0.1, "slow-ok", monkeypatch)
    group = InProcessGroup(3)
    reference = [DenseMean(t) for t in inputs]
    with ThreadPoolExecutor(3) as pool:
        list(pool.map(lambda rank: group.communicator(rank).all_reduce(reference[rank], 0, "params"), range(3)))
    for exchange, s in zip(exchanges, stats):
        assert s.committed and s.dropped == [] and len(s.peers) == 3
        assert all(torch.equal(a, b) for a, b in zip(exchange.mean(), reference[0].mean()))


def test_the_same_link_is_dropped_when_the_deadline_ignores_the_payload(monkeypatch):
    """The same round with deadlines that stay at the 1 s base (a floor of 1e6 Mbit/s): the slow peer is dropped
    and the other two commit without it. This is the branch the payload-sized deadline avoids."""
    _, _, stats, slow = run_round_with_a_slow_link(1e6, "slow-dropped", monkeypatch)
    assert not stats[0].committed and stats[0].excluded  # the slow peer (first in peer order) is out
    assert all(s.committed and slow in s.dropped for s in stats[1:])


def test_a_round_s_end_is_awaited_for_the_bound_until_rounds_are_stated_then_three_of_them_and_a_liar_moves_none():
    bound = round_bound(matchmaking_timeout=300, allreduce_timeout=300)
    assert bound == 1200 and round_wait(bound, heartbeat=1.0, rounds=[0.0, 0.0]) == bound
    # a slack (two heartbeats, MIN_ALLOWANCE at least) and ROUND_WAITS rounds of the run
    assert round_wait(bound, heartbeat=1.0, rounds=[2.0, 2.0, 0.0]) == MIN_ALLOWANCE + ROUND_WAITS * 2.0
    assert round_wait(bound, heartbeat=10.0, rounds=[2.0]) == 20.0 + ROUND_WAITS * 2.0
    # one key of three that states hour-long rounds moves nothing; as many as the honest ones move it to the bound
    assert round_wait(bound, 1.0, [2.0, 2.0, 3600.0]) == MIN_ALLOWANCE + ROUND_WAITS * 2.0
    assert round_wait(bound, 1.0, [2.0, 3600.0, 3600.0]) == bound
