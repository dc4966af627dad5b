"""DiLoCo (Douillard et al. 2023): dense mean of pseudo-gradients, outer SGD with Nesterov momentum."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from p2ploco.collective.dense import DenseMean
from p2ploco.collective.exchange import AllReduceStats, Communicator
from p2ploco.collective.sliced import SlicedExchange
from p2ploco.config import DiLoCoConfig
from p2ploco.outer.base import OuterAlgorithm, pseudo_gradients

CPU = torch.device("cpu")


class DiLoCo(OuterAlgorithm):
    def __init__(self, global_params: Sequence[torch.Tensor], config: DiLoCoConfig,
                 slices: Mapping[str, Sequence[int]] | None = None):
        super().__init__(global_params, slices)
        self.config = config
        self.momentum = [torch.zeros_like(p) for p in self.params]

    def sync(self, local_params: Sequence[torch.Tensor], comm: Communicator, round_index: int,
             start: Sequence[torch.Tensor] | None = None) -> AllReduceStats:
        # 1. Pseudo-gradient: global (or where training started) - local, a descent direction like a gradient.
        deltas = pseudo_gradients(start if start is not None else self.params, local_params, CPU)

        # 2. Its mean over the replicas of this round, every slice among its holders.
        exchange = SlicedExchange({name: DenseMean([deltas[i] for i in positions], self.config.wire_dtype)
                                   for name, positions in self.slices.items()})
        stats = comm.all_reduce(exchange, round_index, "params")
        if not stats.committed:
            return stats
        mean = [torch.empty(0)] * len(self.params)
        for name, positions in self.slices.items():
            for i, grad in zip(positions, exchange.parts[name].mean()):
                mean[i] = grad

        # 3. Outer SGD with (Nesterov) momentum: buf = m*buf + g; step = g + m*buf (or buf); p -= lr*step.
        #    One rounding per operation (no fused multiply-add), so every CPU computes the same bits.
        m, lr = self.config.momentum, self.config.lr
        for param, grad, buf in zip(self.params, mean, self.momentum):
            buf.mul_(m).add_(grad)
            step = buf.mul(m).add_(grad) if self.config.nesterov else buf.clone()
            param.sub_(step.mul_(lr))
        return stats

    def shared_state(self) -> dict[str, torch.Tensor]:
        return {f"momentum.{i}": buf for i, buf in enumerate(self.momentum)}
