"""A heterogeneous swarm in one process: full replicas and pipeline groups side by side, for tests and
benchmarks. Every worker (a full replica, or one stage of a group) runs in its own thread and runs the same
round schedule a node runs (``p2ploco.schedules``), over the in-process communicator (``communicator.py``: each
slice reduced among its holders) and, within a group, the in-process stage transport (``transport.py``).

Replicas of unequal speed are simulated by count, not by time (runs repeat exactly): ``budgets[i]`` is replica
i's round budget (``budget.FixedSteps(n)``: n inner steps a round, as a replica that fits n of the fast ones' H
steps into the round's time), and its contribution is weighted by the tokens it trained, as in a swarm. A hostile
replica is an honest one whose communicator an ``adversaries`` entry wraps (``benchmarks/quality.py`` flips its
contributions).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from p2ploco.budget import RoundBudget
from p2ploco.build import build_linked_stage, build_replica
from p2ploco.collective.exchange import AllReduceResult, Communicator, Exchange
from p2ploco.collective.sliced import SlicedExchange, as_sliced
from p2ploco.config import Config
from p2ploco.data import ShardSampler
from p2ploco.data.streams import TokenStream
from p2ploco.outer.base import Synced
from p2ploco.pipeline.transport import StageTransport
from p2ploco.schedules import Landing, RoundHooks, RoundSchedule, build_schedule
from p2ploco.testing.attacks import HostileReducer
from p2ploco.testing.communicator import InProcessGroup
from p2ploco.testing.threads import run_in_threads
from p2ploco.testing.transport import InProcessPipe
from p2ploco.worker import Worker

FULL, GROUP = "full", "group"
CPU = torch.device("cpu")
AFTER_ONE_STEP = Landing(after=1, wait=True)  # an eager overlapped round's all-reduce takes one inner step


class InProcessSwarm:
    """Replicas of one run in this process: ``replicas[i]`` is [a full replica's worker] or [the S stage
    workers of a group]. Each worker runs its run's round schedule (``schedules[i]`` for ``workers[i]``); an eager
    overlapped round lands at a fixed inner step of the next round (``landing``), so that runs repeat exactly.
    ``budgets[i]``: how many inner steps replica i trains a round (None: H; every stage of a group gets the
    same); ``weighted=False`` weighs every contribution the same whatever it trained (for comparison);
    ``adversaries[i]`` wraps replica i's communicator (what it sends is then whatever the wrapper makes of it);
    ``hostile[i]`` makes full replica i's results as a reducer (``testing/attacks.py``), and ``defended`` says whether
    the swarm's answers to that are on (``InProcessGroup``)."""

    def __init__(self, config: Config, replicas: list[list[Worker]], pipes: list[InProcessPipe],
                 transports: list[StageTransport], landing: Landing,
                 budgets: Sequence[RoundBudget | None] | None = None, weighted: bool = True,
                 adversaries: Mapping[int, Callable[[Communicator], Communicator]] | None = None,
                 hostile: Mapping[int, HostileReducer] | None = None, defended: bool = True):
        self.replicas, self.pipes, self.transports = replicas, pipes, transports
        self.workers = [worker for replica in replicas for worker in replica]
        self.schedules: list[RoundSchedule] = [build_schedule(config, worker, landing) for worker in self.workers]
        self.budgets = list(budgets) if budgets is not None else [None] * len(replicas)
        if len(self.budgets) != len(replicas):
            raise ValueError(f"{len(self.budgets)} budgets for {len(replicas)} replicas")
        self.weighted = weighted
        self.adversaries = dict(adversaries or {})
        if any(len(replicas[i]) > 1 for i in hostile or {}):
            raise ValueError("a hostile reducer must be a full replica")
        # by rank: a full replica's one worker
        self.hostile = {self.workers.index(replicas[i][0]): attack for i, attack in (hostile or {}).items()}
        self.defended = defended
        self.group: InProcessGroup | None = None  # the last ``train``'s: what it did of hostile reducers
        self.all_reduce_bytes = [0] * len(replicas)  # sent + received by each replica's workers in all rounds
        self.tokens = [0] * len(replicas)  # tokens each replica trained in all rounds (a group's, once)
        self.steps = [0] * len(replicas)  # inner steps each replica trained in all rounds
        # per sender (``replica-{rank}``, rank in ``workers``): the spans, over all rounds, whose reducer clipped
        # its contribution (``outer.clip_factor`` x the median norm)
        self.clipped: Counter[str] = Counter()
        self.opposed: Counter[str] = Counter()  # likewise, the spans whose reducer left its contribution out
        self._replica_of = [i for i, replica in enumerate(replicas) for _ in replica]
        self._first = {self.workers.index(replica[0]) for replica in replicas}  # ranks that count a replica's work

    def train(self, rounds: int, after_round: Callable[[int], None] | None = None) -> None:
        """``rounds`` outer rounds of every worker; ``after_round(r)`` runs once all have finished round r.
        A worker that fails stops the others at their next wait (nothing hangs), and its error is raised."""
        group = self.group = InProcessGroup(len(self.workers), hostile=self.hostile, defended=self.defended)
        finished, checked = threading.Barrier(len(self.workers)), threading.Barrier(len(self.workers))
        lock = threading.Lock()

        def work(rank: int) -> None:
            try:
                comm: Communicator = group.communicator(rank)
                if not self.weighted:
                    comm = EqualWeights(comm)
                if self._replica_of[rank] in self.adversaries:
                    comm = self.adversaries[self._replica_of[rank]](comm)
                hooks = RoundHooks(budget=self.budgets[self._replica_of[rank]])

                def count(synced: Synced | None) -> None:
                    if synced is not None:
                        result, traffic = synced.all_reduce, synced.all_reduce.traffic
                        with lock:
                            self.all_reduce_bytes[self._replica_of[rank]] += traffic.bytes_sent + traffic.bytes_received
                            self.clipped.update(result.clipped)
                            self.opposed.update(result.opposed)

                for r in range(rounds):
                    outcome = self.schedules[rank].run(r, comm, hooks)
                    assert outcome is not None  # nothing stops a round here
                    if rank in self._first:
                        self.tokens[self._replica_of[rank]] += outcome.inner.tokens
                        self.steps[self._replica_of[rank]] += outcome.inner.steps
                    count(outcome.comm)
                    if r + 1 == rounds:  # an overlapped round still in flight lands at the end of the run
                        count(self.schedules[rank].finish_in_flight())
                    if after_round is not None:
                        if finished.wait() == 0:
                            after_round(r)
                        checked.wait()
            except BaseException:  # the other replicas' threads must not wait on this one forever
                for waiting in (group, finished, checked, *self.pipes):
                    waiting.abort()
                raise

        run_in_threads(len(self.workers), work)


