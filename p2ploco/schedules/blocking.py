"""The blocking round, as DiLoCo, SparseLoCo and LoCo are written in their papers.

    train H inner steps from the global params (or as many as fit in the round's budget: budget.py)
    contribute: pseudo-gradient (global - local) into the outer algorithm's exchange
    all-reduce it with the round's group, and wait
    outer step on the aggregate (if the round committed), publish the new global state
    the local params start over from it

Everything happens on the training thread, one part after the other: the time a round spends outside its
inner steps is the all-reduce, the step and the hash.
"""

from __future__ import annotations

from collections.abc import Callable

from p2ploco.budget import FixedSteps
from p2ploco.collective.exchange import Communicator, SittingOut
from p2ploco.outer.base import Synced
from p2ploco.schedules.base import RoundHooks, RoundOutcome, RoundSchedule


class BlockingRounds(RoundSchedule):
    sits_out = True

    def run(self, round_index: int, comm: Communicator, hooks: RoundHooks) -> RoundOutcome | None:
        hooks.announce()
        inner = self.worker.inner.run_round(round_index, hooks.stopping, budget=hooks.budget)
        if inner is None:
            self.worker.load_into_model()
            return None
        return RoundOutcome(inner, self.average(round_index, comm, inner.tokens))

    def sit_out(self, round_index: int, stopping: Callable[[], bool], me: str) -> RoundOutcome | None:
        inner = self.worker.inner.run_round(round_index, stopping, budget=FixedSteps(1))
        if inner is None:
            self.worker.load_into_model()
            return None
        return RoundOutcome(inner, self.average(round_index, SittingOut(me), inner.tokens))

    def average(self, round_index: int, comm: Communicator, tokens: int = 1) -> Synced:
        """The outer round on whatever the local params hold now (trained on ``tokens``): pseudo-gradient,
        all-reduce, step, publish; the local params start over from the global ones."""
        worker = self.worker
        # A constrained worker trained a projection of the global params: its progress is measured from that.
        start = worker.start_params() if worker.constraint is not None else None
        synced = worker.outer.sync(worker.local_params(), comm, round_index, start, tokens)
        if synced.applied:
            worker.refresh_published()
        worker.load_into_model()
        return synced
