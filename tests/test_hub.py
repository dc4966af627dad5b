"""Hubs: public peers that train nothing, coordinate and reduce the spans of trainers that cannot be dialled.

Real daemons on loopback: the trainers say they only dial out (``reachability: client``, as behind a home router),
so no trainer can coordinate or reduce, and a round happens only through the hub."""

import dataclasses
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from helpers import LOOPBACK, in_process_mean, run_document

from p2ploco.collective.dense import DenseMean
from p2ploco.collective.exchange import contribution_digest
from p2ploco.config import SwarmConfig
from p2ploco.errors import Failure, PayloadError
from p2ploco.launch import TINY_CONFIG, cli
from p2ploco.peer import Swarm
from p2ploco.swarm.evidence import group_statement
from p2ploco.swarm.records import Phase
from p2ploco.sync.contribute import parse_reply
from p2ploco.sync.group import Group

CONFIG = SwarmConfig(matchmaking_timeout=2, allreduce_timeout=3, heartbeat_interval=0.5, peer_ttl=10, ban_rounds=0)
SHAPES = [(64, 33), (33,), (7, 5)]


def tensors(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) for shape in SHAPES]



@pytest.fixture(scope="module")
def helped():
    """A hub and two trainers that only dial out; (hub, trainers)."""
    swarms = []
    try:
        hub = Swarm.join("helped", CONFIG, run_document(), host_maddrs=LOOPBACK, role="hub")
        swarms.append(hub)
        client = CONFIG.model_copy(update={"reachability": "client"})
        for _ in range(2):
            swarms.append(Swarm.join("helped", client, run_document(), initial_peers=hub.addresses(),
                                     host_maddrs=LOOPBACK))
        for s in swarms:
            s.announce_progress(0, Phase.JOINING, "start-state", {"params": "start-state"})
        assert all(s.wait_for_peers(3, 30) == 3 for s in swarms)
        yield hub, swarms[1:]
    finally:
        for s in swarms:
            s.leave()


def run_round(hub, trainers, round_index, seed, hub_first: threading.Event | None = None):
    """One all-reduce of the hub (no contribution: zeros, never sent) and the trainers; their results and
    exchanges, hub first."""
    for s in (hub, *trainers):
        s.announce_progress(round_index, Phase.AVERAGING, "start-state", {"params": "start-state"})
    assert all(s.flush() for s in (hub, *trainers))
    exchanges = [DenseMean([torch.zeros(shape) for shape in SHAPES])] + [
        DenseMean(tensors(seed + i)) for i in range(len(trainers))]
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(hub.communicator.all_reduce, exchanges[0], round_index, "params")]
        if hub_first is not None:
            hub_first.wait(30)
        futures += [pool.submit(s.communicator.all_reduce, e, round_index, "params")
                    for s, e in zip(trainers, exchanges[1:])]
        return [f.result(timeout=60) for f in futures], exchanges


@pytest.mark.timeout(120)
def test_trainers_that_cannot_be_dialled_all_reduce_through_a_hub_to_the_mean_of_their_contributions(helped):
    """Neither trainer can be dialled: the hub coordinates and reduces every span. It sends no contribution, so
    every peer ends the round with the mean of the trainers' two, bit for bit as in process, the hub too."""
    hub, trainers = helped
    results, exchanges = run_round(hub, trainers, 1, seed=10)
    assert all(r.committed and len(r.peers) == 3 for r in results), [r.failures for r in results]
    assert all(not r.dropped and not r.failures for r in results), [(r.dropped, r.failures) for r in results]
    expected = in_process_mean([tensors(10), tensors(11)])
    for exchange in exchanges:
        assert all(torch.equal(a, b) for a, b in zip(exchange.mean(), expected, strict=True))
    assert results[0].traffic.contribution_bytes == 0 and results[1].traffic.contribution_bytes > 0
    # A trainer that reduces nothing knows its partners from the hub's answers: the other trainer, whose step times
    # its round budget then goes by (the hub has none)
    assert trainers[1].peer_id in trainers[0].communicator.partners


@pytest.mark.timeout(120)
def test_a_hubs_join_does_not_start_the_formations_wait_the_first_contribution_does(helped):
    """The hub joins as the round begins, long before the trainers have finished their steps: the formation it
    opens waits for the trainers (here 2 matchmaking timeouts after the hub joined), then closes with them.
    Started at the hub's join, the wait would have closed a group of the hub alone, and the trainers would
    have been told they were late."""
    hub, trainers = helped
    coordinator = hub.communicator.matchmaker.coordinator
    opened = threading.Event()

    def wait_for_the_hubs_formation():
        deadline = time.monotonic() + 30
        while not any(key[0] == 2 for key in list(coordinator._forming)) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(2 * CONFIG.matchmaking_timeout)  # the time that passes is what is tested
        opened.set()

    waiter = threading.Thread(target=wait_for_the_hubs_formation)
    waiter.start()
    results, exchanges = run_round(hub, trainers, 2, seed=20, hub_first=opened)
    waiter.join()
    assert all(r.committed and len(r.peers) == 3 for r in results), [r.failures for r in results]
    expected = in_process_mean([tensors(20), tensors(21)])
    assert all(torch.equal(a, b) for e in exchanges for a, b in zip(e.mean(), expected, strict=True))


