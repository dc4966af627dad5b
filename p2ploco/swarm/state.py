"""Serving and fetching the swarm's state: how a joining, restarted or lagging peer catches up.

A snapshot is the global state of one named slice (``stage0``, ...: the whole model when it is not cut
into stages) at the start of a round: the slice's parameters plus the outer state every peer holds
alike for them, as the bytes of one safetensors file (its blob). Every node serves byte ranges
of the snapshots of its two latest rounds, one per slice it holds, so a stage peer fetches only its
slice, from any holder: a full replica or the same stage of another group.

No blob is ever made whole, on either side: what is served is a ``Blob`` (a size, ranges read on request, a
manifest), for a snapshot a ``TensorBlob`` that reads each range straight from the published tensors, and for the
round before the latest a ``PatchedBlob`` over the latest one's tensors with what its step changed put back (a
sparse step's few percent of the coordinates, not a second copy of the model); a joiner writes each checked range
into the tensors that the first range's header sized, and trains from them. Anything else served by ranges
against a manifest (a round's update) is a ``Blob`` served the same way.

Nothing a donor says is taken on its word. The state to fetch is the one the swarm vouches for
(``consensus.ranked_states``: by the number of peers whose signed records hold it, never by how far ahead a
claim is), and its hash covers the parameters and the shared outer state alike (``metrics.state_digest``).
Each donor first describes the blob: its size and a manifest, the sha256 of every ``RANGE_BYTES`` of it.
The manifest most donors describe is fetched first, in ranges from all of its donors at once (two streams per
donor, so a donor's link does not idle a round trip per range), and every range is checked against it as it
arrives: a donor whose range does not match is blamed (banned, ``swarm/bans.py``) and its ranges go to the
others. A blob that does not hash to the vouched state when whole (its donors described another one) blames
all of them, and the next manifest is tried. A range that stalls past its deadline (a transfer deadline as in
the butterfly) goes back to the queue, and that donor is not asked again, unblamed.

A range request, a wire message (``swarm/wire.py``) with no payload::

    {v, round: the round the state starts, or -1 for the latest, slice, offset, length: <= 4 MiB,
     blob: state (the default) or update, base: with update, the state digest the update starts from}

answered ``{v, status: ok, round, slice, total, state_digest}`` + the bytes of the range, or, for a length of 0
(the joiner's first question), + the manifest; ``{v, status: moved, round: the latest held}``; or
``{v, status: empty}`` (no state of that slice, or no update from that base). A range starts at a multiple of
``RANGE_BYTES``. The same requests, ranges and manifests serve a round's update (``swarm/updates.py``: what a peer
that missed a few rounds fetches instead of the state); its answer's ``round`` is the round the update starts,
its ``state_digest`` the state it leads to.
"""

from __future__ import annotations

import asyncio
import bisect
import enum
import hashlib
import json
import logging
import math
import struct
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Protocol

import numpy as np
import torch
from hivemind.p2p import P2P
from pydantic import Field

from p2ploco import faults
from p2ploco.errors import PayloadError, SwarmError, TransportError
from p2ploco.metrics import state_digest
from p2ploco.swarm import wire
from p2ploco.swarm.consensus import SwarmState
from p2ploco.swarm.deadlines import TransferDeadline
from p2ploco.swarm.messages import MAX_ROUND, Digest, Message, Round, SliceName, decode, status_of
from p2ploco.tensorfile import header, raw_bytes

logger = logging.getLogger(__name__)

