"""Starting a peer's sync: its services (the coordinator's side of matchmaking, audits, the butterfly's reducer side,
the commit), and the communicator that runs each sync through them. Membership (``p2ploco/swarm/``) comes first:
the sync stands on its directory, bans and transfer deadlines."""

from __future__ import annotations

from hivemind.p2p import P2P

from p2ploco.config import SwarmConfig
from p2ploco.swarm.bans import Bans
from p2ploco.swarm.deadlines import TransferDeadline
from p2ploco.swarm.directory import PeerDirectory
from p2ploco.swarm.evidence import Signer
from p2ploco.swarm.loop import EventLoopThread
from p2ploco.sync.audit import Audits
from p2ploco.sync.communicator import SwarmCommunicator
from p2ploco.sync.coordinator import Coordinator
from p2ploco.sync.decide import RoundCommit
from p2ploco.sync.form import Matchmaker
from p2ploco.sync.group import GroupBook
from p2ploco.sync.liveness import ProbeAnswers, lost_behind_nats
from p2ploco.sync.reduce import ButterflyAllReduce
from p2ploco.sync.tether import Tether, Tethers
from p2ploco.sync.this_peer import ThisPeer


async def start_sync(loop: EventLoopThread, p2p: P2P, directory: PeerDirectory, me: ThisPeer, run_id: str,
                     config: SwarmConfig, deadlines: TransferDeadline, bans: Bans, signer: Signer, stages: int,
                     max_tokens: int, dial_out: bool) -> SwarmCommunicator:
    """This peer's sync services, started, and its communicator. ``stages``: how many slices a pipeline of this run
    brings to a round; ``max_tokens``: the most tokens one contribution may weigh; ``dial_out``: others cannot dial
    this peer (``swarm/reachability.py``)."""

    def key_of(peer: str) -> bytes | None:
        return signer.public_key if peer == me.peer_id else directory.keys.get(peer)

    book = GroupBook()
    tethers = Tethers(p2p, run_id, directory, deadlines.base)
    lost = lost_behind_nats(tethers.cut, directory.stopped)
    coordinator = Coordinator(p2p, directory, run_id, config.matchmaking_timeout, bans, stages, book, max_tokens,
                              config.max_reducers, signer, tethers, dial_out)
    matchmaker = Matchmaker(p2p, directory, coordinator, me, run_id, config.matchmaking_timeout, bans, stages,
                            max_tokens, key_of, dial_out)
    audits = Audits(p2p, run_id, deadlines.base, config.audit)
    butterfly = ButterflyAllReduce(p2p, me.peer_id, run_id, deadlines, bans, signer, key_of, directory.rates,
                                   lost, matchmaker.whereabouts, audits)
    commit = RoundCommit(p2p, me.peer_id, run_id, config.allreduce_timeout, book, bans, signer, key_of, lost)
    probes = ProbeAnswers(p2p, run_id, matchmaker.whereabouts, deadlines.base)
    for service in (tethers, probes, coordinator, audits, butterfly, commit):
        await service.start()
    if dial_out:  # nobody can dial this peer: its coordinators learn that it crashed from its tethers
        Tether(p2p, run_id, directory, coordinator.candidates).start()
    return SwarmCommunicator(loop, me, directory, config.matchmaking_timeout, matchmaker, butterfly, commit)
