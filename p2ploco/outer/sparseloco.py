"""SparseLoCo (Sarfi, Thérien, Lidin, Belilovsky 2025): error feedback, chunked Top-k, 2-bit values.

No outer momentum: the error-feedback buffer is the momentum, and it is local state of each replica.
A round that does not commit gives the buffer back exactly what it sent, so nothing is lost.
A replica that catches up from the swarm starts with an empty buffer: what it held was measured
against parameters the swarm has left behind.

With resparsified results (``outer.sparseloco.result``, the default) each reducer compresses its span's mean
again (``collective/sparse.py``), keeping up to ``result_topk`` values per chunk (all its contributions selected: a
group too large for that sends fewer values each, ``_resend``), so that a result has a bounded size whatever the
swarm's size. A reducer keeps no buffer of its own: a result is a function of the contributions alone, which anyone
holding them can check (``sync/audit.py``).

The buffers live on the training device, in chunk order ((chunks, chunk_numel) per tensor): the
pseudo-gradient is added to them through a tiled view of it, Top-k reads their rows as they are, and
what is sent is subtracted in place at the selected positions. Checkpoints hold them in the parameters'
own shapes (``local_state``). The aggregate arrives sparse and is applied at the coordinates it holds.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from p2ploco.collective.robust import UNBOUNDED, Policy
from p2ploco.collective.sliced import SlicedExchange
from p2ploco.collective.sparse import ResultLayouts, SparseExchange
from p2ploco.compression.chunking import chunk_grid
from p2ploco.compression.sparse_format import SparseLayout
from p2ploco.compression.topk import CompressedTensor, Taken, compress_
from p2ploco.config import SparseLoCoConfig
from p2ploco.outer.base import (
    CPU,
    Move,
    OuterAlgorithm,
    OuterStep,
    OuterSync,
    check_pseudo_gradient,
    check_state,
    finite_update,
)
from p2ploco.tensorfile import Deferred, made


@dataclass
class SparseSync(OuterSync):
    taken: list[Taken] = field(default_factory=list)  # what the contribution took from each error buffer


class SparseLoCo(OuterAlgorithm):
    def __init__(self, global_params: Sequence[torch.Tensor], config: SparseLoCoConfig, device: torch.device,
                 slices: Mapping[str, Sequence[int]] | None = None, policy: Policy = UNBOUNDED,
                 max_tokens: int | None = None):
        super().__init__(global_params, slices, policy, max_tokens)
        self.config, self.device = config, device
        self.grids = [chunk_grid(tuple(p.shape), config.chunk_size, config.topk) for p in self.params]
        self.layouts = {name: SparseLayout([self.grids[i] for i in positions])
                        for name, positions in self.slices.items()}
        self.result_layouts: dict[str, ResultLayouts] = {}  # per slice, how results are chunked (none: exact results)
        if config.result == "resparsified":
            caps = [chunk_grid(tuple(p.shape), config.chunk_size, config.result_topk) for p in self.params]
            self.result_layouts = {name: ResultLayouts(self.layouts[name], SparseLayout([caps[i] for i in positions]))
                                   for name, positions in self.slices.items()}
        self.feedback = [torch.zeros(g.chunks, g.chunk_numel, dtype=torch.float32, device=device) for g in self.grids]
        self.density = sum(g.k * g.chunks for g in self.grids) / sum(g.numel for g in self.grids)

    @property
    def errors(self) -> list[torch.Tensor]:
        """The error-feedback buffers in the parameters' shapes (copies)."""
        return [grid.from_chunks(buffer) for grid, buffer in zip(self.grids, self.feedback)]

    def contribute(self, local_params: Sequence[torch.Tensor], round_index: int,
                   start: Sequence[torch.Tensor] | None = None, tokens: int = 1) -> SparseSync:
        compressed, taken = self.compress(local_params, start if start is not None else self.params)
        # 4. All-reduce of every slice among its holders: per-coordinate mean over the replicas that
        #    selected it (or sum / replicas), each contribution weighted by its tokens and clipped to clip_factor x
        #    the median norm for its tokens, those pointing against the others left out (collective/robust.py);
        #    with resparsified results, each reducer sends back the Top-k of its span's mean (step 2 again).
        exchange = SlicedExchange({name: SparseExchange(self.layouts[name], [compressed[i] for i in positions],
                                                        self.config.aggregate, self.policy,
                                                        self.result_layouts.get(name),
                                                        functools.partial(self._resend, taken, positions),
                                                        self.device)
                                   for name, positions in self.slices.items()}, self.tokens_behind(tokens))
        return SparseSync(round_index, exchange, taken=taken)

    def _resend(self, taken: list[Taken], positions: Sequence[int], layout: SparseLayout) -> list[CompressedTensor]:
        """Steps 2-3 again for the tensors at ``positions`` (a slice), at ``layout``'s lower density, once the group
        is known (``ResultLayouts.shared``): each buffer takes back what it sent, then sends its Top-k at the new k.
        The same bits as if it had sent that k at first. ``taken`` (the round's) records what they took now."""
        compressed = []
        for i, grid in zip(positions, layout.grids, strict=True):
            self.feedback[i].scatter_(1, taken[i].indices, taken[i].values)
            sent, taken[i] = compress_(self.feedback[i], grid)
            compressed.append(sent)
        return compressed

    def prepare(self, outer_sync: OuterSync) -> OuterStep | None:
        return self._step(self.per_param(outer_sync.exchange, SparseExchange.updates), outer_sync.round_index)

    def give_back(self, outer_sync: OuterSync) -> None:
        """Not applied anywhere: the buffers keep what was sent, for the next round (a round is finished before
        the next one contributes, so they are put back exactly as they were)."""
        for buffer, took in zip(self.feedback, outer_sync.taken):
            buffer.scatter_(1, took.indices, took.values)

    def compress(self, local_params: Sequence[torch.Tensor], start: Sequence[torch.Tensor],
                 ) -> tuple[list[CompressedTensor], list[Taken]]:
        """Steps 1-3 of a round, on the training device: this replica's contribution, and what it took from
        the error feedback. A pseudo-gradient that is not finite raises TrainingError, which ends the node
        (the buffers, perhaps partly updated by then, are not checkpointed)."""
        alpha, beta = self.config.lr, self.config.error_decay
        scratch = torch.empty(max(g.numel for g in self.grids), dtype=torch.float32, device=self.device)
        compressed, taken = [], []
        for buffer, grid, begin, local in zip(self.feedback, self.grids, start, local_params, strict=True):
            # 1. Pseudo-gradient into the error buffer: e = beta * e + alpha * (start - local), elementwise,
            #    through a tiled view of the pseudo-gradient (no reordering copy).
            delta = torch.sub(begin.to(self.device, torch.float32), local.detach().float(),
                              out=scratch[: grid.numel].view(grid.shape))
            check_pseudo_gradient(delta, start)
            if alpha != 1.0:  # x * 1.0 == x exactly: a pass saved in the default setting
                delta.mul_(alpha)
            buffer.view(grid.tile_shape).mul_(beta).add_(grid.tiles(delta))
            # 2. Top-k of every chunk, 2-bit values. 3. The buffer keeps exactly what was not transmitted:
            #    the decoded values, as receivers see them, are subtracted where they were taken.
            sent, took = compress_(buffer, grid)
            compressed.append(sent)
            taken.append(took)
        return compressed, taken

    def _step(self, updates: list[tuple[np.ndarray, np.ndarray]], round_index: int) -> OuterStep | None:
        """5. Outer step: plain SGD on the aggregate, elementwise float32 on the CPU, at the coordinates the
        aggregate holds (elsewhere it is zero and the parameters keep their bits), into new tensors. None if it
        would make the global params non-finite."""
        alpha = self.config.lr
        where = [torch.from_numpy(index) for index, _ in updates]
        # x * 1.0 == x exactly: in the default setting the aggregate's values are the step, with no copy of them
        steps = [torch.from_numpy(values) if alpha == 1.0 else torch.from_numpy(values).mul(alpha)
                 for _, values in updates]
        new_params = {}
        for i, (param, index, step) in enumerate(zip(self.params, where, steps)):
            # one tensor's new values at a time: a step that would not be finite is dropped before any is kept
            values = param.view(-1)[index] - step
            if not finite_update([values], round_index):
                return None
            flat = param.view(-1).clone()
            flat[index] = values
            new_params[i] = flat.view(param.shape)
        return OuterStep(new_params, {}, {i: Move(step, index) for i, (index, step) in enumerate(zip(where, steps))})

    def local_state(self) -> dict[str, torch.Tensor]:
        """The error-feedback buffers in the parameters' shapes, as checkpoints hold them (copies)."""
        return {f"error.{i}": error for i, error in enumerate(self.errors)}

    def local_state_with(self, in_flight: OuterSync | None) -> dict[str, Deferred]:
        """Each buffer in its parameter's shape, on the CPU (what an ``in_flight`` round took given back), converted
        when it is written: one buffer's copy at a time, where the whole set is 4 bytes a parameter."""
        taken = in_flight.taken if in_flight is not None else [None] * len(self.grids)
        return {f"error.{i}": Deferred(grid.shape, torch.float32, functools.partial(self._error, i, took))
                for i, (grid, took) in enumerate(zip(self.grids, taken, strict=True))}

    def _error(self, i: int, taken: Taken | None) -> torch.Tensor:
        """Buffer ``i`` in its parameter's shape on the CPU (a copy), with what ``taken`` took from it put back."""
        grid, buffer = self.grids[i], self.feedback[i]
        if taken is not None:
            buffer = buffer.clone().scatter_(1, taken.indices, taken.values)
        error = torch.empty(grid.shape, dtype=torch.float32, device=CPU)
        grid.tiles(error).copy_(buffer.view(grid.tile_shape))
        return error

    def load_local_state(self, state: Mapping[str, torch.Tensor | Deferred]) -> None:
        """The buffers of a checkpoint. A reducer's buffer, which checkpoints written before reducers kept none hold
        (``reducer_error.*``: a residual of results), is dropped."""
        check_state({f"error.{i}": torch.empty(grid.shape, device="meta") for i, grid in enumerate(self.grids)},
                    {k: v for k, v in state.items() if not k.startswith("reducer_error.")})
        self.reset_local_state()
        for i, grid in enumerate(self.grids):
            self.feedback[i].view(grid.tile_shape).copy_(grid.tiles(made(state[f"error.{i}"])))

    def reset_local_state(self) -> None:
        for buffer in self.feedback:
            buffer.zero_()
