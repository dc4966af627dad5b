"""Stage links over hivemind: the transport of a pipeline whose stages run on different peers.

Every stage peer serves one stream handler, ``p2ploco/<run>/stage``, and pushes to its neighbours:
activations forward to stage s + 1, gradients back to stage s - 1, and its addends of the per-step
sums to every stage of the pipeline. A push is one framed message (``swarm/wire.py``) on a fresh
binary stream, which carries any size (hivemind's unary limit does not apply), and is answered with
one status:

    request:  u32 header length | u64 payload length | msgpack header | payload
    header:   {v, kind: activations | gradients | sum | abort, group, epoch, step, micro,
               shapes: [[...], ...], dtypes: [...], from_stage (sum, abort), reason (abort)}
    payload:  the tensors' raw little-endian bytes, one after the other, in header order
                activations: token ids (B, T + 1; uint16 or int32), values (B, T, width; wire dtype)
                gradients:   values (B, T, width; wire dtype)
                sum:         float64 addends (n,)
                abort:       nothing
    answer:   {v, status: ok | rejected, reason}

The receiver knows who may send what: only the peer holding stage s - 1 of its current pipeline
(``epoch`` counts re-formations) may send activations, only stage s + 1 gradients, only its stages sums.
It checks the sender before it reads a payload, bounds every shape by the pipeline's schedule (batch,
sequence, width, vocabulary), reads exactly the bytes those shapes need, and refuses non-finite
values and out-of-range ids. A bad message from the expected neighbour fails the step it belongs to
(the waiting stage gets a PipelineError at once, and the pipeline's round with it); a message from
anyone else is refused and changes nothing. No process ever stops for a message.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Annotated, Any

import numpy as np
import torch
from hivemind.p2p import P2P
from pydantic import Field, StringConstraints

from p2ploco.aio import in_time
from p2ploco.config import Config
from p2ploco.errors import PayloadError, PipelineError, TransportError
from p2ploco.pipeline.schedule import WIRE_DTYPES
from p2ploco.pipeline.transport import PENDING_STEPS, Activations, Mailbox, MicroKey, StageTransport, id_dtype
from p2ploco.swarm import wire
from p2ploco.swarm.loop import EventLoopThread
from p2ploco.swarm.messages import MAX_ROUND, Message, Name, Reason, decode, status_of

logger = logging.getLogger(__name__)

DTYPES = {"uint16": torch.uint16, "int32": torch.int32, "float32": torch.float32, "float16": torch.float16,
          "bfloat16": torch.bfloat16, "float64": torch.float64}
MAX_ADDENDS = 16
MAX_BOUNDARY_MAGNITUDE = 1e5  # no honest activation or activation-gradient comes near: the forward would overflow
MAX_DIMENSION = 1 << 31  # of a tensor on the wire, or a stage or micro-batch index
PROBES_TO_GIVE_UP = 2  # consecutive failed checks before a stage's peer counts as gone (a busy daemon may miss one)


class Kind(Enum):
    ACTIVATIONS = "activations"
    GRADIENTS = "gradients"
    SUM = "sum"
    ABORT = "abort"  # the sender cannot finish the step: stop waiting for it


class Status(Enum):
    OK = "ok"
    REJECTED = "rejected"


Shape = Annotated[list[Annotated[int, Field(ge=0, le=MAX_DIMENSION)]], Field(max_length=4)]


class StageHeader(Message):
    kind: status_of(Kind)
    group: Name  # the pipeline (a wire name)
    epoch: Annotated[int, Field(ge=0, le=MAX_ROUND)]
    step: Annotated[int, Field(ge=0, le=MAX_ROUND)]
    micro: Annotated[int, Field(ge=0, le=MAX_DIMENSION)] = 0
    shapes: Annotated[list[Shape], Field(max_length=4)] = []
    dtypes: Annotated[list[Annotated[str, StringConstraints(max_length=16)]], Field(max_length=4)] = []
    from_stage: Annotated[int, Field(ge=0, le=MAX_DIMENSION)] = 0  # with sum and abort: the sender's stage
    reason: Reason = ""  # with abort


class StageAnswer(Message):
    status: status_of(Status)
    reason: Reason = ""


@dataclass(frozen=True)
class StageLinks:
    """One formation of a pipeline: which peer holds each stage (``epoch`` counts re-formations)."""

    pipeline: str
    epoch: int
    peers: tuple[str, ...]


@dataclass(frozen=True)
class Schedule:
    """What every message of a pipeline must fit: the pipeline's micro-batch shape and the boundary width."""

    micro_batches: int
    batch_size: int
    seq_len: int
    width: int
    vocab_size: int
    wire_dtype: torch.dtype
    id_dtype: torch.dtype

    @classmethod
    def of(cls, config: Config) -> Schedule:
        """The schedule every stage of a pipeline of this config runs (the pipeline shares these inner settings)."""
        c = config
        width = c.pipeline.rank if c.pipeline.compressed else c.model.d_model
        return cls(c.inner.grad_accum, c.inner.batch_size, c.data.seq_len, width, c.model.vocab_size,
                   WIRE_DTYPES[c.pipeline.wire_dtype], id_dtype(c.model.vocab_size))


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    flat = tensor.detach().contiguous().cpu()
    if flat.dtype == torch.bfloat16:
        flat = flat.view(torch.int16)  # numpy has no bfloat16: move the same bits
    return flat.numpy().tobytes()


