"""Catching up: a node whose state is not the swarm's fetches the swarm's before it trains the next round.

The swarm's state of each slice is the one most peers' signed records vouch for (``consensus.ranked_states``); a
node behind it (joining, restarted, or left out of a round) fetches it from the peers that hold it
(``Swarm.fetch_state``: checked range by range against a manifest) and hands it to its round schedule, which
decides what becomes of a round in flight (``RoundSchedule.adopt``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from p2ploco.config import Config
from p2ploco.errors import SwarmError
from p2ploco.schedules import RoundSchedule
from p2ploco.swarm.consensus import SwarmState
from p2ploco.swarm.records import PeerState
from p2ploco.swarm.runtime import Swarm

CATCH_UP_POLL = 0.25  # seconds between looks at the records while waiting to catch up
# a peer at most this many rounds behind keeps its unapplied work (error feedback, carry) when it catches up
KEEP_LOCAL_ROUNDS = 4


@dataclass
class Membership:
    """How this node came by the state it trains from."""

    joined_round: int  # the round it (re)joined at
    source: str  # init (seeded), checkpoint, or peer (fetched from the swarm)
    catchup_seconds: float = 0.0  # time spent fetching state before the next round


class CatchUp:
    def __init__(self, config: Config, swarm: Swarm, stopping: threading.Event, out: Callable[[str], None]):
        self.config, self.swarm, self.stopping, self.out = config, swarm, stopping, out

    def __call__(self, schedule: RoundSchedule, round_index: int, membership: Membership, unsettled: int | None,
                 doubtful: bool, first: bool) -> tuple[int, Membership, bool]:
        """If the swarm is ahead of us, or holds another state of some slice at our round, fetch the state of
        every slice this peer holds and contribute from the next round. After an unsettled round, first let
        the others finish it and compare states at the next round (the swarm's state wins: ``swarm/consensus.py``,
        in which a ``doubtful`` state, one this peer holds for not having applied a round the others may have, has
        no say), then fetch at once. A peer that is otherwise behind (joining, restarted) first waits (bounded) for
        the others to finish the round they are in, so that it starts the next one with them rather than late.
        ``first``: this node has trained no round yet. Returns the round to train, how this peer came by its
        state, and whether that state is still doubtful."""
        swarm, worker = self.swarm, schedule.worker

        def behind(targets: dict[str, SwarmState]) -> bool:
            return any(t.round > round_index or (t.round == round_index
                                                 and t.state_sha256 != worker.slice_sha256[t.slice])
                       for t in targets.values())

        latest: list[dict[str, SwarmState]] = []  # the last look passed() took: acted on at once, rounds may be short

        def passed(round_in_progress: int) -> bool:
            latest[:] = [swarm.swarm_state(round_index, worker.slice_sha256)]
            return not latest[0] or max(t.round for t in latest[0].values()) > round_in_progress

        s = self.config.swarm
        deadline = time.monotonic() + s.matchmaking_timeout + 3 * s.allreduce_timeout
        if unsettled is not None:
            # our state, to compare
            swarm.announce_progress(round_index, PeerState.TRAINING, worker.params_sha256, worker.slice_sha256,
                                    doubtful)
            if not self._wait(lambda: swarm.settled(unsettled), deadline):
                return round_index, membership, doubtful
        # Between two rounds that went well the heartbeat's view will do (a peer behind is also told so at its next
        # join, and catches up then); a peer that starts, or after a round that went otherwise, looks afresh.
        targets = swarm.swarm_state(round_index, worker.slice_sha256, fresh=unsettled is not None or doubtful or first)
        if not behind(targets):
            return round_index, membership, False
        if unsettled is None and not doubtful:  # joining or restarted: let the round under way end, then start the
            # next with all
            if not self._wait(lambda: passed(max(t.round for t in targets.values())), deadline):
                return round_index, membership, doubtful
            targets = latest[0]
            if not behind(targets):
                return round_index, membership, False
        me = swarm.peer_id[-8:]
        top = max(t.round for t in targets.values())
        missing = sorted(name for name in worker.slices if name not in targets or targets[name].round != top)
        if missing:
            self.out(f"[{me}] the swarm is at round {top} but nobody serves {', '.join(missing)} of it; training on "
                     f"and trying again next round")
            return round_index, membership, True
        # A slice whose state this peer holds already (a full replica may be behind in one slice only) is kept.
        own = {snapshot.slice: snapshot for snapshot in worker.snapshots(round_index)}
        fetch = {name: t for name, t in targets.items() if (t.round, t.state_sha256) != (round_index,
                                                                                          own[name].state_sha256)}
        donors = {peer for t in fetch.values() for peer in t.holders} - {swarm.peer_id}
        self.out(f"[{me}] the swarm is at round {top} (this peer: {round_index}); fetching the state of "
                 f"{', '.join(sorted(fetch))} from {len(donors)} peer(s)")
        # Announce where we are headed, stored before the fetch (records are otherwise stored in the background):
        # a round being formed waits for us rather than closing early, but only once its coordinator sees this.
        swarm.announce_progress(top, PeerState.JOINING, "", {t.slice: t.state_sha256 for t in targets.values()})
        swarm.flush()
        started = time.perf_counter()
        try:
            fetched = {name: swarm.fetch_state(t, worker.state_bytes(name)) for name, t in fetch.items()}
            schedule.adopt({**own, **fetched}, keep_local=top - round_index <= KEEP_LOCAL_ROUNDS)
        except SwarmError as e:
            self.out(f"[{me}] could not catch up ({e}); training on and trying again next round")
            return round_index, membership, True
        seconds = time.perf_counter() - started
        self.out(f"[{me}] caught up to round {top} in {seconds:.1f} s")
        return top, Membership(top, "peer", seconds), False

    def _wait(self, done: Callable[[], bool], deadline: float) -> bool:
        """Poll ``done`` until it holds or ``deadline`` passes; False if this node is stopping."""
        while not done() and time.monotonic() < deadline:
            if self.stopping.is_set():
                return False
            # Others publish their next round the moment they reach it: look often, a round may be short.
            time.sleep(min(self.config.swarm.heartbeat_interval, CATCH_UP_POLL, max(0.0, deadline - time.monotonic())))
        return not self.stopping.is_set()
