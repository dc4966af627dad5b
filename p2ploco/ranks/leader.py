"""Rank 0's side of its node's inner steps: before each, it brings the other ranks to what it changed outside a
step, then has them take the step with it.

Params changed outside a step are found by their version counters (every in-place write bumps one): after its own
step rank 0 notes them, and any that moved since (the global params loaded at a round's start, a catch-up, an eager
overlapped round's correction) are sent before the next step, all of them. The inner optimizer's state changes
outside a step only when a checkpoint is loaded (``InnerTrainer.load_optimizer_state``), which says so. Rank 0's
params are the ones it trains, so they are never behind its steps (``gather`` has nothing to do); a sharded replica's
are not (``sharded.ShardedLeader``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from p2ploco.data import Batch
from p2ploco.inner import evaluate
from p2ploco.ranks.processes import Command, LocalRanks


class Leader:
    """The ``inner.OtherRanks`` of rank 0's ``InnerTrainer``."""

    def __init__(self, ranks: LocalRanks):
        self.ranks = ranks
        self.versions: list[int] | None = None  # the params' version counters after rank 0's last step
        self.optimizer_changed = False

    def before_step(self, step: int, params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer) -> None:
        self.ranks.check()
        if self.versions != [p._version for p in params]:
            self.ranks.command(Command.PARAMS)
            self.ranks.share_params(params)
        if self.optimizer_changed:
            self.ranks.command(Command.OPTIMIZER)
            self.ranks.share_optimizer(optimizer)
            self.optimizer_changed = False
        self.ranks.command(Command.STEP, step)

    def after_step(self, params: Sequence[torch.Tensor]) -> None:
        self.versions = [p._version for p in params]

    def gather(self) -> None:
        pass

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return optimizer.state_dict()

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        optimizer.load_state_dict(state)
        self.optimizer_changed = True

    def evaluate(self, model: torch.nn.Module, batches: list[Batch]) -> float:
        """On rank 0 alone: it holds the whole model, and the others wait for its next command."""
        return evaluate(model, batches, self.ranks.device)
