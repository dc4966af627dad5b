"""This process's place in a swarm: a DHT node and p2p daemon in a background loop, its peer record,
and the matchmaking and all-reduce services that make up the SwarmCommunicator."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from functools import partial
from typing import Any

from hivemind.dht.node import DHTNode
from hivemind.utils import get_dht_time
from hivemind.utils.multiaddr import Multiaddr

from p2ploco import __version__
from p2ploco.config import SwarmConfig, document_fingerprint
from p2ploco.errors import SwarmError, shown
from p2ploco.swarm import DEFAULT_HOST_MADDRS, wire
from p2ploco.swarm.bans import Bans
from p2ploco.swarm.consensus import SwarmState, ranked_states, settled
from p2ploco.swarm.deadlines import TransferDeadline, round_bound, round_wait
from p2ploco.swarm.dht import FAREWELL_TIMEOUT, start_dht_node, start_serving, visible_maddrs
from p2ploco.swarm.directory import PeerDirectory
from p2ploco.swarm.evidence import Signer
from p2ploco.swarm.identity import Identity
from p2ploco.swarm.loop import EventLoopThread, finishes_within
from p2ploco.swarm.messages import MAX_TOKENS
from p2ploco.swarm.names import human_name
from p2ploco.swarm.reachability import DialBack, detect
from p2ploco.swarm.records import (
    MAX_ADDRESSES,
    PeerRecord,
    PeerRole,
    Phase,
    Reachability,
    parse_records,
    read_entries,
    run_records,
)
from p2ploco.swarm.run_config import ConfigServer, RunDocument, fetch_run_document, tell_conflict
from p2ploco.swarm.state import Snapshot
from p2ploco.swarm.state_fetch import choose_donors, fetch_state, served_state
from p2ploco.swarm.state_server import StateServer
from p2ploco.swarm.status import Host, Route, StatusServer, Surveyed
from p2ploco.swarm.status_document import PEERS_DOCUMENT, STATUS_PATH
from p2ploco.swarm.survey import survey
from p2ploco.swarm.updates import Chain, UpdateKeeper, caught_up, describe_chain, fetch_chain
from p2ploco.swarm.upload_cap import cap_uploads
from p2ploco.sync.communicator import SwarmCommunicator
from p2ploco.sync.group import Group
from p2ploco.sync.start import start_sync
from p2ploco.sync.this_peer import ThisPeer

logger = logging.getLogger(__name__)

CALL_TIMEOUT = 30.0  # bound on quick calls into the loop (record updates, address lookups)
PROBE_TIMEOUT = 5.0  # to ask a lone peer whether it serves the state its record claims
PROBE_MEMORY = 10.0  # seconds an answer to that question is trusted
COORDINATOR_GRACE = 10.0  # a leaving peer still decides the rounds of the groups it formed, for at most this long


class Swarm:
    def __init__(self, loop: EventLoopThread, node: DHTNode, directory: PeerDirectory, communicator: SwarmCommunicator,
                 state_server: StateServer, config_server: ConfigServer, config: SwarmConfig, identity: Identity,
                 bans: Bans, updates: UpdateKeeper):
        self.loop, self.node, self.directory, self.communicator = loop, node, directory, communicator
        self.state_server, self.config_server, self.updates = state_server, config_server, updates
        self.config, self.identity, self.bans = config, identity, bans
        self._refusals: dict[tuple[str, int, str, str], float] = {}  # a lone claim its holder did not serve -> when
        self.status_server: StatusServer | None = None
        self.surveyed: Surveyed | None = None  # the status server's survey (``serve_status``)

    @classmethod
    def join(cls, run_id: str, config: SwarmConfig, document: dict[str, Any], initial_peers: Sequence[str] = (),
             host_maddrs: Sequence[str] = DEFAULT_HOST_MADDRS, announce_maddrs: Sequence[str] = (),
             identity_path: str | None = None, name: str = "", device: str = "", role: PeerRole = PeerRole.REPLICA,
             stages: int = 1, max_tokens: int = MAX_TOKENS) -> Swarm:
        """Arrive (``Arrival``) and enter at once: for a peer whose config is settled (``document``: its run
        document, ``Config.run_document``)."""
        arrival = Arrival.start(run_id, config.reachability, initial_peers, host_maddrs, announce_maddrs,
                                identity_path)
        return arrival.enter(config, document, name, device, role, stages, max_tokens)


    @property
    def peer_id(self) -> str:
        return self.directory.me.peer_id

    @property
    def reachability(self) -> Reachability:
        return Reachability(self.directory.me.reachability)

    def step_seconds(self) -> list[float]:
        """The inner-step times the round budget goes by (``budget.py``; 0: not known yet), as last seen: those the
        partners of this peer's recent rounds publish (``SwarmCommunicator.partners``), or, while it has none (it
        joins, or applied none of its last rounds), those of every live peer of this run's config; never a banned
        peer's, nor its own, nor those of peers that sit rounds out (their steps outlast the round: they set none
        of its pace). Read between inner steps: no lookup."""
        directory, partners = self.directory, self.communicator.partners
        return [r.step_seconds for p, r in directory.live.items()
                if p != self.peer_id and (p in partners or not partners) and r.fingerprint == directory.me.fingerprint
                and not r.sits_out and directory.current(p) and not self.bans.banned(p, directory.me.round)]

    def formation_wait(self, round_index: int) -> float:
        """How long a formation of ``round_index`` waits after its first contribution, as this peer would judge it now
        (``Matchmaker.formation_wait``; a coordinator judges by the same rule). Read between rounds: no lookup."""
        return self.communicator.matchmaker.formation_wait(round_index)

    def applied_with(self) -> Group | None:
        """The group this peer applied its last round with (None: none, or its own update alone)."""
        return self.communicator.matchmaker.following

    def round_wait(self) -> float:
        """How long to wait for the round under way to end (``deadlines.round_wait``), by the round times this run's
        live records state (this peer's own among them; neither a banned peer's nor one that sits rounds out). Read
        between rounds: no lookup."""
        directory, c = self.directory, self.config
        me = directory.me
        rounds = [r.round_seconds for p, r in directory.live.items()
                  if p != me.peer_id and r.fingerprint == me.fingerprint and not r.sits_out
                  and not self.bans.banned(p, me.round)]
        return round_wait(round_bound(c.matchmaking_timeout, c.allreduce_timeout), directory.interval,
                          [*rounds, me.round_seconds])

    def addresses(self) -> list[str]:
        return self.loop.run(visible_maddrs(self.node), CALL_TIMEOUT)

    def announce_progress(self, round_index: int, phase: Phase, params_digest: str, slices: dict[str, str],
                          unsettled: bool = False) -> None:
        """Announce where this peer is: its phase, the round it works on and the state digests it started from (of all
        it holds, and of each slice), and whether that state is unsettled (its last round may have ended otherwise
        for the others, and it has not caught up since: the state then has no say on the swarm's). Returns at
        once: the record is stored in the background (a round's join waits for it, ``flush`` too)."""
        self.update_record(round=round_index, state=phase, params_digest=params_digest, slices=dict(slices),
                           unsettled=unsettled)

    def update_record(self, **changes: object) -> None:
        """Change fields of this peer's public record (loss, throughput, traffic, ...), from any thread; it is stored
        in the background."""
        self.loop.loop.call_soon_threadsafe(partial(self.directory.update_soon, **changes))

    def flush(self) -> bool:
        """Wait until this peer's record as last changed is stored (False if the DHT did not take it in time)."""
        return self.loop.run(self.directory.flush(timeout=CALL_TIMEOUT))

    def track(self, live_fields: Callable[[], dict[str, Any]]) -> None:
        """Fields read afresh at every heartbeat (e.g. the inner step), so the record moves between rounds."""
        self.directory.live_fields = live_fields

    def wait_for_peers(self, count: int, timeout: float, stop: threading.Event | None = None) -> int:
        """Block until ``count`` peers (this one included) are present or the run is under way, ``timeout`` passes,
        or ``stop`` is set (the node was told to leave while it waited)."""
        return self.loop.run(self.directory.wait_for_peers(count, timeout, stop or threading.Event()))

    def swarm_state(self, round_index: int, slices: dict[str, str], seeds: dict[str, str] | None = None,
                    fresh: bool = True, distrusted: Collection[str] = frozenset(), unsettled: bool = False
                    ) -> dict[str, SwarmState]:
        """For each slice this peer holds (name -> the hash it holds at ``round_index``), the state to follow: one
        that two or more peers vouch for, this peer's own, or else a lone peer's claim that it really serves
        (probed: the state it serves then, which may be a later round's), unless that peer is ``distrusted`` (it
        refused this peer's contribution in its last round: a state the group committed without this peer is held by
        a majority of it, not by that peer alone); never the seed's state (``seeds``: slice -> its hash as the run's
        seed makes it) where anyone holds another. Slices nobody else holds are left out. From a fresh look at the
        records, or (``fresh`` False: the check between two rounds that went well) from the heartbeat's view if it
        looked since this peer moved to its round. ``unsettled``: this peer's own state is doubtful, and ranks as an
        unsettled record's does (below a settled one's, however far ahead it claims to be)."""
        async def look() -> dict[str, SwarmState]:
            me = self.directory.me.model_copy(update={"round": round_index, "slices": dict(slices),
                                                     "state": Phase.TRAINING, "unsettled": unsettled})
            live = await (self.directory.refresh() if fresh else self.directory.view())
            chosen: dict[str, SwarmState] = {}
            for name in slices:
                for state in ranked_states(live, me, name, (seeds or {}).get(name, "")):
                    adopted = (state if state.vouched or me.peer_id in state.holders
                                else None if state.holders[0] in distrusted else await self._served(state))
                    if adopted is not None:
                        chosen[name] = adopted
                        break
            return chosen

        return self.loop.run(look(), CALL_TIMEOUT + len(self.directory.live) * len(slices) * PROBE_TIMEOUT)

    def trained_elsewhere(self, seeds: dict[str, str]) -> list[str]:
        """The slices of ``seeds`` (name -> the hash the run's seed gives it) that some other live peer of this run's
        config holds in another state: trained. From the heartbeat's view: no lookup."""
        directory = self.directory
        return sorted(name for name, seed in seeds.items()
                      if any(p != self.peer_id and r.fingerprint == directory.me.fingerprint and name in r.slices
                             and r.slices[name] != seed for p, r in directory.live.items()))

    async def _served(self, claim: SwarmState) -> SwarmState | None:
        """The state ``claim``'s lone holder serves, the claimed one or a later round's (``state.served_state``);
        None if neither. A refusal is remembered for a while (a record that lies is not asked about again and
        again); a state served is asked for afresh at every look, as its holder moves on."""
        key = (claim.holders[0], claim.round, claim.slice, claim.state_digest)
        now = time.monotonic()
        self._refusals = {k: when for k, when in self._refusals.items() if now - when < PROBE_MEMORY}
        if key in self._refusals:
            return None
        served = await served_state(self.node.protocol.p2p, self.state_server.handler_name, claim, PROBE_TIMEOUT)
        if served is None:
            logger.info(f"{key[0][-8:]} claims {shown(claim.slice)} of round {key[1]} but does not serve it or a "
                        f"later round's; not following it")
            self._refusals[key] = now
        return served

    def settled(self, round_index: int) -> bool:
        """Whether at least half of the other active peers of our config have moved past ``round_index``."""
        async def look() -> bool:
            return settled(await self.directory.refresh(), self.directory.me, round_index)

        return self.loop.run(look(), CALL_TIMEOUT)

    def fetch_state(self, target: SwarmState, tensor_bytes: int) -> Snapshot:
        """Download ``target`` (one slice, whose tensors take ``tensor_bytes`` here) from the peers that hold it and
        are not banned here (SwarmError if none serves it as vouched); a donor that describes or serves it falsely
        is banned."""
        donors = self._donors(target)
        return self.loop.run(fetch_state(self.node.protocol.p2p, self.state_server.handler_name, target, donors,
                                         self.state_server.deadline, tensor_bytes, self._blamer(target),
                                         self.directory.rates(donors)))

    def describe_updates(self, own: Snapshot, target: SwarmState, budget: int) -> Chain | None:
        """The updates that lead from ``own`` (this peer's state of ``target``'s slice) to ``target``, as the peers
        that hold it keep them, if there are fewer than ``budget`` bytes of them (``swarm/updates.py``); None if
        not. A donor that describes one falsely is banned."""
        donors = self._donors(target)
        return self.loop.run(describe_chain(self.node.protocol.p2p, self.state_server.handler_name, own, target,
                                            donors, self.state_server.deadline, budget, self._blamer(target),
                                            self.directory.rates(donors)))

    def fetch_updates(self, chain: Chain) -> Snapshot | None:
        """The state ``chain`` leads to, fetched and applied (on the calling thread), if it is the one the swarm
        vouches for; None if not (the donors of an update that led elsewhere are banned)."""
        blame = self._blamer(chain.target)
        changes = self.loop.run(fetch_chain(self.node.protocol.p2p, self.state_server.handler_name, chain,
                                            self.state_server.deadline, blame,
                                            self.directory.rates(sorted(chain.donors))))
        return None if changes is None else caught_up(chain, changes, blame)

    def _donors(self, target: SwarmState) -> list[str]:
        """The holders of ``target`` that this peer fetches it from (``choose_donors``)."""
        return self.loop.run(choose_donors(self.node.protocol.p2p, target, self.peer_id, self.bans, self.directory),
                             CALL_TIMEOUT)

    def _blamer(self, target: SwarmState) -> Callable[[str, str], None]:
        def blame(donor: str, why: str) -> None:
            self.bans.ban(donor, target.round, why)

        return blame

    def serve_state(self, snapshots: list[Snapshot]) -> None:
        """Serve ``snapshots`` (one round, one per slice held) to peers that catch up (prepared on this thread:
        ``StateServer.prepare_round``), and keep the update from the state served before (``swarm/updates.py``):
        before the round before is demoted, while its tensors are still whole."""
        self.updates.keep(snapshots)
        self.loop.loop.call_soon_threadsafe(self.state_server.hold, *self.state_server.prepare_round(snapshots))

    def claims(self) -> list[PeerRecord]:
        """The fresh, not-leaving records of stage peers of our config (this one's included), from a fresh look."""
        async def look() -> list[PeerRecord]:
            live = await self.directory.refresh()
            return [r for r in live.values()
                    if r.role == PeerRole.STAGE and r.fingerprint == self.directory.me.fingerprint
                    and r.state != Phase.LEAVING and r.group and self.directory.fresh(r.peer_id)]

        return self.loop.run(look(), CALL_TIMEOUT)

    def serve_status(self, listening: socket.socket, host: str, routes: Mapping[str, Route]) -> None:
        """Serve the run's survey over HTTP on ``listening`` (bound to ``host``, as given) at ``STATUS_PATH`` and
        ``PEERS_DOCUMENT``, and what ``routes`` name at their paths (``swarm/status.py``)."""
        self.surveyed = Surveyed(partial(survey, self.node, self.directory.run_id), self.config.heartbeat_interval)
        self.status_server = StatusServer({STATUS_PATH: self.surveyed, PEERS_DOCUMENT: self.surveyed, **routes},
                                          Host(host))
        self.loop.run(self.status_server.start(listening), CALL_TIMEOUT)

    def request_leave(self) -> None:
        """Start leaving now (safe from a signal handler): stop joining groups, tell the others."""
        async def withdraw() -> None:
            self.directory.update_soon(state=Phase.LEAVING)
            await self.communicator.matchmaker.withdraw()

        asyncio.run_coroutine_threadsafe(withdraw(), self.loop.loop)

    def leave(self) -> None:
        """Tell the swarm this peer is leaving, then stop the DHT node and its daemon."""
        async def stop() -> None:
            if self.status_server is not None:  # first: its requests look the DHT up
                await self.status_server.stop()
                await self.surveyed.close()
            # Either step may hang if the daemon is already gone (e.g. SIGTERM to the whole process group).
            try:
                if not await finishes_within(self.directory.update(state=Phase.LEAVING), FAREWELL_TIMEOUT):
                    logger.info("could not announce leaving: the DHT did not answer")
            except wire.DAEMON_ERRORS as e:
                logger.info(f"could not announce leaving: {e!r}")
            await finishes_within(self.communicator.matchmaker.withdraw(), FAREWELL_TIMEOUT)
            await finishes_within(self.communicator.commit.coordinate_to_the_end(), COORDINATOR_GRACE)
            await finishes_within(self.node.shutdown(), FAREWELL_TIMEOUT)

        try:
            self.loop.run(stop(), CALL_TIMEOUT)
        except wire.DAEMON_ERRORS as e:  # the daemon is gone, or did not answer in time
            logger.warning(f"leaving the swarm uncleanly: {e!r}")
        except Exception:  # a bug must not keep the process from exiting: say where it is, stop anyway
            logger.exception("leaving the swarm uncleanly")
        finally:
            self.loop.stop()
            self.identity.release()


class Arrival:
    """A node on its way into a run: its DHT node is up, it can read the run's records and ask the run's peers for
    the run's config (``swarm/run_config.py``), and it has published nothing, so a start that ends here leaves no
    trace in the swarm. ``enter`` makes it a Swarm, ``abandon`` stops it."""

    def __init__(self, loop: EventLoopThread, node: DHTNode, owner: bytes, identity: Identity, run_id: str,
                 initial_peers: Sequence[str]):
        self.loop, self.node, self.owner, self.identity = loop, node, owner, identity
        self.run_id, self.initial_peers = run_id, initial_peers
        self.abandoned = False

    @classmethod
    def start(cls, run_id: str, reachability: str, initial_peers: Sequence[str] = (),
              host_maddrs: Sequence[str] = DEFAULT_HOST_MADDRS, announce_maddrs: Sequence[str] = (),
              identity_path: str | None = None) -> Arrival:
        """Start the p2p daemon and DHT node (``reachability``: the swarm.reachability setting). A DHT client until
        it is known to be dialable (``dht.start_serving``); the daemon's own routing serves unless the peer is
        known to sit behind a NAT."""
        identity = Identity.claim(identity_path) if identity_path is not None else Identity.fresh()
        loop = EventLoopThread()
        try:
            node, owner = loop.run(start_dht_node(initial_peers, host_maddrs, announce_maddrs, identity,
                                                  client_mode=reachability != Reachability.PUBLIC, run_id=run_id,
                                                  dht_mode="client" if reachability == "client" else "server"))
        except BaseException:  # interrupted too: no loop thread or identity lock outlives a failed start
            loop.stop()
            identity.release()
            raise
        return cls(loop, node, owner, identity, run_id, initial_peers)

    @property
    def peer_id(self) -> str:
        return str(self.node.peer_id)

    def run_document(self, mine: str = "") -> RunDocument | None:
        """The config most of the run's live peers train with, as one of them serves it (``mine``: this peer's own
        config's fingerprint, "" if it brought none); None if no peer of the run serves one."""
        async def look() -> RunDocument | None:
            # A node that brings no config must find the run: looked for as `p2ploco peers` does, patiently (a DHT
            # node that just joined may need a few lookups). One that brings its own goes by the first answer, so
            # that the first node of a run does not wait for peers that are not there.
            if mine:
                found = await read_entries(self.node, run_records(self.run_id).keys)
                now = get_dht_time()
                parsed = parse_records(found, now).values()
                records, expires_in = [r for r, _ in parsed], {r.peer_id: e - now for r, e in parsed}
            else:
                surveyed = await survey(self.node, self.run_id)
                records, expires_in = surveyed.peers, surveyed.expires_in
            typed = [Multiaddr(a)["p2p"] for a in self.initial_peers]
            return await fetch_run_document(self.node.protocol.p2p, self.run_id, records, self.peer_id, mine,
                                            expires_in, typed)

        try:
            return self.loop.run(look())
        except wire.DAEMON_ERRORS as e:  # the daemon or a link failed mid-lookup
            raise SwarmError(f"could not read run '{self.run_id}''s records from the DHT: {e!r}") from None

    def tell_conflict(self, run: RunDocument, mine: str) -> None:
        """Let ``run``'s donor know that this peer, of config ``mine``, stops instead of joining."""
        self.loop.run(tell_conflict(self.node.protocol.p2p, self.run_id, run, mine))

    def enter(self, config: SwarmConfig, document: dict[str, Any], name: str = "", device: str = "",
              role: PeerRole = PeerRole.REPLICA, stages: int = 1, max_tokens: int = MAX_TOKENS) -> Swarm:
        """Publish this peer's record (carrying ``document``'s fingerprint) and serve rounds, state and the run's
        config. ``stages``: how many slices a pipeline of this run brings to a round; ``max_tokens``: the most
        tokens one contribution may weigh (``Config.max_contribution_tokens``)."""

        async def start() -> Swarm:
            p2p = self.node.protocol.p2p
            cap_uploads(config.max_upload_mbit)
            directory, reachability = await self._membership(config, document, name, device, role)
            bans = directory.bans = Bans(config.ban_rounds, self.run_id)
            deadlines = TransferDeadline(config.allreduce_timeout, config.min_bandwidth_mbit,
                                         config.max_transfer_timeout)
            me = ThisPeer(directory.me.peer_id, role, directory.me.fingerprint)
            communicator = await start_sync(self.loop, p2p, directory, me, self.run_id, config, deadlines, bans,
                                            Signer(self.identity.key), stages, max_tokens, reachability.dials_out)
            updates = UpdateKeeper()
            state_server = StateServer(p2p, self.run_id, deadlines, updates.find)
            config_server = ConfigServer(p2p, self.run_id, document, deadlines.base)
            for service in (state_server, config_server):
                await service.start()
            await directory.store_record()
            directory.start_heartbeat()
            return Swarm(self.loop, self.node, directory, communicator, state_server, config_server, config,
                         self.identity, bans, updates)

        try:
            return self.loop.run(start())
        except BaseException:  # interrupted too: no loop thread or identity lock outlives a failed join
            self.abandon()
            raise

    async def _membership(self, config: SwarmConfig, document: dict[str, Any], name: str, device: str,
                          role: PeerRole) -> tuple[PeerDirectory, Reachability]:
        """This peer's directory, its record not stored yet, and whether others can dial it: found out from the
        bootstrap peers the user named, then the run's public peers; a peer others can dial serves the DHT and the
        dial-back probe."""
        node, p2p, me_id = self.node, self.node.protocol.p2p, str(self.node.peer_id)
        addresses = await visible_maddrs(node)
        me = PeerRecord(peer_id=me_id, round=0, state=Phase.JOINING, fingerprint=document_fingerprint(document),
                        version=__version__, name=name or human_name(me_id), device=device, role=role,
                        bandwidth_mbit=config.published_mbit, addresses=addresses[:MAX_ADDRESSES], ttl=config.peer_ttl)
        directory = PeerDirectory(node, run_records(self.run_id), self.owner, me, config.heartbeat_interval,
                                  config.peer_ttl, run_id=self.run_id)
        live = (await directory.refresh()).values()
        if config.reachability == "auto":
            public = [r.peer_id for r in live if not r.dials_out and r.peer_id != me_id]
            reachability = await detect(p2p, [Multiaddr(a)["p2p"] for a in self.initial_peers], public, addresses)
        else:
            reachability = Reachability(config.reachability)
        if not reachability.dials_out:
            await start_serving(node)
            await DialBack(p2p, addresses).start()
        logger.info(f"reachability: {reachability}")
        directory.update_soon(reachability=reachability)  # stored with the first store_record
        return directory, reachability

    def abandon(self) -> None:
        """Stop the DHT node and its daemon: this peer does not enter the run. Once: ``enter`` abandons on its own
        failure, and its caller's clean-up may ask again."""
        if self.abandoned:
            return
        self.abandoned = True
        try:
            self.loop.run(finishes_within(self.node.shutdown(), FAREWELL_TIMEOUT), CALL_TIMEOUT)
        except wire.DAEMON_ERRORS as e:
            logger.info(f"stopping the DHT node: {e!r}")
        finally:
            self.loop.stop()
            self.identity.release()
