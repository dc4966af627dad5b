"""Joining the DHT: address checks, identity, bootstrap, and the errors a person can act on."""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import threading
from collections.abc import Sequence

from hivemind.dht.node import DHTNode
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError
from hivemind.proto import dht_pb2
from hivemind.utils.auth import AuthRole, AuthRPCWrapper
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.multiaddr import Multiaddr

from p2ploco.errors import ConfigError, SwarmError
from p2ploco.swarm import DEFAULT_HOST_MADDRS
from p2ploco.swarm.identity import Identity
from p2ploco.swarm.schema import record_validator

EXAMPLE = "/ip4/203.0.113.7/tcp/31337/p2p/Qm..."  # a peer's address: where it listens, and its id
LISTEN_EXAMPLE = "/ip4/0.0.0.0/tcp/31350"  # this peer's own listening address: no id
FAREWELL_TIMEOUT = 3.0  # the "leaving" record is a courtesy: never hold up an exit for it
DAEMON_LOG = logging.getLogger("hivemind.p2p.p2p_daemon")  # where hivemind logs what its p2p daemon prints


def check_multiaddrs(values: Sequence[str], option: str, need_peer_id: bool) -> list[str]:
    """Parse multiaddrs given on the command line, failing with one line (ConfigError: bad input) that shows the
    expected form: a peer's address with its id (``need_peer_id``), or a listening address without one."""
    checked = []
    for value in values:
        try:
            address = Multiaddr(value)
        except ValueError:  # hivemind's multiaddr ParseError
            raise ConfigError(f"{option} {value!r} is not a multiaddr; expected e.g. "
                              f"{EXAMPLE if need_peer_id else LISTEN_EXAMPLE}") from None
        protocols = {p.name for p in address.protocols()}
        if need_peer_id and "p2p" not in protocols:
            raise ConfigError(f"{option} {value!r} lacks the peer id part /p2p/Qm...; "
                             f"copy the full address the bootstrap peer printed")
        if not need_peer_id and "p2p" in protocols:
            raise ConfigError(f"{option} {value!r} must not include /p2p/...: it names a local listening address, "
                              f"e.g. {LISTEN_EXAMPLE}")
        checked.append(value)
    return checked


def taken_listen_address(host_maddrs: Sequence[str]) -> str | None:
    """The first of ``host_maddrs`` whose TCP port another process listens on, as a bind without SO_REUSEPORT finds
    (p2pd binds with it, so it would share a port another p2pd holds, and both would answer for one address); None if
    every one is free or picks a free port (/tcp/0)."""
    for text in host_maddrs:
        address = Multiaddr(text)
        family = next((f for proto, f in (("ip4", socket.AF_INET), ("ip6", socket.AF_INET6)) if proto in address),
                      None)
        if family is None or "tcp" not in address or address["tcp"] == "0":
            continue
        host = address["ip4"] if family == socket.AF_INET else address["ip6"]
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((host, int(address["tcp"])))
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    return text
    return None


def port_in_use(address: str) -> ConfigError:
    return ConfigError(f"--host-maddrs {address}: the port is in use by another process; pick another port in "
                       f"--host-maddrs (/tcp/0: any free one)")


def check_addresses(initial_peers: Sequence[str], host_maddrs: Sequence[str], announce_maddrs: Sequence[str]) -> None:
    """ConfigError, in one line, for addresses a peer cannot start with: malformed, with or without the peer id
    where the other is needed, an announced port 0, or a port to listen on that another process holds. A command
    calls it before anything else starts; ``start_dht_node`` again, just before the daemon binds."""
    check_multiaddrs(initial_peers, "--initial-peers", need_peer_id=True)
    check_multiaddrs(host_maddrs, "--host-maddrs", need_peer_id=False)
    check_multiaddrs(announce_maddrs, "--announce-maddrs", need_peer_id=False)
    for address in map(Multiaddr, announce_maddrs):
        if any(proto in address and address[proto] == "0" for proto in ("tcp", "udp")):
            raise ConfigError(f"--announce-maddrs '{address}' has port 0; announce the real port others can reach")
    taken = taken_listen_address(host_maddrs)
    if taken is not None:  # p2pd listens with SO_REUSEPORT: it would share the port with another daemon there
        raise port_in_use(taken)


