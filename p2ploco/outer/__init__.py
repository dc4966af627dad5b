"""Outer algorithms on pseudo-gradients, one file each, behind :class:`OuterAlgorithm`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from p2ploco.collective.robust import Policy
from p2ploco.config import OuterConfig
from p2ploco.outer.base import OuterAlgorithm
from p2ploco.outer.diloco import DiLoCo
from p2ploco.outer.loco import LoCo
from p2ploco.outer.sparseloco import SparseLoCo
from p2ploco.outer.streaming import StreamingDiLoCo


def build_outer(config: OuterConfig, global_params: Sequence[torch.Tensor], device: torch.device | None = None,
                slices: Mapping[str, Sequence[int]] | None = None, max_tokens: int | None = None
                ) -> OuterAlgorithm:
    """The configured algorithm over ``global_params`` cut into named ``slices`` (default: one; Streaming
    DiLoCo's fragments for it); ``device`` is where its per-replica working state lives (the training device);
    ``max_tokens``: the most tokens a contribution may weigh (``Config.max_contribution_tokens``; None: uncapped)."""
    policy = Policy(config.clip_factor, config.drop_opposed)
    cpu = torch.device("cpu")
    if config.algorithm == "diloco":
        return DiLoCo(global_params, config.diloco, slices, policy, max_tokens)
    if config.algorithm == "streaming":
        return StreamingDiLoCo(global_params, config.streaming, slices, policy, max_tokens)
    if config.algorithm == "loco":
        return LoCo(global_params, config.loco, device or cpu, slices, policy, max_tokens)
    return SparseLoCo(global_params, config.sparseloco, device or cpu, slices, policy, max_tokens)
