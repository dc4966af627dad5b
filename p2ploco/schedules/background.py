"""Outer work off the training thread: a worker's background thread, and what a landing hands back.

A round schedule hands the outer algorithm's slow work (a contribution: pseudo-gradient, compression,
encoding; a landing, queued once the all-reduce has ended: the outer step computed out of place, the hash of the
state it leaves) to one background thread per worker, in order, so that the training thread only trains. On CUDA that
work runs on a side stream (``p2ploco.device``). The training thread then *takes* a landing between two
inner steps: it swaps the prepared tensors in (``OuterAlgorithm.take``) and publishes the state they make up,
which costs a few reference swaps. Outer state is only ever taken on the training thread, in round order.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TypeVar

import torch

from p2ploco.collective.exchange import AllReduceResult
from p2ploco.device import SideStream
from p2ploco.outer.base import OuterStep, OuterSync, Synced
from p2ploco.worker import Worker

T = TypeVar("T")


@dataclass
class Landed:
    """A round's all-reduce as it ended, and its outer step prepared (None: nothing to apply)."""

    outer_sync: OuterSync
    result: AllReduceResult
    step: OuterStep | None
    slice_digest: str = ""  # the hash of the synced slice once stepped (a Streaming DiLoCo fragment)


class Background:
    """One worker's background thread for outer work, and the side stream that work runs on.

    The thread is a daemon: a node that stops at once does not wait for an all-reduce its swarm has left."""

    def __init__(self, worker: Worker):
        self.worker = worker
        self.side = SideStream(worker.device)
        self._jobs: queue.SimpleQueue[tuple[Future, Callable[[], object]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="outer-work", daemon=True)
        self._thread.start()

    def submit(self, work: Callable[[], T]) -> Future[T]:
        """Run ``work`` after the jobs submitted before it; its result (or its exception) in the future."""
        future: Future[T] = Future()
        self._jobs.put((future, work))
        return future

    def when(self, done: Future, work: Callable[[], T], into: Future[T] | None = None) -> Future[T]:
        """Run ``work`` once ``done`` has ended (an all-reduce: the thread never waits for the network, so a round
        whose all-reduce runs long holds up no other work); its result in ``into`` (a fresh future by default)."""
        future: Future[T] = into if into is not None else Future()
        done.add_done_callback(lambda _: self._jobs.put((future, work)))
        return future

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, work = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(work())
            except BaseException as e:  # handed to whoever takes the landing, like any Future
                future.set_exception(e)

    def land(self, outer_sync: OuterSync) -> Landed:
        """``outer_sync``'s ended all-reduce, and its outer step prepared (on the calling thread)."""
        result = outer_sync.all_reduce.wait()
        step = self.worker.outer.prepare(outer_sync) if result.committed else None
        return Landed(outer_sync, result, step)

    def take(self, landed: Landed, alongside: list[torch.Tensor] | tuple[()] = ()) -> Synced:
        """On the training thread: put ``landed``'s step in place, or give back what its round took; ``follow`` takes
        the same step."""
        with self.worker.lock:
            self.worker.outer.take(landed.outer_sync, landed.step, alongside)
        return Synced(landed.result, landed.step is not None)

    def close(self) -> None:
        """No more jobs: the thread ends after the one under way (whose result nobody takes)."""
        self._jobs.put(None)
