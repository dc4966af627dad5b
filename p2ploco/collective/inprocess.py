"""K replicas in one process: each replica runs in its own thread and calls ``all_reduce`` on its own
communicator; the call returns once all K have called it. The spans are reduced with the same
``reduce_span`` a swarm reducer runs, replica j reducing span j, so results and byte counts match a
butterfly among K peers. Replicas are trusted here: one whose contribution is rejected still gets
the aggregate of the others (in a swarm it would be dropped and fall back to its own update)."""

from __future__ import annotations

import threading
import time

from p2ploco.collective.exchange import AllReduceStats, Communicator, Exchange, dense_fp32_bytes, reduce_span


class InProcessGroup:
    def __init__(self, size: int, timeout: float = 600.0):
        self.size, self.timeout = size, timeout
        self._exchanges: list[Exchange | None] = [None] * size
        self._stats: list[AllReduceStats | None] = [None] * size
        self._error: BaseException | None = None
        self._gather = threading.Barrier(size, action=self._reduce_all)  # the last to arrive reduces
        self._release = threading.Barrier(size)  # nobody starts the next all-reduce before all read this one

    def communicator(self, rank: int) -> InProcessCommunicator:
        return InProcessCommunicator(self, rank)

    def _reduce_all(self) -> None:
        started = time.perf_counter()
        try:
            exchanges = list(self._exchanges)
            names = [f"replica-{rank}" for rank in range(self.size)]
            spans = exchanges[0].partition(self.size)
            sent = [0] * self.size
            received = [0] * self.size
            contributed = [0] * self.size
            dropped: set[str] = set()
            clipped: list[list[str]] = []
            for reducer, span in enumerate(spans):
                payloads = [exchange.encode(span) for exchange in exchanges]
                reduction = reduce_span(exchanges[reducer], span, list(zip(names, payloads)))
                dropped.update(reduction.rejected)
                clipped.append(reduction.clipped)
                for rank, exchange in enumerate(exchanges):
                    result = reduction.result_for(exchanges[reducer], names[rank])
                    exchange.receive(span, result, reduction.own_position(names[rank]))
                    contributed[rank] += len(payloads[rank])
                    if rank != reducer:
                        sent[rank] += len(payloads[rank])
                        received[reducer] += len(payloads[rank])
                        sent[reducer] += len(result)
                        received[rank] += len(result)
            seconds = time.perf_counter() - started
            params = sum(exchanges[0].numel(span) for span in spans)
            self._stats = [
                AllReduceStats(names, sent[rank], received[rank], dense_fp32_bytes(exchanges[rank], spans, rank),
                               contributed[rank], params, sorted(dropped), seconds, clipped=clipped[rank])
                for rank in range(self.size)
            ]
            self._error = None
        except BaseException as e:  # re-raised in every replica's thread
            self._error = e


class InProcessCommunicator(Communicator):
    def __init__(self, group: InProcessGroup, rank: int):
        self.group, self.rank = group, rank

    def all_reduce(self, exchange: Exchange, round_index: int, name: str) -> AllReduceStats:
        group = self.group
        group._exchanges[self.rank] = exchange
        group._gather.wait(group.timeout)
        error, stats = group._error, group._stats[self.rank]
        group._release.wait(group.timeout)
        if error is not None:
            raise error
        return stats
