"""LoCo (Xie et al. 2024): error-compensated low-bit pseudo-gradients, with DiLoCo's outer step.

Every hop that quantizes adds back a moving average of what its past quantizations dropped:
g̃ = g + e; q = Q(g̃) (``outer.loco.bits`` per value, one scale per ``group_size`` values);
e ← β·e + (1 − β)·(g̃ − deQ(q)). The sender does it with its pseudo-gradient; the reducer of each span
does it again with the mean it sends back (``collective/lowbit.py``), with a buffer of its own. The
decoded aggregate then drives Nesterov momentum exactly as in DiLoCo (``outer/diloco.py``).

Both buffers are local state of this replica: checkpointed, reset when the node takes newer global
parameters from peers (they measure errors against parameters the swarm has left), and reset at the
start of every round whose index is a multiple of ``reset_every`` (the swarm's round index, so the
schedule needs no state of its own). A round that does not commit leaves them as the round found them
(after a scheduled reset): what it would have changed referred to an update nobody applied. The
momentum is shared state, downloaded by joiners, as DiLoCo's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from p2ploco.collective.lowbit import LowBitMean
from p2ploco.collective.robust import UNBOUNDED, Policy
from p2ploco.collective.sliced import SlicedExchange
from p2ploco.compression.blockwise import BlockLayout, compensate
from p2ploco.config import LoCoConfig
from p2ploco.device import to_host
from p2ploco.outer.base import OuterAlgorithm, OuterStep, OuterSync, pseudo_gradients
from p2ploco.outer.diloco import nesterov_step


@dataclass
class LoCoSync(OuterSync):
    errors: dict[str, torch.Tensor] = field(default_factory=dict)  # per slice, the sender's buffer if applied


class LoCo(OuterAlgorithm):
    shared_kinds = ("momentum",)

    def __init__(self, global_params: Sequence[torch.Tensor], config: LoCoConfig, device: torch.device,
                 slices: Mapping[str, Sequence[int]] | None = None, policy: Policy = UNBOUNDED,
                 max_tokens: int | None = None):
        super().__init__(global_params, slices, policy, max_tokens)
        self.config, self.device = config, device
        self.momentum = [torch.zeros_like(p) for p in self.params]
        self.layouts = {name: BlockLayout([self.params[i].shape for i in positions], config.group_size)
                        for name, positions in self.slices.items()}
        # Per slice, its values concatenated in parameter order: what this replica did not transmit as a
        # sender, and what it did not transmit as the reducer of a span (its last span's coordinates).
        self.errors = {name: torch.zeros(layout.numel) for name, layout in self.layouts.items()}
        self.reducer_errors = {name: torch.zeros(layout.numel) for name, layout in self.layouts.items()}

    def contribute(self, local_params: Sequence[torch.Tensor], round_index: int,
                   start: Sequence[torch.Tensor] | None = None, tokens: int = 1) -> LoCoSync:
        c = self.config
        # 0. Rounds whose index is a multiple of reset_every start with empty buffers.
        if round_index % c.reset_every == 0:
            self.reset_local_state()

        # 1. Pseudo-gradient: global (or where training started) - local, on the training device, then the host;
        #    plus that of rounds not applied.
        deltas = self.carried(to_host(pseudo_gradients(start if start is not None else self.params, local_params)))

        # 2. Per slice: g~ = g + e; q = Q(g~); e' = beta*e + (1 - beta)*(g~ - deQ(q)), kept if the round commits.
        exchanges, errors = {}, {}
        for name, positions in self.slices.items():
            layout = self.layouts[name]
            flat = torch.cat([deltas[i].reshape(-1) for i in positions])
            quantized, errors[name] = compensate(flat, self.errors[name], c.beta, layout.lengths, c.bits)
            exchanges[name] = LowBitMean(layout, c.bits, quantized, self.reducer_errors[name], c.beta,
                                         self.policy)

        # 3. All-reduce of every slice among its holders (``OuterSync.start``): each span's reducer bounds the
        #    contributions, averages them in float32 and re-quantizes the mean with its own buffer; everybody
        #    decodes the same bytes.
        return LoCoSync(round_index, SlicedExchange(exchanges, self.tokens_behind(tokens)), sent=deltas, errors=errors)

    def prepare(self, outer_sync: OuterSync) -> OuterStep | None:
        # 4. DiLoCo's outer step on the decoded aggregate: SGD with Nesterov momentum.
        c = self.config
        means = self.per_param(outer_sync.exchange, LowBitMean.mean)
        return nesterov_step(range(len(self.params)), self.params, means, self.momentum, c.lr, c.momentum, True,
                             outer_sync.round_index)

    def take(self, outer_sync: OuterSync, step: OuterStep | None, alongside: Sequence[torch.Tensor] = ()) -> None:
        super().take(outer_sync, step, alongside)
        if step is None:
            return
        assert isinstance(outer_sync, LoCoSync)
        # 5. Applied: keep the new buffers, the sender's and the reducer's for the span it reduced.
        for name, part in outer_sync.exchange.parts.items():
            self.errors[name].copy_(outer_sync.errors[name])
            if part.reduced is not None:
                span = part.reduced.elements
                self.reducer_errors[name][span.start : span.stop] = part.reduced.error

    def local_state(self) -> dict[str, torch.Tensor]:
        """Per-parameter views of the flat buffers (live: loading into them loads the buffers)."""
        state = {}
        for name, positions in self.slices.items():
            for kind, buffers in (("error", self.errors), ("reducer_error", self.reducer_errors)):
                for i, view in zip(positions, self.layouts[name].split(buffers[name])):
                    state[f"{kind}.{i}"] = view
        return state
