"""``in_time``: an awaitable bounded in time, run in the awaiting task.

Python 3.11's ``asyncio.wait_for`` runs the awaited coroutine as a task of its own, with a timer and a future to
join them (3.12's runs it in the caller's task, as this does). A node bounds every read and write of a message, and
a round of a swarm of hundreds sends thousands of them: in the simulation of 256 peers those tasks were a fifth of
its CPU."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def in_time(awaitable: Awaitable[T], seconds: float | None) -> T:
    """``await awaitable``, or TimeoutError (and ``awaitable`` cancelled) after ``seconds``; None: no bound."""
    async with asyncio.timeout(seconds):
        return await awaitable
