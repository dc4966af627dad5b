"""Joining the DHT: address checks, identity, bootstrap, and the errors a person can act on."""

from __future__ import annotations

import fcntl
import os
import secrets
from collections.abc import Sequence
from pathlib import Path

from hivemind.dht.node import DHTNode
from hivemind.dht.validation import RecordValidatorBase
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.multiaddr import Multiaddr

from p2ploco.errors import SwarmError
from p2ploco.swarm import DEFAULT_HOST_MADDRS

EXAMPLE = "/ip4/203.0.113.7/tcp/31337/p2p/12D3KooW..."
_held_identities: dict[str, int] = {}  # identity file -> the descriptor that holds its lock while this process runs


def claim_identity(path: str) -> None:
    """Make sure the identity file exists, creating it atomically if it does not (two nodes started at once
    with a new --identity must not both write one and run under the same peer id), and hold an exclusive lock
    on it for this process's life: a second live holder on this machine is refused with a SwarmError.
    (hivemind's own check, a dial to the peer id, catches a holder on another machine.)"""
    target = Path(path)
    if not target.parent.is_dir():
        raise SwarmError(f"--identity {path}: the folder {target.parent} does not exist")
    if not target.exists():
        key = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=RSAPrivateKey().to_bytes())
        temporary = target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}")
        temporary.write_bytes(key.SerializeToString())
        temporary.chmod(0o400)
        try:
            os.link(temporary, target)  # atomic: exactly one of several racing creators wins
        except FileExistsError:
            pass  # another process created it first: use theirs
        finally:
            temporary.unlink()
    key = str(target.resolve())
    if key in _held_identities:
        raise SwarmError(f"identity {path} is already used by a peer in this process; pass another --identity")
    descriptor = os.open(key, os.O_RDONLY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(descriptor)
        raise SwarmError(f"identity {path} is already used by a live peer on this machine; stop that peer or "
                         f"pass another --identity") from None
    _held_identities[key] = descriptor


def release_identity(path: str | None) -> None:
    """Let another process use the identity file (this one is leaving)."""
    descriptor = _held_identities.pop(str(Path(path).resolve()), None) if path else None
    if descriptor is not None:
        os.close(descriptor)


def check_multiaddrs(values: Sequence[str], option: str, need_peer_id: bool) -> list[str]:
    """Parse multiaddrs given on the command line, failing with one line that shows the expected form."""
    checked = []
    for value in values:
        try:
            address = Multiaddr(value)
        except ValueError:  # hivemind's multiaddr ParseError
            raise SwarmError(f"{option} {value!r} is not a multiaddr; expected e.g. {EXAMPLE}") from None
        protocols = {p.name for p in address.protocols()}
        if need_peer_id and "p2p" not in protocols:
            raise SwarmError(f"{option} {value!r} lacks the peer id part /p2p/12D3KooW...; "
                             f"copy the full address the bootstrap peer printed")
        if not need_peer_id and "p2p" in protocols:
            raise SwarmError(f"{option} {value!r} must not include /p2p/...: it names a local listening address")
        checked.append(value)
    return checked


async def start_dht_node(
    initial_peers: Sequence[str] = (),
    host_maddrs: Sequence[str] = DEFAULT_HOST_MADDRS,
    announce_maddrs: Sequence[str] = (),
    identity_path: str | None = None,
    client_mode: bool = False,
    record_validator: RecordValidatorBase | None = None,
) -> DHTNode:
    """Start a p2p daemon and a DHT node in the running loop; bootstrap from ``initial_peers`` if any."""
    initial_peers = check_multiaddrs(initial_peers, "--initial-peers", need_peer_id=True)
    host_maddrs = check_multiaddrs(host_maddrs, "--host-maddrs", need_peer_id=False)
    announce_maddrs = check_multiaddrs(announce_maddrs, "--announce-maddrs", need_peer_id=False)
    for address in map(Multiaddr, announce_maddrs):
        if any(proto in address and address[proto] == "0" for proto in ("tcp", "udp")):
            raise SwarmError(f"--announce-maddrs '{address}' has port 0; announce the real port others can reach")
    if identity_path is not None:
        claim_identity(identity_path)
    try:
        return await DHTNode.create(
            initial_peers=list(initial_peers),
            host_maddrs=list(host_maddrs),
            announce_maddrs=list(announce_maddrs) or None,
            identity_path=identity_path,
            client_mode=client_mode,
            record_validator=record_validator,
        )
    except P2PDaemonError as e:
        release_identity(identity_path)
        text = str(e)
        if "failed to connect to bootstrap peers" in text:
            raise SwarmError(f"could not reach any bootstrap peer in {', '.join(initial_peers)}: "
                             f"check the address and that the peer is running") from None
        if "already taken" in text:
            raise SwarmError(f"identity {identity_path} is already used by a live peer; "
                             f"stop that peer or pass another --identity") from None
        raise SwarmError(f"could not start the p2p daemon: {text.splitlines()[-1] if text else e!r}") from None
    except RuntimeError as e:
        release_identity(identity_path)
        if "bootstrap failed" in str(e):
            raise SwarmError(f"no bootstrap peer in {', '.join(initial_peers)} answered a DHT ping; "
                             f"is it a hivemind DHT peer of a compatible version?") from None
        raise


async def visible_maddrs(node: DHTNode) -> list[str]:
    """Full addresses others can join through: /ip4/.../tcp/.../p2p/<peer id>."""
    return [str(address) for address in await node.protocol.p2p.get_visible_maddrs()]
