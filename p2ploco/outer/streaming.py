"""Streaming DiLoCo (Douillard et al. 2025): fragments synced at staggered inner steps, overlapped, 4-bit.

The parameters come as P named slices ``fragment0 .. fragment{P-1}`` (``pipeline/slices.py``: strided groups
of blocks, the embedding with fragment 0, the final norm and head with fragment P - 1). A round is a period
of H inner steps; within it, fragment p (``FragmentSyncs``, driven by the hook between inner steps):

1. after inner step (p + 1)·H/P - tau: its pseudo-gradient, global - local on the fragment alone, goes out
   in E3M0 4-bit floats (``collective/fp4.py``; float32 with ``bits: 32``) and its all-reduce is started
   in the background (``OuterRound.start``: the communicator's non-blocking all-reduce), named after the
   fragment; training goes on;
2. after inner step (p + 1)·H/P: the all-reduce is waited for; the reducers summed in float32 and every
   peer decodes the same bytes, so the outer step, SGD with Nesterov momentum on the fragment's params and
   momentum alone (DiLoCo's ``nesterov_step``), leaves every peer bit-identical on the fragment;
3. the local fragment becomes alpha·local + (1 - alpha)·global: the local copy keeps part of the tau steps
   it trained meanwhile (alpha = 0: it restarts from the global fragment, as DiLoCo does).

So the peak traffic of a sync is that of one fragment, ~1/P of the model, and every sync ends within its
round: at a round's end nothing is in flight, the global params of all fragments are what every peer of
the round holds, and joiners, checkpoints and catch-up see rounds exactly as with DiLoCo (the momentum is
shared state, by parameter). The local params are not reset at a round's end (they carry on from where
training is); only adopting the swarm's state or a checkpoint restarts them from the global ones. With
P = 1, tau = 0, alpha = 0 and float32 values this is DiLoCo, bit for bit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from p2ploco.collective.dense import DenseMean
from p2ploco.collective.exchange import AllReduceStats, Communicator, Exchange
from p2ploco.collective.fp4 import E3M0Mean
from p2ploco.collective.sliced import SlicedExchange
from p2ploco.config import StreamingConfig
from p2ploco.outer.base import OuterAlgorithm, OuterRound, pseudo_gradients
from p2ploco.outer.diloco import nesterov_step

CPU = torch.device("cpu")


class StreamingDiLoCo(OuterAlgorithm):
    def __init__(self, global_params: Sequence[torch.Tensor], config: StreamingConfig, inner_steps: int,
                 slices: Mapping[str, Sequence[int]] | None = None, clip_factor: float = 0.0):
        """``slices``: the fragments, in order (one slice: a single fragment); ``inner_steps``: H, the period."""
        super().__init__(global_params, slices)
        self.config, self.clip_factor = config, clip_factor
        self.momentum = [torch.zeros_like(p) for p in self.params]
        self.fragments = list(self.slices)
        width = inner_steps // len(self.fragments)
        # fragment -> (inner steps done when its all-reduce starts, when it is applied)
        self.schedule = {name: ((p + 1) * width - config.delay, (p + 1) * width)
                         for p, name in enumerate(self.fragments)}

    def contribute(self, local_params: Sequence[torch.Tensor], round_index: int,
                   start: Sequence[torch.Tensor] | None = None) -> OuterRound:
        """Every fragment at once (one all-reduce for the whole round; the node syncs fragment by fragment)."""
        return self.contribute_fragments(self.fragments, local_params, round_index, start)

    def contribute_fragments(self, fragments: Sequence[str], local_params: Sequence[torch.Tensor], round_index: int,
                             start: Sequence[torch.Tensor] | None = None) -> OuterRound:
        """The pseudo-gradient of ``fragments`` alone (global, or ``start``, minus local), as they are sent."""
        begin = start if start is not None else self.params
        positions = [i for name in fragments for i in self.slices[name]]
        deltas = dict(zip(positions, pseudo_gradients([begin[i] for i in positions],
                                                      [local_params[i] for i in positions], CPU)))
        return OuterRound(round_index, SlicedExchange({name: self._exchange([deltas[i] for i in self.slices[name]])
                                                       for name in fragments}))

    def _exchange(self, deltas: list[torch.Tensor]) -> Exchange:
        if self.config.bits == 32:
            return DenseMean(deltas, "float32", self.clip_factor)
        return E3M0Mean(deltas, self.clip_factor)

    def step(self, outer_round: OuterRound, follow: Sequence[torch.Tensor] = ()) -> bool:
        """Nesterov momentum on the fragments the round synced, nothing else."""
        positions, means = [], []
        for name, part in outer_round.exchange.parts.items():
            positions += self.slices[name]
            means += part.mean()
        c = self.config
        return nesterov_step([self.params[i] for i in positions], means, [self.momentum[i] for i in positions],
                             c.lr, c.momentum, True, outer_round.round_index,
                             [follow[i] for i in positions] if follow else (), self.count_step)

    def merge(self, local_params: Sequence[torch.Tensor], fragments: Sequence[str]) -> None:
        """local <- alpha·local + (1 - alpha)·global on ``fragments`` (exactly global when alpha is 0)."""
        with torch.no_grad():
            for i in (i for name in fragments for i in self.slices[name]):
                local_params[i].lerp_(self.params[i].to(local_params[i].device), 1.0 - self.config.alpha)

    def shared_state(self) -> dict[str, torch.Tensor]:
        return {f"momentum.{i}": buf for i, buf in enumerate(self.momentum)}


class FragmentSyncs:
    """The fragment syncs of one round on one replica: ``after_step(h)`` runs between inner steps (h done) and
    starts or lands the fragments the schedule names for h; ``stats`` sums them up once the round is over."""

    def __init__(self, outer: StreamingDiLoCo, local_params: Sequence[torch.Tensor], comm: Communicator,
                 round_index: int):
        self.outer, self.local, self.comm, self.round_index = outer, list(local_params), comm, round_index
        self.in_flight: dict[str, OuterRound] = {}
        self.done: dict[str, AllReduceStats] = {}

    def after_step(self, steps_done: int) -> None:
        for name, (start, apply) in self.outer.schedule.items():
            if steps_done == start:
                sync = self.outer.contribute_fragments([name], self.local, self.round_index)
                sync.start(self.comm, name)
                self.in_flight[name] = sync
            if steps_done == apply:
                stats = self.outer.finish(self.in_flight.pop(name))
                if stats.committed:
                    self.outer.merge(self.local, [name])
                self.done[name] = stats

    def stats(self) -> AllReduceStats:
        """The round's syncs as one: bytes, parameters and seconds summed, applied only if every fragment was,
        the smallest group, redone if any was, every failure; ``sync_bytes`` lists each fragment's traffic (sent +
        received)."""
        if set(self.done) != set(self.outer.fragments):
            raise RuntimeError(f"round {self.round_index} ended with fragments {sorted(self.in_flight)} unsynced")
        syncs = [self.done[name] for name in self.outer.fragments]
        smallest = min(syncs, key=lambda s: len(s.peers))
        return AllReduceStats(
            list(smallest.peers), sum(s.bytes_sent for s in syncs), sum(s.bytes_received for s in syncs),
            sum(s.dense_fp32_bytes for s in syncs), sum(s.contribution_bytes for s in syncs),
            sum(s.params for s in syncs), sorted({p for s in syncs for p in s.dropped}), sum(s.seconds for s in syncs),
            committed=all(s.committed for s in syncs), excluded=any(s.excluded for s in syncs),
            clipped=sorted({p for s in syncs for p in s.clipped}),
            sync_bytes=[s.bytes_sent + s.bytes_received for s in syncs], attempts=max(s.attempts for s in syncs),
            failures=[failure for s in syncs for failure in s.failures])
