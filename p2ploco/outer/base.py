"""The interface every outer algorithm implements (DiLoCo, SparseLoCo, Streaming DiLoCo, LoCo).

A round has four parts that may happen at different times and on different threads: ``contribute`` (this
replica's pseudo-gradient turned into an exchange), ``OuterSync.start`` (its all-reduce, in the background),
``prepare`` (the outer step on the aggregate, computed out of place) and ``take`` (the prepared step put in
place of the global state, or, for a round not applied, what ``contribute`` took from local state given
back). ``finish`` waits for the all-reduce and does the last two; ``sync`` does all four in a row. Round
schedules (``p2ploco.schedules``) decide when each part runs.

The global parameters and the shared state are never written in place: a step builds new tensors and
``take`` swaps them in. So a copy of the global state handed out once (to serve peers catching up, to
evaluate, to checkpoint) stays whole while the next step is computed on another thread: the double buffer
costs no copy of its own.
"""

from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TypeVar

import torch

from p2ploco.collective.exchange import AllReduceResult, Communicator, Exchange, PendingAllReduce
from p2ploco.collective.robust import UNBOUNDED, Policy
from p2ploco.collective.sliced import SlicedExchange
from p2ploco.errors import TrainingError
from p2ploco.host_memory import give_back_freed
from p2ploco.tensorfile import Deferred, made

logger = logging.getLogger(__name__)
T = TypeVar("T")
CPU = torch.device("cpu")


@dataclass
class OuterSync:
    """One sync (docs/design.md, glossary): this replica's contribution to it, and its all-reduce once started. A
    round is one sync, or in Streaming DiLoCo one per fragment."""

    round_index: int
    exchange: SlicedExchange
    all_reduce: PendingAllReduce | None = None
    # the pseudo-gradient as sent, by an algorithm that keeps no error feedback: if the round is not applied it is
    # carried into the next contribution (``OuterAlgorithm.carried``)
    sent: list[torch.Tensor] | None = None

    def start(self, comm: Communicator, name: str = "params") -> None:
        """Start the all-reduce in the background; ``name`` tells apart the all-reduces of one round."""
        self.all_reduce = comm.start_all_reduce(self.exchange, self.round_index, name)


@dataclass(frozen=True)
class Synced:
    """An outer round as it ended here: its all-reduce, and whether its outer step was taken."""

    all_reduce: AllReduceResult
    applied: bool  # the round committed and its step was finite: the global state moved (False: given back)


@dataclass
class Move:
    """What an outer step subtracted from one global parameter: a dense tensor of its shape, or values at some
    of its flat positions (a sparse aggregate)."""

    step: torch.Tensor
    at: torch.Tensor | None = None  # flat positions of a sparse step; None: dense

    @torch.no_grad()
    def apply_to(self, tensor: torch.Tensor) -> None:
        """The same step, in place, to ``tensor`` on its own device (an overlapped replica's local params)."""
        step = self.step.to(tensor.device)
        if self.at is None:
            tensor.sub_(step)
        else:
            flat, index = tensor.view(-1), self.at.to(tensor.device)
            flat[index] = flat[index] - step


@dataclass
class OuterStep:
    """A round's outer step, computed and not yet taken: the new tensors that replace global ones (built out of
    place), and how far it moved each parameter it touched."""

    params: dict[int, torch.Tensor]  # parameter position -> its new global value
    shared: dict[str, torch.Tensor]  # shared-state key (``momentum.3``) -> its new value
    moves: dict[int, Move] = field(default_factory=dict)

    def norm_squared(self) -> float:
        """The squared L2 norm of the whole step (float64 sums)."""
        return sum(float(torch.linalg.vector_norm(m.step, dtype=torch.float64)) ** 2 for m in self.moves.values())


