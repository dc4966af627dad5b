"""How many inner steps a round trains: as many as fit in the round's wall-clock budget, at most H.

A swarm whose peers differ 2-10x in speed would otherwise train at the pace of its slowest peer (every round
waits for it) or, where the slow peer misses the wait, throw its work away. Instead every round has a budget
in seconds that the swarm agrees on, and each peer trains until the next step would end past it (at least one
step, at most ``inner.steps``). The fastest peers train H steps, a peer three times slower a third of them, and
all of them join the round's all-reduce at about the same time; each contribution is weighted by the tokens it
was trained on (``collective/robust.py``), so the slow peer's work counts for what it is.

A step runs while it would end no later than half a step past the budget. The budget: ``inner.round_seconds``
where a peer sets it (all peers of a run should set the same), else the time the fastest peers need for H steps:
each peer publishes the median of its recent inner steps, the peers within ``FAST_COHORT`` of the fastest (this one's
own included) train H steps, and a slower peer's budget is H times the median step of those. (On a busy machine step
times wander by tens of percent: a budget from the single fastest step would cut the fast peers' rounds too.) A peer
whose record claims an absurdly fast step could
shorten everyone's rounds; the budget is never below H steps of this peer's own, divided by ``MAX_SPEED_SPREAD``,
so a lie costs the others more frequent rounds at most, never a stall. ``inner.fixed_steps`` trains H steps every
round regardless (pipeline stages and Streaming DiLoCo fragments always do: their steps are scheduled by count).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Iterable
from typing import Protocol

MAX_SPEED_SPREAD = 16  # the fastest step a budget trusts is this many times faster than this peer's own
FAST_COHORT = 2.0  # peers whose steps take at most this many times the fastest's train H steps: timing noise
STEP_MEMORY = 8  # recent steps whose median is this peer's step time


class RoundBudget(Protocol):
    def allows(self, steps_done: int, seconds: float) -> bool:
        """Whether one more inner step fits in the round, after ``steps_done`` steps and ``seconds`` since the round
        began."""


class StepTimes:
    """This peer's recent inner-step times (what it publishes as ``step_seconds``)."""

    def __init__(self) -> None:
        self._recent: deque[float] = deque(maxlen=STEP_MEMORY)

    def add(self, seconds: float) -> None:
        self._recent.append(seconds)

    @property
    def median(self) -> float:
        """The median of the recent steps (0.0 before the first)."""
        return statistics.median(self._recent) if self._recent else 0.0


class FixedSteps:
    """A round of exactly ``steps`` inner steps (``inner.fixed_steps``; a simulated slow replica trains fewer)."""

    def __init__(self, steps: int):
        self.steps = steps

    def allows(self, steps_done: int, seconds: float) -> bool:
        return steps_done < self.steps


class WallClockBudget:
    """The round's budget in seconds (module docstring): one more step while it would end within it."""

    def __init__(self, steps: int, own: StepTimes, swarm_step_seconds: Callable[[], Iterable[float]],
                 round_seconds: float = 0.0):
        """``swarm_step_seconds``: the step times the live peers of this run publish (0: not yet known);
        ``round_seconds``: a budget set in the config (0: derived from the swarm)."""
        self.steps, self.own, self.round_seconds = steps, own, round_seconds
        self.swarm_step_seconds = swarm_step_seconds

    def seconds(self) -> float | None:
        """The budget now (None: none, train H steps: this peer is among the fastest, or nothing is known yet)."""
        if self.round_seconds > 0:
            return self.round_seconds
        own = self.own.median
        if own <= 0:
            return None
        known = [own, *(s for s in self.swarm_step_seconds() if s > 0)]
        fastest = max(min(known), own / MAX_SPEED_SPREAD)
        if own <= FAST_COHORT * fastest:
            return None
        return self.steps * statistics.median(max(s, fastest) for s in known if s <= FAST_COHORT * fastest)

    def allows(self, steps_done: int, seconds: float) -> bool:
        if steps_done >= self.steps:
            return False
        budget = self.seconds()
        # A step that would end within half a step of the budget still goes: the fastest peer's H steps plus the
        # round's bookkeeping must not lose it its last step.
        return steps_done == 0 or budget is None or seconds + 0.5 * self.own.median <= budget
