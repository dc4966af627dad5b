"""How many inner steps a round trains: as many as fit in the round's wall-clock budget, at most H.

A swarm whose peers differ 2-10x in speed would otherwise train at the pace of its slowest peer (every round
waits for it) or, where the slow peer misses the wait, throw its work away. Instead every round has a budget
in seconds that the swarm agrees on, and each peer trains until the next step would end past it (at least one
step, at most ``inner.steps``). The fastest peers train H steps, a peer three times slower a third of them, and
all of them join the round's all-reduce at about the same time; each contribution is weighted by the tokens it
was trained on (``collective/robust.py``), so the slow peer's work counts for what it is.

A step runs while it would end within the budget (or half of it would, where the config sets it). The budget:
``inner.round_seconds`` where a peer sets it (all peers of a run should set the same), else the time the fastest
peers need for H steps: each peer publishes the median of its recent inner steps (their wall time, whatever held
them: a peer that waits for its data or shares its device is as slow as it is), the peers within ``FAST_COHORT`` of
the fastest (this one's own included) train H steps, and a slower peer's budget is H times the median step of
those. (On a busy machine step times wander by tens of percent: a budget from the single fastest step would cut
the fast peers' rounds too.)

A step time is a claim in a record, and a record is free to publish: one claiming 1e-300 s, of a peer that never
joined a round, used to cut every peer's round to one step of H. So the budget goes by the peers that took part in
this peer's recent rounds (``Swarm.step_seconds``: those whose contributions were in an aggregate it applied in its
last few all-reduces; a peer with none, a joiner, goes by every live record of the run until it applies a round
again), never by a banned peer, and of their step times it believes none more than ``BELIEVED_SPREAD`` times faster
than the group's lower median (its own and theirs), nor ``MAX_SPEED_SPREAD`` times faster than its own. A claim
faster than that is left out, as if its peer were absent. Moving the lower median takes claims from half the group
or more; short of that, the most a member can do is claim a step at the bound, which gives the peers at the median
a budget of no less than H times a quarter of their step: they train a quarter of H, and a liar that claims a full
round's tokens weighs 4x one of them (the direction rule still holds its contribution to the others'). The cost:
an honest fast minority more than 4x faster than the group's lower median counts as only that fast, and waits for
the others. (The bound was 2x: the fast peer of a group 1x, 3x, 10x waited for the 3x one's H steps, its rounds
2.38x those of two fast peers alone.)

A peer whose single step outlasts the round (the budget is shorter than its own step) would hold every round
for it; instead it sits rounds out: it trains one step while its record says it is standing by (no coordinator
waits for it), keeps the step's work as a round not applied keeps it (error feedback or carry, its tokens owed),
catches up, and contributes that work in the next round without training in it (``sitting``, which ``Node._round``
asks each round). Not in its last two rounds (``training.rounds``): the step's work lands a round later at the
earliest, while the others are still there, so it sits those rounds out idle.

A pipeline group's stages step together: each asks its own budget within every step whether another fits, and the
group stops where any says no (``InnerTrainer.run_round``), so it trains as many steps as its slowest stage's budget
allows. Streaming DiLoCo places its fragments' syncs by step before the round begins: it plans the steps that fit
(``planned_steps``) and spreads the syncs over them as it spreads them over H (``StreamingDiLoCo.schedule_for``),
so each sync of a slow peer comes at about the wall time of the fast peers'. ``inner.fixed_steps`` trains H steps
every round regardless.
"""

from __future__ import annotations

import enum
import math
import statistics
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from p2ploco.config import InnerConfig

MAX_SPEED_SPREAD = 16  # the fastest step a budget believes is this many times faster than this peer's own
FAST_COHORT = 2.0  # peers whose steps take at most this many times the fastest's train H steps: timing noise
BELIEVED_SPREAD = 4.0  # the fastest step a budget believes is this many times faster than its group's lower median
STEP_MEMORY = 8  # recent steps whose median is this peer's step time
SIT_OUT_AFTER = 3  # steps a peer measures before it may sit rounds out: its first one carries start-up costs


class RoundBudget(Protocol):
    def allows(self, steps_done: int, seconds: float) -> bool:
        """Whether one more inner step fits in the round, after ``steps_done`` steps and ``seconds`` since the round
        began."""

    def planned_steps(self) -> int:
        """The steps that fit in the round as this peer's pace has it now: for a schedule that places work by step
        before the round begins (Streaming DiLoCo's fragment syncs)."""


class StepTimes:
    """This peer's recent inner-step times (what it publishes as ``step_seconds``)."""

    def __init__(self) -> None:
        self._recent: deque[float] = deque(maxlen=STEP_MEMORY)

    def add(self, seconds: float) -> None:
        self._recent.append(seconds)

    def __len__(self) -> int:
        return len(self._recent)

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

    def planned_steps(self) -> int:
        return self.steps