class EqualWeights(Communicator):
    """``inner`` with every contribution weighing one token, whatever its replica trained: the plain mean."""

    def __init__(self, inner: Communicator):
        self.inner = inner

    def all_reduce(self, exchange: Exchange, round_index: int, name: str) -> AllReduceResult:
        # the same slices (they receive the aggregate), without the tokens
        return self.inner.all_reduce(SlicedExchange(as_sliced(exchange, name).parts), round_index, name)


def build_swarm(config: Config, kinds: Sequence[str], tokens: TokenStream | np.ndarray,
                device: torch.device = CPU, landing: Landing = AFTER_ONE_STEP,
                budgets: Sequence[RoundBudget | None] | None = None, weighted: bool = True,
                adversaries: Mapping[int, Callable[[Communicator], Communicator]] | None = None,
                hostile: Mapping[int, HostileReducer] | None = None, defended: bool = True) -> InProcessSwarm:
    """Replica i is a full replica or a pipeline group (``kinds[i]``) and draws its batches from a sampler
    seeded by ``replica-i`` (a group's first stage draws for the group). ``landing``: when an eager overlapped
    round lands (by default after the first inner step of the next round: an all-reduce that takes one).
    ``budgets``, ``weighted``, ``adversaries``, ``hostile``, ``defended``: see ``InProcessSwarm``."""
    c = config
    replicas: list[list[Worker]] = []
    pipes: list[InProcessPipe] = []
    transports: list[StageTransport] = []
    for index, kind in enumerate(kinds):
        sampler = ShardSampler(tokens, c.data.seq_len, c.inner.batch_size, c.run_id, f"replica-{index}")
        if kind == FULL:
            replicas.append([build_replica(c, device, sampler)])
        elif kind == GROUP:
            pipe = InProcessPipe(c.pipeline.stages)
            group = [pipe.transport(s) for s in range(c.pipeline.stages)]
            replicas.append([build_linked_stage(c, device, transport, sampler if transport.stage == 0 else None)
                             for transport in group])
            pipes.append(pipe)
            transports += group
        else:
            raise ValueError(f"replica kind {kind!r}: expected {FULL} or {GROUP}")
    return InProcessSwarm(c, replicas, pipes, transports, landing, budgets, weighted, adversaries, hostile, defended)