class OuterAlgorithm(ABC):
    """Owns the global parameters (float32, CPU) and moves them one outer round forward.

    The update is applied elementwise in float32 on the CPU: every peer that applies the same
    aggregate to the same parameters gets the same bits, whatever accelerator it trains on. A round
    whose all-reduce was not committed changes nothing: neither the parameters nor any outer state.

    State comes in two kinds: *shared* state every peer holds alike (a joiner downloads it with the
    parameters) and *local* state of this replica alone (only checkpointed). Shared state is kept per
    parameter in the list attributes named by ``shared_kinds`` (``momentum``), keyed ``kind.position``; like
    the parameters it is replaced, never written in place. Local state (error feedback) is written in place.

    The parameters come in named slices (``p2ploco.slices``: one per pipeline stage); each slice
    is averaged among the peers that hold it, so a pipeline stage runs the same algorithm on its slice
    alone while a full replica runs it on every slice, all in one all-reduce per round.
    """

    density: float = 1.0  # share of coordinates one replica sends per round
    shared_kinds: tuple[str, ...] = ()  # list attributes of per-parameter shared state

    def __init__(self, global_params: Sequence[torch.Tensor], slices: Mapping[str, Sequence[int]] | None = None,
                 policy: Policy = UNBOUNDED, max_tokens: int | None = None):
        """``slices``: slice name -> positions in ``global_params``; by default one slice of everything. ``policy``:
        how reducers weigh and bound contributions (``collective/robust.py``); ``max_tokens``: the most tokens a
        contribution may weigh (``Config.max_contribution_tokens``; None: uncapped)."""
        self.policy, self.max_tokens = policy, max_tokens
        self.params = [p.detach().to(CPU, torch.float32).clone() for p in global_params]
        self.slices = {name: list(positions) for name, positions in (slices or whole(len(self.params))).items()}
        if sorted(i for positions in self.slices.values() for i in positions) != list(range(len(self.params))):
            raise ValueError("slices must cover every parameter exactly once")
        self._moved = 0.0  # squared L2 norm of the outer steps taken since ``take_update_norm`` last read it
        # Work trained here and not yet in an applied aggregate (docs/design.md, "Slow peers"): its tokens, and, for
        # an algorithm without error feedback, its pseudo-gradient (error feedback holds it already).
        self.unapplied_tokens = 0
        self.carry: list[torch.Tensor] | None = None

    def take_update_norm(self) -> float:
        """L2 norm of the outer steps taken since the last call (0 if none): how far they moved the global params,
        from the steps themselves (sparse for SparseLoCo) rather than a pass over the model."""
        norm, self._moved = math.sqrt(self._moved), 0.0
        return norm

    def sync(self, local_params: Sequence[torch.Tensor], comm: Communicator, round_index: int,
             start: Sequence[torch.Tensor] | None = None, tokens: int = 1) -> Synced:
        """Combine this replica's progress (its params after its inner steps, trained on ``tokens`` tokens) with
        the round's other replicas through ``comm`` and update ``self.params`` if the round commits. The
        pseudo-gradient is measured from ``start``, the params the inner steps began from: the global params unless
        the replica trained a projection of them (a subspace-constrained one)."""
        outer_sync = self.contribute(local_params, round_index, start, tokens)
        outer_sync.start(comm)
        return self.finish(outer_sync)

    @abstractmethod
    def contribute(self, local_params: Sequence[torch.Tensor], round_index: int,
                   start: Sequence[torch.Tensor] | None = None, tokens: int = 1) -> OuterSync:
        """This replica's exchange for the round: its pseudo-gradient ``start - local_params`` (``start``: the
        global params by default), encoded as the algorithm sends it, weighted by ``tokens`` (what the inner steps
        trained on) plus the tokens of work not applied yet (``tokens_behind``). Changes only local state (what it takes
        from an error-feedback buffer, or the carry, is given back by ``take`` if the round is not applied)."""

    def tokens_behind(self, tokens: int) -> int:
        """The tokens behind a contribution trained on ``tokens``: those, and the tokens of earlier work that is in it
        because no aggregate applied it yet (given back by ``take`` if this round is not applied either), at most
        ``max_tokens`` (the run's ``training.max_ranks`` full rounds: no contribution weighs more than that many full
        peers', and coordinators refuse more)."""
        weight, self.unapplied_tokens = max(1, tokens) + self.unapplied_tokens, 0
        return weight if self.max_tokens is None else min(weight, self.max_tokens)

    def carried(self, deltas: list[torch.Tensor]) -> list[torch.Tensor]:
        """``deltas`` plus the pseudo-gradient of rounds not applied (an algorithm without error feedback keeps it
        here, rebased: a difference of params holds on any base), which is then taken."""
        carry, self.carry = self.carry, None
        return deltas if carry is None else [d.add_(c) for d, c in zip(deltas, carry, strict=True)]

    def finish(self, outer_sync: OuterSync, alongside: Sequence[torch.Tensor] = ()) -> Synced:
        """Wait for the round's all-reduce, prepare its outer step and take it (``alongside``: tensors that take
        the same step, an overlapped replica's local params). A round not committed, or whose step would not be
        finite, changes no shared state; ``applied`` then says False."""
        result = outer_sync.all_reduce.wait()
        give_back_freed()  # the all-reduce's buffers, before the step builds the new global state beside the old
        step = self.prepare(outer_sync) if result.committed else None
        self.take(outer_sync, step, alongside)
        return Synced(result, step is not None)

    @abstractmethod
    def prepare(self, outer_sync: OuterSync) -> OuterStep | None:
        """The outer step on the round's (committed) aggregate, from the global state as it is now, out of place:
        nothing changes until ``take``. None if it would make the global params non-finite."""

    def take(self, outer_sync: OuterSync, step: OuterStep | None, alongside: Sequence[torch.Tensor] = ()) -> None:
        """Put a prepared ``step`` in place (and move ``alongside[i]`` by the same step), or, with no step (the
        round is not applied), give back what ``contribute`` took from local state."""
        if step is None:
            self.give_back(outer_sync)
            self.unapplied_tokens = outer_sync.exchange.tokens
            if outer_sync.sent is not None:
                self.carry = outer_sync.sent
            return
        for i, value in step.params.items():
            self.params[i] = value
        for key, value in step.shared.items():
            kind, i = split_key(key)
            getattr(self, kind)[i] = value
        for i, move in step.moves.items():
            if alongside:
                move.apply_to(alongside[i])
        self._moved += step.norm_squared()

    def give_back(self, outer_sync: OuterSync) -> None:  # noqa: B027 (most algorithms take nothing)
        """Undo what ``contribute`` took from local state: the round was not applied."""

    def local_state_with(self, in_flight: OuterSync | None) -> dict[str, Deferred]:
        """``local_state`` as it would be if ``in_flight`` (a round not taken yet) were not applied: what a
        checkpoint taken during an overlapped round holds next to the global params that round has not moved. Each
        tensor is a copy on the CPU made when it is written (``tensorfile.Deferred``), of the state as it is then:
        one tensor's copy at a time."""
        return {key: Deferred(tuple(tensor.shape), tensor.dtype, partial(tensor.detach().to, CPU, copy=True))
                for key, tensor in self.local_state().items()}

    def unapplied_work(self, in_flight: OuterSync | None = None) -> tuple[list[torch.Tensor] | None, int]:
        """Work trained here that no aggregate has applied, as a checkpoint holds it: the carry (None: none, or the
        algorithm keeps it in error feedback) and the tokens owed to the next contribution, as they would be if
        ``in_flight`` (a round contributed, not taken) were not applied."""
        if in_flight is None:
            return self.carry, self.unapplied_tokens
        return (in_flight.sent if in_flight.sent is not None else self.carry), in_flight.exchange.tokens

    def load_unapplied_work(self, carry: Sequence[torch.Tensor] | None, tokens: int) -> None:
        """Take a checkpoint's unapplied work (``unapplied_work``); ValueError if it does not fit these params."""
        if carry is not None and [tuple(c.shape) for c in carry] != [tuple(p.shape) for p in self.params]:
            raise ValueError("the carry's shapes differ from the parameters'")
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise ValueError("the tokens owed are not a count")
        self.carry = None if carry is None else [c.detach().to(CPU, torch.float32, copy=True) for c in carry]
        self.unapplied_tokens = tokens

    def per_param(self, exchange: SlicedExchange, results: Callable[[Exchange], list[T]]) -> list[T]:
        """A round's per-slice results in parameter order; ``results`` lists one slice's, one per tensor."""
        out: list[T | None] = [None] * len(self.params)
        for name, positions in self.slices.items():
            for i, result in zip(positions, results(exchange.parts[name]), strict=True):
                out[i] = result
        return out  # type: ignore[return-value]  # the slices cover every parameter (checked in __init__)

    def shared_state(self) -> dict[str, torch.Tensor]:
        """The current shared tensors, by key (``kind.position``)."""
        return {f"{kind}.{i}": tensor for kind in self.shared_kinds for i, tensor in enumerate(getattr(self, kind))}

    def load_shared_state(self, state: dict[str, torch.Tensor]) -> None:
        """Take ``state`` as the shared state (as ``load_params`` takes params: never written in place, not
        copied); ValueError if it does not describe this algorithm's."""
        check_state(self.shared_state(), state)
        for key, tensor in state.items():
            kind, i = split_key(key)
            getattr(self, kind)[i] = tensor.detach().to(CPU, torch.float32).contiguous()

    def local_state(self) -> dict[str, torch.Tensor]:
        """This replica's own tensors by name, as checkpoints hold them: the live tensors, or copies where the
        algorithm keeps them in another layout (it then overrides the two methods below)."""
        return {}

    def load_local_state(self, state: Mapping[str, torch.Tensor | Deferred]) -> None:
        """Take a checkpoint's local state (each ``Deferred`` tensor made as it is copied in: one at a time);
        ValueError if it does not describe this algorithm's."""
        copy_state(self.local_state(), state)

    def reset_local_state(self) -> None:
        """Forget this replica's own state: it refers to parameters the swarm has moved far past."""
        for tensor in self.local_state().values():
            tensor.zero_()
        self.unapplied_tokens, self.carry = 0, None

    def load_params(self, params: Sequence[torch.Tensor]) -> None:
        """Take ``params`` as the global params; ValueError if their shapes differ from these. Global params are
        never written in place, so tensors that are float32 on the CPU already (a fetched state, a checkpoint's)
        are taken as they are: whoever handed them over writes them no more either."""
        if [tuple(p.shape) for p in params] != [tuple(p.shape) for p in self.params]:
            raise ValueError("the parameters' shapes differ from this model's")
        self.params = [p.detach().to(CPU, torch.float32).contiguous() for p in params]


