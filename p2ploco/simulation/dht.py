"""A Kademlia model of hivemind's DHT, for the real ``PeerDirectory`` of simulated peers (``SimDHTNode``: the calls
of hivemind's ``DHTNode`` that p2ploco makes).

The DHT's servers are the peers others can dial (and bootstrap nodes); each has hivemind's node id. A value under a
key lives on the ``REPLICAS`` servers nearest the key's id by XOR distance, as hivemind's ``store`` writes it
(``num_replicas`` = 5). Values are hivemind's bytes: the real serializer and the node's real record validator
(``swarm/schema.py``: a peer record is signed on store and checked, its signature stripped, on read), so a record
weighs what it weighs in the real DHT. A store reaches every replica (each checks it), a lookup of the latest
values hears from every replica (hivemind's traversal does not stop at the first value), and both first
walk ``hops`` routing round trips (their time only: routing bytes are left out, as ``PeerDirectory.dht_bytes``
leaves them out). The bytes a server takes in and sends out are counted
(``served``): that the replicas of one key serve every lookup of it is what this model is for. Every message goes
over the simulated links, so a lookup that returns many records takes the time their bytes need."""

from __future__ import annotations

import asyncio
import math
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.p2p import PeerID
from hivemind.utils import MSGPackSerializer
from hivemind.utils.timed_storage import ValueWithExpiration

from p2ploco.simulation.network import SimNetwork, SimP2P

REPLICAS = 5  # hivemind's DHTNode num_replicas
BUCKET = 20  # hivemind's bucket_size: nodes a routing answer names
CHECKED_KEPT = 1 << 18  # record checks remembered


@dataclass
class SimDHT:
    network: SimNetwork
    servers: dict[DHTID, str] = field(default_factory=dict)  # node id -> peer id of each server
    # key id -> subkey bytes -> (signed value bytes, expiration), as each key's replicas hold it (kept once: the
    # replicas of a key hold the same values in this model)
    storage: dict[DHTID, dict[bytes, tuple[bytes, float]]] = field(default_factory=lambda: defaultdict(dict))
    served: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # server -> bytes in and out
    # a record's signed bytes -> its subkey and value as a lookup returns them (loaded, the signature stripped), or
    # None if it does not validate: a record is checked and loaded once for all simulated peers (both are pure
    # functions of its bytes, every peer of a run holds the same validator, and nothing changes what a lookup
    # returned), which a real peer does for every record of every lookup
    _opened: dict[tuple[bytes, bytes, bytes, float], tuple[Any, ValueWithExpiration] | None] = field(
        default_factory=dict)
    _replicas: dict[DHTID, list[str]] = field(default_factory=dict)  # per key, while no server comes or goes

    def opened(self, record: DHTRecord, validator: RecordValidatorBase) -> tuple[Any, ValueWithExpiration] | None:
        """``record``'s subkey and value without its signature, loaded, if ``validator`` takes it, else None."""
        key = (record.key, record.subkey, record.value, record.expiration_time)
        if key not in self._opened:
            if len(self._opened) > CHECKED_KEPT:
                self._opened.clear()
            self._opened[key] = (MSGPackSerializer.loads(record.subkey), ValueWithExpiration(
                MSGPackSerializer.loads(validator.strip_value(record)), record.expiration_time)
            ) if validator.validate(record) else None
        return self._opened[key]

    def serve(self, peer: str) -> None:
        self.servers[DHTID.generate(source=peer)] = peer
        self._replicas.clear()

    def leave(self, peer: str) -> None:
        self.servers.pop(DHTID.generate(source=peer), None)
        self._replicas.clear()

    def replicas(self, key_id: DHTID) -> list[str]:
        """The servers nearest ``key_id`` (every store and lookup asks; found again after a server came or went)."""
        if key_id not in self._replicas:
            nearest = sorted(self.servers, key=key_id.xor_distance)[:REPLICAS]
            self._replicas[key_id] = [self.servers[node] for node in nearest]
        return self._replicas[key_id]

    @property
    def hops(self) -> int:
        return max(1, math.ceil(math.log2(max(2, len(self.servers) / BUCKET))))

    async def route(self, peer: str) -> None:
        """The routing walk toward a key before a store or lookup: ``hops`` round trips from ``peer``."""
        await asyncio.sleep(self.hops * 2 * self.network.links[peer].latency)

    def carry(self, sender: str, receiver: str, size: int, through: str) -> float:
        """``size`` bytes from ``sender`` to ``receiver``, counted at ``through``, the server taking or sending them:
        when they arrive. A store or lookup sends its messages at once and waits for the last (``until``): one timer
        for them all, not one task each (a lookup of everyone is 32 keys times 5 replicas)."""
        self.served[through] += size
        return self.network.carry(sender, receiver, size)[1]

    async def until(self, arrivals: list[float]) -> None:
        """Wait for the last of ``arrivals``."""
        await asyncio.sleep(max([0.0, *(a - self.network.loop.time() for a in arrivals)]))


