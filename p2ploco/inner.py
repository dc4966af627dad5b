"""The inner loop: H local AdamW steps with warm-up + cosine, clipping and gradient accumulation.

The inner step number is global (round * H + h), so the learning rate and this peer's data
position follow from the round alone: a peer that joins or restarts computes them, it does not
replay them.

Where a step's gradients come from is a :class:`GradientSource`: this peer's own micro-batches
through the whole model (:class:`LocalBatches`), or its stage's part of a pipeline group's schedule
(``p2ploco.pipeline.schedule``). Either way the step is the same: gradients, the global norm over
everything that trains together, one clipping coefficient, one AdamW step. ``GradientSource`` and
:class:`Constraint` are the seam through which pipelines plug in: nothing here knows of them.
"""

from __future__ import annotations

import contextlib
import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from p2ploco import faults
from p2ploco.budget import RoundBudget, StepTimes
from p2ploco.config import InnerConfig
from p2ploco.data import Batch, ShardSampler
from p2ploco.host_memory import give_back_freed


@dataclass
class InnerStats:
    loss: float  # mean training loss over the round's inner steps
    tokens: int
    seconds: float
    steps: int  # inner steps trained: H, or fewer where the round's budget allowed fewer (``budget.py``)


def autocast_for(device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast on CUDA; plain fp32 on CPU."""
    if device.type == "cuda":
        return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


class Constraint(Protocol):
    """Keeps some of a worker's tensors in a subspace (``pipeline.subspace.SubspaceConstraint``)."""

    def project_(self, tensors: Sequence[torch.Tensor | None]) -> None:
        """Project the constrained entries of ``tensors`` (parameters or their gradients, in order) in place."""

    def projected(self, tensors: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        """``tensors`` with the constrained entries replaced by float32 projections on ``device``."""


class OtherRanks(Protocol):
    """Processes that repeat a trainer's inner steps: its node's other local ranks (``p2ploco.ranks.leader``)."""

    def before_step(self, step: int, params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer) -> None:
        """Bring them to ``params`` and ``optimizer``'s state where these changed outside a step; have them take
        step ``step`` with this trainer."""

    def after_step(self, params: Sequence[torch.Tensor]) -> None:
        """The step is taken: ``params`` are what they hold too."""

    def gather(self) -> None:
        """Bring the steps' result into the params the node's outer step reads, where these are not the trained
        ones (a sharded replica's whole copy)."""

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """``optimizer``'s state dict as one process training the whole model holds it (for a checkpoint)."""

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Replace ``optimizer``'s state with ``state`` (a checkpoint's), and theirs."""

    def evaluate(self, model: torch.nn.Module, batches: list[Batch]) -> float:
        """The mean next-token loss of ``batches`` under the params the node's outer step reads, scored with the
        trainer's ``model`` (on this rank alone, or on every rank, each its share, where the ranks hold shards)."""


class GradientSource(ABC):
    """Fills the ``.grad`` of a worker's parameters for one inner step."""

    tokens_per_step: int  # tokens the step trains on (a pipeline group's, for each of its stages)

    @abstractmethod
    def accumulate(self, step: int) -> float:
        """Accumulate the step's gradients over its micro-batches (each loss scaled by 1 / micro-batches);
        return this worker's share of the step's loss (0.0 where the loss is computed elsewhere)."""

    def held_grads(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
        """The gradients of ``params`` this worker holds, as plain tensors: each whole (a shard of each where a
        node's ranks shard the model, whose ``reduce`` sums their norms)."""
        return [p.grad for p in params]

    def reduce(self, step: int, values: Sequence[float]) -> list[float]:
        """Sum ``values`` over everything that trains this step together: a whole model is alone; the
        stages of a pipeline group add theirs (squared gradient norms, the loss)."""
        return list(values)


class LocalBatches(GradientSource):
    """The whole model on this peer's own micro-batches."""

    def __init__(self, model: torch.nn.Module, sampler: ShardSampler, micro_batches: int, device: torch.device):
        self.model, self.sampler, self.micro_batches, self.device = model, sampler, micro_batches, device
        self.tokens_per_step = micro_batches * sampler.batch_size * sampler.seq_len

    def accumulate(self, step: int) -> float:
        losses = []
        for micro in range(self.micro_batches):
            inputs, targets = (on_device(t, self.device) for t in self.sampler.batch(step * self.micro_batches + micro))
            with autocast_for(self.device):
                loss = self.model(inputs, targets=targets) / self.micro_batches
            loss.backward()
            losses.append(loss.detach())
        return float(torch.stack(losses).sum())  # one device sync a step, not one a micro-batch


def on_device(batch: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``batch`` on ``device``: to a GPU from pinned memory without waiting for the copy (the step's kernels queue
    behind it)."""
    if device.type == "cuda":
        return batch.pin_memory().to(device, non_blocking=True)
    return batch.to(device)


def squared_norm(grads: Sequence[torch.Tensor]) -> float:
    """Sum of squares of all gradient entries (float32 per tensor, in one fused kernel as clip_grad_norm_ takes
    them), with one device sync."""
    if not grads:
        return 0.0
    return float(torch.stack(torch._foreach_norm(list(grads), 2, dtype=torch.float32)).pow(2).sum())


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_'s factor: max_norm / (norm + 1e-6), at most 1."""
    return min(1.0, max_norm / (total_norm + 1e-6))


class InnerTrainer:
    def __init__(self, model: torch.nn.Module, config: InnerConfig, gradients: GradientSource, device: torch.device,
                 horizon: int, constraint: Constraint | None = None, other_ranks: OtherRanks | None = None):
        """``horizon``: the inner step where the cosine reaches its floor (0: constant after warm-up).
        ``constraint``: keeps subspace-constrained weights in span(U) (gradients projected before the step,
        weights after it). ``other_ranks``: the node's other local ranks, which take every step with this one."""
        self.model, self.config, self.gradients, self.device, self.horizon = model, config, gradients, device, horizon
        self.constraint, self.other_ranks = constraint, other_ranks
        self.params = list(model.parameters())
        decay = [p for p in self.params if p.dim() >= 2]
        no_decay = [p for p in self.params if p.dim() < 2]  # norm gains
        # Fused (one kernel for every parameter's update) where the device has it; on the CPU the default
        # (foreach) update is the one the reference-algorithm tests follow bit for bit
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=config.lr, betas=tuple(config.betas), fused=True if device.type == "cuda" else None,
        )
        self.step_in_round = 0  # inner steps done in the round under way (shown in the peer's record)
        self.step_times = StepTimes()  # recent steps' wall time: sizes the swarm's round budget (``budget.py``)

    def lr_at(self, step: int) -> float:
        c = self.config
        if step < c.warmup_steps:
            return c.lr * (step + 1) / c.warmup_steps
        if self.horizon <= c.warmup_steps:
            return c.lr
        progress = min(1.0, (step - c.warmup_steps) / (self.horizon - c.warmup_steps))
        return c.lr * (c.min_lr_ratio + (1 - c.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))

    def step(self, step: int) -> float:
        """One inner step (global step number ``step``); returns its training loss."""
        return self._step(step, lambda: True)[0]

    def _step(self, step: int, wants_another: Callable[[], bool]) -> tuple[float, bool]:
        """One inner step; returns its training loss, and whether everything that trains together wants another
        step this round: asked of each (``wants_another``, as the step's gradients are in) and summed with the
        loss, so that the stages of a pipeline group stop at the same step (the slowest one's budget)."""
        if self.other_ranks is not None:
            self.other_ranks.before_step(step, self.params, self.optimizer)
        for param_group in self.optimizer.param_groups:
            param_group["lr"] = self.lr_at(step)
        self.optimizer.zero_grad(set_to_none=True)
        loss_share = self.gradients.accumulate(step)
        grads = self.gradients.held_grads(self.params)
        if self.constraint is not None:
            self.constraint.project_(grads)
        present = [g for g in grads if g is not None]
        stop_vote = 0.0 if wants_another() else 1.0
        loss, total_squared, stop_votes = self.gradients.reduce(step, [loss_share, squared_norm(present), stop_vote])
        if self.config.grad_clip > 0:
            coefficient = clip_coefficient(math.sqrt(total_squared), self.config.grad_clip)
            if coefficient < 1.0:
                torch._foreach_mul_(present, coefficient)
        self.optimizer.step()
        if self.constraint is not None:
            self.constraint.project_(self.params)
        if self.other_ranks is not None:
            self.other_ranks.after_step(self.params)
        return loss, stop_votes == 0

    def evaluate(self, batches: list[Batch]) -> float:
        """The mean next-token loss of ``batches`` under the params the node's outer step reads: the model's, or,
        where the node's ranks shard it, theirs (``OtherRanks.evaluate``)."""
        if self.other_ranks is None:
            return evaluate(self.model, batches, self.device)
        return self.other_ranks.evaluate(self.model, batches)

    def run_round(self, round_index: int, should_stop: Callable[[], bool] = lambda: False,
                  between: Callable[[int], None] | None = None, budget: RoundBudget | None = None
                  ) -> InnerStats | None:
        """The round's steps: H, or as many as ``budget`` allows (at least one; ``budget.py``); None if
        ``should_stop`` turned true before they were done. ``between(h)`` runs after each step, h steps done: the
        place for work that belongs between inner steps (announcing the round once the previous one's group
        formed; a Streaming DiLoCo fragment started or landed). Its time is not counted as training time; anything
        else that holds a step is. Step h
        of round r is global step r * H + h whatever the budget (its learning rate and batch), so a peer that
        trains fewer steps skips the rest of the round's batches. Whether a step after the first fits is decided
        within the step before it, by everything that trains together (a pipeline group's stages alike)."""
        c = self.config
        self.model.train()
        losses, seconds, began = [], 0.0, time.perf_counter()
        since = began  # where the step under way began: the end of the last one's ``between``, or the round's start
        another = budget is None or budget.allows(0, 0.0)

        def wants_another() -> bool:  # asked within step h (h + 1 steps done once it ends)
            return budget is None or budget.allows(len(losses) + 1, time.perf_counter() - began)

        for h in range(c.steps):
            self.step_in_round = h
            if not another:
                break
            if should_stop():
                return None
            faults.hit("inner.step", round_index)
            started = time.perf_counter()
            loss, another = self._step(round_index * c.steps + h, wants_another)
            losses.append(loss)
            faults.stretch("inner.step", round_index, time.perf_counter() - started)
            # A step's time is its wall time, whatever held it (its data, a device shared with another job, a stall
            # before it): the budget must see this peer's real pace, not its compute alone.
            took = time.perf_counter() - since
            self.step_times.add(took)
            seconds += took
            if between is not None:
                between(h + 1)
            since = time.perf_counter()
        # The gradients are let go until the next step makes them again, and the pages they and the steps'
        # activations held go back to the kernel: the outer step that follows builds the new global state (4 bytes
        # a parameter) beside the old one, in their place
        self.optimizer.zero_grad(set_to_none=True)
        give_back_freed()
        self.step_in_round = len(losses)
        loss = sum(losses) / len(losses) if losses else float("nan")  # none: a round that only contributes
        return InnerStats(loss, len(losses) * self.gradients.tokens_per_step, seconds, len(losses))

    def optimizer_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """AdamW's moments as named tensors, and its settings as JSON, for a checkpoint."""
        state = (self.optimizer.state_dict() if self.other_ranks is None
                 else self.other_ranks.optimizer_state(self.optimizer))
        tensors = {f"{index}.{key}": value for index, slots in state["state"].items()
                   for key, value in slots.items() if torch.is_tensor(value)}
        return tensors, {"param_groups": state["param_groups"]}

    def load_optimizer_state(self, tensors: dict[str, torch.Tensor], settings: dict[str, Any]) -> None:
        slots: dict[int, dict[str, torch.Tensor]] = {}
        for key, value in tensors.items():
            index, _, name = key.partition(".")
            slots.setdefault(int(index), {})[name] = value
        state = {"state": slots, "param_groups": settings["param_groups"]}
        if self.other_ranks is None:
            self.optimizer.load_state_dict(state)
        else:
            self.other_ranks.load_optimizer_state(self.optimizer, state)


def evaluate(model: torch.nn.Module, batches: list[Batch], device: torch.device) -> float:
    """Mean next-token loss over the held-out batches."""
    total, count = loss_sums(model, batches, device)
    return total / count


@torch.no_grad()
def loss_sums(model: torch.nn.Module, batches: list[Batch], device: torch.device) -> tuple[float, int]:
    """The next-token loss summed over every target of ``batches``, and how many targets (the model left in eval
    mode)."""
    model.eval()
    total, count = 0.0, 0
    for inputs, targets in batches:
        with autocast_for(device):
            loss = model(inputs.to(device), targets=targets.to(device))
        total += loss.item() * targets.numel()
        count += targets.numel()
    return total, count
