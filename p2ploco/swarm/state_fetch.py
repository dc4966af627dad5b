"""The fetching side of the swarm's state (``swarm/state.py``): a joining, restarted or lagging peer asks donors
to describe the vouched state's blob, then fetches its ranges from all the donors that agree on it at once, each
range checked against the manifest as it arrives, and blames every donor that described or served it falsely."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from hivemind.p2p import P2P

from p2ploco.aio import in_time
from p2ploco.errors import PayloadError, SwarmError, TransportError
from p2ploco.swarm import wire
from p2ploco.swarm.bans import Bans
from p2ploco.swarm.consensus import SwarmState
from p2ploco.swarm.deadlines import TransferDeadline
from p2ploco.swarm.directory import PeerDirectory
from p2ploco.swarm.messages import decode
from p2ploco.swarm.state import (
    LATEST,
    MAX_BLOB_HEADER,
    MAX_MANIFEST_BYTES,
    PART_BYTES,
    RANGE_BYTES,
    STREAMS_PER_DONOR,
    BlobKind,
    BytesBlob,
    Snapshot,
    StateAnswer,
    StateStatus,
    TensorBlob,
)

logger = logging.getLogger(__name__)


Blame = Callable[[str, str], None]  # (donor, what it did): a donor that served or described a state falsely
# Holders a peer fetches a state from, at most: enough streams to fill a newcomer's link, and flat in N (a state that
# all 256 of a swarm hold was described 171 times to each newcomer, and split into as many ranges)
MAX_DONORS = 8


async def choose_donors(p2p: P2P, target: SwarmState, me: str, bans: Bans, directory: PeerDirectory,
                        draw: random.Random | None = None) -> list[str]:
    """The holders of ``target`` that peer ``me`` fetches it from: at most MAX_DONORS of those not banned here and
    reachable, drawn at random, so that newcomers spread over the holders and a fetch that failed draws others when
    it is tried again."""
    # A peer behind a NAT cannot be dialled for the state: it is a donor only over a connection it opened to this
    # one (a hub started again, whose trainers all dial out, holds nothing else to catch up from)
    connected = await wire.connected_directly(p2p)
    eligible = [p for p in target.holders if p != me and not bans.banned(p, target.round)
                and (not directory.dials_out(p) or p in connected)]
    return eligible if len(eligible) <= MAX_DONORS else (draw or random).sample(eligible, MAX_DONORS)


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
    return await in_time(wire.call(p2p, donor, handler, request, max_payload=limit), timeout)


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

    # 1. What each donor says the blob is: donors that agree on it are tried together, the most agreed-on first.
    described = dict(zip(donors, await asyncio.gather(*(
        _describe(p2p, handler, donor, target, deadline, tensor_bytes, blame, rates) for donor in donors))))
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


async def _describe(p2p: P2P, handler: str, donor: str, target: SwarmState, deadline: TransferDeadline,
                    tensor_bytes: int, blame: Blame, rates: Sequence[float]) -> Description | None:
    """What ``donor`` says ``target``'s blob is (``fetch_state``); None if it holds another state, is unreachable or
    slow, or described it falsely (blamed)."""
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
    fetch_part = _part_fetcher(p2p, handler, target, description, part, working, deadline, blame, rates, base)
    head = None
    while head is None and working:
        head = await fetch_part(working[0], 0)
    if head is None:
        logger.info(f"download of {target.slice} of round {target.round} from {len(donors)} donor(s) failed")
        return None
    blob = TensorBlob.receive(head, total) if base is None else BytesBlob.receive(head, total)
    if not await _fetched_rest(fetch_part, blob, offsets, donors, working):
        logger.info(f"download of {target.slice} of round {target.round} from {len(donors)} donor(s) failed")
        return None
    return blob


def _part_fetcher(p2p: P2P, handler: str, target: SwarmState, description: Description, part: int, working: list[str],
                  deadline: TransferDeadline, blame: Blame, rates: Sequence[float], base: str | None
                  ) -> Callable[[str, int], Awaitable[bytes | None]]:
    """How ``fetch_blob`` fetches one part (``part`` bytes, whole ranges) of ``description``'s blob; a donor that
    fails is dropped from ``working``."""
    total = description.total

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

    return fetch_part


async def _fetched_rest(fetch_part: Callable[[str, int], Awaitable[bytes | None]], blob: TensorBlob | BytesBlob,
                        offsets: list[int], donors: list[str], working: list[str]) -> bool:
    """Whether every part after the first (``offsets[1:]``) was fetched into ``blob``, by ``STREAMS_PER_DONOR``
    streams per ``working`` donor at once: a part a donor fails on goes back to the queue, for the others."""
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
    return received == len(offsets)
