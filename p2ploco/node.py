"""A training node: joins the swarm, catches up with it, and runs outer rounds until told to stop.

Start-up (``Node.run``): device, data and the swarm first, so that bad input ends the start with one line before
any peer has seen this node; then the run directory, the role (a full replica or a pipeline stage) and a
checkpoint to resume from. The loop (``Node._loop``), round by round: settle which part of the model this peer
holds, catch up with the swarm if it is ahead (``catchup.py``), check that the role may train the round, run
the round schedule (``p2ploco.schedules``: inner steps and the outer round, blocking, overlapped or streaming),
write the record. Checkpoints are written every ``training.checkpoint_every`` rounds and on a clean exit. What the
node shows the swarm on the way goes through one object (``presence.py``); what it carries from one round to the
next is one value (``standing.py``).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

from p2ploco import faults
from p2ploco.budget import FixedSteps, SitOut, Sitting, WallClockBudget, round_budget, sitting
from p2ploco.catchup import CatchUp
from p2ploco.checkpoint import Checkpoint
from p2ploco.collective.exchange import AllReduceResult
from p2ploco.config import Config
from p2ploco.config_choice import config_to_train
from p2ploco.dashboard.documents import ROUNDS_DOCUMENT, RUN_STATUS, RoundsFeed, config_rows, run_status
from p2ploco.dashboard.page import PAGE_PATH, page_routes
from p2ploco.data import Batch, TrainingData, eval_batches, load_training_data
from p2ploco.errors import ConfigError, PipelineError
from p2ploco.host_memory import give_back_freed, keep_freed_memory
from p2ploco.machine import describe_device, resolve_device
from p2ploco.metrics import RoundSummary
from p2ploco.outer.base import Synced
from p2ploco.peer import Arrival, Swarm
from p2ploco.presence import Presence
from p2ploco.progress import join_command, join_instructions, progress_line, summary
from p2ploco.ranks import LocalRanks, RankError
from p2ploco.ranks.processes import RankSetup
from p2ploco.roles import HUB, REPLICA, STAGE, HubRole, ReplicaRole, Role, RoleOptions, StageRole
from p2ploco.rundir import RunDirectory
from p2ploco.schedules import RoundHooks, RoundSchedule, build_schedule
from p2ploco.standing import Membership, Standing
from p2ploco.swarm import DEFAULT_HOST_MADDRS
from p2ploco.swarm.status import WILDCARDS, Answer, constant, listen, why_not_listening
from p2ploco.swarm.status_document import STATUS_PATH


@dataclass
class SwarmOptions:
    initial_peers: Sequence[str] = ()
    host_maddrs: Sequence[str] = DEFAULT_HOST_MADDRS
    announce_maddrs: Sequence[str] = ()
    identity_path: str | None = None
    name: str = ""  # shown in `p2ploco peers`; derived from the peer id when empty


class Node:
    def __init__(self, config: Config, options: SwarmOptions, log_dir: Path | None, config_path: str | None,
                 resume: str | None = None, out: Callable[[str], None] = print, role: RoleOptions | None = None,
                 status_address: tuple[str, int] | None = None, overrides: Sequence[str] = (),
                 document_path: Path | None = None):
        """``config_path``: the file ``config`` was read from; None: the node trains its run's config, fetched from
        the run's peers (``swarm/run_config.py``), with ``config``'s own settings (``config.LOCAL_KEYS``) and
        ``overrides`` (the ``--set`` given) on top; ``document_path``: where that run's document is (``p2ploco dht``
        fetched it for its hub), instead of from the run's peers. ``status_address``: (host, port) to serve the run's
        status on (``swarm/status.py``); None: not served."""
        self.config, self.options, self.config_path, self.out = config, options, config_path, out
        self.document_path = document_path
        self.overrides = overrides
        self.data: TrainingData | None = None  # loaded once the config is settled (``config_choice.config_to_train``)
        self.run_files: tuple[RunDirectory, Checkpoint | None] | None = None  # and the checkpoint to resume from
        self.status_address = status_address
        self.log_dir, self.resume, self.role_options = log_dir, resume, role or RoleOptions()
        self.summaries: list[RoundSummary] = []
        # the members of the newest aggregate this node applied, and the tokens each weighed: the dashboard's shares
        self.weights: dict[str, int] = {}
        self.stopping = threading.Event()
        self.swarm: Swarm | None = None
        self.ranks: LocalRanks | None = None  # the node's local ranks 1..N-1, where it has more than one
        self.failure: RankError | None = None  # why the node stopped training before it was told to (a rank died)

    def stop(self) -> str:
        """Leave after the current round (safe from a signal handler): an unfinished round's inner steps
        are abandoned; an all-reduce under way is finished. Returns what happens next, for the person who asked."""
        self.stopping.set()
        if self.swarm is not None:
            self.swarm.request_leave()
        if not self.summaries:
            return ("leaving before its first round ended: nothing is trained, so no checkpoint is written (start "
                    "again in the same way; signal again to stop at once)")
        return ("leaving: the round's inner steps stop here, an all-reduce under way is finished, then a checkpoint "
                "is written (signal again to stop at once)")

    def run(self) -> list[RoundSummary]:
        c = self.config
        keep_freed_memory()
        if c.training.threads:
            torch.set_num_threads(c.training.threads)
        device = resolve_device(c.training.device, c.training.ranks)
        # Bad input ends the start-up here, with one line, before any peer has seen this node: its own config and
        # data, the status port; then, once the DHT is up, its config against the run's.
        data = None if self.config_path is None else self._load_data(c)
        status = self._listen_for_status(*self.status_address) if self.status_address is not None else None
        swarm = self.swarm = self._join(data, status, device)
        started = time.perf_counter()
        me = swarm.peer_id[-8:]
        try:
            self._train(swarm, status, device)
        except KeyboardInterrupt:  # a second signal: stop now, keep the last periodic checkpoint
            self.out(f"[{me}] stopped at once after {len(self.summaries)} round(s); no exit checkpoint")
        finally:
            try:  # a periodic checkpoint being written is finished, also when stopped at once
                self.run_files[0].close()
            finally:
                try:
                    swarm.leave()
                finally:
                    if self.ranks is not None:
                        self.ranks.close()
        if not self.summaries and self.stopping.is_set():
            return self.summaries  # stopped before its first round: the line the stop printed says all there is
        if self.stopping.is_set() or self.failure is not None:
            self.out(f"[{me}] left the swarm after {len(self.summaries)} round(s)")
        self.out(summary(self.summaries, time.perf_counter() - started))
        if self.failure is not None:
            raise self.failure
        return self.summaries

    def _train(self, swarm: Swarm, status: tuple[socket.socket, str] | None, device: torch.device) -> None:
        """From the swarm joined to the exit checkpoint: the role, the rounds, the checkpoint."""
        c, data, (files, saved) = self.config, self.data, self.run_files
        faults.hit("start.join", 0)
        if self.stopping.is_set():  # stopped while it joined: it leaves before it has trained or said more
            return
        Presence.announce_machine(swarm, describe_device(device, c.training.ranks), c.training.ranks)
        if status is not None:
            self._serve_status(swarm, *status)
        self._print_join_instructions(swarm)
        if c.training.ranks > 1:
            self.ranks = self._start_ranks(swarm, device)
        role, standing = self._take_role(swarm, device, data, files, saved, self.ranks)
        presence = Presence(swarm, role)
        presence.track_steps()
        self._print_setup(swarm, role, device, data)
        presence.announce_joining(standing.round)
        if c.swarm.min_peers > 1:
            self._wait_for_peers(swarm)
        held_out = eval_batches(data.eval, c.data.seq_len, c.data.eval_sequences)
        schedule = build_schedule(c, role.worker)
        try:
            standing, schedule = self._loop(swarm, presence, role, schedule, files, held_out, standing)
            me = swarm.peer_id[-8:]
            if self.failure is not None and c.training.shard:
                self.out(f"[{me}] no exit checkpoint: the rank that left held shards of the model and of its "
                         f"optimizer state; the last checkpoint in {files.checkpoints} stands")
            elif self.summaries:  # one that trained nothing writes none: it would hold the seed's state (or
                # one a checkpoint or the swarm still holds), and make the next start in this folder need --resume
                self._save_on_exit(swarm, role, schedule, files, standing)
                self.out(f"[{me}] checkpoint of round {standing.round} written to {files.checkpoints}")
        finally:
            schedule.close()

    def _start_ranks(self, swarm: Swarm, device: torch.device) -> LocalRanks:
        c = self.config
        ranks = LocalRanks.start(c.training.ranks, device, RankSetup(c.model_dump(mode="json"), swarm.peer_id))
        others = "rank 1" if c.training.ranks == 2 else f"ranks 1-{c.training.ranks - 1}"
        how = "sharded (FSDP2), data parallel" if c.training.shard else "data parallel"
        self.out(f"[{swarm.peer_id[-8:]}] {c.training.ranks} local ranks on {describe_device(device, c.training.ranks)}"
                 f", {how} ({others}: pid {', '.join(str(p.pid) for p in ranks.processes)})")
        return ranks

    def _load_data(self, config: Config) -> TrainingData:
        stages, stage = config.pipeline.stages, self.role_options.stage
        if self.role_options.kind == STAGE and stages < 2:
            raise ConfigError("--role stage needs a config with pipeline.stages >= 2 (e.g. configs/tiny-pipeline.yaml)")
        if self.role_options.kind != REPLICA and config.training.ranks > 1:
            raise ConfigError(f"--role {self.role_options.kind} runs on one rank; --nproc-per-node "
                              f"{config.training.ranks} (training.ranks) goes with full replicas")
        outer = config.outer
        if self.role_options.kind == HUB and (outer.algorithm == "streaming" or outer.overlap is not None):
            overlapped = " with overlap" if outer.overlap is not None else ""
            raise ConfigError(f"--role hub takes part in blocking rounds only; this run's outer is "
                              f"{outer.algorithm}{overlapped}: use SparseLoCo, DiLoCo or LoCo without overlap, or run "
                              f"this machine as a replica")
        if stage is not None and stage >= stages:
            raise ConfigError(f"--stage {stage}: this config has pipeline.stages={stages} (stages 0 to {stages - 1})")
        return load_training_data(config)

    def _join(self, data: TrainingData | None, status: tuple[socket.socket, str] | None, device: torch.device
              ) -> Swarm:
        """Join the swarm with the run's config (``config_choice.config_to_train``) to train on ``device``; the p2p
        daemon is a child process: started before CUDA is initialised in this one."""
        c, o = self.config, self.options
        arrival: Arrival | None = None
        files: RunDirectory | None = None
        try:
            arrival = Arrival.start(c.run_id, c.swarm.reachability, o.initial_peers, o.host_maddrs, o.announce_maddrs,
                                    o.identity_path)
            self.config, self.data = config_to_train(
                arrival, c, data, device, overrides=self.overrides, document_path=self.document_path,
                load_data=self._load_data, out=self.out)
            c = self.config
            # the checkpoint to resume from, checked before any peer has seen this node
            me, fingerprint = arrival.peer_id[-8:], c.swarm_fingerprint(self.data.fingerprint)
            files = RunDirectory(self.log_dir or Path("runs") / c.run_id / me, c, fingerprint, self.resume,
                                 lambda line: self.out(f"[{me}] {line}"))
            self.run_files = files, files.resumed
            return arrival.enter(c.swarm, c.run_document(self.data.fingerprint), o.name, role=self.role_options.kind,
                                 stages=c.pipeline.stages, max_tokens=c.max_contribution_tokens)
        except BaseException:  # interrupted too: the status port is free again for the next start
            if status is not None:
                status[0].close()
            if files is not None:
                files.close()
            if arrival is not None:
                arrival.abandon()
            raise

    def _save_on_exit(self, swarm: Swarm, role: Role, schedule: RoundSchedule, files: RunDirectory,
                      standing: Standing) -> None:
        """Land a round still in flight, then write the exit checkpoint."""
        landed = schedule.finish_in_flight()
        if landed is not None:
            self.out(f"[{swarm.peer_id[-8:]}] the last overlapped round's outer step landed on exit "
                     f"({'applied' if landed.applied else 'NOT APPLIED'}, {len(landed.all_reduce.peers)} peer(s))")
        files.finish(schedule.checkpoint(standing.round, role.checkpoint_extras()))

    def _serve_status(self, swarm: Swarm, listening: socket.socket, address: str) -> None:
        """Serve the run's survey, this node's rounds and the run's config, and the dashboard that draws them."""
        c = self.config
        run = run_status(c.run_id, swarm.peer_id, swarm.directory.me.name, c.swarm.peer_ttl,
                           join_command(c.run_id, swarm.addresses()), config_rows(c))
        swarm.serve_status(listening, self.status_address[0], {
            **page_routes(), RUN_STATUS: constant(Answer(200, run)),
            ROUNDS_DOCUMENT: RoundsFeed(swarm.peer_id, self.summaries, lambda: self.weights)})
        where = f"THIS_MACHINE:{address.rpartition(':')[2]}" if self.status_address[0] in WILDCARDS else address
        self.out(f"[{swarm.peer_id[-8:]}] status served at http://{address}{STATUS_PATH}; read it with "
                 f"`p2ploco peers --from {where}`; dashboard at http://{address}{PAGE_PATH}")

    def _print_setup(self, swarm: Swarm, role: Role, device: torch.device, data: TrainingData) -> None:
        c = self.config
        pace = ("none: a hub trains nothing" if role.kind == HUB else
                "H every round" if self._budget(swarm, role) is None else "as many of H as fit in the round's time")
        reach = ("can be dialled" if not swarm.reachability.dials_out else
                 f"{swarm.reachability}: cannot be dialled (behind a NAT?), takes part by dialling out")
        self.out(f"[{swarm.peer_id[-8:]}] {role.describe()} on {device}; {data.describe()}; outer {c.outer.algorithm}, "
                 f"H={c.inner.steps} ({pace}); reachability {reach}")

    def _wait_for_peers(self, swarm: Swarm) -> None:
        s, me = self.config.swarm, swarm.peer_id[-8:]
        self.out(f"[{me}] waiting for {s.min_peers} peers ...")
        present = swarm.wait_for_peers(s.min_peers, s.startup_timeout, self.stopping)
        if not self.stopping.is_set():
            self.out(f"[{me}] {present} peer(s) present; starting")

    def _take_role(self, swarm: Swarm, device: torch.device, data: TrainingData, files: RunDirectory,
                   saved: Checkpoint | None, ranks: LocalRanks | None) -> tuple[Role, Standing]:
        """This node's role with its worker placed, resumed from ``saved`` (the run directory's checkpoint, if asked
        to resume), and where the node stands then: the round to train first and how it came by its state."""
        c = self.config
        kind = self.role_options.kind
        role: Role = (ReplicaRole(c, device, data, swarm, ranks) if kind == REPLICA else
                      HubRole(c, device, data, swarm) if kind == HUB else
                      StageRole(c, device, data, swarm, self.role_options))
        if saved is not None and isinstance(role, StageRole):
            role.pin(*saved.extras.get("slot", (None, None)))
        role.place()
        if saved is None:
            return role, Standing(0, Membership(0, "init"))
        role.worker.restore(saved, files.checkpoints)
        self.out(f"[{swarm.peer_id[-8:]}] resumed from {files.checkpoints} at round {saved.round}")
        return role, Standing(saved.round, Membership(saved.round, "checkpoint"))

    def _loop(self, swarm: Swarm, presence: Presence, role: Role, schedule: RoundSchedule, files: RunDirectory,
              held_out: list[Batch], standing: Standing) -> tuple[Standing, RoundSchedule]:
        """Rounds until stopped or done; returns where the node stands then (the next round to train) and the
        schedule that ran the last round."""
        c, me = self.config, swarm.peer_id[-8:]
        catch_up = CatchUp(c, swarm, presence, self.stopping, self.out)
        while not self.stopping.is_set() and not self._past_last_round(standing.round):
            if role.place():  # a stage peer took another stage: a new worker, with the seed's state
                schedule.close()
                schedule = build_schedule(c, role.worker)
                self.out(f"[{me}] now {role.describe()}")
                standing = replace(standing, membership=Membership(standing.round, "init"))
            standing = catch_up(schedule, standing, first=not self.summaries)
            if self._past_last_round(standing.round):
                if not self.summaries:
                    self.out(f"[{me}] the run is at round {standing.round}, past its last round "
                             f"({c.training.rounds - 1}): nothing to train; training.rounds (--max-rounds) counts "
                             f"from the run's start")
                break
            if (waited := self._not_ready(swarm, presence, role, standing)) is not None:
                standing = waited
                continue
            try:
                summary = self._round(swarm, presence, role, schedule, standing, held_out)
            except RankError as e:  # the node cannot train on: it leaves as it does when stopped, and says why
                self.out(f"[{me}] round {standing.round}: {e}")
                self.failure = e
                break
            if summary is None:  # stopped during the inner steps: the round is abandoned
                break
            standing = self._recorded(swarm, presence, role, schedule, files, standing, summary)
            if self.failure is not None:
                break
        return standing, schedule

    def _not_ready(self, swarm: Swarm, presence: Presence, role: Role, standing: Standing) -> Standing | None:
        """Where the node stands once it has stood by for a heartbeat, if it may not train ``standing.round`` (a
        doubtful stage, a seed's state where others hold trained ones, a role not ready for the round); None if it
        may."""
        me = swarm.peer_id[-8:]
        if standing.doubtful and role.kind == STAGE:
            # A stage trains no round on a doubtful state (it moved to the round its group meets in, or its last
            # round failed): in for that round, its record told a replica still in the round before that the
            # stage might have applied it without it, and the replica sat it out (a round lost each time a group
            # met). It stands by until its catch-up has the swarm's state of the round.
            return self._stand_by(presence, standing, "doubt", f"[{me}] round {standing.round}: this stage's state "
                                  f"may not be the swarm's (it did not apply the last round); it trains once it has "
                                  f"the swarm's state of this round")
        seeded = standing.membership.source == "init" and standing.round > 0 and not self.summaries
        if seeded and (trained := swarm.trained_elsewhere(role.worker.seed_digest)):
            # It holds the seed's state where others hold trained ones (it could not fetch theirs yet): it
            # trains nothing on it, and tries again (a group trained on a newcomer's seed once, and the swarm
            # followed it)
            return self._stand_by(presence, standing, "state", f"[{me}] round {standing.round}: others hold trained "
                                  f"states of {', '.join(trained)}, this node the seed's; it trains once it has "
                                  f"fetched them")
        if role.ready(standing.round, presence.in_for_round(standing.round, standing.doubtful),
                      partial(presence.announce_standby, standing.round), self.stopping):
            return None
        pipeline_round = role.round_of_pipeline(standing.round)
        if pipeline_round > standing.round:  # its pipeline group meets in a round ahead: it stands by there and, once
            # the swarm is there too, fetches that round's state (catch-up: its state is doubtful, it did not apply
            # the rounds between) and trains it with the group
            self.out(f"[{me}] its pipeline group meets in round {pipeline_round} (this stage: {standing.round}): it "
                     f"moves there")
            standing = replace(standing, round=pipeline_round, waiting_for="", unsettled=None, doubtful=True)
            presence.announce_standby(pipeline_round)
            return standing
        return self._stand_by(presence, standing, role.waiting_for, f"[{me}] standby: waiting for {role.waiting_for}")

    def _recorded(self, swarm: Swarm, presence: Presence, role: Role, schedule: RoundSchedule, files: RunDirectory,
                  standing: Standing, summary: RoundSummary) -> Standing:
        """Where the node stands once ``record`` is written, shown and reported, and the checkpoint due written (if
        a rank failed meanwhile, ``self.failure`` says so)."""
        files.write(summary)
        self.summaries.append(summary)
        self.out(progress_line(swarm.peer_id, summary))
        presence.report(self.summaries)
        standing = standing.after(summary)
        if standing.unsettled is not None:  # settling publishes our next round: only once a round in flight
            # has its group, whose formation reads our record
            schedule.land_in_flight(swarm.round_wait())
        every = self.config.training.checkpoint_every
        if every and standing.round % every == 0:
            try:  # a sharded replica's checkpoint gathers its ranks' shards
                files.save(schedule.checkpoint(standing.round, role.checkpoint_extras()))
            except RankError as e:
                self.out(f"[{swarm.peer_id[-8:]}] checkpoint of round {standing.round}: {e}")
                self.failure = e
        return standing

    def _past_last_round(self, round_index: int) -> bool:
        rounds = self.config.training.rounds
        return bool(rounds) and round_index >= rounds

    def _stand_by(self, presence: Presence, standing: Standing, reason: str, line: str) -> Standing:
        """Sit this round out for ``reason`` (``line`` says it, once per reason), and wait a heartbeat."""
        if reason != standing.waiting_for:
            standing = replace(standing, waiting_for=reason)
            self.out(line)
        presence.announce_standby(standing.round)
        self.stopping.wait(self.config.swarm.heartbeat_interval)
        return standing

    def _round(self, swarm: Swarm, presence: Presence, role: Role, schedule: RoundSchedule, standing: Standing,
               held_out: list[Batch]) -> RoundSummary | None:
        """One round by the schedule, an eval and the record. None if the node was stopped during the inner steps."""
        c = self.config
        worker, round_index, membership = role.worker, standing.round, standing.membership
        presence.serve(round_index)
        started = time.perf_counter()
        budget = self._budget(swarm, role)
        # A replica whose step outlasts the round sits rounds out (``budget.sitting``), and its record says so: the
        # others' budgets leave its step time out
        sits = sitting(budget, schedule.sits_out and role.trains_alone, worker.outer.unapplied_tokens,
                       membership.catchup_seconds, partial(swarm.formation_wait, round_index),
                       self._past_last_round(round_index + 2))
        presence.announce_sitting_out(sits.sits_out)
        if sits.sitting == Sitting.CONTRIBUTES:  # the work it kept, contributed in this round without a step
            self.stopping.wait(sits.wait)
            budget = FixedSteps(0)
        elif sits.sits_out:
            return self._sit_out(swarm, presence, role, schedule, standing, started, sits)
        # The announcement names this round with the state it starts from, taken now (not before the role was ready:
        # an overlapped round in flight may have landed while a stage waited for its pipeline group).
        in_for_round = presence.in_for_round(round_index, standing.doubtful)
        try:
            outcome = schedule.run(round_index, swarm.communicator,
                                   RoundHooks(self.stopping.is_set, in_for_round, budget))
        except PipelineError as e:  # the group could not finish the round: it contributes nothing to it
            self.out(f"[{swarm.peer_id[-8:]}] round {round_index}: the pipeline group failed ({e}); it sits the "
                     f"round out and catches up")
            schedule.restart()
            presence.announce_standby(round_index)
            return self._summary(swarm, role, round_index, membership, started, loss=float("nan"),
                                applied=False, excluded=True)
        if outcome is None:
            return None
        # The state the next round starts from, served now rather than as that round starts: the one before is then
        # served from its tensors (``swarm/state.py``, ``PatchedBlob``) and lets its own go before the eval and the
        # checkpoint, which would otherwise hold them beside the new ones
        give_back_freed()  # what the outer step let go of (its exchange's buffers), before the diff of the new state
        presence.serve(round_index + 1)
        # Nothing landed (the first round in flight, or the one dropped by a catch-up): nothing applied either
        synced = outcome.comm or Synced(AllReduceResult([swarm.peer_id], committed=False), applied=False)
        evaluated = role.evaluates and c.training.evaluates_after(round_index)
        return self._summary(swarm, role, round_index, membership, started, inner=outcome.inner,
                            synced=self._synced(synced), eval_loss=worker.evaluate(held_out) if evaluated else None,
                            density=worker.outer.density, update_norm=worker.outer.take_update_norm())

    def _sit_out(self, swarm: Swarm, presence: Presence, role: Role, schedule: RoundSchedule, standing: Standing,
                 started: float, sits: SitOut) -> RoundSummary | None:
        """Sit the round out as ``sits`` says: idle, or training a step while nobody waits for it (None if the node
        was stopped during it)."""
        round_index, membership = standing.round, standing.membership
        presence.step_aside(round_index)
        if sits.sitting == Sitting.IDLES:
            self.stopping.wait(sits.wait)
            return self._summary(swarm, role, round_index, membership, started, loss=float("nan"), applied=False,
                                sat_out=True)
        outcome = schedule.sit_out(round_index, self.stopping.is_set, swarm.peer_id)
        if outcome is None:
            return None
        return self._summary(swarm, role, round_index, membership, started, inner=outcome.inner,
                            synced=self._synced(outcome.comm), sat_out=True)

    def _synced(self, synced: Synced) -> Synced:
        """``synced``, keeping the weights of its aggregate if it was applied (the dashboard's shares)."""
        if synced.applied:
            self.weights = dict(synced.all_reduce.weights)
        return synced

    def _summary(self, swarm: Swarm, role: Role, round_index: int, membership: Membership, started: float,
                **fields: Any) -> RoundSummary:
        """The round's record (``RoundSummary.of``) with what this node, its state and its role say of it."""
        worker = role.worker
        dht_sent, dht_received = swarm.directory.take_dht_bytes()
        return RoundSummary.of(round_index, started, self.summaries, membership, **fields, dht_bytes_sent=dht_sent,
                              dht_bytes_received=dht_received, params_digest=worker.params_digest,
                              slice_digest=dict(worker.slice_digest), peer_id=swarm.peer_id,
                              reachability=str(swarm.reachability), **role.record_fields())

    def _budget(self, swarm: Swarm, role: Role) -> WallClockBudget | FixedSteps | None:
        """How many inner steps fit in a round (``budget.round_budget``)."""
        return round_budget(self.config.inner, role.kind == HUB, role.worker.inner.step_times, swarm.step_seconds)

    @staticmethod
    def _listen_for_status(host: str, port: int) -> tuple[socket.socket, str]:
        try:
            return listen(host, port)
        except OSError as e:  # the port is taken, or the host is not one of this machine's addresses
            raise ConfigError(f"--status-host {host} --status-port {port}: cannot listen there "
                              f"({why_not_listening(e)}); pick another port (0: any free one) or host") from None

    def _print_join_instructions(self, swarm: Swarm) -> None:
        self.out(f"[{swarm.peer_id[-8:]}] peer {swarm.peer_id} joined run '{self.config.run_id}'")
        for line in join_instructions(self.config, swarm.addresses()):
            self.out(line)
