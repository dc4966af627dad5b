"""4-bit floats with a 3-bit exponent and no mantissa (E3M0), one float32 scale per block of values.

Streaming DiLoCo's exchanged values. A value is a sign and a power of two relative to its block's scale:

    nibble = sign << 3 | e           (sign: 1 bit, e: 3 bits)
    value  = 0                        if e == 0  (the nibble 0b1000, "-0", is never produced and is refused)
           = ±scale · 2^(e - 7)       if e in 1..7

Groups are ``compression/blockwise.py``'s (``BlockLayout``: consecutive values of one tensor, the last
block of a tensor perhaps shorter). Per block:

    scale = amax                      (its largest |value|), 0 instead where amax < 2^-120
    e     = 0 where |v| / scale < 2^-7 (nearer 0 than 2^-6), else the exponent of |v| / scale rounded to the
            nearer power of two (ties up), clamped to [1, 7]

Every decoded value ``scale · 2^(e - 7)`` is a normal float32 (the scale is >= 2^-120), so it is exact, and a
block's largest value decodes to exactly its scale (e = 7): a decoded block quantizes to itself, codes and
scale alike. The codec is exact on its own grid.
"""

from __future__ import annotations

import numpy as np
import torch

EXPONENT_BIAS = 7  # e = 7 is the scale itself
MIN_SCALE = 2.0 ** -120  # smaller amaxes are sent as zeros: scale · 2^-6 must stay a normal float32
NEGATIVE_ZERO = 0b1000


def quantize(values: torch.Tensor, lengths: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
    """E3M0 nibbles (uint8, one per value) and float32 scales (one per block) of float32 ``values`` (CPU, flat)
    cut into consecutive blocks of ``lengths`` values."""
    amax = torch.zeros(len(lengths), dtype=torch.float32)
    if len(lengths):
        starts = (torch.cumsum(lengths, 0) - lengths).numpy()
        amax = torch.from_numpy(np.maximum.reduceat(values.abs().numpy(), starts))  # max is exact in any order
    scales = amax.masked_fill(amax < MIN_SCALE, 0.0)
    per_value = scales.repeat_interleave(lengths)
    ratio = values.abs() / per_value.masked_fill(per_value == 0, 1.0)  # in [0, 1]; 0 where the scale is 0
    ratio = ratio.masked_fill(per_value == 0, 0.0)
    mantissa, exponent = torch.frexp(ratio)  # ratio = mantissa · 2^exponent, mantissa in [0.5, 1)
    nearer = exponent - 1 + (mantissa >= 0.75).to(exponent.dtype)  # 2^(exponent-1) or 2^exponent, ties up
    e = (nearer + EXPONENT_BIAS).clamp_(1, EXPONENT_BIAS)
    e = e.masked_fill_(ratio < 2.0 ** -EXPONENT_BIAS, 0)
    sign = ((values < 0) & (e > 0)).to(torch.int32)
    nibbles = (sign << 3 | e).to(torch.uint8).numpy()
    return nibbles, scales


def decode(nibbles: np.ndarray, scales: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The float32 values of E3M0 ``nibbles`` with their blocks' ``scales`` (exact)."""
    nibbles = torch.from_numpy(np.ascontiguousarray(nibbles)).to(torch.int32)
    e = nibbles & 0b111
    magnitude = torch.ldexp(torch.ones_like(e, dtype=torch.float32), (e - EXPONENT_BIAS).float())
    magnitude = magnitude.masked_fill_(e == 0, 0.0) * scales.repeat_interleave(lengths)
    return torch.where(nibbles >> 3 == 1, -magnitude, magnitude)


def pack(nibbles: np.ndarray) -> bytes:
    """Two nibbles a byte, the first in the high half; an odd count ends with a zero low half."""
    padded = np.zeros(len(nibbles) + len(nibbles) % 2, dtype=np.uint8)
    padded[: len(nibbles)] = nibbles
    return (padded[0::2] << 4 | padded[1::2]).astype(np.uint8).tobytes()


def unpack(data: bytes, count: int) -> np.ndarray:
    """The ``count`` nibbles of ``pack``; ValueError on a wrong length, non-zero padding or a "-0" nibble."""
    if len(data) != (count + 1) // 2:
        raise ValueError(f"E3M0 stream of {len(data)} bytes, expected {(count + 1) // 2} for {count} values")
    packed = np.frombuffer(data, dtype=np.uint8)
    nibbles = np.stack([packed >> 4, packed & 0x0F], axis=1).reshape(-1)
    if nibbles[count:].any():
        raise ValueError("E3M0 stream has non-zero padding")
    nibbles = nibbles[:count]
    if (nibbles == NEGATIVE_ZERO).any():
        raise ValueError("E3M0 stream holds the nibble 0b1000 (-0), which no encoder produces")
    return nibbles
