"""Block-wise symmetric low-bit quantization (LoCo's Q and deQ), and its error compensation.

A tensor is flattened and cut into blocks of ``group_size`` consecutive values (the last block of a
tensor may be shorter; no block spans two tensors, so a norm gain never shares a scale with a weight
matrix). With ``q = 2^(bits-1) - 1`` (7 at 4 bits), each block gets one float32 scale and every value
a code in [-q, q]:

    scale = amax / q, rounded *up* to a 16-bit significand      (amax: the block's largest |value|)
            0 instead where that is below 2^-126 (subnormal)
    code  = clamp(round_half_even(value / scale), -q, q)       (0 where the scale is 0)
    deQ   = code * scale                                        (float32)

The rounded scale keeps ``code * scale`` exact in float32 (at most 7 + 16 significant bits of a normal
number), so a decoded block quantizes to itself: the codec is exact on its own grid, and its largest code
is ±q. A block below ~1e-37 is sent as zeros (error compensation carries it; subnormal scales would lose
the exactness).

Error compensation (``compensate``): g̃ = g + e; q = Q(g̃); e ← β·e + (1 − β)·(g̃ − deQ(q)), each an
elementwise float32 operation rounded once, so a written-out reference reproduces it bit for bit.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

SCALE_SPARE_BITS = 8  # low significand bits of a float32 scale that are always zero (24 - 16)


def max_code(bits: int) -> int:
    """q: codes lie in [-q, q], symmetric around an exact zero."""
    return 2 ** (bits - 1) - 1


class BlockLayout:
    """Where the quantization blocks of a list of tensors lie in their concatenation (tensor order, row-major)."""

    def __init__(self, shapes: Sequence[torch.Size | tuple[int, ...]], group_size: int):
        self.shapes = [torch.Size(s) for s in shapes]
        self.group_size = group_size
        numels = [s.numel() for s in self.shapes]
        lengths = []
        for n in numels:
            full, rest = divmod(n, group_size)
            lengths += [group_size] * full + ([rest] if rest else [])
        self.lengths = torch.tensor(lengths, dtype=torch.int64)  # values in each block
        self.block_ends = np.cumsum(lengths, dtype=np.int64)  # element index one past each block
        self.num_blocks = len(lengths)
        self.numel = sum(numels)
        self.digest = hashlib.sha256(f"{group_size}:{[tuple(s) for s in self.shapes]}".encode()).hexdigest()[:16]

    def element_range(self, blocks: range) -> range:
        """The elements of a run of whole blocks."""
        start = int(self.block_ends[blocks.start - 1]) if blocks.start > 0 else 0
        stop = int(self.block_ends[blocks.stop - 1]) if blocks.stop > blocks.start else start
        return range(start, stop)

    def block_of(self, element: int) -> int:
        """The block that holds element number ``element``."""
        return int(np.searchsorted(self.block_ends, element, side="right"))

    def split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """``flat`` (all tensors' elements concatenated) as views shaped like the tensors."""
        parts = flat.split([s.numel() for s in self.shapes])
        return [part.view(shape) for part, shape in zip(parts, self.shapes)]


@dataclass
class Quantized:
    """A run of whole blocks: one code per value, one scale per block."""

    codes: torch.Tensor  # int8 in [-q, q], one per value
    scales: torch.Tensor  # float32 >= 0, one per block
    lengths: torch.Tensor  # int64, values per block

    def decode(self) -> torch.Tensor:
        """deQ: code * scale in float32 (exact: see the module docstring)."""
        return self.codes.float() * self.scales.repeat_interleave(self.lengths)


def quantize(values: torch.Tensor, lengths: torch.Tensor, bits: int) -> Quantized:
    """Q of float32 ``values`` (CPU, flat) cut into consecutive blocks of ``lengths`` values."""
    q = max_code(bits)
    amax = torch.zeros(len(lengths), dtype=torch.float32)
    if len(lengths):
        starts = (torch.cumsum(lengths, 0) - lengths).numpy()
        amax = torch.from_numpy(np.maximum.reduceat(values.abs().numpy(), starts))  # max is exact in any order
    spare = (1 << SCALE_SPARE_BITS) - 1
    scales = ((amax / q).view(torch.int32) + spare).bitwise_and_(~spare).view(torch.float32)  # rounded up
    scales = scales.masked_fill_(scales < torch.finfo(torch.float32).tiny, 0.0)
    per_value = scales.repeat_interleave(lengths)
    # a zero scale has only zeros in its block: divide them by 1 instead
    ratio = values / per_value.masked_fill(per_value == 0, 1.0)
    codes = ratio.round_().clamp_(-q, q).to(torch.int8)
    return Quantized(codes, scales, lengths)


def compensate(values: torch.Tensor, error: torch.Tensor, beta: float, lengths: torch.Tensor,
               bits: int, scale: float = 1.0) -> tuple[Quantized, torch.Tensor]:
    """LoCo at one hop: the quantized ``values + error`` and the error buffer that follows it (a new tensor;
    ``error`` is left as it is, so that a round that is not applied can keep the old one). ``scale`` < 1 quantizes
    a shorter ``values + error`` (a reducer's result bound, ``robust.within``): what it leaves out is dropped like
    what quantization drops."""
    compensated = values + error  # g~ = g + e
    quantized = quantize(compensated if scale == 1.0 else compensated * scale, lengths, bits)  # q = Q(g~)
    dropped = compensated - quantized.decode()  # what this hop does not transmit
    return quantized, error * beta + dropped * (1 - beta)  # e <- beta * e + (1 - beta) * (g~ - deQ(q))
