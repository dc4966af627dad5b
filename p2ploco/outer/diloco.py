"""DiLoCo (Douillard et al. 2023): dense mean of pseudo-gradients, outer SGD with Nesterov momentum."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from p2ploco.collective.dense import DenseMean
from p2ploco.collective.robust import UNBOUNDED, Policy
from p2ploco.collective.sliced import SlicedExchange
from p2ploco.config import DiLoCoConfig
from p2ploco.device import to_host
from p2ploco.outer.base import Move, OuterAlgorithm, OuterStep, OuterSync, finite_update, pseudo_gradients


class DiLoCo(OuterAlgorithm):
    shared_kinds = ("momentum",)

    def __init__(self, global_params: Sequence[torch.Tensor], config: DiLoCoConfig,
                 slices: Mapping[str, Sequence[int]] | None = None, policy: Policy = UNBOUNDED,
                 max_tokens: int | None = None):
        super().__init__(global_params, slices, policy, max_tokens)
        self.config = config
        self.momentum = [torch.zeros_like(p) for p in self.params]

    def contribute(self, local_params: Sequence[torch.Tensor], round_index: int,
                   start: Sequence[torch.Tensor] | None = None, tokens: int = 1) -> OuterSync:
        # 1. Pseudo-gradient: global (or where training started) - local, a descent direction like a gradient,
        #    computed where the local params live and brought to the host; plus that of rounds not applied.
        deltas = self.carried(to_host(pseudo_gradients(start if start is not None else self.params, local_params)))
        # 2. Its mean over the replicas of this round, every slice among its holders, weighted by tokens trained.
        return OuterSync(round_index, SlicedExchange({
            name: DenseMean([deltas[i] for i in positions], self.config.wire_dtype, self.policy)
            for name, positions in self.slices.items()}, self.tokens_behind(tokens)), sent=deltas)

    def prepare(self, outer_sync: OuterSync) -> OuterStep | None:
        # 3. Outer SGD with (Nesterov) momentum.
        c = self.config
        means = self.per_param(outer_sync.exchange, DenseMean.mean)
        return nesterov_step(range(len(self.params)), self.params, means, self.momentum, c.lr, c.momentum, c.nesterov,
                             outer_sync.round_index)


def nesterov_step(positions: Sequence[int], params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                  momentum: Sequence[torch.Tensor], lr: float, m: float, nesterov: bool, round_index: int,
                  ) -> OuterStep | None:
    """Outer SGD with (Nesterov) momentum on the parameters at ``positions`` (``params``, ``grads`` and
    ``momentum`` indexed by position), out of place: buf' = m*buf + g; step = g + m*buf' (or buf'); p' = p -
    lr*step. One rounding per operation (no fused multiply-add), so every CPU computes the same bits. None if the
    new params would not be finite."""
    new_params, new_momentum, moves = {}, {}, {}
    for i in positions:
        buf = momentum[i].mul(m).add_(grads[i])
        step = buf.mul(m).add_(grads[i]) if nesterov else buf.clone()
        step.mul_(lr)
        new_params[i], new_momentum[f"momentum.{i}"], moves[i] = params[i].sub(step), buf, Move(step)
    if not finite_update(new_params.values(), round_index):
        return None
    return OuterStep(new_params, new_momentum, moves)
