"""K replicas in one process: each replica runs in its own thread and calls ``all_reduce`` on its own
communicator; the call returns once all K have called it. Each named slice is reduced among the members
that hold it (a full replica holds every slice, a pipeline stage one), cut into spans and pieces with
the same ``partition`` and ``pieces`` and reduced with the same ``reduce_span`` a swarm reducer runs,
holder j reducing span j piece by piece, so results and byte counts match a butterfly among the slice's
holders, each contribution weighted by the tokens its replica trained. Replicas are trusted
here: one whose contribution is rejected still gets the aggregate of the
others (in a swarm it would be dropped and fall back to its own update). Hostile reducers (``hostile``,
``testing/attacks.py``) meet what the swarm does of them, modelled on its rules: a reducer whose members hold
different results of one piece is proven, out of the round's redo and of the run (undefended: the round is
aborted, as before signed results); one whose result a member's audit fails reduces nothing in the redo (and,
unlike in a swarm, is not banned by its auditors: the model errs on the attacker's side)."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from p2ploco.collective.exchange import (
    AllReduceResult,
    Communicator,
    Exchange,
    Span,
    SpanReduction,
    Traffic,
    audit,
    dense_fp32_bytes,
    pieces,
    reduce_span,
)
from p2ploco.collective.sliced import as_sliced
from p2ploco.testing.attacks import HostileReducer


@dataclass
class _Tally:
    """What one rank moved and saw over a round's attempts."""

    sent: int = 0
    received: int = 0
    contributed: int = 0
    dense: int = 0
    params: int = 0
    peers: set[str] = field(default_factory=set)
    clipped: set[str] = field(default_factory=set)  # senders clipped in the spans this rank reduced
    opposed: set[str] = field(default_factory=set)  # senders it left out: against the others


@dataclass(frozen=True)
class _Piece:
    slice: str
    span: Span
    reducer: int
    reduction: SpanReduction


