"""A replica sharded over the node's local ranks (FSDP2, ``training.shard``): for a model whose params, gradients and
inner AdamW state do not fit one device.

Every rank holds a shard of each parameter (``fully_shard`` on each block, then on the model: dim 0 cut in ``world``
chunks) and of its AdamW moments, and trains its share of each step's micro-batches as with DDP
(``data_parallel.py``): FSDP gathers a block's params for its forward and backward and reduce-scatters the
gradients, averaged, so every rank steps its shard from the same mean gradient.

Rank 0's outer step reads and writes the whole local params: it keeps them in host memory (the *whole copy*, the
``Worker``'s model, on the CPU beside the global params and the outer state) and moves them to and from the shards
only when they are read or written (``ShardedLeader``). A write (a round's start loads the global params, a catch-up,
a merged fragment) is scattered to the shards before the next step; the steps' result is gathered into the whole copy
when the node reads it (``Worker.local_params``): once a round where only the round's end reads it, not once a step.
The optimizer's moments are gathered for a checkpoint and scattered when one is loaded. An evaluation scatters the
whole copy (the global params, lent to it) as before a step, then every rank scores a share of the held-out batches.
The pseudo-gradient, error feedback and compression run on rank 0 as on any node, on its CPU; per shard they would
need shards cut at SparseLoCo's 64 x 64 tiles and a contribution assembled from N ranks' parts (docs/design.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from p2ploco.data import Batch, ShardSampler
from p2ploco.inner import loss_sums
from p2ploco.model import Transformer
from p2ploco.ranks.data_parallel import RankBatches
from p2ploco.ranks.processes import Command, LocalRanks


def shard_model(model: Transformer, ranks: LocalRanks) -> None:
    """Shard ``model``'s params over ``ranks`` in place: each block a unit of its own (gathered for its forward and
    backward alone), the embedding, final norm and head the model's."""
    mesh = DeviceMesh.from_group(ranks.train, ranks.device.type)
    for block in model.blocks.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


