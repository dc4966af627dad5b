"""A peer's identity: one RSA key behind both its libp2p peer id and the signatures of its DHT records.

libp2p derives an RSA peer's id from its public key (the sha256 multihash of the key's protobuf form), and
hivemind's record signatures name the signer's public key in the record's subkey (``[owner:ssh-rsa ...]``). When
the two keys are one, a reader computes the signer's peer id from the subkey and refuses a record whose
``peer_id`` field names anyone else: nobody can publish a record for another peer (a "leaving" record that hides
it, a second record that outvotes it), and each key holds one record per run key. A node started without
``--identity`` gets a fresh key of the same kind, written where only its p2p daemon reads it and removed once
the daemon has started.

Identity files are claimed for the life of the process: a second live node on the same machine that is given
the same file is refused in one line (hivemind's own check, a dial to the peer id, catches one elsewhere).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import re
import secrets
import tempfile
from dataclasses import dataclass
from pathlib import Path

import multihash
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from google.protobuf.message import DecodeError
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey

from p2ploco.errors import SwarmError

OWNER_SUBKEY = re.compile(rb"\[owner:(ssh-rsa [A-Za-z0-9+/=]{1,2048})\]")  # hivemind's RSASignatureValidator form
_held_identities: dict[str, int] = {}  # identity file -> the descriptor that holds its lock while this process runs


@dataclass(frozen=True)
class Identity:
    """The key file the p2p daemon reads, and the same key, which signs this peer's records."""

    path: str
    key: RSAPrivateKey
    ephemeral: bool  # made for this run of the process: no other peer can hold it, and nothing keeps it

    @classmethod
    def claim(cls, path: str) -> Identity:
        """The identity in ``path`` (created if missing), held by this process until ``release``."""
        claim_identity(path)
        try:
            return cls(path, _signing_key(Path(path).read_bytes()), ephemeral=False)
        except (OSError, ValueError) as e:
            release_identity(path)
            raise SwarmError(f"--identity {path} is not a readable libp2p RSA key file ({e}); move it away to get a "
                             f"new identity") from None

    @classmethod
    def fresh(cls) -> Identity:
        """A new identity in a private temporary file (``release`` removes it once the daemon has read it)."""
        serialized = new_key_file()
        descriptor, path = tempfile.mkstemp(prefix="p2ploco-identity-")
        with os.fdopen(descriptor, "wb") as f:
            f.write(serialized)
        return cls(path, _signing_key(serialized), ephemeral=True)

    def release(self) -> None:
        """Remove an ephemeral key file (the daemon read it as it started), or let another process claim this one."""
        if self.ephemeral:
            Path(self.path).unlink(missing_ok=True)
        else:
            release_identity(self.path)


def new_key_file() -> bytes:
    """A fresh RSA key in the libp2p key-file form that ``--identity`` names and the p2p daemon reads."""
    return crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=RSAPrivateKey().to_bytes()).SerializeToString()


def _signing_key(serialized: bytes) -> RSAPrivateKey:
    """hivemind's RSAPrivateKey for the key in a libp2p key file (ValueError if it holds no RSA key)."""
    try:
        stored = crypto_pb2.PrivateKey.FromString(serialized)
    except DecodeError:
        raise ValueError("not a libp2p key file") from None
    if stored.key_type != crypto_pb2.KeyType.RSA:
        raise ValueError("not an RSA key")
    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key.__setstate__({"_private_key": stored.data})  # hivemind's own way back from the DER bytes (its pickling)
    return key


@functools.lru_cache(maxsize=4096)
def peer_id_of(subkey: bytes) -> str | None:
    """The libp2p peer id of the RSA key that a record subkey (``[owner:ssh-rsa ...]``, exactly) names, or None if the
    subkey is anything else."""
    match = OWNER_SUBKEY.fullmatch(subkey)
    if match is None:
        return None
    try:
        public = serialization.load_ssh_public_key(match.group(1))
    except (ValueError, UnsupportedAlgorithm):  # what cryptography raises on a malformed or unknown key
        return None
    if not isinstance(public, rsa.RSAPublicKey):
        return None
    der = public.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    return PeerID(multihash.encode(hashlib.sha256(encoded).digest(), multihash.coerce_code("sha2-256"))).to_base58()


def claim_identity(path: str) -> None:
    """Make sure the identity file exists, creating it atomically if it does not (two nodes started at once
    with a new --identity must not both write one and run under the same peer id), and hold an exclusive lock
    on it for this process's life: a second live holder on this machine is refused with a SwarmError."""
    target = Path(path)
    if not target.parent.is_dir():
        raise SwarmError(f"--identity {path}: the folder {target.parent} does not exist")
    if not target.exists():
        temporary = target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}")
        temporary.write_bytes(new_key_file())
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
