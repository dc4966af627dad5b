"""What a node shows the swarm, one verb per moment of a round.

Its machine, its record's phase, round and state digests (``Swarm.announce_progress``), its pace and results
(``Swarm.update_record``, ``Swarm.track``) and the state it serves to peers catching up (``Swarm.serve_state``).
Every verb returns at once: records are stored in the background, except where a verb says otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial

from p2ploco.metrics import RoundSummary
from p2ploco.peer import Swarm
from p2ploco.roles import Role
from p2ploco.swarm.records import EVAL_HISTORY, Phase


class Presence:
    def __init__(self, swarm: Swarm, role: Role):
        self.swarm, self.role = swarm, role

    @staticmethod
    def announce_machine(swarm: Swarm, device: str, ranks: int) -> None:
        """The device this peer trains on and its local ranks: shown as it starts, before it has a role."""
        swarm.update_record(device=device, ranks=ranks)

    def track_steps(self) -> None:
        """Keep the record's inner step and median step time as the worker's are, at every heartbeat: the round
        budgets of others go by them (``budget.py``). The role's worker is read each time: a stage peer that takes
        another stage has a new one."""
        role = self.role
        self.swarm.track(lambda: {"inner_step": role.worker.inner.step_in_round,
                                  "step_seconds": role.worker.inner.step_times.median})

    def announce_joining(self, round_index: int) -> None:
        """This peer joins at ``round_index`` with the state it holds (seeded, or resumed from a checkpoint)."""
        self._announce(round_index, Phase.JOINING)

    def announce_catching_up(self, round_index: int, digests: dict[str, str]) -> None:
        """This peer heads for ``round_index`` with these state digests (slice -> digest), about to fetch them;
        stored before this returns: a round being formed waits for this peer rather than closing early, but only
        once its coordinator sees this."""
        self.swarm.announce_progress(round_index, Phase.JOINING, "", digests)
        self.swarm.flush()

    def announce_own_state(self, round_index: int, doubtful: bool) -> None:
        """This peer trains ``round_index`` from the state it holds, for the swarm's state to be compared with (a
        ``doubtful`` state has no say on it: ``swarm/consensus.py``)."""
        self._announce(round_index, Phase.TRAINING, doubtful)

    def in_for_round(self, round_index: int, doubtful: bool) -> Callable[[], None]:
        """The announcement that this peer trains ``round_index``, made when the round may be named
        (``RoundHooks.announce``; a stage makes it earlier too, to assemble its pipeline group). The state digests are
        taken now: an overlapped round in flight may land before the announcement is made."""
        worker = self.role.worker
        return partial(self.swarm.announce_progress, round_index, Phase.TRAINING, worker.params_digest,
                       dict(worker.slice_digest), doubtful)

    def announce_standby(self, round_index: int) -> None:
        """This peer sits ``round_index`` out: nobody waits for its join."""
        self._announce(round_index, Phase.STANDBY)

    def step_aside(self, round_index: int) -> None:
        """This peer sits ``round_index`` out to train a step (``budget.Sitting.STEPS``): stored before this returns,
        before the step: a coordinator that still saw it in the round would wait for it."""
        self.announce_standby(round_index)
        self.swarm.flush()

    def announce_sitting_out(self, sits_out: bool) -> None:
        """Whether this peer's step outlasts the round (``budget.sitting``): the others' budgets leave it out."""
        self.swarm.update_record(sits_out=sits_out)

    def serve(self, round_index: int) -> None:
        """Serve the state this peer holds, as the state of ``round_index``, to peers catching up."""
        self.swarm.serve_state(self.role.worker.snapshots(round_index))

    def report(self, summaries: Sequence[RoundSummary]) -> None:
        """Show the last round's results in this peer's record."""
        self.swarm.update_record(**public_fields(summaries))

    def _announce(self, round_index: int, phase: Phase, doubtful: bool = False) -> None:
        worker = self.role.worker
        self.swarm.announce_progress(round_index, phase, worker.params_digest, worker.slice_digest, doubtful)


def public_fields(summaries: Sequence[RoundSummary]) -> dict[str, object]:
    """What this node's DHT record tells others about its last round."""
    def finite(value: float | None) -> float | None:  # the record schema admits no NaN or inf
        return round(value, 4) if value is not None and math.isfinite(value) else None

    r = summaries[-1]
    traffic = r.bytes_sent + r.bytes_received
    evals = [[x.round, finite(x.eval_loss)] for x in summaries if finite(x.eval_loss) is not None][-EVAL_HISTORY:]
    return {"loss": finite(r.loss), "eval_loss": finite(r.eval_loss),
            "tokens_per_second": round(r.tokens / r.round_seconds, 1) if r.round_seconds else 0.0,
            "bytes_sent": r.bytes_sent, "bytes_received": r.bytes_received,
            "compression": round(r.dense_fp32_bytes / traffic, 1) if traffic else 0.0,
            "round_seconds": round(r.round_seconds, 2), "eval_history": evals}