@dataclass
class _Message:
    """One incoming stage message as its checks go: once the sender is known to be the right neighbour, a bad
    message fails the step it names (``fail``); before that it fails nothing."""

    sender: str
    kind: Kind | None = None
    mailbox: Mailbox | None = None
    key: MicroKey | None = None
    from_stage: int = -1
    shapes: list[tuple[int, ...]] = field(default_factory=list)
    dtypes: list[torch.dtype] = field(default_factory=list)
    reason: str = ""  # an abort's

    def fail(self, reason: str) -> None:
        if self.mailbox is not None and self.key is not None:
            self.mailbox.fail(self.key[0], reason)


class StageLinkServer:
    """What this stage peer receives: one mailbox per direction, plus the pipeline's sums."""

    def __init__(self, p2p: P2P, run_id: str, timeout: float):
        self.p2p, self.timeout = p2p, timeout
        self.handler_name = f"p2ploco/{run_id}/stage"
        self.me = ""
        self.links: StageLinks | None = None
        self.stage = -1
        self.schedule: Schedule | None = None
        self.activations, self.gradients, self.sums = Mailbox(), Mailbox(), Mailbox()

    async def start(self) -> None:
        self.me = str(self.p2p.peer_id)
        await self.p2p.add_binary_stream_handler(self.handler_name, self._serve)

    def join(self, links: StageLinks, stage: int, schedule: Schedule) -> None:
        """Serve ``stage`` of the formation ``links`` from now on; what was in flight for another one is gone."""
        for mailbox in (self.activations, self.gradients, self.sums):
            mailbox.close()
        capacity = PENDING_STEPS * max(schedule.micro_batches, len(links.peers))
        self.activations, self.gradients, self.sums = Mailbox(capacity), Mailbox(capacity), Mailbox(capacity)
        self.links, self.stage, self.schedule = links, stage, schedule

    def leave(self) -> None:
        """No formation: every waiting stage fails at once, and nobody's messages are accepted."""
        for mailbox in (self.activations, self.gradients, self.sums):
            mailbox.close()
        self.links = None

    def _expected_sender(self, header: StageHeader) -> tuple[StageLinks, Mailbox, int]:
        links = self.links
        if links is None or header.group != links.pipeline or header.epoch != links.epoch:
            raise PayloadError("message for a pipeline formation this peer does not serve")
        if header.kind is Kind.ACTIVATIONS:
            return links, self.activations, self.stage - 1
        if header.kind is Kind.GRADIENTS:
            return links, self.gradients, self.stage + 1
        return links, self.sums, header.from_stage  # sums and aborts: any stage of the pipeline

    def admit(self, message: _Message, raw: dict[str, Any], length: int) -> None:
        """Check a message's header before its payload is read: its kind, that ``message.sender`` is the stage that
        may send it, its step and micro-batch, and that its shapes fit the schedule and announce ``length``
        bytes. PayloadError otherwise; once the sender is known to be the right neighbour, ``message`` names
        the step a bad message fails."""
        header = decode(StageHeader, raw)
        kind = message.kind = header.kind
        links, mailbox, from_stage = self._expected_sender(header)
        if not 0 <= from_stage < len(links.peers) or links.peers[from_stage] != message.sender:
            raise PayloadError(f"{message.sender[-8:]} does not hold the stage that sends {kind.value} to this one")
        message.mailbox, message.from_stage = mailbox, from_stage
        message.key = self._key(header, from_stage)
        if kind is Kind.ABORT:
            message.reason = header.reason[:200]
            return
        message.shapes, message.dtypes = self._expected_tensors(header)
        size = sum(int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size()
                   for shape, dtype in zip(message.shapes, message.dtypes))
        if length != size:
            raise PayloadError(f"{kind.value} payload of {length} bytes, its shapes need {size}")

    def deliver(self, message: _Message, payload: bytes) -> None:
        """Put an admitted message's tensors in their mailbox (or fail the step an abort names)."""
        if message.kind is Kind.ABORT:
            for box in (self.activations, self.gradients, self.sums):
                box.fail(message.key[0], f"stage {message.from_stage} gave up: {message.reason}")
            return
        message.mailbox.put(message.key, self._decode(message.kind, payload, message.shapes, message.dtypes))

    def accept(self, sender: str, header: dict[str, Any], payload: bytes) -> None:
        """Admit and deliver a message whose payload is all here: what ``_serve`` does with one off the wire."""
        message = _Message(sender)
        try:
            self.admit(message, header, len(payload))
            self.deliver(message, payload)
        except PayloadError as e:
            message.fail(str(e))
            raise

    async def _serve(self, stream_info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        message = _Message(str(stream_info.peer_id))
        try:
            header, length = await in_time(wire.read_header(reader), self.timeout)
            self.admit(message, header, length)
            payload = await in_time(wire.read_payload(reader, length, length), self.timeout)
            self.deliver(message, payload)
            await in_time(wire.write_message(writer, {"status": Status.OK.value}), self.timeout)
        except TransportError as e:  # the sender resends on a fresh stream, or has crashed (the waiting stage's
            # probes find that out): the step is not failed for one broken stream
            if message.kind is not None:  # else a liveness probe: a stream opened and closed at once
                logger.warning(f"stage message from {message.sender[-8:]} broke off: {e}")
        except (PayloadError, PipelineError, TimeoutError) as e:
            reason = str(e) or "timed out"
            logger.warning(f"stage message from {message.sender[-8:]} refused: {reason}")
            message.fail(reason)
            try:
                await in_time(wire.write_message(writer, {"status": Status.REJECTED.value,
                                                          "reason": reason[:200]}), 1.0)
            except (TransportError, TimeoutError):
                pass  # the sender is gone or stalled; it will time out on its own
        finally:
            await wire.hang_up(reader, writer, self.timeout)

    def _key(self, header: StageHeader, from_stage: int) -> MicroKey:
        if header.kind in (Kind.SUM, Kind.ABORT):
            return header.step, from_stage
        if header.micro >= self.schedule.micro_batches:
            raise PayloadError(f"micro-batch {header.micro} outside [0, {self.schedule.micro_batches})")
        return header.step, header.micro

    def _expected_tensors(self, header: StageHeader) -> tuple[list[tuple[int, ...]], list[torch.dtype]]:
        """The shapes and element types the header announces, checked against the schedule."""
        s, kind = self.schedule, header.kind
        shapes = [tuple(shape) for shape in header.shapes]
        dtypes = [DTYPES.get(name) for name in header.dtypes]
        if kind is Kind.ACTIVATIONS:
            allowed = [s.id_dtype, s.wire_dtype]
        elif kind is Kind.GRADIENTS:
            allowed = [s.wire_dtype]
        else:
            allowed = [torch.float64]
        if dtypes != allowed or len(shapes) != len(allowed):
            raise PayloadError(f"{kind.value} must carry tensors of types {[str(d) for d in allowed]}")
        if kind is Kind.SUM:
            if len(shapes[0]) != 1 or not 0 < shapes[0][0] <= MAX_ADDENDS:
                raise PayloadError(f"sum of {shapes[0]} addends")
            return shapes, dtypes
        values = shapes[-1]
        if len(values) != 3 or not (0 < values[0] <= s.batch_size and 0 < values[1] <= s.seq_len
                                    and values[2] == s.width):
            raise PayloadError(f"{kind.value} of shape {values}, expected at most ({s.batch_size}, {s.seq_len}, "
                               f"{s.width})")
        if kind is Kind.ACTIVATIONS and shapes[0] != (values[0], values[1] + 1):
            raise PayloadError(f"token ids of shape {shapes[0]} do not frame values of shape {values}")
        return shapes, dtypes

    def _decode(self, kind: Kind, payload: bytes, shapes: list[tuple[int, ...]],
                dtypes: list[torch.dtype]) -> Activations | torch.Tensor:
        tensors, offset = [], 0
        for shape, dtype in zip(shapes, dtypes):
            size = int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size()
            tensors.append(from_bytes(payload[offset : offset + size], dtype, shape))
            offset += size
        values = tensors[-1].float()
        if not torch.isfinite(values).all():
            raise PayloadError(f"{kind.value} hold NaN or Inf values")
        if kind is Kind.SUM and (values < 0).any():
            raise PayloadError("a sum's addends are losses and squared norms: none is negative")
        if kind is not Kind.SUM and values.numel() and float(values.abs().max()) > MAX_BOUNDARY_MAGNITUDE:
            raise PayloadError(f"{kind.value} of magnitude {float(values.abs().max()):.3g}, beyond "
                               f"{MAX_BOUNDARY_MAGNITUDE:.0e}: the forward pass would overflow")
        if kind is Kind.ACTIVATIONS:
            ids = tensors[0].to(torch.int64)
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.schedule.vocab_size):
                raise PayloadError(f"token ids outside [0, {self.schedule.vocab_size})")
            return Activations(tensors[0], tensors[1])
        return tensors[0]


