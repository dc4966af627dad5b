"""Peers of unequal speed: the round's time budget, tokens-weighted aggregates, and work that a missed round keeps."""

import pytest
import torch
from helpers import CPU, sampler, small_config

from p2ploco import checkpoint, faults
from p2ploco.budget import FixedSteps, StepTimes, WallClockBudget
from p2ploco.build import build_replica
from p2ploco.collective.dense import DenseMean
from p2ploco.collective.exchange import AllReduceResult, Communicator, Exchange
from p2ploco.collective.robust import mean_factors
from p2ploco.collective.sliced import SlicedExchange, reduce_alone
from p2ploco.config import DiLoCoConfig
from p2ploco.metrics import RoundSummary
from p2ploco.outer.diloco import DiLoCo
from p2ploco.progress import progress_line
from p2ploco.schedules import RoundHooks
from p2ploco.schedules.blocking import BlockingRounds
from p2ploco.testing.communicator import InProcessGroup
from p2ploco.testing.threads import run_in_threads


def all_reduce(values: list[torch.Tensor], tokens: list[int]) -> torch.Tensor:
    """The aggregate three replicas holding ``values`` (trained on ``tokens``) all end with (checked equal)."""
    exchanges = [SlicedExchange({"params": DenseMean([v])}, tokens=t) for v, t in zip(values, tokens)]
    group = InProcessGroup(len(values))
    run_in_threads(len(values), lambda rank: group.communicator(rank).all_reduce(exchanges[rank], 0, "params"))
    means = [e.parts["params"].mean()[0] for e in exchanges]
    assert all(torch.equal(m, means[0]) for m in means)
    return means[0]


def test_contributions_weigh_the_tokens_they_were_trained_on():
    generator = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(1000, generator=generator) for _ in range(3))
    weighted = all_reduce([a, b, c], [3000, 1000, 1000])
    # Written out: each contribution times n * w_i / sum(w) in float32, summed in group order, divided by n.
    f32 = torch.float32
    reference = (a * torch.tensor(1.8, dtype=f32) + b * torch.tensor(0.6, dtype=f32)
                 + c * torch.tensor(0.6, dtype=f32)) / 3
    assert torch.equal(weighted, reference)
    assert torch.allclose(weighted, (3 * a + b + c) / 5, atol=1e-6)
    # Equal weights are the plain mean, to the bit (every earlier reference test holds).
    assert torch.equal(all_reduce([a, b, c], [2048] * 3), all_reduce([a, b, c], [1, 1, 1]))
    assert not torch.equal(weighted, all_reduce([a, b, c], [1, 1, 1]))


def test_weights_are_the_tokens_share_and_a_claim_weighs_at_most_a_full_round():
    assert mean_factors([1.0, 1.0, 1.0], [1000, 1000, 4000], 0.0)[0] == [0.5, 0.5, 2.0]
    assert mean_factors([1.0, 1.0], [5, 5], 2.0)[0] == [1.0, 1.0] and mean_factors([], [], 2.0) == ([], [])
    # A peer that owes a missed round's tokens claims them with the next contribution, up to a round's worth.
    outer = DiLoCo([torch.zeros(3)], DiLoCoConfig(), max_tokens=4000)
    outer.unapplied_tokens = 10**12
    assert outer.tokens_behind(1000) == 4000


class NotApplied(Communicator):
    """The round runs, then its vote fails: nothing is applied."""

    def all_reduce(self, exchange: Exchange, round_index: int, name: str) -> AllReduceResult:
        reduce_alone(exchange)
        return AllReduceResult(["me"], committed=False)


def test_diloco_carries_a_missed_rounds_pseudo_gradient_and_tokens_into_the_next():
    generator = torch.Generator().manual_seed(1)
    start = [torch.randn(4, 8, generator=generator), torch.randn(8, generator=generator)]
    config = DiLoCoConfig(lr=0.5, momentum=0.9)
    outer, reference = DiLoCo(start, config), DiLoCo(start, config)
    missed = [p - 0.01 * torch.randn(p.shape, generator=generator) for p in start]
    trained = [p - 0.01 * torch.randn(p.shape, generator=generator) for p in start]
    assert not outer.sync(missed, NotApplied(), 0, tokens=1024).applied
    assert all(torch.equal(p, q) for p, q in zip(outer.params, start)) and outer.unapplied_tokens == 1024
    synced = outer.sync(trained, InProcessGroup(1).communicator(0), 1, tokens=3072)
    assert synced.applied and synced.all_reduce.tokens == 1024 + 3072
    assert outer.unapplied_tokens == 0 and outer.carry is None
    # The reference takes one round whose local params moved by both pseudo-gradients at once.
    both = [t - (p - m) for t, p, m in zip(trained, start, missed)]
    reference.sync(both, InProcessGroup(1).communicator(0), 1)
    assert all(torch.equal(p, q) for p, q in zip(outer.params, reference.params))


