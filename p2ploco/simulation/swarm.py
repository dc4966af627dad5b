"""A swarm of simulated peers running p2ploco's own protocol code: each peer has a real ``PeerDirectory`` (records,
heartbeat, follow and look-up rules), the real sync services (``sync/start.py``: matchmaking at the coordinator,
the butterfly all-reduce, audits, the vote and commit, bans), a real ``StateServer``, and a real outer algorithm
(SparseLoCo by default) over a small model; only the links (``network.py``), the DHT (``dht.py``) and the clock
(``clock.py``) are simulated.

What a node does between syncs is the driver's (``SimPeer.train``): it trains ``inner_seconds`` of virtual time
(its pseudo-gradient is seeded noise: what matters here is the codec's real output, not learning), announces its
round and state, syncs, and takes the outer step where the round committed. A peer that did not apply a round
catches up as a node does: the state the records vouch for (``consensus.ranked_states``), fetched from its holders
(``state_fetch.fetch_state``). Churn: a share of peers leaves every round, half of them cleanly (a LEAVING record)
and half by crashing, and as many newcomers join, catch up and train."""

from __future__ import annotations

import asyncio
import logging
import math
import random
import threading
import weakref
from collections import OrderedDict, defaultdict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from hivemind.p2p import PeerID
from hivemind.utils.crypto import RSAPrivateKey

from p2ploco import __version__
from p2ploco.aio import in_time
from p2ploco.collective import robust
from p2ploco.collective.exchange import AllReduceResult, PendingAllReduce, Receipt
from p2ploco.compression.sparse_format import SparseValues
from p2ploco.config import Config, document_fingerprint, load_config
from p2ploco.errors import SwarmError
from p2ploco.metrics import RoundSummary, state_digest
from p2ploco.model import Transformer
from p2ploco.outer import build_outer
from p2ploco.outer.base import OuterAlgorithm, whole
from p2ploco.presence import public_fields
from p2ploco.simulation.clock import VirtualLoop, on_behalf_of
from p2ploco.simulation.dht import SimDHT, SimDHTNode
from p2ploco.simulation.keys import simulation_keys
from p2ploco.simulation.network import Link, SimNetwork, SimP2P
from p2ploco.swarm.bans import Bans
from p2ploco.swarm.consensus import ranked_states
from p2ploco.swarm.deadlines import TransferDeadline, round_bound, round_wait
from p2ploco.swarm.directory import PeerDirectory
from p2ploco.swarm.evidence import Signer, owner_of
from p2ploco.swarm.names import human_name
from p2ploco.swarm.records import PeerRecord, PeerRole, Phase, Reachability, run_records
from p2ploco.swarm.schema import record_validator
from p2ploco.swarm.state import Snapshot
from p2ploco.swarm.state_fetch import choose_donors, fetch_state
from p2ploco.swarm.state_server import StateServer
from p2ploco.sync.communicator import SwarmCommunicator
from p2ploco.sync.start import start_sync
from p2ploco.sync.this_peer import ThisPeer

logger = logging.getLogger(__name__)

RUN = "simulated"
SLICE = next(iter(whole(1)))  # the one slice of a full replica
TOKENS = 4096  # tokens a round's inner steps train on, per peer
SETTINGS = ("swarm.heartbeat_interval=10", "swarm.peer_ttl=60", "swarm.matchmaking_timeout=120",
            "swarm.allreduce_timeout=120", "outer.algorithm=sparseloco")


@dataclass(frozen=True)
class Scenario:
    peers: int
    rounds: int
    nat_share: float = 0.3  # peers behind a NAT: they dial out only
    churn: float = 0.0  # per round, the share of peers that leave (half cleanly, half crashing); as many join
    stragglers: float = 0.0  # peers whose inner steps take STRAGGLER_FACTOR times as long
    straggler_factor: float = 3.0
    inner_seconds: float = 60.0  # virtual time of a round's inner steps
    # virtual time from a round's sync to the next round's inner steps: a node's outer step, evaluation and round
    # record, free here (0) but where set to a real run's (``scale.py``'s ``outer_seconds_median``, for agreement)
    outer_seconds: float = 0.0
    params: int = 1 << 16  # parameters of the simulated model (one 64 x 64 matrix per 4096)
    latency: tuple[float, float] = (0.01, 0.08)  # one-way, seconds: drawn per peer
    mbit: tuple[float, float] = (50.0, 500.0)  # up and down link rates, drawn per peer
    seed: int = 0
    settings: tuple[str, ...] = ()  # config overrides, after SETTINGS
    config: str | None = None  # a config file: its settings (before ``settings``), and its model's parameter shapes
    attackers: int = 0  # peers (public, of the first) that answer the spans they reduce with their result scaled
    attack_from: int = 1  # the round from which they do


