"""Cutting a tensor into equal chunks: tiles for matrices, runs for vectors (SparseLoCo reference).

A matrix (any tensor of 2+ dims, viewed as rows x the rest) is cut into tiles whose sides are the
largest divisors of each dimension not above ``chunk_size``, so every tile has the same size even
when a dimension is not a multiple of it (a prime vocabulary of 257 rows gives 1-row tiles). Vectors
are cut into runs the same way. Each chunk keeps ``k`` values: ``topk`` per full chunk_size^2 tile
scaled to the tile's size for matrices, and ``min(topk, run)`` for vectors, which keeps the few norm
gains and biases dense, as the reference does.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch


def largest_divisor_at_most(n: int, limit: int) -> int:
    return next(d for d in range(min(n, limit), 0, -1) if n % d == 0)


@dataclass(frozen=True)
class ChunkGrid:
    shape: tuple[int, ...]
    rows: int  # the tensor viewed as rows x cols (a vector is 1 x n)
    cols: int
    tile_rows: int
    tile_cols: int
    k: int  # values kept per chunk

    @property
    def chunk_numel(self) -> int:
        return self.tile_rows * self.tile_cols

    @property
    def chunks(self) -> int:
        return (self.rows // self.tile_rows) * (self.cols // self.tile_cols)

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    @property
    def tile_shape(self) -> tuple[int, int, int, int]:
        """(tile rows, tile columns, rows in a tile, columns in a tile): a chunk-order buffer viewed as tiles."""
        return self.rows // self.tile_rows, self.cols // self.tile_cols, self.tile_rows, self.tile_cols

    def tiles(self, tensor: torch.Tensor) -> torch.Tensor:
        """A view of a tensor of this shape in the layout of ``tile_shape`` (no copy): elementwise arithmetic
        between it and a chunk-order buffer's ``view(tile_shape)`` runs in place, with no reordering copy."""
        a, b = self.tile_rows, self.tile_cols
        return tensor.reshape(self.rows // a, a, self.cols // b, b).permute(0, 2, 1, 3)

    def to_chunks(self, tensor: torch.Tensor) -> torch.Tensor:
        """(chunks, chunk_numel) view-order copy: chunk c holds tile c in row-major tile order."""
        return self.tiles(tensor).reshape(self.chunks, self.chunk_numel)

    def from_chunks(self, chunked: torch.Tensor) -> torch.Tensor:
        return chunked.reshape(self.tile_shape).permute(0, 2, 1, 3).reshape(self.shape)

    def flat_index(self, positions: np.ndarray) -> np.ndarray:
        """Row-major element offsets in the tensor of chunk-order element offsets (chunk x chunk_numel + j):
        where its tile starts, plus where element j sits in a tile."""
        chunk, inner = np.divmod(positions, self.chunk_numel)
        return self._tile_starts[chunk] + self._tile_offsets[inner]

    @functools.cached_property
    def _tile_starts(self) -> np.ndarray:
        tile_row, tile_col = np.divmod(np.arange(self.chunks, dtype=np.int64), self.cols // self.tile_cols)
        return tile_row * self.tile_rows * self.cols + tile_col * self.tile_cols

    @functools.cached_property
    def _tile_offsets(self) -> np.ndarray:
        row, col = np.divmod(np.arange(self.chunk_numel, dtype=np.int64), self.tile_cols)
        return row * self.cols + col


def chunk_grid(shape: tuple[int, ...], chunk_size: int, topk: int) -> ChunkGrid:
    if len(shape) >= 2:
        rows, cols = shape[0], math.prod(shape[1:])
        tile_rows, tile_cols = largest_divisor_at_most(rows, chunk_size), largest_divisor_at_most(cols, chunk_size)
        k = min(tile_rows * tile_cols, max(1, round(topk * tile_rows * tile_cols / chunk_size**2)))
    else:
        rows, cols = 1, max(1, math.prod(shape))
        tile_rows, tile_cols = 1, largest_divisor_at_most(cols, chunk_size)
        k = min(topk, tile_cols)
    return ChunkGrid(tuple(shape), rows, cols, tile_rows, tile_cols, k)