def from_bytes(data: bytes, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """A tensor of ``dtype`` and ``shape`` from raw little-endian bytes (a copy: the message may go away)."""
    carrier = torch.int16 if dtype == torch.bfloat16 else dtype
    array = np.frombuffer(data, dtype=str(carrier).removeprefix("torch."))
    return torch.from_numpy(array.copy()).view(dtype).reshape(tuple(shape))


class RemoteTransport(StageTransport):
    """This stage's links to the other stages of its pipeline, over hivemind streams."""

    def __init__(self, loop: EventLoopThread, server: StageLinkServer, links: StageLinks, stage: int,
                 schedule: Schedule, timeout: float):
        self.loop, self.server, self.links, self.schedule, self.timeout = loop, server, links, schedule, timeout
        self.stage, self.stages = stage, len(links.peers)
        server.join(links, stage, schedule)

    def _push(self, kind: Kind, to_stage: int, key: MicroKey, tensors: Sequence[torch.Tensor],
              **extra: object) -> None:
        header = {"kind": kind.value, "group": self.links.pipeline, "epoch": self.links.epoch, "step": key[0],
                  "micro": key[1], "shapes": [list(t.shape) for t in tensors],
                  "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors], **extra}
        payload = b"".join(tensor_bytes(t) for t in tensors)
        peer = self.links.peers[to_stage]

        # A stream that breaks is sent again on a fresh one: the receiver drops a second copy of what it already
        # has, so a resend after a lost answer is harmless.
        started = time.monotonic()
        push = wire.call(self.server.p2p, peer, self.server.handler_name, header, payload=payload, attempts=2)
        try:
            answer, _ = self.loop.run(in_time(push, self.timeout), self.timeout + 5)
        except (TransportError, TimeoutError) as e:
            raise PipelineError(f"could not send {kind.value} of step {key[0]} to stage {to_stage} "
                                f"({peer[-8:]}): {e!r}") from None
        except PayloadError as e:  # an answer that is not one
            raise PipelineError(f"stage {to_stage} ({peer[-8:]}) answered our {kind.value} with garbage: "
                                f"{e}") from None
        try:
            reply = decode(StageAnswer, answer)
        except PayloadError as e:
            raise PipelineError(f"stage {to_stage} ({peer[-8:]}) answered our {kind.value} with garbage: "
                                f"{e}") from None
        if reply.status is not Status.OK:
            raise PipelineError(f"stage {to_stage} refused our {kind.value}: {reply.reason[:200]}")
        self.bytes_sent += len(payload)
        self.seconds += time.monotonic() - started

    def send_activations(self, key: MicroKey, activations: Activations) -> None:
        self._push(Kind.ACTIVATIONS, self.stage + 1, key, [activations.ids, activations.values])

    def _take(self, mailbox: Mailbox, key: MicroKey, what: str, from_stage: int) -> Any:
        """The message ``key`` from ``from_stage``; while waiting, every PROBE_EVERY seconds, make sure that stage's
        peer can still be reached: one that crashed fails the step at once, not after the whole timeout."""
        started = time.monotonic()
        deadline = started + self.timeout
        peer = self.links.peers[from_stage]
        missed = 0
        while not mailbox.wait(key, min(wire.PROBE_EVERY, max(0.0, deadline - time.monotonic())), what):
            if time.monotonic() >= deadline:
                raise PipelineError(f"no {what} for step {key[0]} micro-batch {key[1]} from stage {from_stage} "
                                    f"within {self.timeout:.0f} s")
            alive = self.loop.run(wire.reachable(self.server.p2p, peer, self.server.handler_name, wire.PROBE_EVERY),
                                  wire.PROBE_EVERY + 5)
            missed = 0 if alive else missed + 1
            if missed >= PROBES_TO_GIVE_UP:
                raise PipelineError(f"stage {from_stage} ({peer[-8:]}) cannot be reached: it has gone")
        self.seconds += time.monotonic() - started
        return mailbox.take(key, 0, what)

    def recv_activations(self, key: MicroKey) -> Activations:
        activations = self._take(self.server.activations, key, "activations", self.stage - 1)
        self.bytes_received += activations.nbytes
        return activations

    def send_gradients(self, key: MicroKey, gradients: torch.Tensor) -> None:
        self._push(Kind.GRADIENTS, self.stage - 1, key, [gradients])

    def recv_gradients(self, key: MicroKey) -> torch.Tensor:
        gradients = self._take(self.server.gradients, key, "gradients", self.stage + 1)
        self.bytes_received += gradients.numel() * gradients.element_size()
        return gradients

    def all_sum(self, step: int, values: Sequence[float]) -> list[float]:
        mine = torch.tensor(list(values), dtype=torch.float64)
        for other in range(self.stages):
            if other != self.stage:
                self._push(Kind.SUM, other, (step, 0), [mine], from_stage=self.stage)
        addends = [mine if s == self.stage else self._take(self.server.sums, (step, s), "sum", s)
                   for s in range(self.stages)]
        for s, addend in enumerate(addends):
            if addend.shape != mine.shape:
                raise PipelineError(f"stage {s} sent {addend.numel()} addends for step {step}, where the pipeline sums "
                                    f"{mine.numel()}")
        return [float(v) for v in torch.stack(addends).sum(0)]  # in stage order: the same on every stage

    def abort(self, step: int, reason: str) -> None:
        for other in range(self.stages):
            if other != self.stage:
                try:
                    self._push(Kind.ABORT, other, (step, 0), [], from_stage=self.stage, reason=reason[:200])
                except PipelineError as e:  # best effort: that stage times out on its own
                    logger.info(f"could not tell stage {other} that step {step} is given up: {e}")
