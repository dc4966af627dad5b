"""Pipelines in process: the stage schedule, the subspace codec, and heterogeneous SparseLoCo."""

import numpy as np
import pytest
import torch
from helpers import CPU, TOKENS, sampler, small_config

from p2ploco.budget import FixedSteps
from p2ploco.build import build_linked_stage, build_replica
from p2ploco.config import Config, load_config
from p2ploco.errors import PipelineError
from p2ploco.pipeline.schedule import one_forward_one_backward
from p2ploco.pipeline.subspace import Subspace, constrained_dims
from p2ploco.schedules.blocking import BlockingRounds
from p2ploco.testing.communicator import InProcessGroup
from p2ploco.testing.swarm import build_swarm
from p2ploco.testing.threads import run_in_threads
from p2ploco.testing.transport import InProcessPipe
from p2ploco.worker import Worker


def one_step_unsplit_and_split(config: Config) -> tuple[Worker, list[Worker], float, list[float], list]:
    """The same inner step by the whole model and by an S-stage group (same batches, same init); the group's
    stage transports last."""
    whole = build_replica(config, CPU, sampler(config))
    pipe = InProcessPipe(config.pipeline.stages, timeout=60)
    transports = [pipe.transport(s) for s in range(config.pipeline.stages)]
    stages = [build_linked_stage(config, CPU, transport, sampler(config) if transport.stage == 0 else None)
              for transport in transports]
    for stage in stages:  # a stage holds exactly the (projected) weights of its slice of the whole model
        mine = dict(zip(stage.names, stage.model.parameters()))
        for name, p in zip(whole.names, whole.model.parameters()):
            if name in mine:
                assert torch.equal(mine[name], p), name
    losses = [0.0] * len(stages)

    def step(s: int) -> None:
        losses[s] = stages[s].inner.step(7)

    run_in_threads(len(stages), step)
    return whole, stages, whole.inner.step(7), losses, transports


def grad_norm(workers: list[Worker]) -> float:
    return sum(float(p.grad.pow(2).sum()) for w in workers for p in w.model.parameters()) ** 0.5


def assert_same_step(whole: Worker, stages: list[Worker], whole_loss: float, stage_losses: list[float]) -> None:
    """The same loss on every stage, and the same gradients as AdamW saw them: accumulated over the
    micro-batches, projected where constrained, clipped by one global norm over all stages."""
    assert all(loss == pytest.approx(whole_loss, rel=1e-5) for loss in stage_losses)  # every stage learns the loss
    reference = {name: p for name, p in zip(whole.names, whole.model.parameters())}
    for stage in stages:
        for name, p in zip(stage.names, stage.model.parameters()):
            torch.testing.assert_close(p.grad, reference[name].grad, rtol=1e-4, atol=1e-7, msg=name)
    # the clip was active (grad_clip 0.05) and the stages clipped by the norm over all of them, not their own
    assert grad_norm([whole]) == pytest.approx(0.05, rel=1e-4)
    assert grad_norm(stages) == pytest.approx(0.05, rel=1e-4)


def test_one_forward_one_backward_bounds_the_micro_batches_in_flight():
    for stages, micro in [(2, 4), (3, 2), (4, 7), (1, 3)]:
        for s in range(stages):
            order = one_forward_one_backward(s, stages, micro)
            assert sorted(order) == sorted([("F", m) for m in range(micro)] + [("B", m) for m in range(micro)])
            assert all(order.index(("F", m)) < order.index(("B", m)) for m in range(micro))
            in_flight = np.cumsum([1 if op == "F" else -1 for op, _ in order])
            assert in_flight.max() == min(stages - s, micro)  # GPipe would hold all `micro`
    assert one_forward_one_backward(0, 2, 3) == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("B", 2)]


@pytest.mark.parametrize("stages", [2, 4])
def test_an_uncompressed_pipeline_equals_the_unsplit_model(stages):
    config = small_config(f"pipeline.stages={stages}", "pipeline.compression=none")
    whole, group, whole_loss, losses, _ = one_step_unsplit_and_split(config)
    assert whole.constraint is None and group[0].model.token_table is None
    assert_same_step(whole, group, whole_loss, losses)


@pytest.mark.parametrize("stages", [2, 3])
def test_the_compressed_pipeline_is_exact_against_the_unsplit_constrained_model(stages):
    # uniform: the whole model is constrained too, so both compute the same function
    config = small_config(f"pipeline.stages={stages}", "pipeline.compression=uniform", "pipeline.rank=8")
    whole, group, whole_loss, losses, transports = one_step_unsplit_and_split(config)
    assert whole.constraint is not None
    # per micro-batch: the window's ids (2 x 17, uint16) and k = 8 float32 values per token (2 x 16 tokens)
    assert transports[0].bytes_sent == 3 * (2 * 17 * 2 + 2 * 16 * 8 * 4)
    assert_same_step(whole, group, whole_loss, losses)
    # after the step the constrained weights are back in span(U)
    for worker in (whole, *group):
        assert worker.constraint.max_relative_residual(list(worker.model.parameters())) < 1e-6


