"""How long a round waits: for its members to join, and for each transfer of its all-reduce. One owner of both
rules, derived from what this peer measures; the config's ``swarm.*_timeout`` values are bounds only.

A fixed timeout is wrong somewhere: it drops a slow but honest link (a dense fp32 contribution over 20 Mbit/s takes
far longer than a compressed one over 1 Gbit/s), or lets a peer that stalls hold fast rounds for minutes; and a
value tuned for a LAN loses rounds across continents. (hivemind's users ask for deadlines from the arrival times
a peer already sees instead of its fixed ``matchmaking_time`` and ``averaging_timeout``: learning-at-home/hivemind
#676; torchft's set its quorum and process-group timeouts by hand, to thousands of seconds to be safe:
meta-pytorch/torchft#329, pytorch/torchtitan#2899.) So each wait is what this peer has seen take that long, with a
margin, within the bound:

- **A transfer** (``TransferDeadline``) is an allowance (latency, a sender's encoding, the skew between members that
  start sending) plus its payload at the slowest rate the group's members report (``swarm.bandwidth_mbit`` in their
  records). No report counts as ``swarm.min_bandwidth_mbit``, and no report counts as slower: a peer cannot make the
  others wait longer than that floor by claiming a slow link. ``swarm.max_transfer_timeout`` caps the result.
  The allowance of a reducer's wait for the contributions to its spans (``expected``) is measured: ALLOWANCE_MARGIN
  times the slowest of this peer's recent all-reduces (ARRIVALS of them), each counted by when its senders' last
  pieces arrived, the lower median over senders, within [MIN_ALLOWANCE, ``swarm.allreduce_timeout``]. A peer that
  has measured nothing yet (its first all-reduce, or a joiner) waits the bound. A member that sends late moves the
  lower median of a group of three or more only with half of its senders; alone against one sender (a group of two)
  it can raise the allowance by ALLOWANCE_MARGIN a round, to the bound at most, and only for that pair. A claimed fast
  link shortens nobody's deadline below an honest slow member's: the slowest report counts. What waits on another
  peer's decision (a sender's wait for its reducer's answer, a state transfer, headers) keeps the bound
  (``seconds``): the reducer decides when it answers, and a shorter wait there would drop honest results.
- **A formation** (``formation_wait``: how long a coordinator waits, after a round's first contribution, for the
  peers it expects) is a slack (two heartbeats, the age of the records it reads, and MIN_ALLOWANCE at least) plus
  ARRIVAL_STEPS times the slowest inner step the expected peers publish (``step_seconds``; ``budget.py`` ends every
  peer's steps within one of its steps of the others'), and never more than this peer's own last round
  (``round_seconds`` of its record) on top of the slack. A peer that states no step (a joiner: nothing measured
  yet) counts as that round. So a claimed slow step makes the others wait at most one round's work (which an honest
  peer that late would have done) and the slack; a claimed fast one shortens only the wait for its own claim, and an
  honest slow peer's own claim keeps the wait for it. A late peer that keeps being expected stretches the next
  round by what it cost this one, for the STRAGGLER_MISSES rounds the coordinator still expects it. A peer that has
  not finished a round yet (a joiner that coordinates) goes by the lower median of the rounds its peers' records
  state, which one key of three moves no more than the others; before anyone has (a run's first round), and never
  beyond it, ``swarm.matchmaking_timeout``.
- **The end of a round under way** (``round_wait``: how long a joiner or a restarted peer waits for the swarm to
  finish the round it is in before it catches up, and a peer whose round is unsettled for the others to settle it;
  a stage, for its mates to come into the group's round) is a slack plus ROUND_WAITS times the round the run's peers
  take, the lower median of the ``round_seconds`` their records state (this peer's own among them), within the
  bound ``swarm.matchmaking_timeout + 3 * swarm.allreduce_timeout`` (a formation's wait, and a transfer each way
  and a vote); the bound while no record states a round. A key that claims long rounds moves the lower median only
  with as many others.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable

ALLOWANCE_MARGIN = 4.0  # a transfer's allowance over the slowest recent all-reduce's arrivals
MIN_ALLOWANCE = 5.0  # seconds: the least a transfer's allowance is (scheduling on a busy machine, a stream's setup)
ARRIVALS = 8  # recent all-reduces whose arrivals the allowance goes by
ARRIVAL_STEPS = 2.0  # inner steps of the slowest expected peer a formation waits for after its first contribution
LOOKUP_HEARTBEATS = 2.0  # heartbeats a formation waits on top of the steps: the records it reads are that old
ROUND_WAITS = 3.0  # rounds of the run a peer waits for the round under way to end: the one it is in, and two late


class TransferDeadline:
    def __init__(self, base: float, min_mbit: float, cap: float):
        """``base``: the longest allowance a transfer has (``swarm.allreduce_timeout``); ``min_mbit``: the slowest
        link a deadline allows for (Mbit/s); ``cap``: the longest any transfer may take (seconds)."""
        self.base, self.min_mbit, self.cap = base, min_mbit, cap
        self.arrivals: deque[float] = deque(maxlen=ARRIVALS)  # recent all-reduces' arrival times (seconds)

    def seconds(self, payload_bytes: int, reported_mbit: Iterable[float] = ()) -> float:
        """The bound on a transfer of ``payload_bytes`` among peers that report these link rates (0: none)."""
        return self._with(self.base, payload_bytes, reported_mbit)

    def expected(self, payload_bytes: int, reported_mbit: Iterable[float] = ()) -> float:
        """How long a reducer waits for the contributions of ``payload_bytes``: the measured allowance (the bound
        while nothing is measured) plus the payload, as ``seconds``."""
        return self._with(self.allowance(), payload_bytes, reported_mbit)

    def arrived(self, seconds: Iterable[float]) -> None:
        """One all-reduce's arrivals at this reducer: when each sender's last piece came in, from the start."""
        seconds = list(seconds)
        if seconds:
            self.arrivals.append(statistics.median_low(seconds))

    def allowance(self) -> float:
        """The allowance of a reducer's wait, from the recent arrivals (the bound while there are none)."""
        if not self.arrivals:
            return self.base
        return min(self.base, max(MIN_ALLOWANCE, ALLOWANCE_MARGIN * max(self.arrivals)))

    def _with(self, allowance: float, payload_bytes: int, reported_mbit: Iterable[float]) -> float:
        rate = max(self.min_mbit, min((r for r in reported_mbit if r > 0), default=self.min_mbit))
        return min(self.cap, allowance + 8 * payload_bytes / (rate * 1e6))


