"""Workers as a run's config describes them: a full replica, or one stage of a pipeline group.

The one place that puts pipelines into a worker: a stage's gradients come from its group's schedule
(``pipeline/schedule.py``) and a compressed boundary constrains weights to span(U) (``pipeline/subspace.py``),
both through the seam of ``p2ploco.inner`` (``GradientSource``, ``Constraint``).
"""

from __future__ import annotations

import torch

from p2ploco.config import Config
from p2ploco.data import ShardSampler
from p2ploco.inner import GradientSource, InnerTrainer, LocalBatches
from p2ploco.model import Transformer, stage_layers
from p2ploco.pipeline.schedule import PipelineStage
from p2ploco.pipeline.subspace import PlainBoundary, Subspace, SubspaceConstraint, constrained_dims
from p2ploco.pipeline.transport import StageTransport
from p2ploco.ranks.data_parallel import DataParallelBatches
from p2ploco.ranks.leader import Leader
from p2ploco.ranks.processes import LocalRanks
from p2ploco.worker import Worker


def run_subspace(config: Config, device: torch.device) -> Subspace | None:
    """The run's U and F on ``device`` when its stage boundaries are compressed, else None."""
    p = config.pipeline
    return Subspace.derive(config.model, p.rank, config.training.seed).to(device) if p.compressed else None


def _constraint(config: Config, subspace: Subspace, model: Transformer) -> SubspaceConstraint:
    names = [name for name, _ in model.named_parameters()]
    return SubspaceConstraint(subspace, names, constrained_dims(config.model, config.pipeline.stages))


def build_replica(config: Config, device: torch.device, sampler: ShardSampler, ranks: LocalRanks | None = None
                  ) -> Worker:
    """A full replica: the whole model on this peer's own batches; constrained only in uniform mode. ``ranks``: the
    node's local ranks, of which this is rank 0 (``p2ploco.ranks``); where they shard the model (``training.shard``)
    the outer step reads a whole copy of it in host memory."""
    model, gradients, constraint = _replica_parts(config, device, sampler, ranks)
    c = config
    if ranks is not None and c.training.shard:
        from p2ploco.ranks.sharded import ShardedLeader, ShardedState  # see _replica_parts

        cpu = torch.device("cpu")
        whole = _seeded_model(c, cpu, run_subspace(c, cpu))
        leader = ShardedLeader(ranks, ShardedState(ranks, model), list(whole.parameters()))
        return Worker(c, cpu, whole, InnerTrainer(model, c.inner, gradients, device, c.inner_horizon,
                                                  other_ranks=leader), None)
    other_ranks = Leader(ranks) if ranks is not None else None
    return Worker(c, device, model, InnerTrainer(model, c.inner, gradients, device, c.inner_horizon, constraint,
                                                 other_ranks), constraint)


def build_rank_trainer(config: Config, device: torch.device, sampler: ShardSampler, ranks: LocalRanks) -> InnerTrainer:
    """A node's local rank other than 0: its replica's model and inner trainer, which repeat rank 0's steps (no
    outer state: rank 0 alone takes the outer steps)."""
    model, gradients, constraint = _replica_parts(config, device, sampler, ranks)
    return InnerTrainer(model, config.inner, gradients, device, config.inner_horizon, constraint)


def _seeded_model(config: Config, device: torch.device, subspace: Subspace | None) -> Transformer:
    return Transformer(config.model, config.training.seed, token_table=subspace.table if subspace else None).to(device)


def _replica_parts(config: Config, device: torch.device, sampler: ShardSampler, ranks: LocalRanks | None
                   ) -> tuple[Transformer, GradientSource, SubspaceConstraint | None]:
    subspace = run_subspace(config, device)
    model = _seeded_model(config, device, subspace)
    sharded = ranks is not None and config.training.shard
    if sharded:
        # imported here: torch.distributed.tensor takes most of a second to import, at every node's start otherwise
        from p2ploco.ranks.sharded import ShardedBatches, shard_model

        shard_model(model, ranks)  # before compiling: torch.compile traces FSDP2's gathers with the model
    constrained = subspace is not None and config.pipeline.compression == "uniform"
    forward = torch.compile(model) if config.training.compile else model  # the same parameters, compiled kernels
    accum = config.inner.grad_accum
    if ranks is None:
        gradients: GradientSource = LocalBatches(forward, sampler, accum, device)
    elif sharded:
        gradients = ShardedBatches(model, forward, sampler, accum, ranks)
    else:
        gradients = DataParallelBatches(forward, sampler, accum, device, ranks)
    return model, gradients, _constraint(config, subspace, model) if constrained else None


def build_stage(config: Config, device: torch.device, stage: int) -> tuple[Worker, PipelineStage]:
    """Stage ``stage`` of a pipeline group: its worker, and the gradient source that trains it with the group's
    other stages once linked to them (``PipelineStage.link``)."""
    c = config
    subspace = run_subspace(c, device)
    layers = stage_layers(c.model.n_layer, c.pipeline.stages)[stage]
    first_with_table = subspace is not None and layers.start == 0  # only the first stage adds F to its input
    model = Transformer(c.model, c.training.seed, layers,
                        token_table=subspace.table if first_with_table else None).to(device)
    codec = subspace if subspace is not None else PlainBoundary(c.model.d_model)
    gradients = PipelineStage(model, codec, stage, c.pipeline.stages, c.inner.grad_accum, c.inner.batch_size,
                              c.data.seq_len, c.pipeline.wire_dtype, device)
    constraint = _constraint(c, subspace, model) if subspace else None
    return Worker(c, device, model, InnerTrainer(model, c.inner, gradients, device, c.inner_horizon, constraint),
                  constraint), gradients


def build_linked_stage(config: Config, device: torch.device, transport: StageTransport,
                       sampler: ShardSampler | None) -> Worker:
    """A stage worker linked at once (in-process groups): ``sampler`` on the first stage only."""
    worker, gradients = build_stage(config, device, transport.stage)
    gradients.link(transport, sampler)
    return worker
