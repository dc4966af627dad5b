"""Each rank's share of an inner step: data parallel over the node's local ranks (DDP; sharded, FSDP2, in
``sharded.py``).

The node's step trains on ``ranks x inner.grad_accum`` micro-batches of its shard: rank r takes those a one-rank
node with ``ranks x grad_accum`` micro-batches would take in positions ``r * grad_accum ...`` of the step, so the
node's step is that node's step, summed in another order (DDP sums the ranks' gradients; one process adds its
micro-batches one by one). The loss and the budget's stop votes are summed over the ranks; the gradient norm is
taken of the averaged gradients, which every rank holds alike.
"""

from __future__ import annotations

import contextlib
from abc import abstractmethod
from collections.abc import Sequence

import torch
from torch.nn.parallel import DistributedDataParallel

from p2ploco.data import ShardSampler
from p2ploco.inner import GradientSource, autocast_for, on_device
from p2ploco.ranks.processes import LocalRanks


class RankBatches(GradientSource):
    """A local rank's share of each step's micro-batches, through ``forward``; the ranks' gradients are averaged
    with the last micro-batch's backward (``gradient_sync``)."""

    forward: torch.nn.Module

    def __init__(self, sampler: ShardSampler, micro_batches: int, device: torch.device, ranks: LocalRanks):
        self.sampler, self.micro_batches, self.device, self.ranks = sampler, micro_batches, device, ranks
        self.tokens_per_step = ranks.world * micro_batches * sampler.batch_size * sampler.seq_len

    @abstractmethod
    def gradient_sync(self, on: bool) -> contextlib.AbstractContextManager:
        """Where a micro-batch's backward runs: averaging the ranks' gradients (``on``) or only adding its own."""

    def accumulate(self, step: int) -> float:
        losses = []
        first = (step * self.ranks.world + self.ranks.rank) * self.micro_batches
        with self.ranks.failures():
            for micro in range(self.micro_batches):
                inputs, targets = (on_device(t, self.device) for t in self.sampler.batch(first + micro))
                with self.gradient_sync(micro == self.micro_batches - 1), autocast_for(self.device):
                    loss = self.forward(inputs, targets=targets) / self.micro_batches
                loss.backward()
                losses.append(loss.detach())
        return float(torch.stack(losses).sum())


class DataParallelBatches(RankBatches):
    def __init__(self, forward: torch.nn.Module, sampler: ShardSampler, micro_batches: int, device: torch.device,
                 ranks: LocalRanks):
        """``forward``: the model, or its compiled forward (``training.compile``); wrapped in DDP over ``ranks``."""
        super().__init__(sampler, micro_batches, device, ranks)
        with ranks.failures():  # DDP's start broadcasts rank 0's params and buffers to every rank
            self.forward = DistributedDataParallel(forward, device_ids=[device] if device.type == "cuda" else None,
                                                   process_group=ranks.train, forward_sync_buffers=False)

    def gradient_sync(self, on: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if on else self.forward.no_sync()

    def reduce(self, step: int, values: Sequence[float]) -> list[float]:
        """[loss, squared norm, stop votes]: the loss is the mean of the ranks', the votes their sum; the norm is
        every rank's own (of the averaged gradients)."""
        loss_share, squared_norm, stop_vote = values
        summed = self.ranks.sum_(torch.tensor([loss_share, stop_vote], dtype=torch.float64, device=self.device))
        return [float(summed[0]) / self.ranks.world, squared_norm, float(summed[1])]

