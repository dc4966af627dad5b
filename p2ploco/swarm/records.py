"""Peer records in the DHT: each node keeps its own record fresh on a heartbeat; a record that is
not refreshed expires, and with it the peer's place in the swarm.

All records of a run live under one DHT key, one subkey per peer, so a single lookup lists the
swarm. Records from other peers are untrusted input: malformed ones are skipped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import asdict, dataclass

from hivemind.dht.node import DHTNode
from hivemind.utils import get_dht_time

logger = logging.getLogger(__name__)

STATES = ("joining", "training", "averaging", "leaving")


@dataclass
class PeerRecord:
    peer_id: str
    round: int  # the round this peer is working on
    state: str  # one of STATES
    fingerprint: str  # of the config parts every peer of a round must share (Config.swarm_fingerprint)
    params_sha256: str = ""  # hash of this peer's global parameters at the start of `round`
    version: str = ""

    @classmethod
    def parse(cls, peer_id: str, value: object) -> PeerRecord | None:
        if not isinstance(value, dict):
            return None
        round_index, state, fingerprint = value.get("round"), value.get("state"), value.get("fingerprint")
        params, version = value.get("params_sha256", ""), value.get("version", "")
        if (type(round_index) is not int or round_index < 0 or state not in STATES
                or not all(isinstance(text, str) for text in (fingerprint, params, version))):
            return None
        return cls(peer_id, round_index, state, fingerprint, params, version)

    @property
    def active(self) -> bool:
        """Training or averaging with a known state: a peer others can average with or fetch from."""
        return self.state in ("training", "averaging") and bool(self.params_sha256)


@dataclass(frozen=True)
class SwarmState:
    """Where the swarm is: the furthest round its active peers work on, the state most of them hold
    there, and the peers that hold it (the donors a lagging peer fetches from)."""

    round: int
    params_sha256: str
    holders: tuple[str, ...]


def swarm_state(live: dict[str, PeerRecord], me: PeerRecord) -> SwarmState | None:
    """The state to follow, seen from ``me``; None when no other active peer shares our config.

    The furthest round wins; at that round the state held by most peers (ourselves included), ties
    broken by the hash, so every peer with the same view makes the same choice."""
    peers = [r for r in live.values() if r.peer_id != me.peer_id and r.fingerprint == me.fingerprint and r.active]
    if not peers:
        return None
    top = max(r.round for r in peers)
    at_top = [r for r in peers if r.round == top] + ([me] if me.round == top and me.active else [])
    votes = Counter(r.params_sha256 for r in at_top)
    chosen = max(votes, key=lambda digest: (votes[digest], digest))
    return SwarmState(top, chosen, tuple(sorted(r.peer_id for r in at_top if r.params_sha256 == chosen)))


def peers_key(run_id: str) -> str:
    return f"p2ploco/{run_id}/peers"


class PeerDirectory:
    """This node's record (published on a heartbeat) and the last view of everyone's."""

    def __init__(self, node: DHTNode, run_id: str, me: PeerRecord, interval: float, ttl: float):
        self.node, self.key, self.me, self.interval, self.ttl = node, peers_key(run_id), me, interval, ttl
        self.live: dict[str, PeerRecord] = {}
        self._expires: dict[str, float] = {}  # DHT time at which each record in `live` lapses
        self._task: asyncio.Task | None = None

    async def publish(self) -> None:
        value = {k: v for k, v in asdict(self.me).items() if k != "peer_id"}
        ok = await self.node.store(self.key, subkey=self.me.peer_id, value=value,
                                   expiration_time=get_dht_time() + self.ttl)
        if not ok:
            logger.debug("heartbeat record was not stored by any DHT peer")

    async def refresh(self) -> dict[str, PeerRecord]:
        """The live records of the run, this node's own included. A lookup may miss records (a DHT peer
        that stalls, a partial answer): records seen before are kept until they lapse, so a peer only
        ever leaves the view by expiring or by a newer record of its own."""
        now = get_dht_time()
        live = {p: r for p, r in self.live.items() if self._expires.get(p, 0.0) > now}
        try:
            found = await self.node.get(self.key, latest=True)
        except Exception as e:  # DHT lookups fail in many ways on a flaky network
            logger.info(f"peer lookup failed, keeping the last view: {e!r}")
            found = None
        if found is not None and isinstance(found.value, dict):
            for subkey, item in found.value.items():
                record = PeerRecord.parse(subkey, getattr(item, "value", None)) if isinstance(subkey, str) else None
                expires = getattr(item, "expiration_time", None)
                if record is not None and isinstance(expires, float) and expires > now:
                    live[subkey], self._expires[subkey] = record, expires
        live[self.me.peer_id] = self.me
        self.live = live
        return live

    async def update(self, **fields: object) -> None:
        """Change this node's record and publish it at once (state changes should not wait a heartbeat)."""
        for name, value in fields.items():
            setattr(self.me, name, value)
        await self.publish()

    def start_heartbeat(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._heartbeat())

    async def _heartbeat(self) -> None:
        while True:
            started = time.monotonic()
            try:
                await self.publish()
            except Exception as e:  # a DHT hiccup must not end the heartbeat
                logger.warning(f"heartbeat failed: {e!r}")
            await self.refresh()
            await asyncio.sleep(max(0.0, self.interval - (time.monotonic() - started)))

    async def wait_for_peers(self, count: int, timeout: float) -> int:
        """Wait until ``count`` peers of our config (this one included) are present and have published the
        state they start from, or the run is already under way (someone trains); return how many are present."""
        deadline = time.monotonic() + timeout
        while True:
            peers = [r for r in (await self.refresh()).values()
                     if r.fingerprint == self.me.fingerprint and r.state != "leaving" and r.params_sha256]
            if len(peers) >= count or any(r.active for r in peers) or time.monotonic() >= deadline:
                return len(peers)
            await asyncio.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
