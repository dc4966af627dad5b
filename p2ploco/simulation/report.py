"""Running a simulated swarm (``simulate``) and what its run showed (``Report``): the figures of a row of
``benchmarks/simulate.py``'s table."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable, Coroutine
from dataclasses import asdict, dataclass
from typing import Any

from p2ploco import faults
from p2ploco.metrics import steady_rounds
from p2ploco.simulation.clock import VirtualLoop, virtual_time
from p2ploco.simulation.swarm import RUN, RoundOutcome, Scenario, SimulatedSwarm, scaled_results, shared_audits
from p2ploco.sync.join import join_handler


@dataclass(frozen=True)
class Report:
    peers: int
    rounds: int
    rounds_by_all: int  # rounds every peer that synced them and stayed applied, with one digest
    applied_share: float  # peer-rounds applied / peer-rounds synced, all rounds
    round_seconds: float  # median virtual round time (inner steps and sync), rounds 1..
    allreduce_bytes: float  # per peer per steady round: all-reduce payload sent + received (``Traffic``), applied ones
    wire_bytes: float  # per peer per round: every byte its streams carried, both ways (framing included)
    dht_bytes: float  # per peer per steady round: DHT payload stored + read (``PeerDirectory.dht_bytes``)
    streams: float  # streams a peer opened per round
    coordinator_bytes: float  # per round: what the coordinators' join and vote handlers carried
    coordinator_cpu: float  # per round: CPU seconds of those handlers
    busiest_dht_bytes: float  # the busiest DHT server's bytes in and out, per heartbeat
    newcomer_seconds: float | None  # mean virtual time from a newcomer's start to its first applied round
    newcomers: int
    ban_seconds: float | None  # mean virtual time from an attacker's first attacking round to its ban by most peers
    attackers_banned: int
    virtual_seconds: float
    wall_seconds: float
    cpu_seconds: float  # the simulated peers' CPU time, all together

    def to_json(self) -> dict:
        return asdict(self)


def simulate(scenario: Scenario, on_round: Callable[[RoundOutcome], None] = lambda outcome: None,
             events: Callable[[SimulatedSwarm], Coroutine[Any, Any, None]] | None = None) -> Report:
    """Run ``scenario`` in virtual time and report it; ``on_round`` hears of each round once every peer ended it;
    ``events``: what happens to the swarm beside the scenario's churn (a peer that crashes at a chosen time), run
    alongside it."""
    started = time.perf_counter()
    loop = VirtualLoop()
    asyncio.set_event_loop(loop)
    try:
        swarm = SimulatedSwarm(scenario, loop)
        swarm.on_round = lambda index: on_round(swarm.round_outcome(index))
        if scenario.attackers:
            faults.swap("reduce.result", scaled_results(swarm))
        faults.swap("audit.check", shared_audits())
        with virtual_time(loop):
            happening = None if events is None else loop.create_task(events(swarm))
            loop.run_until_complete(swarm.run())
            left = asyncio.all_tasks(loop)  # the peers' services, still serving: cancelled, and let finish
            for task in left:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
        if happening is not None and not happening.cancelled() and happening.exception() is not None:
            raise happening.exception()  # a broken events script, raised as a peer's bug is
        return report(swarm, time.perf_counter() - started)
    finally:
        faults.swap("reduce.result", None)
        faults.swap("audit.check", None)
        asyncio.set_event_loop(None)
        loop.close()


def report(swarm: SimulatedSwarm, wall: float) -> Report:
    scenario, network, loop = swarm.scenario, swarm.network, swarm.loop
    outcomes = [swarm.round_outcome(r) for r in range(scenario.rounds)]
    steady = set(steady_rounds(range(scenario.rounds)))  # per-round means go over these, as scale.py's do
    rows = [row for p in swarm.peers for r, row in p.rounds.items() if r in steady]
    applied = [row for row in rows if row.applied]
    peer_rounds = max(1, sum(len(p.rounds) for p in swarm.peers))  # for totals over the whole run
    seconds = [s for o in outcomes if o.round in steady for s in o.seconds]
    coordinating = {join_handler(RUN), swarm.peers[0].communicator.commit.handler_name}
    newcomers = [p for p in swarm.peers if p.index >= scenario.peers]
    settled = [p.first_applied_at - p.joined_at for p in newcomers if p.first_applied_at is not None]
    heartbeats = max(1.0, loop.now / swarm.config.swarm.heartbeat_interval)
    attacking_since = swarm.round_began.get(scenario.attack_from)
    bans = [when - attacking_since for when in swarm.banned_at.values() if attacking_since is not None]
    return Report(
        peers=scenario.peers, rounds=scenario.rounds, rounds_by_all=sum(o.by_all for o in outcomes),
        applied_share=round(sum(row.applied for p in swarm.peers for row in p.rounds.values()) / peer_rounds, 4),
        round_seconds=round(statistics.median(seconds), 2) if seconds else 0.0,
        allreduce_bytes=round(statistics.mean(r.result.traffic.bytes_sent + r.result.traffic.bytes_received
                                              for r in applied)) if applied else 0,
        wire_bytes=round((sum(network.sent.values()) + sum(network.received.values())) / peer_rounds),
        dht_bytes=round(sum(sum(r.dht_bytes) for r in rows) / max(1, len(rows))),
        streams=round(sum(network.streams_opened.values()) / peer_rounds, 1),
        coordinator_bytes=round(sum(b for (_, handler), b in network.served.items() if handler in coordinating)
                                / scenario.rounds),
        coordinator_cpu=round(sum(c for (_, service), c in loop.cpu.items() if service in coordinating)
                              / scenario.rounds, 4),
        busiest_dht_bytes=round(max(swarm.dht.served.values(), default=0) / heartbeats),
        newcomer_seconds=round(statistics.mean(settled), 1) if settled else None, newcomers=len(newcomers),
        ban_seconds=round(statistics.mean(bans), 1) if bans else None, attackers_banned=len(bans),
        virtual_seconds=round(loop.now, 1), wall_seconds=round(wall, 1), cpu_seconds=round(sum(loop.cpu.values()), 1))
