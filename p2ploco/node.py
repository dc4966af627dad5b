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
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from p2ploco import checkpoint
from p2ploco.config import Config
from p2ploco.data import Batch, ShardSampler, eval_batches, load_training_data
from p2ploco.errors import CheckpointError, ConfigError, SwarmError
from p2ploco.inner import evaluate
from p2ploco.metrics import MetricsLog, RoundRecord, TensorBoardLog, format_table, human_bytes, update_norm
from p2ploco.swarm import DEFAULT_HOST_MADDRS
from p2ploco.swarm.records import EVAL_HISTORY, SwarmState
from p2ploco.swarm.runtime import Swarm
from p2ploco.worker import Worker, build_replica

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
                 resume: bool = False, out: Callable[[str], None] = print):
        self.config, self.options, self.config_path, self.out = config, options, config_path, out
        self.log_dir, self.resume = log_dir, resume
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
        # Data problems end the start-up here, with one line, before any peer has seen this node.
        data = load_training_data(c)
        fingerprint = c.swarm_fingerprint(data.fingerprint)
        # The p2p daemon is a child process: start it before CUDA is initialised in this one.
        swarm = self.swarm = Swarm.join(c.run_id, c.swarm, fingerprint, **asdict(self.options))
        started = time.perf_counter()
        round_index = 0
        me = swarm.peer_id[-8:]
        try:
            swarm.report(device=describe_device(device))
            self._announce(swarm)
            log_dir = self.log_dir or Path("runs") / c.run_id / me
            checkpoints = log_dir / "checkpoint"
            if checkpoint.exists(checkpoints) and not self.resume:
                raise CheckpointError(f"{checkpoints} already holds a checkpoint: pass --resume to continue it, "
                                      f"or another --log-dir")
            log_dir.mkdir(parents=True, exist_ok=True)
            (log_dir / "config.json").write_text(json.dumps(c.to_dict(), indent=2))
            metrics = MetricsLog(log_dir / "metrics.jsonl")
            board = TensorBoardLog(log_dir / "tensorboard")
            if board.writer is not None:
                self.out(f"[{me}] TensorBoard logs in {log_dir / 'tensorboard'}")

            sampler = ShardSampler(data.train, c.data.seq_len, c.inner.batch_size, c.run_id, swarm.peer_id)
            held_out = eval_batches(data.eval, c.data.seq_len, c.data.eval_sequences)
            replica = build_replica(c, device, sampler)
            swarm.track(lambda: {"inner_step": replica.inner.step_in_round})
            membership = Membership(0, "init")
            if self.resume:
                saved = checkpoint.load(checkpoints, c.run_id, fingerprint)
                replica.restore(saved, checkpoints)
                round_index, membership = saved.round, Membership(saved.round, "checkpoint")
                self.out(f"[{me}] resumed from {checkpoints} at round {round_index}")
            self.out(f"[{me}] model {sum(p.numel() for p in replica.model.parameters()) / 1e6:.2f}M params on "
                     f"{device}; {data.describe()}; outer {c.outer.algorithm}, H={c.inner.steps}")
            swarm.set_progress(round_index, "joining", replica.params_sha256)
            if c.swarm.min_peers > 1:
                self.out(f"[{me}] waiting for {c.swarm.min_peers} peers ...")
                present = swarm.wait_for_peers(c.swarm.min_peers, c.swarm.startup_timeout)
                self.out(f"[{me}] {present} peer(s) present; starting")

            def finished() -> bool:
                return bool(c.training.rounds) and round_index >= c.training.rounds

            unsettled: int | None = None  # a round that may have ended otherwise for the others
            while not self.stopping.is_set() and not finished():
                round_index, membership = self._catch_up(swarm, replica, round_index, membership, unsettled)
                if finished():
                    break
                record = self._round(swarm, replica, round_index, membership, held_out, device)
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
                round_index += 1
                if c.training.checkpoint_every and round_index % c.training.checkpoint_every == 0:
                    checkpoint.save(checkpoints, replica.checkpoint(round_index), c.run_id, fingerprint)
            board.close()
            checkpoint.save(checkpoints, replica.checkpoint(round_index), c.run_id, fingerprint)
            self.out(f"[{me}] checkpoint of round {round_index} written to {checkpoints}")
        except KeyboardInterrupt:  # a second signal: stop now, keep the last periodic checkpoint
            self.out(f"[{me}] stopped at once after {len(self.records)} round(s); no exit checkpoint")
        finally:
            swarm.leave()
        if self.stopping.is_set():
            self.out(f"[{me}] left the swarm after {len(self.records)} round(s)")
        self.out(summary(self.records, time.perf_counter() - started))
        return self.records

    def _catch_up(self, swarm: Swarm, replica: Worker, round_index: int, membership: Membership,
                  unsettled: int | None) -> tuple[int, Membership]:
        """If the swarm is ahead of us, or holds another state at our round, fetch its state and contribute
        from the next round. After an unsettled round, first let the others finish it and compare states
        at the next round (the majority wins), then fetch at once. A peer that is otherwise behind (joining,
        restarted) first waits (bounded) for the others to finish the round they are in, so that it starts
        the next one with them rather than late."""
        def behind(target: SwarmState | None) -> bool:
            return target is not None and (target.round > round_index or (
                target.round == round_index and target.params_sha256 != replica.params_sha256))

        latest: list[SwarmState | None] = []  # the last look passed() took: acted on at once, rounds may be short

        def passed(round_in_progress: int) -> bool:
            latest[:] = [swarm.swarm_state(round_index, replica.params_sha256)]
            return latest[0] is None or latest[0].round > round_in_progress

        s = self.config.swarm
        deadline = time.monotonic() + s.matchmaking_timeout + 3 * s.allreduce_timeout
        if unsettled is not None:
            swarm.set_progress(round_index, "training", replica.params_sha256)  # our state, for the vote
            if not self._wait(lambda: swarm.settled(unsettled), deadline):
                return round_index, membership
        target = swarm.swarm_state(round_index, replica.params_sha256)
        if not behind(target):
            return round_index, membership
        if unsettled is None:  # joining or restarted: let the round under way end, then start the next with all
            if not self._wait(lambda: passed(target.round), deadline):
                return round_index, membership
            target = latest[0]
            if not behind(target):
                return round_index, membership
        me = swarm.peer_id[-8:]
        self.out(f"[{me}] the swarm is at round {target.round} (this peer: {round_index}); fetching its state "
                 f"from {len(target.holders)} peer(s)")
        # Announce where we are headed: a round being formed waits for us rather than closing early.
        swarm.set_progress(target.round, "joining", target.params_sha256)
        started = time.perf_counter()
        try:
            replica.adopt(swarm.fetch_state(target))
        except SwarmError as e:
            self.out(f"[{me}] could not catch up ({e}); training on and trying again next round")
            return round_index, membership
        seconds = time.perf_counter() - started
        self.out(f"[{me}] caught up to round {target.round} in {seconds:.1f} s")
        return target.round, Membership(target.round, "peer", seconds)

    def _wait(self, done: Callable[[], bool], deadline: float) -> bool:
        """Poll ``done`` until it holds or ``deadline`` passes; False if this node is stopping."""
        while not done() and time.monotonic() < deadline:
            if self.stopping.is_set():
                return False
            # Others publish their next round the moment they reach it: look often, a round may be short.
            time.sleep(min(self.config.swarm.heartbeat_interval, CATCH_UP_POLL))
        return not self.stopping.is_set()

    def _round(self, swarm: Swarm, replica: Worker, round_index: int, membership: Membership,
               held_out: list[Batch], device: torch.device) -> RoundRecord | None:
        c = self.config
        start = replica.snapshot(round_index)
        swarm.publish_state(start)
        swarm.set_progress(round_index, "training", replica.params_sha256)
        started = time.perf_counter()
        inner_stats = replica.train(round_index, self.stopping.is_set)
        if inner_stats is None:
            replica.load_into_model()
            return None
        comm = replica.sync(swarm.communicator, round_index)
        evaluated = round_index % c.training.eval_every == 0 or round_index + 1 == c.training.rounds
        return RoundRecord(
            round=round_index, peers=len(comm.peers), loss=inner_stats.loss,
            eval_loss=evaluate(replica.model, held_out, device) if evaluated else None,
            params_sha256=replica.params_sha256, bytes_sent=comm.bytes_sent, bytes_received=comm.bytes_received,
            dense_fp32_bytes=comm.dense_fp32_bytes, density=replica.outer.density,
            bits_per_param=8 * comm.contribution_bytes / comm.params if comm.params else 0.0,
            tokens=inner_stats.tokens, inner_seconds=inner_stats.seconds, comm_seconds=comm.seconds,
            round_seconds=time.perf_counter() - started, peer_id=swarm.peer_id, dropped_peers=comm.dropped,
            clipped_peers=comm.clipped, update_norm=update_norm(start.params.values(), replica.outer.params),
            applied=comm.committed, excluded=comm.excluded, joined_round=membership.joined_round,
            state_source=membership.source,
            catchup_seconds=membership.catchup_seconds, timestamp=time.time(),
            compute_utilisation=RoundRecord.utilisation(inner_stats.seconds, self.records, started),
        )

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
