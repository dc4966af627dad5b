"""SparseLoCo (Sarfi, Thérien, Lidin, Belilovsky 2025): error feedback, chunked Top-k, 2-bit values.

No outer momentum: the error-feedback buffer is the momentum, and it is local state of each replica.
A round that does not commit gives the buffer back what it would have sent, so nothing is lost.
A replica that catches up from the swarm starts with an empty buffer: what it held was measured
against parameters the swarm has left behind.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from p2ploco.collective.exchange import AllReduceStats, Communicator
from p2ploco.collective.sliced import SlicedExchange
from p2ploco.collective.sparse import SparseExchange
from p2ploco.compression.chunking import chunk_grid
from p2ploco.compression.sparse_format import SparseLayout
from p2ploco.compression.topk import compress
from p2ploco.config import SparseLoCoConfig
from p2ploco.outer.base import OuterAlgorithm, finite_step, pseudo_gradients


class SparseLoCo(OuterAlgorithm):
    def __init__(self, global_params: Sequence[torch.Tensor], config: SparseLoCoConfig, device: torch.device,
                 slices: Mapping[str, Sequence[int]] | None = None, clip_factor: float = 0.0):
        super().__init__(global_params, slices)
        self.config, self.device, self.clip_factor = config, device, clip_factor
        self.grids = [chunk_grid(tuple(p.shape), config.chunk_size, config.topk) for p in self.params]
        self.layouts = {name: SparseLayout([self.grids[i] for i in positions])
                        for name, positions in self.slices.items()}
        self.errors = [torch.zeros(p.shape, dtype=torch.float32, device=device) for p in self.params]
        self.density = sum(g.k * g.chunks for g in self.grids) / sum(g.numel for g in self.grids)

    def sync(self, local_params: Sequence[torch.Tensor], comm: Communicator, round_index: int,
             start: Sequence[torch.Tensor] | None = None) -> AllReduceStats:
        alpha, beta = self.config.lr, self.config.error_decay
        deltas = pseudo_gradients(start if start is not None else self.params, local_params, self.device)
        compressed, sent_values = [], []
        for error, delta, grid in zip(self.errors, deltas, self.grids):
            # 1. Pseudo-gradient into the error buffer: e = beta * e + alpha * (global - local).
            error.mul_(beta).add_(delta.mul_(alpha))
            # 2. Top-k of every chunk, 2-bit values.
            sent, decoded = compress(error, grid)
            # 3. The buffer keeps exactly what was not transmitted (the decoded values, as receivers see them).
            error.sub_(decoded)
            compressed.append(sent)
            sent_values.append(decoded)

        # 4. All-reduce of every slice among its holders: per-coordinate mean over the replicas that
        #    selected it (or sum / replicas), each contribution clipped to clip_factor x the median norm.
        exchange = SlicedExchange({name: SparseExchange(self.layouts[name], [compressed[i] for i in positions],
                                                        self.config.aggregate, self.clip_factor)
                                   for name, positions in self.slices.items()})
        stats = comm.all_reduce(exchange, round_index, "params")
        updates = [u.mul_(alpha) for u in self.per_param(exchange, SparseExchange.aggregate)] if stats.committed else []
        if not stats.committed or not finite_step(self.params, updates, round_index):
            for error, decoded in zip(self.errors, sent_values):
                error.add_(decoded)  # not applied anywhere: keep it for the next round
            stats.committed = False
            return stats

        # 5. Outer step: plain SGD on the aggregate, elementwise float32 on the CPU.
        for param, update in zip(self.params, updates):
            param.sub_(update)
        return stats

    def local_state(self) -> dict[str, torch.Tensor]:
        return {f"error.{i}": e for i, e in enumerate(self.errors)}
