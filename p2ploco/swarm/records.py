"""Peer records in the DHT: who is in a run, where each peer stands, and what it is doing.

Each node keeps its own record fresh on a heartbeat; a record that is not refreshed expires, and
with it the peer's place in the swarm. All records of a run live under one DHT key, so a single
lookup lists the swarm. The subkey is the owner's RSA public key and the value carries its
signature (hivemind's RSASignatureValidator): only the owner can write its record. Every node, and
``p2ploco peers``, validates records it stores or receives against the schema below; a record with
a bad signature or schema is dropped by the DHT layer and never reaches the application.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgpack
from cryptography.exceptions import UnsupportedAlgorithm
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.node import DHTNode
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import CompositeValidator, DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer, get_dht_time
from hivemind.utils.crypto import RSAPrivateKey
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from p2ploco.config import MAX_WAIT
from p2ploco.swarm.identity import peer_id_of
from p2ploco.swarm.messages import MAX_ROUND, MAX_SLICES, status_of
from p2ploco.swarm.reachability import Reachability
from p2ploco.swarm.wire import DAEMON_ERRORS

logger = logging.getLogger(__name__)


class PeerState(enum.StrEnum):
    """What a peer is doing, as its record says."""

    JOINING = "joining"  # fetching or waiting for the swarm's state
    TRAINING = "training"  # inner steps of its round
    AVERAGING = "averaging"  # in its round's all-reduce
    LEAVING = "leaving"  # finishing up; joins no new group
    SERVING = "serving"  # a bootstrap peer
    STANDBY = "standby"  # a stage peer waiting for a slot, or for the other stages of its pipeline group


BOOTSTRAP_KEY = "p2ploco/bootstrap"  # records of bootstrap peers, shared by all runs
RUNS_KEY = "p2ploco/runs"  # the run ids being trained, so a client can find them
MAX_RECORD_BYTES = 4096  # a record is a few hundred bytes; anything much larger is junk
MAX_RECORD_TTL = MAX_WAIT + 5.0  # the longest swarm.peer_ttl, plus the clock skew DHT peers tolerate
MAX_COUNT = 1 << 62
MAX_TEXT = 256  # longest string field (an address, a device name)
MAX_ADDRESSES = 16
MAX_STAGES = 1024
EVAL_HISTORY = 16  # (round, eval loss) pairs a record keeps, for the trend in `p2ploco status`
STALE_HEARTBEATS = 3  # a record not renewed for this many heartbeats (or half its ttl) belongs to a dead peer


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
    newer versions can add some. Its ``peer_id`` must be the signer's (``RecordSchema``)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    peer_id: Annotated[str, StringConstraints(min_length=1, max_length=64)]
    round: Annotated[int, Field(ge=0, le=MAX_ROUND)]  # the round this peer is working on
    state: status_of(PeerState)
    fingerprint: Short  # of the config parts every peer of a round must share (Config.swarm_fingerprint)
    params_sha256: Short = ""  # hash of the global parameters this peer holds, at the start of `round`
    slices: Annotated[dict[Annotated[str, StringConstraints(max_length=32)], Short],
                      Field(max_length=MAX_SLICES)] = {}  # slice name -> hash of its global parameters, same time
    version: Short = ""
    name: Short = ""  # short human name
    role: Literal["replica", "stage", "bootstrap"] = "replica"  # a full replica, a pipeline stage, a bootstrap
    device: Text = ""
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
    # has not caught up since: its state has no say on the swarm's (``state_rank``)
    unsettled: bool = False
    reachability: status_of(Reachability) = Reachability.PUBLIC  # whether others can dial it (swarm/reachability.py)
    step_seconds: Amount = 0.0  # its inner step's recent median time (0: none yet): sizes the swarm's round budget

    @property
    def dials_out(self) -> bool:
        """Whether this peer only opens streams in rounds (behind a NAT): no span, no coordinating, no
        donating."""
        return Reachability(self.reachability).dials_out

    @classmethod
    def parse(cls, value: object) -> PeerRecord | None:
        """The record in ``value`` if it fits the schema exactly enough to trust its fields, else None."""
        try:
            return cls.model_validate(value)
        except ValidationError:
            return None

    def to_value(self) -> dict[str, Any]:
        # hivemind's serializer takes no str subclass
        return {**self.model_dump(), "state": str(self.state), "reachability": str(self.reachability)}

    @property
    def active(self) -> bool:
        """Training or averaging with a known state: a peer others can average with or fetch from."""
        return self.state in (PeerState.TRAINING, PeerState.AVERAGING) and bool(self.slices)


_ADJECTIVES = ("amber", "bold", "brisk", "calm", "clever", "cosmic", "crisp", "dapper", "eager", "fuzzy",
               "gentle", "golden", "happy", "humble", "jolly", "keen", "lively", "lucky", "mellow", "nimble",
               "noble", "plucky", "quiet", "rapid", "rustic", "silver", "sleek", "sunny", "swift", "tidy",
               "vivid", "witty")
_ANIMALS = ("badger", "beaver", "bison", "crane", "dingo", "eagle", "falcon", "ferret", "gecko", "heron",
            "ibex", "jackal", "koala", "lemur", "lynx", "marmot", "moose", "newt", "ocelot", "otter", "panda",
            "puffin", "quokka", "raven", "salmon", "stoat", "tapir", "toucan", "walrus", "wombat", "yak", "zebra")


def human_name(peer_id: str) -> str:
    """A short name derived from the peer id (the same peer keeps it across restarts), e.g. swift-otter-7Kq2."""
    digest = DHTID.generate(source=peer_id)
    return f"{_ADJECTIVES[digest % 32]}-{_ANIMALS[(digest >> 5) % 32]}-{peer_id[-4:]}"


class RecordSchema(RecordValidatorBase):
    """DHT-level rules for p2ploco's keys: a peer record is signed (its subkey names the owner's public key, and
    nothing else, so a key holds one record per run key), parses as PeerRecord, names the signer's own peer id
    (``identity.peer_id_of``: nobody publishes for another peer), and lapses within ``MAX_RECORD_TTL`` (an
    abandoned record does not linger); run names are short strings. Other keys pass untouched. Every DHT node
    applies these rules to what it stores, and every reader to what it receives."""

    def __init__(self, record_keys: Iterable[str]):
        self.record_keys = {DHTID.generate(source=key).to_bytes() for key in record_keys}
        self.runs_key = DHTID.generate(source=RUNS_KEY).to_bytes()

    def validate(self, record: DHTRecord) -> bool:
        if record.key not in self.record_keys and record.key != self.runs_key:
            return True
        if len(record.value) > MAX_RECORD_BYTES or record.expiration_time > get_dht_time() + MAX_RECORD_TTL:
            return False
        try:
            subkey, value = MSGPackSerializer.loads(record.subkey), MSGPackSerializer.loads(record.value)
        except (ValueError, TypeError, msgpack.UnpackException):  # undecodable bytes from a peer
            return False
        if record.key == self.runs_key:
            return isinstance(subkey, str) and 0 < len(subkey) <= 64 and isinstance(value, dict)
        if not isinstance(subkey, bytes):
            return False
        parsed = PeerRecord.parse(value)
        return parsed is not None and parsed.peer_id == peer_id_of(subkey)

    def merge_with(self, other: RecordValidatorBase) -> bool:
        if not isinstance(other, RecordSchema):
            return False
        self.record_keys |= other.record_keys
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
    keys = [BOOTSTRAP_KEY] + ([peers_key(run_id)] if run_id is not None else [])
    return CompositeValidator([signatures, RecordSchema(keys)]), signatures.local_public_key


@dataclass(frozen=True)
class SwarmState:
    """A state of one slice that some active peers hold: the round it starts and the hash of the slice's
    parameters, the peers that hold it (the donors a lagging peer fetches from), and whether two or more
    peers vouch for it."""

    round: int
    slice: str
    state_sha256: str  # ``metrics.state_sha256`` of the slice
    holders: tuple[str, ...]

    @property
    def vouched(self) -> bool:
        return len(self.holders) >= 2


def active_peers(live: dict[str, PeerRecord], me: PeerRecord) -> list[PeerRecord]:
    """The other peers of our config that train or average from a known state."""
    return [r for r in live.values() if r.peer_id != me.peer_id and r.fingerprint == me.fingerprint and r.active]


def state_rank(holders: Sequence[PeerRecord], digest: str) -> tuple[int, int, str]:
    """How a state of one slice at one round ranks against the others held there: by its holders whose last round
    settled (a peer left out of its last round, alone in it, or without its decision may hold a state the others
    have moved past: it has no say), then by all its holders, then by the hash, so that every peer with the same
    view ranks alike. The one rule of the swarm's state: a round's formation (``round_state``), the coordinator's
    choice among members (``rounds.admit``) and the state a peer catches up to (``ranked_states``) follow it."""
    return sum(not r.unsettled for r in holders), len(holders), digest


def ranked_states(live: dict[str, PeerRecord], me: PeerRecord, slice_name: str) -> list[SwarmState]:
    """The states of ``slice_name`` to follow, seen from ``me``, best first; empty when no other active peer of
    our config holds that slice.

    A state ranks by the peers whose signed records hold it (``state_rank``: those whose last round settled first,
    then all), never by how far ahead it claims to be: records that claim a round ahead of everyone, from one
    attacker with a few keys, lose to the peers that actually train, as long as those are more. Among equals the
    earlier round (while the swarm moves to the next round, some of it is still at the last: an attacker's
    claim of the next round ties with the honest peers that moved already, and loses), then the hash, so that
    every peer with the same view ranks alike. A state two or more peers hold is vouched for; among lone claims
    the furthest round comes first instead (a swarm of two, one of them restarted, agrees on nothing), and the
    caller follows one only if its holder actually serves that state (a liar that serves nothing is passed
    over)."""
    peers = [r for r in active_peers(live, me) if slice_name in r.slices]
    if not peers:
        return []
    holders: dict[tuple[int, str], list[PeerRecord]] = {}
    for r in peers + ([me] if me.active and slice_name in me.slices else []):
        holders.setdefault((r.round, r.slices[slice_name]), []).append(r)
    def rank(state: tuple[int, str]) -> tuple[int, int, int, str]:
        settled, count, digest = state_rank(holders[state], state[1])
        return settled, count, -state[0] if count >= 2 else state[0], digest

    ranked = sorted(holders, key=rank, reverse=True)
    return [SwarmState(state[0], slice_name, state[1], tuple(sorted(r.peer_id for r in holders[state])))
            for state in ranked]


def swarm_state(live: dict[str, PeerRecord], me: PeerRecord, slice_name: str) -> SwarmState | None:
    """The best state of ``slice_name`` that two or more peers vouch for (see ``ranked_states``), or None."""
    return next((state for state in ranked_states(live, me, slice_name) if state.vouched), None)


def round_state(live: dict[str, PeerRecord], me: PeerRecord, round_index: int, banned: set[str] = frozenset()
                ) -> tuple[str, dict[str, str]]:
    """The state the swarm starts ``round_index`` from, seen from ``me``: for every slice that an active peer of
    our config holds at that round (``me`` included), the state ``state_rank`` puts first, and one digest of them
    all. Every peer with the same view computes the same; it names the round's formation.
    Peers ``me`` has banned have no vote: while the others' records still show the previous
    round, one banned peer's stale hash would tie with ours and could win the tie."""
    held = _holders_at(live, me, round_index, banned)
    chosen = {name: max(states, key=lambda digest: state_rank(states[digest], digest))
              for name, states in sorted(held.items())}
    combined = hashlib.sha256(";".join(f"{name}={digest}" for name, digest in chosen.items()).encode()).hexdigest()
    return combined, chosen


