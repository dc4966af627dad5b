"""Vectorized bit codes for sparse payloads: Rice codes of index gaps, and 2-bit value packing.

Sorted positions inside a chunk are sent as gaps g (positions minus previous position minus 1). A
gap is split into a unary part g >> r and an r-bit remainder; the unary parts of all gaps form one
bit stream (q zeros, then a one) and the remainders another, so both encode and decode are
vectorized numpy. For k of n positions a gap averages about n/k, and r ~ log2(n/k * ln 2) costs
about 7.5-8 bits per index at 64 of 4096 (the information bound is 7.4; fixed-width would be 12).
"""

from __future__ import annotations

import math

import numpy as np

from p2ploco.errors import PayloadError


def rice_parameter(n: int, k: int) -> int:
    """Remainder width for gaps of ``k`` sorted positions among ``n`` (near-optimal for a geometric gap)."""
    if k <= 0 or k >= n:
        return 0
    return max(0, int(math.floor(math.log2(max(1.0, (n - k) / k * math.log(2))))))


def max_unary_bits(n: int, k: int, r: int) -> int:
    """Most unary bits ``k`` gaps among ``n`` positions can take: the gaps sum to at most n - k."""
    return k + ((n - k) >> r)


def _bit_matrix(values: np.ndarray, width: int) -> np.ndarray:
    """(len(values), width) bits of each value, most significant first; values must fit in ``width`` bits."""
    size = 1 if width <= 8 else 2 if width <= 16 else 4
    as_bytes = values.astype(f">u{size}").view(np.uint8).reshape(len(values), size)
    return np.unpackbits(as_bytes, axis=1)[:, 8 * size - width:]


def _bit_values(bits: np.ndarray) -> np.ndarray:
    """The inverse of ``_bit_matrix``: each row of bits (most significant first) as an int64."""
    width = bits.shape[1]
    weights = (1 << np.arange(width - 1, -1, -1)).astype(np.uint8 if width <= 8 else np.uint16 if width <= 16
                                                          else np.uint32)
    return (bits @ weights).astype(np.int64)


def rice_encode(gaps: np.ndarray, widths: np.ndarray) -> tuple[bytes, bytes]:
    """(unary stream, remainder stream) for non-negative ``gaps`` with per-gap remainder ``widths``."""
    gaps, widths = gaps.astype(np.int64, copy=False), widths.astype(np.int64, copy=False)
    quotients = gaps >> widths
    ends = np.cumsum(quotients + 1) - 1
    unary = np.zeros(int(ends[-1]) + 1 if len(ends) else 0, dtype=np.uint8)
    unary[ends] = 1
    widest = int(widths.max()) if len(widths) else 0
    if widest == 0:
        return np.packbits(unary).tobytes(), b""
    bits = _bit_matrix(gaps & ((1 << widths) - 1), widest)
    if int(widths.min()) == widest:  # one width (a contribution's tensor): every row is a whole code
        remainder_bits = bits.reshape(-1)
    else:
        remainder_bits = bits[np.arange(widest) >= (widest - widths)[:, None]]
    return np.packbits(unary).tobytes(), np.packbits(remainder_bits).tobytes()


def rice_decode(unary: bytes, remainders: bytes, widths: np.ndarray) -> np.ndarray:
    """The gaps, checking both streams hold exactly len(widths) codes and nothing more."""
    widths = widths.astype(np.int64, copy=False)
    count = len(widths)
    bits = np.unpackbits(np.frombuffer(unary, dtype=np.uint8))
    ends = np.flatnonzero(bits.view(bool))  # a bool view: numpy's fast path
    if len(ends) != count:
        raise PayloadError(f"index stream holds {len(ends)} codes, expected {count}")
    if len(unary) != (int(ends[-1]) // 8 + 1 if count else 0):
        raise PayloadError("index stream has trailing bytes")
    quotients = np.diff(ends, prepend=-1) - 1
    total = int(widths.sum())
    if len(remainders) != (total + 7) // 8:
        raise PayloadError(f"remainder stream of {len(remainders)} bytes, expected {(total + 7) // 8}")
    remainder_bits = np.unpackbits(np.frombuffer(remainders, dtype=np.uint8))
    if remainder_bits[total:].any():
        raise PayloadError("remainder stream has non-zero padding")
    widest = int(widths.max()) if count else 0
    if widest == 0:
        return quotients
    if int(widths.min()) == widest:
        rests = _bit_values(remainder_bits[:total].reshape(count, widest))
    else:
        rows = np.zeros((count, widest), dtype=np.uint8)
        rows[np.arange(widest) >= (widest - widths)[:, None]] = remainder_bits[:total]
        rests = _bit_values(rows)
    return (quotients << widths) + rests


def pack_2bit(codes: np.ndarray) -> bytes:
    """Four 2-bit codes per byte, first code in the high bits."""
    padded = np.zeros((len(codes) + 3) // 4 * 4, dtype=np.uint8)
    padded[: len(codes)] = codes
    quads = padded.reshape(-1, 4)
    return (quads[:, 0] << 6 | quads[:, 1] << 4 | quads[:, 2] << 2 | quads[:, 3]).astype(np.uint8).tobytes()


def unpack_2bit(data: bytes, count: int) -> np.ndarray:
    if len(data) != (count + 3) // 4:
        raise PayloadError(f"value stream of {len(data)} bytes, expected {(count + 3) // 4}")
    packed = np.frombuffer(data, dtype=np.uint8)
    quads = np.stack([packed >> 6, packed >> 4 & 3, packed >> 2 & 3, packed & 3], axis=1).reshape(-1)
    if quads[count:].any():
        raise PayloadError("value stream has non-zero padding")
    return quads[:count]
