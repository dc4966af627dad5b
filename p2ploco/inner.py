"""The inner loop: H local AdamW steps with warm-up + cosine, clipping and gradient accumulation.

The inner step number is global (round * H + h), so the learning rate and this peer's data
position follow from the round alone: a peer that joins or restarts computes them, it does not
replay them.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from p2ploco import faults
from p2ploco.config import InnerConfig
from p2ploco.data import ShardSampler


@dataclass
class InnerStats:
    loss: float  # mean training loss over the round's inner steps
    tokens: int
    seconds: float


def autocast_for(device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast on CUDA; plain fp32 on CPU."""
    if device.type == "cuda":
        return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


class InnerTrainer:
    def __init__(self, model: torch.nn.Module, config: InnerConfig, sampler: ShardSampler, device: torch.device,
                 horizon: int):
        """``horizon``: the inner step where the cosine reaches its floor (0: constant after warm-up)."""
        self.model, self.config, self.sampler, self.device, self.horizon = model, config, sampler, device, horizon
        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]  # norm gains
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=config.lr, betas=tuple(config.betas),
        )
        self.step_in_round = 0  # inner steps done in the round under way (shown in the peer's record)

    def lr_at(self, step: int) -> float:
        c = self.config
        if step < c.warmup_steps:
            return c.lr * (step + 1) / c.warmup_steps
        if self.horizon <= c.warmup_steps:
            return c.lr
        progress = min(1.0, (step - c.warmup_steps) / (self.horizon - c.warmup_steps))
        return c.lr * (c.min_lr_ratio + (1 - c.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))

    def run_round(self, round_index: int, should_stop: Callable[[], bool] = lambda: False) -> InnerStats | None:
        """The round's H steps; None if ``should_stop`` turned true before they were done."""
        c = self.config
        started = time.perf_counter()
        self.model.train()
        losses = []
        for h in range(c.steps):
            self.step_in_round = h
            if should_stop():
                return None
            faults.hit("inner.step", round_index)
            step = round_index * c.steps + h
            for group in self.optimizer.param_groups:
                group["lr"] = self.lr_at(step)
            self.optimizer.zero_grad(set_to_none=True)
            step_loss = 0.0
            for micro in range(c.grad_accum):
                inputs, targets = self.sampler.batch(step * c.grad_accum + micro)
                with autocast_for(self.device):
                    loss = self.model(inputs.to(self.device), targets.to(self.device)) / c.grad_accum
                loss.backward()
                step_loss += loss.item()
            if c.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), c.grad_clip)
            self.optimizer.step()
            losses.append(step_loss)
        self.step_in_round = c.steps
        tokens = c.steps * c.grad_accum * c.batch_size * self.sampler.seq_len
        return InnerStats(sum(losses) / len(losses), tokens, time.perf_counter() - started)

    def optimizer_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """AdamW's moments as named tensors, and its settings as JSON, for a checkpoint."""
        state = self.optimizer.state_dict()
        tensors = {f"{index}.{key}": value for index, slots in state["state"].items()
                   for key, value in slots.items() if torch.is_tensor(value)}
        return tensors, {"param_groups": state["param_groups"]}

    def load_optimizer_state(self, tensors: dict[str, torch.Tensor], settings: dict[str, Any]) -> None:
        slots: dict[int, dict[str, torch.Tensor]] = {}
        for key, value in tensors.items():
            index, _, name = key.partition(".")
            slots.setdefault(int(index), {})[name] = value
        self.optimizer.load_state_dict({"state": slots, "param_groups": settings["param_groups"]})


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device) -> float:
    """Mean next-token loss over the held-out batches."""
    model.eval()
    total, count = 0.0, 0
    for inputs, targets in batches:
        with autocast_for(device):
            loss = model(inputs.to(device), targets.to(device))
        total += loss.item() * targets.numel()
        count += targets.numel()
    return total / count