@dataclass
class PeerRound:
    """One round as one peer lived it."""

    applied: bool
    digest: str  # of the global params after the round (before it, where it was not applied)
    result: AllReduceResult
    started: float  # virtual time at which it began the round's inner steps
    ended: float  # at which its sync returned
    dht_bytes: tuple[int, int]  # stored, read since the round before's record (``PeerDirectory.take_dht_bytes``)


@dataclass(frozen=True)
class RoundOutcome:
    round: int
    synced: int  # peers that synced the round and were still there when it ended
    applied: int  # of them, those that applied it
    digests: int  # distinct params digests among those that applied it
    seconds: list[float]  # each one's round time: its inner steps and its sync (virtual seconds)

    @property
    def by_all(self) -> bool:
        return self.synced > 0 and self.applied == self.synced and self.digests == 1


@dataclass
class SimPeer:
    swarm: SimulatedSwarm
    index: int
    link: Link
    straggler: bool = False
    attacker: bool = False  # scales the results of the spans it reduces (``SCALE``)
    joined_at: float = 0.0
    left_at: float | None = None
    first_applied_at: float | None = None
    training: int = -1  # the round it trains or syncs now
    rounds: dict[int, PeerRound] = field(default_factory=dict)
    summaries: list[RoundSummary] = field(default_factory=list)  # its round records, as a node keeps them
    communicator: SwarmCommunicator | None = None
    directory: PeerDirectory | None = None
    server: StateServer | None = None
    outer: OuterAlgorithm | None = None
    p2p: SimP2P | None = None
    deadlines: TransferDeadline | None = None
    task: asyncio.Task | None = None

    def __post_init__(self) -> None:
        self.key = self.swarm.key(self.index)
        self.peer_id = owner_of(self.key.get_public_key().to_bytes())

    @property
    def live(self) -> bool:
        return self.left_at is None

    async def start(self) -> None:
        """Enter the swarm as ``peer.Arrival.enter`` does: a DHT node, a record, the sync services, a state server."""
        swarm, config = self.swarm, self.swarm.config
        c = config.swarm
        self.p2p = p2p = swarm.network.daemon(PeerID.from_base58(self.peer_id), self.link)
        validator, owner = record_validator(self.key, RUN)
        node = SimDHTNode(swarm.dht, p2p, validator, server=not self.link.nat)
        reachability = Reachability.RELAYED if self.link.nat else Reachability.PUBLIC
        me = PeerRecord(peer_id=self.peer_id, round=0, state=Phase.JOINING, fingerprint=swarm.fingerprint,
                        version=__version__, name=human_name(self.peer_id), role=PeerRole.REPLICA, device="cpu",
                        bandwidth_mbit=round(self.link.up * 8 / 1e6, 1), ttl=c.peer_ttl, reachability=reachability,
                        addresses=[str(a) for a in await p2p.get_visible_maddrs()])
        self.directory = directory = PeerDirectory(node, run_records(RUN), owner, me, c.heartbeat_interval, c.peer_ttl,
                                                   run_id=RUN, entries=swarm.dht_entries)
        await directory.refresh()
        bans = directory.bans = Bans(c.ban_rounds, RUN)
        self.deadlines = deadlines = TransferDeadline(c.allreduce_timeout, c.min_bandwidth_mbit, c.max_transfer_timeout)
        this = ThisPeer(self.peer_id, PeerRole.REPLICA, swarm.fingerprint)
        self.communicator = await start_sync(None, p2p, directory, this, RUN, c, deadlines, bans, Signer(self.key), 1,
                                             config.max_contribution_tokens, self.link.nat)
        self.server = StateServer(p2p, RUN, deadlines)
        await self.server.start()
        self.outer = build_outer(config.outer, swarm.initial_params(), max_tokens=config.max_contribution_tokens)
        directory.live_fields = lambda: {"inner_step": self.inner_step(), "step_seconds": self.step_seconds()}
        await directory.store_record()
        directory.start_heartbeat()

    # ---- a node's rounds --------------------------------------------------------------------------------------

    async def train(self, first_round: int) -> None:
        """Train from ``first_round`` until the scenario's last round or until this peer leaves."""
        swarm, directory = self.swarm, self.directory
        round_index = first_round
        while round_index < swarm.scenario.rounds:
            self.training = round_index
            digest = self.digest()
            self.serve(round_index, digest)
            # the round's announcement, with whether this peer sits rounds out (``budget.sitting``: a simulated peer
            # never does, it trains a step at least), which a node says just before it: one store
            directory.update_soon(round=round_index, state=Phase.TRAINING, params_digest=digest,
                                  slices={SLICE: digest}, step_seconds=self.step_seconds(), unsettled=False,
                                  sits_out=False)
            started = swarm.loop.time()
            await asyncio.sleep(self.inner_seconds(round_index))
            outer_sync = self.outer.contribute(self.trained(round_index), round_index, tokens=TOKENS)
            if self.attacker and round_index >= swarm.scenario.attack_from:
                swarm.hostile_exchanges.update(outer_sync.exchange.parts.values())
            result = await self.communicator.sync(outer_sync.exchange, round_index, "params")
            outer_sync.all_reduce = finished(result)
            synced = self.outer.finish(outer_sync)
            ended = swarm.loop.time()
            await asyncio.sleep(swarm.scenario.outer_seconds)
            self.rounds[round_index] = PeerRound(synced.applied, self.digest(), result, started, ended,
                                                 directory.take_dht_bytes())
            traffic = result.traffic
            # its round record, as a node's shows in its DHT record: made-up losses (nothing here learns), an eval
            # where a node evaluates
            evaluated = swarm.config.training.evaluates_after(round_index)
            self.summaries.append(RoundSummary(
                round=round_index, peers=len(result.peers), loss=4.0 - 0.01 * round_index,
                eval_loss=4.1 - 0.01 * round_index if evaluated else None, params_digest=self.digest(),
                round_seconds=swarm.loop.time() - started, bytes_sent=traffic.bytes_sent,
                bytes_received=traffic.bytes_received, dense_fp32_bytes=traffic.dense_fp32_bytes, tokens=TOKENS))
            directory.update_soon(**public_fields(self.summaries))
            await asyncio.sleep(0)  # stored apart from the next round's announcement, as a node's loop thread does
            swarm.round_ended(self, round_index)
            if synced.applied:
                if self.first_applied_at is None:
                    self.first_applied_at = swarm.loop.time()
                round_index += 1
            else:
                round_index = await self.catch_up(round_index + 1)

    def inner_seconds(self, round_index: int) -> float:
        """How long this peer trains round ``round_index``: its H steps, or, where it starts the round after the swarm
        did (it caught up), as many steps (at least one) as end with the swarm's, as a node's round budget has it
        (``budget.py``)."""
        began = self.swarm.round_began.setdefault(round_index, self.swarm.loop.time())
        full = self.step_seconds() * self.swarm.steps
        left = began + full - self.swarm.loop.time()
        return max(self.step_seconds(), math.floor(left / self.step_seconds()) * self.step_seconds())

    def inner_step(self) -> int:
        """The inner step this peer is at in its round, as its record shows it on every heartbeat."""
        began = self.swarm.round_began.get(self.training)
        if began is None:
            return 0
        return min(self.swarm.steps, int((self.swarm.loop.time() - began) / self.step_seconds()))

    def step_seconds(self) -> float:
        scenario = self.swarm.scenario
        seconds = scenario.inner_seconds / self.swarm.steps
        return seconds * (scenario.straggler_factor if self.straggler else 1.0)

    def trained(self, round_index: int) -> list[torch.Tensor]:
        """The local params after the round's inner steps: the global ones moved along the round's common direction
        (what every peer's data agrees on) plus this peer's own seeded noise, as pseudo-gradients of one model on
        one corpus are (independent noise alone would point many peers against their group's mean)."""
        seed = self.swarm.scenario.seed
        common = torch.Generator().manual_seed(hash((seed, round_index)) % 2**62)
        own = torch.Generator().manual_seed(hash((seed, self.index, round_index)) % 2**62)
        return [p - 1e-3 * (torch.randn(p.shape, generator=common) + 0.2 * torch.randn(p.shape, generator=own))
                for p in self.outer.params]

    def digest(self) -> str:
        params, shared = self.state()
        return state_digest(params, shared)

    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        return {f"p{i}": p for i, p in enumerate(self.outer.params)}, self.outer.shared_state()

    def serve(self, round_index: int, digest: str) -> None:
        """Serve the state this peer starts ``round_index`` from (of ``digest``), to peers that catch up."""
        snapshot = Snapshot(round_index, SLICE, *self.state(), digest)
        self.server.hold(*self.server.prepare_round([snapshot]))

    async def catch_up(self, round_index: int) -> int:
        """The round to train next, once this peer holds the state the swarm's records vouch for at
        ``round_index`` or later (fetched from its holders), as a node's catch-up does."""
        directory, c = self.directory, self.swarm.config.swarm
        interval, loop = c.heartbeat_interval, self.swarm.loop
        # how long the round under way may still take, as a node waits for it (``Swarm.round_wait``)
        deadline = loop.time() + round_wait(round_bound(c.matchmaking_timeout, c.allreduce_timeout), interval,
                                            [r.round_seconds for r in directory.live.values()])
        while round_index < self.swarm.scenario.rounds and self.swarm.running_round() < self.swarm.scenario.rounds:
            live = await directory.refresh()
            me = directory.me.model_copy(update={"round": round_index, "slices": {SLICE: self.digest()},
                                                 "state": Phase.TRAINING, "unsettled": True})
            states = [s for s in ranked_states(live, me, SLICE) if s.round >= round_index and len(s.holders) >= 2]
            if states and self.peer_id in states[0].holders:
                return states[0].round
            if states:
                target = states[0]
                donors = await choose_donors(self.p2p, target, self.peer_id, directory.bans, directory,
                                             self.swarm.donor_draw)
                try:
                    snapshot = await fetch_state(self.p2p, self.server.handler_name, target,
                                                 donors, self.deadlines, self.swarm.state_bytes, _blame_nobody,
                                                 directory.rates(donors))
                except SwarmError as e:
                    logger.info(f"sim{self.index}: catch-up failed ({e}); looking again")
                else:
                    self.outer.load_params([snapshot.params[f"p{i}"] for i in range(len(self.outer.params))])
                    self.outer.load_shared_state(snapshot.shared)
                    return target.round
            elif loop.time() >= deadline:
                # Nobody holds a state of this round or later once the round under way is over: every survivor
                # dropped the last round (its coordinator aborted it), nobody is ahead, and a node that is not
                # behind trains on from its own state (``catchup.py``)
                return round_index
            directory.update_soon(state=Phase.JOINING, round=round_index)
            await asyncio.sleep(interval)
        return self.swarm.scenario.rounds  # the run is over

    async def begin(self) -> None:
        """One of the run's first peers: wait for the others, as a node waits for ``swarm.min_peers``, and train."""
        c = self.swarm.config.swarm
        digest = self.digest()
        self.directory.update_soon(slices={SLICE: digest}, params_digest=digest)  # the state it starts from
        await self.directory.wait_for_peers(self.swarm.scenario.peers, c.startup_timeout, threading.Event())
        await self.train(0)

    async def join(self) -> None:
        """A newcomer: enter, catch up with the swarm, train."""
        await self.start()
        first = await self.catch_up(0) if self.swarm.running_round() > 0 else 0
        await self.train(first)


