"""What a node trains as: a full replica, one stage of a pipeline group, or a hub that trains nothing.

``Node`` keeps the lifecycle (join, catch up, rounds, records, checkpoints, leave); a role owns the
worker and decides when it may train a round. A replica holds the whole model and may always train.
A stage peer takes a (group, stage) slot (``pipeline/assembly.py``: the rules every peer applies to the
same signed records), holds that stage's slice, and trains a round only when its pipeline group is
complete and every stage of it has reached that round; it then links to the group's other stages over
hivemind streams (``pipeline/links.py``). Until then it waits as standby, keeping its slice up to date,
and it serves that slice to peers catching up like any holder.

A hub is a public machine that helps trainers who cannot be dialled (behind home routers: ``swarm/reachability.py``)
train together. It holds a full replica and trains no step: it joins every round with no contribution
(``Group.contributors``), coordinates, reduces its spans of the trainers' contributions and takes every result, so it
ends each round with the same global state as they do, and serves that state to peers catching up.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from hivemind.utils import get_dht_time

from p2ploco.build import build_replica, build_stage
from p2ploco.config import Config
from p2ploco.data import ShardSampler, TrainingData
from p2ploco.errors import shown
from p2ploco.peer import Swarm
from p2ploco.pipeline.assembly import Claim, choose_slot, complete_pipelines, formation_epoch, in_step, pipeline_round
from p2ploco.pipeline.links import RemoteTransport, Schedule, StageLinks, StageLinkServer
from p2ploco.pipeline.schedule import PipelineStage
from p2ploco.ranks import LocalRanks
from p2ploco.swarm.records import PeerRole, Phase
from p2ploco.worker import Worker

logger = logging.getLogger(__name__)

REPLICA, STAGE, HUB = PeerRole.REPLICA, PeerRole.STAGE, PeerRole.HUB  # what a node trains as: its record's role
IN_ROUND = (Phase.TRAINING, Phase.AVERAGING)  # a stage that announced it is in for its round
ASSEMBLY_POLL = 0.25  # seconds between looks at whether the other stages of a group are in for the round


@dataclass(frozen=True)
class RoleOptions:
    kind: str = REPLICA  # replica (the whole model), stage (one stage of a pipeline group) or hub (trains nothing)
    pipeline: str | None = None  # a stage's pinned pipeline group (None: any)
    stage: int | None = None  # a stage's pinned stage (None: any)


def schedule_digest(config: Config) -> str:
    """What the stages of a pipeline group must share to step together: the inner settings and the window."""
    shared = {"inner": config.inner.model_dump(), "seq_len": config.data.seq_len}
    return hashlib.sha256(json.dumps(shared, sort_keys=True).encode()).hexdigest()[:16]


class Role(ABC):
    kind: str
    evaluates: bool  # whether this peer can score the held-out data (it holds the whole model)
    # whether it steps on its own (a replica), so may sit rounds out while one step outlasts them; a pipeline
    # stage steps with its group's other stages (the group stops at the step the slowest stage's budget allows)
    trains_alone: bool
    worker: Worker | None = None
    waiting_for = ""  # why the last ready() said no, for the node's log

    def place(self) -> bool:
        """Settle which part of the model this peer holds; True if that gave it a new worker (whose state is the
        seed's: the swarm's comes with the next catch-up)."""
        return False

    def ready(self, round_index: int, announce: Callable[[], None], stand_by: Callable[[], None],
              stopping: threading.Event) -> bool:
        """Whether this peer may train ``round_index`` now; ``announce`` publishes that it is in for the round,
        ``stand_by`` that it is in the round but nobody is to wait for it (a stage stands by while the other stages
        of its group come to the round, and announces once they all have, then waits, bounded, for them to be in
        too)."""
        return True

    def round_of_pipeline(self, round_index: int) -> int:
        """The round this peer trains next as its pipeline has it (``pipeline.assembly.pipeline_round``): the round
        it meets in, ahead of ``round_index``, or ``round_index``. A replica has no pipeline."""
        return round_index

    def record_fields(self) -> dict[str, Any]:
        """What this role adds to a round record (role, group, stage, boundary traffic)."""
        return {"role": self.kind}

    def checkpoint_extras(self) -> dict[str, Any]:
        return {}

    @abstractmethod
    def describe(self) -> str:
        """One line on what this peer holds."""


class ReplicaRole(Role):
    kind, evaluates, trains_alone = REPLICA, True, True

    def __init__(self, config: Config, device: torch.device, data: TrainingData, swarm: Swarm,
                 ranks: LocalRanks | None = None):
        """``ranks``: the node's local ranks (``p2ploco.ranks``), which train the replica with it."""
        c = config
        sampler = ShardSampler(data.train, c.data.seq_len, c.inner.batch_size, c.run_id, swarm.peer_id)
        self.worker = build_replica(c, device, sampler, ranks)
        self.ranks = 1 if ranks is None else ranks.world

    def describe(self) -> str:
        on = f" on {self.ranks} local ranks" if self.ranks > 1 else ""
        return f"full replica{on}, {sum(p.numel() for p in self.worker.model.parameters()) / 1e6:.2f}M params"


