"""Catching up: a node whose state is not the swarm's fetches the swarm's before it trains the next round.

The swarm's state of each slice is the one most peers' signed records vouch for (``consensus.ranked_states``); a
node behind it (joining, restarted, or left out of a round) gets it from the peers that hold it and hands it to its
round schedule, which decides what becomes of a round in flight (``RoundSchedule.adopt``). It gets it by the
updates of the rounds it missed where its donors keep them and they are fewer bytes than the state
(``Swarm.describe_updates``, ``swarm/updates.py``: applied, the result must hash to the vouched state), else, or
when they do not lead there, by fetching the state (``Swarm.fetch_state``: checked range by range against a
manifest).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace

from p2ploco.config import Config
from p2ploco.errors import SwarmError
from p2ploco.metrics import human_bytes
from p2ploco.peer import Swarm
from p2ploco.presence import Presence
from p2ploco.schedules import RoundSchedule
from p2ploco.standing import Membership, Standing
from p2ploco.swarm.consensus import SwarmState
from p2ploco.worker import Worker

CATCH_UP_POLL = 0.25  # seconds between looks at the records while waiting to catch up
# a peer at most this many rounds behind keeps its unapplied work (error feedback, carry) when it catches up
KEEP_LOCAL_ROUNDS = 4


class CatchUp:
    def __init__(self, config: Config, swarm: Swarm, presence: Presence, stopping: threading.Event,
                 out: Callable[[str], None]):
        self.config, self.swarm, self.presence, self.stopping, self.out = config, swarm, presence, stopping, out

    def __call__(self, schedule: RoundSchedule, standing: Standing, first: bool) -> Standing:
        """If the swarm is ahead of us, or holds another state of some slice at our round, fetch the state of
        every slice this peer holds and contribute from the next round. After an unsettled round, first let
        the others finish it and compare states at the next round (the swarm's state wins: ``swarm/consensus.py``,
        in which a ``doubtful`` state, one this peer holds for not having applied a round the others may have, has
        no say), then fetch at once. A peer that is otherwise behind (joining, restarted) first waits (bounded) for
        the others to finish the round they are in, so that it starts the next one with them rather than late.
        ``first``: this node has trained no round yet. Returns where this node stands then: the round to train, how
        it came by its state, and whether that state is still doubtful."""
        swarm, slices, round_index = self.swarm, schedule.worker.slice_digest, standing.round
        deadline = time.monotonic() + swarm.round_wait()
        if standing.unsettled is not None:
            # Our state, to compare, served as the record claims it: a replica alone in the swarm waited here ~14 s a
            # round while its record named a round it did not serve yet, and newcomers that probed it never followed it
            self.presence.serve(round_index)
            self.presence.announce_own_state(round_index, standing.doubtful)
            if not self._wait(lambda: swarm.settled(standing.unsettled), deadline):
                return standing
        # Between two rounds that went well the heartbeat's view will do (a peer behind is also told so at its next
        # join, and catches up then); a peer that starts, or after a round that went otherwise, looks afresh.
        seeds = schedule.worker.seed_digest
        targets = swarm.swarm_state(round_index, slices, seeds,
                                    fresh=standing.unsettled is not None or standing.doubtful or first,
                                    distrusted=standing.refused_by, unsettled=standing.doubtful)
        if standing.doubtful and targets and min(t.round for t in targets.values()) < round_index:
            # A doubtful state ranks below one that a peer applied: a peer still in a round this one did not apply
            # (a replica that trained on alone while its pipeline groups failed) may come out of it with a newer
            # state. Wait for it rather than clear the doubt: two failed stages once did, outvoted the replica's
            # state, and it lost two rounds.
            targets = self._look_until(lambda looked: all(t.round >= round_index for t in looked.values()),
                                       round_index, slices, seeds, deadline, standing.refused_by, unsettled=True)
            if targets is None or any(t.round < round_index for t in targets.values()):
                # Still behind at the deadline: the doubt stays (this state keeps no say) and the next look waits
                # again. Cleared here, a pipeline group that met ahead of a slow replica trained the round on slices
                # four rounds old, and the replica followed them back.
                return standing
        if not behind(targets, round_index, slices):
            return replace(standing, doubtful=False)
        if standing.unsettled is None and not standing.doubtful:  # joining or restarted: let the round under way
            # end, then start the next with all
            under_way = max(t.round for t in targets.values())
            targets = self._look_until(lambda looked: not looked or max(t.round for t in looked.values()) > under_way,
                                       round_index, slices, seeds, deadline, standing.refused_by)
            if targets is None:
                return standing
            if not behind(targets, round_index, slices):
                return replace(standing, doubtful=False)
        return self._fetch(schedule, standing, targets)

    def _look_until(self, done: Callable[[dict[str, SwarmState]], bool], round_index: int, slices: dict[str, str],
                    seeds: dict[str, str], deadline: float, distrusted: frozenset[str], unsettled: bool = False
                    ) -> dict[str, SwarmState] | None:
        """The swarm's state from fresh looks (no lone claim of a ``distrusted`` peer followed; this peer's own state
        ``unsettled`` or not), once ``done`` holds of it or ``deadline`` passed; None if this node stops meanwhile."""
        latest: list[dict[str, SwarmState]] = []  # the last look passed() took: acted on at once, rounds may be short

        def passed() -> bool:
            latest[:] = [self.swarm.swarm_state(round_index, slices, seeds, distrusted=distrusted,
                                                unsettled=unsettled)]
            return done(latest[0])

        return latest[0] if self._wait(passed, deadline) else None

    def _fetch(self, schedule: RoundSchedule, standing: Standing, targets: dict[str, SwarmState]) -> Standing:
        """Fetch the swarm's state (``targets``) of every slice this peer holds in another state, and hand it to the
        schedule; where this node stands then."""
        swarm, worker, round_index = self.swarm, schedule.worker, standing.round
        me = swarm.peer_id[-8:]
        top = max(t.round for t in targets.values())
        missing = sorted(name for name in worker.slices if name not in targets or targets[name].round != top)
        if missing:
            self.out(f"[{me}] the swarm is at round {top} but nobody serves {', '.join(missing)} of it; training on "
                     f"and trying again next round")
            return replace(standing, doubtful=True)
        # A slice whose state this peer holds already (a full replica may be behind in one slice only) is kept.
        own = {snapshot.slice: snapshot for snapshot in worker.snapshots(round_index)}
        fetch = {name: t for name, t in targets.items() if (t.round, t.state_digest) != (round_index,
                                                                                          own[name].state_digest)}
        self.presence.announce_catching_up(top, {t.slice: t.state_digest for t in targets.values()})
        started = time.perf_counter()
        try:
            # The rounds' updates where they are fewer bytes than the state (none for a dense algorithm)
            chains = {name: chain for name, t in fetch.items()
                      if (chain := swarm.describe_updates(own[name], t, worker.state_bytes(name))) is not None}
            states = {name: t for name, t in fetch.items() if name not in chains}
            self.out(f"[{me}] the swarm is at round {top} (this peer: {round_index}); fetching "
                     + "; ".join([*(f"{rounds_updates(len(chain.links))} ({human_bytes(chain.bytes)}) of {name} from "
                                    f"{len(chain.donors)} peer(s)" for name, chain in sorted(chains.items())),
                                  *([self._state_line(worker, states)] if states else [])]))
            fetched = {}
            for name, chain in sorted(chains.items()):
                if (snapshot := swarm.fetch_updates(chain)) is not None:
                    fetched[name] = snapshot
                else:
                    self.out(f"[{me}] the updates of {name} could not be fetched or did not lead to the state the "
                             f"swarm vouches for; fetching the state instead")
                    states[name] = fetch[name]
            fetched.update({name: swarm.fetch_state(t, worker.state_bytes(name)) for name, t in states.items()})
            # A step it sat rounds out for is kept however many rounds it took: it is there to be contributed.
            schedule.adopt({**own, **fetched}, keep_local=standing.sat_out or top - round_index <= KEEP_LOCAL_ROUNDS)
        except SwarmError as e:
            self.out(f"[{me}] could not catch up ({e}); training on and trying again next round")
            return replace(standing, doubtful=True)
        seconds = time.perf_counter() - started
        by_updates = {name: chains[name] for name in fetched if name not in states}
        fetched_bytes = (sum(chain.bytes for chain in by_updates.values())
                         + sum(worker.state_bytes(name) for name in states))
        self.out(f"[{me}] caught up to round {top} in {seconds:.1f} s ({human_bytes(fetched_bytes)} fetched)")
        membership = Membership(top, "peer", seconds, fetched_bytes,
                                sum(len(chain.links) for chain in by_updates.values()))
        return replace(standing, round=top, membership=membership, doubtful=False)

    def _state_line(self, worker: Worker, states: dict[str, SwarmState]) -> str:
        """What the catching-up line says of the slices whose state it fetches."""
        donors = {peer for t in states.values() for peer in t.holders} - {self.swarm.peer_id}
        size = sum(worker.state_bytes(name) for name in states)
        return f"the state ({human_bytes(size)}) of {', '.join(sorted(states))} from {len(donors)} peer(s)"

    def _wait(self, done: Callable[[], bool], deadline: float) -> bool:
        """Poll ``done`` until it holds or ``deadline`` passes; False if this node is stopping."""
        while not done() and time.monotonic() < deadline:
            if self.stopping.is_set():
                return False
            # Others publish their next round the moment they reach it: look often, a round may be short.
            time.sleep(min(self.config.swarm.heartbeat_interval, CATCH_UP_POLL, max(0.0, deadline - time.monotonic())))
        return not self.stopping.is_set()


def rounds_updates(count: int) -> str:
    """``3 rounds' updates``, ``1 round's update``."""
    return "1 round's update" if count == 1 else f"{count} rounds' updates"


def behind(targets: dict[str, SwarmState], round_index: int, slices: dict[str, str]) -> bool:
    """Whether the swarm's state (``targets``) is ahead of this peer's (``slices`` at ``round_index``), or another
    at its round."""
    return any(t.round > round_index or (t.round == round_index and t.state_digest != slices[t.slice])
               for t in targets.values())
