"""Overlapped rounds: the all-reduce of round r runs while round r+1's inner steps do.

Round r as the training thread runs it (a background thread does the rest: ``background.py``):

    train round r's inner steps; eager: between two of them, as soon as round r-1 has landed, take it
    at the end of the inner steps:
        eager: take round r-1 if it has not landed yet (only here does the training thread wait, and only for
               a round in flight more than one round late)
        capture the local params y_r
        naive: take round r-1, its step applied to the local params as well
        hand round r to the background thread: contribute start_r - y_r, start its all-reduce, wait for it,
        prepare the outer step, hash the state it leaves and (eager) the jump that rebases onto it
    go on to round r+1 at once

The two updates differ in where the local params go meanwhile.

Eager (the default; after Kale et al. 2025, "Eager updates for overlapped communication and computation in
DiLoCo"): this replica's own pseudo-gradient stands in for the round's average that has not arrived. The
replica trains on from where its inner steps ended, y_r = start_r - Delta_r: the global params moved by its
own progress. When round r lands, the stand-in is replaced by the real step: the local params are rebased onto
the new global params G_{r+1}, keeping the inner steps they took since (local += G_{r+1} - y_r), and round
r+1's pseudo-gradient is measured from G_{r+1}. So every contribution is this replica's training progress and
nothing else, and the global params take every round's average exactly once, at most one round late; the
stand-in only decides where the inner steps before the landing ran. docs/design.md ("Overlapped rounds")
derives it from the paper and says how it meets SparseLoCo's error feedback.

Naive (``overlap_update: naive``): the replica keeps its own progress and takes each landed step one round late,
at the end of the next round's inner steps (local -= the step the global params took); its pseudo-gradient is
measured from where the round's inner steps started, a point of its own.

Either way every peer takes the same aggregate onto the same global state, so the global params stay
bit-identical. The state of round r (served to joiners, hashed in the record) is the global state at round r's
start on every peer: every round before r-1 applied.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from p2ploco.checkpoint import Checkpoint
from p2ploco.collective.exchange import Communicator
from p2ploco.device import to_device, wait_for
from p2ploco.outer.base import Synced
from p2ploco.schedules.background import Background, Flight, Landed
from p2ploco.schedules.base import RoundHooks, RoundOutcome, RoundSchedule
from p2ploco.swarm.state import Snapshot
from p2ploco.worker import Worker


@dataclass(frozen=True)
class Landing:
    """When an eager round in flight lands during the next round: at the first inner step boundary from ``after``
    steps on at which it is ready, at the latest at that round's end. ``wait``: at exactly ``after`` steps,
    waiting for it there if need be (a fixed schedule, for tests and benchmarks)."""

    after: int = 0
    wait: bool = False

    def now(self, steps_done: int, ready: bool) -> bool:
        return steps_done == self.after if self.wait else steps_done >= self.after and ready


AS_SOON_AS_READY = Landing()


class OverlappedRounds(RoundSchedule):
    def __init__(self, worker: Worker, update: str, landing: Landing = AS_SOON_AS_READY):
        super().__init__(worker)
        if worker.constraint is not None:
            raise ValueError("overlapped rounds need an unconstrained worker (pipeline groups do not overlap)")
        self.eager, self.landing = update == "eager", landing
        self.background = Background(worker)
        self.flight: Flight | None = None  # the round whose all-reduce runs during this one
        self.start: list[torch.Tensor] | None = None  # where this round's progress is measured from (None: the
        # published global params)

    def run(self, round_index: int, comm: Communicator, hooks: RoundHooks) -> RoundOutcome | None:
        params = list(self.worker.model.parameters())
        landed: Synced | None = None
        announced = False

        def between(steps_done: int) -> None:
            nonlocal landed, announced
            flight = self.flight
            if not announced and (flight is None or flight.grouped()):
                hooks.announce()  # the formation of the round in flight no longer reads our record
                announced = True
            if self.eager and flight is not None and self.landing.now(steps_done, flight.ready()):
                landed = self._take(params)

        between(0)
        inner = self.worker.inner.run_round(round_index, hooks.stopping, between, hooks.budget)
        if inner is None:
            return None  # the round in flight lands at finish_in_flight
        if self.eager and self.flight is not None:
            landed = self._take(params)
        trained = [p.detach().clone() for p in params]
        if not self.eager and self.flight is not None:
            landed = self._take(params)
        if not announced:
            hooks.announce()
        self._launch(round_index, comm, trained, inner.tokens)
        self.start = trained if self.eager else [p.detach().clone() for p in params]
        return RoundOutcome(inner, landed)

    def _launch(self, round_index: int, comm: Communicator, trained: list[torch.Tensor], tokens: int) -> None:
        """Round ``round_index``'s outer work (``trained`` on ``tokens``), on the background thread: contribution,
        all-reduce, landing."""
        worker, background = self.worker, self.background
        start = self.start if self.start is not None else list(worker.published.params)
        flight = Flight(round_index, trained)
        after = background.side.mark()  # ``trained`` was copied on the training stream

        def contribute() -> None:
            try:
                with background.side.running(after), worker.lock:
                    background.side.holds([*trained, *start])
                    flight.outer_round = worker.outer.contribute(trained, round_index, start, tokens)
                flight.outer_round.start(comm)
            except BaseException as e:  # the training thread meets it when it takes the landing
                flight.landing.set_exception(e)
                raise
            finally:
                flight.contributed.set()
            background.when(flight.outer_round.all_reduce.result, land, into=flight.landing)

        def land() -> Landed:
            landed = background.land(flight.outer_round)
            with background.side.running():
                if landed.step is not None:
                    landed.published = worker.after(landed.step)
                if self.eager:
                    landed.rebased = to_device((landed.published or worker.published).params, worker.device)
                    landed.moved = [new.sub(old) for new, old in zip(landed.rebased, trained)]
                landed.done = background.side.done()
            return landed

        background.submit(contribute)
        self.flight = flight

    @torch.no_grad()
    def _take(self, params: list[torch.Tensor]) -> Synced:
        """Land the round in flight on the training thread (waiting for it if it is not ready yet)."""
        flight, self.flight = self.flight, None
        landed = flight.landing.result()
        base = self.start if self.start is not None else list(self.worker.published.params)
        prepared_here = landed.loaded != self.background.loaded
        synced = self.background.take(landed, () if self.eager else params)
        if landed.published is not None:
            self.worker.published = landed.published
        elif landed.step is not None:  # prepared again here, on a state loaded meanwhile
            self.worker.publish()
        if self.eager:
            wait_for(landed.done, [*landed.rebased, *landed.moved])
            if prepared_here or base is not flight.base:  # a catch-up moved the local params meanwhile
                landed.rebased = to_device(self.worker.published.params, self.worker.device)
                landed.moved = [new.sub(old) for new, old in zip(landed.rebased, base)]
            for param, move in zip(params, landed.moved):
                param.add_(move)
            self.start = landed.rebased
        return synced

    def finish_in_flight(self) -> Synced | None:
        if self.flight is None:
            return None
        synced = self._take(list(self.worker.model.parameters()))
        self.start = None
        self.worker.load_into_model()
        return synced

    def settle(self, timeout: float) -> None:
        flight = self.flight
        if flight is None:
            return
        deadline = time.monotonic() + timeout
        if flight.contributed.wait(timeout) and flight.outer_round is not None:
            flight.outer_round.all_reduce.grouped.wait(max(0.0, deadline - time.monotonic()))

    def restart(self) -> None:
        self.start = None
        self.worker.load_into_model()

    def adopt(self, snapshots: dict[str, Snapshot], keep_local: bool = False) -> None:
        """Take the swarm's state. A round in flight still lands on it if it is the state it was meant for (that of
        the next round), else it is dropped (its all-reduce ends in the background, unread)."""
        flight = self.flight
        if flight is not None:
            flight.contributed.wait()  # what its contribution takes from local state is taken before the reset
        self.worker.adopt(snapshots, keep_local)
        self.background.loaded += 1
        self.start = None
        if flight is not None and {snapshot.round for snapshot in snapshots.values()} != {flight.round_index + 1}:
            self.flight = None

    def checkpoint(self, round_index: int, extras: dict[str, Any] | None = None) -> Checkpoint:
        """A round in flight has not moved the published state: saved as if it were not applied."""
        flight = self.flight
        if flight is not None:
            flight.contributed.wait()
        return self.worker.checkpoint(round_index, extras, flight.outer_round if flight is not None else None)

    def close(self) -> None:
        self.background.close()
