"""The seam between a stage's schedule and the links to its neighbours.

A stage sends the activations of each micro-batch to the next stage and the gradients with respect to
what it received back to the previous one, each message keyed by (inner step, micro-batch). Token
ids travel with the activations, so the last stage gets its targets without a side channel. The
stages of a pipeline also sum a few numbers per step (squared gradient norms for one global clipping
coefficient, the loss). ``pipeline/links.py`` links stages on different peers over hivemind;
``p2ploco.testing.transport`` links S stages in one process (tests, benchmarks) behind the same interface.

Every wait is bounded: a stage that does not hear from its neighbour in time fails the step with a
PipelineError, never hangs.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from p2ploco.errors import PayloadError, PipelineError

MicroKey = tuple[int, int]  # (global inner step, micro-batch)
MAX_REMEMBERED, REMEMBERED_STEPS = 4096, 64  # delivered keys a mailbox remembers, to drop resent copies
PENDING_STEPS = 4  # steps' worth of messages a mailbox holds untaken: a neighbour runs at most one step ahead


def id_dtype(vocab_size: int) -> torch.dtype:
    """The smallest integer type that holds every token id on the wire."""
    return torch.uint16 if vocab_size <= 1 << 16 else torch.int32


@dataclass
class Activations:
    """What crosses a stage boundary forward: the window's token ids (B, T + 1: the inputs, and shifted
    by one the targets) and the boundary values (B, T, width) in the wire's element type."""

    ids: torch.Tensor
    values: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.ids.numel() * self.ids.element_size() + self.values.numel() * self.values.element_size()


class StageTransport(ABC):
    """One stage's links: to the previous stage (gradients out, activations in) and the next."""

    stage: int
    stages: int
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0  # spent sending to the other stages or waiting for them (counted by wire transports)

    @abstractmethod
    def send_activations(self, key: MicroKey, activations: Activations) -> None:
        """To the next stage."""

    @abstractmethod
    def recv_activations(self, key: MicroKey) -> Activations:
        """From the previous stage; PipelineError if they do not come in time."""

    @abstractmethod
    def send_gradients(self, key: MicroKey, gradients: torch.Tensor) -> None:
        """To the previous stage: d loss / d (the values received for ``key``), in the wire's element type."""

    @abstractmethod
    def recv_gradients(self, key: MicroKey) -> torch.Tensor:
        """From the next stage; PipelineError if they do not come in time."""

    @abstractmethod
    def all_sum(self, step: int, values: Sequence[float]) -> list[float]:
        """The element-wise sum of ``values`` (finite and non-negative: losses, squared norms) over the pipeline's
        stages (every stage gets the same numbers); PipelineError if a stage sends other addends."""

    @abstractmethod
    def abort(self, step: int, reason: str) -> None:
        """This stage cannot finish ``step``: the others stop waiting for it at once (best effort)."""


class Mailbox:
    """Messages by (step, index), each taken once; a take waits (bounded) for its message, and fails at once
    when its step was failed (a malformed message from the neighbour) or the mailbox closed. It holds at most
    ``capacity`` messages not yet taken (a neighbour that sends more, for steps far ahead, is refused), and
    forgets those of steps before the one last taken (a failed step's leftovers)."""

    def __init__(self, capacity: int = 1 << 16) -> None:
        self.capacity = capacity
        self._items: dict[MicroKey, object] = {}
        self._delivered: set[MicroKey] = set()  # every key put so far (recent steps only): a resent copy is dropped
        self._failed: dict[int, str] = {}  # step -> why
        self._arrived = threading.Condition()
        self._closed = False

    def close(self) -> None:
        """No more messages will come: every waiting and later take fails at once."""
        with self._arrived:
            self._closed = True
            self._arrived.notify_all()

    def fail(self, step: int, reason: str) -> None:
        """Step ``step`` cannot finish: its takes fail at once with ``reason``."""
        with self._arrived:
            self._failed[step] = reason
            self._arrived.notify_all()

    def put(self, key: MicroKey, item: object) -> None:
        """Deliver ``key``'s message; a second copy (a sender that resent after a lost answer) is dropped.
        PayloadError if the mailbox is full: its sender sends faster than any schedule does."""
        with self._arrived:
            if key in self._delivered:
                return
            if len(self._items) >= self.capacity:
                raise PayloadError(f"{self.capacity} messages not taken yet; a stage runs at most one step ahead")
            self._delivered.add(key)
            if len(self._delivered) > MAX_REMEMBERED:  # forget the keys of old steps
                newest = max(step for step, _ in self._delivered)
                self._delivered = {k for k in self._delivered if k[0] > newest - REMEMBERED_STEPS}
            self._items[key] = item
            self._arrived.notify_all()

    def wait(self, key: MicroKey, timeout: float, what: str) -> bool:
        """Whether ``key``'s message is here within ``timeout``; PipelineError at once if its step failed or no more
        messages will come."""
        with self._arrived:
            if not self._arrived.wait_for(lambda: key in self._items or key[0] in self._failed or self._closed,
                                          timeout):
                return False
            if key[0] in self._failed:
                raise PipelineError(f"step {key[0]} failed: {self._failed[key[0]]}")
            if key not in self._items:
                raise PipelineError(f"the link closed before the {what} of step {key[0]} micro-batch {key[1]} came")
            return True

    def take(self, key: MicroKey, timeout: float, what: str) -> object:
        """``key``'s message, waiting up to ``timeout`` for it (PipelineError if it does not come)."""
        if not self.wait(key, timeout, what):
            raise PipelineError(f"no {what} for step {key[0]} micro-batch {key[1]} within {timeout:.0f} s")
        with self._arrived:
            for stale in [k for k in self._items if k[0] < key[0]]:
                del self._items[stale]
            return self._items.pop(key)
