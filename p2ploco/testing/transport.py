"""The links of one pipeline group's stages, all in this process (each stage in its own thread), behind the
``StageTransport`` seam a node's hivemind links (``pipeline/links.py``) implement: each message is cloned into the
receiving stage's mailbox, and the stages' per-step sums meet at a barrier. Every wait is bounded, as over a
network: a stage that does not hear from its neighbour in time fails the step with a PipelineError."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from p2ploco.errors import PipelineError
from p2ploco.pipeline.transport import Activations, Mailbox, MicroKey, StageTransport


class InProcessPipe:
    """The links of one group's stages, all in this process (each stage in its own thread)."""

    def __init__(self, stages: int, timeout: float = 600.0):
        self.stages, self.timeout = stages, timeout
        self.forward = [Mailbox() for _ in range(stages)]  # activations into stage s
        self.backward = [Mailbox() for _ in range(stages)]  # gradients into stage s
        self._addends: list[list[float]] = [[] for _ in range(stages)]
        self._sum: list[float] = []
        self._gather = threading.Barrier(stages, action=self._add)
        self._release = threading.Barrier(stages)

    def transport(self, stage: int) -> InProcessTransport:
        return InProcessTransport(self, stage)

    def abort(self) -> None:
        """A stage failed: the others stop at their next wait with a PipelineError."""
        for mailbox in (*self.forward, *self.backward):
            mailbox.close()
        self._gather.abort()
        self._release.abort()

    def _add(self) -> None:
        self._sum = [sum(column) for column in zip(*self._addends, strict=True)]  # in stage order


class InProcessTransport(StageTransport):
    def __init__(self, pipe: InProcessPipe, stage: int):
        self.pipe, self.stage, self.stages = pipe, stage, pipe.stages

    def send_activations(self, key: MicroKey, activations: Activations) -> None:
        self.bytes_sent += activations.nbytes
        self.pipe.forward[self.stage + 1].put(key, Activations(activations.ids.clone(), activations.values.clone()))

    def recv_activations(self, key: MicroKey) -> Activations:
        activations = self.pipe.forward[self.stage].take(key, self.pipe.timeout, "activations")
        self.bytes_received += activations.nbytes
        return activations

    def send_gradients(self, key: MicroKey, gradients: torch.Tensor) -> None:
        self.bytes_sent += gradients.numel() * gradients.element_size()
        self.pipe.backward[self.stage - 1].put(key, gradients.clone())

    def recv_gradients(self, key: MicroKey) -> torch.Tensor:
        gradients = self.pipe.backward[self.stage].take(key, self.pipe.timeout, "gradients")
        self.bytes_received += gradients.numel() * gradients.element_size()
        return gradients

    def abort(self, step: int, reason: str) -> None:
        for mailbox in (*self.pipe.forward, *self.pipe.backward):
            mailbox.fail(step, f"stage {self.stage} gave up: {reason}")
        self.pipe._gather.abort()  # a stage waiting in all_sum stops too

    def all_sum(self, step: int, values: Sequence[float]) -> list[float]:
        pipe = self.pipe
        pipe._addends[self.stage] = list(values)
        try:
            pipe._gather.wait(pipe.timeout)
            total = list(pipe._sum)
            pipe._release.wait(pipe.timeout)
        except threading.BrokenBarrierError:
            raise PipelineError(f"the group's stages did not all finish step {step} within "
                                f"{pipe.timeout:.0f} s") from None
        return total