def contested(live: dict[str, PeerRecord], me: PeerRecord, round_index: int, banned: set[str] = frozenset()) -> bool:
    """Whether the peers that vote on ``round_index``'s starting state (``round_state``) hold more than one hash
    of some slice."""
    return any(len(states) > 1 for states in _holders_at(live, me, round_index, banned).values())


def _holders_at(live: dict[str, PeerRecord], me: PeerRecord, round_index: int, banned: set[str]
                ) -> dict[str, dict[str, list[PeerRecord]]]:
    """For every slice, who holds each of its hashes among the peers voting on ``round_index``'s starting state:
    the active peers of our config at that round, ``me`` included, those ``me`` has banned left out."""
    held: dict[str, dict[str, list[PeerRecord]]] = {}
    for r in active_peers(live, me) + [me]:
        if r.round == round_index and r.peer_id not in banned:
            for name, digest in r.slices.items():
                held.setdefault(name, {}).setdefault(digest, []).append(r)
    return held


def settled(live: dict[str, PeerRecord], me: PeerRecord, round_index: int) -> bool:
    """Whether at least half of the other active peers of our config work past ``round_index`` (or there are
    none): a record stuck at an old round, honest or not, cannot hold the others up."""
    others = active_peers(live, me)
    return 2 * sum(r.round > round_index for r in others) >= len(others)


