"""Peer records in the DHT: who is in a run, where each peer stands, and what it is doing.

Each node keeps its own record fresh on a heartbeat (``swarm/directory.py``); a record that is not refreshed
expires, and with it the peer's place in the swarm. A run's records are spread over ``RUN_RECORD_KEYS`` DHT keys
(``RecordKeys``), each peer's under the one its id hashes to: one lookup of them all (``read_entries``) lists the
swarm, one key finds a given peer, and no DHT node stores or serves every record of a run (under one key, the
five nodes nearest it answered every lookup of the swarm, and past ~3,000 peers the answer outgrew hivemind's
4 MiB message). The subkey is the owner's RSA public key and the value carries its signature: only the owner can
write its record (``swarm/schema.py``), and only under its own record key. A record is read from anyone,
so it is a strict, bounded pydantic model: every node, and ``p2ploco peers``, parses what it stores or receives
with it, and a record that does not fit is dropped by the DHT layer and never reaches the application.
"""

from __future__ import annotations

import enum
import hashlib
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from p2ploco.swarm.messages import MAX_ROUND, MAX_SLICES, status_of


class Reachability(enum.StrEnum):
    """Whether other peers can dial a peer (found out as it starts: swarm/reachability.py)."""

    PUBLIC = "public"  # others can dial it
    RELAYED = "relayed"  # only through a circuit relay
    CLIENT = "client"  # it can only dial out

    @property
    def dials_out(self) -> bool:
        """Whether, in rounds, this peer only opens streams: it reduces no span, coordinates nothing, donates no
        state. A relayed peer too: a round's traffic would go through its relay's link."""
        return self is not Reachability.PUBLIC


class Phase(enum.StrEnum):
    """What a peer is doing, as its record says."""

    JOINING = "joining"  # fetching or waiting for the swarm's state
    TRAINING = "training"  # inner steps of its round
    AVERAGING = "averaging"  # in its round's all-reduce
    LEAVING = "leaving"  # finishing up; joins no new group
    SERVING = "serving"  # a bootstrap peer
    STANDBY = "standby"  # a stage peer waiting for a slot, or for the other stages of its pipeline group


class PeerRole(enum.StrEnum):
    """What a peer is in its run, as its record says: the one place the role names are written (``roles.py``)."""

    REPLICA = "replica"  # a full replica
    STAGE = "stage"  # one stage of a pipeline group
    HUB = "hub"  # a replica that trains nothing: it joins every round with no contribution (``roles.py``)
    BOOTSTRAP = "bootstrap"  # a bootstrap peer: it serves the DHT and trains in no run


BOOTSTRAP_KEY = "p2ploco/bootstrap"  # records of bootstrap peers, shared by all runs
RUNS_KEY = "p2ploco/runs"  # the run ids being trained, so a client can find them
MAX_COUNT = 1 << 62
MAX_TEXT = 256  # longest string field (an address, a device name)
MAX_ADDRESSES = 16
MAX_STAGES = 1024
MAX_RANKS = 1024
EVAL_HISTORY = 16  # (round, eval loss) pairs a record keeps, for the trend in `p2ploco status`


RUN_RECORD_KEYS = 32  # DHT keys a run's records are spread over: ~3,000 records each fit a lookup's answer


@dataclass(frozen=True)
class RecordKeys:
    """The DHT keys a directory's records live under, and which of them holds a given peer's: the one its id
    hashes to. A run's peers have ``RUN_RECORD_KEYS`` (``run_records``), the bootstrap peers, a handful, one."""

    keys: tuple[str, ...]

    def of(self, peer_id: str) -> str:
        return self.keys[key_index(peer_id, len(self.keys))]


def key_index(peer_id: str, keys: int) -> int:
    """Which of ``keys`` record keys holds ``peer_id``'s record: its id's hash, so that nobody chooses it."""
    return int.from_bytes(hashlib.sha256(peer_id.encode()).digest()[:4], "big") % keys


def run_records(run_id: str) -> RecordKeys:
    """The DHT keys under which the peers of ``run_id`` publish their records."""
    return RecordKeys(tuple(f"p2ploco/{run_id}/peers/{index}" for index in range(RUN_RECORD_KEYS)))


BOOTSTRAP_RECORDS = RecordKeys((BOOTSTRAP_KEY,))


async def read_entries(node: Any, keys: Iterable[str]) -> dict[Any, Any]:
    """The DHT entries (subkey -> value with expiration) under ``keys``, merged (``merged_entries``): one traversal
    for all of them (hivemind's ``get_many``), each key's latest values."""
    keys = tuple(keys)
    return merged_entries(await node.get_many(keys, sufficient_expiration_time=math.inf), keys)


def merged_entries(found: dict[str, Any], keys: Iterable[str]) -> dict[Any, Any]:
    """The entries of ``keys`` in a ``get_many`` answer, as one dictionary: a subkey names its owner, and a record
    lies under one key, so entries never collide."""
    entries: dict[Any, Any] = {}
    for key in keys:
        value = getattr(found.get(key), "value", None)
        if isinstance(value, dict):
            entries.update(value)
    return entries


Text = Annotated[str, StringConstraints(max_length=MAX_TEXT)]
Short = Annotated[str, StringConstraints(max_length=64)]
Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]
Amount = Annotated[float, Field(ge=0, allow_inf_nan=False)]  # an int is taken too


def _evaluated(pair: list[float]) -> list[float]:
    if pair[0] != int(pair[0]):
        raise ValueError("the round of an eval is not a whole number")
    return [int(pair[0]), pair[1]]