class ShardedBatches(RankBatches):
    def __init__(self, model: FSDPModule, forward: torch.nn.Module, sampler: ShardSampler, micro_batches: int,
                 ranks: LocalRanks):
        """``model``: sharded (``shard_model``); ``forward``: it, or its compiled forward (``training.compile``)."""
        super().__init__(sampler, micro_batches, ranks.device, ranks)
        self.model, self.forward = model, forward

    def gradient_sync(self, on: bool) -> contextlib.AbstractContextManager:
        self.model.set_requires_gradient_sync(on)  # off: the backward keeps the whole gradients, reduce-scattered later
        return contextlib.nullcontext()

    def held_grads(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
        """This rank's shard of each gradient (a view: clipping it clips the gradient)."""
        return [None if p.grad is None else p.grad.to_local() for p in params]

    def reduce(self, step: int, values: Sequence[float]) -> list[float]:
        """[loss, squared norm, stop votes]: the loss is the mean of the ranks', the squared norm and the votes their
        sums (each rank's norm is of its shards)."""
        loss_share, squared_norm, stop_vote = values
        summed = self.ranks.sum_(torch.tensor([loss_share, squared_norm, stop_vote], dtype=torch.float64,
                                              device=self.device))
        return [float(summed[0]) / self.ranks.world, float(summed[1]), float(summed[2])]


class ShardedState:
    """Moves a sharded replica's state between rank 0's whole copy and every rank's shards. Every rank calls each
    method in the same order (rank 0 as it leads, the others as told); the whole copy is rank 0's argument, None on
    the others."""

    def __init__(self, ranks: LocalRanks, model: torch.nn.Module):
        """``model``: this rank's sharded model (``shard_model``; its params are DTensors)."""
        self.ranks, self.model, self.params = ranks, model, list(model.parameters())

    @torch.no_grad()
    def scatter_params(self, whole: Sequence[torch.Tensor] | None) -> None:
        """Every rank's shards <- rank 0's ``whole`` params."""
        with self.ranks.failures():
            for i, param in enumerate(self.params):
                param.to_local().copy_(self._scattered(param, None if whole is None else whole[i]).to_local())

    @torch.no_grad()
    def gather_params(self, whole: Sequence[torch.Tensor] | None) -> None:
        """Rank 0's ``whole`` params <- every rank's shards."""
        with self.ranks.failures():
            for i, param in enumerate(self.params):
                gathered = param.full_tensor()
                if whole is not None:
                    whole[i].copy_(gathered)

    def scatter_optimizer(self, optimizer: torch.optim.Optimizer, whole: dict[str, Any] | None) -> None:
        """Every rank's ``optimizer`` state <- rank 0's ``whole`` state dict (as one rank holding the whole model
        keeps it): a moment shaped as its param is cut as the param is; the rest (the step count, the settings)
        sent whole."""
        params = [p for param_group in optimizer.param_groups for p in param_group["params"]]  # the state dict's order
        layout: list = [None]
        if whole is not None:
            layout[0] = {"param_groups": whole["param_groups"],
                         "state": {i: {key: ("shard", value.dtype) if _cut(params[i], value) else value
                                       for key, value in slots.items()}
                                   for i, slots in whole["state"].items()}}
        with self.ranks.failures():
            dist.broadcast_object_list(layout, src=0, group=self.ranks.control, device=self.ranks.device)
            state: dict[int, dict[str, Any]] = {}
            for i, slots in sorted(layout[0]["state"].items()):
                state[i] = {}
                for key, value in sorted(slots.items()):
                    if isinstance(value, tuple) and value[:1] == ("shard",):
                        source = None if whole is None else whole["state"][i][key]
                        state[i][key] = self._scattered(params[i], source, value[1])
                    else:
                        state[i][key] = value
        optimizer.load_state_dict({"state": state, "param_groups": layout[0]["param_groups"]})

    def gather_optimizer(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """``optimizer``'s state dict with every sharded moment whole, on the CPU (of use on rank 0)."""
        state = optimizer.state_dict()
        with self.ranks.failures():
            slots = {i: {key: value.full_tensor().cpu() if isinstance(value, DTensor) else value
                         for key, value in sorted(values.items())}
                     for i, values in sorted(state["state"].items())}
        return {"state": slots, "param_groups": state["param_groups"]}

    def evaluate(self, batches: list[Batch] | None) -> float:
        """The mean next-token loss of rank 0's ``batches`` (None on the others) under the params the shards hold,
        each rank scoring every world-th batch. A forward gathers each block's params from every rank, so every rank
        runs as many forwards: one with a batch fewer repeats the first, unscored."""
        shared: list = [batches]
        device, world = self.ranks.device, self.ranks.world
        with self.ranks.failures():  # the forwards' gathers too: a rank that dies mid-way is named
            dist.broadcast_object_list(shared, src=0, group=self.ranks.control, device=device)
            everyone = shared[0]
            mine = everyone[self.ranks.rank :: world]
            total, count = loss_sums(self.model, mine, device)
            loss_sums(self.model, everyone[:1] * (-(-len(everyone) // world) - len(mine)), device)
        self.model.train()
        # FSDP2 keeps the root's params (embedding, final norm, head) gathered after a forward, for the backward that
        # reshards them; no backward follows here, and the next step's forward would read these gathered params, not
        # the shards scattered before it
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        summed = self.ranks.sum_(torch.tensor([total, count], dtype=torch.float64, device=device))
        return float(summed[0]) / float(summed[1])

    def take_part(self, kind: Command, optimizer: torch.optim.Optimizer) -> None:
        """A rank 1..N-1's part in rank 0's command ``kind`` (not a step's)."""
        if kind is Command.PARAMS:
            self.scatter_params(None)
        elif kind is Command.OPTIMIZER:
            self.scatter_optimizer(optimizer, None)
        elif kind is Command.GATHER_PARAMS:
            self.gather_params(None)
        elif kind is Command.GATHER_OPTIMIZER:
            self.gather_optimizer(optimizer)
        elif kind is Command.EVALUATE:
            self.evaluate(None)
        else:
            raise ValueError(f"{kind.name} is not a sharded state's command")

    def _scattered(self, param: torch.Tensor, source: torch.Tensor | None, dtype: torch.dtype | None = None
                   ) -> DTensor:
        """``source`` (rank 0's; None on the others) cut as ``param`` is, each rank's part sent to it."""
        device = self.ranks.device
        whole = (torch.empty(param.shape, dtype=dtype or param.dtype, device=device) if source is None
                 else source.to(device))
        return distribute_tensor(whole, param.device_mesh, param.placements, src_data_rank=0)


class ShardedLeader:
    """The ``inner.OtherRanks`` of rank 0's ``InnerTrainer`` when the replica is sharded: it keeps rank 0's whole copy
    of the local params (``whole``, the model its outer step reads) and the shards the ranks train in step."""

    def __init__(self, ranks: LocalRanks, state: ShardedState, whole: Sequence[torch.Tensor]):
        self.ranks, self.state, self.whole = ranks, state, list(whole)
        self.versions: list[int] | None = None  # the whole copy's version counters when it last matched the shards
        self.stepped = False  # steps moved the shards since the whole copy was gathered
        self.loaded_optimizer: dict[str, Any] | None = None  # a checkpoint's state, scattered before the next step

    def before_step(self, step: int, params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer) -> None:
        self.ranks.check()
        self._scatter_writes()
        if self.loaded_optimizer is not None:
            self.ranks.command(Command.OPTIMIZER)
            self.state.scatter_optimizer(optimizer, self.loaded_optimizer)
            self.loaded_optimizer = None
        self.ranks.command(Command.STEP, step)

    def after_step(self, params: Sequence[torch.Tensor]) -> None:
        self.stepped = True

    def gather(self) -> None:
        if not self.stepped:
            return
        self.ranks.check()
        self.ranks.command(Command.GATHER_PARAMS)
        self.state.gather_params(self.whole)
        self.versions, self.stepped = self._versions(), False

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        if self.loaded_optimizer is not None:
            return self.loaded_optimizer
        self.ranks.check()
        self.ranks.command(Command.GATHER_OPTIMIZER)
        return self.state.gather_optimizer(optimizer)

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        self.loaded_optimizer = state

    def evaluate(self, model: torch.nn.Module, batches: list[Batch]) -> float:
        """On every rank, each its share of ``batches`` (``ShardedState.evaluate``), the whole copy's params scattered
        to the shards first, as before a step. The steps' result must be in the whole copy already (``Worker.evaluate``
        gathers it): the shards are overwritten."""
        if self.stepped:
            raise RuntimeError("a sharded replica evaluated with steps not gathered into its whole copy")
        self.ranks.check()
        self._scatter_writes()
        self.ranks.command(Command.EVALUATE)
        return self.state.evaluate(batches)

    def _scatter_writes(self) -> None:
        """The shards <- the whole copy, if it was written since they last matched (the writes win over any steps
        since the gather)."""
        if self.versions != self._versions():
            self.ranks.command(Command.PARAMS)
            self.state.scatter_params(self.whole)
            self.versions, self.stepped = self._versions(), False

    def _versions(self) -> list[int]:
        return [p._version for p in self.whole]


def _cut(param: torch.Tensor, value: object) -> bool:
    """Whether ``value``, a state entry of ``param``, is cut as ``param`` is (a moment, not the step count)."""
    return torch.is_tensor(value) and value.dim() > 0 and tuple(value.shape) == tuple(param.shape)
