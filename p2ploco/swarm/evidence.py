"""What a peer signs and cannot take back, and the proof that two such statements make.

A peer signs, with the key behind its peer id (``swarm/identity.py``), every value others act on and might be told
differently: each result it answers as a reducer (the digest of one piece's aggregate and receipt, for one group,
slice and piece) and each group it hands out as a coordinator (the digest of the group, for one group id). An honest
peer signs one value per question: it reduces a piece of a group once, and forms a group id once. So two different
values signed for one question are a proof that its signer told different peers different things: anyone checks it
with the signer's public key alone, which the proof carries and whose hash is the signer's peer id. Nobody can make
one for an honest peer, since it needs that peer's own signatures.

Every peer that holds a proof (from a decision, a reducer's answer or the DHT) checks it itself, bans the signer for
the rest of the run and passes the proof on: it stores it in the DHT under the run's proof key (``proofs_key``; the
subkey is the signer's peer id, and a DHT node of the run stores and a reader keeps only a proof that holds:
``schema.RecordSchema``), where every peer of the run reads it with the records.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any

import msgpack
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from hivemind.utils.crypto import RSAPrivateKey
from pydantic import Field

from p2ploco.swarm.identity import peer_id_of
from p2ploco.swarm.messages import Digest, Message, PeerId, SliceName, status_of

PIECE_DIGEST_BYTES = 16  # a piece's digest as signed and voted on: 128 bits of sha256
MAX_SIGNATURE = 512  # bytes of an RSA signature (256 for the 2048-bit keys peers have)
MAX_KEY = 2048  # bytes of an OpenSSH public key
_PADDING = padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=padding.PSS.MAX_LENGTH)


class Claim(enum.StrEnum):
    """What a signed statement is about."""

    RESULT = "result"  # a reducer's result for one piece of a group's slice
    GROUP = "group"  # a coordinator's group for one group id


def proofs_key(run_id: str) -> str:
    """The DHT key under which the proofs against the keys of ``run_id`` are kept, one per signer."""
    return f"p2ploco/{run_id}/proofs"


def result_statement(run_id: str, group: str, slice_name: str, start: int, stop: int, digest: bytes) -> bytes:
    """What a reducer signs for the result of the piece [start, stop) of ``slice_name`` it answers every member of
    the group whose digest is ``group`` (``Group.digest``: the id, round, attempt, coordinator and every entry)."""
    return msgpack.packb(["p2ploco/result", run_id, group, slice_name, start, stop, digest], use_bin_type=True)


def group_statement(run_id: str, group_id: str, digest: bytes) -> bytes:
    """What a coordinator signs for the group it hands out under ``group_id`` (``digest``: that group's digest)."""
    return msgpack.packb(["p2ploco/group", run_id, group_id, digest], use_bin_type=True)


class Signer:
    """Signs statements with this peer's key."""

    def __init__(self, key: RSAPrivateKey):
        # this peer's own key, checked as its identity was read: checking it again takes ~40 ms
        self._key = serialization.load_der_private_key(key.to_bytes(), password=None,
                                                       unsafe_skip_rsa_key_validation=True)
        self.public_key: bytes = key.get_public_key().to_bytes()  # OpenSSH form, as record subkeys carry it

    def sign(self, statement: bytes) -> bytes:
        return self._key.sign(statement, _PADDING, hashes.SHA256())


def signed_by(key: bytes, statement: bytes, signature: bytes) -> bool:
    """Whether ``signature`` is the signature of ``statement`` by the OpenSSH RSA public ``key``."""
    try:
        public = serialization.load_ssh_public_key(key)
    except (ValueError, UnsupportedAlgorithm):  # what cryptography raises on a malformed or unknown key
        return False
    if not isinstance(public, rsa.RSAPublicKey):
        return False
    try:
        public.verify(signature, statement, _PADDING, hashes.SHA256())
    except (InvalidSignature, ValueError):
        return False
    return True


def owner_of(key: bytes) -> str | None:
    """The peer id of the OpenSSH RSA public ``key``, or None if it is none."""
    return peer_id_of(b"[owner:" + key + b"]")


class Signed(Message):
    """A value and its signer's signature of the statement it answers."""

    digest: Annotated[bytes, Field(min_length=1, max_length=64)]
    signature: Annotated[bytes, Field(min_length=1, max_length=MAX_SIGNATURE)]


class Proof(Message):
    """Two values one key signed for one question (``Claim``): a result of one piece of one group's slice, or one
    group id's group."""

    claim: status_of(Claim)
    accused: PeerId
    key: Annotated[bytes, Field(min_length=1, max_length=MAX_KEY)]  # the accused's public key (OpenSSH form)
    group_id: Digest
    group: Digest = ""  # with a result: the digest of the group the result is for
    slice: SliceName | None = None  # with a result
    span: Annotated[list[Annotated[int, Field(ge=0, le=1 << 40)]], Field(min_length=2, max_length=2)] = [0, 0]
    first: Signed
    second: Signed

    def statement(self, run_id: str, signed: Signed) -> bytes:
        if self.claim == Claim.RESULT:
            return result_statement(run_id, self.group, self.slice or "", self.span[0], self.span[1], signed.digest)
        return group_statement(run_id, self.group_id, signed.digest)

    def holds(self, run_id: str) -> bool:
        """Whether this proves ``accused`` signed two different values for one question of ``run_id``."""
        return (self.first.digest != self.second.digest and owner_of(self.key) == self.accused
                and (self.claim != Claim.RESULT or (self.slice is not None and self.group != ""))
                and all(signed_by(self.key, self.statement(run_id, s), s.signature) for s in (self.first, self.second)))

    def describe(self) -> str:
        """What it proves, for a log line."""
        if self.claim == Claim.RESULT:
            return (f"it answered two different results for piece {self.span[0]}:{self.span[1]} of {self.slice} in "
                    f"one group")
        return f"it handed out two different versions of group {self.group_id[:16]}"

    def to_value(self) -> dict[str, Any]:
        """The proof as stored in the DHT and sent in decisions: a msgpack-able map."""
        return self.model_dump(mode="python") | {"claim": str(self.claim)}