def finished(result: AllReduceResult) -> PendingAllReduce:
    """A sync that has ended with ``result``, as the outer algorithm waits for one."""
    future: Future[AllReduceResult] = Future()
    future.set_result(result)
    grouped = threading.Event()
    grouped.set()
    return PendingAllReduce(future, grouped)


def _blame_nobody(donor: str, why: str) -> None:
    logger.info(f"donor {donor[-8:]}: {why}")


SCALE = 8.0  # what an attacker multiplies the results of its spans by


def scaled_results(swarm: SimulatedSwarm) -> Callable[[Any, Callable[..., Any]], Callable[..., Any]]:
    """The ``reduce.result`` seam (``faults.py``) of a swarm with attackers: an attacker's exchange answers its span's
    mean, and the bound the contributions allow, times SCALE (well-formed and finite); everyone else's, honestly."""
    def resulting(exchange: Any, honest: Callable[..., Any]) -> Callable[..., Any]:
        if exchange not in swarm.hostile_exchanges:
            return honest

        def scaled(span: Any, mean: SparseValues, contributions: int, limit: float) -> Any:
            return honest(span, SparseValues(mean.positions, mean.values * np.float32(SCALE)), contributions,
                          limit * SCALE)
        return scaled
    return resulting


SHARED_VERDICTS = 1024  # audits' verdicts the simulation keeps for the peers that audit the same piece alike


