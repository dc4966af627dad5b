"""Where a node stands in its run between two rounds: what ``Node._loop`` carries from one round to the next.

The steps of a round that change it return a new one (``CatchUp``, ``Standing.after``): nothing is threaded
through tuples or changed in place.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from p2ploco.metrics import RoundSummary


@dataclass(frozen=True)
class Membership:
    """How this node came by the state it trains from."""

    joined_round: int  # the round it (re)joined at
    source: str  # init (seeded), checkpoint, or peer (fetched from the swarm)
    catchup_seconds: float = 0.0  # time spent fetching state before the next round
    catchup_bytes: int = 0  # what it fetched then: the rounds' updates, or the state (``catchup.py``)
    catchup_updates: int = 0  # rounds' updates it applied then (0: it fetched the state, or nothing)


@dataclass(frozen=True)
class Standing:
    round: int  # the round to train next
    membership: Membership
    unsettled: int | None = None  # a round that may have ended otherwise for the others
    doubtful: bool = False  # this peer did not apply a round the others may have, and has not caught up since
    waiting_for: str = ""  # what a standby stage last said it waits for (said once, not every look)
    sat_out: bool = False  # its last round was sat out (budget.py): the work it kept is to be contributed
    # the reducers that refused its contribution in its last round: it follows none of their lone states after it
    refused_by: frozenset[str] = frozenset()

    def after(self, summary: RoundSummary) -> Standing:
        """Once this round is recorded. Alone, or not applied: the others may hold another state after it (they
        committed without us, or a judge we could not reach decided otherwise)."""
        membership = replace(self.membership, catchup_seconds=0.0, catchup_bytes=0, catchup_updates=0)  # said once
        return Standing(self.round + 1, membership,
                        unsettled=self.round if summary.peers == 1 or not summary.applied else None,
                        doubtful=self.doubtful or not summary.applied, sat_out=summary.sat_out,
                        refused_by=frozenset(summary.refused_by))