def times(*seconds: float) -> StepTimes:
    steps = StepTimes()
    for s in seconds:
        steps.add(s)
    return steps


def test_the_budget_fits_a_slow_peers_steps_into_the_fast_peers_round():
    fast, slow = times(0.1, 0.1, 0.11), times(0.3, 0.31, 0.3)
    swarm = [0.1, 0.3, 0.12]
    assert WallClockBudget(10, fast, lambda: swarm).seconds() is None  # among the fastest: H steps
    budget = WallClockBudget(10, slow, lambda: swarm)
    assert budget.seconds() == 10 * 0.11  # H times the median step of the fast ones (0.1, 0.11, 0.12)
    steps_in = [h for h in range(10) if budget.allows(h, h * 0.3)]
    assert steps_in == [0, 1, 2]  # a fourth step would end at 1.2 s, past 1.1 s: the fast peers would wait for it
    assert budget.planned_steps() == 3
    configured = WallClockBudget(10, slow, lambda: swarm, round_seconds=1.1)  # half a step past a set budget runs
    assert [h for h in range(10) if configured.allows(h, h * 0.3)] == [0, 1, 2, 3]
    assert WallClockBudget(10, slow, lambda: swarm, round_seconds=0.6).seconds() == 0.6
    assert WallClockBudget(10, times(), lambda: swarm).seconds() is None  # no step of its own yet: H
    assert not WallClockBudget(3, fast, lambda: swarm).allows(3, 0.0)  # never more than H
    assert [FixedSteps(2).allows(h, 0.0) for h in range(3)] == [True, True, False]


def test_a_members_absurdly_fast_claim_is_not_believed_and_any_claim_moves_the_budget_at_most_to_its_bound():
    group = [0.1, 0.11]  # the others of a group with this peer: steps of 0.1-0.12 s, timing noise
    own = times(0.12)
    assert WallClockBudget(10, own, lambda: group).seconds() is None  # within 2x of the fastest: H steps
    # 1e-300 s used to cut the round to 10 * 0.12 / 16 s, one step; a claim more than 4x faster than the group's
    # lower median (0.1 s, among this peer's 0.12 and the others' with the claim) is left out, as if its peer were
    # absent.
    for absurd in (1e-300, 1e-9, 0.024):
        assert WallClockBudget(10, own, lambda absurd=absurd: [*group, absurd]).seconds() is None
    # A claim at the edge is believed: a slower peer gets H times the median of the fast cohort (the claim and the
    # steps up to twice it), never below H * 0.025 s, a quarter of H steps of the group's lower-median peer.
    assert WallClockBudget(10, own, lambda: [*group, 0.025]).seconds() == pytest.approx(10 * 0.025)
    assert WallClockBudget(10, own, lambda: [*group, 0.05]).seconds() == pytest.approx(10 * (0.05 + 0.1) / 2)
    assert WallClockBudget(10, own, lambda: [*group, 0.06]).seconds() is None  # 0.12 is within 2x of it
    # A fast minority of one in three (the group 1x, 3x, 10x, at H = 4) is believed by the others, within the bound:
    # the 3x peer fits its steps into the fast one's round, the 10x one sits rounds out once it has measured 3 steps.
    assert WallClockBudget(4, times(0.3), lambda: [0.1, 1.0]).seconds() == pytest.approx(4 * 0.1)
    assert not WallClockBudget(4, times(1.0, 1.0), lambda: [0.1, 0.3]).outlasted()
    assert WallClockBudget(4, times(1.0, 1.0, 1.0), lambda: [0.1, 0.3]).outlasted()
    # On a busy machine the same group measured 0.07, 0.3 and 1.0 s (the 3x peer over 4x the fast one): the 10x peer,
    # judging the others' round without its own step, sits out; its record then says so, and the 3x peer, whose
    # budget leaves a sitting-out peer's step out (Swarm.step_seconds), fits its steps into the fast one's round.
    assert WallClockBudget(4, times(1.0, 1.0, 1.0), lambda: [0.07, 0.3]).outlasted()
    assert WallClockBudget(4, times(1.0, 1.0, 1.0), lambda: [0.07, 0.3]).seconds() == pytest.approx(4 * 0.3)
    assert WallClockBudget(4, times(0.3), lambda: [0.07]).seconds() == pytest.approx(4 * 0.07)
    # A peer 20x slower than the others believes none of their steps for its budget (MAX_SPEED_SPREAD: it would train
    # H steps), but judges its step against their round, and sits out.
    assert WallClockBudget(5, times(1.2, 1.2, 1.2), lambda: [0.06, 0.06]).seconds() is None
    assert WallClockBudget(5, times(1.2, 1.2, 1.2), lambda: [0.06, 0.06]).outlasted()
    # Claims move the lower median only as half the group or more: two of six can not, the other of two can,
    # and then the budget is at least H steps of this peer's own over MAX_SPEED_SPREAD (1e-9: 16x is believed).
    assert WallClockBudget(10, own, lambda: [*group, 0.1, 1e-9, 1e-9]).seconds() is None
    assert WallClockBudget(10, own, lambda: [0.02]).seconds() == 10 * 0.02
    assert WallClockBudget(10, own, lambda: [0.0075]).seconds() == 10 * 0.0075
    assert WallClockBudget(10, own, lambda: [1e-9]).seconds() is None