def peers_key(run_id: str) -> str:
    return f"p2ploco/{run_id}/peers"


def parse_records(found: object, now: float) -> dict[str, tuple[PeerRecord, float]]:
    """Records and their expiry from a DHT dictionary value, by peer id (one each: a record names its signer)."""
    records: dict[str, tuple[PeerRecord, float]] = {}
    if not isinstance(found, dict):
        return records
    for item in found.values():
        record = PeerRecord.parse(getattr(item, "value", None))
        expires = getattr(item, "expiration_time", None)
        if record is None or not isinstance(expires, float) or expires <= now:
            continue
        if record.peer_id not in records or records[record.peer_id][1] < expires:
            records[record.peer_id] = (record, expires)
    return records


class PeerDirectory:
    """This node's record (published on a heartbeat, and in the background when it changes) and the last view
    of everyone's (refreshed on the heartbeat)."""

    def __init__(self, node: DHTNode, key: str, owner: bytes, me: PeerRecord, interval: float, ttl: float,
                 run_id: str | None = None):
        self.node, self.key, self.owner, self.me, self.interval, self.ttl = node, key, owner, me, interval, ttl
        self.run_id = run_id  # listed under RUNS_KEY while this peer trains it
        self.live: dict[str, PeerRecord] = {}
        self.refreshed_at = -math.inf  # local time of the last lookup of everyone's records
        self.moved_at = -math.inf  # local time this node's record last changed round or state
        self.watchers: set[asyncio.Event] = set()  # set after every lookup, for whoever waits on the view
        self._expires: dict[str, float] = {}  # DHT time at which each record in `live` lapses
        self._refreshed: dict[str, float] = {}  # local time at which each record was last seen renewed
        self._tasks: list[asyncio.Task] = []
        self._started = time.monotonic()
        self._changes = 0  # updates of this node's record so far
        self._attempted = 0  # updates that a finished store (successful or not) has carried
        self._stored = asyncio.Condition()
        self._dirty = asyncio.Event()
        self.live_fields: Callable[[], dict[str, Any]] = dict  # fields that change between updates

    async def publish(self, list_run: bool = False) -> None:
        """Store this node's record now (and, on the heartbeat, list its run: that listing only has to outlive
        the record's ttl, so state changes do not store it again)."""
        for name, value in self.live_fields().items():
            setattr(self.me, name, value)
        self.me.uptime = round(time.monotonic() - self._started, 1)
        changes = self._changes
        expires = get_dht_time() + self.ttl
        stores = [self.node.store(self.key, subkey=self.owner, value=self.me.to_value(), expiration_time=expires)]
        if list_run and self.run_id is not None:
            stores.append(self.node.store(RUNS_KEY, subkey=self.run_id, value={"version": self.me.version},
                                          expiration_time=expires))
        try:
            ok, *_ = await asyncio.gather(*stores)
        finally:
            async with self._stored:
                self._attempted = max(self._attempted, changes)
                self._stored.notify_all()
        if not ok:
            logger.debug("peer record was not stored by any DHT peer")

    def update_soon(self, **changes: object) -> int:
        """Change this node's record now and publish it in the background (a burst of changes costs one store);
        returns the change's number, for ``flush``."""
        for name, value in changes.items():
            setattr(self.me, name, value)
        if {"round", "slices"} & set(changes):
            self.moved_at = time.monotonic()
        self._changes += 1
        self._dirty.set()
        return self._changes

    async def flush(self, change: int | None = None, timeout: float = 10.0) -> bool:
        """Wait until a store has carried ``change`` (default: every change so far), for at most ``timeout``
        seconds; False if it has not by then (the DHT is slow or unreachable: the heartbeat keeps trying)."""
        change = self._changes if change is None else change
        async with self._stored:
            try:
                await asyncio.wait_for(self._stored.wait_for(lambda: self._attempted >= change), timeout)
            except TimeoutError:
                return False
        return True

    async def refresh(self) -> dict[str, PeerRecord]:
        """The live records of the run, this node's own included. A lookup may miss records (a DHT peer
        that stalls, a partial answer): records seen before are kept until they lapse, so a peer only
        ever leaves the view by expiring or by a newer record of its own."""
        now = get_dht_time()
        live = {p: r for p, r in self.live.items() if self._expires.get(p, 0.0) > now}
        try:
            found = await self.node.get(self.key, latest=True)
        except DAEMON_ERRORS as e:  # the daemon or a link failed mid-lookup
            logger.info(f"peer lookup failed, keeping the last view: {e!r}")
            found = None
        for peer_id, (record, expires) in parse_records(getattr(found, "value", None), now).items():
            if expires > self._expires.get(peer_id, 0.0):
                self._refreshed[peer_id] = time.monotonic()
            live[peer_id], self._expires[peer_id] = record, expires
        live[self.me.peer_id] = self.me
        self.live, self.refreshed_at = live, time.monotonic()
        for watcher in self.watchers:
            watcher.set()
        return live

    def rates(self, peers: Iterable[str]) -> list[float]:
        """The link rates (Mbit/s, 0: not stated) that ``peers`` state in their records, as last seen."""
        return [self.live[p].bandwidth_mbit for p in peers if p in self.live]

    async def view(self) -> dict[str, PeerRecord]:
        """The live records as the heartbeat last saw them if it looked since this node moved to its current
        round (the others publish theirs as they move, too); otherwise a fresh lookup."""
        return self.live if self.refreshed_at > self.moved_at else await self.refresh()

    def of_run(self, peer_id: str) -> bool:
        """Whether ``peer_id`` has a live record of this run's config, as last seen (this peer's own included)."""
        record = self.live.get(peer_id)
        return (record is not None and record.fingerprint == self.me.fingerprint and record.state != PeerState.LEAVING
                and self.fresh(peer_id))

    def dials_out(self, peer_id: str) -> bool:
        """Whether ``peer_id``'s record (this peer's own included) says it cannot be dialled in rounds, as last seen."""
        record = self.me if peer_id == self.me.peer_id else self.live.get(peer_id)
        return record is not None and record.dials_out

    def fresh(self, peer_id: str) -> bool:
        """Whether ``peer_id``'s record was renewed lately: a crashed peer stops renewing it long before it lapses."""
        stale_after = max(STALE_HEARTBEATS * self.interval, self.ttl / 2)
        return peer_id == self.me.peer_id or time.monotonic() - self._refreshed.get(peer_id, 0.0) < stale_after

    async def update(self, **changes: object) -> None:
        """Change this node's record and wait until it is stored (where it must be, e.g. before leaving)."""
        await self.flush(self.update_soon(**changes), timeout=math.inf)

    def start_heartbeat(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._heartbeat()), loop.create_task(self._publish_changes())]

    async def _heartbeat(self) -> None:
        while True:
            started = time.monotonic()
            try:
                await asyncio.gather(self.publish(list_run=True), self.refresh())
            except DAEMON_ERRORS as e:  # a DHT hiccup must not end the heartbeat
                logger.warning(f"heartbeat failed: {e!r}")
            except Exception:  # nor a bug: the peer would vanish from the swarm while still training
                logger.exception("heartbeat failed unexpectedly")
            await asyncio.sleep(max(0.0, self.interval - (time.monotonic() - started)))

    async def _publish_changes(self) -> None:
        """Store the record whenever it changed: state changes reach the others within a store's time, without
        the caller waiting for it."""
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            try:
                await self.publish()
            except DAEMON_ERRORS as e:  # the heartbeat stores it again soon
                logger.warning(f"publishing this peer's record failed: {e!r}")
            except Exception:  # a bug: keep publishing, and say where it is
                logger.exception("publishing this peer's record failed unexpectedly")

    async def wait_for_peers(self, count: int, timeout: float, stop: threading.Event) -> int:
        """Wait until ``count`` peers of our config (this one included) are present and have published the
        state they start from, or the run is already under way (someone trains), or ``stop`` is set; return how
        many are present."""
        deadline = time.monotonic() + timeout
        while True:
            peers = [r for r in (await self.refresh()).values()
                     if r.fingerprint == self.me.fingerprint and r.state != PeerState.LEAVING and r.slices]
            if len(peers) >= count or any(r.active for r in peers) or time.monotonic() >= deadline or stop.is_set():
                return len(peers)
            await asyncio.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
