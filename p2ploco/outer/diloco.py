"""DiLoCo (Douillard et al. 2023): dense mean of pseudo-gradients, outer SGD with Nesterov momentum."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from p2ploco.collective.dense import DenseMean
from p2ploco.collective.sliced import SlicedExchange
from p2ploco.config import DiLoCoConfig
from p2ploco.outer.base import OuterAlgorithm, OuterRound, finite_step, pseudo_gradients

CPU = torch.device("cpu")


class DiLoCo(OuterAlgorithm):
    def __init__(self, global_params: Sequence[torch.Tensor], config: DiLoCoConfig,
                 slices: Mapping[str, Sequence[int]] | None = None, clip_factor: float = 0.0):
        super().__init__(global_params, slices)
        self.config, self.clip_factor = config, clip_factor
        self.momentum = [torch.zeros_like(p) for p in self.params]

    def contribute(self, local_params: Sequence[torch.Tensor], round_index: int,
                   start: Sequence[torch.Tensor] | None = None) -> OuterRound:
        # 1. Pseudo-gradient: global (or where training started) - local, a descent direction like a gradient.
        deltas = pseudo_gradients(start if start is not None else self.params, local_params, CPU)
        # 2. Its mean over the replicas of this round, every slice among its holders.
        return OuterRound(round_index, SlicedExchange({
            name: DenseMean([deltas[i] for i in positions], self.config.wire_dtype, self.clip_factor)
            for name, positions in self.slices.items()}))

    def step(self, outer_round: OuterRound, follow: Sequence[torch.Tensor] = ()) -> bool:
        # 3. Outer SGD with (Nesterov) momentum (``follow``, when overlapped: the local params take the same step).
        return nesterov_step(self.params, self.per_param(outer_round.exchange, DenseMean.mean), self.momentum,
                             self.config.lr, self.config.momentum, self.config.nesterov, outer_round.round_index,
                             follow, self.count_step)

    def shared_state(self) -> dict[str, torch.Tensor]:
        return {f"momentum.{i}": buf for i, buf in enumerate(self.momentum)}


def nesterov_step(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], momentum: Sequence[torch.Tensor],
                  lr: float, m: float, nesterov: bool, round_index: int, follow: Sequence[torch.Tensor] = (),
                  on_step: Callable[[torch.Tensor], None] = lambda step: None) -> bool:
    """Outer SGD with (Nesterov) momentum, in place: buf = m*buf + g; step = g + m*buf (or buf); p -= lr*step.
    One rounding per operation (no fused multiply-add), so every CPU computes the same bits. Computed twice:
    once to refuse a non-finite result before anything changes (False), once to apply it (True). ``follow``
    (overlapped rounds: the local params, on their device) take the same step; ``on_step`` sees each step."""

    def step_of(grad: torch.Tensor, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        new_buf = buf.mul(m).add_(grad)
        step = new_buf.mul(m).add_(grad) if nesterov else new_buf.clone()
        return new_buf, step.mul_(lr)

    if not finite_step(params, (step_of(g, b)[1] for g, b in zip(grads, momentum)), round_index):
        return False
    for i, (param, grad, buf) in enumerate(zip(params, grads, momentum)):
        new_buf, step = step_of(grad, buf)
        buf.copy_(new_buf)
        param.sub_(step)
        on_step(step)
        if follow:
            with torch.no_grad():
                follow[i].sub_(step.to(follow[i].device))
    return True
