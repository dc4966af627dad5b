"""Serving and fetching the swarm's state: how a joining, restarted or lagging peer catches up.

A snapshot is the global state of one named slice (``stage0``, ...: the whole model when it is not cut
into stages) at the start of a round: the slice's parameters plus the outer state every peer holds
alike for them, serialized (on first request) as one safetensors blob. Every node serves byte ranges
of the snapshots of its two latest rounds, one per slice it holds, so a stage peer fetches only its
slice, from any holder: a full replica or the same stage of another group. A peer catching up fetches
ranges from all donors at once, two streams per donor (so a donor's link does not idle a round trip
per range), spreading the load; a range that fails or stalls past its deadline goes back in the queue
for another donor, and that donor is not asked again. The blob's sha256, reported by every donor, and
the slice's hash, published in the donors' peer records, are both checked.

A range request, a wire message (``swarm/wire.py``) with no payload::

    {v, round: the round the state starts, or -1 for the latest, slice, offset, length: <= 4 MiB}

answered ``{v, status: ok, round, slice, total, sha256, params_sha256}`` + the bytes of the range (none
for a length of 0: the joiner's first question), ``{v, status: moved, round: the latest held}``, or
``{v, status: empty}`` (no state of that slice).
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any

import torch
from hivemind.p2p import P2P
from pydantic import Field
from safetensors import SafetensorError
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from p2ploco import faults
from p2ploco.errors import PayloadError, SwarmError, TransportError
from p2ploco.metrics import params_sha256
from p2ploco.swarm import wire
from p2ploco.swarm.deadlines import TransferDeadline
from p2ploco.swarm.messages import MAX_ROUND, Digest, Message, Round, SliceName, decode, status_of
from p2ploco.swarm.records import SwarmState

logger = logging.getLogger(__name__)

PART_BYTES = 4 << 20  # the largest range a donor serves in one answer
MAX_STATE_BYTES = 1 << 36  # the largest state of one slice a donor may describe (its ranges are listed up front)
MIN_PART_BYTES = 64 << 10
STREAMS_PER_DONOR = 2  # ranges in flight per donor: one is served while the other crosses the wire
KEEP_SNAPSHOTS = 2
LATEST = -1  # ask for whatever round the donor has last


class StateStatus(enum.StrEnum):
    OK = "ok"  # the state's description, and the range asked for
    MOVED = "moved"  # the donor no longer (or not yet) holds that round
    EMPTY = "empty"  # the donor holds no state yet


@dataclass
class Snapshot:
    round: int  # the round this state starts
    slice: str  # the slice these parameters make up
    params: dict[str, torch.Tensor]  # CPU copies, owned by the snapshot
    shared: dict[str, torch.Tensor]
    params_sha256: str
    _blob: bytes | None = field(default=None, repr=False)

    def blob(self) -> bytes:
        if self._blob is None:
            tensors = {f"param/{k}": v for k, v in self.params.items()}
            tensors.update({f"shared/{k}": v for k, v in self.shared.items()})
            self._blob = save_tensors(tensors)
        return self._blob

    @classmethod
    def from_blob(cls, round_index: int, slice_name: str, blob: bytes) -> Snapshot:
        """The snapshot in ``blob``; PayloadError if it is not a snapshot (not safetensors, or other sections)."""
        try:
            tensors = load_tensors(blob)
        except (SafetensorError, ValueError, TypeError, OverflowError) as e:  # what safetensors raises on garbage
            raise PayloadError(f"state blob is not a safetensors file: {e}") from None
        params, shared = {}, {}
        for key, tensor in tensors.items():
            section, _, name = key.partition("/")
            if section not in ("param", "shared") or not name:
                raise PayloadError(f"state blob holds an unexpected tensor {key[:64]!r}")
            if tensor.dtype != torch.float32 or (section == "param" and not torch.isfinite(tensor).all()):
                raise PayloadError(f"state tensor {key[:64]!r} is not finite float32")
            (params if section == "param" else shared)[name] = tensor
        return cls(round_index, slice_name, params, shared, params_sha256(list(params), params.values()), blob)


class StateServer:
    def __init__(self, p2p: P2P, run_id: str, deadline: TransferDeadline):
        self.p2p, self.deadline = p2p, deadline
        self.handler_name = f"p2ploco/{run_id}/state"
        self.snapshots: OrderedDict[int, dict[str, Snapshot]] = OrderedDict()  # round -> slice -> snapshot
        self._blob_hashes: dict[tuple[int, str], str] = {}  # sha256 of each serialized snapshot, computed once

    async def start(self) -> None:
        await self.p2p.add_binary_stream_handler(self.handler_name, self._serve)

    def publish(self, snapshots: list[Snapshot]) -> None:
        """Serve the snapshots of one round, one per slice held (call on the loop); rounds beyond KEEP_SNAPSHOTS
        are dropped, oldest first. A peer that changes the slices it holds (a stage peer that moves) serves the
        new ones from this round on."""
        for snapshot in snapshots:
            self.snapshots.setdefault(snapshot.round, {})[snapshot.slice] = snapshot
        while len(self.snapshots) > KEEP_SNAPSHOTS:
            dropped, _ = self.snapshots.popitem(last=False)
            self._blob_hashes = {key: value for key, value in self._blob_hashes.items() if key[0] != dropped}

    async def _describe(self, snapshot: Snapshot) -> tuple[bytes, str]:
        loop = asyncio.get_running_loop()
        blob = await loop.run_in_executor(None, snapshot.blob)
        key = (snapshot.round, snapshot.slice)
        if key not in self._blob_hashes:
            self._blob_hashes[key] = await loop.run_in_executor(None, lambda: hashlib.sha256(blob).hexdigest())
        return blob, self._blob_hashes[key]

    async def _serve(self, stream_info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            header, _ = await asyncio.wait_for(wire.read_message(reader, max_payload=0), self.deadline.base)
            request = decode(StateRequest, header)
            wanted, slice_name, offset, length = request.round, request.slice, request.offset, request.length
            rounds = [r for r, held in self.snapshots.items() if slice_name in held]
            if not rounds:
                await wire.write_message(writer, {"status": StateStatus.EMPTY})
                return
            round_held = rounds[-1] if wanted == LATEST else wanted
            if round_held not in rounds:
                await wire.write_message(writer, {"status": StateStatus.MOVED, "round": rounds[-1]})
                return
            snapshot = self.snapshots[round_held][slice_name]
            blob, blob_sha = await self._describe(snapshot)
            if offset > len(blob):
                raise PayloadError(f"bad range {offset}+{length} of a {len(blob)}-byte state")
            if length:  # a range, not the joiner's first question (which round, how big)
                await faults.hit_async("state.serve", snapshot.round)
            header = {"status": StateStatus.OK, "round": snapshot.round, "slice": snapshot.slice, "total": len(blob),
                      "sha256": blob_sha, "params_sha256": snapshot.params_sha256}
            await asyncio.wait_for(wire.write_message(writer, header, blob[offset : offset + length]),
                                   self.deadline.seconds(length))
        except PayloadError as e:  # a bad request never hurts the donor
            logger.info(f"malformed state request from {str(stream_info.peer_id)[-8:]}: {e}")
        except (TransportError, TimeoutError) as e:  # nor a vanished joiner
            logger.info(f"state request from {str(stream_info.peer_id)[-8:]} broke off: {e!r}")
        except Exception:  # a bug: keep serving, and say where it is
            logger.exception(f"state request from {str(stream_info.peer_id)[-8:]} failed unexpectedly")
        finally:
            await wire.hang_up(reader, writer, self.deadline.seconds(PART_BYTES))


async def _request(p2p: P2P, handler: str, donor: str, round_index: int, slice_name: str, offset: int, length: int,
                   timeout: float) -> tuple[dict[str, Any], bytes]:
    request = {"round": round_index, "slice": slice_name, "offset": offset, "length": length}
    return await asyncio.wait_for(wire.call(p2p, donor, handler, request, max_payload=PART_BYTES), timeout)


class StateRequest(Message):
    round: Annotated[int, Field(ge=LATEST, le=MAX_ROUND)]
    slice: SliceName
    offset: Annotated[int, Field(ge=0, le=MAX_STATE_BYTES)]
    length: Annotated[int, Field(ge=0, le=PART_BYTES)]  # 0: the joiner's first question


class StateAnswer(Message):
    status: status_of(StateStatus)
    round: Round = 0  # with ok: the state's round; with moved: the latest the donor holds
    slice: SliceName = "-"
    total: Annotated[int, Field(ge=0, le=MAX_STATE_BYTES)] = 0  # with ok: the blob's size and sha256
    sha256: Digest = ""
    params_sha256: Digest = ""


def parse_description(header: dict[str, Any], round_index: int, slice_name: str,
                      params_sha256: str) -> tuple[int, str] | None:
    """The blob size and sha256 a donor describes for the state of ``slice_name`` (``round_index``,
    ``params_sha256``), or None if it holds another state; PayloadError if the answer is malformed."""
    answer = decode(StateAnswer, header)
    if answer.status != StateStatus.OK:
        return None
    if (answer.round, answer.slice, answer.params_sha256) != (round_index, slice_name, params_sha256):
        return None
    return answer.total, answer.sha256


async def serves(p2p: P2P, handler: str, donor: str, state: SwarmState, timeout: float) -> bool:
    """Whether ``donor`` serves ``state`` (a slice's parameters at the start of a round)."""
    try:
        header, _ = await _request(p2p, handler, donor, state.round, state.slice, 0, 0, timeout)
        return parse_description(header, state.round, state.slice, state.params_sha256) is not None
    except (PayloadError, TransportError, TimeoutError):
        return False


async def fetch_state(p2p: P2P, handler: str, target: SwarmState, deadline: TransferDeadline,
                      rates: Sequence[float] = ()) -> Snapshot:
    """Download ``target`` (a slice at the start of a round) from its holders; SwarmError if they cannot. A range
    may take as long as its bytes need at the slowest of ``rates`` (the holders' stated links), within ``deadline``'s
    floor and cap: a slow donor is not mistaken for a stalled one."""
    started = time.monotonic()
    round_index, slice_name, expected_params_sha256 = target.round, target.slice, target.params_sha256
    # 1. Which donors hold that round, how big is it, and what is its checksum?
    described: dict[str, tuple[int, str]] = {}
    donors = list(target.holders)
    for donor in donors:
        try:
            header, _ = await _request(p2p, handler, donor, round_index, slice_name, 0, 0, deadline.base)
            description = parse_description(header, round_index, slice_name, expected_params_sha256)
        except (PayloadError, TransportError, TimeoutError) as e:  # unreachable or confused donors are skipped
            logger.info(f"donor {donor[-8:]} did not describe its state: {e!r}")
            continue
        if description is not None:
            described[donor] = description
    agreed = set(described.values())
    if not described or len(agreed) != 1:
        raise SwarmError(f"no donor serves {slice_name} of round {round_index} with the expected hash "
                         f"({len(described)} of {len(donors)} answered, {len(agreed)} distinct blobs)")
    total, blob_sha = agreed.pop()

    # 2. Ranges from every donor at once; a failed or stalled range goes back for another donor.
    # Ranges small enough that every stream of every donor gets work, large enough to keep overheads low.
    part = min(PART_BYTES, max(MIN_PART_BYTES, -(-total // (STREAMS_PER_DONOR * len(described)))))
    offsets = list(range(0, total, part))
    parts: asyncio.Queue[int | None] = asyncio.Queue()
    for offset in offsets:
        parts.put_nowait(offset)
    received: dict[int, bytes] = {}
    working = set(described)

    def release_all() -> None:  # wake every waiting worker: all ranges are in, or nobody is left to fetch
        for _ in range(STREAMS_PER_DONOR * len(described)):
            parts.put_nowait(None)

    async def worker(donor: str) -> None:
        while (offset := await parts.get()) is not None:
            if donor not in working:  # its other stream failed: leave the range to the other donors
                parts.put_nowait(offset)
                return
            length = min(part, total - offset)
            try:
                header, data = await _request(p2p, handler, donor, round_index, slice_name, offset, length,
                                              deadline.seconds(length, rates))
                if parse_description(header, round_index, slice_name, expected_params_sha256) != (
                        total, blob_sha) or len(data) != length:
                    raise PayloadError(f"donor answered another state, or {len(data)} bytes for a {length}-byte range")
            except (PayloadError, TransportError, TimeoutError) as e:
                logger.info(f"donor {donor[-8:]} failed on range {offset}: {e!r}; leaving it to the others")
                parts.put_nowait(offset)
                working.discard(donor)
                if not working:
                    release_all()
                return
            received[offset] = data
            if len(received) == len(offsets):
                release_all()

    if offsets:
        await asyncio.gather(*(worker(donor) for donor in described for _ in range(STREAMS_PER_DONOR)))
    if len(received) != len(offsets):
        raise SwarmError(f"download of {slice_name} of round {round_index} failed: every donor stalled or failed")
    blob = b"".join(received[offset] for offset in sorted(received))
    if hashlib.sha256(blob).hexdigest() != blob_sha:
        raise SwarmError(f"downloaded {slice_name} of round {round_index} does not match its checksum")
    try:
        snapshot = Snapshot.from_blob(round_index, slice_name, blob)
    except PayloadError as e:  # a blob that passed the checksum yet does not parse: every donor served garbage
        raise SwarmError(f"downloaded {slice_name} of round {round_index} is malformed ({e})") from None
    if snapshot.params_sha256 != expected_params_sha256:
        raise SwarmError(f"downloaded {slice_name} of round {round_index} does not match the donors' published hash")
    logger.info(f"fetched {total / 1e6:.1f} MB of {slice_name} from {len(described)} donors in "
                f"{time.monotonic() - started:.1f} s")
    return snapshot