async def start_dht_node(
    initial_peers: Sequence[str] = (),
    host_maddrs: Sequence[str] = DEFAULT_HOST_MADDRS,
    announce_maddrs: Sequence[str] = (),
    identity: Identity | None = None,
    client_mode: bool = False,
    run_id: str | None = None,
    dht_mode: str | None = None,
) -> tuple[DHTNode, bytes]:
    """Start a p2p daemon and a DHT node in the running loop; bootstrap from ``initial_peers`` if any. Records are
    signed with ``identity``'s key, the one behind the peer id (a client that publishes nothing may go without:
    its daemon makes up a key), and validated for ``run_id``'s key too if given. Returns the node and the subkey
    its records are stored under. An ephemeral identity's key file is gone once this returns (a claimed one is
    the caller's to release). What the daemon logs while it starts is shown once it has started, or if it fails in a
    way this does not explain; a daemon that fails as expected (a port in use, no bootstrap peer) is one line."""
    reapers, held, explained = _reapers(), _HeldRecords(), False
    DAEMON_LOG.addFilter(held)
    try:
        check_addresses(initial_peers, host_maddrs, announce_maddrs)
        validator, owner = record_validator(identity.key if identity is not None else RSAPrivateKey(), run_id)
        return await DHTNode.create(
            initial_peers=list(initial_peers),
            host_maddrs=list(host_maddrs),
            announce_maddrs=list(announce_maddrs) or None,
            identity_path=identity.path if identity is not None else None,
            check_if_identity_free=identity is not None and not identity.ephemeral,  # a fresh key is nobody's
            client_mode=client_mode,
            record_validator=validator,
            # Behind a NAT the daemon reserves a slot at a public peer's relay (its bootstrap peers are trusted
            # relays) and announces the circuit address; a public peer's AutoNAT keeps it from doing so.
            use_relay=True,
            use_auto_relay=True,
            **({"dht_mode": dht_mode} if dht_mode is not None else {}),
        ), owner
    except P2PDaemonError as e:
        explained = True  # its last words (e.g. a listener closed as it exits) would only bury the error's line
        await _reaped(_reapers() - reapers)
        raise _daemon_failure(e, initial_peers, host_maddrs, identity) from None
    except RuntimeError as e:
        if "bootstrap failed" in str(e):
            raise SwarmError(f"no bootstrap peer in {', '.join(initial_peers)} answered a DHT ping; "
                             f"is it a hivemind DHT peer of a compatible version?") from None
        raise
    finally:
        DAEMON_LOG.removeFilter(held)
        if not explained:
            for record in held.records:
                DAEMON_LOG.handle(record)
        if identity is not None and identity.ephemeral:
            identity.release()


def _daemon_failure(e: P2PDaemonError, initial_peers: Sequence[str], host_maddrs: Sequence[str],
                    identity: Identity | None) -> SwarmError | ConfigError:
    """The one line that says why the p2p daemon of ``start_dht_node`` failed to start, and what to do."""
    text = str(e)
    if "failed to connect to bootstrap peers" in text:
        return SwarmError(f"could not reach any bootstrap peer in {', '.join(initial_peers)}: "
                          f"check the address and that the peer is running")
    if "address already in use" in text:
        return port_in_use(" ".join(host_maddrs))
    if "already taken" in text:
        return SwarmError(f"identity {identity.path} is already used by a live peer; "
                          f"stop that peer or pass another --identity")
    return SwarmError(f"could not start the p2p daemon: {text.splitlines()[-1] if text else e!r}")


class _HeldRecords(logging.Filter):
    """Keeps a logger's records instead of letting them through."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        self.records.append(record)
        return False


def _reapers() -> set[threading.Thread]:
    """asyncio's threads (Python 3.11's child watcher) that wait for this process's children to exit."""
    return {thread for thread in threading.enumerate() if thread.name.startswith("asyncio-waitpid-")}


async def _reaped(reapers: set[threading.Thread], timeout: float = 5.0) -> None:
    """Wait, with the loop running, until ``reapers`` have reported their children's exit to it. Hivemind leaves a
    daemon that failed to start to its reaper, and the node stops at once with a one-line error: a report that comes
    after the loop closed is a stray warning line under it. (Python 3.12+ watches children on the loop: no threads.)"""
    def join() -> None:
        for thread in reapers:
            thread.join(timeout)

    await asyncio.to_thread(join)


async def start_serving(node: DHTNode) -> None:
    """Turn a DHT node started as a client into a server, as hivemind's ``DHTProtocol.create`` makes one: it serves
    the DHT's requests, and its requests carry its node id, so that peers add it to their routing tables from now
    on. A node starts as a client until it knows that it can be dialled (``swarm/reachability.py``): the other way
    round, peers that already listed it would go on handing it out, and hivemind's own store refuses a traversal
    that returns the node itself."""
    protocol = node.protocol
    if protocol.client_mode:
        await protocol.add_p2p_handlers(protocol.p2p, AuthRPCWrapper(protocol, AuthRole.SERVICER, protocol.authorizer))
        protocol.client_mode = False
        protocol.node_info = dht_pb2.NodeInfo(node_id=node.node_id.to_bytes())


async def visible_maddrs(node: DHTNode) -> list[str]:
    """Full addresses others can join through: /ip4/.../tcp/.../p2p/<peer id>."""
    return [str(address) for address in await node.protocol.p2p.get_visible_maddrs()]
