"""DiLoCo through the in-process communicator equals the algorithm written out by hand, bit for bit."""

import pytest
import torch
from helpers import run_outer_replicas

from p2ploco.config import DiLoCoConfig, OuterConfig

SHAPES = [(33, 17), (17,), (5, 4, 3)]


def run_replicas(replicas: int, rounds: int, diloco: DiLoCoConfig, seed: int = 0):
    """K DiLoCo replicas in threads; each round every replica's local params are random perturbations."""
    return run_outer_replicas(OuterConfig(algorithm="diloco", diloco=diloco), SHAPES, replicas, rounds, 0.01, seed)


def reference_diloco(initial, locals_per_round, lr, momentum):
    """The DiLoCo outer step as in the paper: mean pseudo-gradient, then SGD with Nesterov momentum."""
    params = [p.clone() for p in initial]
    bufs = [torch.zeros_like(p) for p in initial]
    for local_params in locals_per_round:
        for i, p in enumerate(params):
            deltas = [p - replica[i] for replica in local_params]
            mean = deltas[0].clone()
            for d in deltas[1:]:
                mean = mean + d
            mean = mean / len(deltas)
            bufs[i] = bufs[i] * momentum + mean
            params[i] = p - (bufs[i] * momentum + mean) * lr
    return params


@pytest.mark.parametrize("replicas", [1, 3, 4])
def test_in_process_diloco_matches_the_reference_exactly(replicas):
    config = DiLoCoConfig(lr=0.7, momentum=0.9)
    initial, locals_per_round, algorithms, stats = run_replicas(replicas, 3, config)
    expected = reference_diloco(initial, locals_per_round, 0.7, 0.9)
    for algorithm in algorithms:
        for got, want in zip(algorithm.params, expected):
            assert torch.equal(got, want)
    numel = sum(torch.Size(s).numel() for s in SHAPES)
    for rank_stats in stats:
        assert rank_stats[0].all_reduce.peers == [f"replica-{i}" for i in range(replicas)]
        # float32 on the wire: a dense exchange moves exactly what the dense fp32 butterfly would
        traffic = rank_stats[0].all_reduce.traffic
        assert traffic.bytes_sent + traffic.bytes_received == traffic.dense_fp32_bytes
    traffic = [s[0].all_reduce.traffic for s in stats]
    assert sum(t.bytes_sent for t in traffic) == sum(t.bytes_received for t in traffic)
    if replicas == 4:
        assert sum(t.dense_fp32_bytes for t in traffic) == 2 * 4 * numel * 2 * 3  # 2(n-1)/n * 4 B each way, n=4


def test_nesterov_step_agrees_with_torch_sgd():
    config = DiLoCoConfig(lr=0.7, momentum=0.9)
    initial, locals_per_round, algorithms, _ = run_replicas(2, 4, config, seed=3)
    params = [p.clone().requires_grad_(True) for p in initial]
    sgd = torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)
    for local_params in locals_per_round:
        for i, p in enumerate(params):
            p.grad = sum(p.detach() - replica[i] for replica in local_params) / len(local_params)
        sgd.step()
    for got, want in zip(algorithms[0].params, params):
        assert torch.allclose(got, want.detach(), rtol=0, atol=1e-6)


def test_half_precision_wire_still_gives_identical_replicas():
    config = DiLoCoConfig(wire_dtype="bfloat16")
    _, _, algorithms, stats = run_replicas(3, 2, config)
    for algorithm in algorithms[1:]:
        assert all(torch.equal(a, b) for a, b in zip(algorithm.params, algorithms[0].params))
    traffic = stats[0][0].all_reduce.traffic
    assert traffic.bytes_sent * 2 == traffic.dense_fp32_bytes // 2
