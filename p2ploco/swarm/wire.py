"""Framing of p2ploco messages on hivemind's libp2p streams, and the order in which a stream is closed.

A message, big-endian lengths::

    +------------------+-------------------+--------------------------+-----------------+
    | u32 header bytes | u64 payload bytes | msgpack header (a map,   | payload bytes   |
    | (<= 64 KiB)      | (<= the span's    | {"v": 2, ...fields})     |                 |
    |                  |  largest valid)   |                          |                 |
    +------------------+-------------------+--------------------------+-----------------+

Both lengths are checked against limits before anything is read, so an oversized message from a peer
costs a bounded read and a PayloadError, never memory or a crash.

Two kinds of failure, two classes, never mixed up:

- PayloadError: the peer broke the protocol (a header that is no p2ploco map, a field of the wrong type,
  an oversized payload). Its sender is at fault and may be banned.
- TransportError: the link failed (the peer could not be dialled, ``Unreachable``; its stream ended
  mid-message, ``StreamClosed``; it was reset). Nobody is banned for it: the peer may have crashed, or
  its link broke for a moment. Every error hivemind's daemon client or its sockets raise on a stream
  (``DAEMON_ERRORS``) is turned into one here, so callers catch TransportError alone. A timeout stays a
  TimeoutError: slow is not broken.

**Every exchange is a request and its answer on a fresh stream, and the reader of the last message
closes first.** The p2p daemon (hivemind's go-libp2p-daemon, ``stream.go``) pipes each stream between a
unix socket and a yamux stream with two goroutines. When our end of the socket closes, one of them
calls ``Close`` on the yamux stream, which is ``CloseRead`` then ``CloseWrite`` (the FIN); ``CloseRead``
wakes the other goroutine, whose pending read then fails and which calls ``Reset``. If it gets there
between the two halves of ``Close`` (a loaded machine preempts the first goroutine there), the peer
receives a RST and no FIN, and its yamux session drops every byte it has received but not yet handed to
the reader (``Read`` on a reset stream fails even with data buffered). So an answer written and closed
at once is now and then lost whole or in part at a busy reader: "stream closed mid-message (0 of 12
bytes)", "payload truncated: 0 of 4386 bytes". Closing with unread input left in our socket makes the
daemon reset the stream the same way, every time (``tests/test_wire.py`` shows it). Hence: a caller
(``call``) writes its request, reads the whole answer and then closes; the side that answered waits for
that close, reading and dropping whatever the caller still sends, before it closes its own end
(``hang_up``). Nothing written is then ever in flight when a stream ends. A handler that answers one request
does so inside ``serving``, which hangs up after it and logs what the requester did wrong.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import msgpack
from hivemind.p2p import P2P, P2PDaemonError, PeerID

from p2ploco import PROTOCOL_VERSION
from p2ploco.aio import in_time
from p2ploco.errors import Failure, PayloadError, TransportError
from p2ploco.swarm.messages import MAX_PEER_ID
from p2ploco.swarm.upload_cap import CHUNK_BYTES, upload_cap

PREFIX = struct.Struct(">IQ")
MAX_HEADER_BYTES = 1 << 16
MAX_DEPTH = 8  # how deep a header's maps and lists may nest: p2ploco's messages need 3 levels
DRAIN_CHUNK = 1 << 16

# What hivemind's daemon client and its sockets raise when a link or the daemon fails: the daemon's control
# errors (it cannot dial the peer, the peer has no such handler), a refused, reset or broken connection
# (OSError; TimeoutError is one too, and is left alone), and a connection that ends early (EOFError). The one
# definition of a transport failure: streams turn these into TransportError, DHT calls catch them as they are.
DAEMON_ERRORS = (P2PDaemonError, OSError, EOFError)


class StreamClosed(TransportError):
    """The stream ended mid-message: the peer crashed, or its link broke (its content was not at fault)."""


class Unreachable(TransportError):
    """No stream to the peer could be opened: its daemon cannot be dialled, or it serves no such handler."""


def failure_of(error: BaseException) -> Failure:
    """The kind of a failure on a stream, as a round's record counts it."""
    if isinstance(error, StreamClosed):
        return Failure.STREAM_CLOSED
    if isinstance(error, Unreachable):
        return Failure.UNREACHABLE
    if isinstance(error, TransportError):
        return Failure.STREAM_BROKE
    if isinstance(error, TimeoutError):
        return Failure.TIMEOUT
    if isinstance(error, PayloadError):
        return Failure.MALFORMED
    raise TypeError(f"{error!r} is no failure of a stream")


