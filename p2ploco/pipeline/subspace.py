"""Subspace-compressed stage boundaries (Ramasinghe et al. 2025, "Protocol Models").

From the run seed alone every peer derives the same orthonormal basis U (d x k) and a frozen random
token table F (V x d). The model's input is h0 = E[tok] + F[tok]. In a *constrained* replica every
weight that writes into the residual stream before the last stage boundary (the embedding, attention
out, MLP down) lies in span(U), so at every boundary h - F[tok] lies in span(U) and

    sent:     c = (h - F[tok]) U          k values per token, plus the token ids
    rebuilt:  h = c U^T + F[tok]          inside the receiver's autograd graph

is exact; the gradient sent back, dL/dc = (dL/dh) U, is k values per token too. Norm gains sit on
branch inputs only (pre-norm blocks), so nothing else writes outside the subspace. Layers after the
last boundary send nothing and stay unconstrained.

The constraint is kept by projection (docs/pipeline.md): gradients of constrained weights are
projected onto span(U) before each inner step (the tangent space of the constraint, which also makes a
pipeline's gradients equal the unsplit constrained model's), and the weights are projected again after
the step (AdamW's elementwise update leaves the span) and whenever new global parameters are loaded.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from p2ploco.config import ModelConfig
from p2ploco.model import stage_layers, tensor_seed

BASIS_NAME, TABLE_NAME = "pipeline.basis", "pipeline.token_table"


class Subspace:
    """U (d x k, orthonormal columns) and F (V x d), the same on every peer of a run."""

    def __init__(self, basis: torch.Tensor, table: torch.Tensor):
        self.basis, self.table = basis, table

    @classmethod
    def derive(cls, config: ModelConfig, rank: int, seed: int) -> Subspace:
        """QR of a seeded Gaussian in float64, rounded to float32; F ~ N(0, init_std^2) like the embedding,
        so neither part of h0 drowns the other."""
        gaussian = torch.randn(config.d_model, rank, dtype=torch.float64,
                               generator=torch.Generator().manual_seed(tensor_seed(seed, BASIS_NAME)))
        basis = torch.linalg.qr(gaussian).Q.float().contiguous()
        table = torch.empty(config.vocab_size, config.d_model)
        table.normal_(0.0, config.init_std, generator=torch.Generator().manual_seed(tensor_seed(seed, TABLE_NAME)))
        return cls(basis, table)

    @property
    def width(self) -> int:
        """Values per token at a boundary: k."""
        return self.basis.shape[1]

    def to(self, device: torch.device) -> Subspace:
        return Subspace(self.basis.to(device), self.table.to(device))

    def encode(self, hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """c = (h - F[ids]) U: (B, T, d) -> (B, T, k)."""
        return (hidden - self.table[ids].to(hidden.dtype)) @ self.basis.to(hidden.dtype)

    def decode(self, code: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """h = c U^T + F[ids]: (B, T, k) -> (B, T, d)."""
        return code @ self.basis.T.to(code.dtype) + self.table[ids].to(code.dtype)

    def project_(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """In place: the component of ``tensor`` in span(U) along dimension ``dim`` (0: U U^T W; 1: W U U^T)."""
        U = self.basis.to(tensor.device)
        projected = U @ (U.T @ tensor) if dim == 0 else (tensor @ U) @ U.T
        return tensor.copy_(projected)

    def relative_residual(self, tensor: torch.Tensor, dim: int) -> float:
        """||W - P(W)|| / ||W||: 0 for a tensor inside span(U)."""
        outside = tensor.detach().float() - self.project_(tensor.detach().float().clone(), dim)
        return float(outside.norm() / tensor.detach().float().norm().clamp_min(1e-30))


class PlainBoundary:
    """An uncompressed boundary (``pipeline.compression: none``): h itself, d values per token."""

    def __init__(self, d_model: int):
        self.width = d_model

    def encode(self, hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return hidden

    def decode(self, values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return values


BoundaryCodec = Subspace | PlainBoundary


def constrained_dims(config: ModelConfig, stages: int) -> dict[str, int]:
    """Constrained parameters by global name, with the dimension that holds d_model: the embedding (rows are
    d-vectors) and the residual-writing projections of every layer before the last stage boundary."""
    last_boundary = stage_layers(config.n_layer, stages)[-1].start
    dims = {"embed.weight": 1}
    for layer in range(last_boundary):
        dims[f"blocks.{layer}.attn.out.weight"] = 0
        dims[f"blocks.{layer}.mlp.down.weight"] = 0
    return dims


class SubspaceConstraint:
    """Which of a replica's (or a stage's) parameters are constrained, and their projection onto span(U).

    Works on lists of tensors in the order of ``names`` (the model's parameters, their gradients, or the
    global parameters), so one object serves the inner steps and the outer round.
    """

    def __init__(self, subspace: Subspace, names: Sequence[str], dims: dict[str, int]):
        self.subspace = subspace
        self.members = [(position, dims[name]) for position, name in enumerate(names) if name in dims]

    @torch.no_grad()
    def project_(self, tensors: Sequence[torch.Tensor | None]) -> None:
        """Project the constrained entries of ``tensors`` in place (None entries, e.g. absent grads, skipped)."""
        for position, dim in self.members:
            if tensors[position] is not None:
                self.subspace.project_(tensors[position], dim)

    @torch.no_grad()
    def projected(self, tensors: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        """``tensors`` with the constrained entries replaced by float32 projections on ``device``."""
        out = list(tensors)
        for position, dim in self.members:
            out[position] = self.subspace.project_(tensors[position].to(device, torch.float32, copy=True), dim)
        return out

    def max_relative_residual(self, tensors: Sequence[torch.Tensor]) -> float:
        return max((self.subspace.relative_residual(tensors[position], dim) for position, dim in self.members),
                   default=0.0)
