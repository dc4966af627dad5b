"""A peer's training state: the slices of the model it holds, their global parameters and outer algorithm,
and the inner trainer that moves its local copy.

A *full replica* holds the whole model and computes its gradients from its own batches; a *stage*
holds one pipeline stage and computes its gradients together with the other stages of its group (its
``GradientSource``, ``p2ploco.inner``). To round schedules, nodes and the in-process harnesses both are the
same :class:`Worker` (``p2ploco.build`` makes either).

A *constrained* worker (a stage of a subspace-compressed group, or any replica with
``pipeline.compression: uniform``) trains a projection of the global parameters: its residual-writing
weights are projected onto span(U) whenever it loads new global parameters, and its pseudo-gradient
is measured from that projection, so it reports its own training and not the projection
(docs/pipeline.md explains why the dropped part is not put into the error-feedback buffer).

The global state is handed out as :class:`Published` copies. The outer algorithm never writes its global
tensors in place (``outer/base.py``), so the copy its last step left is whole and stays so: serving peers that
catch up, evaluation, checkpoints and the peer's record read it, while a round schedule prepares the next step
on another thread. When the state moves is the round schedule's business (``p2ploco.schedules``); this
object only holds it.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

from p2ploco.checkpoint import Checkpoint
from p2ploco.config import Config
from p2ploco.data import Batch
from p2ploco.errors import CheckpointError, SwarmError
from p2ploco.inner import Constraint, InnerTrainer
from p2ploco.metrics import state_digest
from p2ploco.model import Transformer
from p2ploco.outer import build_outer
from p2ploco.outer.base import OuterStep, OuterSync, split_key
from p2ploco.slices import group_by_slice
from p2ploco.swarm.state import Snapshot
from p2ploco.tensorfile import Deferred, made


@dataclass(frozen=True)
class Published:
    """A fully stepped global state: the parameters and the shared outer state, in the outer algorithm's order
    and keys, with their hashes. Its tensors are never written."""

    params: tuple[torch.Tensor, ...]
    shared: dict[str, torch.Tensor]  # ``kind.position`` -> tensor
    slice_digest: dict[str, str]  # slice -> ``metrics.state_digest`` of its params and shared state
    params_digest: str  # of every slice: the slice's own hash when there is one


class Worker:
    def __init__(self, config: Config, device: torch.device, model: Transformer, inner: InnerTrainer,
                 constraint: Constraint | None):
        """``model``: the local params the outer step reads and writes, on ``device``; ``inner``: what trains them,
        the same model, or (a node's ranks sharding it, ``p2ploco.ranks.sharded``) shards of a copy, which its
        other ranks bring back into ``model`` when asked (``local_params``)."""
        c = config
        self.device, self.model, self.constraint, self.inner = device, model, constraint, inner
        self.names = [name for name, _ in model.named_parameters()]
        streaming = c.outer.algorithm == "streaming"
        self.slices = group_by_slice(self.names, c.model, c.pipeline.stages,
                                     c.outer.streaming.fragments if streaming else 0)
        self.outer = build_outer(c.outer, list(model.parameters()), device, self.slices,
                                 c.max_contribution_tokens)
        # Held while the outer algorithm's local state changes (a contribution, a step taken, a round given back),
        # which a round schedule may do on its background thread: a checkpoint copies that state under it.
        self.lock = threading.Lock()
        self.published = self.state_of(self.outer.params, self.outer.shared_state())
        # Each slice's hash as the run's seed makes it: a state nobody trained (``consensus.ranked_states``)
        self.seed_digest = dict(self.published.slice_digest)
        self.load_into_model()

    @property
    def params_digest(self) -> str:
        return self.published.params_digest

    @property
    def slice_digest(self) -> dict[str, str]:
        return self.published.slice_digest

    def state_of(self, params: Sequence[torch.Tensor], shared: dict[str, torch.Tensor],
                 slice_digest: dict[str, str] | None = None) -> Published:
        """``params`` and ``shared`` as a published state, hashed (per slice, unless ``slice_digest`` already says);
        reads nothing else, so any thread may call it."""
        if slice_digest is None:
            slice_digest = {name: state_digest(*self._named(params, shared, positions))
                            for name, positions in self.slices.items()}
        whole = (next(iter(slice_digest.values())) if len(slice_digest) == 1 else
                 hashlib.sha256(";".join(f"{k}={v}" for k, v in slice_digest.items()).encode()).hexdigest())
        return Published(tuple(params), dict(shared), dict(slice_digest), whole)

    def after(self, step: OuterStep) -> Published:
        """The published state as ``step`` will leave it once taken (hashed here, on the calling thread)."""
        return self.state_of(*self._stepped(step))

    def slice_hash(self, step: OuterStep, slice_name: str) -> str:
        """The hash of ``slice_name``'s state once ``step`` is taken (on the calling thread)."""
        return state_digest(*self._named(*self._stepped(step), self.slices[slice_name]))

    def refresh_published(self) -> None:
        """The published state <- the outer algorithm's global state as it is now (hashed)."""
        self.published = self.state_of(self.outer.params, self.outer.shared_state())

    def _stepped(self, step: OuterStep) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
        params = list(self.outer.params)
        for i, value in step.params.items():
            params[i] = value
        return params, {**self.outer.shared_state(), **step.shared}

    def _named(self, params: Sequence[torch.Tensor], shared: dict[str, torch.Tensor], members: Sequence[int],
               ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The params at positions ``members`` and the shared state that goes with them, named by parameter
        (``momentum.blocks.3.mlp.up.weight``), whatever holds them."""
        wanted = set(members)
        named_shared = {}
        for key, tensor in shared.items():
            kind, i = split_key(key)
            if i in wanted:
                named_shared[f"{kind}.{self.names[i]}"] = tensor
        return {self.names[i]: params[i] for i in members}, named_shared

    def state_bytes(self, slice_name: str) -> int:
        """The bytes of the tensors of ``slice_name``'s global state (params and shared outer state)."""
        params, shared = self._named(self.published.params, self.published.shared, self.slices[slice_name])
        return sum(t.numel() * t.element_size() for t in [*params.values(), *shared.values()])

    def snapshots(self, round_index: int) -> list[Snapshot]:
        """The published state of each slice this worker holds, as the state of ``round_index``, for peers catching
        up (its tensors are never written, so the snapshots need no copies)."""
        state = self.published
        return [Snapshot(round_index, name, *self._named(state.params, state.shared, members),
                         state.slice_digest[name]) for name, members in self.slices.items()]

    def local_params(self) -> list[torch.Tensor]:
        """The model's params as the inner steps left them (gathered from the ranks' shards first where a node's
        ranks shard it): what a round's pseudo-gradient is measured from; a write to them is what the next step
        starts from."""
        if self.inner.other_ranks is not None:
            self.inner.other_ranks.gather()
        return list(self.model.parameters())

    @torch.no_grad()
    def evaluate(self, batches: list[Batch]) -> float:
        """The eval loss of the published global params (projected where constrained), lent to the model: its
        own local params are put back after. A model that holds them already (after a blocking round, which loads
        them: ``schedules/blocking.py``) is evaluated as it is, with no copy of its params (4 bytes a parameter)."""
        params = self.local_params()
        if self.constraint is None and all(p.device == v.device and torch.equal(p, v)
                                           for p, v in zip(params, self.published.params)):
            loss = self.inner.evaluate(batches)
            self.model.train()
            return loss
        local = [p.detach().clone() for p in params]
        self._load(self.published.params)
        loss = self.inner.evaluate(batches)
        for param, mine in zip(params, local):
            param.copy_(mine)
        self.model.train()
        return loss

    def load_into_model(self) -> None:
        """local <- published global params (projected onto span(U) where constrained): the next inner steps
        start here."""
        self._load(self.published.params)

    @torch.no_grad()
    def _load(self, values: Sequence[torch.Tensor]) -> None:
        params = list(self.model.parameters())
        for param, value in zip(params, values):
            param.copy_(value)
        if self.constraint is not None:
            self.constraint.project_(params)

    def start_params(self) -> list[torch.Tensor]:
        """Where inner steps that start from the published global params are measured from: those params, or, for
        a constrained worker, their projection (on the training device)."""
        params = list(self.published.params)
        return self.constraint.projected(params, self.device) if self.constraint is not None else params

    def adopt(self, snapshots: dict[str, Snapshot], keep_local: bool = False) -> None:
        """Take the swarm's state of every slice this worker holds; the model starts over from the new global
        params. ``keep_local``: this peer missed a round or two and keeps its local outer state, rebased (error
        feedback, or the carry, holds its work no aggregate has applied yet: a difference of params, valid on the
        new ones; docs/design.md, "Slow peers"); else that state refers to params the swarm has moved far past and
        is reset. (A round in flight is the schedule's to keep or drop: ``RoundSchedule.adopt``.)"""
        if set(snapshots) != set(self.slices):
            raise SwarmError(f"fetched slices {sorted(snapshots)} but this worker holds {sorted(self.slices)}")
        params = {name: t for snapshot in snapshots.values() for name, t in snapshot.params.items()}
        given = {name: t for snapshot in snapshots.values() for name, t in snapshot.shared.items()}
        if set(params) != set(self.names):
            raise SwarmError("fetched state does not fit this model (parameter names differ)")
        with self.lock:
            try:
                shared = {}
                for key in self.outer.shared_state():
                    kind, i = split_key(key)
                    shared[key] = given[f"{kind}.{self.names[i]}"]
                self.outer.load_params([params[name] for name in self.names])
                self.outer.load_shared_state(shared)
            except (KeyError, ValueError, RuntimeError) as e:
                raise SwarmError(f"fetched state does not fit this model and algorithm: {e!r}") from None
            if not keep_local:
                self.outer.reset_local_state()
        self.refresh_published()
        self.load_into_model()

    def checkpoint(self, round_index: int, extras: dict[str, Any] | None = None,
                   in_flight: OuterSync | None = None) -> Checkpoint:
        """All this worker needs to continue, as of the published state; ``extras``: what its role adds (a stage's
        slot). A round ``in_flight`` (contributed, not taken) has not moved the published state: the local outer
        state and the work no aggregate applied (``Outer.unapplied_work``) are saved as if it were not applied.

        The local outer state (4 bytes a parameter) is not copied here: each of its tensors is a ``Deferred``, copied
        under the lock when it is written, so that one tensor's copy exists at a time. Write the checkpoint's local
        section before the next round starts (``BackgroundSaver.save`` does, before it returns): until then only the
        training thread, which is writing it, changes that state (a schedule's background thread contributes a
        round only once the training thread has handed it one, and the training thread takes its step)."""
        inner_tensors, inner_settings = self.inner.optimizer_state()
        local: dict[str, torch.Tensor | Deferred] = {
            f"outer/{key}": Deferred(deferred.shape, deferred.dtype, partial(self._locked, deferred.make))
            for key, deferred in self.outer.local_state_with(in_flight).items()}
        with self.lock:
            carry, owed = self.outer.unapplied_work(in_flight)
            local.update({f"carry/{name}": c.detach().to("cpu", copy=True) for name, c in zip(self.names, carry or ())})
        local.update({f"inner/{k}": v for k, v in inner_tensors.items()})
        state = self.published
        return Checkpoint(round_index, dict(zip(self.names, state.params)), dict(state.shared), local,
                          {"inner": inner_settings, "slices": state.slice_digest, "unapplied_tokens": owed,
                           **(extras or {})})

    def _locked(self, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        with self.lock:
            return make()

    def restore(self, saved: Checkpoint, where: Path) -> None:
        """Continue from ``saved``. The optimizer's moments (8 bytes a parameter, read from the file as they are taken)
        are taken last, once the state this worker started with is let go."""
        shapes = {name: tuple(p.shape) for name, p in zip(self.names, self.outer.params)}
        if {name: tuple(t.shape) for name, t in saved.params.items()} != shapes:
            raise CheckpointError(f"the checkpoint in {where} does not fit this model (parameter names or shapes "
                                  f"differ)")
        try:
            with self.lock:
                self.outer.load_params([saved.params[name] for name in self.names])
                self.outer.load_shared_state(saved.shared)
                self.outer.load_local_state({k[6:]: v for k, v in saved.local.items() if k.startswith("outer/")})
                carry = ([made(saved.local[f"carry/{name}"]) for name in self.names]
                         if any(k.startswith("carry/") for k in saved.local) else None)
                self.outer.load_unapplied_work(carry, saved.extras.get("unapplied_tokens", 0))
            self.refresh_published()
            self.load_into_model()
            self.inner.load_optimizer_state({k[6:]: made(v) for k, v in saved.local.items() if k.startswith("inner/")},
                                            saved.extras["inner"])
        except (KeyError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"the checkpoint in {where} does not fit this model and algorithm ({e})") from None
        except (OSError, SafetensorError) as e:  # its local section is read as it is taken (``checkpoint.load``)
            raise CheckpointError(f"the checkpoint in {where} could not be read any more ({e}); resume again") from None
