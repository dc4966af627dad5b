"""DHT-level rules for p2ploco's keys: who may write a record, and what a stored value may look like.

A peer record's subkey is its owner's RSA public key and its value carries the owner's signature (hivemind's
RSASignatureValidator): only the owner can write its record. ``RecordSchema`` adds p2ploco's own rules on top.
Every DHT node applies these validators to what it stores, and every reader to what it receives: a record with a
bad signature or schema is dropped by the DHT layer and never reaches the application.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgpack
from cryptography.exceptions import UnsupportedAlgorithm
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import CompositeValidator, DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer, get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from p2ploco.config import MAX_WAIT
from p2ploco.errors import PayloadError
from p2ploco.swarm.evidence import Proof, proofs_key
from p2ploco.swarm.identity import peer_id_of
from p2ploco.swarm.messages import decode
from p2ploco.swarm.records import BOOTSTRAP_RECORDS, RUNS_KEY, PeerRecord, RecordKeys, key_index, run_records

MAX_RECORD_BYTES = 4096  # a record is a few hundred bytes; anything much larger is junk
MAX_RECORD_TTL = MAX_WAIT + 5.0  # the longest swarm.peer_ttl, plus the clock skew DHT peers tolerate


class RecordSchema(RecordValidatorBase):
    """DHT-level rules for p2ploco's keys: a peer record is signed (its subkey names the owner's public key, and
    nothing else, so a key holds one record per run key), parses as PeerRecord, names the signer's own peer id
    (``identity.peer_id_of``: nobody publishes for another peer), lies under its owner's record key (``RecordKeys.of``:
    a lookup of that key alone finds it), and lapses within ``MAX_RECORD_TTL`` (an
    abandoned record does not linger); run names are short strings; a run's proof (``evidence.proofs_key``) holds
    and is stored under the peer id it accuses, so that nobody can overwrite one with anything else. Other keys
    pass untouched. Every DHT node applies these rules to what it stores, and every reader to what it receives."""

    def __init__(self, listings: Iterable[RecordKeys], run_id: str | None = None):
        # each record key -> (its index, how many keys its listing has)
        self.record_keys = {DHTID.generate(source=key).to_bytes(): (index, len(listing.keys))
                            for listing in listings for index, key in enumerate(listing.keys)}
        self.runs_key = DHTID.generate(source=RUNS_KEY).to_bytes()
        # a run's proofs key -> the run (each proof is checked against its run)
        self.proof_keys = {} if run_id is None else {DHTID.generate(source=proofs_key(run_id)).to_bytes(): run_id}

    def validate(self, record: DHTRecord) -> bool:
        if record.key not in self.record_keys and record.key != self.runs_key and record.key not in self.proof_keys:
            return True
        if len(record.value) > MAX_RECORD_BYTES or record.expiration_time > get_dht_time() + MAX_RECORD_TTL:
            return False
        try:
            subkey, value = MSGPackSerializer.loads(record.subkey), MSGPackSerializer.loads(record.value)
        except (ValueError, TypeError, msgpack.UnpackException):  # undecodable bytes from a peer
            return False
        if record.key == self.runs_key:
            return isinstance(subkey, str) and 0 < len(subkey) <= 64 and isinstance(value, dict)
        if record.key in self.proof_keys:
            try:
                proof = decode(Proof, value)
            except PayloadError:
                return False
            return proof.accused == subkey and proof.holds(self.proof_keys[record.key])
        if not isinstance(subkey, bytes):
            return False
        parsed, (index, keys) = PeerRecord.parse(value), self.record_keys[record.key]
        return parsed is not None and parsed.peer_id == peer_id_of(subkey) and key_index(parsed.peer_id, keys) == index

    def merge_with(self, other: RecordValidatorBase) -> bool:
        if not isinstance(other, RecordSchema):
            return False
        self.record_keys |= other.record_keys
        self.proof_keys |= other.proof_keys
        return True


class SignatureValidator(RSASignatureValidator):
    """hivemind's RSASignatureValidator, except that a record whose embedded public key does not parse is
    refused: hivemind's lets the cryptography library's error escape into its DHT request handlers, so one
    forged record could break a lookup (found by ``benchmarks/fuzz.py``)."""

    def validate(self, record: DHTRecord) -> bool:
        try:
            return super().validate(record)
        except (ValueError, TypeError, UnsupportedAlgorithm):  # what load_ssh_public_key raises on garbage
            return False


def record_validator(signing_key: RSAPrivateKey, run_id: str | None = None) -> tuple[CompositeValidator, bytes]:
    """A validator for a node of ``run_id`` (or a bootstrap peer or client: None) whose records ``signing_key``
    signs, and the subkey they are stored under. The key must be the one behind the node's peer id
    (``identity.Identity``), or others refuse its records."""
    signatures = SignatureValidator(signing_key)
    listings = [BOOTSTRAP_RECORDS] + ([run_records(run_id)] if run_id is not None else [])
    return CompositeValidator([signatures, RecordSchema(listings, run_id)]), signatures.local_public_key