def test_the_codec_is_exact_only_inside_the_subspace():
    config = small_config()
    subspace = Subspace.derive(config.model, 8, seed=0)
    ids = torch.randint(0, 257, (2, 16))
    inside = subspace.table[ids] + torch.randn(2, 16, 8) @ subspace.basis.T
    torch.testing.assert_close(subspace.decode(subspace.encode(inside, ids), ids), inside, rtol=0, atol=1e-6)
    outside = inside + torch.randn(2, 16, 64)
    assert (subspace.decode(subspace.encode(outside, ids), ids) - outside).abs().max() > 0.1
    # and every peer derives the same U and F from the seed
    again = Subspace.derive(config.model, 8, seed=0)
    assert torch.equal(again.basis, subspace.basis) and torch.equal(again.table, subspace.table)
    assert not torch.equal(Subspace.derive(config.model, 8, seed=1).basis, subspace.basis)


def test_constrained_tensors_are_the_residual_writers_before_the_last_boundary():
    config = small_config("pipeline.stages=2")  # 4 layers: the last boundary is before layer 2
    assert constrained_dims(config.model, 2) == {"embed.weight": 1, "blocks.0.attn.out.weight": 0,
                                                  "blocks.0.mlp.down.weight": 0, "blocks.1.attn.out.weight": 0,
                                                  "blocks.1.mlp.down.weight": 0}


def test_one_full_replica_and_one_compressed_group_hold_bit_identical_slices_after_every_round():
    config = load_config("configs/tiny-pipeline.yaml", ["inner.steps=2", "model.max_seq_len=32", "data.seq_len=32"])
    swarm = build_swarm(config, ["full", "group"], TOKENS)
    (full,), group = swarm.replicas
    initial = [p.clone() for p in full.outer.params]
    holders_checked = []

    def check(round_index: int) -> None:
        reference = dict(zip(full.names, full.outer.params))
        for stage in group:
            for name, p in zip(stage.names, stage.outer.params):
                assert torch.equal(p, reference[name]), (round_index, name)
            # re-projected on taking the new global params; the full replica stays unconstrained
            assert stage.constraint.max_relative_residual(list(stage.model.parameters())) < 1e-6
        holders_checked.append(round_index)

    swarm.train(3, check)
    assert holders_checked == [0, 1, 2]
    assert all(not torch.equal(a, b) for a, b in zip(initial, full.outer.params))
    subspace = group[0].constraint.subspace  # selective: the full replica's weights are left far from span(U)
    assert subspace.relative_residual(full.model.embed.weight, 1) > 0.5
    assert subspace.relative_residual(full.model.blocks["0"].mlp.down.weight, 0) > 0.5


def test_a_constrained_worker_that_did_not_train_sends_no_update():
    # The initial global weights are not in span(U); the stage trains their projection. Its pseudo-gradient is
    # measured from that projection, so without training it is zero: the projection itself is not an update.
    config = small_config("outer.algorithm=diloco")
    stage = build_linked_stage(config, CPU, InProcessPipe(2).transport(0), sampler(config))
    before = [p.clone() for p in stage.outer.params]
    assert stage.constraint.subspace.relative_residual(before[stage.names.index("embed.weight")], 1) > 0.5
    assert BlockingRounds(stage).average(0, InProcessGroup(1).communicator(0)).applied
    assert all(torch.equal(a, b) for a, b in zip(before, stage.outer.params))


def test_a_stage_that_hears_nothing_fails_the_step_in_bounded_time():
    config = small_config()
    pipe = InProcessPipe(2, timeout=0.5)
    last = build_linked_stage(config, CPU, pipe.transport(1), None)
    with pytest.raises(PipelineError, match="no activations for step 0 micro-batch 0 within"):
        last.inner.step(0)


@pytest.mark.timeout(120)
def test_a_groups_stages_stop_at_the_step_its_slowest_stages_budget_allows():
    """Each stage asks its own budget whether another step fits; the group sums the answers with the step's loss,
    so both stages stop after the fewest steps any of them allows, with the same tokens (the group's weight)."""
    config = small_config("inner.steps=4")
    pipe = InProcessPipe(2, timeout=60)
    stages = [build_linked_stage(config, CPU, pipe.transport(s), sampler(config) if s == 0 else None)
              for s in range(2)]
    budgets = [FixedSteps(4), FixedSteps(2)]  # the last stage is the slower one here: 2 steps of H = 4 fit
    stats = [None, None]

    def train(s: int) -> None:
        stats[s] = stages[s].inner.run_round(0, budget=budgets[s])

    run_in_threads(2, train)
    assert [s.steps for s in stats] == [2, 2]  # without the vote, stage 0 waited for a third step's gradients
    assert stats[0].tokens == stats[1].tokens == 2 * stages[0].inner.gradients.tokens_per_step
