"""A heterogeneous swarm in one process: full replicas and pipeline groups side by side, for tests and
benchmarks. Every worker (a full replica, or one stage of a group) runs in its own thread and runs the same
round schedule a node runs (``p2ploco.schedules``), over the in-process communicator (each slice reduced among
its holders) and, within a group, the in-process stage transport.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import numpy as np
import torch

from p2ploco.build import build_linked_stage, build_replica
from p2ploco.collective.exchange import AllReduceStats
from p2ploco.collective.inprocess import InProcessGroup
from p2ploco.config import Config
from p2ploco.data import ShardSampler
from p2ploco.data.streams import TokenStream
from p2ploco.pipeline.transport import InProcessPipe, StageTransport
from p2ploco.schedules import Landing, RoundHooks, RoundSchedule, build_schedule
from p2ploco.worker import Worker

FULL, GROUP = "full", "group"
CPU = torch.device("cpu")
AFTER_ONE_STEP = Landing(after=1, wait=True)  # an eager overlapped round's all-reduce takes one inner step


class InProcessSwarm:
    """Replicas of one run in this process: ``replicas[i]`` is [a full replica's worker] or [the S stage
    workers of a group]. Each worker runs its run's round schedule (``schedules[i]`` for ``workers[i]``); an eager
    overlapped round lands at a fixed inner step of the next round (``landing``), so that runs repeat exactly."""

    def __init__(self, config: Config, replicas: list[list[Worker]], pipes: list[InProcessPipe],
                 transports: list[StageTransport], landing: Landing):
        self.replicas, self.pipes, self.transports = replicas, pipes, transports
        self.workers = [worker for replica in replicas for worker in replica]
        self.schedules: list[RoundSchedule] = [build_schedule(config, worker, landing) for worker in self.workers]
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
                comm = group.communicator(rank)

                def count(stats: AllReduceStats | None) -> None:
                    if stats is not None:
                        with lock:
                            self.all_reduce_bytes[self._replica_of[rank]] += stats.bytes_sent + stats.bytes_received

                for r in range(rounds):
                    count(self.schedules[rank].run(r, comm, RoundHooks()).comm)
                    if r + 1 == rounds:  # an overlapped round still in flight lands at the end of the run
                        count(self.schedules[rank].finish_in_flight())
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
                device: torch.device = CPU, landing: Landing = AFTER_ONE_STEP) -> InProcessSwarm:
    """Replica i is a full replica or a pipeline group (``kinds[i]``) and draws its batches from a sampler
    seeded by ``replica-i`` (a group's first stage draws for the group). ``landing``: when an eager overlapped
    round lands (by default after the first inner step of the next round: an all-reduce that takes one)."""
    c = config
    replicas: list[list[Worker]] = []
    pipes: list[InProcessPipe] = []
    transports: list[StageTransport] = []
    for index, kind in enumerate(kinds):
        sampler = ShardSampler(tokens, c.data.seq_len, c.inner.batch_size, c.run_id, f"replica-{index}")
        if kind == FULL:
            replicas.append([build_replica(c, device, sampler)])
        elif kind == GROUP:
            pipe = InProcessPipe(c.pipeline.stages)
            group = [pipe.transport(s) for s in range(c.pipeline.stages)]
            replicas.append([build_linked_stage(c, device, transport, sampler if transport.stage == 0 else None)
                             for transport in group])
            pipes.append(pipe)
            transports += group
        else:
            raise ValueError(f"replica kind {kind!r}: expected {FULL} or {GROUP}")
    return InProcessSwarm(c, replicas, pipes, transports, landing)


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
