"""The interface of a round schedule, and what it reports.

A round schedule says when a worker's inner steps and its outer round happen relative to each other (not to
be confused with a pipeline group's micro-batch schedule, ``pipeline/schedule.py``). A node, or an in-process
harness, runs every round as ``schedule.run(round, comm, hooks)``; the schedule does what lies between:
inner steps, contribution, all-reduce, outer step, and where the local params go after it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from p2ploco.budget import RoundBudget
from p2ploco.checkpoint import Checkpoint
from p2ploco.collective.exchange import Communicator
from p2ploco.inner import InnerStats
from p2ploco.outer.base import Synced
from p2ploco.swarm.state import Snapshot
from p2ploco.worker import Worker


def _never() -> bool:
    return False


def _nothing() -> None:
    return None


@dataclass(frozen=True)
class RoundHooks:
    """What the caller of ``run`` lends a schedule for one round."""

    stopping: Callable[[], bool] = _never  # asked before each inner step: True abandons the round
    # Called once per round, as soon as the peer's public record may say it works on this round (the formation of
    # a round in flight reads that record: it must not move on before that round has its group).
    announce: Callable[[], None] = _nothing
    # how many inner steps fit in the round (``budget.py``); None: H
    budget: RoundBudget | None = None


@dataclass
class RoundOutcome:
    inner: InnerStats
    comm: Synced | None  # the outer round that landed during this one (None: none did)


class RoundSchedule(ABC):
    # whether a peer whose step outlasts the round may sit rounds out with this schedule (``sit_out``); an
    # overlapped round in flight, or Streaming DiLoCo's fragments synced at fixed steps, leave no round to sit out
    sits_out = False

    def __init__(self, worker: Worker):
        self.worker = worker

    @abstractmethod
    def run(self, round_index: int, comm: Communicator, hooks: RoundHooks) -> RoundOutcome | None:
        """One round: the inner steps and the outer work this schedule puts around them. None if ``hooks.stopping``
        turned true before the inner steps were done: the round is abandoned."""

    def sit_out(self, round_index: int, stopping: Callable[[], bool], me: str) -> RoundOutcome | None:
        """Train one step of ``round_index`` and contribute it to no all-reduce: the outer algorithm keeps its work
        as it keeps a round not applied, for the next round this peer contributes to (``budget.py``). None if
        ``stopping`` turned true first."""
        raise NotImplementedError(f"{type(self).__name__} does not sit rounds out")

    def finish_in_flight(self) -> Synced | None:
        """Wait for a round still in flight and land it (before an exit checkpoint); None if there is none."""
        return None

    def land_in_flight(self, timeout: float) -> None:  # noqa: B027 (only an overlapped schedule has anything to wait for)
        """Wait, at most ``timeout`` seconds, until a round in flight knows its group: from then on the peer's
        record may name a later round without changing how that one is formed."""

    def restart(self) -> None:
        """The local params start over from the published global ones (a round was abandoned)."""
        self.worker.load_into_model()

    def adopt(self, snapshots: dict[str, Snapshot], keep_local: bool = False) -> None:
        """Take the swarm's state (``Worker.adopt``)."""
        self.worker.adopt(snapshots, keep_local)

    def checkpoint(self, round_index: int, extras: dict[str, Any] | None = None) -> Checkpoint:
        """``Worker.checkpoint`` of the published state."""
        return self.worker.checkpoint(round_index, extras)

    def close(self) -> None:  # noqa: B027 (only schedules with a background thread have one to stop)
        """Stop this schedule's background work (a round in flight is left unread)."""