RANGE_BYTES = 1 << 20  # the manifest's grain: each range of this size is hashed on its own
PART_BYTES = 4 << 20  # the most a donor serves in one answer: whole ranges
MAX_STATE_BYTES = 1 << 36  # the largest state of one slice a donor may describe
MAX_MANIFEST_BYTES = 32 * (MAX_STATE_BYTES // RANGE_BYTES)
MAX_BLOB_HEADER = 1 << 20  # a snapshot's safetensors header (names, shapes, offsets) is far smaller
STREAMS_PER_DONOR = 2  # ranges in flight per donor: one is served while the other crosses the wire
KEEP_SNAPSHOTS = 2
LATEST = -1  # ask for whatever round the donor has last

Blame = Callable[[str, str], None]  # (donor, what it did): a donor that served or described a state falsely


class BlobKind(enum.StrEnum):
    STATE = "state"  # a slice's state at the start of a round (``Snapshot``)
    UPDATE = "update"  # what a round changed in a slice's state (``swarm/updates.py``)


class StateStatus(enum.StrEnum):
    OK = "ok"  # the state's description, and the range asked for (or its manifest)
    MOVED = "moved"  # the donor no longer (or not yet) holds that round
    EMPTY = "empty"  # the donor holds no state yet


class Blob(Protocol):
    """Bytes a node serves by ranges against a manifest (a snapshot's ``TensorBlob``): read where they lie, never
    made whole."""

    total: int  # bytes

    def read(self, offset: int, length: int) -> bytes:
        """Bytes ``offset`` .. ``offset + length`` (clipped at ``total``)."""

    def manifest(self) -> bytes:
        """The sha256 of every RANGE_BYTES of the bytes, one after the other."""


class BytesBlob:
    """Bytes served or received whole (a round's update: a few percent of a state's bytes), with their manifest
    (or the one given)."""

    def __init__(self, data: bytes | bytearray, manifest: bytes | None = None):
        self.data, self.total, self._manifest = data, len(data), manifest

    def read(self, offset: int, length: int) -> bytes:
        return bytes(self.data[offset : offset + length])

    def manifest(self) -> bytes:
        if self._manifest is None:
            self._manifest = b"".join(hashlib.sha256(self.data[at : at + RANGE_BYTES]).digest()
                                      for at in range(0, self.total, RANGE_BYTES))
        return self._manifest

    @classmethod
    def receive(cls, head: bytes, total: int) -> BytesBlob:
        """``total`` bytes, the first of them ``head``, to ``write`` the rest into."""
        blob = cls(bytearray(total))
        blob.write(0, head)
        return blob

    def write(self, offset: int, data: bytes) -> None:
        self.data[offset : offset + len(data)] = data


class TensorBlob:
    """The bytes of a safetensors file of named float32 tensors, sorted by name, as safetensors' own ``save`` lays
    them out (``p2ploco/tensorfile.py``), read straight from the tensors' storage: a range is slices of them and
    the manifest is hashed from them, so no copy of the whole is ever made. The tensors must not be written while
    it is read (a published state is never written, ``outer/base.py``).

    ``receive`` is the other direction: a header checked to be one this class writes, tensors allocated for it,
    and ranges written into them as they arrive."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.names = sorted(tensors)
        self.tensors = [tensors[name].detach() for name in self.names]
        if any(t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous() for t in self.tensors):
            raise ValueError("a TensorBlob holds contiguous float32 CPU tensors")
        self.head = header([(name, torch.float32, tuple(t.shape)) for name, t in zip(self.names, self.tensors)])
        self.starts: list[int] = []  # where each tensor's bytes begin in the blob
        at = len(self.head)
        for tensor in self.tensors:
            self.starts.append(at)
            at += tensor.numel() * 4
        self.total = at
        self._manifest: bytes | None = None

    def _pieces(self, offset: int, length: int) -> Iterator[memoryview]:
        """The bytes ``offset`` .. ``offset + length`` as views of the header and the tensors, in order."""
        end = min(offset + length, self.total)
        if offset < len(self.head):
            yield memoryview(self.head)[offset:min(end, len(self.head))]
        first = max(0, bisect.bisect_right(self.starts, offset) - 1)
        for start, tensor in zip(self.starts[first:], self.tensors[first:]):
            if start >= end:
                break
            stop = start + tensor.numel() * 4
            if stop > offset:
                data = raw_bytes(tensor)
                yield data[max(offset, start) - start:min(end, stop) - start]

    def read(self, offset: int, length: int) -> bytes:
        return b"".join(self._pieces(offset, length))

    def manifest(self) -> bytes:
        if self._manifest is None:
            hashes = []
            for at in range(0, self.total, RANGE_BYTES):
                digest = hashlib.sha256()
                for piece in self._pieces(at, RANGE_BYTES):
                    digest.update(piece)
                hashes.append(digest.digest())
            self._manifest = b"".join(hashes)
        return self._manifest

    @classmethod
    def receive(cls, head: bytes, total: int) -> TensorBlob:
        """A blob of ``total`` bytes whose first bytes are ``head`` (at least its whole header), with zeroed tensors to
        ``write`` the rest into; PayloadError unless the header is exactly one this class writes (float32 tensors
        named ``param/...`` or ``shared/...``, in order, filling ``total``)."""
        if len(head) < 8:
            raise PayloadError("a state blob shorter than its header length")
        size = struct.unpack("<Q", head[:8])[0]
        if size > min(MAX_BLOB_HEADER, len(head) - 8):
            raise PayloadError(f"a state blob header of {size} bytes (at most {MAX_BLOB_HEADER}, within the first "
                               f"range)")
        try:
            described = json.loads(head[8:8 + size])
            names = list(described)
            shapes = [tuple(described[name]["shape"]) for name in names]
            if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for shape in shapes for d in shape):
                raise TypeError("a shape is not a list of sizes")
        except (ValueError, TypeError, KeyError, AttributeError, UnicodeDecodeError) as e:
            raise PayloadError(f"state blob header is malformed: {e}") from None
        # one canonical form, the one honest donors write: its offsets, order and dtypes are sound
        if header([(name, torch.float32, shape) for name, shape in zip(names, shapes)]) != head[:8 + size]:
            raise PayloadError("state blob header is not one of float32 tensors in order")
        for name in names:
            section, _, tensor_name = name.partition("/")
            if section not in ("param", "shared") or not tensor_name:
                raise PayloadError(f"state blob holds an unexpected tensor {name[:64]!r}")
        if 8 + size + 4 * sum(math.prod(shape) for shape in shapes) != total:
            raise PayloadError(f"state blob header describes other than its {total} bytes")
        blob = cls({name: torch.zeros(shape, dtype=torch.float32) for name, shape in zip(names, shapes)})
        blob.write(0, head)
        return blob

    def write(self, offset: int, data: bytes) -> None:
        """``data`` (checked already) into the tensors at ``offset``; bytes of the header are not written."""
        view = memoryview(data)
        for piece in self._pieces(offset, len(data)):
            if piece.obj is not self.head:
                piece[:] = view[:len(piece)]
            view = view[len(piece):]


@dataclass
class Snapshot:
    round: int  # the round this state starts
    slice: str  # the slice these parameters make up
    params: dict[str, torch.Tensor]  # CPU tensors that nobody writes (a published state, or fetched)
    shared: dict[str, torch.Tensor]
    state_digest: str  # ``metrics.state_digest`` of params and shared: what the records vouch for
    served: Blob | None = field(default=None, repr=False)  # its bytes as served: a TensorBlob of its tensors

    def blob(self) -> Blob:
        """Its bytes, read range by range from its tensors (made on first request)."""
        if self.served is None:
            tensors = {f"param/{k}": v for k, v in self.params.items()}
            tensors.update({f"shared/{k}": v for k, v in self.shared.items()})
            self.served = TensorBlob(tensors)
        return self.served

    @classmethod
    def of_blob(cls, round_index: int, slice_name: str, blob: TensorBlob) -> Snapshot:
        """The snapshot whose tensors ``blob`` (received, ``TensorBlob.receive``) holds; PayloadError unless they
        are finite."""
        params, shared = {}, {}
        for key, tensor in zip(blob.names, blob.tensors):
            section, _, name = key.partition("/")
            if not torch.isfinite(tensor).all():
                raise PayloadError(f"state tensor {key[:64]!r} is not finite")
            (params if section == "param" else shared)[name] = tensor
        return cls(round_index, slice_name, params, shared, state_digest(params, shared), blob)

    @classmethod
    def from_blob(cls, round_index: int, slice_name: str, blob: bytes) -> Snapshot:
        """The snapshot in ``blob`` (whole); PayloadError if it is not one (not such a safetensors file)."""
        received = TensorBlob.receive(blob[:RANGE_BYTES], len(blob))
        received.write(0, blob)
        return cls.of_blob(round_index, slice_name, received)


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
        await self.p2p.add_binary_stream_handler(self.handler_name, self._serve)

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
            header, _ = await asyncio.wait_for(wire.read_message(reader, max_payload=0), self.deadline.base)
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
            await asyncio.wait_for(wire.write_message(writer, answer, payload), self.deadline.seconds(len(payload)))

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


class StateRequest(Message):
    round: Annotated[int, Field(ge=LATEST, le=MAX_ROUND)]
    slice: SliceName
    offset: Annotated[int, Field(ge=0, le=MAX_STATE_BYTES)]
    length: Annotated[int, Field(ge=0, le=PART_BYTES)]  # 0: the joiner's first question
    blob: status_of(BlobKind) = BlobKind.STATE  # a peer that does not send it asks for the state
    base: Digest = ""  # with an update: the state digest it starts from


class StateAnswer(Message):
    status: status_of(StateStatus)
    round: Round = 0  # with ok: the state's round; with moved: the latest the donor holds
    slice: SliceName = "-"
    total: Annotated[int, Field(ge=0, le=MAX_STATE_BYTES)] = 0  # with ok: the blob's size
    state_digest: Digest = ""


@dataclass(frozen=True)
class Description:
    """What a donor says of the blob of the state asked for: its size and the hash of every range."""

    total: int
    manifest: bytes

    def range_hash(self, offset: int) -> bytes:
        at = 32 * (offset // RANGE_BYTES)
        return self.manifest[at : at + 32]


def parse_description(header: dict[str, Any], payload: bytes, target: SwarmState) -> Description | None:
    """A donor's description of ``target``'s blob, or None if the donor holds another state; PayloadError if the
    answer is malformed (a manifest that does not fit the size it states)."""
    answer = decode(StateAnswer, header)
    if not _answers_for(answer, target):
        return None
    if len(payload) != 32 * -(-answer.total // RANGE_BYTES):
        raise PayloadError(f"a manifest of {len(payload)} bytes for a {answer.total}-byte state")
    return Description(answer.total, payload)


def _answers_for(answer: StateAnswer, target: SwarmState) -> bool:
    return answer.status == StateStatus.OK and (answer.round, answer.slice, answer.state_digest) == (
        target.round, target.slice, target.state_digest)


async def request_range(p2p: P2P, handler: str, donor: str, round_index: int, slice_name: str, offset: int,
                        length: int, timeout: float, base: str | None = None) -> tuple[dict[str, Any], bytes]:
    """One range of a donor's blob (length 0: its description), of the state of ``round_index`` or, given
    ``base``, of the update from the state of that digest."""
    request = {"round": round_index, "slice": slice_name, "offset": offset, "length": length}
    if base is not None:
        request.update(blob=BlobKind.UPDATE, base=base)
    limit = length or MAX_MANIFEST_BYTES
    return await asyncio.wait_for(wire.call(p2p, donor, handler, request, max_payload=limit), timeout)


async def served_state(p2p: P2P, handler: str, claim: SwarmState, timeout: float) -> SwarmState | None:
    """The latest state of ``claim``'s slice that its lone holder serves, if it is the claimed one or a later round's
    (a peer whose rounds are short may be past what its record last said by the time it is asked); None if the
    holder serves neither (a record that claims what its peer does not serve is not followed)."""
    donor = claim.holders[0]
    try:
        header, payload = await request_range(p2p, handler, donor, LATEST, claim.slice, 0, 0, timeout)
        answer = decode(StateAnswer, header)
        served = SwarmState(answer.round, claim.slice, answer.state_digest, (donor,))
        if answer.round < claim.round or (answer.round == claim.round and answer.state_digest != claim.state_digest):
            return None
        return served if parse_description(header, payload, served) is not None else None
    except (PayloadError, TransportError, TimeoutError):
        return None


async def fetch_state(p2p: P2P, handler: str, target: SwarmState, donors: Sequence[str], deadline: TransferDeadline,
                      tensor_bytes: int, blame: Blame, rates: Sequence[float] = ()) -> Snapshot:
    """Download ``target`` (a slice's state at the start of a round) from ``donors``; SwarmError if they cannot.
    ``tensor_bytes``: those of this peer's own state of the slice, which an honest blob holds plus a header (a
    donor that describes more is malformed: it would have this peer download and hold junk). ``blame`` is told
    of every donor that described or served the state falsely. A range may
    take as long as its bytes need at the slowest of ``rates`` (the donors' stated links), within ``deadline``'s
    floor and cap: a slow donor is not mistaken for a stalled one."""
    started = time.monotonic()

    async def describe(donor: str) -> Description | None:
        try:
            header, payload = await request_range(p2p, handler, donor, target.round, target.slice, 0, 0,
                                                  deadline.seconds(MAX_MANIFEST_BYTES, rates))
            description = parse_description(header, payload, target)
            if description is not None and description.total > tensor_bytes + MAX_BLOB_HEADER:
                raise PayloadError(f"a {description.total}-byte state where {tensor_bytes} bytes of tensors fit "
                                   f"this model")
            return description
        except PayloadError as e:
            blame(donor, f"it described {target.slice} of round {target.round} falsely ({e})")
        except (TransportError, TimeoutError) as e:  # unreachable or slow donors are skipped, unblamed
            logger.info(f"donor {donor[-8:]} did not describe its state: {e!r}")
        return None

    # 1. What each donor says the blob is: donors that agree on it are tried together, the most agreed-on first.
    described = dict(zip(donors, await asyncio.gather(*(describe(donor) for donor in donors))))
    candidates: dict[Description, list[str]] = {}
    for donor, description in described.items():
        if description is not None:
            candidates.setdefault(description, []).append(donor)
    ranked = sorted(candidates.items(), key=lambda item: (-len(item[1]), hashlib.sha256(item[0].manifest).digest()))
    # 2. Its ranges from all of them at once, each checked as it comes; then the whole against the vouched hash.
    for description, agreeing in ranked:
        try:
            blob = await fetch_blob(p2p, handler, target, description, agreeing, deadline, blame, rates)
            if blob is None:
                continue
            snapshot = Snapshot.of_blob(target.round, target.slice, blob)
            if snapshot.state_digest != target.state_digest:
                raise PayloadError("its contents do not hash to the state the swarm vouches for")
        except PayloadError as e:  # every range matched the manifest: the manifest itself was false
            for donor in agreeing:
                blame(donor, f"it described {target.slice} of round {target.round} falsely ({e})")
            continue
        for donor, other in described.items():  # it described the vouched state, and the state is not that
            if other is not None and other != description:
                blame(donor, f"it described {target.slice} of round {target.round} falsely (another manifest)")
        logger.info(f"fetched {description.total / 1e6:.1f} MB of {target.slice} from {len(agreeing)} donors in "
                    f"{time.monotonic() - started:.1f} s")
        return snapshot
    raise SwarmError(f"no donor served {target.slice} of round {target.round} with the vouched hash "
                     f"({len(candidates)} description(s) from {sum(d is not None for d in described.values())} of "
                     f"{len(donors)} donors)")


async def fetch_blob(p2p: P2P, handler: str, target: SwarmState, description: Description, donors: list[str],
                     deadline: TransferDeadline, blame: Blame, rates: Sequence[float], base: str | None = None
                     ) -> TensorBlob | BytesBlob | None:
    """The blob ``description`` describes, from ``donors``, every range checked against its manifest and written
    into the blob's tensors as it arrives (the first part, which holds the header that sizes them, before the
    others); None if they all failed, stalled or served something else. PayloadError if the header its manifest
    vouches for is not one of a state (the description is false). ``base``: the blob is the update from the state
    of that digest (``target``: the round it starts and the state it leads to), received whole as bytes."""
    total = description.total
    if total < 8:
        raise PayloadError(f"a {total}-byte state blob: shorter than its header length")
    # Parts (whole ranges) small enough that every stream of every donor gets work, large enough to keep overheads
    # low.
    wanted = -(-total // (STREAMS_PER_DONOR * len(donors)))
    part = min(PART_BYTES, max(RANGE_BYTES, -(-wanted // RANGE_BYTES) * RANGE_BYTES))
    offsets = list(range(0, total, part))
    working = list(donors)

    async def fetch_part(donor: str, offset: int) -> bytes | None:
        """The part at ``offset`` from ``donor``, checked; None (and the donor dropped) if it failed to serve it."""
        length = min(part, total - offset)
        try:
            header, data = await request_range(p2p, handler, donor, target.round, target.slice, offset, length,
                                               deadline.seconds(length, rates), base)
            if not _answers_for(decode(StateAnswer, header), target):
                raise PayloadError("it answered for another state")
            if len(data) != length or any(hashlib.sha256(data[at : at + RANGE_BYTES]).digest()
                                          != description.range_hash(offset + at)
                                          for at in range(0, length, RANGE_BYTES)):
                raise PayloadError(f"bytes {offset}+{length} do not match the manifest it described")
            return data
        except PayloadError as e:
            blame(donor, f"it served {target.slice} of round {target.round} falsely ({e})")
        except (TransportError, TimeoutError) as e:
            logger.info(f"donor {donor[-8:]} failed on range {offset}: {e!r}; leaving it to the others")
        if donor in working:
            working.remove(donor)
        return None

    head = None
    while head is None and working:
        head = await fetch_part(working[0], 0)
    if head is None:
        logger.info(f"download of {target.slice} of round {target.round} from {len(donors)} donor(s) failed")
        return None
    blob = TensorBlob.receive(head, total) if base is None else BytesBlob.receive(head, total)
    parts: asyncio.Queue[int | None] = asyncio.Queue()
    for offset in offsets[1:]:
        parts.put_nowait(offset)
    received = 1

    def release_all() -> None:  # wake every waiting worker: all ranges are in, or nobody is left to fetch
        for _ in range(STREAMS_PER_DONOR * len(donors)):
            parts.put_nowait(None)

    async def worker(donor: str) -> None:
        nonlocal received
        while (offset := await parts.get()) is not None:
            if donor not in working:  # its other stream failed: leave the range to the other donors
                parts.put_nowait(offset)
                return
            data = await fetch_part(donor, offset)
            if data is None:
                parts.put_nowait(offset)
                if not working:
                    release_all()
                return
            blob.write(offset, data)
            received += 1
            if received == len(offsets):
                release_all()

    if received < len(offsets):
        await asyncio.gather(*(worker(donor) for donor in list(working) for _ in range(STREAMS_PER_DONOR)))
    if received != len(offsets):
        logger.info(f"download of {target.slice} of round {target.round} from {len(donors)} donor(s) failed")
        return None
    return blob
