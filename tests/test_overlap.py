"""Overlapped rounds (``outer.<algorithm>.overlap``): the all-reduce of round r runs during round r+1's inner
steps; its outer step lands one round late (naive) or rebases the local params as soon as it lands (eager). In
process, against the schedules written out by hand, bit for bit; the background thread's state as others see
it; then real nodes over hivemind."""

import re
import subprocess
import sys
import threading
import time
from functools import partial

import pytest
import torch
from helpers import CPU, TOKENS
from safetensors.torch import load_file
from test_sparseloco import reference_sparse_aggregate

from p2ploco import checkpoint
from p2ploco.build import build_replica
from p2ploco.collective.exchange import AllReduceResult, Communicator, Exchange
from p2ploco.config import load_config
from p2ploco.data import ShardSampler
from p2ploco.errors import ConfigError
from p2ploco.metrics import read_summaries, state_digest
from p2ploco.schedules import Landing, RoundHooks
from p2ploco.schedules.overlapped import OverlappedRounds
from p2ploco.swarm.state import Snapshot
from p2ploco.testing.communicator import InProcessGroup
from p2ploco.testing.swarm import FULL, build_swarm

REPLICAS, ROUNDS = 3, 4


def overlap_config(algorithm: str, *overrides: str):
    return load_config("configs/tiny.yaml", [
        "model.d_model=32", "model.n_head=2", "model.n_layer=1", "model.max_seq_len=16", "data.seq_len=16",
        "inner.steps=2", "inner.batch_size=2", "outer.clip_factor=0", "outer.drop_opposed=false",
        f"outer.algorithm={algorithm}",
        f"outer.{algorithm}.overlap=true", "outer.sparseloco.topk=8", "outer.sparseloco.chunk_size=16",
        # the schedules written out here aggregate exactly (resparsified results: tests/test_sparseloco.py)
        "outer.sparseloco.result=exact", *overrides])


def reference_overlap(config, rounds: int) -> list[list[torch.Tensor]]:
    """The overlapped schedule written out on a swarm of the same workers, driven step by step: every replica's
    inner steps (its own ``InnerTrainer``) start where its previous round left its local params; each round's
    pseudo-gradient is measured from that start; the aggregate of round r is applied to the global params at the
    end of round r+1's inner steps, and moves every replica's local params by as much. Returns the global params
    after each round (round r's own step not yet in them), and once more after the last step has landed."""
    workers = build_swarm(config, [FULL] * REPLICAS, TOKENS).workers
    glob = [p.clone() for p in workers[0].outer.params]
    starts = [[p.clone() for p in glob] for _ in workers]
    momentum = [torch.zeros_like(p) for p in glob]
    errors = [[torch.zeros_like(p) for p in glob] for _ in workers]
    pending = None
    history = []

    def outer_step(aggregate):
        """What the outer step subtracts from every tensor: SGD on the aggregate, or Nesterov momentum."""
        if config.outer.algorithm == "sparseloco":
            return [a * config.outer.sparseloco.lr for a in aggregate]
        d = config.outer.diloco
        steps = []
        for i, g in enumerate(aggregate):
            momentum[i] = momentum[i] * d.momentum + g
            steps.append((momentum[i] * d.momentum + g) * d.lr)
        return steps

    for r in range(rounds):
        trained = []
        for worker, start in zip(workers, starts):
            with torch.no_grad():
                for param, value in zip(worker.model.parameters(), start):
                    param.copy_(value)
            worker.inner.run_round(r)
            trained.append([p.detach().clone() for p in worker.model.parameters()])
        deltas = [[s - y for s, y in zip(start, local)] for start, local in zip(starts, trained)]
        if pending is not None:  # the step of round r-1 lands on the global params and on every local copy
            steps = outer_step(pending)
            glob = [p - step for p, step in zip(glob, steps)]
            trained = [[y - step for y, step in zip(local, steps)] for local in trained]
        starts = trained
        if config.outer.algorithm == "sparseloco":
            pending = reference_sparse_aggregate(deltas, errors, config.outer.sparseloco)
        else:
            pending = []
            for i in range(len(glob)):
                total = deltas[0][i]
                for replica in deltas[1:]:
                    total = total + replica[i]
                pending.append(total / len(deltas))
        history.append(glob)
    history.append([p - step for p, step in zip(glob, outer_step(pending))])
    return history