def formation_wait(bound: float, heartbeat: float, own_round: float, steps: Iterable[float],
                   others_rounds: Iterable[float] = ()) -> float:
    """How long a formation waits after its first contribution for the peers it expects, whose records state these
    inner step times (0: none yet), by this peer's own last round (``own_round`` seconds; 0: none yet: the lower
    median of the rounds ``others_rounds`` its peers' records state, 0 for none, counts instead)."""
    if own_round <= 0:
        stated = [r for r in others_rounds if r > 0]
        if not stated:
            return bound
        own_round = statistics.median_low(stated)
    slowest = max((s if s > 0 else own_round for s in steps), default=0.0)
    slack = max(MIN_ALLOWANCE, LOOKUP_HEARTBEATS * heartbeat)
    return min(bound, slack + min(own_round, ARRIVAL_STEPS * slowest))


def round_bound(matchmaking_timeout: float, allreduce_timeout: float) -> float:
    """The longest a round under way may take to end, from the config's bounds: its formation, a transfer each way
    and the vote."""
    return matchmaking_timeout + 3 * allreduce_timeout


def round_wait(bound: float, heartbeat: float, rounds: Iterable[float]) -> float:
    """How long to wait for the round under way to end, given the round times the run's records state (0: none)."""
    stated = [r for r in rounds if r > 0]
    if not stated:
        return bound
    return min(bound, max(MIN_ALLOWANCE, LOOKUP_HEARTBEATS * heartbeat) + ROUND_WAITS * statistics.median_low(stated))
