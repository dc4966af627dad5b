"""A training node: joins the swarm, catches up with it, and runs outer rounds until told to stop.

One round: if the swarm is ahead (or holds another state at this round), fetch its state first;
then H inner AdamW steps on this peer's shard, the outer algorithm's sync with the round's group
(pseudo-gradient, all-reduce, vote, outer step on the global params if the round commits), the
global params loaded back into the model, an eval, one metrics record and one progress line.
Checkpoints are written every ``training.checkpoint_every`` rounds and on a clean exit.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from p2ploco import checkpoint
from p2ploco.collective.exchange import AllReduceStats
from p2ploco.config import Config
from p2ploco.data import Batch, eval_batches, load_training_data
from p2ploco.errors import CheckpointError, ConfigError, PipelineError, SwarmError
from p2ploco.metrics import MetricsLog, RoundRecord, TensorBoardLog, format_table, human_bytes
from p2ploco.roles import REPLICA, STAGE, ReplicaRole, Role, RoleOptions, StageRole
from p2ploco.swarm import DEFAULT_HOST_MADDRS
from p2ploco.swarm.records import EVAL_HISTORY, PeerState, SwarmState
from p2ploco.swarm.runtime import Swarm
from p2ploco.worker import Worker

CATCH_UP_POLL = 0.25  # seconds between looks at the records while waiting to catch up


@dataclass
class SwarmOptions:
    initial_peers: Sequence[str] = ()
    host_maddrs: Sequence[str] = DEFAULT_HOST_MADDRS
    announce_maddrs: Sequence[str] = ()
    identity_path: str | None = None
    name: str = ""  # shown in `p2ploco peers`; derived from the peer id when empty


@dataclass
class Membership:
    """How this node came by the state it trains from."""

    joined_round: int  # the round it (re)joined at
    source: str  # init (seeded), checkpoint, or peer (fetched from the swarm)
    catchup_seconds: float = 0.0  # time spent fetching state before the next round


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)


def public_fields(records: Sequence[RoundRecord]) -> dict[str, object]:
    """What this node's DHT record tells others about its last round."""
    def finite(value: float | None) -> float | None:  # the record schema admits no NaN or inf
        return round(value, 4) if value is not None and math.isfinite(value) else None

    r = records[-1]
    traffic = r.bytes_sent + r.bytes_received
    evals = [[x.round, finite(x.eval_loss)] for x in records if finite(x.eval_loss) is not None][-EVAL_HISTORY:]
    return {"loss": finite(r.loss), "eval_loss": finite(r.eval_loss),
            "tokens_per_second": round(r.tokens / r.round_seconds, 1) if r.round_seconds else 0.0,
            "bytes_sent": r.bytes_sent, "bytes_received": r.bytes_received,
            "compression": round(r.dense_fp32_bytes / traffic, 1) if traffic else 0.0,
            "round_seconds": round(r.round_seconds, 2), "eval_history": evals}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"training.device={name} but no CUDA device is visible; use training.device=cpu")
    return device