@pytest.mark.timeout(120)
@pytest.mark.parametrize("algorithm", ["diloco", "sparseloco"])
def test_the_delayed_outer_step_equals_the_schedule_written_out(algorithm):
    config = overlap_config(algorithm, f"outer.{algorithm}.overlap_update=naive")
    swarm = build_swarm(config, [FULL] * REPLICAS, TOKENS)
    seen = []
    swarm.train(ROUNDS, lambda r: seen.append([[p.clone() for p in w.outer.params] for w in swarm.workers]))
    expected = reference_overlap(config, ROUNDS)
    assert len(seen) == ROUNDS
    # after round r: the step of round r-1 has landed (the last round lands at once, at the end of the run)
    for r, (replicas, want) in enumerate(zip(seen, expected[:ROUNDS - 1] + [expected[ROUNDS]])):
        for params in replicas:  # exactly, so every replica holds the same bits
            assert all(torch.equal(got, w) for got, w in zip(params, want)), (algorithm, r)
    assert not all(torch.equal(a, b) for a, b in zip(expected[1], expected[2]))  # the steps did move the params


def outer_steps(config):
    """The outer step, written out: what it subtracts from every tensor given an aggregate (SGD, or Nesterov
    momentum with its buffers kept here)."""
    momentum = []

    def step(aggregate):
        if config.outer.algorithm == "sparseloco":
            return [a * config.outer.sparseloco.lr for a in aggregate]
        d = config.outer.diloco
        momentum[:] = momentum or [torch.zeros_like(a) for a in aggregate]
        steps = []
        for i, g in enumerate(aggregate):
            momentum[i] = momentum[i] * d.momentum + g
            steps.append((momentum[i] * d.momentum + g) * d.lr)
        return steps

    return step


def reference_aggregate(config, deltas, errors):
    """The round's aggregate of every replica's pseudo-gradient: SparseLoCo's (error feedback, Top-k, 2 bits,
    ``errors`` updated in place) or DiLoCo's dense mean."""
    if config.outer.algorithm == "sparseloco":
        return reference_sparse_aggregate(deltas, errors, config.outer.sparseloco)
    mean = []
    for i in range(len(deltas[0])):
        total = deltas[0][i]
        for replica in deltas[1:]:
            total = total + replica[i]
        mean.append(total / len(deltas))
    return mean


@torch.no_grad()
def rebase_after(landing: int, params, landed, end, steps_done: int) -> None:
    """After ``landing`` inner steps: local += the landed global params - where the previous round ended."""
    if steps_done == landing:
        for param, new, old in zip(params, landed, end):
            param.add_(new.sub(old))


def reference_eager(config, rounds: int, landing: int) -> list[list[torch.Tensor]]:
    """The eager schedule written out on a swarm of the same workers: every replica's inner steps (its own
    ``InnerTrainer``) go on from where its previous round ended; round r-1's aggregate lands on the global params
    after ``landing`` inner steps of round r, where every replica's local params are rebased onto the new global
    params (local += new - where round r-1 ended), and round r's pseudo-gradient is measured from them. Returns
    the global params after each round (round r-1 landed), and once more after the last round has landed."""
    workers = build_swarm(config, [FULL] * REPLICAS, TOKENS).workers
    step_of = outer_steps(config)
    glob = [p.clone() for p in workers[0].outer.params]
    errors = [[torch.zeros_like(p) for p in glob] for _ in workers]
    starts, ends, pending, history = [glob] * len(workers), None, None, []
    for r in range(rounds):
        landed = [p - step for p, step in zip(glob, step_of(pending))] if pending is not None else None
        trained = []
        for m, worker in enumerate(workers):
            params = list(worker.model.parameters())
            rebase = partial(rebase_after, landing, params, landed, ends[m]) if landed is not None else None
            worker.inner.run_round(r, lambda: False, rebase)
            trained.append([p.detach().clone() for p in params])
        if landed is not None:
            glob, starts = landed, [landed] * len(workers)
        pending = reference_aggregate(config, [[s - y for s, y in zip(start, local)]
                                               for start, local in zip(starts, trained)], errors)
        starts = ends = trained
        history.append(glob)
    history.append([p - step for p, step in zip(glob, step_of(pending))])
    return history


