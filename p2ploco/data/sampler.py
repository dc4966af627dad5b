"""This peer's walk over the training windows, and the fixed held-out windows every peer scores.

Each peer visits the training windows in a fresh pseudo-random order per epoch, seeded by
(run id, peer id, epoch); micro-batch ``i`` is a pure function of ``i``, so a restarted peer
resumes by computing its position, not by replaying. The order is a keyed Feistel permutation of
the window indices, evaluated per index: no permutation array is ever built, so a peer's memory
does not grow with the corpus (an explicit permutation of a 1 GB corpus's 128-token windows
would take 64 MB, of a 100 GB one 6 GB).
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from p2ploco.data.streams import TokenStream

Batch = tuple[torch.Tensor, torch.Tensor]  # inputs, next-token targets
FEISTEL_ROUNDS = 4


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a fast, well-scrambling function of 64-bit integers."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class Permutation:
    """A pseudo-random bijection of [0, n) computed per index: a balanced Feistel network over the smallest
    even number of bits that covers n, with cycle walking to stay below n (on average under 4 steps)."""

    def __init__(self, n: int, seed: bytes):
        self.n = n
        bits = max(2, (n - 1).bit_length())
        self.half = np.uint64((bits + 1) // 2)
        self.mask = np.uint64((1 << int(self.half)) - 1)
        digest = hashlib.sha256(seed).digest()
        self.keys = [np.uint64(int.from_bytes(digest[8 * r : 8 * r + 8], "big")) for r in range(FEISTEL_ROUNDS)]

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self.half, x & self.mask
        for key in self.keys:
            left, right = right, left ^ (_mix(right ^ key) & self.mask)
        return (left << self.half) | right

    def __call__(self, indices: np.ndarray) -> np.ndarray:
        out = self._encrypt(indices.astype(np.uint64))
        while (outside := out >= np.uint64(self.n)).any():
            out[outside] = self._encrypt(out[outside])
        return out.astype(np.int64)


def _batch_of(tokens: TokenStream, rows: np.ndarray, seq_len: int) -> Batch:
    block = torch.from_numpy(tokens.gather(rows, seq_len))
    return block[:, :-1], block[:, 1:]


class ShardSampler:
    """This peer's stream of micro-batches over the training windows."""

    def __init__(self, tokens: TokenStream | np.ndarray, seq_len: int, batch_size: int, run_id: str, peer_key: str):
        self.tokens = tokens if isinstance(tokens, TokenStream) else TokenStream([tokens])
        self.seq_len, self.batch_size = seq_len, batch_size
        self.num_windows = self.tokens.windows(seq_len)
        if self.num_windows < 1:
            raise ValueError(f"no window of {seq_len + 1} tokens in {self.tokens.tokens} training tokens")
        self.seed_prefix = f"{run_id}/{peer_key}"
        self._permutations: dict[int, Permutation] = {}

    def _permutation(self, epoch: int) -> Permutation:
        if epoch not in self._permutations:
            self._permutations = {epoch: Permutation(self.num_windows, f"{self.seed_prefix}/{epoch}".encode())}
        return self._permutations[epoch]

    def rows(self, index: int) -> np.ndarray:
        """The window indices of micro-batch ``index`` (any index, in any order)."""
        positions = np.arange(index * self.batch_size, (index + 1) * self.batch_size, dtype=np.int64)
        epochs, within = np.divmod(positions, self.num_windows)
        rows = np.empty_like(positions)
        for epoch in np.unique(epochs).tolist():
            here = epochs == epoch
            rows[here] = self._permutation(epoch)(within[here])
        return rows

    def batch(self, index: int) -> Batch:
        """Micro-batch number ``index`` of this peer's stream."""
        return _batch_of(self.tokens, self.rows(index), self.seq_len)


def eval_batches(tokens: TokenStream | np.ndarray, seq_len: int, sequences: int, batch_size: int = 16) -> list[Batch]:
    """The fixed held-out windows every peer scores the same way: ``sequences`` of them, spread evenly over
    the held-out stream (which lists the held-out text in corpus order)."""
    stream = tokens if isinstance(tokens, TokenStream) else TokenStream([tokens])
    available = stream.windows(seq_len)
    count = min(sequences, available)
    rows = np.arange(count, dtype=np.int64) * available // max(count, 1)
    return [_batch_of(stream, rows[i : i + batch_size], seq_len) for i in range(0, count, batch_size)]
