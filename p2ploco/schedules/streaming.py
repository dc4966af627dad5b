"""Streaming DiLoCo's round: every fragment synced at its own inner steps (``outer/streaming.py``).

    n: the steps that fit the round's budget (H without one; at least P·(tau + 1))
    for each inner step h = 1 .. n, after it:
        for every fragment p whose sync starts at h ((p + 1)·n/P - tau):
            contribute its pseudo-gradient (global - local, the fragment alone), start its all-reduce
            (named after it), and hand its landing to the background thread: wait for the aggregate, prepare
            the Nesterov step of the fragment, hash the fragment's state
        for every fragment p applied at h ((p + 1)·n/P):
            take its landing (waiting for it if it is not ready), then merge the local fragment:
            alpha·local + (1 - alpha)·global
    publish the round's state: every fragment stepped (or not, where its sync failed)

Every sync lands within its round, so at a round's end nothing is in flight and joiners, checkpoints and
catch-up see rounds as with DiLoCo. A round not applied everywhere restarts the local params from the
global ones. The round is not stopped midway: its early fragments already moved the global params, and every
peer must end the round holding all of them (a checkpoint of half a round would be a state nobody else holds);
a stop request takes effect at the round's end.
"""

from __future__ import annotations

from concurrent.futures import Future
from functools import partial

from p2ploco.budget import FixedSteps
from p2ploco.collective.exchange import AllReduceResult, Communicator, Traffic
from p2ploco.outer.base import OuterSync, Synced
from p2ploco.outer.streaming import StreamingDiLoCo
from p2ploco.schedules.background import Background, Landed
from p2ploco.schedules.base import RoundHooks, RoundOutcome, RoundSchedule
from p2ploco.worker import Worker


class StreamingRounds(RoundSchedule):
    def __init__(self, worker: Worker, outer: StreamingDiLoCo):
        """``outer``: the worker's outer algorithm, as the Streaming DiLoCo it is."""
        super().__init__(worker)
        self.outer = outer
        self.background = Background(worker)

    def run(self, round_index: int, comm: Communicator, hooks: RoundHooks) -> RoundOutcome | None:
        worker, outer = self.worker, self.outer
        syncing: dict[str, Future[Landed]] = {}
        synced: dict[str, Synced] = {}
        hashes = dict(worker.slice_digest)

        # The steps that fit this peer's round budget (H without one), the fragments' syncs spread over them
        steps = max(outer.fewest_steps, hooks.budget.planned_steps() if hooks.budget is not None
                    else worker.inner.config.steps)
        tokens, schedule = steps * worker.inner.gradients.tokens_per_step, outer.schedule_for(steps)

        def between(steps_done: int) -> None:
            for name, (start, apply) in schedule.items():
                if steps_done == start:
                    sync = outer.contribute_fragments([name], worker.local_params(), round_index, tokens=tokens)
                    sync.start(comm, name)
                    syncing[name] = self.background.when(sync.all_reduce.result, partial(self._land, sync, name))
                if steps_done == apply:
                    landed = syncing.pop(name).result()
                    synced[name] = self.background.take(landed)
                    if landed.step is not None:
                        outer.merge(worker.local_params(), [name])
                        hashes[name] = landed.slice_digest

        hooks.announce()
        inner = worker.inner.run_round(round_index, lambda: False, between, FixedSteps(steps))
        if set(synced) != set(outer.fragments):
            raise RuntimeError(f"round {round_index} ended with fragments {sorted(syncing)} unsynced")
        round_sync = summed([synced[name] for name in outer.fragments])
        worker.published = worker.state_of(outer.params, outer.shared_state(), hashes)
        if not round_sync.applied:
            worker.load_into_model()
        return RoundOutcome(inner, round_sync)

    def _land(self, sync: OuterSync, name: str) -> Landed:
        landed = self.background.land(sync)
        if landed.step is not None:
            landed.slice_digest = self.worker.slice_hash(landed.step, name)
        return landed

    def close(self) -> None:
        self.background.close()


def summed(syncs: list[Synced]) -> Synced:
    """A round's fragment syncs as one: bytes, parameters and seconds summed, committed and applied only if every
    fragment was, the smallest group, redone if any was, every failure, the weight a fragment carried (fragments
    weigh alike, ``OuterAlgorithm.contribute_fragments``); ``sync_bytes`` lists each fragment's traffic (sent +
    received)."""
    results = [s.all_reduce for s in syncs]
    traffic = [r.traffic for r in results]
    smallest = min(results, key=lambda r: len(r.peers))
    return Synced(AllReduceResult(
        list(smallest.peers), all(r.committed for r in results), any(r.excluded for r in results),
        sorted({p for r in results for p in r.dropped}), sorted({p for r in results for p in r.clipped}),
        sorted({p for r in results for p in r.opposed}), max(r.attempts for r in results),
        [failure for r in results for failure in r.failures], max(r.tokens for r in results),
        traffic=Traffic(sum(t.bytes_sent for t in traffic), sum(t.bytes_received for t in traffic),
                        sum(t.dense_fp32_bytes for t in traffic), sum(t.contribution_bytes for t in traffic),
                        sum(t.params for t in traffic), sum(t.seconds for t in traffic),
                        [t.bytes_sent + t.bytes_received for t in traffic]),
        refused_by=sorted({p for r in results for p in r.refused_by})),
        all(s.applied for s in syncs))