@contextmanager
def _link(doing: str, error: type[TransportError] = TransportError) -> Iterator[None]:
    """Turn what a failing link raises into ``error`` (a TransportError); a timeout stays a timeout."""
    try:
        yield
    except TimeoutError:
        raise
    except DAEMON_ERRORS as e:
        raise error(f"{doing}: {e!r}") from None


async def write_message(writer: asyncio.StreamWriter, header: dict[str, Any], payload: bytes = b"") -> None:
    """Write one message; at the node's upload cap, if it has one (``upload_cap.py``)."""
    head = msgpack.packb({"v": PROTOCOL_VERSION, **header}, use_bin_type=True)
    cap = upload_cap()
    with _link("the stream broke while writing"):
        if cap is None:
            writer.write(PREFIX.pack(len(head), len(payload)) + head)
            if payload:
                writer.write(payload)
            await writer.drain()
            return
        message = memoryview(PREFIX.pack(len(head), len(payload)) + head + payload)
        for start in range(0, len(message), CHUNK_BYTES):
            chunk = message[start:start + CHUNK_BYTES]
            await cap.take(len(chunk))
            writer.write(chunk)
            await writer.drain()


async def read_header(reader: asyncio.StreamReader, max_header: int = MAX_HEADER_BYTES) -> tuple[dict[str, Any], int]:
    """The header of the next message (of at most ``max_header`` bytes: more only where a message's own bound says,
    a group answer's) and the length of the payload that follows it."""
    with _link("the stream broke while reading"):
        try:
            head_len, payload_len = PREFIX.unpack(await reader.readexactly(PREFIX.size))
            if head_len > max_header:
                raise PayloadError(f"message header of {head_len} bytes exceeds the {max_header}-byte limit")
            raw = await reader.readexactly(head_len)
        except asyncio.IncompleteReadError as e:
            raise StreamClosed(f"stream closed mid-message ({len(e.partial)} of {e.expected} bytes)") from None
    header = unpack(raw, "message header")
    if not isinstance(header, dict) or header.get("v") != PROTOCOL_VERSION:
        raise PayloadError(f"message header is not a p2ploco v{PROTOCOL_VERSION} map")
    return header, payload_len


def pack(value: Any) -> bytes:
    """``value`` as msgpack (bytes as msgpack's bin type): a payload that ``unpack`` reads."""
    return msgpack.packb(value, use_bin_type=True)


def unpack(raw: bytes, what: str) -> Any:
    """The msgpack value ``raw`` from a peer (a header, or a payload that is one), nested at most ``MAX_DEPTH`` levels
    deep; PayloadError naming ``what`` otherwise."""
    try:
        value = msgpack.unpackb(raw, raw=False, max_bin_len=len(raw), max_str_len=len(raw))
    except (ValueError, TypeError, msgpack.UnpackException) as e:  # msgpack's errors on garbage
        raise PayloadError(f"{what} is not valid msgpack: {type(e).__name__}") from None
    if not nested_within(value, MAX_DEPTH):  # before anything formats, hashes or compares it
        raise PayloadError(f"{what} nests deeper than {MAX_DEPTH} levels")
    return value


_CONTAINERS = frozenset({dict, list})


def nested_within(value: Any, limit: int) -> bool:
    """Whether ``value``'s maps and lists nest at most ``limit`` levels deep, found without recursion: msgpack
    unpacks up to 1024 levels, and formatting or comparing such a value overflows Python's stack. For values as
    msgpack and json make them (plain dicts and lists, no subclass); level by level, so that the scalars most
    messages are made of cost one type lookup each."""
    level, depth = [value], 1
    while True:
        nested = [item for item in level if type(item) in _CONTAINERS]
        if not nested:
            return True
        if depth > limit:
            return False
        depth += 1
        level = []
        for item in nested:
            if type(item) is dict:
                level.extend(item.keys())
                level.extend(item.values())
            else:
                level.extend(item)


async def read_payload(reader: asyncio.StreamReader, length: int, limit: int) -> bytes:
    if length > limit:
        raise PayloadError(f"payload of {length} bytes exceeds the {limit} bytes this span can need")
    with _link("the stream broke while reading"):
        try:
            return await reader.readexactly(length)
        except asyncio.IncompleteReadError as e:
            raise StreamClosed(f"payload truncated: {len(e.partial)} of {length} bytes") from None