@pytest.mark.timeout(120)
@pytest.mark.parametrize("landing", [1, 2])
@pytest.mark.parametrize("algorithm", ["diloco", "sparseloco"])
def test_the_eager_step_equals_the_schedule_written_out(algorithm, landing):
    """Landing after the first of the next round's 2 inner steps, or at its end (an all-reduce as long as a
    round): the global params every replica holds after every round, exactly."""
    config = overlap_config(algorithm)
    assert config.outer.overlap == "eager"  # the default update of an overlapped round
    swarm = build_swarm(config, [FULL] * REPLICAS, TOKENS, landing=Landing(after=landing, wait=True))
    seen = []
    swarm.train(ROUNDS, lambda r: seen.append([[p.clone() for p in w.outer.params] for w in swarm.workers]))
    expected = reference_eager(config, ROUNDS, landing)
    for r, (replicas, want) in enumerate(zip(seen, expected[:ROUNDS - 1] + [expected[ROUNDS]])):
        for params in replicas:
            assert all(torch.equal(got, w) for got, w in zip(params, want)), (algorithm, landing, r)
    # a different algorithm from the naive delay's
    naive = reference_overlap(overlap_config(algorithm, f"outer.{algorithm}.overlap_update=naive"), ROUNDS)
    assert not all(torch.equal(a, b) for a, b in zip(expected[ROUNDS], naive[ROUNDS]))


def replica(config):
    return build_replica(config, CPU, ShardSampler(TOKENS, config.data.seq_len, config.inner.batch_size, "run", "r0"))


class Gated(Communicator):
    """An in-process member whose all-reduces end only once ``gate`` is open: an all-reduce as slow as we like."""

    def __init__(self, inner: Communicator, gate: threading.Event):
        self.inner, self.gate = inner, gate

    def all_reduce(self, exchange: Exchange, round_index: int, name: str) -> AllReduceResult:
        assert self.gate.wait(60)
        return self.inner.all_reduce(exchange, round_index, name)


@pytest.mark.timeout(120)
def test_a_round_in_flight_holds_up_no_inner_step_and_the_next_rounds_end_waits_for_it():
    """Eager, landing as soon as it can: while round 0's all-reduce has not ended, round 1's inner steps all
    run; only the end of round 1 (round 0 then more than one round late) waits for it."""
    config = overlap_config("sparseloco")
    worker = replica(config)
    schedule = OverlappedRounds(worker, "eager")
    gate = threading.Event()
    comm = Gated(InProcessGroup(1).communicator(0), gate)
    first = schedule.run(0, comm, RoundHooks())
    assert first is not None and first.comm is None  # nothing was in flight before round 0
    outcome = []
    worker.inner.step_in_round = 0  # round 0 left it at H: only round 1's inner steps bring it there again
    thread = threading.Thread(target=lambda: outcome.append(schedule.run(1, comm, RoundHooks())))
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while worker.inner.step_in_round < config.inner.steps and time.monotonic() < deadline:
            thread.join(0.05)
        assert worker.inner.step_in_round == config.inner.steps  # every inner step of round 1 ran
        assert thread.is_alive() and not outcome  # and the round's end waits for round 0, whose all-reduce has not
    finally:
        gate.set()
        thread.join(60)
    assert outcome[0].comm.applied
    assert schedule.finish_in_flight().applied
    schedule.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("algorithm", ["sparseloco", "diloco"])
def test_a_checkpoint_or_a_state_download_taken_while_a_step_is_in_flight_holds_a_fully_stepped_state(
        algorithm, tmp_path):
    """Round 0's step is computed on the background thread and held there before it is taken: what a joiner
    downloads and what a checkpoint saves meanwhile is the state before it, whole and as hashed; once taken,
    the state after it, whole and as hashed."""
    config = overlap_config(algorithm)
    worker = replica(config)
    schedule = OverlappedRounds(worker, "eager")
    preparing, release = threading.Event(), threading.Event()
    prepare = worker.outer.prepare

    def held(outer_sync):
        step = prepare(outer_sync)
        preparing.set()
        assert release.wait(60)
        return step

    worker.outer.prepare = held
    before = worker.published

    def served(round_index: int) -> Snapshot:
        (snapshot,) = worker.snapshots(round_index)
        blob = snapshot.blob()
        fetched = Snapshot.from_blob(round_index, snapshot.slice, blob.read(0, blob.total))
        assert state_digest(fetched.params, fetched.shared) == snapshot.state_digest == worker.params_digest
        return fetched

    try:
        schedule.run(0, InProcessGroup(1).communicator(0), RoundHooks())
        assert preparing.wait(60)
        fetched = served(1)
        assert all(torch.equal(fetched.params[n], p) for n, p in zip(worker.names, before.params))
        checkpoint.save(tmp_path, schedule.checkpoint(1), "run", "fp")
        resumed = replica(config)
        resumed.restore(checkpoint.load(tmp_path, "run", "fp"), tmp_path)
        assert resumed.params_digest == before.params_digest
    finally:
        release.set()
    assert schedule.finish_in_flight().applied
    assert worker.params_digest != before.params_digest
    fetched = served(2)
    assert all(torch.equal(fetched.params[n], p) for n, p in zip(worker.names, worker.outer.params))
    schedule.close()