class WallClockBudget:
    """The round's budget in seconds (module docstring): one more step while it would end within it."""

    def __init__(self, steps: int, own: StepTimes, swarm_step_seconds: Callable[[], Iterable[float]],
                 round_seconds: float = 0.0):
        """``swarm_step_seconds``: the step times of the peers this one goes by, its own left out
        (``Swarm.step_seconds``; 0: not yet known); ``round_seconds``: a budget set in the config (0: derived from
        the swarm)."""
        self.steps, self.own, self.round_seconds = steps, own, round_seconds
        self.swarm_step_seconds = swarm_step_seconds

    def seconds(self) -> float | None:
        """The budget now (None: none, train H steps: this peer is among the fastest, or nothing is known yet)."""
        return self._seconds(judging_own_step=False)

    def others_round_seconds(self) -> float | None:
        """The round the others train, as far as this peer believes their step times, to judge whether its own step
        outlasts it (None: it does not, or nothing is known yet): its own step is left out of their median (a slow
        peer is not the median of the round it would hold: in a group 1x, 3x, 10x the 10x step made the 3x one the
        median, whose H steps it fit), and no claim is left out for being too fast for its own (a peer more than
        16x slower than the others sits rounds out rather than train H steps; a claim can then only make it sit
        out, which delays its work and loses none)."""
        return self._seconds(judging_own_step=True)

    def _seconds(self, judging_own_step: bool) -> float | None:
        if self.round_seconds > 0:
            return self.round_seconds
        own = self.own.median
        if own <= 0:
            return None
        claims = [s for s in self.swarm_step_seconds() if s > 0]
        # Claims faster than this are not believed: the group's lower-median peer trains at least a quarter of H
        # (only half the group or more can move that median), and no claim is absurdly faster than this peer's own.
        if judging_own_step and claims:
            fastest_believed = statistics.median_low(claims) / BELIEVED_SPREAD
        else:
            fastest_believed = max(statistics.median_low([own, *claims]) / BELIEVED_SPREAD, own / MAX_SPEED_SPREAD)
        known = [own, *(s for s in claims if s >= fastest_believed)]
        fastest = min(known)
        if own <= FAST_COHORT * fastest:
            return None
        return self.steps * statistics.median(s for s in known if s <= FAST_COHORT * fastest)

    def outlasted(self) -> bool:
        """Whether one step of this peer outlasts the others' whole round (``others_round_seconds``): it then trains a
        step across rounds, sitting them out, and contributes the step's work in a later round
        (``RoundSchedule.sit_out``)."""
        budget = self.others_round_seconds()
        return len(self.own) >= SIT_OUT_AFTER and budget is not None and self.own.median > budget

    def planned_steps(self) -> int:
        """The steps ``allows`` lets run at this peer's median step: step k starts k steps in (at least 1, at most
        H)."""
        budget = self.seconds()
        if budget is None:
            return self.steps
        return max(1, min(self.steps, math.floor(budget / self.own.median - self._must_fit()) + 1))

    def allows(self, steps_done: int, seconds: float) -> bool:
        if steps_done >= self.steps:
            return False
        budget = self.seconds()
        return steps_done == 0 or budget is None or seconds + self._must_fit() * self.own.median <= budget

    def _must_fit(self) -> float:
        """How much of the next step must fit in the budget for it to run. A budget set in the config: half (the
        fastest peer's H steps plus the round's bookkeeping must not lose it its last step). A budget from the fast
        peers' steps: all of it, so that they never wait for this peer (half a step was a quarter of their round for
        a 3x peer at H = 5, whose second step ran past their five)."""
        return 0.5 if self.round_seconds > 0 else 1.0


def round_budget(inner: InnerConfig, hub: bool, own: StepTimes, swarm_step_seconds: Callable[[], Iterable[float]]
                 ) -> WallClockBudget | FixedSteps | None:
    """How many inner steps fit in a round: as many as the swarm's round budget allows (for a pipeline stage, as its
    group's slowest stage's budget allows), unless this peer trains a fixed H (None), or none (a ``hub``)."""
    if hub:
        return FixedSteps(0)
    if inner.fixed_steps:
        return None
    return WallClockBudget(inner.steps, own, swarm_step_seconds, inner.round_seconds)


class Sitting(enum.StrEnum):
    """What a peer does in a round, as far as its step's length goes (module docstring)."""

    TRAINS = "trains"  # it trains the round as the others do
    CONTRIBUTES = "contributes"  # it contributes the work it kept from the round it sat out, without a step
    STEPS = "steps"  # it sits the round out, training a step while nobody waits for it
    IDLES = "idles"  # it sits the round out idle: a step's work would land past its last round


@dataclass(frozen=True)
class SitOut:
    sitting: Sitting
    wait: float = 0.0  # seconds it waits first (CONTRIBUTES), or for the others' round (IDLES)

    @property
    def sits_out(self) -> bool:
        """What its record says: its step outlasts the round (the others' budgets leave its step time out)."""
        return self.sitting != Sitting.TRAINS


def sitting(budget: WallClockBudget | FixedSteps | None, may_sit_out: bool, kept_tokens: int, catchup_seconds: float,
            formation_wait: Callable[[], float], last_rounds: bool) -> SitOut:
    """Whether and how this peer sits the round out. Only a replica that trains alone under a blocking schedule
    ``may_sit_out`` (a pipeline stage cannot: its group steps together), and only where its step outlasts the
    others' round (``WallClockBudget.outlasted``). With work kept from the round it sat out (``kept_tokens``) it
    contributes it, joining once the others may be done with their steps: a formation closes its wait
    (``formation_wait``) after its first contribution, and one that came early would close before them; their
    round began about as its catch-up did (``catchup_seconds`` ago). Else it trains a step while nobody waits for
    it, except in its ``last_rounds`` (the last two), where the step's work would land after the others had
    finished, alone, and its state would part from theirs: it sits the round out idle."""
    if not (may_sit_out and isinstance(budget, WallClockBudget) and budget.outlasted()):
        return SitOut(Sitting.TRAINS)
    if kept_tokens:
        return SitOut(Sitting.CONTRIBUTES,
                      max(0.0, budget.others_round_seconds() - catchup_seconds - formation_wait() / 2))
    if last_rounds:
        return SitOut(Sitting.IDLES, budget.others_round_seconds())
    return SitOut(Sitting.STEPS)
