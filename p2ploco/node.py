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
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

from p2ploco import faults
from p2ploco.budget import FixedSteps, WallClockBudget
from p2ploco.catchup import CatchUp
from p2ploco.checkpoint import Checkpoint
from p2ploco.collective.exchange import AllReduceResult
from p2ploco.config import Config, config_of_run, differences, keys_set, split_for_run
from p2ploco.dashboard.documents import ROUNDS_DOCUMENT, RUN_DOCUMENT, RoundsFeed, config_rows, run_document
from p2ploco.dashboard.page import PAGE_PATH, page_routes
from p2ploco.data import Batch, TrainingData, eval_batches, load_training_data
from p2ploco.errors import ConfigError, PipelineError, SwarmError
from p2ploco.host_memory import give_back_freed, host_bytes_needed, keep_freed_memory, total_memory
from p2ploco.inner import InnerStats
from p2ploco.metrics import RoundRecord, format_table, human_bytes
from p2ploco.model import parameter_count
from p2ploco.outer.base import Synced
from p2ploco.peer import Arrival, Swarm
from p2ploco.presence import Presence
from p2ploco.ranks import LocalRanks, RankError
from p2ploco.ranks.group import RankSetup
from p2ploco.roles import HUB, REPLICA, STAGE, HubRole, ReplicaRole, Role, RoleOptions, StageRole
from p2ploco.rundir import RunDirectory
from p2ploco.schedules import RoundHooks, RoundSchedule, build_schedule
from p2ploco.standing import Membership, Standing
from p2ploco.swarm import DEFAULT_HOST_MADDRS
from p2ploco.swarm.run_config import load_run_document
from p2ploco.swarm.status import WILDCARDS, Answer, constant, listen, why_not_listening
from p2ploco.swarm.status_document import STATUS_PATH


@dataclass
class SwarmOptions:
    initial_peers: Sequence[str] = ()
    host_maddrs: Sequence[str] = DEFAULT_HOST_MADDRS
    announce_maddrs: Sequence[str] = ()
    identity_path: str | None = None
    name: str = ""  # shown in `p2ploco peers`; derived from the peer id when empty


def describe_device(device: torch.device, ranks: int = 1) -> str:
    """``device``, or with ``ranks`` > 1 the devices of the node's local ranks (``cpu x2``, ``cuda:0-3 (NVIDIA
    H100 80GB HBM3)``)."""
    if ranks > 1 and device.type == "cpu":
        return f"cpu x{ranks}"
    if ranks > 1:
        return f"cuda:0-{ranks - 1} ({torch.cuda.get_device_name(device)})"
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)


def inner_fields(stats: InnerStats) -> dict[str, Any]:
    """What a round record says of the round's inner steps."""
    return {"loss": stats.loss, "tokens": stats.tokens, "inner_steps": stats.steps, "inner_seconds": stats.seconds}


def sync_fields(synced: Synced) -> dict[str, Any]:
    """What a round record says of the round's syncs: who took part and how it ended, and the traffic."""
    result, traffic = synced.all_reduce, synced.all_reduce.traffic
    syncs = traffic.sync_bytes or [traffic.bytes_sent + traffic.bytes_received]
    return {"peers": len(result.peers), "applied": synced.applied, "excluded": result.excluded,
            "refused_by": result.refused_by,
            "contributed_tokens": result.tokens, "dropped_peers": result.dropped,
            "aggregate_tokens": sum(result.weights.values()) if synced.applied else 0,
            "clipped_peers": result.clipped, "opposed_peers": result.opposed, "attempts": result.attempts,
            "failures": dict(Counter(str(failure) for failure in result.failures)),
            "bytes_sent": traffic.bytes_sent, "bytes_received": traffic.bytes_received,
            "dense_fp32_bytes": traffic.dense_fp32_bytes, "comm_seconds": traffic.seconds,
            "bits_per_param": 8 * traffic.contribution_bytes / traffic.params if traffic.params else 0.0,
            "fragment_bytes": syncs, "peak_sync_bytes": max(syncs)}


