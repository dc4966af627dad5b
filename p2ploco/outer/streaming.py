"""Streaming DiLoCo (Douillard et al. 2025): fragments synced at staggered inner steps, overlapped, 4-bit.

The parameters come as P named slices ``fragment0 .. fragment{P-1}`` (``p2ploco/slices.py``: strided groups
of blocks, the embedding with fragment 0, the final norm and head with fragment P - 1). A round is a period
of H inner steps; within it, fragment p (``schedules/streaming.py``, between inner steps):

1. after inner step (p + 1)·H/P - tau: its pseudo-gradient, global - local on the fragment alone, goes out
   in E3M0 4-bit floats (``collective/fp4.py``; float32 with ``bits: 32``) and its all-reduce is started
   in the background (``OuterSync.start``: the communicator's non-blocking all-reduce), named after the
   fragment; training goes on;
2. by inner step (p + 1)·H/P: the all-reduce ends; the reducers summed in float32 and every peer decodes
   the same bytes, so the outer step, SGD with Nesterov momentum on the fragment's params and momentum alone
   (DiLoCo's ``nesterov_step``, prepared on the schedule's background thread as soon as the aggregate is in
   and taken after that inner step), leaves every peer bit-identical on the fragment;
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
from p2ploco.collective.exchange import Exchange
from p2ploco.collective.fp4 import E3M0Mean
from p2ploco.collective.robust import UNBOUNDED, Policy
from p2ploco.collective.sliced import SlicedExchange
from p2ploco.config import StreamingConfig
from p2ploco.device import to_host
from p2ploco.outer.base import OuterAlgorithm, OuterStep, OuterSync, pseudo_gradients
from p2ploco.outer.diloco import nesterov_step


class StreamingDiLoCo(OuterAlgorithm):
    shared_kinds = ("momentum",)

    def __init__(self, global_params: Sequence[torch.Tensor], config: StreamingConfig,
                 slices: Mapping[str, Sequence[int]] | None = None, policy: Policy = UNBOUNDED,
                 max_tokens: int | None = None):
        """``slices``: the fragments, in order (one slice: a single fragment)."""
        super().__init__(global_params, slices, policy, max_tokens)
        self.config = config
        self.momentum = [torch.zeros_like(p) for p in self.params]
        self.fragments = list(self.slices)
        # the fewest steps a round may plan: each fragment's sync lands before the next one starts (Config holds H
        # to it)
        self.fewest_steps = len(self.fragments) * (config.delay + 1)

    def schedule_for(self, steps: int) -> dict[str, tuple[int, int]]:
        """Fragment -> (inner steps done when its all-reduce starts, when it is applied) in a round of ``steps``
        (at least ``fewest_steps``): applied after ⌊(p + 1)·steps/P⌋, at least ⌊steps/P⌋ > delay steps after the
        one before, so each lands before the next starts. A peer that trains fewer steps than H (its round
        budget) syncs each fragment as far into the round as the others do."""
        applied = [(p + 1) * steps // len(self.fragments) for p in range(len(self.fragments))]
        return {name: (apply - self.config.delay, apply) for name, apply in zip(self.fragments, applied)}

    def contribute(self, local_params: Sequence[torch.Tensor], round_index: int,
                   start: Sequence[torch.Tensor] | None = None, tokens: int = 1) -> OuterSync:
        """Every fragment at once (one all-reduce for the whole round; the node syncs fragment by fragment)."""
        return self.contribute_fragments(self.fragments, local_params, round_index, start, tokens)

    def contribute_fragments(self, fragments: Sequence[str], local_params: Sequence[torch.Tensor], round_index: int,
                             start: Sequence[torch.Tensor] | None = None, tokens: int = 1) -> OuterSync:
        """The pseudo-gradient of ``fragments`` alone (global, or ``start``, minus local), as they are sent,
        weighted by ``tokens`` (the round's planned steps' tokens: a peer that trains fewer steps weighs less); a
        fragment not applied is not carried (``merge`` follows the global fragment)."""
        begin = start if start is not None else self.params
        positions = [i for name in fragments for i in self.slices[name]]
        deltas = dict(zip(positions, to_host(pseudo_gradients([begin[i] for i in positions],
                                                              [local_params[i] for i in positions]))))
        return OuterSync(round_index, SlicedExchange({name: self._exchange([deltas[i] for i in self.slices[name]])
                                                       for name in fragments}, max(1, tokens)))

    def _exchange(self, deltas: list[torch.Tensor]) -> Exchange:
        if self.config.bits == 32:
            return DenseMean(deltas, "float32", self.policy)
        return E3M0Mean(deltas, self.policy)

    def prepare(self, outer_sync: OuterSync) -> OuterStep | None:
        """Nesterov momentum on the fragments the round synced, nothing else."""
        positions = [i for name in outer_sync.exchange.parts for i in self.slices[name]]
        means = dict(zip(positions, (mean for part in outer_sync.exchange.parts.values() for mean in part.mean())))
        c = self.config
        return nesterov_step(positions, self.params, means, self.momentum, c.lr, c.momentum, True,
                             outer_sync.round_index)

    def merge(self, local_params: Sequence[torch.Tensor], fragments: Sequence[str]) -> None:
        """local <- alpha·local + (1 - alpha)·global on ``fragments`` (exactly global when alpha is 0)."""
        with torch.no_grad():
            for i in (i for name in fragments for i in self.slices[name]):
                local_params[i].lerp_(self.params[i].to(local_params[i].device), 1.0 - self.config.alpha)
