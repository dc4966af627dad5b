"""Framing of p2ploco messages on hivemind's libp2p streams.

A message, big-endian lengths::

    +------------------+-------------------+--------------------------+-----------------+
    | u32 header bytes | u64 payload bytes | msgpack header (a map,   | payload bytes   |
    | (<= 64 KiB)      | (<= the span's    | {"v": 1, ...fields})     |                 |
    |                  |  largest valid)   |                          |                 |
    +------------------+-------------------+--------------------------+-----------------+

Both lengths are checked against limits before anything is read, so an oversized or truncated
message from a peer costs a bounded read and a PayloadError, never memory or a crash. A stream
that ends mid-message raises StreamClosed (a PayloadError that says the link, not the content,
failed: a crashed peer is not banned for it).
"""

from __future__ import annotations

import asyncio
import enum
import struct
from typing import Any, TypeVar

import msgpack
from hivemind.p2p import P2P, P2PDaemonError, PeerID

from p2ploco.errors import PayloadError

PREFIX = struct.Struct(">IQ")
MAX_HEADER_BYTES = 1 << 16
PROTOCOL_VERSION = 1
MAX_PEER_ID = 128  # a base58 peer id is ~52 characters

# What a stream to or from another peer raises when the link fails: the daemon's control errors (it cannot
# dial the peer, the peer has no such handler), a refused, reset or timed-out connection (OSError covers
# ConnectionError and TimeoutError), and a stream that ends early (asyncio.IncompleteReadError is an EOFError).
TRANSPORT_ERRORS = (P2PDaemonError, OSError, EOFError)

E = TypeVar("E", bound=enum.Enum)


class StreamClosed(PayloadError):
    """The stream ended mid-message: the sender crashed or its link broke (its content was not at fault)."""


async def write_message(writer: asyncio.StreamWriter, header: dict[str, Any], payload: bytes = b"") -> None:
    head = msgpack.packb({"v": PROTOCOL_VERSION, **header}, use_bin_type=True)
    writer.write(PREFIX.pack(len(head), len(payload)) + head)
    if payload:
        writer.write(payload)
    await writer.drain()


async def read_header(reader: asyncio.StreamReader) -> tuple[dict[str, Any], int]:
    """The header of the next message and the length of the payload that follows it."""
    try:
        head_len, payload_len = PREFIX.unpack(await reader.readexactly(PREFIX.size))
        if head_len > MAX_HEADER_BYTES:
            raise PayloadError(f"message header of {head_len} bytes exceeds the {MAX_HEADER_BYTES}-byte limit")
        raw = await reader.readexactly(head_len)
    except asyncio.IncompleteReadError as e:
        raise StreamClosed(f"stream closed mid-message ({len(e.partial)} of {e.expected} bytes)") from None
    try:
        header = msgpack.unpackb(raw, raw=False, max_bin_len=MAX_HEADER_BYTES, max_str_len=MAX_HEADER_BYTES)
    except (ValueError, TypeError, msgpack.UnpackException) as e:  # msgpack's errors on garbage
        raise PayloadError(f"message header is not valid msgpack: {e!r}") from None
    if not isinstance(header, dict) or header.get("v") != PROTOCOL_VERSION:
        raise PayloadError(f"message header is not a p2ploco v{PROTOCOL_VERSION} map")
    return header, payload_len


async def read_payload(reader: asyncio.StreamReader, length: int, limit: int) -> bytes:
    if length > limit:
        raise PayloadError(f"payload of {length} bytes exceeds the {limit} bytes this span can need")
    try:
        return await reader.readexactly(length)
    except asyncio.IncompleteReadError as e:
        raise StreamClosed(f"payload truncated: {len(e.partial)} of {length} bytes") from None


async def read_message(reader: asyncio.StreamReader, max_payload: int) -> tuple[dict[str, Any], bytes]:
    header, length = await read_header(reader)
    return header, await read_payload(reader, length, max_payload)


def field(header: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    """A header field of the expected type, or PayloadError naming it."""
    value = header.get(name)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise PayloadError(f"message field {name!r} is missing or not a {getattr(kind, '__name__', kind)}")
    return value


def status(header: dict[str, Any], kind: type[E], name: str = "status") -> E:
    """A header field that must be one of an Enum's values, or PayloadError naming it."""
    try:
        return kind(header.get(name))
    except ValueError:
        raise PayloadError(f"message field {name!r} is not one of {', '.join(str(k.value) for k in kind)}") from None


def peer_ids(header: dict[str, Any], name: str) -> list[str]:
    """A header field listing distinct peer ids in ascending order, or PayloadError naming it."""
    peers = field(header, name, list)
    if not all(isinstance(p, str) and 0 < len(p) <= MAX_PEER_ID for p in peers) or peers != sorted(set(peers)):
        raise PayloadError(f"message field {name!r} is not a sorted list of distinct peer ids")
    return peers


async def open_stream(p2p: P2P, peer_id: str, handler: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A fresh stream to ``peer_id``'s ``handler``; a malformed peer id is a PayloadError, not a crash."""
    try:
        peer = PeerID.from_base58(peer_id)
    except ValueError:
        raise PayloadError(f"{peer_id[:MAX_PEER_ID]!r} is not a peer id") from None
    _, reader, writer = await p2p.call_binary_stream_handler(peer, handler)
    return reader, writer


async def call(p2p: P2P, peer_id: str, handler: str, header: dict[str, Any], max_payload: int = 0,
               ) -> tuple[dict[str, Any], bytes]:
    """One request and its answer on a fresh stream to ``peer_id``'s ``handler`` (the caller bounds the time)."""
    reader, writer = await open_stream(p2p, peer_id, handler)
    try:
        await write_message(writer, header)
        return await read_message(reader, max_payload)
    finally:
        writer.close()


async def reachable(p2p: P2P, peer_id: str, handler: str, timeout: float) -> bool:
    """False if ``peer_id``'s daemon cannot be dialled or refuses the stream (the peer crashed); True if a stream
    opens, or the answer is merely slow (slow is not dead). The stream is closed at once."""
    try:
        _, writer = await asyncio.wait_for(open_stream(p2p, peer_id, handler), timeout)
    except TimeoutError:
        return True
    except (PayloadError, *TRANSPORT_ERRORS):
        return False
    writer.close()
    return True