def split_key(key: str) -> tuple[str, int]:
    """A shared-state key ``kind.position`` -> (kind, position)."""
    kind, _, position = key.rpartition(".")
    return kind, int(position)


def whole(count: int) -> dict[str, list[int]]:
    """One slice, ``stage0``, of ``count`` parameters: a model that is not cut into stages."""
    return {"stage0": list(range(count))}


def pseudo_gradients(start: Sequence[torch.Tensor], local_params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """start - local in float32, each on its local tensor's device (the training device: on CUDA it runs on
    whatever stream the caller runs on), refusing to send what a diverged replica computed."""
    deltas = [begin.to(local.device, torch.float32) - local.detach().float()
              for begin, local in zip(start, local_params)]
    for delta in deltas:
        check_pseudo_gradient(delta, start)
    return deltas


def check_pseudo_gradient(delta: torch.Tensor, global_params: Sequence[torch.Tensor]) -> None:
    """TrainingError if ``delta`` (one tensor's global - local) holds NaN or Inf, saying whose fault it is."""
    if all_finite(delta):
        return
    if not all(all_finite(g) for g in global_params):  # not this replica's doing
        raise TrainingError("the global parameters hold NaN or Inf: the state this node loaded is corrupt; "
                            "start it with a fresh --log-dir so that it fetches the swarm's state")
    raise TrainingError("this replica's pseudo-gradient holds NaN or Inf: training diverged; lower inner.lr "
                        "or enable inner.grad_clip")


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every element is finite, at the speed of a sum: a NaN or an Inf makes the sum NaN or Inf, so a
    finite sum settles it; only a non-finite one (perhaps an overflow of large finite values) is checked
    element by element."""
    return bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())


def finite_update(updated: Iterable[torch.Tensor], round_index: int) -> bool:
    """Whether the global params as a round's step would leave them (``updated``) are finite everywhere."""
    if all(all_finite(u) for u in updated):
        return True
    logger.warning(f"round {round_index}: the aggregate would make the global parameters non-finite; "
                   f"this round is dropped (by every peer alike)")
    return False


def check_state(into: Mapping[str, torch.Tensor | Deferred], source: Mapping[str, torch.Tensor | Deferred]) -> None:
    """ValueError if ``source`` does not hold the same names and shapes as ``into``."""
    if set(source) != set(into) or any(tuple(source[k].shape) != tuple(into[k].shape) for k in into):
        raise ValueError(f"state {sorted(source)[:3]}... does not fit {sorted(into)[:3]}...")


def copy_state(into: dict[str, torch.Tensor], source: Mapping[str, torch.Tensor | Deferred]) -> None:
    """Copy ``source`` into the live tensors ``into`` (a ``Deferred`` made as its turn comes); ValueError if they
    do not describe the same state."""
    check_state(into, source)
    for key, tensor in into.items():
        tensor.copy_(made(source[key]))