class Node:
    def __init__(self, config: Config, options: SwarmOptions, log_dir: Path | None, config_path: str,
                 resume: bool = False, out: Callable[[str], None] = print, role: RoleOptions | None = None):
        self.config, self.options, self.config_path, self.out = config, options, config_path, out
        self.log_dir, self.resume, self.role_options = log_dir, resume, role or RoleOptions()
        self.records: list[RoundRecord] = []
        self.stopping = threading.Event()
        self.swarm: Swarm | None = None

    def stop(self) -> None:
        """Leave after the current round (safe from a signal handler): an unfinished round's inner steps
        are abandoned; an all-reduce under way is finished."""
        self.stopping.set()
        if self.swarm is not None:
            self.swarm.request_leave()

    def run(self) -> list[RoundRecord]:
        c = self.config
        if c.training.threads:
            torch.set_num_threads(c.training.threads)
        device = resolve_device(c.training.device)
        if self.role_options.kind == STAGE and c.pipeline.stages < 2:
            raise ConfigError("--role stage needs a config with pipeline.stages >= 2 (e.g. configs/tiny-pipeline.yaml)")
        # Data problems end the start-up here, with one line, before any peer has seen this node.
        data = load_training_data(c)
        fingerprint = c.swarm_fingerprint(data.fingerprint)
        # The p2p daemon is a child process: start it before CUDA is initialised in this one.
        swarm = self.swarm = Swarm.join(c.run_id, c.swarm, fingerprint, **asdict(self.options),
                                        role=self.role_options.kind, stages=c.pipeline.stages)
        started = time.perf_counter()
        round_index = 0
        me = swarm.peer_id[-8:]
        saver: checkpoint.BackgroundSaver | None = None
        try:
            swarm.report(device=describe_device(device))
            self._announce(swarm)
            log_dir = self.log_dir or Path("runs") / c.run_id / me
            checkpoints = log_dir / "checkpoint"
            if checkpoint.exists(checkpoints) and not self.resume:
                raise CheckpointError(f"{checkpoints} already holds a checkpoint: pass --resume to continue it, "
                                      f"or another --log-dir")
            log_dir.mkdir(parents=True, exist_ok=True)
            saver = checkpoint.BackgroundSaver(checkpoints, c.run_id, fingerprint)
            (log_dir / "config.json").write_text(json.dumps(c.to_dict(), indent=2))
            metrics = MetricsLog(log_dir / "metrics.jsonl")
            board = TensorBoardLog(log_dir / "tensorboard")
            if board.writer is not None:
                self.out(f"[{me}] TensorBoard logs in {log_dir / 'tensorboard'}")

            held_out = eval_batches(data.eval, c.data.seq_len, c.data.eval_sequences)
            role: Role = (ReplicaRole(c, device, data, swarm) if self.role_options.kind == REPLICA
                          else StageRole(c, device, data, swarm, self.role_options))
            membership = Membership(0, "init")
            saved = checkpoint.load(checkpoints, c.run_id, fingerprint) if self.resume else None
            if saved is not None and isinstance(role, StageRole):
                role.pin(*saved.extras.get("slot", (None, None)))
            role.place()
            swarm.track(lambda: {"inner_step": role.worker.inner.step_in_round})
            if saved is not None:
                role.worker.restore(saved, checkpoints)
                round_index, membership = saved.round, Membership(saved.round, "checkpoint")
                self.out(f"[{me}] resumed from {checkpoints} at round {round_index}")
            self.out(f"[{me}] {role.describe()} on {device}; {data.describe()}; outer {c.outer.algorithm}, "
                     f"H={c.inner.steps}")
            self._publish(swarm, role.worker, round_index, PeerState.JOINING)
            if c.swarm.min_peers > 1:
                self.out(f"[{me}] waiting for {c.swarm.min_peers} peers ...")
                present = swarm.wait_for_peers(c.swarm.min_peers, c.swarm.startup_timeout, self.stopping)
                if not self.stopping.is_set():
                    self.out(f"[{me}] {present} peer(s) present; starting")

            def finished() -> bool:
                return bool(c.training.rounds) and round_index >= c.training.rounds

            unsettled: int | None = None  # a round that may have ended otherwise for the others
            doubtful = False  # this peer did not apply a round the others may have, and has not caught up since
            waiting = ""  # what a standby stage last said it waits for (said once, not every look)
            while not self.stopping.is_set() and not finished():
                if role.place():
                    self.out(f"[{me}] now {role.describe()}")
                    membership = Membership(round_index, "init")
                round_index, membership, doubtful = self._catch_up(swarm, role.worker, round_index, membership,
                                                                   unsettled, doubtful)
                if finished():
                    break
                announce = partial(self._publish, swarm, role.worker, round_index, PeerState.TRAINING, doubtful)
                if not role.ready(round_index, announce, self.stopping):
                    if role.waiting_for != waiting:
                        waiting = role.waiting_for
                        self.out(f"[{me}] standby: waiting for {waiting}")
                    self._publish(swarm, role.worker, round_index, PeerState.STANDBY)
                    self._wait(lambda: False, time.monotonic() + c.swarm.heartbeat_interval)
                    continue
                waiting = ""
                record = self._round(swarm, role, round_index, membership, held_out, doubtful)
                if record is None:  # stopped during the inner steps: the round is abandoned
                    break
                metrics.append(record)
                self.records.append(record)
                self.out(progress_line(swarm.peer_id, record))
                swarm.report(**public_fields(self.records))
                board.write(record)
                membership.catchup_seconds = 0.0
                # Alone, or not applied: the others may hold another state after this round (they committed
                # without us, or a judge we could not reach decided otherwise).
                unsettled = round_index if record.peers == 1 or not record.applied else None
                doubtful = doubtful or not record.applied
                if unsettled is not None and role.worker.launched:  # settling publishes our next round: only
                    # once the round in flight has its group, whose formation reads our record (not asked otherwise:
                    # it waits for the round's contribution, which is computed in the background meanwhile)
                    role.worker.in_flight.all_reduce.grouped.wait(c.swarm.matchmaking_timeout
                                                                  + c.swarm.allreduce_timeout)
                round_index += 1
                if c.training.checkpoint_every and round_index % c.training.checkpoint_every == 0:
                    saver.save(role.worker.checkpoint(round_index, role.checkpoint_extras()))
            board.close()
            landed = role.worker.finish_in_flight()
            if landed is not None:
                self.out(f"[{me}] the last overlapped round's outer step landed on exit "
                         f"({'applied' if landed.committed else 'NOT APPLIED'}, {len(landed.peers)} peer(s))")
            saver.save(role.worker.checkpoint(round_index, role.checkpoint_extras()))
            saver.wait()
            self.out(f"[{me}] checkpoint of round {round_index} written to {checkpoints}")
        except KeyboardInterrupt:  # a second signal: stop now, keep the last periodic checkpoint
            self.out(f"[{me}] stopped at once after {len(self.records)} round(s); no exit checkpoint")
        finally:
            try:
                if saver is not None:  # a periodic checkpoint being written is finished, also when stopped at once
                    saver.close()
            finally:
                swarm.leave()
        if self.stopping.is_set():
            self.out(f"[{me}] left the swarm after {len(self.records)} round(s)")
        self.out(summary(self.records, time.perf_counter() - started))
        return self.records

    @staticmethod
    def _publish(swarm: Swarm, worker: Worker, round_index: int, state: PeerState, doubtful: bool = False) -> None:
        swarm.set_progress(round_index, state, worker.params_sha256, worker.slice_sha256, doubtful)

    def _catch_up(self, swarm: Swarm, worker: Worker, round_index: int, membership: Membership,
                  unsettled: int | None, doubtful: bool) -> tuple[int, Membership, bool]:
        """If the swarm is ahead of us, or holds another state of some slice at our round, fetch the state of
        every slice this peer holds and contribute from the next round. After an unsettled round, first let
        the others finish it and compare states at the next round (the swarm's state wins: ``records.state_rank``,
        in which a ``doubtful`` state, one this peer holds for not having applied a round the others may have, has
        no say), then fetch at once. A peer that is otherwise behind (joining, restarted) first waits (bounded) for
        the others to finish the round they are in, so that it starts the next one with them rather than late.
        Returns the round to train, how this peer came by its state, and whether that state is still doubtful."""
        def behind(targets: dict[str, SwarmState]) -> bool:
            return any(t.round > round_index or (t.round == round_index
                                                 and t.state_sha256 != worker.slice_sha256[t.slice])
                       for t in targets.values())

        latest: list[dict[str, SwarmState]] = []  # the last look passed() took: acted on at once, rounds may be short

        def passed(round_in_progress: int) -> bool:
            latest[:] = [swarm.swarm_state(round_index, worker.slice_sha256)]
            return not latest[0] or max(t.round for t in latest[0].values()) > round_in_progress

        s = self.config.swarm
        deadline = time.monotonic() + s.matchmaking_timeout + 3 * s.allreduce_timeout
        if unsettled is not None:
            self._publish(swarm, worker, round_index, PeerState.TRAINING, doubtful)  # our state, for the comparison
            if not self._wait(lambda: swarm.settled(unsettled), deadline):
                return round_index, membership, doubtful
        # Between two rounds that went well the heartbeat's view will do (a peer behind is also told so at its next
        # join, and catches up then); a peer that starts, or after a round that went otherwise, looks afresh.
        targets = swarm.swarm_state(round_index, worker.slice_sha256,
                                    fresh=unsettled is not None or doubtful or not self.records)
        if not behind(targets):
            return round_index, membership, False
        if unsettled is None and not doubtful:  # joining or restarted: let the round under way end, then start the
            # next with all
            if not self._wait(lambda: passed(max(t.round for t in targets.values())), deadline):
                return round_index, membership, doubtful
            targets = latest[0]
            if not behind(targets):
                return round_index, membership, False
        me = swarm.peer_id[-8:]
        top = max(t.round for t in targets.values())
        missing = sorted(name for name in worker.slices if name not in targets or targets[name].round != top)
        if missing:
            self.out(f"[{me}] the swarm is at round {top} but nobody serves {', '.join(missing)} of it; training on "
                     f"and trying again next round")
            return round_index, membership, True
        # A slice whose state this peer holds already (a full replica may be behind in one slice only) is kept.
        own = {snapshot.slice: snapshot for snapshot in worker.snapshots(round_index)}
        fetch = {name: t for name, t in targets.items() if (t.round, t.state_sha256) != (round_index,
                                                                                          own[name].state_sha256)}
        donors = {peer for t in fetch.values() for peer in t.holders} - {swarm.peer_id}
        self.out(f"[{me}] the swarm is at round {top} (this peer: {round_index}); fetching the state of "
                 f"{', '.join(sorted(fetch))} from {len(donors)} peer(s)")
        # Announce where we are headed, stored before the fetch (records are otherwise stored in the background):
        # a round being formed waits for us rather than closing early, but only once its coordinator sees this.
        swarm.set_progress(top, PeerState.JOINING, "", {t.slice: t.state_sha256 for t in targets.values()})
        swarm.flush()
        started = time.perf_counter()
        try:
            worker.adopt({**own, **{name: swarm.fetch_state(t, worker.state_bytes(name)) for name, t in fetch.items()}})
        except SwarmError as e:
            self.out(f"[{me}] could not catch up ({e}); training on and trying again next round")
            return round_index, membership, True
        seconds = time.perf_counter() - started
        self.out(f"[{me}] caught up to round {top} in {seconds:.1f} s")
        return top, Membership(top, "peer", seconds), False

    def _wait(self, done: Callable[[], bool], deadline: float) -> bool:
        """Poll ``done`` until it holds or ``deadline`` passes; False if this node is stopping."""
        while not done() and time.monotonic() < deadline:
            if self.stopping.is_set():
                return False
            # Others publish their next round the moment they reach it: look often, a round may be short.
            time.sleep(min(self.config.swarm.heartbeat_interval, CATCH_UP_POLL, max(0.0, deadline - time.monotonic())))
        return not self.stopping.is_set()

    def _round(self, swarm: Swarm, role: Role, round_index: int, membership: Membership,
               held_out: list[Batch], doubtful: bool) -> RoundRecord | None:
        """One round: inner steps, then the outer round (overlapped: the previous round's outer step lands and
        this round's all-reduce starts in the background), an eval and the record. ``doubtful``: published with
        the state this round starts from (``_catch_up``)."""
        c = self.config
        worker = role.worker
        swarm.publish_state(worker.snapshots(round_index))
        announce = partial(swarm.set_progress, round_index, PeerState.TRAINING, worker.params_sha256,
                           dict(worker.slice_sha256), doubtful)
        # Overlapped, the record moves on to this round once the round in flight has its group (its formation
        # reads the record), at the first inner step after that or at the latest when the round lands.
        announced = not worker.launched
        if announced:
            announce()

        def between(_: int) -> None:
            nonlocal announced
            if not announced and worker.in_flight_grouped():
                announce()
                announced = True

        started = time.perf_counter()
        try:
            inner_stats = worker.train(round_index, self.stopping.is_set, between, swarm.communicator)
        except PipelineError as e:  # the group could not finish the round: it contributes nothing to it
            self.out(f"[{swarm.peer_id[-8:]}] round {round_index}: the pipeline group failed ({e}); it sits the "
                     f"round out and catches up")
            worker.load_into_model()
            self._publish(swarm, worker, round_index, PeerState.STANDBY)  # nobody waits for this peer's join
            return self._record(swarm, role, round_index, membership, started, loss=float("nan"),
                                applied=False, excluded=True)
        if inner_stats is None:
            worker.load_into_model()
            return None
        if worker.overlap:
            landed = worker.land()
            if not announced:
                announce()
            worker.launch(round_index, swarm.communicator)
            # Nothing landed (the first round in flight, or the one dropped by a catch-up): nothing applied either
            comm = landed or AllReduceStats([swarm.peer_id], committed=False)
        else:
            comm = worker.sync(swarm.communicator, round_index)
        syncs = comm.sync_bytes or [comm.bytes_sent + comm.bytes_received]
        evaluated = role.evaluates and (round_index % c.training.eval_every == 0
                                        or round_index + 1 == c.training.rounds)
        return self._record(
            swarm, role, round_index, membership, started, peers=len(comm.peers), loss=inner_stats.loss,
            eval_loss=worker.evaluate(held_out) if evaluated else None,
            bytes_sent=comm.bytes_sent, bytes_received=comm.bytes_received,
            dense_fp32_bytes=comm.dense_fp32_bytes, density=worker.outer.density,
            bits_per_param=8 * comm.contribution_bytes / comm.params if comm.params else 0.0,
            tokens=inner_stats.tokens, inner_seconds=inner_stats.seconds, comm_seconds=comm.seconds,
            dropped_peers=comm.dropped, clipped_peers=comm.clipped,
            update_norm=worker.outer.take_update_norm(),
            applied=comm.committed, excluded=comm.excluded, fragment_bytes=syncs, peak_sync_bytes=max(syncs),
            attempts=comm.attempts, failures=dict(Counter(str(failure) for failure in comm.failures)))

    def _record(self, swarm: Swarm, role: Role, round_index: int, membership: Membership, started: float,
                **fields: Any) -> RoundRecord:
        worker = role.worker
        utilisation = RoundRecord.utilisation(float(fields.get("inner_seconds", 0.0)), self.records, started)
        return RoundRecord(round=round_index, **{"peers": 1, "eval_loss": None, **fields},
                           compute_utilisation=utilisation,
                           params_sha256=worker.params_sha256, slice_sha256=dict(worker.slice_sha256),
                           round_seconds=time.perf_counter() - started, peer_id=swarm.peer_id,
                           joined_round=membership.joined_round, state_source=membership.source,
                           catchup_seconds=membership.catchup_seconds, timestamp=time.time(), **role.record_fields())

    def _announce(self, swarm: Swarm) -> None:
        addresses = swarm.addresses()
        self.out(f"[{swarm.peer_id[-8:]}] peer {swarm.peer_id} joined run '{self.config.run_id}'")
        self.out("To join this swarm from another machine, run:")
        self.out(f"  p2ploco node start --config {self.config_path} --run-id {self.config.run_id} "
                 + " ".join(f"--initial-peers {a}" for a in addresses))


