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

What a state is (its blobs, its snapshot, the messages) is here; serving it is ``swarm/state_server.py``, fetching
it ``swarm/state_fetch.py``.
"""

from __future__ import annotations

import bisect
import enum
import hashlib
import json
import logging
import math
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Annotated, Protocol

import torch
from pydantic import Field

from p2ploco.errors import PayloadError
from p2ploco.metrics import state_digest
from p2ploco.swarm.messages import MAX_ROUND, Digest, Message, Round, SliceName, status_of
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