def fits_memory(config: Config, device: torch.device) -> None:
    """ConfigError, in one line, if the model of ``config`` needs more host memory to train on ``device`` than this
    machine has (``host_memory.host_bytes_needed``): a run's document sets its model's size, and a newcomer takes it
    from peers it does not know."""
    parameters, memory = parameter_count(config.model), total_memory()
    needed = host_bytes_needed(parameters, device.type)
    if needed > memory:
        raise ConfigError(f"run '{config.run_id}' trains a model of {parameters / 1e6:,.1f}M parameters: at least "
                          f"{human_bytes(needed)} of training state in this machine's memory, which holds "
                          f"{human_bytes(memory)}; join a run of a smaller model, or use a machine with more memory")


def resolve_device(name: str, ranks: int = 1) -> torch.device:
    """Rank 0's device; with ``ranks`` > 1 local ranks, rank r trains on the r-th GPU (``ranks.group.rank_device``)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"training.device={name} but no CUDA device is visible; use training.device=cpu")
    if device.type == "cuda" and ranks > 1:
        if device.index not in (None, 0):
            raise ConfigError(f"training.device={name} with {ranks} local ranks: ranks train on cuda:0 to "
                              f"cuda:{ranks - 1}; use training.device=cuda (CUDA_VISIBLE_DEVICES picks the GPUs)")
        if torch.cuda.device_count() < ranks:
            raise ConfigError(f"{ranks} local ranks need {ranks} GPUs; {torch.cuda.device_count()} are visible: use "
                              f"--nproc-per-node {torch.cuda.device_count()}")
        device = torch.device("cuda", 0)
    return device


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
        self.data: TrainingData | None = None  # loaded once the config is settled (``_settle``)
        self.run_files: tuple[RunDirectory, Checkpoint | None] | None = None  # and the checkpoint to resume from
        self.status_address = status_address
        self.log_dir, self.resume, self.role_options = log_dir, resume, role or RoleOptions()
        self.records: list[RoundRecord] = []
        # the members of the newest aggregate this node applied, and the tokens each weighed: the dashboard's shares
        self.weights: dict[str, int] = {}
        self.stopping = threading.Event()
        self.swarm: Swarm | None = None
        self.failure: RankError | None = None  # why the node stopped training before it was told to (a rank died)

    def stop(self) -> str:
        """Leave after the current round (safe from a signal handler): an unfinished round's inner steps
        are abandoned; an all-reduce under way is finished. Returns what happens next, for the person who asked."""
        self.stopping.set()
        if self.swarm is not None:
            self.swarm.request_leave()
        if not self.records:
            return ("leaving before its first round ended: nothing is trained, so no checkpoint is written (start "
                    "again in the same way; signal again to stop at once)")
        return ("leaving: the round's inner steps stop here, an all-reduce under way is finished, then a checkpoint "
                "is written (signal again to stop at once)")

    def run(self) -> list[RoundRecord]:
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
        c, data, (files, saved) = self.config, self.data, self.run_files
        started = time.perf_counter()
        me = swarm.peer_id[-8:]
        ranks: LocalRanks | None = None
        try:
            faults.hit("start.join", 0)
            if self.stopping.is_set():  # stopped while it joined: it leaves before it has trained or said more
                return self.records
            swarm.update_record(device=describe_device(device, c.training.ranks), ranks=c.training.ranks)
            if status is not None:
                self._serve_status(swarm, *status)
            self._print_join_instructions(swarm)
            if c.training.ranks > 1:
                ranks = self._start_ranks(swarm, device)
            role, standing = self._take_role(swarm, device, data, files, saved, ranks)
            self._print_setup(swarm, role, device, data)
            presence = Presence(swarm, role)
            presence.announce_joining(standing.round)
            if c.swarm.min_peers > 1:
                self._wait_for_peers(swarm)
            held_out = eval_batches(data.eval, c.data.seq_len, c.data.eval_sequences)
            schedule = build_schedule(c, role.worker)
            try:
                standing, schedule = self._loop(swarm, presence, role, schedule, files, held_out, standing)
                if self.failure is not None and c.training.shard:
                    self.out(f"[{me}] no exit checkpoint: the rank that left held shards of the model and of its "
                             f"optimizer state; the last checkpoint in {files.checkpoints} stands")
                elif self.records:  # one that trained nothing writes none: it would hold the seed's state (or
                    # one a checkpoint or the swarm still holds), and make the next start in this folder need --resume
                    self._save_on_exit(swarm, role, schedule, files, standing)
                    self.out(f"[{me}] checkpoint of round {standing.round} written to {files.checkpoints}")
            finally:
                schedule.close()
        except KeyboardInterrupt:  # a second signal: stop now, keep the last periodic checkpoint
            self.out(f"[{me}] stopped at once after {len(self.records)} round(s); no exit checkpoint")
        finally:
            try:  # a periodic checkpoint being written is finished, also when stopped at once
                files.close()
            finally:
                try:
                    swarm.leave()
                finally:
                    if ranks is not None:
                        ranks.close()
        if not self.records and self.stopping.is_set():
            return self.records  # stopped before its first round: the line the stop printed says all there is
        if self.stopping.is_set() or self.failure is not None:
            self.out(f"[{me}] left the swarm after {len(self.records)} round(s)")
        self.out(summary(self.records, time.perf_counter() - started))
        if self.failure is not None:
            raise self.failure
        return self.records

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
        """Join the swarm with the run's config (``_settle``) to train on ``device``; the p2p daemon is a child process:
        started before CUDA is initialised in this one."""
        c, o = self.config, self.options
        arrival: Arrival | None = None
        files: RunDirectory | None = None
        try:
            arrival = Arrival.start(c.run_id, c.swarm.reachability, o.initial_peers, o.host_maddrs, o.announce_maddrs,
                                    o.identity_path)
            self.config, self.data = self._settle(arrival, data, device)
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

    def _settle(self, arrival: Arrival, data: TrainingData | None, device: torch.device
                ) -> tuple[Config, TrainingData]:
        """The config and data this node trains with: its own (``data`` loaded for it), or, without a config file,
        the run's as its peers serve it with this node's own settings (``config.config_of_run``; ConfigError, before
        anything is built, if its model would not fit this machine's memory on ``device``); either with a batch
        split of the run's step where the person set none (``config.split_for_run``). ConfigError if they differ
        from what most of the run trains with, naming the first keys that do, unless no peer of the run serves a
        config (this node starts the run)."""
        own, run_id = self.config, self.config.run_id
        mine = "" if data is None else own.swarm_fingerprint(data.fingerprint)
        run = arrival.run_document(mine) if self.document_path is None else load_run_document(self.document_path)
        if run is None:
            if data is None:  # swarm trouble (exit 1), not bad input: its peers may have left a moment ago
                raise SwarmError(f"no peer of run '{run_id}' answered with its config through --initial-peers; check "
                                 f"--run-id (`p2ploco peers --initial-peers ADDR` lists the runs), or start the run "
                                 f"with --config FILE")
            return own, data
        if run.fingerprint == mine:
            return own, data
        if data is None:
            config = config_of_run(run.document, own, self.overrides)
            fits_memory(config, device)
            self._needs_run_data(config, run.document)
            data = self._load_data(config)
            joining = (f"training the config of run '{run_id}': {run.holders} of its {run.peers} peer(s) (trainers and "
                       f"hubs) hold it")
        else:  # its own, with a split of the run's step where the person set none with --set (the file's is a default)
            try:
                config = split_for_run(own, run.document, keys_set(self.overrides))
            except ConfigError:
                arrival.tell_conflict(run, mine)
                raise
            i = config.inner
            joining = (f"this node's config is that of run '{run_id}' with the run's {i.batch_size * i.grad_accum:,} "
                       f"sequences a step, split {i.batch_size} x {i.grad_accum} (inner.batch_size x "
                       f"inner.grad_accum; its own {own.inner.batch_size} x {own.inner.grad_accum} make another step)")
        theirs = config.swarm_fingerprint(data.fingerprint)
        if theirs == run.fingerprint:
            self.out(joining)
            return config, data
        arrival.tell_conflict(run, theirs)
        differ = differences(config.run_document(data.fingerprint), run.document)
        shown_keys = "; ".join(differ[:3]) + (f"; and {len(differ) - 3} more" if len(differ) > 3 else "")
        fix = ("drop those --set" if self.config_path is None else
               "join without --config to train the run's config (with --set only for your own settings: README, "
               "\"Joining with one address\"), or pick another --run-id")
        raise ConfigError(f"this node's config differs from that of run '{run_id}', which {run.holders} of its "
                          f"{run.peers} peer(s) (trainers and hubs) hold: {shown_keys}; {fix}")

    @staticmethod
    def _needs_run_data(config: Config, document: dict[str, Any]) -> None:
        """ConfigError if the run trains on a prepared corpus or a tokenizer of its own (``document["data"]``) and this
        node was not given its copy: peers never say where they keep their files (the path would be a stranger's
        to read), so a joiner names its own, which the run's digest then checks."""
        kind, _, digest = document["data"].partition(":")
        for key, needed in (("data.prepared", "prepared"), ("data.tokenizer", "tokenizer")):
            if kind == needed and not getattr(config.data, key.split(".")[1]):
                what = "a prepared corpus" if needed == "prepared" else "a tokenizer of its own"
                raise ConfigError(f"run '{config.run_id}' trains on {what} (digest {digest[:16]}); pass --set "
                                  f"{key}=PATH, your copy of it (its digest must be the run's)")

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
        run = run_document(c.run_id, swarm.peer_id, swarm.directory.me.name, c.swarm.peer_ttl,
                           join_command(c.run_id, swarm.addresses()), config_rows(c))
        swarm.serve_status(listening, self.status_address[0], {
            **page_routes(), RUN_DOCUMENT: constant(Answer(200, run)),
            ROUNDS_DOCUMENT: RoundsFeed(swarm.peer_id, self.records, lambda: self.weights)})
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
        swarm.track(lambda: {"inner_step": role.worker.inner.step_in_round,
                             "step_seconds": role.worker.inner.step_times.median})
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
            standing = catch_up(schedule, standing, first=not self.records)
            if self._past_last_round(standing.round):
                if not self.records:
                    self.out(f"[{me}] the run is at round {standing.round}, past its last round "
                             f"({c.training.rounds - 1}): nothing to train; training.rounds (--max-rounds) counts "
                             f"from the run's start")
                break
            if standing.doubtful and role.kind == STAGE:
                # A stage trains no round on a doubtful state (it moved to the round its group meets in, or its last
                # round failed): in for that round, its record told a replica still in the round before that the
                # stage might have applied it without it, and the replica sat it out (a round lost each time a group
                # met). It stands by until its catch-up has the swarm's state of the round.
                standing = self._stand_by(presence, standing, "doubt", f"[{me}] round {standing.round}: this "
                                          f"stage's state may not be the swarm's (it did not apply the last round); it "
                                          f"trains once it has the swarm's state of this round")
                continue
            seeded = standing.membership.source == "init" and standing.round > 0 and not self.records
            if seeded and (trained := swarm.trained_elsewhere(role.worker.seed_digest)):
                # It holds the seed's state where others hold trained ones (it could not fetch theirs yet): it
                # trains nothing on it, and tries again (a group trained on a newcomer's seed once, and the swarm
                # followed it)
                standing = self._stand_by(presence, standing, "state", f"[{me}] round {standing.round}: others "
                                          f"hold trained states of {', '.join(trained)}, this node the seed's; it "
                                          f"trains once it has fetched them")
                continue
            if not role.ready(standing.round, presence.in_for_round(standing.round, standing.doubtful),
                              partial(presence.announce_standby, standing.round), self.stopping):
                group_round = role.round_of_group(standing.round)
                if group_round > standing.round:  # its pipeline group meets in a round ahead: it stands by there and,
                    # once the swarm is there too, fetches that round's state (catch-up: its state is doubtful, it did
                    # not apply the rounds between) and trains it with the group
                    self.out(f"[{me}] its pipeline group meets in round {group_round} (this stage: {standing.round}): "
                             f"it moves there")
                    standing = replace(standing, round=group_round, waiting_for="", unsettled=None, doubtful=True)
                    presence.announce_standby(group_round)
                    continue
                standing = self._stand_by(presence, standing, role.waiting_for,
                                          f"[{me}] standby: waiting for {role.waiting_for}")
                continue
            try:
                record = self._round(swarm, presence, role, schedule, standing, held_out)
            except RankError as e:  # the node cannot train on: it leaves as it does when stopped, and says why
                self.out(f"[{me}] round {standing.round}: {e}")
                self.failure = e
                break
            if record is None:  # stopped during the inner steps: the round is abandoned
                break
            files.write(record)
            self.records.append(record)
            self.out(progress_line(swarm.peer_id, record))
            presence.report(self.records)
            standing = standing.after(record)
            if standing.unsettled is not None:  # settling publishes our next round: only once a round in flight
                # has its group, whose formation reads our record
                schedule.settle(swarm.round_wait())
            if c.training.checkpoint_every and standing.round % c.training.checkpoint_every == 0:
                try:  # a sharded replica's checkpoint gathers its ranks' shards
                    files.save(schedule.checkpoint(standing.round, role.checkpoint_extras()))
                except RankError as e:
                    self.out(f"[{me}] checkpoint of round {standing.round}: {e}")
                    self.failure = e
                    break
        return standing, schedule

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
               held_out: list[Batch]) -> RoundRecord | None:
        """One round by the schedule, an eval and the record. None if the node was stopped during the inner steps."""
        c = self.config
        worker, round_index, membership = role.worker, standing.round, standing.membership
        presence.serve(round_index)
        started = time.perf_counter()
        budget = self._budget(swarm, role)
        # A replica whose step outlasts the round sits rounds out (a pipeline stage cannot: its group steps together),
        # and its record says so: the others' budgets leave its step time out
        sits_out = budget is not None and schedule.sits_out and role.trains_alone and budget.outlasted()
        swarm.update_record(sits_out=sits_out)
        if sits_out:
            if worker.outer.unapplied_tokens:
                # The work it kept, contributed in this round without a step. It joins once the others may be done
                # with their steps (a formation closes its wait after its first contribution: one that came early
                # would close before them). Their round began about as its catch-up did.
                self.stopping.wait(max(0.0, budget.others_round_seconds() - membership.catchup_seconds
                                       - swarm.formation_wait(round_index) / 2))
                budget = FixedSteps(0)
            else:  # it trains a step while nobody waits for it
                presence.announce_standby(round_index)
                swarm.flush()  # out before the step: a coordinator that still saw it in the round would wait
                if self._past_last_round(round_index + 2):
                    # The step's work lands a round later at the earliest, while the others are still in it: in its
                    # last two rounds it trains none, and sits the round out idle (a step of the one before the last
                    # was contributed after the others had finished, alone, and its state parted from theirs)
                    self.stopping.wait(budget.others_round_seconds())
                    return self._record(swarm, role, round_index, membership, started, loss=float("nan"),
                                        applied=False, sat_out=True)
                outcome = schedule.sit_out(round_index, self.stopping.is_set, swarm.peer_id)
                if outcome is None:
                    return None
                return self._record(swarm, role, round_index, membership, started, **inner_fields(outcome.inner),
                                    **self._synced(outcome.comm), sat_out=True)
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
            return self._record(swarm, role, round_index, membership, started, loss=float("nan"),
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
        evaluated = role.evaluates and (round_index % c.training.eval_every == 0
                                        or round_index + 1 == c.training.rounds)
        return self._record(swarm, role, round_index, membership, started, **inner_fields(outcome.inner),
                            **self._synced(synced), eval_loss=worker.evaluate(held_out) if evaluated else None,
                            density=worker.outer.density, update_norm=worker.outer.take_update_norm())

    def _synced(self, synced: Synced) -> dict[str, Any]:
        """``sync_fields(synced)``, keeping the weights of its aggregate if it was applied."""
        if synced.applied:
            self.weights = dict(synced.all_reduce.weights)
        return sync_fields(synced)

    def _record(self, swarm: Swarm, role: Role, round_index: int, membership: Membership, started: float,
                **fields: Any) -> RoundRecord:
        worker = role.worker
        utilisation = RoundRecord.utilisation(float(fields.get("inner_seconds", 0.0)), self.records, started)
        dht_sent, dht_received = swarm.take_dht_bytes()
        return RoundRecord(round=round_index, **{"peers": 1, "eval_loss": None, **fields},
                           dht_bytes_sent=dht_sent, dht_bytes_received=dht_received,
                           compute_utilisation=utilisation,
                           params_digest=worker.params_digest, slice_digest=dict(worker.slice_digest),
                           round_seconds=time.perf_counter() - started, peer_id=swarm.peer_id,
                           joined_round=membership.joined_round, state_source=membership.source,
                           catchup_seconds=membership.catchup_seconds, catchup_bytes=membership.catchup_bytes,
                           catchup_updates=membership.catchup_updates, timestamp=time.time(),
                           reachability=str(swarm.reachability), **role.record_fields())

    def _budget(self, swarm: Swarm, role: Role) -> WallClockBudget | FixedSteps | None:
        """How many inner steps fit in a round (``budget.py``): as many as the swarm's round budget allows (for a
        pipeline stage, as its group's slowest stage's budget allows), unless this peer trains a fixed H, or none (a
        hub)."""
        c = self.config
        if role.kind == HUB:
            return FixedSteps(0)
        if c.inner.fixed_steps:
            return None
        return WallClockBudget(c.inner.steps, role.worker.inner.step_times, swarm.step_seconds, c.inner.round_seconds)

    @staticmethod
    def _listen_for_status(host: str, port: int) -> tuple[socket.socket, str]:
        try:
            return listen(host, port)
        except OSError as e:  # the port is taken, or the host is not one of this machine's addresses
            raise ConfigError(f"--status-host {host} --status-port {port}: cannot listen there "
                              f"({why_not_listening(e)}); pick another port (0: any free one) or host") from None

    def _print_join_instructions(self, swarm: Swarm) -> None:
        addresses = swarm.addresses()
        self.out(f"[{swarm.peer_id[-8:]}] peer {swarm.peer_id} joined run '{self.config.run_id}'")
        self.out("To join this swarm from another machine, run:")
        self.out(f"  {join_command(self.config.run_id, addresses)}")
        d = self.config.data
        for key, path in (("data.prepared", d.prepared), ("data.tokenizer", d.tokenizer)):
            if path:
                self.out(f"  (the run's config comes from its peers; its {key.split('.')[1]} {path} does not: add "
                         f"--set {key}=PATH, your copy of it)")


def join_command(run_id: str, addresses: Sequence[str]) -> str:
    """The command that starts a peer of run ``run_id`` from another machine, through ``addresses``."""
    return f"p2ploco node start --run-id {run_id} " + " ".join(f"--initial-peers {a}" for a in addresses)


def progress_line(peer_id: str, r: RoundRecord) -> str:
    evaluated = f"{r.eval_loss:.3f}" if r.eval_loss is not None else "-"
    rate = r.tokens / r.inner_seconds if r.inner_seconds else 0.0
    notes = (" | sat out: its step outlasts the round, its work goes into the next" if r.sat_out and r.tokens else
             " | sat out idle: a step's work would land past its last round" if r.sat_out else
             "" if r.applied else " | NOT APPLIED")
    if not r.inner_steps and r.contributed_tokens and not r.sat_out:
        notes += " | no step of its own: it contributed the work it kept from the round it sat out"
    notes += f" | dropped {len(r.dropped_peers)}" if r.dropped_peers else ""
    notes += f" | clipped {len(r.clipped_peers)}" if r.clipped_peers else ""
    notes += f" | left out {len(r.opposed_peers)} opposed" if r.opposed_peers else ""
    notes += " | redone" if r.attempts > 1 else ""
    if r.role == HUB:  # it trains nothing: what it did is the rounds it held, and the bytes it reduced and served
        return (f"[{peer_id[-8:]}] round {r.round:>4} | hub | group {r.peers} | reduced "
                f"{human_bytes(r.bytes_received)} | served {human_bytes(r.bytes_sent)} | comm {r.comm_seconds:.1f}s"
                f"{notes} | {r.params_digest[:10]}")
    traffic = r.bytes_sent + r.bytes_received
    saving = f", {r.dense_fp32_bytes / traffic:.0f}x under dense fp32" if traffic else ""
    # a round that trained no step has no loss (``InnerStats``: NaN), and says so
    loss = f"{r.loss:.3f}" if r.inner_steps else "-"
    return (f"[{peer_id[-8:]}] round {r.round:>4} | peers {r.peers} | loss {loss} | eval {evaluated} | "
            f"{rate / 1e3:.1f}k tok/s | sent {human_bytes(r.bytes_sent)} recv {human_bytes(r.bytes_received)} "
            f"({r.bits_per_param:.3f} bits/param{saving}) | inner {r.inner_seconds:.1f}s comm {r.comm_seconds:.1f}s"
            f"{notes} | {r.params_digest[:10]}")


def summary(records: Sequence[RoundRecord], seconds: float) -> str:
    if not records:
        return f"no round completed ({seconds:.1f} s)"
    evals = [r.eval_loss for r in records if r.eval_loss is not None]
    rounds = ("rounds", f"{len(records)} ({records[0].round} to {records[-1].round}, "
                        f"{sum(not r.applied for r in records)} not applied)")
    group = ("mean group size", f"{sum(r.peers for r in records) / len(records):.1f}")
    digest = ("final params digest", records[-1].params_digest[:16])
    if records[-1].role == HUB:
        return format_table(("summary", "value"), [
            rounds, group,
            ("bytes per round (reduced / served)",
             f"{human_bytes(sum(r.bytes_received for r in records) / len(records))} / "
             f"{human_bytes(sum(r.bytes_sent for r in records) / len(records))}"),
            ("time (comm / total)", f"{sum(r.comm_seconds for r in records):.1f} s / {seconds:.1f} s"), digest])
    return format_table(("summary", "value"), [
        rounds,
        ("eval loss first -> last", f"{evals[0]:.3f} -> {evals[-1]:.3f}" if evals else "-"),
        group,
        ("bytes per round (sent + received)",
         human_bytes(sum(r.bytes_sent + r.bytes_received for r in records) / len(records))),
        ("tokens trained", f"{sum(r.tokens for r in records):,}"),
        ("time (inner / comm / total)", f"{sum(r.inner_seconds for r in records):.1f} s / "
                                        f"{sum(r.comm_seconds for r in records):.1f} s / {seconds:.1f} s"),
        digest])
