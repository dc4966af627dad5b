"""Round schedules, one per file, each readable top to bottom: when a worker's inner steps and its outer round
happen relative to each other.

- ``blocking.py``: train, average, step, as DiLoCo, SparseLoCo and LoCo are written;
- ``overlapped.py``: the all-reduce of round r runs during round r+1's inner steps (eager or naive update);
- ``streaming.py``: Streaming DiLoCo, every fragment synced at its own inner steps.

``build_schedule`` picks the one a run's config asks for.
"""

from __future__ import annotations

from p2ploco.config import Config
from p2ploco.schedules.base import RoundHooks, RoundOutcome, RoundSchedule
from p2ploco.schedules.blocking import BlockingRounds
from p2ploco.schedules.overlapped import AS_SOON_AS_READY, Landing, OverlappedRounds
from p2ploco.schedules.streaming import StreamingRounds
from p2ploco.worker import Worker

__all__ = ["Landing", "RoundHooks", "RoundOutcome", "RoundSchedule", "build_schedule"]


def build_schedule(config: Config, worker: Worker, landing: Landing = AS_SOON_AS_READY) -> RoundSchedule:
    """The schedule of ``config``'s outer algorithm for ``worker``; ``landing``: when an eager overlapped round
    lands (by default as soon as it is ready)."""
    if config.outer.algorithm == "streaming":
        return StreamingRounds(worker, worker.outer)
    if config.outer.overlap is not None:
        return OverlappedRounds(worker, config.outer.overlap, landing)
    return BlockingRounds(worker)
