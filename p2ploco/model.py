"""A LLaMA-style decoder: RMSNorm, rotary embeddings, SwiGLU, causal SDPA attention.

The model is ``embed -> blocks[0..n_layer) -> norm -> head``; a pipeline stage is the same class
built for a slice of the blocks (plus, at the ends, the embedding or the head).
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from p2ploco.config import ModelConfig


def ffn_width(config: ModelConfig) -> int:
    if config.d_ff:
        return config.d_ff
    return 64 * math.ceil(8 * config.d_model / 3 / 64)


def parameter_count(config: ModelConfig) -> int:
    """The parameters of the whole model of ``config``, as ``Transformer`` holds them (counted, not built)."""
    d, vocab = config.d_model, config.vocab_size
    block = 2 * d + 4 * d * d + 3 * d * ffn_width(config)  # two norms, attention's qkv and out, SwiGLU's three
    return vocab * d * (1 if config.tie_embeddings else 2) + config.n_layer * block + d


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rotary_tables(head_dim: int, seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), freqs)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) of each head by position-dependent angles; x is (B, H, T, D)."""
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    rotated = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model, bias=False)
        self.out = nn.Linear(config.d_model, config.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(B, T, C))


class SwiGLU(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        hidden = ffn_width(config)
        self.gate = nn.Linear(config.d_model, hidden, bias=False)
        self.up = nn.Linear(config.d_model, hidden, bias=False)
        self.down = nn.Linear(hidden, config.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = RMSNorm(config.d_model, config.norm_eps)
        self.mlp = SwiGLU(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


def stage_layers(n_layer: int, stages: int) -> list[range]:
    """The layers of each of ``stages`` consecutive stages, as even as they divide."""
    bounds = [n_layer * s // stages for s in range(stages + 1)]
    return [range(bounds[s], bounds[s + 1]) for s in range(stages)]


def tensor_seed(seed: int, name: str) -> int:
    """The generator seed of one named tensor: a stage built alone draws the same values as the whole model."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "big")


class Transformer(nn.Module):
    """Layers [first, stop) of the decoder: the whole model by default, or one pipeline stage.

    The stage holding layer 0 embeds token ids; the stage holding the last layer has the final norm and
    the head. Parameter names are global (``blocks.5.mlp.up.weight`` on whichever stage holds layer 5),
    and every tensor is drawn from (seed, name), so a stage built alone holds exactly the weights of the
    same slice of the whole model. ``token_table`` is the frozen random table F of subspace-compressed
    runs: the input is then h0 = E[tok] + F[tok] (``p2ploco.pipeline.subspace``).
    """

    def __init__(self, config: ModelConfig, seed: int, layers: range | None = None,
                 token_table: torch.Tensor | None = None):
        super().__init__()
        self.config = config
        self.layers = layers = layers if layers is not None else range(config.n_layer)
        if not 0 <= layers.start < layers.stop <= config.n_layer:
            raise ValueError(f"layers {layers.start}:{layers.stop} are not a slice of {config.n_layer} layers")
        self.first, self.last = layers.start == 0, layers.stop == config.n_layer
        if self.first:
            self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleDict({str(i): Block(config) for i in layers})
        if self.last:
            self.norm = RMSNorm(config.d_model, config.norm_eps)
            self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            if not (self.first and self.last):
                raise ValueError("tied embeddings need the embedding and the head on one stage")
            self.lm_head.weight = self.embed.weight
        cos, sin = rotary_tables(config.d_model // config.n_head, config.max_seq_len, config.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.register_buffer("token_table", token_table, persistent=False)
        self.reset_parameters(seed)

    def reset_parameters(self, seed: int) -> None:
        """GPT-2 style: N(0, std), residual-writing projections scaled down by depth, each tensor from a
        private generator seeded by (seed, its name): weights depend on nothing else."""
        std, depth_scale = self.config.init_std, 1 / math.sqrt(2 * self.config.n_layer)
        for name, p in self.named_parameters():
            if p.dim() < 2:
                continue  # norm gains stay at 1
            generator = torch.Generator().manual_seed(tensor_seed(seed, name))  # built on the CPU, then moved
            writes_residual = name.endswith(("attn.out.weight", "mlp.down.weight"))
            nn.init.normal_(p, mean=0.0, std=std * depth_scale if writes_residual else std, generator=generator)

    def forward(self, idx: torch.Tensor, *, hidden: torch.Tensor | None = None,
                targets: torch.Tensor | None = None) -> torch.Tensor:
        """``idx``: token ids (B, T). The first stage embeds them; a later stage continues from ``hidden``
        (B, T, d), the previous stage's output. The last stage returns logits (B, T, V), or the mean
        next-token cross-entropy when targets are given; other stages return their hidden state."""
        T = idx.shape[1]
        if T > self.config.max_seq_len:
            raise ValueError(f"sequence of {T} tokens exceeds model.max_seq_len={self.config.max_seq_len}")
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        if self.first:
            x = self.embed(idx)
            if self.token_table is not None:
                x = x + self.token_table[idx]
        else:
            x = hidden
        for block in self.blocks.values():
            x = block(x, cos, sin)
        if not self.last:
            return x
        logits = self.lm_head(self.norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