Evaluation = Annotated[list[Amount], Field(min_length=2, max_length=2), AfterValidator(_evaluated)]


class PeerRecord(BaseModel):
    """A peer's public record: strict and bounded (a record is read from anyone), unknown fields ignored so that
    newer versions can add some. Its ``peer_id`` must be the signer's (``schema.RecordSchema``)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    peer_id: Annotated[str, StringConstraints(min_length=1, max_length=64)]
    round: Annotated[int, Field(ge=0, le=MAX_ROUND)]  # the round this peer is working on
    state: status_of(Phase)
    fingerprint: Short  # of the config parts every peer of a round must share (Config.swarm_fingerprint)
    params_digest: Short = ""  # hash of the global parameters this peer holds, at the start of `round`
    slices: Annotated[dict[Annotated[str, StringConstraints(max_length=32)], Short],
                      Field(max_length=MAX_SLICES)] = {}  # slice name -> hash of its global parameters, same time
    version: Short = ""
    name: Short = ""  # short human name
    # a full replica, a pipeline stage, a hub (a replica that trains nothing: ``roles.py``), a bootstrap peer
    role: status_of(PeerRole) = PeerRole.REPLICA
    device: Text = ""
    # local processes that train it together (``p2ploco.ranks``): shown only, it weighs nothing (a contribution's
    # weight is capped by the run's ``training.max_ranks``, whatever a record says)
    ranks: Annotated[int, Field(ge=1, le=MAX_RANKS)] = 1
    inner_step: Count = 0  # inner steps done in the current round
    loss: Amount | None = None  # mean inner loss of the last finished round
    eval_loss: Amount | None = None  # eval loss after the last finished round
    tokens_per_second: Amount = 0.0  # over the last finished round, communication included
    bytes_sent: Count = 0  # payload bytes of the last round's all-reduce
    bytes_received: Count = 0
    compression: Amount = 0.0  # dense fp32 all-reduce bytes / actual bytes, last round (0: nothing sent)
    round_seconds: Amount = 0.0  # wall time of the last finished round
    bandwidth_mbit: Amount = 0.0  # this peer's link as its operator states it (0: not stated); sizes deadlines
    uptime: Amount = 0.0  # seconds since the node started
    addresses: Annotated[list[Text], Field(max_length=MAX_ADDRESSES)] = []  # multiaddrs others can reach it at
    eval_history: Annotated[list[Evaluation], Field(max_length=EVAL_HISTORY)] = []  # [round, eval loss], oldest first
    group: Short = ""  # a stage peer's pipeline group ("" for replicas)
    stage: Annotated[int, Field(ge=-1, lt=MAX_STAGES)] = -1  # a stage peer's stage in that group (-1 for replicas)
    since: Amount = 0.0  # DHT time at which a stage peer claimed its (group, stage) slot
    schedule: Short = ""  # digest of the inner settings the stages of a pipeline group must share
    # its last round may have ended otherwise for the others (it was left out, alone, or got no decision), and it
    # has not caught up since: its state has no say on the swarm's (``consensus.round_state``)
    unsettled: bool = False
    reachability: status_of(Reachability) = Reachability.PUBLIC  # whether others can dial it (swarm/reachability.py)
    step_seconds: Amount = 0.0  # its inner step's recent median time (0: none yet): sizes the swarm's round budget
    # its one step outlasts the round: it sits rounds out and sets none of their pace (``budget.py``); claiming it
    # leaves only its own step time out of the others' budgets, as an absent peer's
    sits_out: bool = False
    # how long the record lives unrenewed (its run's swarm.peer_ttl): a newcomer counts it while at least half of that
    # is left (``run_config.fresh``), as a live peer renews it on every heartbeat; 0: while it lives
    ttl: Amount = 0.0

    @property
    def dials_out(self) -> bool:
        """Whether this peer only opens streams in rounds (behind a NAT): no span, no coordinating, no
        donating."""
        return Reachability(self.reachability).dials_out

    @property
    def active(self) -> bool:
        """Training or averaging with a known state: a peer others can average with or fetch from."""
        return self.state in (Phase.TRAINING, Phase.AVERAGING) and bool(self.slices)

    @classmethod
    def parse(cls, value: object) -> PeerRecord | None:
        """The record in ``value`` if it fits the schema exactly enough to trust its fields, else None."""
        try:
            return cls.model_validate(value)
        except ValidationError:
            return None

    def to_value(self) -> dict[str, Any]:
        """The record as stored in the DHT: a msgpack-able dict (hivemind's serializer takes no str subclass)."""
        return {**self.model_dump(), "state": str(self.state), "reachability": str(self.reachability),
                "role": str(self.role)}


def parse_records(found: object, now: float,
                  parse: Callable[[Any, Any], PeerRecord | None] = lambda _, item: PeerRecord.parse(
                      getattr(item, "value", None))) -> dict[str, tuple[PeerRecord, float]]:
    """Records and their expiry from a DHT dictionary value, by peer id (one each: a record names its signer);
    ``parse``: the record in one (subkey, entry), None if none."""
    records: dict[str, tuple[PeerRecord, float]] = {}
    if not isinstance(found, dict):
        return records
    for subkey, item in found.items():
        expires = getattr(item, "expiration_time", None)
        if not isinstance(expires, float) or expires <= now:
            continue
        record = parse(subkey, item)
        if record is None:
            continue
        if record.peer_id not in records or records[record.peer_id][1] < expires:
            records[record.peer_id] = (record, expires)
    return records