@pytest.mark.parametrize("algorithm", ["diloco", "loco", "sparseloco"])
def test_a_missed_rounds_carry_and_owed_tokens_survive_a_restart(tmp_path, algorithm):
    """A round is trained and not applied; the node checkpoints and restarts: the restored worker owes the same
    tokens and carries the same pseudo-gradient (DiLoCo, LoCo; SparseLoCo keeps it in error feedback) as the one
    that wrote the checkpoint, so its next contribution weighs and holds what it would have without the restart."""
    config = small_config(f"outer.algorithm={algorithm}", "pipeline.stages=1", "outer.loco.group_size=32",
                          "inner.steps=2")
    worker = build_replica(config, CPU, sampler(config))
    outcome = BlockingRounds(worker).run(0, NotApplied(), RoundHooks())
    assert not outcome.comm.applied
    carry, owed = worker.outer.carry, worker.outer.unapplied_tokens
    assert owed == 2 * config.inner.batch_size * config.inner.grad_accum * config.data.seq_len
    assert (carry is None) == (algorithm == "sparseloco")
    checkpoint.save(tmp_path, worker.checkpoint(1), "run", "fp")
    resumed = build_replica(config, CPU, sampler(config))
    resumed.restore(checkpoint.load(tmp_path, "run", "fp"), tmp_path)
    restored_carry, restored_owed = resumed.outer.carry, resumed.outer.unapplied_tokens
    assert restored_owed == owed
    assert (restored_carry is None) == (carry is None)
    assert all(torch.equal(a, b) for a, b in zip(restored_carry or (), carry or (), strict=True))
    assert all(torch.equal(v, worker.outer.local_state()[k]) for k, v in resumed.outer.local_state().items())


def test_a_peer_held_before_its_steps_publishes_its_real_pace(monkeypatch):
    """A peer slowed outside its compute (here held 0.5 s before each step, as by a data loader that waits or a
    device another job holds; a step of this model computes in tens of ms) publishes step times that hold the
    wait, so the round's budget sees it as slow."""
    config = small_config("pipeline.stages=1", "inner.steps=2", "model.n_layer=1", "inner.grad_accum=1")
    worker = build_replica(config, CPU, sampler(config))
    monkeypatch.setattr(faults, "ACTIVE", faults.parse("inner.step=stall:0.5"))
    stats = worker.inner.run_round(0)
    assert stats.steps == 2 and stats.seconds >= 1.0
    own = worker.inner.step_times
    assert own.median >= 0.5
    fast_peers = [0.1, 0.1]  # two peers that do train steps of 0.1 s
    assert WallClockBudget(2, own, lambda: fast_peers).seconds() == pytest.approx(2 * 0.1)


def test_a_peer_whose_pace_changes_leaves_the_fast_cohort_within_a_few_steps():
    own = times(*[0.1] * 8)
    swarm = [0.1, 0.1]
    assert WallClockBudget(10, own, lambda: swarm).seconds() is None  # among the fastest: H steps
    for _ in range(5):  # now 3x slower (another job took its device): the median of its last 8 steps moves
        own.add(0.3)
    assert WallClockBudget(10, own, lambda: swarm).seconds() == pytest.approx(10 * 0.1)


def test_a_round_that_trained_no_step_prints_no_loss_and_says_whose_work_it_contributed():
    """After a round it sat out, a slow peer contributes the step it kept, with no step of its own: its round line
    used to read ``loss nan``. It reads ``loss -`` and says what the round did; a round that trained prints its
    loss."""
    kept = RoundSummary(round=7, peers=3, loss=float("nan"), eval_loss=None, params_digest="ab" * 32,
                       round_seconds=1.0, inner_steps=0, tokens=0, contributed_tokens=1024)
    line = progress_line("x" * 46, kept)
    assert "nan" not in line and "| loss - |" in line
    assert "no step of its own: it contributed the work it kept from the round it sat out" in line
    idle = RoundSummary(round=8, peers=1, loss=float("nan"), eval_loss=None, params_digest="ab" * 32,
                       round_seconds=1.0, inner_steps=0, sat_out=True, applied=False)
    assert "nan" not in progress_line("x" * 46, idle) and "sat out idle" in progress_line("x" * 46, idle)
    trained = RoundSummary(round=9, peers=3, loss=2.5, eval_loss=None, params_digest="ab" * 32, round_seconds=1.0,
                          inner_steps=4, tokens=4096, contributed_tokens=4096)
    assert "| loss 2.500 |" in progress_line("x" * 46, trained) and "no step" not in progress_line("x" * 46, trained)