@pytest.mark.timeout(120)
def test_overlap_follows_the_schedule_and_not_the_blocking_one():
    """The same run without overlap ends elsewhere: the delayed step is a different algorithm, not a no-op."""
    overlapped = build_swarm(overlap_config("sparseloco"), [FULL] * 2, TOKENS)
    blocking = build_swarm(overlap_config("sparseloco", "outer.sparseloco.overlap=false"), [FULL] * 2, TOKENS)
    for swarm in (overlapped, blocking):
        swarm.train(3)
    a, b = overlapped.workers[0].outer.params, blocking.workers[0].outer.params
    assert not all(torch.equal(x, y) for x, y in zip(a, b))


def test_overlap_is_refused_for_pipeline_stages_in_one_line():
    with pytest.raises(ConfigError, match=r"outer.sparseloco.overlap needs pipeline.stages=1"):
        load_config("configs/tiny-pipeline.yaml", ["outer.sparseloco.overlap=true"])


def final_params(checkpoint_dir) -> dict[str, torch.Tensor]:
    (path,) = checkpoint_dir.glob("state-*.safetensors")
    return {k: v for k, v in load_file(path).items() if k.startswith("param/")}


@pytest.mark.timeout(300)
def test_three_real_nodes_overlap_rounds_with_identical_params(tmp_path):
    """Real node processes on loopback: every round's all-reduce lands one round late with all three peers, the
    params are identical after every round, and the last round lands on exit (so the checkpoints agree)."""
    result = subprocess.run([sys.executable, "-m", "p2ploco.cli", "demo", "--replicas", "3", "--rounds", "4",
                             "--workdir", str(tmp_path), "--set", "outer.sparseloco.overlap=true"],
                            capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "identical global parameters on all 3 nodes after every round: yes" in result.stdout
    runs = [read_summaries(tmp_path / f"node{i}" / "metrics.jsonl") for i in range(3)]
    for records in runs:
        assert [r["round"] for r in records] == [0, 1, 2, 3]
        assert records[0]["bytes_sent"] == 0  # nothing has landed at the end of the first round
        assert all(r["peers"] == 3 and r["applied"] and r["bytes_sent"] > 0 for r in records[1:])
        assert records[-1]["eval_loss"] < records[0]["eval_loss"]
    for round_index in range(4):
        assert len({records[round_index]["params_digest"] for records in runs}) == 1
    assert len({records[1]["params_digest"], records[2]["params_digest"], records[3]["params_digest"]}) == 3
    for i in range(3):
        log = (tmp_path / f"node{i}.log").read_text()
        assert re.search(r"outer step landed on exit \(applied, 3 peer\(s\)\)", log), log[-2000:]
    checkpoints = [final_params(tmp_path / f"node{i}" / "checkpoint") for i in range(3)]
    for other in checkpoints[1:]:
        assert all(torch.equal(other[k], checkpoints[0][k]) for k in checkpoints[0])


def test_an_eval_after_a_blocking_round_scores_the_published_params_and_leaves_the_local_ones_as_they_were():
    """After a blocking round the model holds the published params (evaluated as they are, no copy); after inner
    steps it holds its own, which the eval lends to the published ones and puts back, bit for bit."""
    config = load_config(None, ["inner.steps=2", "training.eval_every=1"])
    worker = build_replica(config, CPU, ShardSampler(TOKENS, config.data.seq_len, config.inner.batch_size, "r", "p"))
    held_out = [ShardSampler(TOKENS, config.data.seq_len, 4, "r", "eval").batch(0)]
    published = worker.evaluate(held_out)
    worker.inner.run_round(0)
    trained = [p.detach().clone() for p in worker.local_params()]
    assert not all(torch.equal(t, p) for t, p in zip(trained, worker.published.params))
    assert worker.evaluate(held_out) == published
    assert all(torch.equal(t, p) for t, p in zip(trained, worker.local_params()))