async def read_message(reader: asyncio.StreamReader, max_payload: int, max_header: int = MAX_HEADER_BYTES
                       ) -> tuple[dict[str, Any], bytes]:
    header, length = await read_header(reader, max_header)
    return header, await read_payload(reader, length, max_payload)


async def open_stream(p2p: P2P, peer_id: str, handler: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A fresh stream to ``peer_id``'s ``handler``; Unreachable if none opens, PayloadError for a malformed id."""
    try:
        peer = PeerID.from_base58(peer_id)
    except ValueError:
        raise PayloadError(f"{peer_id[:MAX_PEER_ID]!r} is not a peer id") from None
    with _link(f"could not open a stream to {peer_id[-8:]}", Unreachable):
        _, reader, writer = await p2p.call_binary_stream_handler(peer, handler)
    return reader, writer


async def call(p2p: P2P, peer_id: str, handler: str, header: dict[str, Any], max_payload: int = 0,
               payload: bytes = b"", attempts: int = 1, max_header: int = MAX_HEADER_BYTES
               ) -> tuple[dict[str, Any], bytes]:
    """One request and its answer on a fresh stream to ``peer_id``'s ``handler`` (the caller bounds the time),
    which this side closes once it has read the answer. ``attempts`` > 1 asks again on a new stream when a
    stream breaks (a TransportError other than Unreachable): for requests that are safe to repeat, whose
    handler answers a second ask as it answered the first."""
    attempt = 1
    while True:
        reader, writer = await open_stream(p2p, peer_id, handler)
        try:
            await write_message(writer, header, payload)
            return await read_message(reader, max_payload, max_header)
        except TransportError:
            if attempt >= attempts:
                raise
            attempt += 1
        finally:
            writer.close()


async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, timeout: float) -> None:
    """Close a stream this side answered on, once the caller has closed its end (it has read the answer then):
    what the caller still sends is read and dropped, and a caller that keeps the stream open is cut off after
    ``timeout`` seconds. Closing first could lose the answer (module docstring)."""
    try:
        await in_time(_until_closed(reader), timeout)
    except (TimeoutError, *DAEMON_ERRORS):  # cut off, or the link is gone already: nothing left to deliver
        pass
    finally:
        writer.close()


@asynccontextmanager
async def serving(log: logging.Logger, request: str, sender: str, reader: asyncio.StreamReader,
                  writer: asyncio.StreamWriter, hang_up_after: float,
                  broke_off_level: int = logging.INFO) -> AsyncIterator[None]:
    """Answer one ``request`` (e.g. "vote") from ``sender`` on a stream this side serves: an error the block
    raises ends it, logged in ``log`` and not raised further (a cancellation is), and the stream is hung up after
    (``hang_up``). A malformed request and one that broke off are the requester's doing, one line each, and nobody
    is banned for them; anything else is a bug, logged with its traceback, and the handler keeps serving."""
    try:
        yield
    except PayloadError as e:
        log.info(f"malformed {request} from {sender[-8:]}: {e}")
    except (TransportError, TimeoutError) as e:  # the requester went away, or never finished asking
        log.log(broke_off_level, f"{request} from {sender[-8:]} broke off: {e!r}")
    except Exception:  # a bug: keep serving, and say where it is
        log.exception(f"{request} from {sender[-8:]} failed unexpectedly")
    finally:
        await hang_up(reader, writer, hang_up_after)


async def _until_closed(reader: asyncio.StreamReader) -> None:
    while await reader.read(DRAIN_CHUNK):
        pass


# Seconds between checks that a peer waited for can still be reached (``reachable``): by a coordinator of the peers
# its formation awaits, of the voters its ballot awaits, by a reducer of the members that owe it a contribution, by a
# pipeline stage of the stage whose message it waits for
PROBE_EVERY = 2.0


async def reachable(p2p: P2P, peer_id: str, handler: str, timeout: float) -> bool:
    """False if ``peer_id``'s daemon cannot be dialled or refuses the stream (the peer crashed); True if a stream
    opens, or the answer is merely slow (slow is not dead). The stream is closed at once."""
    try:
        _, writer = await in_time(open_stream(p2p, peer_id, handler), timeout)
    except TimeoutError:
        return True
    except (PayloadError, TransportError):
        return False
    writer.close()
    return True


async def connected_directly(p2p: P2P) -> set[str]:
    """The peers this daemon holds a connection to that no relay carries: one a peer behind NAT opened to it is one
    this peer can open streams on, though nobody can dial that peer."""
    return {str(info.peer_id) for info in await p2p.list_peers()
            if any("/p2p-circuit" not in str(address) for address in info.addrs)}