def shared_audits() -> Callable[[Any, Callable[..., Any]], Callable[..., Any]]:
    """The ``audit.check`` seam (``faults.py``) of a simulated swarm: an audit's verdict is a function of what it is
    given (its peers all run one outer algorithm on one slice, so the exchange's kind and the span stand for the rest),
    and the members that audit one piece with the same payloads, receipt and taken values are told the verdict of the
    first of them, worked out by the honest audit. Else N members re-reducing a piece of N contributions each would
    cost the simulation N^3 a round, the peers they stand for N^2 each."""
    verdicts: OrderedDict[tuple, str | None] = OrderedDict()

    def auditing(audits: Any, honest: Callable[..., Any]) -> Callable[..., Any]:
        def once(exchange: Any, span: range, contributions: list[tuple[str, bytes]], tokens: dict[str, int],
                 receipt: Receipt, values: robust.Vector) -> str | None:
            key = (type(exchange), span, tuple(contributions), tuple(sorted(tokens.items())), receipt.norms,
                   receipt.tokens, receipt.opposed, receipt.contributions, values.values.tobytes(),
                   None if values.positions is None else values.positions.tobytes())
            if key not in verdicts:
                verdicts[key] = honest(exchange, span, contributions, tokens, receipt, values)
                while len(verdicts) > SHARED_VERDICTS:
                    verdicts.popitem(last=False)
            return verdicts[key]
        return once
    return auditing


