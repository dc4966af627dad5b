"""Serving and fetching the swarm's state: how a joining, restarted or lagging peer catches up.

A snapshot is the global state of one named slice (``stage0``, ...: the whole model when it is not cut
into stages) at the start of a round: the slice's parameters plus the outer state every peer holds
alike for them, serialized (on first request) as one safetensors blob. Every node serves byte ranges
of the snapshots of its two latest rounds, one per slice it holds, so a stage peer fetches only its
slice, from any holder: a full replica or the same stage of another group.

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
import enum
import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Protocol

import torch
from hivemind.p2p import P2P
from pydantic import Field
from safetensors import SafetensorError
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from p2ploco import faults
from p2ploco.errors import PayloadError, SwarmError, TransportError
from p2ploco.metrics import state_digest
from p2ploco.swarm import wire
from p2ploco.swarm.consensus import SwarmState
from p2ploco.swarm.deadlines import TransferDeadline
from p2ploco.swarm.messages import MAX_ROUND, Digest, Message, Round, SliceName, decode, status_of

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


class Served(Protocol):
    """What a donor serves in ranges: a snapshot, or an update."""

    round: int
    slice: str
    state_digest: str  # of the state it is (a snapshot) or leads to (an update)

    def blob(self) -> bytes: ...

    def manifest(self) -> bytes: ...


def no_updates(slice_name: str, base: str) -> Served | None:
    """What a server that keeps no updates finds: none."""
    return None


class StateStatus(enum.StrEnum):
    OK = "ok"  # the state's description, and the range asked for (or its manifest)
    MOVED = "moved"  # the donor no longer (or not yet) holds that round
    EMPTY = "empty"  # the donor holds no state yet


@dataclass
class Snapshot:
    round: int  # the round this state starts
    slice: str  # the slice these parameters make up
    params: dict[str, torch.Tensor]  # CPU tensors that nobody writes (a published state, or fetched)
    shared: dict[str, torch.Tensor]
    state_digest: str  # ``metrics.state_digest`` of params and shared: what the records vouch for
    _blob: bytes | None = field(default=None, repr=False)
    _manifest: bytes | None = field(default=None, repr=False)

    def blob(self) -> bytes:
        if self._blob is None:
            tensors = {f"param/{k}": v for k, v in self.params.items()}
            tensors.update({f"shared/{k}": v for k, v in self.shared.items()})
            self._blob = save_tensors(tensors)
        return self._blob

    def manifest(self) -> bytes:
        """The sha256 of every RANGE_BYTES of the blob, one after the other."""
        if self._manifest is None:
            blob = self.blob()
            self._manifest = manifest_of(blob)
        return self._manifest

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
            if tensor.dtype != torch.float32 or not torch.isfinite(tensor).all():
                raise PayloadError(f"state tensor {key[:64]!r} is not finite float32")
            (params if section == "param" else shared)[name] = tensor
        return cls(round_index, slice_name, params, shared, state_digest(params, shared), blob)


def manifest_of(blob: bytes) -> bytes:
    return b"".join(hashlib.sha256(blob[at : at + RANGE_BYTES]).digest() for at in range(0, len(blob), RANGE_BYTES))


class StateServer:
    def __init__(self, p2p: P2P, run_id: str, deadline: TransferDeadline,
                 updates: Callable[[str, str], Served | None] = no_updates):
        """``updates``: the update of a slice from a state digest that this peer keeps, if any
        (``UpdateKeeper.find``)."""
        self.p2p, self.deadline, self.updates = p2p, deadline, updates
        self.handler_name = f"p2ploco/{run_id}/state"
        self.snapshots: OrderedDict[int, dict[str, Snapshot]] = OrderedDict()  # round -> slice -> snapshot

    async def start(self) -> None:
        await self.p2p.add_binary_stream_handler(self.handler_name, self._serve)

    def serve_round(self, snapshots: list[Snapshot]) -> None:
        """Serve the snapshots of one round, one per slice held (call on the loop); rounds beyond KEEP_SNAPSHOTS
        are dropped, oldest first. A peer that changes the slices it holds (a stage peer that moves) serves the
        new ones from this round on."""
        for snapshot in snapshots:
            self.snapshots.setdefault(snapshot.round, {})[snapshot.slice] = snapshot
        while len(self.snapshots) > KEEP_SNAPSHOTS:
            self.snapshots.popitem(last=False)

    async def _serve(self, stream_info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async with wire.serving(logger, "state request", str(stream_info.peer_id), reader, writer,
                                self.deadline.seconds(PART_BYTES)):
            header, _ = await asyncio.wait_for(wire.read_message(reader, max_payload=0), self.deadline.base)
            request = decode(StateRequest, header)
            served = self._find(request)
            if isinstance(served, dict):  # the answer that it holds none
                await wire.write_message(writer, served)
                return
            loop = asyncio.get_running_loop()
            blob = await loop.run_in_executor(None, served.blob)
            if request.offset % RANGE_BYTES or request.offset > len(blob):
                raise PayloadError(f"bad range {request.offset}+{request.length} of a {len(blob)}-byte state")
            if request.length:  # a range
                await faults.hit_async("state.serve", served.round)
                payload = blob[request.offset : request.offset + request.length]
            else:  # the joiner's first question: how big, and the hash of every range
                payload = await loop.run_in_executor(None, served.manifest)
            answer = {"status": StateStatus.OK, "round": served.round, "slice": served.slice, "total": len(blob),
                      "state_digest": served.state_digest}
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
        blob = await fetch_blob(p2p, handler, target, description, agreeing, deadline, blame, rates)
        if blob is None:
            continue
        try:
            snapshot = Snapshot.from_blob(target.round, target.slice, blob)
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
                     ) -> bytes | None:
    """The blob ``description`` describes, from ``donors``, every range checked against its manifest; None if they
    all failed, stalled or served something else. ``base``: the blob is the update from the state of that digest
    (``target``: the round it starts and the state it leads to), not a state."""
    total = description.total
    # Parts (whole ranges) small enough that every stream of every donor gets work, large enough to keep overheads
    # low.
    wanted = -(-total // (STREAMS_PER_DONOR * len(donors)))
    part = min(PART_BYTES, max(RANGE_BYTES, -(-wanted // RANGE_BYTES) * RANGE_BYTES))
    offsets = list(range(0, total, part))
    parts: asyncio.Queue[int | None] = asyncio.Queue()
    for offset in offsets:
        parts.put_nowait(offset)
    received: dict[int, bytes] = {}
    working = set(donors)

    def release_all() -> None:  # wake every waiting worker: all ranges are in, or nobody is left to fetch
        for _ in range(STREAMS_PER_DONOR * len(donors)):
            parts.put_nowait(None)

    def drop(donor: str, offset: int) -> None:
        parts.put_nowait(offset)
        working.discard(donor)
        if not working:
            release_all()

    async def worker(donor: str) -> None:
        while (offset := await parts.get()) is not None:
            if donor not in working:  # its other stream failed: leave the range to the other donors
                parts.put_nowait(offset)
                return
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
            except PayloadError as e:
                blame(donor, f"it served {target.slice} of round {target.round} falsely ({e})")
                drop(donor, offset)
                return
            except (TransportError, TimeoutError) as e:
                logger.info(f"donor {donor[-8:]} failed on range {offset}: {e!r}; leaving it to the others")
                drop(donor, offset)
                return
            received[offset] = data
            if len(received) == len(offsets):
                release_all()

    if offsets:
        await asyncio.gather(*(worker(donor) for donor in donors for _ in range(STREAMS_PER_DONOR)))
    if len(received) != len(offsets):
        logger.info(f"download of {target.slice} of round {target.round} from {len(donors)} donor(s) failed")
        return None
    return b"".join(received[offset] for offset in offsets)