class InProcessGroup:
    def __init__(self, size: int, timeout: float = 600.0, hostile: Mapping[int, HostileReducer] | None = None,
                 defended: bool = True):
        """``hostile``: ranks whose results a ``HostileReducer`` makes (what the swarm does of them below);
        ``defended``: whether the swarm's answers to hostile reducers are on."""
        self.size, self.timeout = size, timeout
        self.hostile, self.defended = dict(hostile or {}), defended
        self.convicted: set[int] = set()  # ranks proven to have answered members different results: out for good
        self.caught = 0  # rounds redone: a reducer proven, or a member's audit failed a result
        self.aborted = 0  # rounds nobody applied: members held different results of one piece, undefended
        self.landed = 0  # rounds applied with a hostile reducer's result in them
        self._draw = random.Random(0)  # which piece each member audits: runs repeat exactly
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
        """The round: one attempt, and where a hostile reducer was caught (defended), a redo without its results,
        as the swarm's coordinator decides it (``sync/decide.py``): a reducer whose members hold different digests of
        a piece is proven and out of the run, one whose result failed an audit reduces nothing in the redo."""
        started = time.perf_counter()
        try:
            tallies = [_Tally() for _ in range(self.size)]
            dropped: set[str] = set()
            proven, caught, hostile = self._attempt(set(self.convicted), set(), tallies, dropped)
            committed = True
            if self.defended and (proven or caught):
                self.convicted |= proven
                self.caught += 1
                proven, _, hostile = self._attempt(set(self.convicted), caught, tallies, dropped)
            if proven:  # no majority holds one digest of the piece: nobody applies the round
                committed = False
                self.aborted += 1
            self.landed += committed and hostile
            seconds = time.perf_counter() - started
            self._results = [
                AllReduceResult(sorted(t.peers), committed=committed and rank not in self.convicted,
                                dropped=sorted(dropped), clipped=sorted(t.clipped), opposed=sorted(t.opposed),
                                tokens=self._tokens[rank],
                                traffic=Traffic(t.sent, t.received, t.dense, t.contributed, t.params, seconds))
                for rank, t in enumerate(tallies)
            ]
            self._error = None
        except BaseException as e:  # re-raised in every replica's thread
            self._error = e

    def _attempt(self, out: set[int], passive: set[int], tallies: list[_Tally], dropped: set[str]
                 ) -> tuple[set[int], set[int], bool]:
        """One butterfly among the ranks not ``out``, the ``passive`` ones reducing nothing: the hostile reducers
        whose members hold different digests of a piece, (defended) those whose piece a member's audit failed, and
        whether a hostile reducer answered any piece."""
        plans = self._plans
        names = [f"replica-{rank}" for rank in range(self.size)]
        proven: set[int] = set()
        reduced: list[_Piece] = []
        for slice_name in dict.fromkeys(s for plan in plans for s in plan):  # in order of first appearance
            holders = [rank for rank in range(self.size) if slice_name in plans[rank] and rank not in out]
            reducers = [rank for rank in holders if rank not in passive]
            for rank in holders:
                plans[rank][slice_name].fit_group(len(holders))
            spans = plans[holders[0]][slice_name].partition(len(reducers))
            for reducer, span in ((r, piece) for r, whole in zip(reducers, spans)
                                  for piece in pieces(plans[r][slice_name], whole)):
                payloads = [plans[rank][slice_name].encode(span) for rank in holders]
                reducing = plans[reducer][slice_name]
                reduction = reduce_span(reducing, span, list(zip([names[r] for r in holders], payloads)),
                                        {names[r]: self._tokens[r] for r in holders})
                dropped.update(reduction.rejected)
                tallies[reducer].clipped.update(reduction.clipped)
                tallies[reducer].opposed.update(reduction.opposed)
                hostile = self.hostile.get(reducer)
                answers = (hostile.results(reducing, span, reduction, [names[r] for r in holders])
                           if hostile is not None else {})
                digests = set()
                for rank, payload in zip(holders, payloads):
                    result = answers.get(names[rank]) or reduction.result_for(reducing, names[rank])
                    digests.add(plans[rank][slice_name].receive(span, result, reduction.receipt_for(names[rank])))
                    tallies[rank].contributed += len(payload)
                    if rank != reducer:
                        tallies[rank].sent += len(payload)
                        tallies[reducer].received += len(payload)
                        tallies[reducer].sent += len(result)
                        tallies[rank].received += len(result)
                if len(digests) > 1:
                    proven.add(reducer)
                reduced.append(_Piece(slice_name, span, reducer, reduction))
            for rank in holders:
                exchange = plans[rank][slice_name]
                index = reducers.index(rank) if rank in reducers else None
                tallies[rank].dense += dense_fp32_bytes(exchange, spans, index)
                tallies[rank].params += exchange.numel(range(exchange.num_units))
                tallies[rank].peers.update(names[r] for r in holders)
        caught = self._audits(reduced, out, names) if self.defended and self.hostile else set()
        return proven, caught, any(p.reducer in self.hostile for p in reduced)

    def _audits(self, reduced: list[_Piece], out: set[int], names: list[str]) -> set[int]:
        """Every member audits one random piece another reducer answered it (``sync/audit.py``): the reducers of
        the pieces that fail. (Only where a hostile reducer is: an honest result always passes.)"""
        caught = set()
        tokens = {names[rank]: self._tokens[rank] for rank in range(self.size)}
        for rank in range(self.size):
            if rank in out:
                continue
            drawn = [p for p in reduced if p.reducer != rank and p.slice in self._plans[rank] and len(p.span)
                     and self._plans[rank][p.slice].auditable]
            if not drawn:
                continue
            piece = drawn[self._draw.randrange(len(drawn))]
            exchange = self._plans[rank][piece.slice]
            if audit(exchange, piece.span, piece.reduction.weighed, tokens, piece.reduction.receipt_for(names[rank]),
                     exchange.taken(piece.span)) is not None:
                caught.add(piece.reducer)
        return caught


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
