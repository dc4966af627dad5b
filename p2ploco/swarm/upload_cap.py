"""A cap on how fast a peer sends (``swarm.max_upload_mbit``): what a hub's operator offers a run of their link.

Every p2ploco message a node writes (``wire.write_message``: contributions, reduced spans, votes, state served to
peers catching up) goes out on the node's event loop, so one cap per loop paces them all: each chunk books its
bytes at the cap's rate after the bytes booked before it, and waits until the cap lets them go. A short burst is
let through at once, so small messages (votes, headers) are not slowed. The DHT's own traffic (records, lookups:
kilobytes a round) goes through the p2p daemon and is not counted.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from weakref import WeakKeyDictionary

BURST_SECONDS = 0.05  # sent at once before the cap's pace starts to bind (50 ms of its rate)
CHUNK_BYTES = 1 << 16  # a capped message is written in chunks of this size, each paced


class UploadCap:
    def __init__(self, mbit: float, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep):
        self.bytes_per_second = mbit * 1e6 / 8
        self.clock, self.sleep = clock, sleep
        self.free_at = 0.0  # when the bytes booked so far will have left at the cap's rate

    async def take(self, size: int) -> None:
        """Wait until ``size`` more bytes may go: they leave after the bytes booked before them, at the cap's rate.
        The booking comes before the wait, so concurrent streams share the cap rather than each taking all of it."""
        now = self.clock()
        self.free_at = max(self.free_at, now) + size / self.bytes_per_second
        wait = self.free_at - now - BURST_SECONDS
        if wait > 0:
            await self.sleep(wait)


_caps: WeakKeyDictionary[asyncio.AbstractEventLoop, UploadCap] = WeakKeyDictionary()


def cap_uploads(mbit: float) -> None:
    """From now on, what this event loop's node sends goes at most ``mbit`` Mbit/s (0: no cap)."""
    loop = asyncio.get_running_loop()
    if mbit > 0:
        _caps[loop] = UploadCap(mbit)
    else:
        _caps.pop(loop, None)


def upload_cap() -> UploadCap | None:
    """The cap of the node whose event loop runs this, if it set one."""
    return _caps.get(asyncio.get_running_loop())
