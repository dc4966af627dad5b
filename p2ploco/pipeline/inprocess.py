"""A heterogeneous swarm in one process: full replicas and pipeline groups side by side, for tests and
benchmarks. Every worker (a full replica, or one stage of a group) runs in its own thread and calls
the same ``Worker.train`` and ``Worker.sync`` (overlapped: ``land`` and ``launch``) a node calls, over
the in-process communicator (each slice reduced among its holders) and, within a group, the in-process
stage transport.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import numpy as np
import torch

from p2ploco.collective.exchange import AllReduceStats
from p2ploco.collective.inprocess import InProcessGroup
from p2ploco.config import Config
from p2ploco.data import ShardSampler
from p2ploco.data.streams import TokenStream
from p2ploco.pipeline.transport import InProcessPipe
from p2ploco.worker import Worker, build_linked_stage, build_replica

FULL, GROUP = "full", "group"
CPU = torch.device("cpu")


class InProcessSwarm:
    """Replicas of one run in this process: ``replicas[i]`` is [a full replica's worker] or [the S stage
    workers of a group]."""

    def __init__(self, replicas: list[list[Worker]], pipes: list[InProcessPipe]):
        self.replicas, self.pipes = replicas, pipes
        self.workers = [worker for replica in replicas for worker in replica]
        self.all_reduce_bytes = [0] * len(replicas)  # sent + received by each replica's workers in all rounds
        self._replica_of = [i for i, replica in enumerate(replicas) for _ in replica]

    def train(self, rounds: int, after_round: Callable[[int], None] | None = None) -> None:
        """``rounds`` outer rounds of every worker; ``after_round(r)`` runs once all have finished round r.
        A worker that fails stops the others at their next wait (nothing hangs), and its error is raised."""
        group = InProcessGroup(len(self.workers))
        finished, checked = threading.Barrier(len(self.workers)), threading.Barrier(len(self.workers))
        lock = threading.Lock()

        def work(rank: int) -> None:
            try:
                worker, comm = self.workers[rank], group.communicator(rank)

                def count(stats: AllReduceStats | None) -> None:
                    if stats is not None:
                        with lock:
                            self.all_reduce_bytes[self._replica_of[rank]] += stats.bytes_sent + stats.bytes_received

                for r in range(rounds):
                    worker.train(r, comm=comm)  # (Streaming DiLoCo syncs its fragments during the inner steps)
                    if worker.overlap:  # round r's all-reduce runs during round r+1; the last one lands at once
                        count(worker.land())
                        worker.launch(r, comm)
                        if r + 1 == rounds:
                            count(worker.finish_in_flight())
                    else:
                        count(worker.sync(comm, r))
                    if after_round is not None:
                        if finished.wait() == 0:
                            after_round(r)
                        checked.wait()
            except BaseException:
                for waiting in (group, finished, checked, *self.pipes):
                    waiting.abort()
                raise

        run_in_threads(len(self.workers), work)


def build_swarm(config: Config, kinds: Sequence[str], tokens: TokenStream | np.ndarray,
                device: torch.device = CPU) -> InProcessSwarm:
    """Replica i is a full replica or a pipeline group (``kinds[i]``) and draws its batches from a sampler
    seeded by ``replica-i`` (a group's first stage draws for the group)."""
    c = config
    replicas: list[list[Worker]] = []
    pipes: list[InProcessPipe] = []
    for index, kind in enumerate(kinds):
        sampler = ShardSampler(tokens, c.data.seq_len, c.inner.batch_size, c.run_id, f"replica-{index}")
        if kind == FULL:
            replicas.append([build_replica(c, device, sampler)])
        elif kind == GROUP:
            pipe = InProcessPipe(c.pipeline.stages)
            replicas.append([build_linked_stage(c, device, pipe.transport(s), sampler if s == 0 else None)
                             for s in range(c.pipeline.stages)])
            pipes.append(pipe)
        else:
            raise ValueError(f"replica kind {kind!r}: expected {FULL} or {GROUP}")
    return InProcessSwarm(replicas, pipes)


def run_in_threads(count: int, work: Callable[[int], None]) -> None:
    """``work(i)`` for i < count, each in its own thread; the first error is raised after all have ended."""
    errors: list[BaseException] = []

    def guarded(index: int) -> None:
        try:
            work(index)
        except BaseException as e:  # surfaced after the join
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(index,)) for index in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
