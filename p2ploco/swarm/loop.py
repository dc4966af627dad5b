"""A background asyncio loop: hivemind's DHT node, the p2p daemon's client and our RPC handlers run
here while the main thread trains (torch releases the GIL in its kernels)."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
logger = logging.getLogger(__name__)


class EventLoopThread:
    def __init__(self, name: str = "p2ploco-swarm"):
        self.loop = asyncio.new_event_loop()
        self.loop.set_exception_handler(_report_stray_exception)
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, coroutine: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coroutine`` on the loop and wait for its result from the calling thread."""
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        try:
            return future.result(timeout)
        except BaseException:  # a timeout or an interrupt here must not leave the coroutine running on the loop
            future.cancel()
            raise

    def stop(self, timeout: float = 10.0) -> None:
        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=timeout / 2)  # a task that ignores cancellation is left behind

        if self._thread.is_alive():
            try:
                self.run(cancel_all(), timeout)
            finally:
                self.loop.call_soon_threadsafe(self.loop.stop)
                self._thread.join(timeout)
                if not self._thread.is_alive():
                    self.loop.close()


async def finishes_within(coroutine: Coroutine[Any, Any, Any], timeout: float) -> bool:
    """Run ``coroutine`` for at most ``timeout`` seconds; unlike asyncio.wait_for, never wait on a
    cancellation that the coroutine does not honour (hivemind calls into a dead daemon can hang so)."""
    task = asyncio.ensure_future(coroutine)
    done, _ = await asyncio.wait({task}, timeout=timeout)
    if not done:
        task.cancel()
        return False
    task.result()
    return True


def _report_stray_exception(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """Errors no task awaited (e.g. hivemind's daemon connection breaking as the daemon exits): one line each."""
    error = context.get("exception")
    if isinstance(error, (ConnectionError, BrokenPipeError, asyncio.CancelledError)):
        logger.debug(f"{context.get('message')}: {error!r}")
    else:
        logger.warning(f"{context.get('message')}: {error!r}")