def progress_line(peer_id: str, r: RoundRecord) -> str:
    evaluated = f"{r.eval_loss:.3f}" if r.eval_loss is not None else "-"
    rate = r.tokens / r.inner_seconds if r.inner_seconds else 0.0
    notes = "" if r.applied else " | NOT APPLIED"
    notes += f" | dropped {len(r.dropped_peers)}" if r.dropped_peers else ""
    notes += f" | clipped {len(r.clipped_peers)}" if r.clipped_peers else ""
    notes += " | redone" if r.attempts > 1 else ""
    traffic = r.bytes_sent + r.bytes_received
    saving = f", {r.dense_fp32_bytes / traffic:.0f}x under dense fp32" if traffic else ""
    return (f"[{peer_id[-8:]}] round {r.round:>4} | peers {r.peers} | loss {r.loss:.3f} | eval {evaluated} | "
            f"{rate / 1e3:.1f}k tok/s | sent {human_bytes(r.bytes_sent)} recv {human_bytes(r.bytes_received)} "
            f"({r.bits_per_param:.3f} bits/param{saving}) | inner {r.inner_seconds:.1f}s comm {r.comm_seconds:.1f}s"
            f"{notes} | {r.params_sha256[:10]}")


def summary(records: Sequence[RoundRecord], seconds: float) -> str:
    if not records:
        return f"no round completed ({seconds:.1f} s)"
    evals = [r.eval_loss for r in records if r.eval_loss is not None]
    rows = [
        ("rounds", f"{len(records)} ({records[0].round} to {records[-1].round}, "
                   f"{sum(not r.applied for r in records)} not applied)"),
        ("eval loss first -> last", f"{evals[0]:.3f} -> {evals[-1]:.3f}" if evals else "-"),
        ("mean group size", f"{sum(r.peers for r in records) / len(records):.1f}"),
        ("bytes per round (sent + received)",
         human_bytes(sum(r.bytes_sent + r.bytes_received for r in records) / len(records))),
        ("tokens trained", f"{sum(r.tokens for r in records):,}"),
        ("time (inner / comm / total)", f"{sum(r.inner_seconds for r in records):.1f} s / "
                                        f"{sum(r.comm_seconds for r in records):.1f} s / {seconds:.1f} s"),
        ("final params sha256", records[-1].params_sha256[:16]),
    ]
    return format_table(("summary", "value"), rows)
