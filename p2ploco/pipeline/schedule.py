"""One stage's part of a pipeline's inner step: micro-batches through S stages, 1F1B.

Each stage runs this schedule on its own (in its own thread here, on its own peer over hivemind) and
meets its neighbours only through the transport. Stage s runs min(S - s - 1, M) forwards first, then
alternates one forward and one backward, then drains the backwards:

    stage 0 of 2, M = 4:   F0 F1 B0 F2 B1 F3 B2 B3
    stage 1 of 2, M = 4:   F0 B0 F1 B1 F2 B2 F3 B3

1F1B rather than GPipe: both have the same bubble, but stage s never holds more than S - s
micro-batches' activations, where GPipe holds all M until the backwards start. Weak peers are
short of memory, not of patience, and M (``inner.grad_accum``) can then grow freely.

Forward on stage s: the first stage draws the window (B, T + 1 ids) from the pipeline's sampler and
embeds ``ids[:, :-1]``; a later stage rebuilds h from the received values inside autograd (the
received tensor is a leaf, so its gradient is what goes back). The last stage computes the loss
against ``ids[:, 1:]``; the others encode their output and send it on. Every loss is scaled by 1 / M,
as gradient accumulation in one model does, so the pipeline's update equals the unsplit model's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from p2ploco.data import ShardSampler
from p2ploco.errors import PipelineError
from p2ploco.inner import GradientSource, autocast_for
from p2ploco.model import Transformer
from p2ploco.pipeline.subspace import BoundaryCodec
from p2ploco.pipeline.transport import Activations, MicroKey, StageTransport, id_dtype

WIRE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def one_forward_one_backward(stage: int, stages: int, micro_batches: int) -> list[tuple[str, int]]:
    """The order of ("F", m) and ("B", m) operations of ``stage`` in a 1F1B schedule."""
    warmup = min(stages - stage - 1, micro_batches)
    order = [("F", m) for m in range(warmup)]
    for m in range(micro_batches - warmup):
        order += [("F", warmup + m), ("B", m)]
    return order + [("B", m) for m in range(micro_batches - warmup, micro_batches)]


class PipelineStage(GradientSource):
    def __init__(self, model: Transformer, codec: BoundaryCodec, stage: int, stages: int, micro_batches: int,
                 batch_size: int, seq_len: int, wire_dtype: str, device: torch.device):
        self.model, self.codec, self.stage = model, codec, stage
        self.micro_batches, self.device = micro_batches, device
        self.wire_dtype = WIRE_DTYPES[wire_dtype]
        self.id_dtype = id_dtype(model.config.vocab_size)
        self.tokens_per_step = micro_batches * batch_size * seq_len
        self.order = one_forward_one_backward(stage, stages, micro_batches)
        self.transport: StageTransport | None = None
        self.sampler: ShardSampler | None = None
        # per micro-batch in flight: the tensor to backpropagate from (the loss, or the encoded output)
        # and the received values (a leaf whose gradient goes back), None on the first stage
        self._in_flight: dict[MicroKey, tuple[torch.Tensor, torch.Tensor | None]] = {}

    def link(self, transport: StageTransport, sampler: ShardSampler | None) -> None:
        """Train with the stages ``transport`` reaches; ``sampler``: the pipeline's data, on the first stage only
        (later stages get the token ids with the activations). A pipeline that re-forms links again."""
        if transport.stage != self.stage:
            raise ValueError(f"a transport of stage {transport.stage} for stage {self.stage}")
        if self.model.first != (sampler is not None):
            raise ValueError("the first stage, and only it, draws the pipeline's batches")
        self.transport, self.sampler = transport, sampler

    def accumulate(self, step: int) -> float:
        if self.transport is None:
            raise PipelineError(f"stage {self.stage} is not linked to a pipeline")
        loss = 0.0
        try:
            for op, micro in self.order:
                key = (step, micro)
                if op == "F":
                    self._forward(key)
                else:
                    loss += self._backward(key)
        except PipelineError as e:
            self.transport.abort(step, str(e))  # the other stages need not wait out their timeouts
            raise
        finally:
            self._in_flight.clear()  # a failed step leaves nothing behind for the next one
        return loss

    def reduce(self, step: int, values: Sequence[float]) -> list[float]:
        """The pipeline's sums (the loss, the squared gradient norm); PipelineError if they are not finite and
        non-negative: some stage's inputs made its step overflow, and the pipeline's round fails, not this peer."""
        sums = self.transport.all_sum(step, values)
        if not all(math.isfinite(v) and v >= 0 for v in sums):
            raise PipelineError(f"step {step}: the pipeline's loss and squared gradient norm are {sums}; a stage's "
                                f"inputs made it overflow")
        return sums

    def _forward(self, key: MicroKey) -> None:
        step, micro = key
        received = None
        if self.sampler is not None:
            inputs, targets = self.sampler.batch(step * self.micro_batches + micro)
            ids = torch.cat([inputs, targets[:, -1:]], dim=1).to(self.device)
            hidden = None
        else:
            activations = self.transport.recv_activations(key)
            ids = activations.ids.to(self.device, torch.long)
            received = activations.values.to(self.device, torch.float32).requires_grad_()
            hidden = self.codec.decode(received, ids[:, :-1])
        with autocast_for(self.device):
            output = self.model(ids[:, :-1], hidden=hidden, targets=ids[:, 1:] if self.model.last else None)
        if self.model.last:
            self._in_flight[key] = (output / self.micro_batches, received)
            return
        encoded = self.codec.encode(output.float(), ids[:, :-1])
        self.transport.send_activations(key, Activations(ids.to(self.id_dtype).cpu(),
                                                         encoded.detach().to(self.wire_dtype).cpu()))
        self._in_flight[key] = (encoded, received)

    def _backward(self, key: MicroKey) -> float:
        output, received = self._in_flight.pop(key)
        if self.model.last:
            output.backward()
            loss = output.item()
        else:
            output.backward(self.transport.recv_gradients(key).to(self.device, torch.float32))
            loss = 0.0
        if received is not None:
            self.transport.send_gradients(key, received.grad.to(self.wire_dtype).cpu())
        return loss
