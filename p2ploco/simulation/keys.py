"""RSA keys for simulated peers. A peer's id is its key's (libp2p) and its records are signed with it, as in a real
swarm; a 2048-bit key takes ~40 ms to make, so keys are made once and kept in a cache file that later simulations
read (at most ``count`` are made per call: a simulation of 4,096 peers makes them once)."""

from __future__ import annotations

import os
import struct
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.utils.crypto import RSAPrivateKey

CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "p2ploco" / "simulation-keys.bin"
LENGTH = struct.Struct(">I")


def simulation_keys(count: int, cache: Path = CACHE) -> list[RSAPrivateKey]:
    """``count`` distinct keys, the same ones on every call (those in ``cache`` first, new ones appended to it)."""
    known = _read(cache)
    made = [RSAPrivateKey() for _ in range(count - len(known))]
    if made:
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            with cache.open("ab") as out:
                for key in made:
                    raw = key.to_bytes()
                    out.write(LENGTH.pack(len(raw)) + raw)
        except OSError:  # a read-only home: the keys serve this run, and the next one makes them again
            pass
    return (known + made)[:count]


class _CachedKey(RSAPrivateKey):
    """A key read back from the cache without hivemind's check of its numbers (~40 ms a key; it was made here)."""

    def __init__(self, private: rsa.RSAPrivateKey):
        self._private_key = private  # where hivemind's RSAPrivateKey keeps it


def _key(raw: bytes) -> RSAPrivateKey:
    private = serialization.load_der_private_key(raw, password=None, unsafe_skip_rsa_key_validation=True)
    if not isinstance(private, rsa.RSAPrivateKey):
        raise ValueError("not an RSA key")
    return _CachedKey(private)


def _read(cache: Path) -> list[RSAPrivateKey]:
    try:
        data = cache.read_bytes()
    except FileNotFoundError:
        return []
    keys, offset = [], 0
    while offset + LENGTH.size <= len(data):
        (length,) = LENGTH.unpack_from(data, offset)
        raw = data[offset + LENGTH.size:offset + LENGTH.size + length]
        if len(raw) < length:  # a write cut short: the keys before it stand
            break
        try:
            keys.append(_key(raw))
        except ValueError:
            break
        offset += LENGTH.size + length
    return keys
