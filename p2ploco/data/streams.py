"""Token streams: flat arrays of token ids, in memory or memory-mapped from shard files, read as windows.

A window is ``seq_len + 1`` consecutive tokens (inputs and next-token targets). Windows start at
multiples of ``seq_len`` within one array and never span two, so finding window ``i`` costs one
binary search over the arrays, whatever the corpus size.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np


class TokenStream:
    def __init__(self, shards: Sequence[np.ndarray]):
        self.shards = [shard for shard in shards if len(shard)]
        self.tokens = sum(len(shard) for shard in self.shards)
        self._first_window: dict[int, np.ndarray] = {}  # seq_len -> index of each shard's first window, and the total

    def _window_offsets(self, seq_len: int) -> np.ndarray:
        if seq_len not in self._first_window:
            counts = [max(0, (len(shard) - 1) // seq_len) for shard in self.shards]
            self._first_window[seq_len] = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        return self._first_window[seq_len]

    def windows(self, seq_len: int) -> int:
        return int(self._window_offsets(seq_len)[-1])

    def gather(self, rows: np.ndarray, seq_len: int) -> np.ndarray:
        """Windows number ``rows`` as an int64 array of shape (len(rows), seq_len + 1)."""
        offsets = self._window_offsets(seq_len)
        shard_of = np.searchsorted(offsets, rows, side="right") - 1
        block = np.empty((len(rows), seq_len + 1), dtype=np.int64)
        for i, (row, shard) in enumerate(zip(rows.tolist(), shard_of.tolist())):
            start = (row - int(offsets[shard])) * seq_len
            block[i] = self.shards[shard][start : start + seq_len + 1]
        return block


class TokenSink(Protocol):
    """Where tokenized text goes: memory (small corpora) or shard files (prepared corpora)."""

    def append(self, tokens: np.ndarray) -> None: ...


class MemorySink:
    def __init__(self, dtype: np.dtype):
        self.dtype, self.parts = dtype, []

    def append(self, tokens: np.ndarray) -> None:
        self.parts.append(tokens.astype(self.dtype, copy=False))

    def stream(self) -> TokenStream:
        return TokenStream([np.concatenate(self.parts)] if self.parts else [])
