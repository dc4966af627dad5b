"""A peer's training worker: the slices of the model it holds, their global parameters and outer
algorithm, and the inner trainer that moves its local copy.

A *full replica* holds the whole model and computes its gradients from its own batches; a *stage*
holds one pipeline stage and computes its gradients together with the other stages of its group
(``p2ploco.pipeline.schedule``). To the node and to the in-process harnesses both are the same
:class:`Worker`: inner steps, the outer round, snapshots for peers catching up, checkpoints.

A *constrained* worker (a stage of a subspace-compressed group, or any replica with
``pipeline.compression: uniform``) trains a projection of the global parameters: its residual-writing
weights are projected onto span(U) whenever it loads new global parameters, and its pseudo-gradient
is measured from that projection, so it reports its own training and not the projection
(docs/pipeline.md explains why the dropped part is not put into the error-feedback buffer).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from p2ploco.checkpoint import Checkpoint
from p2ploco.collective.exchange import AllReduceStats, Communicator
from p2ploco.config import Config
from p2ploco.data import Batch, ShardSampler
from p2ploco.errors import CheckpointError, SwarmError
from p2ploco.inner import GradientSource, InnerStats, InnerTrainer, LocalBatches, evaluate
from p2ploco.metrics import state_sha256
from p2ploco.model import Transformer, stage_layers
from p2ploco.outer import build_outer
from p2ploco.outer.base import OuterRound
from p2ploco.outer.streaming import FragmentSyncs, StreamingDiLoCo
from p2ploco.pipeline.schedule import PipelineStage
from p2ploco.pipeline.slices import group_by_slice
from p2ploco.pipeline.subspace import PlainBoundary, Subspace, SubspaceConstraint, constrained_dims
from p2ploco.pipeline.transport import StageTransport
from p2ploco.swarm.state import Snapshot


class Worker:
    def __init__(self, config: Config, device: torch.device, model: Transformer, gradients: GradientSource,
                 constraint: SubspaceConstraint | None):
        c = config
        self.device, self.model, self.constraint = device, model, constraint
        self.names = [name for name, _ in model.named_parameters()]
        streaming = c.outer.algorithm == "streaming"
        self.slices = group_by_slice(self.names, c.model, c.pipeline.stages,
                                     c.outer.streaming.fragments if streaming else 0)
        self.outer = build_outer(c.outer, list(model.parameters()), device, self.slices, c.inner.steps)
        horizon = c.inner.total_steps or c.training.rounds * c.inner.steps
        self.inner = InnerTrainer(model, c.inner, gradients, device, horizon, constraint)
        self.overlap = c.outer.overlap  # rounds end with land + launch instead of sync
        self.trained_from: list[torch.Tensor] | None = None  # overlapped: where these inner steps started (None:
        # from the global params)
        self._background = ThreadPoolExecutor(1, thread_name_prefix="outer-round") if self.overlap else None
        self._launched: Future[OuterRound] | None = None  # overlapped: the round in flight, once contributed
        self._trained: list[torch.Tensor] | None = None  # between land and launch: where the inner steps ended
        self._start: list[torch.Tensor] | None = None  # and where they started
        self.fragment_syncs: FragmentSyncs | None = None  # Streaming DiLoCo: this round's fragment syncs
        self.load_into_model()

    def _hash(self) -> tuple[str, dict[str, str]]:
        """The hash of each slice's global state (params and shared outer state), and one of them all (the slice's
        own when there is one)."""
        slices = {name: state_sha256(*self._global_state(positions)) for name, positions in self.slices.items()}
        if len(slices) == 1:
            return next(iter(slices.values())), slices
        return hashlib.sha256(";".join(f"{k}={v}" for k, v in slices.items()).encode()).hexdigest(), slices

    def train(self, round_index: int, should_stop: Callable[[], bool] = lambda: False,
              between: Callable[[int], None] | None = None, comm: Communicator | None = None) -> InnerStats | None:
        """The round's inner steps, ``between(h)`` after each; None if stopped before they were done. Streaming
        DiLoCo syncs its fragments through ``comm`` between them (the schedule's inner steps) and is not stopped
        before the round's end."""
        if isinstance(self.outer, StreamingDiLoCo):
            if comm is None:
                raise ValueError("Streaming DiLoCo trains with a communicator: its fragments sync between inner steps")
            syncs = self.fragment_syncs = FragmentSyncs(self.outer, list(self.model.parameters()), comm, round_index)

            def hook(steps_done: int) -> None:
                syncs.after_step(steps_done)
                if between is not None:
                    between(steps_done)

            # Not stopped midway: a round's early fragments already moved the global params, and every peer
            # must end the round holding all its fragments (a checkpoint of half a round would be a state
            # nobody else holds). A stop request takes effect at the round's end.
            return self.inner.run_round(round_index, lambda: False, hook)
        return self.inner.run_round(round_index, should_stop, between)

    def sync(self, comm: Communicator, round_index: int) -> AllReduceStats:
        """The outer round: pseudo-gradient (from where training started), all-reduce, outer step; then the
        model starts over from the new global params (or the old ones, if the round was not applied). Streaming
        DiLoCo synced its fragments during ``train``: this sums them up, and the model carries on from where it
        is (only a round not applied everywhere restarts it from the global params)."""
        if self.fragment_syncs is not None:
            stats, self.fragment_syncs = self.fragment_syncs.stats(), None
            if stats.committed:
                self.params_sha256, self.slice_sha256 = self._hash()
            else:
                self.load_into_model()
            return stats
        start = self.constraint.projected(self.outer.params, self.device) if self.constraint else None
        stats = self.outer.sync(list(self.model.parameters()), comm, round_index, start)
        self.load_into_model()
        return stats

    # ---- overlapped rounds: the all-reduce of round r runs during round r+1's inner steps ------------------
    #
    # When round r's outer step lands (at the end of round r+1's inner steps) it moves the global params and
    # the local ones alike: the replica keeps its own progress of round r+1, which the next all-reduce carries.
    # So each round's pseudo-gradient is measured from where its inner steps started, a point of this replica's
    # own (``trained_from``), not from the global params. The contribution (compression included) is computed
    # and its all-reduce started on a thread of its own while the next inner steps run; a round is finished
    # before the next one contributes, so local outer state changes in round order. Pipeline stages do not
    # overlap (config.py refuses it), so no subspace constraint applies here.

    @property
    def in_flight(self) -> OuterRound | None:
        """The round whose all-reduce runs during these inner steps (waits until it has been handed over)."""
        return self._launched.result() if self._launched is not None else None

    @property
    def launched(self) -> bool:
        """Whether a round is in flight (never waits)."""
        return self._launched is not None

    def in_flight_grouped(self) -> bool:
        """Whether the round in flight knows its group (so the peer's record may move on); never waits."""
        launched = self._launched
        return launched is not None and launched.done() and launched.result().all_reduce.grouped.is_set()

    def land(self) -> AllReduceStats | None:
        """The end of an overlapped round's inner steps, first half: the round in flight waited for and its outer
        step applied to the global params (one round late) and to the local ones. Returns its stats (None if no
        round was in flight: the first, or one dropped by catching up)."""
        self._trained = [p.detach().clone() for p in self.model.parameters()]
        self._start = self.trained_from if self.trained_from is not None else [p.clone() for p in self.outer.params]
        landed, self._launched = self.in_flight, None
        if landed is None:
            self.trained_from = self._trained
            return None
        stats = self.outer.finish(landed, list(self.model.parameters()))
        self.trained_from = [p.detach().clone() for p in self.model.parameters()]
        return stats

    def launch(self, round_index: int, comm: Communicator) -> None:
        """Second half: this round's contribution (from where its inner steps started to where they ended) and
        its all-reduce, on the background thread; the next inner steps go on from where ``land`` left them."""
        trained, start = self._trained, self._start
        self._trained = self._start = None

        def contribute_and_start() -> OuterRound:
            contribution = self.outer.contribute(trained, round_index, start)
            contribution.start(comm)
            return contribution

        self._launched = self._background.submit(contribute_and_start)
        self.params_sha256, self.slice_sha256 = self._hash()

    def evaluate(self, batches: list[Batch]) -> float:
        """The eval loss of the global params (the model holds them, or, overlapped or streaming, is lent them
        meanwhile)."""
        if self.trained_from is None and not isinstance(self.outer, StreamingDiLoCo):
            return evaluate(self.model, batches, self.device)
        with torch.no_grad():
            local = [p.detach().clone() for p in self.model.parameters()]
            for param, value in zip(self.model.parameters(), self.outer.params):
                param.copy_(value)
            loss = evaluate(self.model, batches, self.device)
            for param, mine in zip(self.model.parameters(), local):
                param.copy_(mine)
        self.model.train()
        return loss

    def finish_in_flight(self) -> AllReduceStats | None:
        """Wait for the round in flight and apply it (before an exit checkpoint); None if there was none."""
        landed, self._launched = self.in_flight, None
        if landed is None:
            return None
        stats = self.outer.finish(landed)
        self.load_into_model()
        return stats

    def load_into_model(self) -> None:
        """local <- global (projected onto span(U) where constrained): the next inner steps start here."""
        self.trained_from = None
        params = list(self.model.parameters())
        with torch.no_grad():
            for param, value in zip(params, self.outer.params):
                param.copy_(value)
        if self.constraint is not None:
            self.constraint.project_(params)
        self.params_sha256, self.slice_sha256 = self._hash()

    def _shared_positions(self) -> dict[str, tuple[str, int]]:
        """The outer algorithm's shared state keys (``kind.i``, i a parameter position) -> (kind, position)."""
        return {key: (key.rpartition(".")[0], int(key.rpartition(".")[2])) for key in self.outer.shared_state()}

    def _global_state(self, members: Sequence[int]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The live global params at parameter positions ``members``, and the shared outer state that goes with
        them, named by parameter (``momentum.blocks.3.mlp.up.weight``), whatever holds them."""
        shared = self.outer.shared_state()
        return ({self.names[i]: self.outer.params[i] for i in members},
                {f"{kind}.{self.names[i]}": shared[key] for key, (kind, i) in self._shared_positions().items()
                 if i in members})

    def state_bytes(self, slice_name: str) -> int:
        """The bytes of the tensors of ``slice_name``'s global state (params and shared outer state)."""
        params, shared = self._global_state(self.slices[slice_name])
        return sum(t.numel() * t.element_size() for t in [*params.values(), *shared.values()])

    def snapshots(self, round_index: int) -> list[Snapshot]:
        """The global state of each slice this worker holds at the start of ``round_index``, for peers catching
        up (CPU copies)."""
        out = []
        for name, members in self.slices.items():
            params, shared = self._global_state(members)
            out.append(Snapshot(round_index, name, {k: v.clone() for k, v in params.items()},
                                {k: v.detach().to("cpu").clone() for k, v in shared.items()}, self.slice_sha256[name]))
        return out

    def adopt(self, snapshots: dict[str, Snapshot]) -> None:
        """Take the swarm's state of every slice this worker holds; its own local outer state no longer applies.
        A round in flight still lands on it if the state is the one it was meant for (that of the next round),
        else it is dropped (its all-reduce ends in the background, unread)."""
        if set(snapshots) != set(self.slices):
            raise SwarmError(f"fetched slices {sorted(snapshots)} but this worker holds {sorted(self.slices)}")
        params = {name: t for snapshot in snapshots.values() for name, t in snapshot.params.items()}
        given = {name: t for snapshot in snapshots.values() for name, t in snapshot.shared.items()}
        if set(params) != set(self.names):
            raise SwarmError("fetched state does not fit this model (parameter names differ)")
        try:
            shared = {key: given[f"{kind}.{self.names[i]}"] for key, (kind, i) in self._shared_positions().items()}
            self.outer.load_params([params[name] for name in self.names])
            self.outer.load_shared_state(shared)
        except (KeyError, ValueError, RuntimeError) as e:
            raise SwarmError(f"fetched state does not fit this model and algorithm: {e!r}") from None
        in_flight = self.in_flight  # contributed (the error feedback is not touched any more) before the reset
        self.outer.reset_local_state()
        if in_flight is not None and {snapshot.round for snapshot in snapshots.values()} != {in_flight.round_index + 1}:
            self._launched = None
        self.load_into_model()

    def checkpoint(self, round_index: int, extras: dict[str, Any] | None = None) -> Checkpoint:
        """All this worker needs to continue; ``extras``: what its role adds (a stage's slot)."""
        inner_tensors, inner_settings = self.inner.optimizer_state()
        # A round in flight has not moved the global params yet: saved as if it were not applied.
        local = {f"outer/{k}": v for k, v in self.outer.local_state_with(self.in_flight).items()}
        local.update({f"inner/{k}": v for k, v in inner_tensors.items()})
        return Checkpoint(round_index, dict(zip(self.names, self.outer.params)), self.outer.shared_state(), local,
                          {"inner": inner_settings, "slices": self.slice_sha256, **(extras or {})})

    def restore(self, saved: Checkpoint, where: Path) -> None:
        shapes = {name: tuple(p.shape) for name, p in zip(self.names, self.outer.params)}
        if {name: tuple(t.shape) for name, t in saved.params.items()} != shapes:
            raise CheckpointError(f"the checkpoint in {where} does not fit this model (parameter names or shapes "
                                  f"differ)")
        try:
            self.outer.load_params([saved.params[name] for name in self.names])
            self.outer.load_shared_state(saved.shared)
            self.outer.load_local_state({k[6:]: v for k, v in saved.local.items() if k.startswith("outer/")})
            self.inner.load_optimizer_state({k[6:]: v for k, v in saved.local.items() if k.startswith("inner/")},
                                            saved.extras["inner"])
        except (KeyError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"the checkpoint in {where} does not fit this model and algorithm ({e})") from None
        self.load_into_model()


def run_subspace(config: Config, device: torch.device) -> Subspace | None:
    """The run's U and F on ``device`` when its stage boundaries are compressed, else None."""
    p = config.pipeline
    return Subspace.derive(config.model, p.rank, config.training.seed).to(device) if p.compressed else None


def _constraint(config: Config, subspace: Subspace, model: Transformer) -> SubspaceConstraint:
    names = [name for name, _ in model.named_parameters()]
    return SubspaceConstraint(subspace, names, constrained_dims(config.model, config.pipeline.stages))


def build_replica(config: Config, device: torch.device, sampler: ShardSampler) -> Worker:
    """A full replica: the whole model on this peer's own batches; constrained only in uniform mode."""
    subspace = run_subspace(config, device)
    model = Transformer(config.model, config.training.seed,
                        token_table=subspace.table if subspace else None).to(device)
    constrained = subspace is not None and config.pipeline.compression == "uniform"
    return Worker(config, device, model, LocalBatches(model, sampler, config.inner.grad_accum, device),
                  _constraint(config, subspace, model) if constrained else None)


def build_stage(config: Config, device: torch.device, stage: int) -> Worker:
    """Stage ``stage`` of a pipeline group: its slice of the model, trained with the group's other stages once
    ``worker.inner.gradients.link(...)`` connects it (``PipelineStage.link``)."""
    c = config
    subspace = run_subspace(c, device)
    layers = stage_layers(c.model.n_layer, c.pipeline.stages)[stage]
    first_with_table = subspace is not None and layers.start == 0  # only the first stage adds F to its input
    model = Transformer(c.model, c.training.seed, layers,
                        token_table=subspace.table if first_with_table else None).to(device)
    codec = subspace if subspace is not None else PlainBoundary(c.model.d_model)
    gradients = PipelineStage(model, codec, stage, c.pipeline.stages, c.inner.grad_accum, c.inner.batch_size,
                              c.data.seq_len, c.pipeline.wire_dtype, device)
    return Worker(c, device, model, gradients, _constraint(c, subspace, model) if subspace else None)


def build_linked_stage(config: Config, device: torch.device, transport: StageTransport,
                       sampler: ShardSampler | None) -> Worker:
    """A stage worker linked at once (in-process groups): ``sampler`` on the first stage only."""
    worker = build_stage(config, device, transport.stage)
    worker.inner.gradients.link(transport, sampler)
    return worker
