"""Overlapped rounds: the all-reduce of round r runs while round r+1's inner steps do.

Round r as the training thread runs it (``run``), in named steps after torchft's ``prepare_sync`` /
``perform_sync``; the background thread (``background.py``) does what ``_contribute`` and ``_prepare_landing`` say:

    train round r's inner steps; between two of them (``_between_steps``): announce round r once round r-1 has
        its group; eager: as soon as round r-1 has landed, take it (``_perform_sync``)
    at the end of the inner steps:
        eager: take round r-1 if it has not landed yet (only here does the training thread wait, and only for
               a round in flight more than one round late)
        capture the local params y_r
        naive: take round r-1, its step applied to the local params as well
        hand round r to the background thread (``_prepare_sync``): there ``_contribute`` measures start_r - y_r
        and starts its all-reduce; once that has ended, ``_prepare_landing`` prepares the outer step, hashes the
        state it leaves and (eager) the jump that rebases onto it
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

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from p2ploco.checkpoint import Checkpoint
from p2ploco.collective.exchange import Communicator
from p2ploco.device import to_device, wait_for
from p2ploco.outer.base import OuterSync, Synced
from p2ploco.schedules.background import Background, Landed
from p2ploco.schedules.base import RoundHooks, RoundOutcome, RoundSchedule
from p2ploco.swarm.state import Snapshot
from p2ploco.worker import Published, Worker


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


@dataclass
class PreparedLanding:
    """A round whose all-reduce has ended, made ready on the background thread for the training thread to take."""

    landed: Landed
    adopted: int  # ``OverlappedRounds.adopted`` when it was prepared: a state adopted since makes it stale
    stepped: Published | None  # the state its step leaves (None: no step to take)
    # Eager: the new global params on the training device, and what rebases the local params onto them (new - the
    # point the local params continued from)
    rebased: list[torch.Tensor] = field(default_factory=list)
    moved: list[torch.Tensor] = field(default_factory=list)
    done: torch.cuda.Event | None = None  # on CUDA: when the side stream has finished the tensors above


@dataclass
class Flight:
    """A round handed to the background thread: contributed there, all-reduced, its landing prepared."""

    round_index: int
    trained: list[torch.Tensor]  # the local params at the end of its inner steps, where they continued from
    landing: Future[PreparedLanding] = field(default_factory=Future)
    outer_sync: OuterSync | None = None  # once contributed
    contributed: threading.Event = field(default_factory=threading.Event)  # set once contributed, or failed to

    def grouped(self) -> bool:
        """Whether its all-reduce knows its group (never waits)."""
        pending = self.outer_sync.all_reduce if self.outer_sync is not None else None
        return pending is not None and pending.grouped.is_set()


@dataclass
class RoundUnderWay:
    """The round the training thread runs, as its inner-step boundaries see it."""

    hooks: RoundHooks
    announced: bool = False
    landed: Synced | None = None  # the round in flight, once it has landed during this one

    def announce(self) -> None:
        """Let the peer's record name this round (once)."""
        if not self.announced:
            self.hooks.announce()
            self.announced = True


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
        # Bumped whenever the swarm's state is adopted (a catch-up): a landing prepared before that is stale
        self.adopted = 0

    def run(self, round_index: int, comm: Communicator, hooks: RoundHooks) -> RoundOutcome | None:
        current = RoundUnderWay(hooks)
        self._between_steps(current, 0)
        inner = self.worker.inner.run_round(round_index, hooks.stopping, partial(self._between_steps, current),
                                            hooks.budget)
        if inner is None:
            return None  # the round in flight lands at finish_in_flight
        if self.eager and self.flight is not None:  # not landed yet, so more than one round late: waited for here
            current.landed = self._perform_sync(self.worker.local_params())
        trained = [p.detach().clone() for p in self.worker.local_params()]
        if not self.eager and self.flight is not None:  # one round late, the local params moved by its step too
            current.landed = self._perform_sync(self.worker.local_params())
        current.announce()
        self.flight = self._prepare_sync(round_index, comm, trained, inner.tokens)
        self.start = trained if self.eager else [p.detach().clone() for p in self.worker.local_params()]
        return RoundOutcome(inner, current.landed)

    def _between_steps(self, current: RoundUnderWay, steps_done: int) -> None:
        """After ``steps_done`` inner steps (0: before the first): announce the round once the round in flight has
        its group (its formation reads this peer's record); eager: take the round in flight if ``landing`` says."""
        flight = self.flight
        if flight is None or flight.grouped():
            current.announce()
        if self.eager and flight is not None and self.landing.now(steps_done, flight.landing.done()):
            current.landed = self._perform_sync(self.worker.local_params())

    def _prepare_sync(self, round_index: int, comm: Communicator, trained: list[torch.Tensor], tokens: int,
                      ) -> Flight:
        """Hand round ``round_index`` (``trained`` on ``tokens``) to the background thread, measured from where this
        round's progress is measured from."""
        start = self.start if self.start is not None else list(self.worker.published.params)
        flight = Flight(round_index, trained)
        after = self.background.side.mark()  # ``trained`` was copied on the training stream
        self.background.submit(partial(self._contribute, flight, comm, start, tokens, after))
        return flight

    def _contribute(self, flight: Flight, comm: Communicator, start: list[torch.Tensor], tokens: int,
                    after: torch.cuda.Event | None) -> None:
        """On the background thread: the pseudo-gradient ``start - flight.trained`` into the outer algorithm's
        exchange and its all-reduce started; its landing is prepared once that has ended."""
        worker, side = self.worker, self.background.side
        try:
            with side.running(after), worker.lock:
                side.holds([*flight.trained, *start])
                flight.outer_sync = worker.outer.contribute(flight.trained, flight.round_index, start, tokens)
            flight.outer_sync.start(comm)
        except BaseException as e:  # the training thread meets it when it takes the landing
            flight.landing.set_exception(e)
            raise
        finally:
            flight.contributed.set()
        self.background.when(flight.outer_sync.all_reduce.result, partial(self._prepare_landing, flight),
                             into=flight.landing)

    def _prepare_landing(self, flight: Flight) -> PreparedLanding:
        """On the background thread, once the all-reduce has ended: the outer step, the state it leaves and (eager)
        the jump that rebases the local params onto it."""
        worker, side = self.worker, self.background.side
        adopted = self.adopted
        landed = self.background.land(flight.outer_sync)
        with side.running():
            prepared = PreparedLanding(landed, adopted, worker.after(landed.step) if landed.step is not None else None)
            if self.eager:
                prepared.rebased = to_device((prepared.stepped or worker.published).params, worker.device)
                prepared.moved = [new.sub(old) for new, old in zip(prepared.rebased, flight.trained)]
            prepared.done = side.done()
        return prepared

    @torch.no_grad()
    def _perform_sync(self, params: list[torch.Tensor]) -> Synced:
        """On the training thread: land the round in flight (waiting for it if it is not ready yet), its step put in
        place and its state published; eager: the local params rebased onto it."""
        flight, self.flight = self.flight, None
        prepared = flight.landing.result()
        base = self.start if self.start is not None else list(self.worker.published.params)
        stale = prepared.adopted != self.adopted
        landed = prepared.landed
        if stale and landed.step is not None:  # prepared again, on the state adopted meanwhile
            landed.step = self.worker.outer.prepare(landed.outer_sync)
        synced = self.background.take(landed, () if self.eager else params)
        if landed.step is not None:
            if stale:
                self.worker.refresh_published()
            else:
                self.worker.published = prepared.stepped
        if self.eager:
            self._rebase(params, prepared, base, recompute=stale or base is not flight.trained)
        return synced

    def _rebase(self, params: list[torch.Tensor], prepared: PreparedLanding, base: list[torch.Tensor],
                recompute: bool) -> None:
        """Eager: local += new global params - ``base`` (where the local params continued from); the next progress
        is measured from the new global params. ``recompute``: a catch-up moved the local params or the global state
        meanwhile, so the jump prepared on the background thread no longer fits."""
        wait_for(prepared.done, [*prepared.rebased, *prepared.moved])
        rebased, moved = prepared.rebased, prepared.moved
        if recompute:
            rebased = to_device(self.worker.published.params, self.worker.device)
            moved = [new.sub(old) for new, old in zip(rebased, base)]
        for param, move in zip(params, moved):
            param.add_(move)
        self.start = rebased

    def finish_in_flight(self) -> Synced | None:
        if self.flight is None:
            return None
        synced = self._perform_sync(self.worker.local_params())
        self.start = None
        self.worker.load_into_model()
        return synced

    def land_in_flight(self, timeout: float) -> None:
        flight = self.flight
        if flight is None:
            return
        deadline = time.monotonic() + timeout
        if flight.contributed.wait(timeout) and flight.outer_sync is not None:
            flight.outer_sync.all_reduce.grouped.wait(max(0.0, deadline - time.monotonic()))

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
        self.adopted += 1
        self.start = None
        if flight is not None and {snapshot.round for snapshot in snapshots.values()} != {flight.round_index + 1}:
            self.flight = None

    def checkpoint(self, round_index: int, extras: dict[str, Any] | None = None) -> Checkpoint:
        """A round in flight has not moved the published state: saved as if it were not applied."""
        flight = self.flight
        if flight is not None:
            flight.contributed.wait()
        return self.worker.checkpoint(round_index, extras, flight.outer_sync if flight is not None else None)

    def close(self) -> None:
        self.background.close()
