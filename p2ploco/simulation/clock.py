"""Virtual time for a simulated swarm: an asyncio loop whose clock jumps to its next timer instead of sleeping, so
the real async code of thousands of peers runs unchanged in one process, a simulated minute taking only the CPU
its code needs.

``VirtualLoop`` is a selector loop whose selector never blocks: where the loop would wait ``t`` seconds for I/O,
the clock moves on ``t`` and nothing is ready (a simulated network delivers bytes by timers, not sockets). Work
the code hands to a thread pool (``run_in_executor``) runs inline: a thread's real time would let the virtual
clock run ahead of it. ``virtual_time`` makes ``time.monotonic``, ``time.perf_counter`` and ``time.time`` (hence
hivemind's ``get_dht_time``) read the loop's clock while a simulation runs; CPU clocks (``time.thread_time``,
``time.process_time``) stay real, and measure what the simulated peers' code costs.

Each task runs on behalf of one simulated peer and one of its services (``on_behalf_of``; a task inherits its
creator's), and the CPU time of each of its steps is charged to them (``VirtualLoop.cpu``)."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import selectors
import sys
import time
import weakref
from collections import defaultdict
from collections.abc import Callable, Coroutine, Generator, Iterator
from contextlib import contextmanager
from typing import Any

EPOCH = 1.8e9  # what time.time() reads at virtual time 0: a plausible date, so that DHT expirations look real

# (peer, service): whom a task works for, and as what (a handler's name, or "node" for the peer's own work)
acting: contextvars.ContextVar[tuple[str, str]] = contextvars.ContextVar("acting", default=("", ""))


class PeerStamp(logging.Filter):
    """Stamps each log record with the virtual time it was made at (``virtual``, seconds) and the simulated peer it
    was made for (``peer``: its id's last 8 characters; "" for the simulation's own): one process logs for all peers,
    and a trace of one of them needs both."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.virtual = record.created - EPOCH  # ``time.time`` reads the loop's clock while a simulation runs
        record.peer = acting.get()[0][-8:]
        return True


class SimulationStalled(RuntimeError):
    """Nothing is scheduled and nothing can happen: every simulated peer waits for something that never comes."""


class _JumpingSelector(selectors.DefaultSelector):
    def __init__(self, loop: VirtualLoop):
        super().__init__()
        self._loop = loop

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = super().select(0)  # the loop's own wake-up pipe
        if ready or timeout == 0:
            return ready
        if timeout is None:
            raise SimulationStalled("no peer has anything scheduled: the simulation cannot go on")
        self._loop.now += timeout
        return []


class VirtualLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        self.now = 0.0
        super().__init__(_JumpingSelector(self))
        self.cpu: dict[tuple[str, str], float] = defaultdict(float)  # (peer, service) -> CPU seconds its tasks took
        self._tasks: dict[str, weakref.WeakSet[asyncio.Task]] = defaultdict(weakref.WeakSet)
        self.set_task_factory(self._metered_task)

    def time(self) -> float:
        return self.now

    def run_in_executor(self, executor: Any, func: Callable[..., Any], *args: Any) -> asyncio.Future:
        future = self.create_future()
        try:
            future.set_result(func(*args))
        except Exception as e:  # handed to the awaiting code, as a pool's future would
            future.set_exception(e)
        return future

    def _metered_task(self, loop: asyncio.AbstractEventLoop, coro: Coroutine, context: contextvars.Context | None = None
                      ) -> asyncio.Task:
        whom = acting.get() if context is None else context.get(acting, ("", ""))  # None: the creator's context
        task = asyncio.Task(_Metered(coro, whom, self.cpu).run(), loop=loop, context=context)
        self._tasks[whom[0]].add(task)
        return task

    def tasks_of(self, peer: str) -> list[asyncio.Task]:
        """The unfinished tasks that work for ``peer``."""
        return [task for task in self._tasks[peer] if not task.done()]


class _Metered:
    """A coroutine run step by step, the CPU time of every step charged to ``whom``."""

    def __init__(self, coro: Coroutine, whom: tuple[str, str], cpu: dict[tuple[str, str], float]):
        self.coro, self.whom, self.cpu = coro, whom, cpu

    async def run(self) -> Any:
        return await self

    def __await__(self) -> Generator[Any, Any, Any]:
        coro, value, error = self.coro, None, None
        while True:
            started = time.thread_time()
            try:
                yielded = coro.send(value) if error is None else coro.throw(error)
            except StopIteration as stop:
                return stop.value
            finally:
                self.cpu[self.whom] += time.thread_time() - started
            try:
                value, error = (yield yielded), None
            except BaseException as e:  # a cancellation or an exception thrown into the task: passed on
                value, error = None, e


@contextmanager
def virtual_time(loop: VirtualLoop) -> Iterator[None]:
    """``time.monotonic``, ``perf_counter`` and ``time`` read ``loop``'s clock inside the block, and so does every
    module's ``get_dht_time`` (hivemind binds it to ``time.time`` itself, and modules import that binding)."""
    real = time.time
    saved = time.monotonic, time.perf_counter, time.time
    bound = [module for module in list(sys.modules.values()) if getattr(module, "get_dht_time", None) is real]

    def now() -> float:
        return EPOCH + loop.now

    time.monotonic = time.perf_counter = loop.time
    time.time = now
    for module in bound:
        module.get_dht_time = now
    try:
        yield
    finally:
        time.monotonic, time.perf_counter, time.time = saved
        for module in bound:
            module.get_dht_time = real


def on_behalf_of(peer: str, coro: Coroutine, service: str = "node") -> asyncio.Task:
    """A task running ``coro`` for ``peer`` as ``service``: it, and every task it starts, charge their CPU time to
    that peer and service."""
    context = contextvars.copy_context()
    context.run(acting.set, (peer, service))
    return asyncio.get_running_loop().create_task(coro, context=context)
