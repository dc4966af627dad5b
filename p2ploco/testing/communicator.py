"""K replicas in one process: each replica runs in its own thread and calls ``all_reduce`` on its own
communicator; the call returns once all K have called it. Each named slice is reduced among the members
that hold it (a full replica holds every slice, a pipeline stage one), cut into spans and pieces with
the same ``partition`` and ``pieces`` and reduced with the same ``reduce_span`` a swarm reducer runs,
holder j reducing span j piece by piece, so results and byte counts match a butterfly among the slice's
holders, each contribution weighted by the tokens its replica trained. Replicas are trusted
here: one whose contribution is rejected still gets the aggregate of the
others (in a swarm it would be dropped and fall back to its own update)."""

from __future__ import annotations

import threading
import time

from p2ploco.collective.exchange import (
    AllReduceResult,
    Communicator,
    Exchange,
    Traffic,
    dense_fp32_bytes,
    pieces,
    reduce_span,
)
from p2ploco.collective.sliced import as_sliced


class InProcessGroup:
    def __init__(self, size: int, timeout: float = 600.0):
        self.size, self.timeout = size, timeout
        self._plans: list[dict[str, Exchange]] = [{} for _ in range(size)]
        self._tokens: list[int] = [1] * size  # what each replica trained for its contribution: its weight
        self._results: list[AllReduceResult | None] = [None] * size
        self._error: BaseException | None = None
        self._gather = threading.Barrier(size, action=self._reduce_all)  # the last to arrive reduces
        self._release = threading.Barrier(size)  # nobody starts the next all-reduce before all read this one

    def communicator(self, rank: int) -> InProcessCommunicator:
        return InProcessCommunicator(self, rank)

    def abort(self) -> None:
        """A member failed: every member waiting in (or coming to) an all-reduce gets BrokenBarrierError."""
        self._gather.abort()
        self._release.abort()

    def _reduce_all(self) -> None:
        started = time.perf_counter()
        try:
            plans, size = self._plans, self.size
            names = [f"replica-{rank}" for rank in range(size)]
            sent, received, contributed, dense, params = ([0] * size for _ in range(5))
            peers: list[set[str]] = [set() for _ in range(size)]
            clipped: list[set[str]] = [set() for _ in range(size)]  # senders clipped in the spans a rank reduced
            opposed: list[set[str]] = [set() for _ in range(size)]  # senders it left out: against the others
            dropped: set[str] = set()
            for slice_name in dict.fromkeys(s for plan in plans for s in plan):  # in order of first appearance
                holders = [rank for rank in range(size) if slice_name in plans[rank]]
                for rank in holders:
                    plans[rank][slice_name].fit_group(len(holders))
                spans = plans[holders[0]][slice_name].partition(len(holders))
                for reducer, span in ((r, piece) for r, whole in zip(holders, spans)
                                      for piece in pieces(plans[r][slice_name], whole)):
                    payloads = [plans[rank][slice_name].encode(span) for rank in holders]
                    reducing = plans[reducer][slice_name]
                    reduction = reduce_span(reducing, span, list(zip([names[r] for r in holders], payloads)),
                                            {names[r]: self._tokens[r] for r in holders})
                    dropped.update(reduction.rejected)
                    clipped[reducer].update(reduction.clipped)
                    opposed[reducer].update(reduction.opposed)
                    for rank, payload in zip(holders, payloads):
                        result = reduction.result_for(reducing, names[rank])
                        plans[rank][slice_name].receive(span, result, reduction.receipt_for(names[rank]))
                        contributed[rank] += len(payload)
                        if rank != reducer:
                            sent[rank] += len(payload)
                            received[reducer] += len(payload)
                            sent[reducer] += len(result)
                            received[rank] += len(result)
                for index, rank in enumerate(holders):
                    exchange = plans[rank][slice_name]
                    dense[rank] += dense_fp32_bytes(exchange, spans, index)
                    params[rank] += exchange.numel(range(exchange.num_units))
                    peers[rank].update(names[r] for r in holders)
            seconds = time.perf_counter() - started
            self._results = [
                AllReduceResult(sorted(peers[rank]), committed=True, dropped=sorted(dropped),
                                clipped=sorted(clipped[rank]), opposed=sorted(opposed[rank]), tokens=self._tokens[rank],
                                traffic=Traffic(sent[rank], received[rank], dense[rank], contributed[rank],
                                                params[rank], seconds))
                for rank in range(size)
            ]
            self._error = None
        except BaseException as e:  # re-raised in every replica's thread
            self._error = e


class InProcessCommunicator(Communicator):
    def __init__(self, group: InProcessGroup, rank: int):
        self.group, self.rank = group, rank

    def all_reduce(self, exchange: Exchange, round_index: int, name: str) -> AllReduceResult:
        group = self.group
        sliced = as_sliced(exchange, name)
        group._plans[self.rank], group._tokens[self.rank] = sliced.parts, sliced.tokens
        group._gather.wait(group.timeout)
        error, result = group._error, group._results[self.rank]
        group._release.wait(group.timeout)
        if error is not None:
            raise error
        return result
