import numpy as np
import pytest
import torch

from p2ploco.build import build_replica
from p2ploco.config import InnerConfig, ModelConfig, load_config
from p2ploco.data import ShardSampler, load_training_data
from p2ploco.inner import InnerTrainer, LocalBatches, clip_coefficient, evaluate
from p2ploco.launch import TINY_CONFIG
from p2ploco.model import Transformer


def make_trainer(accum: int, batch: int, horizon: int = 100) -> tuple[InnerTrainer, ShardSampler]:
    tokens = (np.arange(20_000) * 7 % 251).astype(np.uint16)
    model = Transformer(ModelConfig(n_layer=1, d_model=32, n_head=2, max_seq_len=16), 0)
    config = InnerConfig(steps=5, batch_size=batch, grad_accum=accum, lr=1e-2, warmup_steps=4, min_lr_ratio=0.1)
    sampler = ShardSampler(tokens, 16, batch, "r", "p")
    cpu = torch.device("cpu")
    return InnerTrainer(model, config, LocalBatches(model, sampler, accum, cpu), cpu, horizon), sampler


def test_warmup_then_cosine_to_the_floor():
    trainer, _ = make_trainer(1, 4)
    lrs = [trainer.lr_at(s) for s in range(0, 120)]
    assert lrs[0] == 1e-2 / 4 and lrs[3] == 1e-2
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:]))
    assert abs(lrs[100] - 1e-3) < 1e-12 and lrs[119] == lrs[100]
    assert make_trainer(1, 4, horizon=0)[0].lr_at(50) == 1e-2  # no horizon: constant after warm-up


def test_a_round_trains_and_reports_tokens():
    trainer, sampler = make_trainer(2, 4)
    batches = [sampler.batch(i) for i in range(100, 104)]
    before = evaluate(trainer.model, batches, torch.device("cpu"))
    stats = [trainer.run_round(r) for r in range(4)]
    assert stats[0].tokens == 5 * 2 * 4 * 16
    assert evaluate(trainer.model, batches, torch.device("cpu")) < before
    assert stats[-1].loss < stats[0].loss


def test_clipping_matches_torch_clip_grad_norm():
    trainer, _ = make_trainer(1, 4)
    trainer.gradients.accumulate(0)
    grads = [p.grad.clone() for p in trainer.params]
    total = torch.nn.utils.clip_grad_norm_(trainer.params, 0.05)  # clips the live grads in place
    coefficient = clip_coefficient(float(total), 0.05)
    assert coefficient < 1.0  # the clip is active at this bound
    for clipped, raw in zip((p.grad for p in trainer.params), grads):
        assert torch.allclose(clipped, raw * coefficient, rtol=1e-6, atol=0)


def test_training_compile_compiles_the_forward_over_the_workers_own_parameters():
    config = load_config(TINY_CONFIG, ["training.compile=true"])
    data = load_training_data(config)
    sampler = ShardSampler(data.train, config.data.seq_len, config.inner.batch_size, config.run_id, "p")
    worker = build_replica(config, torch.device("cpu"), sampler)
    forward = worker.inner.gradients.model
    assert isinstance(forward, torch._dynamo.eval_frame.OptimizedModule) and forward._orig_mod is worker.model
    assert not isinstance(build_replica(load_config(TINY_CONFIG), torch.device("cpu"), sampler).inner.gradients.model,
                          torch._dynamo.eval_frame.OptimizedModule)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_optimizer_is_fused_and_a_round_trains_from_pinned_batches():
    config = load_config(TINY_CONFIG)
    data = load_training_data(config)
    sampler = ShardSampler(data.train, config.data.seq_len, config.inner.batch_size, config.run_id, "p")
    worker = build_replica(config, torch.device("cuda"), sampler)
    assert all(group["fused"] for group in worker.inner.optimizer.param_groups)
    stats = worker.inner.run_round(0)
    assert stats.steps == config.inner.steps and np.isfinite(stats.loss)
