"""Overlapped rounds (``outer.<algorithm>.overlap``): the all-reduce of round r runs during round r+1's inner
steps and its outer step lands one round late. In process, against the schedule written out by hand, bit for
bit; then real nodes over hivemind."""

import re
import subprocess
import sys

import pytest
import torch
from helpers import TOKENS
from safetensors.torch import load_file
from test_sparseloco import reference_sparse_aggregate

from p2ploco.config import ConfigError, load_config
from p2ploco.metrics import read_records
from p2ploco.pipeline.inprocess import FULL, build_swarm

REPLICAS, ROUNDS = 3, 4


def overlap_config(algorithm: str, *overrides: str):
    return load_config("configs/tiny.yaml", [
        "model.d_model=32", "model.n_head=2", "model.n_layer=1", "model.max_seq_len=16", "data.seq_len=16",
        "inner.steps=2", "inner.batch_size=2", "outer.clip_factor=0", f"outer.algorithm={algorithm}",
        f"outer.{algorithm}.overlap=true", "outer.sparseloco.topk=8", "outer.sparseloco.chunk_size=16", *overrides])


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
    config = overlap_config(algorithm)
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
    runs = [read_records(tmp_path / f"node{i}" / "metrics.jsonl") for i in range(3)]
    for records in runs:
        assert [r["round"] for r in records] == [0, 1, 2, 3]
        assert records[0]["bytes_sent"] == 0  # nothing has landed at the end of the first round
        assert all(r["peers"] == 3 and r["applied"] and r["bytes_sent"] > 0 for r in records[1:])
        assert records[-1]["eval_loss"] < records[0]["eval_loss"]
    for round_index in range(4):
        assert len({records[round_index]["params_sha256"] for records in runs}) == 1
    assert len({records[1]["params_sha256"], records[2]["params_sha256"], records[3]["params_sha256"]}) == 3
    for i in range(3):
        log = (tmp_path / f"node{i}.log").read_text()
        assert re.search(r"outer step landed on exit \(applied, 3 peer\(s\)\)", log), log[-2000:]
    checkpoints = [final_params(tmp_path / f"node{i}" / "checkpoint") for i in range(3)]
    for other in checkpoints[1:]:
        assert all(torch.equal(other[k], checkpoints[0][k]) for k in checkpoints[0])
