"""The train/eval split: decided from the corpus entries' names and sizes alone, so every peer makes the same one.

With enough entries, whole entries are held out by a hash of their name (the eval text is text
the model never trained on, from entries it never saw). A corpus of one or a few entries (a
single text file, a folder of plays) cannot be split that way: its text is cut into fixed blocks
of bytes instead, and an evenly spread share of the blocks is held out. Both decisions depend
only on the names, sizes and order of the entries and on ``eval_percent``.

Text reaches the tokenizer in parts of at most ``PART_BYTES``, cut at a line end where one is
near (and never inside a UTF-8 character), so that a 1 GB file never sits in memory as one string.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import Literal

MIN_HELD_OUT_ENTRIES = 8  # fewer held-out entries than this make a poor sample: split by blocks instead
SHARE_TOLERANCE = 3.0  # an entry-level split must hold out between 1/3x and 3x eval_percent of the bytes
TARGET_HELD_OUT_BLOCKS = 16  # block-level: aim for this many held-out blocks spread over the corpus
MIN_BLOCK_BYTES = 1 << 10
MAX_BLOCK_BYTES = 1 << 20
PART_BYTES = 1 << 16
UTF8_MAX = 4  # bytes of the longest UTF-8 character


def is_held_out(name: str, eval_percent: float) -> bool:
    """Entry-level: whether the entry called ``name`` is held out (a hash of the name, the same everywhere)."""
    bucket = int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "big") % 10_000
    return bucket < eval_percent * 100


@dataclass(frozen=True)
class Split:
    """A corpus's split. Its fields are the prepared corpus's ``split`` (``prepared.SplitInfo``) by name, whose
    digest the run document carries: "documents" there means entries (the kind "documents" holds out whole ones)."""

    kind: Literal["documents", "blocks"]
    eval_percent: float
    documents: int  # the corpus's entries
    bytes: int
    held_out_documents: int = 0  # "documents": how many entries are held out
    block_bytes: int = 0  # windows: the held-out unit
    held_out_blocks: int = 0  # windows: how many blocks are held out, spread evenly

    @property
    def blocks(self) -> int:
        return math.ceil(self.bytes / self.block_bytes) if self.block_bytes else 0

    @cached_property
    def _held_out_block_indices(self) -> frozenset[int]:
        n, count = self.blocks, self.held_out_blocks
        return frozenset((2 * j + 1) * n // (2 * count) for j in range(count))

    def describe(self) -> str:
        if self.kind == "documents":
            return f"{self.held_out_documents} of {self.documents} documents held out"
        return (f"{self.held_out_blocks} of {self.blocks} blocks of {self.block_bytes:,} bytes held out: "
                f"{self.documents} document{'s' if self.documents != 1 else ''}, too few to hold out whole ones")

    def parts(self, name: str, chunks: Iterable[bytes], offset: int) -> Iterator[tuple[bool, bytes]]:
        """(held out?, text) for the parts of one entry (its text in ``chunks``) that starts ``offset``
        bytes into the corpus."""
        if self.kind == "documents":
            held = is_held_out(name, self.eval_percent)
            for part, _ in _cut(chunks, offset, lambda at: None):
                yield held, part
        else:
            for part, at in _cut(chunks, offset, lambda at: (at // self.block_bytes + 1) * self.block_bytes):
                yield at // self.block_bytes in self._held_out_block_indices, part


def text_parts(chunks: Iterable[bytes]) -> Iterator[bytes]:
    """An entry's text (in ``chunks``) in parts of about PART_BYTES, cut at line ends where possible."""
    return (part for part, _ in _cut(chunks, 0, lambda at: None))


def _cut(chunks: Iterable[bytes], offset: int, boundary: Callable[[int], int | None]) -> Iterator[tuple[bytes, int]]:
    """(part, its offset in the corpus) for an entry that starts at ``offset``: each part ends at the next
    ``boundary(start)`` (a corpus offset; None: none) if that is within PART_BYTES, else at the last line end
    within PART_BYTES (or at PART_BYTES); never inside a UTF-8 character. Holds at most a chunk and a part."""
    buffer, start, base = b"", 0, offset  # buffer[start:] is not cut yet; buffer[0] is at corpus offset base
    for chunk in itertools.chain(chunks, [None]):
        final = chunk is None
        buffer, base, start = buffer[start:] + (chunk or b""), base + start, 0
        while start < len(buffer):
            limit = boundary(base + start)
            hard = len(buffer) if limit is None else min(len(buffer), limit - base)
            if not final and min(hard, start + PART_BYTES) + UTF8_MAX > len(buffer):
                break  # the part's end may depend on text not read yet
            end = _part_end(buffer, start, hard)
            yield buffer[start:end], base + start
            start = end


def _part_end(data: bytes, start: int, hard: int) -> int:
    """Where the part from ``start`` ends: at ``hard`` if it is near, else at the last line end within
    PART_BYTES (if any); moved past a UTF-8 character it would cut."""
    soft = start + PART_BYTES
    if hard <= soft:
        end = hard
    else:
        newline = data.rfind(b"\n", start, soft)
        end = newline + 1 if newline > start else soft
    while end < len(data) and data[end] & 0xC0 == 0x80:
        end += 1
    return end


def plan_split(sizes: Iterable[tuple[str, int]], eval_percent: float) -> Split:
    """Hold out whole entries when enough of them (and about the right share of the text) would be;
    else an evenly spread share of fixed blocks of the text."""
    entries = total = held_entries = held_bytes = 0
    for name, size in sizes:
        if not size:
            continue
        entries += 1
        total += size
        if is_held_out(name, eval_percent):
            held_entries += 1
            held_bytes += size
    share = eval_percent / 100
    if (held_entries >= MIN_HELD_OUT_ENTRIES
            and share / SHARE_TOLERANCE <= held_bytes / total <= share * SHARE_TOLERANCE):
        return Split("documents", eval_percent, entries, total, held_out_documents=held_entries)
    block_bytes = min(MAX_BLOCK_BYTES, max(MIN_BLOCK_BYTES, math.ceil(total * share / TARGET_HELD_OUT_BLOCKS)))
    blocks = math.ceil(total / block_bytes)
    held_blocks = min(blocks - 1, max(1, round(blocks * share))) if blocks >= 2 else 0
    return Split("blocks", eval_percent, entries, total, block_bytes=block_bytes, held_out_blocks=held_blocks)