@pytest.mark.timeout(120)
def test_a_hub_waiting_for_a_round_the_trainers_have_passed_stops_waiting_and_catches_up(helped):
    """The hub joins round 30 (its own formation: it coordinates here), but the trainers' records show round 31: no
    contribution will come to it. It is told it is late within a heartbeat or two, instead of waiting out the
    hour a hub's join may wait for a round's first contribution."""
    hub, trainers = helped
    hub.announce_progress(30, Phase.AVERAGING, "start-state", {"params": "start-state"})
    for s in trainers:
        s.announce_progress(31, Phase.TRAINING, "start-state", {"params": "start-state"})
    assert all(s.flush() for s in (hub, *trainers))
    result = hub.communicator.all_reduce(DenseMean([torch.zeros(shape) for shape in SHAPES]), 30, "params")
    assert not result.committed and Failure.LATE in result.failures, result.failures


@pytest.mark.timeout(60)
def test_a_group_that_weighs_a_trainer_otherwise_than_it_joined_or_not_at_all_is_refused(helped):
    """A coordinator that gave the trainers no weight would make the group's aggregate its own contribution alone:
    only a peer whose record says it is a hub may weigh nothing, and a member takes a group only at its own weight."""
    hub, (me, other) = helped
    peers = tuple(sorted(s.peer_id for s in (hub, me, other)))

    def accept(tokens: dict[str, int]):
        group = Group("g", 40, "params", peers, hub.peer_id, holdings=tuple((p, ("params",)) for p in peers),
                      tokens=tuple((p, tokens[p]) for p in peers), dial_out=(me.peer_id, other.peer_id))
        signed = dataclasses.replace(group, grant=hub.communicator.matchmaker.coordinator.signer.sign(
            group_statement("helped", group.group_id, bytes.fromhex(group.digest))))  # as the hub hands it out
        return me.loop.run(me.communicator.matchmaker._accept(signed, {"params": ("x", "y")}, 100, []), 30)

    assert accept({hub.peer_id: 0, me.peer_id: 100, other.peer_id: 100}).tokens_of()[me.peer_id] == 100
    with pytest.raises(PayloadError, match="gives 1 member.s. that are no hub no weight"):
        accept({hub.peer_id: 0, me.peer_id: 100, other.peer_id: 0})
    with pytest.raises(PayloadError, match="another weight than it joined with"):
        accept({hub.peer_id: 0, me.peer_id: 0, other.peer_id: 100})


def test_a_reducers_answer_that_names_a_hubs_contribution_is_refused():
    """A hub sends no contribution, so an aggregate that names one (included, or left out as opposed) was not
    made from what the group sent: refused like any malformed answer. The hub itself takes an answer that names
    only the trainers' contributions."""
    peers = ("a", "b", "h")
    group = Group("g", 3, "params", peers, "h", holdings=tuple((p, ("params",)) for p in peers),
                  tokens=(("a", 100), ("b", 100), ("h", 0)), dial_out=("a", "b"))
    assert group.contributors("params") == ("a", "b") and group.reducers("params") == ("h",)
    honest = {"v": 1, "status": "ok", "included": [0, 1], "norms": [1.0, 2.0], "opposed": [], "signature": b"s",
              "contributions": [contribution_digest(b"a"), contribution_digest(b"b")]}
    receipt, included, _, _ = parse_reply(honest, group, "h", None)
    assert included == ["a", "b"] and receipt.own is None and receipt.tokens == (100, 100)
    hubs = contribution_digest(b"")
    for lie in ({**honest, "included": [0, 1, 2], "norms": [1.0, 2.0, 0.0], "contributions": [*honest[
            "contributions"], hubs]}, {**honest, "opposed": [2], "contributions": [*honest["contributions"], hubs]}):
        with pytest.raises(PayloadError, match="names a contribution of a hub"):
            parse_reply(lie, group, "a", b"a")


@pytest.mark.timeout(120)
def test_a_hub_for_rounds_it_cannot_take_part_in_is_refused_in_one_line(tmp_path):
    """Overlapped rounds land during inner steps a hub does not take (and Streaming DiLoCo's fragments sync at them)."""
    result = subprocess.run(cli("node", "start", "--config", str(TINY_CONFIG), "--role", "hub", "--set",
                                "outer.sparseloco.overlap=true", "--log-dir", str(tmp_path)),
                            capture_output=True, text=True, timeout=100)
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [
        "error: --role hub takes part in blocking rounds only; this run's outer is sparseloco with overlap: use "
        "SparseLoCo, DiLoCo or LoCo without overlap, or run this machine as a replica"], result.stderr