class HubRole(ReplicaRole):
    """A full replica that trains nothing (module docstring): its rounds have no inner step (``Node._budget``), and it
    leaves scoring the held-out data to the trainers (a hub is a machine lent for its link, not its compute)."""

    kind, evaluates, trains_alone = HUB, False, False

    def describe(self) -> str:
        return (f"hub: a full replica that trains nothing, "
                f"{sum(p.numel() for p in self.worker.model.parameters()) / 1e6:.2f}M params")


class StageRole(Role):
    kind, evaluates, trains_alone = STAGE, False, False

    def __init__(self, config: Config, device: torch.device, data: TrainingData, swarm: Swarm,
                 options: RoleOptions):
        self.config, self.device, self.data, self.swarm, self.options = config, device, data, swarm, options
        self.server = StageLinkServer(swarm.node.protocol.p2p, config.run_id, config.swarm.allreduce_timeout)
        swarm.loop.run(self.server.start(), 30)
        self.schedule = schedule_digest(config)
        self.slot: tuple[str, int] | None = None
        self.gradients: PipelineStage | None = None  # the worker's gradient source: its part of the group's steps
        self.links: StageLinks | None = None
        self.transport: RemoteTransport | None = None
        self._counted: tuple[int, int, float] = (0, 0, 0.0)  # boundary traffic and time as of the last record

    def pin(self, pipeline: str, stage: int) -> None:
        """Claim this slot (a stage resumed from its checkpoint goes back to the stage it holds)."""
        self.options = RoleOptions(STAGE, self.options.pipeline or pipeline, stage)

    def _claims(self) -> list[tuple[Claim, str, int, str]]:
        return [(Claim(r.peer_id, r.group, r.stage, r.since), r.schedule, r.round, r.state)
                for r in self.swarm.claims()]

    def place(self) -> bool:
        me = self.swarm.peer_id
        claims = [claim for claim, *_ in self._claims() if claim.peer_id != me]
        if self.slot is not None:
            claims.append(Claim(me, *self.slot, self.swarm.directory.me.since))
        slot = choose_slot(claims, me, self.config.pipeline.stages, self.options.pipeline, self.options.stage)
        if slot == self.slot:
            return False
        logger.info(f"stage slot {shown(slot[0])}/{slot[1]} (was {self.slot})")  # a tuple shows its strings escaped
        self.slot, self.links = slot, None
        self.swarm.update_record(group=slot[0], stage=slot[1], since=get_dht_time(), schedule=self.schedule)
        if self.gradients is not None and self.gradients.stage == slot[1]:
            return False  # the same stage of another group: the same slice, kept
        self.worker, self.gradients = build_stage(self.config, self.device, slot[1])
        return True

    def _pipeline(self) -> tuple[tuple[str, ...] | None, dict[str, tuple[str, int, str]]]:
        """The holders of this peer's group if it is complete and this peer holds its slot (else None), and each
        holder's (schedule, round, state)."""
        pipeline, stage = self.slot
        claims = self._claims()
        peers = complete_pipelines([claim for claim, *_ in claims], self.config.pipeline.stages).get(pipeline)
        if peers is None or peers[stage] != self.swarm.peer_id:
            return None, {}
        return peers, {claim.peer_id: (schedule, round_of, state) for claim, schedule, round_of, state in claims
                       if claim.peer_id in peers}

    def ready(self, round_index: int, announce: Callable[[], None], stand_by: Callable[[], None],
              stopping: threading.Event) -> bool:
        pipeline, stage = self.slot
        peers, mates = self._pipeline()
        if peers is None:
            self.waiting_for = f"pipeline {shown(pipeline)} to have all {self.config.pipeline.stages} stages"
            return False
        if any(schedule != self.schedule for schedule, _, _ in mates.values()):
            self.waiting_for = (f"pipeline {shown(pipeline)}'s stages to share inner settings (inner.* and "
                                f"data.seq_len must match on every stage)")
            return False
        links = StageLinks(pipeline, formation_epoch(pipeline, peers), peers)
        if links != self.links:
            self.links = links
            self.transport = RemoteTransport(self.swarm.loop, self.server, links, stage, Schedule.of(self.config),
                                             self.config.swarm.allreduce_timeout)
            c = self.config
            sampler = (ShardSampler(self.data.train, c.data.seq_len, c.inner.batch_size, c.run_id, f"group-{pipeline}")
                       if stage == 0 else None)
            self.gradients.link(self.transport, sampler)
            self._counted = (0, 0, 0.0)
        if -1 < self._swarm_round(peers) < round_index - 1:
            # the round the pipeline meets in (``round_of_pipeline``): its state comes when the swarm's trainers reach
            # it (a round behind is the swarm finishing the last round, as the stages are done with it first)
            self.waiting_for = f"the swarm to reach round {round_index}, where pipeline {shown(pipeline)} meets"
            return False
        self.waiting_for = f"every stage of pipeline {shown(pipeline)} to be in round {round_index}"
        # Assembling: until every stage is in this round, this one stands by in it (a coordinator does not wait for a
        # group that may never come together), unless the group is in step (``in_step``: it applied the last round
        # together); once all are, it is in for the round, and waits for the others to be too.
        others = {peer: (round_of, state in IN_ROUND) for peer, (_, round_of, state) in mates.items()
                  if peer != self.swarm.peer_id}
        applied = self.swarm.applied_with()
        together = applied is not None and in_step(others, round_index, applied.round_index, applied.peers)
        if not self._all_in(peers, round_index, lambda state: state != Phase.LEAVING, stopping,
                            announce if together else stand_by):
            return False
        announce()  # the round's coordinator now waits for this stage; the others may send to it
        return self._all_in(peers, round_index, lambda state: state in IN_ROUND, stopping)

    def _all_in(self, peers: tuple[str, ...], round_index: int, meets: Callable[[str], bool],
                stopping: threading.Event, waiting: Callable[[], None] | None = None) -> bool:
        """Whether every other stage of the group ``peers`` comes to be in ``round_index`` in a state that ``meets``
        asks, within the wait for a round to end (``Swarm.round_wait``; ``waiting`` is announced once, if this stage
        has to wait for them). False at once if the group changes, or a stage is in a later round (the group meets
        where ``round_of_pipeline`` says)."""
        deadline = time.monotonic() + self.swarm.round_wait()
        while not stopping.is_set() and time.monotonic() < deadline:
            peers_now, mates = self._pipeline()
            if peers_now != peers:
                return False  # the group changed while it assembled
            others = [(round_of, state) for peer, (_, round_of, state) in mates.items() if peer != self.swarm.peer_id]
            if all(round_of == round_index and meets(state) for round_of, state in others):
                return True
            if any(round_of > round_index for round_of, _ in others):
                return False
            if waiting is not None:
                waiting()
                waiting = None
            stopping.wait(min(self.config.swarm.heartbeat_interval, ASSEMBLY_POLL))
        return False

    def round_of_pipeline(self, round_index: int) -> int:
        peers, mates = self._pipeline()
        if peers is None:
            return round_index
        me = self.swarm.peer_id
        return pipeline_round([round_of for peer, (_, round_of, _) in mates.items() if peer != me], round_index,
                           self._swarm_round(peers))

    def _swarm_round(self, peers: tuple[str, ...]) -> int:
        """The furthest round a trainer of the run outside the group ``peers`` is in or catching up to (-1: none);
        not a standby stage's (another group's proposal)."""
        fingerprint = self.swarm.directory.me.fingerprint
        return max((r.round for r in self.swarm.directory.live.values()
                    if r.peer_id not in peers and r.fingerprint == fingerprint
                    and r.state in (*IN_ROUND, Phase.JOINING)), default=-1)

    def record_fields(self) -> dict[str, Any]:
        t = self.transport
        sent, received, seconds = (t.bytes_sent, t.bytes_received, t.seconds) if t else (0, 0, 0.0)
        fields = {"role": STAGE, "group": self.slot[0], "stage": self.slot[1],
                  "boundary_bytes_sent": sent - self._counted[0],
                  "boundary_bytes_received": received - self._counted[1],
                  "boundary_seconds": seconds - self._counted[2]}
        self._counted = (sent, received, seconds)
        return fields

    def checkpoint_extras(self) -> dict[str, Any]:
        return {"slot": list(self.slot)}

    def describe(self) -> str:
        return (f"stage {self.slot[1]} of pipeline group {shown(self.slot[0])}, "
                f"{sum(p.numel() for p in self.worker.model.parameters()) / 1e6:.2f}M params")