class SimDHTNode:
    """One peer's DHT node: store and get through the model, with the peer's own record validator."""

    def __init__(self, dht: SimDHT, p2p: SimP2P, validator: RecordValidatorBase, server: bool):
        self.dht, self.p2p, self.validator = dht, p2p, validator
        self.protocol = _Protocol(p2p)
        self.peer_id: PeerID = p2p.peer_id
        if server:
            dht.serve(str(self.peer_id))

    async def store(self, key: str, value: Any, expiration_time: float, subkey: Any = None, **_: Any) -> bool:
        me, key_id = str(self.peer_id), DHTID.generate(source=key)
        subkey_bytes = MSGPackSerializer.dumps(subkey)
        record = DHTRecord(key_id.to_bytes(), subkey_bytes, MSGPackSerializer.dumps(value), expiration_time)
        signed = self.validator.sign_value(record)
        record = DHTRecord(record.key, subkey_bytes, signed, expiration_time)
        await self.dht.route(me)
        replicas = self.dht.replicas(key_id)
        size = len(key_id.to_bytes()) + len(subkey_bytes) + len(signed) + 16
        await self.dht.until([self.dht.carry(me, replica, size, through=replica) for replica in replicas])
        if not replicas or self.dht.opened(record, self.validator) is None:
            return False
        held = self.dht.storage[key_id]
        if subkey_bytes not in held or held[subkey_bytes][1] <= expiration_time:
            held[subkey_bytes] = (signed, expiration_time)
        return True

    async def get_many(self, keys: tuple[str, ...], sufficient_expiration_time: float | None = None, **_: Any
                       ) -> dict[str, ValueWithExpiration | None]:
        """Each key's values, as one traversal finds them (hivemind's ``get_many``): one routing walk, then every
        replica of each key answers (``sufficient_expiration_time`` infinite, as ``latest=True`` asks), or the
        first only."""
        me = str(self.peer_id)
        await self.dht.route(me)
        now, arrivals, held = time.time(), [], {}
        ids = {key: DHTID.generate(source=key) for key in keys}
        for key, key_id in ids.items():
            held[key] = {s: (v, e) for s, (v, e) in self.dht.storage.get(key_id, {}).items() if e > now}
            self.dht.storage[key_id] = held[key]
            size = sum(len(s) + len(v) + 8 for s, (v, _) in held[key].items()) + 32
            replicas = self.dht.replicas(key_id)
            asked = replicas if sufficient_expiration_time == math.inf else replicas[:1]
            arrivals += [self.dht.carry(replica, me, size, through=replica) for replica in asked]
        await self.dht.until(arrivals)
        return {key: self._found(key_id, held[key]) for key, key_id in ids.items()}

    def _found(self, key_id: DHTID, held: dict[bytes, tuple[bytes, float]]) -> ValueWithExpiration | None:
        """The values under ``key_id`` that this peer's validator takes, of those its replicas ``held``."""
        if not held or not self.dht.replicas(key_id):
            return None
        found = {}
        for subkey_bytes, (signed, expires) in held.items():
            opened = self.dht.opened(DHTRecord(key_id.to_bytes(), subkey_bytes, signed, expires), self.validator)
            if opened is not None:
                found[opened[0]] = opened[1]
        return ValueWithExpiration(found, max(e for _, e in held.values())) if found else None


@dataclass
class _Protocol:
    p2p: SimP2P
