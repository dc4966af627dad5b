"""This node's view of the swarm: its own record, kept in the DHT on a heartbeat, and everyone else's.

A record that is not renewed expires, and with it the peer's place in the swarm; a crashed peer stops renewing
it long before it lapses (``fresh``). The heartbeat stores this node's record; a change (a new round, a new
state) is stored at once in the background, so that the others see it within a store's time without the caller
waiting for it.

Reading is what grows with the swarm: one lookup of all a run's record keys (``records.RecordKeys``) returns all N
records (~1.3 KB each, half of it the owner's key and signature), so a peer that looked on every heartbeat would
read O(N) per heartbeat, O(N^2) for the swarm. A peer that applied its last round with a group *follows* that group:
the group is its view of the swarm (its members' records as last seen stand for them; a member that has left costs
at most one failed dial), and it looks up the records only on its turn, once every ceil(n / LOOKUPS_PER_ROUND)
rounds, so that it reads about LOOKUPS_PER_ROUND records per round whatever N, and a peer that has parted from the
swarm (a minority that formed a group of its own) still finds out within that many rounds (``catchup.py``). n counts
the members that *vouched* for the group in the round: they delivered this peer a contribution or an aggregate, with
a daemon of their own. The members a coordinator merely named do not count: a hostile coordinator's group of its
victim, itself and record-only Sybils would otherwise put off the victim's next look for as many rounds as it names
Sybils, and decide its rounds meanwhile (it is the one candidate in that view). A group formed by a coordinator, or
naming a member, whose record neither the last lookup nor a look-up of its key since returned is followed for one
round only, until the next lookup (``doubted``). A coordinator looks every heartbeat while it forms a group
(``sync/coordinator.py``; it is one peer per round). A peer that follows no group (it joins, catches up, was left out
or alone) looks on the heartbeat too, but once every ceil(n / WATCHES_PER_HEARTBEAT) heartbeats (n the records its last
lookup found), at a phase its id sets: the whole lookups of the run's peers that follow no group come about
WATCHES_PER_HEARTBEAT times a heartbeat between them whatever N, and where it acts on the view (a join: ``view``) it
looks afresh if its last lookup is older than the records' ``fresh`` window. In a run's first round every peer follows
no group: had each looked every heartbeat, each record key's replicas would send N^2 / RUN_RECORD_KEYS records a
heartbeat (at 2,048 peers ~157 MB, past a 50 Mbit/s uplink), lookups would take longer than a record lives, and views
would empty. A peer the round names that this view does not know (a joiner)
is looked up on demand, under its own record key alone (``look_up``). The directory counts the bytes of the values
it stores and reads (``dht_bytes``), so that a round record can say what coordination cost."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from hivemind.dht.node import DHTNode
from hivemind.utils import MSGPackSerializer, get_dht_time

from p2ploco import PROTOCOL_VERSION
from p2ploco.aio import in_time
from p2ploco.errors import PayloadError, shown
from p2ploco.swarm.bans import Bans
from p2ploco.swarm.evidence import Proof, proofs_key
from p2ploco.swarm.identity import OWNER_SUBKEY, peer_id_of
from p2ploco.swarm.messages import decode
from p2ploco.swarm.records import RUNS_KEY, PeerRecord, Phase, RecordKeys, merged_entries, parse_records
from p2ploco.swarm.wire import DAEMON_ERRORS

logger = logging.getLogger(__name__)

STALE_HEARTBEATS = 3  # a record not renewed for this many heartbeats (or half its ttl) belongs to a dead peer
FOREIGN_NAMED = 8  # config fingerprints of other peers of the run a node names in its log, at most
LOOKUPS_PER_ROUND = 4  # records a peer that follows its group reads per round, on average, whatever N
WATCHES_PER_HEARTBEAT = 256  # whole lookups the run's peers that follow no group make a heartbeat between them, about
KEY_READS = 4  # reads of one record key alone (``look_up``) a heartbeat at most: a join burst's, not a flood's
PROOFS_KEPT = 8  # proofs this node stores again on every heartbeat (its newest), so that they outlive it in the DHT


def payload_bytes(subkey: object, value: object) -> int:
    """The size of one (subkey, value) entry as hivemind serializes it (msgpack)."""
    return len(MSGPackSerializer.dumps(subkey)) + len(MSGPackSerializer.dumps(value))


class PeerDirectory:
    """This node's record (published on a heartbeat, and in the background when it changes) and the last view
    of everyone's (refreshed on the heartbeat)."""

    def __init__(self, node: DHTNode, records: RecordKeys, owner: bytes, me: PeerRecord, interval: float, ttl: float,
                 run_id: str | None = None, entries: dict[Any, tuple[Any, int, PeerRecord | None]] | None = None):
        """``entries``: the memo of DHT entries read (``_entries``), where many directories in one process read the
        same records (a simulation's peers: each parsed every record, N^2 a heartbeat); a node has its own."""
        self.node, self.records, self.owner, self.me = node, records, owner, me
        self.interval, self.ttl = interval, ttl
        self.run_id = run_id  # listed under RUNS_KEY while this peer trains it
        self.live: dict[str, PeerRecord] = {}
        # other peers' public keys (OpenSSH form), as their records' subkeys name them: their signatures' check
        self.keys: dict[str, bytes] = {}
        self.refreshed_at = -math.inf  # local time of the last lookup of everyone's records
        # local times the latest KEY_READS reads of each record key alone began (``look_up``), oldest first
        self._key_read_at: dict[str, deque[float]] = {}
        self._key_reads: dict[str, asyncio.Future] = {}  # the read of each key under way or due
        self.moved_at = -math.inf  # local time this node's record last changed round or state
        self.watchers: set[asyncio.Event] = set()  # set after every lookup, for whoever waits on the view
        self._expires: dict[str, float] = {}  # DHT time at which each record in `live` lapses
        self._refreshed: dict[str, float] = {}  # local time at which each record was last seen renewed
        # per DHT subkey, the last entry read under it: its expiry, its bytes and its record (None: none). An entry
        # is stored anew with a later expiry on every heartbeat, so one read again with the same expiry is the same
        # entry, and is not parsed again. Reads come faster than renewals while a run starts (``wait_for_peers``)
        # and while a formation is open: 20 % of the entries 128 simulated peers read in a round's run were such
        self._entries = {} if entries is None else entries
        self._tasks: list[asyncio.Task] = []
        self._started = time.monotonic()
        self._foreign_named: set[str] = set()  # config fingerprints of other peers of the run, said in the log
        self._changes = 0  # updates of this node's record so far
        self._attempted = 0  # updates that a finished store (successful or not) has carried
        self._stored = asyncio.Condition()
        self._dirty = asyncio.Event()
        self._bytes_sent = self._bytes_received = 0
        self._bytes_taken = (0, 0)  # ``dht_bytes`` at the last ``take_dht_bytes``
        self.live_fields: Callable[[], dict[str, Any]] = dict  # fields that change between updates
        self.followed: frozenset[str] = frozenset()  # the others of the group this peer applied its last round with
        self.vouched: frozenset[str] = frozenset()  # those of them that took part in it with this peer
        self.seen: frozenset[str] = frozenset()  # the peers whose records the last lookup returned
        self.doubted = False  # the followed group names a peer the last lookup did not return: look next round
        self._phase = int.from_bytes(hashlib.sha256(me.peer_id.encode()).digest()[:4], "big")  # of its turns to look
        self._beats = 0  # heartbeats so far
        # who is banned here, and the proofs this node holds (``swarm/bans.py``): it passes them on in the DHT and
        # convicts whom the proofs found there accuse (None: a directory without a run's rounds)
        self.bans: Bans | None = None

    @property
    def dht_bytes(self) -> tuple[int, int]:
        """Bytes this directory has stored in and read from the DHT so far (sent, received), never decreasing.

        Application-level payload: the serialized (subkey, value) entries it asks the DHT to store, once per store
        however many replicas hivemind writes, and those each lookup returns (signatures stripped). Not hivemind's
        own traffic: routing, the lookups' hops, replication and the p2p daemon's framing are left out."""
        return self._bytes_sent, self._bytes_received

    def take_dht_bytes(self) -> tuple[int, int]:
        """``dht_bytes`` (sent, received) since the last call: what a node's round record counts, from one record to
        the next (the simulation's peers take theirs alike)."""
        now = self.dht_bytes
        (sent, received), self._bytes_taken = self._bytes_taken, now
        return now[0] - sent, now[1] - received

    async def store_record(self, list_run: bool = False) -> None:
        """Store this node's record now (and, on the heartbeat, list its run: that listing only has to outlive
        the record's ttl, so state changes do not store it again)."""
        for name, value in self.live_fields().items():
            setattr(self.me, name, value)
        self.me.uptime = round(time.monotonic() - self._started, 1)
        changes = self._changes
        expires = get_dht_time() + self.ttl
        entries: list[tuple[str, object, dict[str, Any]]] = [(self.records.of(self.me.peer_id), self.owner,
                                                              self.me.to_value())]
        if list_run and self.run_id is not None:
            entries.append((RUNS_KEY, self.run_id, {"version": self.me.version}))
            if self.bans is not None:  # passed on: each proof this node holds, from the DHT, a decision or a round
                entries += [(proofs_key(self.run_id), accused, proof.to_value())
                            for accused, proof in list(self.bans.proofs.items())[-PROOFS_KEPT:]]
        self._bytes_sent += sum(payload_bytes(subkey, value) for _, subkey, value in entries)
        try:
            ok, *_ = await asyncio.gather(*(self.node.store(key, subkey=subkey, value=value, expiration_time=expires)
                                            for key, subkey, value in entries))
        finally:
            async with self._stored:
                self._attempted = max(self._attempted, changes)
                self._stored.notify_all()
        if not ok:
            logger.debug("peer record was not stored by any DHT peer")

    def update_soon(self, **changes: object) -> int:
        """Change this node's record now and store it in the background (a burst of changes costs one store);
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
                await in_time(self._stored.wait_for(lambda: self._attempted >= change), timeout)
            except TimeoutError:
                return False
        return True

    async def refresh(self) -> dict[str, PeerRecord]:
        """The live records of the run, this node's own included. A lookup may miss records (a DHT peer
        that stalls, a partial answer): records seen before are kept until they lapse, so a peer only
        ever leaves the view by expiring or by a newer record of its own."""
        now = get_dht_time()
        convicting = self.bans is not None and self.run_id is not None
        proofs_at = (proofs_key(self.run_id),) if convicting else ()
        try:
            found = await self.node.get_many(self.records.keys + proofs_at, sufficient_expiration_time=math.inf)
        except DAEMON_ERRORS as e:  # the daemon or a link failed mid-lookup
            logger.info(f"peer lookup failed, keeping the last view: {e!r}")
            found = {}
        # the view as it is now: a key read (``look_up``) that ended while this lookup was under way found records
        # this lookup's answers may predate (a joiner's first, a renewal)
        live = self._unexpired(now)
        entries = merged_entries(found, self.records.keys)
        found_records = self._take(entries, now, live)
        for subkey in [subkey for subkey in self._entries if subkey not in entries]:  # in place: it may be shared
            del self._entries[subkey]
        live[self.me.peer_id] = self.me
        self.keys = {peer: key for peer, key in self.keys.items() if peer in live}
        self._convict(getattr(found.get(proofs_at[0]) if proofs_at else None, "value", None), live)
        self._name_foreign(live)
        self.live, self.refreshed_at = live, time.monotonic()
        self.seen, self.doubted = frozenset(found_records) | {self.me.peer_id}, False
        for watcher in self.watchers:
            watcher.set()
        return live

    async def look_up(self, peers: Iterable[str]) -> dict[str, PeerRecord]:
        """The live records, with those of ``peers`` (ones this view lacks: joiners) read from the DHT from now on,
        under their record keys alone: about N / RUN_RECORD_KEYS records a key, where a whole lookup reads N. A
        peer stores its record before it asks anything of another, so a read begun now finds it. Anyone can name
        made-up peers, so one key is read at most KEY_READS times a heartbeat, whoever asks: a read of it already
        under way, or due, serves everyone who asked before it began."""
        asked = time.monotonic()
        await asyncio.gather(*(self._read_key(key, asked) for key in {self.records.of(peer) for peer in peers}))
        return self.live

    async def _read_key(self, key: str, asked: float) -> None:
        """Return once a read of ``key`` begun at or after ``asked`` is over (at most two: one under way may have
        begun before); the read waits until the KEY_READS-th latest began a heartbeat ago."""
        while self._key_read_at.get(key, [-math.inf])[-1] < asked:
            if key not in self._key_reads:
                began = self._key_read_at.get(key, ())
                due = began[0] + self.interval if len(began) == KEY_READS else -math.inf
                self._key_reads[key] = asyncio.ensure_future(self._read_key_at(key, due))
            await asyncio.shield(self._key_reads[key])

    async def _read_key_at(self, key: str, due: float) -> None:
        """Read ``key`` at local time ``due`` (now if past) and take its records into the view."""
        try:
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            self._key_read_at.setdefault(key, deque(maxlen=KEY_READS)).append(time.monotonic())
            now = get_dht_time()
            try:
                found = await self.node.get_many((key,), sufficient_expiration_time=math.inf)
            except DAEMON_ERRORS as e:  # the daemon or a link failed mid-lookup
                logger.info(f"peer lookup failed, keeping the last view: {e!r}")
                return
            live = self._unexpired(now)
            found_records = self._take(merged_entries(found, (key,)), now, live)
            live[self.me.peer_id] = self.me
            self.live = live
            self.seen |= set(found_records)  # a member found so is no reason to doubt its group (``follow``)
        finally:
            del self._key_reads[key]

    def _take(self, entries: dict[Any, Any], now: float, live: dict[str, PeerRecord]
              ) -> dict[str, tuple[PeerRecord, float]]:
        """Put the records among DHT ``entries`` into ``live`` (newer ones only) and note their owners' keys; returns
        them."""
        for subkey, item in entries.items():
            expires = getattr(item, "expiration_time", None)
            if self._entries.get(subkey, (None,))[0] != expires:
                value = getattr(item, "value", None)
                self._entries[subkey] = (expires, payload_bytes(subkey, value), PeerRecord.parse(value))
            self._bytes_received += self._entries[subkey][1]
        found_records = parse_records(entries, now, lambda subkey, _: self._entries[subkey][2])
        for subkey in entries:  # the DHT layer checked that its key signed it
            owner = OWNER_SUBKEY.fullmatch(subkey) if isinstance(subkey, bytes) else None
            if owner is not None and peer_id_of(subkey) in found_records:
                self.keys[peer_id_of(subkey)] = owner.group(1)
        for peer_id, (record, expires) in found_records.items():
            known = self._expires.get(peer_id, 0.0)
            if expires > known:
                self._refreshed[peer_id] = time.monotonic()
            if expires >= known:  # an answer older than a read that ended before it does not take a record back
                live[peer_id], self._expires[peer_id] = record, expires
        return found_records

    def _convict(self, found: object, live: dict[str, PeerRecord]) -> None:
        """Convict the peers of this run that the proofs ``found`` in the DHT accuse (each checked here). Proofs
        against keys without a live record here are left: anyone can sign two statements with keys of its own."""
        for subkey, item in found.items() if isinstance(found, dict) and self.bans is not None else ():
            if subkey in live and subkey not in self.bans.proofs:
                try:
                    proof = decode(Proof, getattr(item, "value", None))
                except PayloadError:
                    continue
                if proof.accused == subkey and self.bans.convict(proof, self.me.round):
                    logger.info(f"the proof against {subkey[-8:]} came from the DHT")

    def _name_foreign(self, live: dict[str, PeerRecord]) -> None:
        """Say in one line, when they first come into view, that the run has peers of another config: another
        model, corpus, batch or seed, or another protocol version (a peer of an older p2ploco). They are ignored,
        never a reason to stop: anyone can publish a record under the run's key, and for as many fingerprints as
        it likes, so at most FOREIGN_NAMED are ever named. A bootstrap peer's directory (no run) has nothing to say."""
        if self.run_id is None:
            return
        foreign = sorted({r.fingerprint for r in live.values() if r.state != Phase.LEAVING}
                         - {self.me.fingerprint} - self._foreign_named)[:FOREIGN_NAMED - len(self._foreign_named)]
        if not foreign:
            return
        self._foreign_named.update(foreign)
        logger.warning(f"run '{self.run_id}' has peers of another config (fingerprint "
                       f"{', '.join(map(shown, foreign))}, yours {self.me.fingerprint}: other settings, or another "
                       f"p2ploco protocol version than yours, {PROTOCOL_VERSION}); this peer ignores them. A node "
                       f"started without --config trains the config most of the run's peers train (README, "
                       f"\"Joining with one address\"); `p2ploco peers` lists them")

    def _unexpired(self, now: float) -> dict[str, PeerRecord]:
        """The records in view that have not lapsed, and those of the followed group as last seen."""
        return {p: r for p, r in self.live.items() if self._holds(p, now)}

    def _holds(self, peer_id: str, now: float) -> bool:
        return self._expires.get(peer_id, 0.0) > now or peer_id in self.followed or peer_id == self.me.peer_id

    def lacks(self, peers: Iterable[str], lapsed_within: float = 0.0) -> set[str]:
        """Of ``peers``, those this view holds no record of that has not lapsed, or lapsed at most ``lapsed_within``
        seconds ago (``live`` keeps a lapsed one until the next heartbeat or read rebuilds it): the ones to
        ``look_up``."""
        now = get_dht_time()
        if lapsed_within:  # a record seen lately will do, whether the view still holds it or not
            return {p for p in peers if not self._holds(p, now - lapsed_within)}
        return {p for p in peers if p not in self.live or not self._holds(p, now)}

    def follow(self, peers: Iterable[str], vouched: Iterable[str] = (), coordinator: str = "") -> None:
        """This peer applied its last round with ``peers`` (none: it did not, or applied it alone), formed by
        ``coordinator``: they are its view of the swarm until the next round says otherwise. Of them, ``vouched``
        took part with it (they delivered it a contribution or an aggregate) and set how long it goes without a
        lookup; if the coordinator or a member was not in the last lookup, it looks again next round (module
        docstring)."""
        self.followed = frozenset(peers) - {self.me.peer_id}
        self.vouched = frozenset(vouched) & self.followed
        self.doubted = bool(self.followed) and not self.followed | ({coordinator} - {""}) <= self.seen

    @property
    def watching(self) -> bool:
        """Whether this heartbeat looks up everyone's records: a formation this peer coordinates waits on the lookups,
        or this peer follows no group and it is its heartbeat to look (module docstring)."""
        if self.watchers:
            return True
        period = max(1, math.ceil(len(self.seen) / WATCHES_PER_HEARTBEAT))
        return not self.followed and (self._beats + self._phase) % period == 0

    def _turn_to_look(self) -> bool:
        """Whether a peer that follows its group looks up the records in its current round: once every
        ceil(n / LOOKUPS_PER_ROUND) rounds, n the members that vouched for its group and itself, at a phase its id
        sets, so that the members take turns."""
        period = math.ceil((len(self.vouched) + 1) / LOOKUPS_PER_ROUND)
        return (self.me.round + self._phase) % period == 0

    def rates(self, peers: Iterable[str]) -> list[float]:
        """The link rates (Mbit/s, 0: not stated) that ``peers`` state in their records, as last seen."""
        return [self.live[p].bandwidth_mbit for p in peers if p in self.live]

    async def stopped(self, peers: Iterable[str]) -> set[str]:
        """Of ``peers``, those whose records, read from now on (``look_up``), are no longer renewed: they crashed."""
        peers = set(peers)
        if peers:
            await self.look_up(peers)
        return {p for p in peers if not self.fresh(p)}

    async def view(self) -> dict[str, PeerRecord]:
        """The records as last seen if they will do: unless this node doubts the group it follows, looked up
        since this node moved to its current round (the others publish theirs as they move, too) and, where it
        follows no group (its heartbeat looks only now and then), within the records' ``fresh`` window, or this node
        follows its group and it is not its turn to look (module docstring); otherwise a fresh lookup."""
        looked = self.refreshed_at > self.moved_at and (
            bool(self.followed) or time.monotonic() - self.refreshed_at < self._stale_after)
        if not self.doubted and (looked or (self.followed and not self._turn_to_look())):
            return self.live
        return await self.refresh()

    def current(self, peer_id: str) -> bool:
        """Whether this node may go by ``peer_id``'s record as last seen: renewed lately (``fresh``), or of a
        member of the group it follows."""
        return peer_id in self.followed or self.fresh(peer_id)

    def of_run(self, peer_id: str) -> bool:
        """Whether ``peer_id`` has a live record of this run's config, as last seen (this peer's own included)."""
        record = self.live.get(peer_id)
        return (record is not None and record.fingerprint == self.me.fingerprint and record.state != Phase.LEAVING
                and self.fresh(peer_id))

    def dials_out(self, peer_id: str) -> bool:
        """Whether ``peer_id``'s record (this peer's own included) says it cannot be dialled in rounds, as last seen."""
        record = self.me if peer_id == self.me.peer_id else self.live.get(peer_id)
        return record is not None and record.dials_out

    def fresh(self, peer_id: str) -> bool:
        """Whether ``peer_id``'s record was renewed lately: a crashed peer stops renewing it long before it lapses."""
        return peer_id == self.me.peer_id or time.monotonic() - self._refreshed.get(peer_id, 0.0) < self._stale_after

    @property
    def _stale_after(self) -> float:
        """Seconds after which a record not seen renewed belongs to a dead peer (``fresh``)."""
        return max(STALE_HEARTBEATS * self.interval, self.ttl / 2)

    async def update(self, **changes: object) -> None:
        """Change this node's record and wait until it is stored (where it must be, e.g. before leaving)."""
        await self.flush(self.update_soon(**changes), timeout=math.inf)

    def start_heartbeat(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._heartbeat()), loop.create_task(self._publish_changes())]

    async def _heartbeat(self) -> None:
        while True:
            started = time.monotonic()
            self.live = self._unexpired(get_dht_time())  # the lapsed records of peers not followed leave the view
            watching, self._beats = self.watching, self._beats + 1
            try:
                await asyncio.gather(self.store_record(list_run=True), *([self.refresh()] if watching else []))
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
                await self.store_record()
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
                     if r.fingerprint == self.me.fingerprint and r.state != Phase.LEAVING and r.slices]
            if len(peers) >= count or any(r.active for r in peers) or time.monotonic() >= deadline or stop.is_set():
                return len(peers)
            await asyncio.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