class SimulatedSwarm:
    def __init__(self, scenario: Scenario, loop: VirtualLoop):
        self.scenario, self.loop = scenario, loop
        self.config: Config = load_config(scenario.config, [*SETTINGS, *scenario.settings,
                                                            f"training.rounds={scenario.rounds}"])
        self.steps = self.config.inner.steps
        self.fingerprint = document_fingerprint(self.config.run_document())
        self.network = SimNetwork(loop)
        self.dht = SimDHT(self.network)
        self.dht_entries: dict = {}  # the record entries every peer's directory has read (``PeerDirectory``)
        self.draw = random.Random(scenario.seed)  # the scenario's: links, churn
        self.donor_draw = random.Random(scenario.seed + 1)  # the peers' (``choose_donors``): the scenario's draws stay
        self.keys = simulation_keys(scenario.peers + math.ceil(scenario.peers * scenario.churn) * scenario.rounds)
        self.peers: list[SimPeer] = []
        self.ended: dict[int, set[str]] = defaultdict(set)  # round -> peers whose sync of it returned
        self.round_began: dict[int, float] = {}  # round -> when its first peer began training it
        self.hostile_exchanges: weakref.WeakSet = weakref.WeakSet()  # the attackers' exchanges: they scale results
        self.banned_at: dict[str, float] = {}  # attacker -> when most honest peers had banned it
        self.on_round: Callable[[int], None] = lambda r: None  # called once every live peer ended a round
        self._reported = -1
        if scenario.config is None:
            self._shapes = [torch.Size((64, 64))] * max(1, scenario.params // 4096)
        else:  # the config's model, as a node trains it
            self._shapes = [p.shape for p in Transformer(self.config.model, self.config.training.seed).parameters()]
        self.state_bytes = sum(4 * shape.numel() for shape in self._shapes)

    def key(self, index: int) -> RSAPrivateKey:
        """Peer ``index``'s key: those made for the expected churn first, more if the run outlasts it."""
        if index >= len(self.keys):
            self.keys = simulation_keys(max(index + 1, 2 * len(self.keys)))
        return self.keys[index]

    def initial_params(self) -> list[torch.Tensor]:
        draw = torch.Generator().manual_seed(self.scenario.seed)
        return [torch.randn(shape, generator=draw) * 0.02 for shape in self._shapes]

    def new_peer(self) -> SimPeer:
        s, draw = self.scenario, self.draw
        latency = draw.uniform(*s.latency)
        up, down = (draw.uniform(*s.mbit) * 1e6 / 8 for _ in range(2))
        peer = SimPeer(self, len(self.peers), Link(latency, up, down, nat=draw.random() < s.nat_share),
                       straggler=draw.random() < s.stragglers, joined_at=self.loop.time())
        self.peers.append(peer)
        return peer

    def running_round(self) -> int:
        return max((max(p.rounds) + 1 for p in self.peers if p.rounds), default=0)

    def round_ended(self, peer: SimPeer, round_index: int) -> None:
        self.ended[round_index].add(peer.peer_id)
        self._look_for_bans(round_index)
        # a round is over once no live peer trains or syncs it or an earlier one: peers left out of a round may end
        # the next before the others end theirs (2,048 peers: round 0 was reported, 0 of 30 applying it, so)
        while self._reported < round_index and not self._syncing(self._reported + 1):
            self._reported += 1
            self.on_round(self._reported)

    def _syncing(self, round_index: int) -> bool:
        """Whether a live peer still trains or syncs ``round_index`` or an earlier round."""
        return any(p.live and 0 <= p.training <= round_index and p.peer_id not in self.ended[p.training]
                   for p in self.peers)

    def _look_for_bans(self, round_index: int) -> None:
        """Note when each attacker is first banned by most of the honest peers that are there."""
        honest = [p for p in self.peers if p.live and not p.attacker and p.directory is not None]
        for attacker in (p for p in self.peers if p.attacker and p.peer_id not in self.banned_at):
            if honest and 2 * sum(p.directory.bans.banned(attacker.peer_id, round_index) for p in honest) > len(honest):
                self.banned_at[attacker.peer_id] = self.loop.time()

    def round_outcome(self, round_index: int) -> RoundOutcome:
        """How round ``round_index`` went: the honest peers that synced it and stayed, and who of them applied it."""
        rows = [p.rounds[round_index] for p in self.peers if round_index in p.rounds and not p.attacker
                and (p.left_at is None or p.left_at > p.rounds[round_index].ended)]
        applied = [r for r in rows if r.applied]
        return RoundOutcome(round_index, len(rows), len(applied), len({r.digest for r in applied}),
                            sorted(r.ended - r.started for r in rows))

    async def run(self) -> None:
        first = [self.new_peer() for _ in range(self.scenario.peers)]
        public = [p for p in first if not p.link.nat]
        if not public:  # somebody must be dialable: the first peer is
            first[0] = self.peers[0] = SimPeer(self, 0, replace(first[0].link, nat=False))
            public = [first[0]]
        for peer in public[:self.scenario.attackers]:
            peer.attacker = True
        await asyncio.gather(*(on_behalf_of(peer.peer_id, peer.start()) for peer in first))
        for peer in first:
            peer.task = on_behalf_of(peer.peer_id, peer.begin())
        churn = asyncio.ensure_future(self._churn())
        try:
            await in_time(self._trained(), self.time_limit())
        except TimeoutError:
            logger.warning(f"the simulation ran out of its {self.time_limit():.0f} s of virtual time")
        finally:  # the peers' services stop with the loop's tasks (``report.simulate``)
            churn.cancel()

    def time_limit(self) -> float:
        """Virtual seconds the run may take: every round's inner steps and its longest sync, twice over."""
        c = self.config.swarm
        return 2 * self.scenario.rounds * (self.scenario.inner_seconds * self.scenario.straggler_factor
                                           + self.scenario.outer_seconds + c.matchmaking_timeout
                                           + c.allreduce_timeout) + 600

    async def _trained(self) -> None:
        """Until every peer's training ended (the last round, or it left); a peer's bug is raised here."""
        while True:
            running = [p.task for p in self.peers if p.task is not None and not p.task.done()]
            if not running:
                break
            await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
        for peer in self.peers:
            if peer.task is not None and not peer.task.cancelled() and peer.task.exception() is not None:
                raise peer.task.exception()

    async def _churn(self) -> None:
        """Once per round time, about ``churn`` of the live peers leave (half cleanly, half crash: a whole number
        drawn so that its mean is right) and as many join."""
        s = self.scenario
        while s.churn and self.running_round() < s.rounds - 1:
            await asyncio.sleep(s.inner_seconds)
            live = [p for p in self.peers if p.live and p.task is not None and not p.task.done()]
            expected = len(live) * s.churn
            count = min(len(live) - 2, int(expected) + (self.draw.random() < expected % 1))
            leaving = self.draw.sample(live, max(0, count))
            for i, peer in enumerate(leaving):
                if i % 2:
                    self.crash(peer)
                else:
                    await self.leave(peer)
            for _ in leaving:
                newcomer = self.new_peer()
                newcomer.task = on_behalf_of(newcomer.peer_id, newcomer.join())

    async def leave(self, peer: SimPeer) -> None:
        peer.directory.update_soon(state=Phase.LEAVING)
        await peer.directory.flush(timeout=10.0)
        self.crash(peer)

    def crash(self, peer: SimPeer) -> None:
        peer.left_at = self.loop.time()
        for task in self.loop.tasks_of(peer.peer_id):
            task.cancel()
        self.network.crash(peer.peer_id)
        self.dht.leave(peer.peer_id)
