"""A bootstrap-only peer: a DHT node that trains nothing, validates p2ploco's signed records, publishes a
record of its own (role ``bootstrap``) so that ``p2ploco peers`` shows it, dials joining nodes back so that they
learn whether they can be dialled (``swarm/reachability.py``), and relays for nodes behind NAT (p2pd's relay
service)."""

from __future__ import annotations

from collections.abc import Sequence

from hivemind.dht.node import DHTNode

from p2ploco import __version__
from p2ploco.config import SwarmConfig
from p2ploco.swarm.dht import FAREWELL_TIMEOUT, start_dht_node, visible_maddrs
from p2ploco.swarm.directory import PeerDirectory
from p2ploco.swarm.identity import Identity
from p2ploco.swarm.loop import EventLoopThread, finishes_within
from p2ploco.swarm.names import human_name
from p2ploco.swarm.reachability import DialBack
from p2ploco.swarm.records import BOOTSTRAP_RECORDS, MAX_ADDRESSES, PeerRecord, PeerRole
from p2ploco.swarm.wire import DAEMON_ERRORS


async def start_bootstrap(initial_peers: Sequence[str], host_maddrs: Sequence[str], announce_maddrs: Sequence[str],
                          identity_path: str | None, name: str = "") -> tuple[DHTNode, list[str]]:
    """Start the DHT node and its record heartbeat; return the node and the addresses to join through."""
    identity = Identity.claim(identity_path) if identity_path is not None else Identity.fresh()
    node, owner = await start_dht_node(initial_peers, host_maddrs, announce_maddrs, identity)
    addresses = await visible_maddrs(node)
    await DialBack(node.protocol.p2p, addresses).start()  # joining nodes ask it whether they can be dialled
    peer_id = str(node.peer_id)
    me = PeerRecord(peer_id=peer_id, round=0, state="serving", fingerprint="", version=__version__,
                    name=name or human_name(peer_id), role=PeerRole.BOOTSTRAP, addresses=addresses[:MAX_ADDRESSES])
    defaults = SwarmConfig()
    directory = PeerDirectory(node, BOOTSTRAP_RECORDS, owner, me, defaults.heartbeat_interval, defaults.peer_ttl)
    await directory.store_record()
    directory.start_heartbeat()
    return node, addresses


def stop_bootstrap(loop: EventLoopThread, node: DHTNode) -> str | None:
    """Shut ``node`` and its p2p daemon down, never hanging on a daemon that is already gone (a signal to the whole
    process group stops it too); None if that went cleanly, else one line on what went otherwise."""
    try:
        if not loop.run(finishes_within(node.shutdown(), FAREWELL_TIMEOUT), FAREWELL_TIMEOUT + 5):
            return "the p2p daemon did not answer (a signal to the process group stops it too); exiting anyway"
    except DAEMON_ERRORS as e:
        return f"the p2p daemon stopped uncleanly ({e!r}); exiting anyway"
    return None
