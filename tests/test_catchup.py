"""Catching up (``p2ploco/catchup.py``) among real peers: when a node whose state is doubtful follows whom."""

import re
import threading
import time
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from helpers import join_swarms, sparsely_moved

from p2ploco.build import build_replica
from p2ploco.catchup import CatchUp
from p2ploco.config import Config, SwarmConfig, load_config
from p2ploco.data import ShardSampler
from p2ploco.launch import TINY_CONFIG
from p2ploco.metrics import state_digest
from p2ploco.presence import Presence
from p2ploco.schedules import build_schedule
from p2ploco.standing import Membership, Standing
from p2ploco.swarm.records import Phase
from p2ploco.swarm.state import Snapshot
from p2ploco.testing.swarm import CPU
from p2ploco.worker import Worker

SWARM = SwarmConfig(matchmaking_timeout=5, allreduce_timeout=2, heartbeat_interval=0.5, peer_ttl=10)


@dataclass
class HeldWorker:  # what Presence reads of a role: the worker whose state it announces
    worker: Worker


def moved(snapshot: Snapshot, round_index: int, step: float) -> Snapshot:
    """``snapshot``'s slice with every parameter moved by ``step``, as the state of ``round_index``."""
    params = {name: tensor + step for name, tensor in snapshot.params.items()}
    return Snapshot(round_index, snapshot.slice, params, snapshot.shared, state_digest(params, snapshot.shared))


def tiny_worker() -> tuple[Config, Worker]:
    config = load_config(TINY_CONFIG, ["swarm.matchmaking_timeout=5", "swarm.allreduce_timeout=2"])
    tokens = np.arange(20_000, dtype=np.uint16) % config.model.vocab_size
    return config, build_replica(config, CPU, ShardSampler(tokens, config.data.seq_len, 1, config.run_id, "me"))


@pytest.mark.timeout(120)
def test_a_doubtful_peer_waits_for_a_holder_still_in_a_round_it_did_not_apply_and_follows_its_newer_state():
    """Two stages whose pipelines failed round 5 move to round 6 with their old state, doubtful; the full replica
    that holds their slice trained round 5 alone and is still in it. The stages used to see nothing newer than their
    own state at round 6, clear their doubt, outvote the replica's state once it came, and cost it two rounds. Now
    a doubtful peer waits for the replica to come out of round 5 and fetches its state."""
    config, worker = tiny_worker()
    schedule = build_schedule(config, worker)
    (old,) = worker.snapshots(6)
    replica_round_5, replica_round_6 = moved(old, 5, 0.01), moved(old, 6, 0.02)
    swarms = []
    try:
        replica, stage, me = join_swarms("catchup-test", 3, SWARM, swarms)
        replica.serve_state([replica_round_5])
        replica.announce_progress(5, Phase.TRAINING, replica_round_5.state_digest,
                                  {old.slice: replica_round_5.state_digest})
        stage.announce_progress(6, Phase.TRAINING, old.state_digest, {old.slice: old.state_digest},
                                unsettled=True)
        assert replica.flush() and stage.flush()

        def replica_ends_round_5() -> None:
            replica.serve_state([replica_round_6])
            replica.announce_progress(6, Phase.TRAINING, replica_round_6.state_digest,
                                      {old.slice: replica_round_6.state_digest})

        later = threading.Timer(2.0, replica_ends_round_5)
        later.start()
        standing = Standing(6, Membership(6, "peer"), unsettled=5, doubtful=True)
        caught_up = CatchUp(config, me, Presence(me, HeldWorker(worker)), threading.Event(), print)(
            schedule, standing, first=False)
        later.join()
        assert worker.slice_digest == {old.slice: replica_round_6.state_digest}
        assert (caught_up.round, caught_up.membership.source, caught_up.doubtful) == (6, "peer", False)
    finally:
        for swarm in swarms:
            swarm.leave()



@pytest.mark.timeout(120)
def test_a_peer_waiting_for_its_unsettled_round_to_settle_serves_the_state_its_record_claims():
    """A replica that trained a round alone announces the state it holds for the next round and waits for the others
    to finish theirs (here: a peer stuck a round behind). It used to serve that state only once its round began: a
    newcomer that probed it meanwhile found a record claiming a round it did not serve, and never followed it."""
    config, worker = tiny_worker()
    swarms = []
    try:
        me, behind, newcomer = join_swarms("catchup-serve", 3, SWARM, swarms)
        (held,) = worker.snapshots(6)
        behind.announce_progress(5, Phase.TRAINING, "b" * 64, {held.slice: "b" * 64})
        assert behind.flush()
        standing = Standing(6, Membership(6, "peer"), unsettled=5)
        waiting = threading.Thread(target=CatchUp(config, me, Presence(me, HeldWorker(worker)), threading.Event(),
                                                  print), args=(build_schedule(config, worker), standing, False))
        waiting.start()
        try:
            followed = {}
            deadline = time.monotonic() + 8  # the catch-up waits 11 s for the peer behind
            while time.monotonic() < deadline:  # until the newcomer sees the record (its own state, at round 0, before)
                followed = newcomer.swarm_state(0, {held.slice: "fresh"})
                if followed[held.slice].round > 0:
                    break
        finally:
            waiting.join()
        assert [(t.round, t.state_digest) for t in followed.values()] == [(6, held.state_digest)]
    finally:
        for swarm in swarms:
            swarm.leave()


