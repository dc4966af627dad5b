"""The device a node trains on: rank 0's, named as the node's record and start-up line show it."""

from __future__ import annotations

import torch

from p2ploco.errors import ConfigError


def describe_device(device: torch.device, ranks: int = 1) -> str:
    """``device``, or with ``ranks`` > 1 the devices of the node's local ranks (``cpu x2``, ``cuda:0-3 (NVIDIA
    H100 80GB HBM3)``)."""
    if ranks > 1 and device.type == "cpu":
        return f"cpu x{ranks}"
    if ranks > 1:
        return f"cuda:0-{ranks - 1} ({torch.cuda.get_device_name(device)})"
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)


def resolve_device(name: str, ranks: int = 1) -> torch.device:
    """Rank 0's device; with ``ranks`` > 1 local ranks, rank r trains on the r-th GPU (``ranks.group.rank_device``)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"training.device={name} but no CUDA device is visible; use training.device=cpu")
    if device.type == "cuda" and ranks > 1:
        if device.index not in (None, 0):
            raise ConfigError(f"training.device={name} with {ranks} local ranks: ranks train on cuda:0 to "
                              f"cuda:{ranks - 1}; use training.device=cuda (CUDA_VISIBLE_DEVICES picks the GPUs)")
        if torch.cuda.device_count() < ranks:
            raise ConfigError(f"{ranks} local ranks need {ranks} GPUs; {torch.cuda.device_count()} are visible: use "
                              f"--nproc-per-node {torch.cuda.device_count()}")
        device = torch.device("cuda", 0)
    return device
