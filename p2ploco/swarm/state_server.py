"""The serving side of the swarm's state (``swarm/state.py``): every node serves byte ranges of the snapshots of its
two latest rounds, the one before the latest as a ``PatchedBlob`` over the latest's tensors, and the updates that it
keeps (``swarm/updates.py``)."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from hivemind.p2p import P2P

from p2ploco import faults
from p2ploco.aio import in_time
from p2ploco.errors import PayloadError
from p2ploco.swarm import wire
from p2ploco.swarm.deadlines import TransferDeadline
from p2ploco.swarm.messages import decode
from p2ploco.swarm.state import (
    KEEP_SNAPSHOTS,
    LATEST,
    PART_BYTES,
    RANGE_BYTES,
    Blob,
    BlobKind,
    Snapshot,
    StateRequest,
    StateStatus,
    TensorBlob,
)

logger = logging.getLogger(__name__)


@dataclass
class Served:
    """A state a node serves: its round, slice and hash, and its bytes."""

    round: int
    slice: str
    state_digest: str
    blob: Blob


class PatchedBlob:
    """An earlier round's state served from a later one's tensors with what the step changed put back: its bytes
    are ``base``'s (a TensorBlob of the later tensors, or of the earlier ones where a step changed most of a tensor)
    with, in each tensor ``i`` of ``patches``, the float32 ``values`` at the sorted flat positions ``at``. A sparse
    outer step (SparseLoCo's) changes a few percent of the coordinates: the earlier round costs those, not a second
    copy of the model."""

    def __init__(self, base: TensorBlob, patches: dict[int, tuple[torch.Tensor, torch.Tensor]],
                 manifest: bytes | None = None):
        """``manifest``: the earlier state's, if it was computed already."""
        self.base, self.patches, self.total = base, patches, base.total
        self._manifest = manifest

    def read(self, offset: int, length: int) -> bytes:
        out = bytearray(self.base.read(offset, length))
        view = np.frombuffer(out, dtype=np.uint8)
        for i, (at, values) in self.patches.items():
            start, numel = self.base.starts[i], self.base.tensors[i].numel()
            first, last = max(0, (offset - start) // 4), min(numel, -(-(offset + len(out) - start) // 4))
            if first >= last:
                continue
            lo, hi = np.searchsorted(at.numpy(), [first, last])
            where = (start - offset + 4 * at[lo:hi].numpy())[:, None] + np.arange(4)  # each value's 4 bytes
            put = values[lo:hi].numpy().view(np.uint8).reshape(-1, 4)
            inside = (where >= 0) & (where < len(out))
            view[where[inside]] = put[inside]
        return bytes(out)

    def manifest(self) -> bytes:
        if self._manifest is None:
            self._manifest = b"".join(hashlib.sha256(self.read(at, RANGE_BYTES)).digest()
                                      for at in range(0, self.total, RANGE_BYTES))
        return self._manifest


def demoted(earlier: Served, later: Served) -> Served:
    """``earlier`` (a TensorBlob's state) served from ``later``'s tensors where they differ from its own in at most
    a third of their elements (``PatchedBlob``), so that it no longer holds the earlier tensors that differ little;
    ``earlier`` itself where the two are not of the same tensors."""
    old, new = earlier.blob, later.blob
    if not (isinstance(old, TensorBlob) and isinstance(new, TensorBlob)) or old.head != new.head:
        return earlier
    tensors, patches = {}, {}
    for i, (name, was, now) in enumerate(zip(old.names, old.tensors, new.tensors)):
        if was.data_ptr() == now.data_ptr():  # the same storage (their shapes are the same): one tensor
            tensors[name] = now
            continue
        at = torch.nonzero(was.view(-1).view(torch.int32) != now.view(-1).view(torch.int32)).view(-1)
        if len(at) > was.numel() // 3:  # positions and values would cost more than the tensor
            tensors[name] = was
            continue
        tensors[name] = now
        if len(at):
            patches[i] = (at, was.view(-1)[at])
    return Served(earlier.round, earlier.slice, earlier.state_digest,
                  PatchedBlob(TensorBlob(tensors), patches, old._manifest))


def no_updates(slice_name: str, base: str) -> Served | None:
    """What a server that keeps no updates finds: none."""
    return None


class StateServer:
    def __init__(self, p2p: P2P, run_id: str, deadline: TransferDeadline,
                 updates: Callable[[str, str], Served | None] = no_updates):
        """``updates``: the update of a slice from a state digest that this peer keeps, if any
        (``UpdateKeeper.find``)."""
        self.p2p, self.deadline, self.updates = p2p, deadline, updates
        self.handler_name = f"p2ploco/{run_id}/state"
        self.snapshots: OrderedDict[int, dict[str, Served]] = OrderedDict()  # round -> slice -> what is served
        self._latest: dict[str, Served] = {}  # slice -> the last prepared (``prepare_round``'s thread alone)

    async def start(self) -> None:
        await self.p2p.add_binary_stream_handler(self.handler_name, faults.seam("answer.state", self, self._serve))

    def prepare_round(self, snapshots: list[Snapshot],
                      ) -> tuple[list[Served], list[tuple[Served, Served | None]]]:
        """What serving the snapshots of one round (one per slice held) takes, made on the calling thread (always
        the same one, not the loop's): each as served, and the round before it, still served, as served from this
        one's tensors where they differ little (``demoted``), so that its own tensors are let go before this
        returns rather than beside whatever the caller does next (an eval, a checkpoint); an earlier round than the
        one before (a catch-up jumped past it) is no longer served (None). For ``hold``."""
        served = [Served(s.round, s.slice, s.state_digest, s.blob()) for s in snapshots]
        demotions: list[tuple[Served, Served | None]] = []
        for now in served:
            was = self._latest.get(now.slice)
            if was is not None and was.round == now.round - 1:
                demotions.append((was, demoted(was, now)))
            elif was is not None and was.round < now.round:  # left behind by a catch-up: nobody fetches it
                demotions.append((was, None))
            self._latest[now.slice] = now
        return served, demotions

    def hold(self, served: list[Served], demotions: list[tuple[Served, Served | None]]) -> None:
        """Serve ``prepare_round``'s result (call on the loop); rounds beyond KEEP_SNAPSHOTS are dropped, oldest
        first. A peer that changes the slices it holds (a stage peer that moves) serves the new ones from this round
        on."""
        for now in served:
            self.snapshots.setdefault(now.round, {})[now.slice] = now
        for was, now in demotions:
            held = self.snapshots.get(was.round, {})
            if held.get(was.slice) is was and now is not None:
                held[was.slice] = now
            elif held.get(was.slice) is was:
                del held[was.slice]
                if not held:
                    del self.snapshots[was.round]
        while len(self.snapshots) > KEEP_SNAPSHOTS:
            self.snapshots.popitem(last=False)

    async def _serve(self, stream_info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async with wire.serving(logger, "state request", str(stream_info.peer_id), reader, writer,
                                self.deadline.seconds(PART_BYTES)):
            header, _ = await in_time(wire.read_message(reader, max_payload=0), self.deadline.base)
            request = decode(StateRequest, header)
            snapshot = self._find(request)
            if isinstance(snapshot, dict):  # the answer that it holds none
                await wire.write_message(writer, snapshot)
                return
            loop, blob = asyncio.get_running_loop(), snapshot.blob
            if request.offset % RANGE_BYTES or request.offset > blob.total:
                raise PayloadError(f"bad range {request.offset}+{request.length} of a {blob.total}-byte state")
            if request.length:  # a range
                await faults.hit_async("state.serve", snapshot.round)
                payload = blob.read(request.offset, request.length)
            else:  # the joiner's first question: how big, and the hash of every range
                payload = await loop.run_in_executor(None, blob.manifest)
            answer = {"status": StateStatus.OK, "round": snapshot.round, "slice": snapshot.slice, "total": blob.total,
                      "state_digest": snapshot.state_digest}
            await in_time(wire.write_message(writer, answer, payload), self.deadline.seconds(len(payload)))

    def _find(self, request: StateRequest) -> Served | dict[str, Any]:
        """What ``request`` asks for, or the answer that this peer does not hold it."""
        if request.blob == BlobKind.UPDATE:
            update = self.updates(request.slice, request.base)
            if update is None or request.round not in (LATEST, update.round):
                return {"status": StateStatus.EMPTY}
            return update
        rounds = [r for r, held in self.snapshots.items() if request.slice in held]
        if not rounds:
            return {"status": StateStatus.EMPTY}
        round_held = rounds[-1] if request.round == LATEST else request.round
        if round_held not in rounds:
            return {"status": StateStatus.MOVED, "round": rounds[-1]}
        return self.snapshots[round_held][request.slice]