def sat_out(round_index: int) -> Standing:
    """Where a peer stands that sat round ``round_index - 1`` out (``Standing.after`` its record): at the next
    round, on the state it held, its last round unsettled."""
    return Standing(round_index, Membership(0, "init"), unsettled=round_index - 1, doubtful=True, sat_out=True)


@pytest.mark.timeout(120)
def test_a_peer_that_missed_three_rounds_applies_their_updates_and_holds_the_swarms_state_bit_for_bit():
    """Two donors served rounds 3 to 6, each of which changed 1% of the values; a peer still on round 3's state
    (the seed's) catches up at round 6 by the three rounds' updates, a fraction of the state's bytes, and then holds
    round 6's state bit for bit."""
    config, worker = tiny_worker()
    (first,) = worker.snapshots(3)
    served = [first]
    for r in (4, 5, 6):
        served.append(sparsely_moved(served[-1], r, r))
    swarms, said = [], []
    try:
        *donors, me = join_swarms("catchup-updates", 3, SWARM, swarms)
        for donor in donors:
            for snapshot in served:
                donor.serve_state([snapshot])
            donor.announce_progress(6, Phase.TRAINING, served[-1].state_digest,
                                    {first.slice: served[-1].state_digest})
            assert donor.flush()
        caught_up = CatchUp(config, me, Presence(me, HeldWorker(worker)), threading.Event(), said.append)(
            build_schedule(config, worker), sat_out(6), first=False)
    finally:
        for swarm in swarms:
            swarm.leave()
    fetching = next(line for line in said if "fetching" in line)
    assert re.search(r"the swarm is at round 6 \(this peer: 6\); fetching 3 rounds' updates \([\d.]+ kB\) of "
                     r"stage0 from 2 peer\(s\)$", fetching), said
    assert (caught_up.round, caught_up.membership.catchup_updates, caught_up.doubtful) == (6, 3, False)
    assert 0 < caught_up.membership.catchup_bytes < worker.state_bytes(first.slice) // 10
    assert worker.slice_digest == {first.slice: served[-1].state_digest}
    held = dict(zip(worker.names, worker.outer.params))
    assert all(torch.equal(held[name].view(torch.int32), t.view(torch.int32)) for name, t in served[-1].params.items())


@pytest.mark.timeout(120)
def test_donors_whose_update_leads_elsewhere_are_banned_and_the_state_is_fetched_instead():
    """Two donors (two keys of one attacker) serve an update from the peer's state that leads elsewhere: they served
    a forged state under the digest of the swarm's, and keep the difference to it. They outnumber the honest donor,
    so their update is the one fetched; applied, it does not hash to the vouched state. Both are banned, the honest
    donor is not, and the peer fetches the state from it."""
    config, worker = tiny_worker()
    (before,) = worker.snapshots(5)
    after = sparsely_moved(before, 6, 6)
    forged = sparsely_moved(before, 6, 7)
    forged = Snapshot(6, before.slice, forged.params, forged.shared, after.state_digest)  # under the swarm's digest
    swarms, said = [], []
    try:
        honest, *liars, me = join_swarms("catchup-lying-update", 4, SWARM, swarms)
        for donor, served in [(honest, after), *((liar, forged) for liar in liars)]:
            donor.serve_state([before])
            donor.serve_state([served])
            donor.announce_progress(6, Phase.TRAINING, after.state_digest, {before.slice: after.state_digest})
            assert donor.flush()
        caught_up = CatchUp(config, me, Presence(me, HeldWorker(worker)), threading.Event(), said.append)(
            build_schedule(config, worker), sat_out(6), first=False)
        banned = {peer for peer in (honest.peer_id, *(liar.peer_id for liar in liars)) if me.bans.banned(peer, 6)}
        liar_ids = {liar.peer_id for liar in liars}
    finally:
        for swarm in swarms:
            swarm.leave()
    assert banned == liar_ids, said
    assert any("1 round's update (" in line for line in said) and any(
        "did not lead to the state the swarm vouches for; fetching the state instead" in line
        for line in said), said
    assert (caught_up.round, caught_up.membership.catchup_updates, caught_up.doubtful) == (6, 0, False)
    assert caught_up.membership.catchup_bytes == worker.state_bytes(before.slice)
    assert worker.slice_digest == {before.slice: after.state_digest}
