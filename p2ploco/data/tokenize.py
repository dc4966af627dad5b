"""Tokenize a corpus into a training and a held-out token stream, following its split.

Every entry's run of text on one side ends with the tokenizer's end-of-text token: at the end
of the entry, and where a block-level split cuts a held-out block out of it (the text on
either side of the cut does not continue across it).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from p2ploco.data.entries import Sources
from p2ploco.data.split import Split
from p2ploco.data.streams import TokenSink
from p2ploco.data.tokenizer import ENCODE_BYTES, Tokenizer
from p2ploco.errors import ConfigError


def tokenize_corpus(sources: Sources, tokenizer: Tokenizer, split: Split, train: TokenSink, held_out: TokenSink,
                    progress: Callable[[int], None] = lambda done: None) -> None:
    """Stream ``sources`` through ``tokenizer`` into the two sinks; ``progress`` gets the bytes of text done."""
    eot = np.array([tokenizer.eot], dtype=np.uint32)
    batch: list[tuple[bool, bytes, bool]] = []  # held out?, text, whether the run on that side ends after it
    batched = 0  # bytes of text in the batch

    def add(held: bool, text: bytes, ends: bool) -> None:
        nonlocal batched
        batch.append((held, text, ends))
        batched += len(text)
        if batched >= ENCODE_BYTES:
            flush()

    def flush() -> None:
        nonlocal batched
        for (held, _, ends), tokens in zip(batch, tokenizer.encode_batch([text for _, text, _ in batch])):
            sink = held_out if held else train
            sink.append(tokens)
            if ends:
                sink.append(eot)
        progress(batched)
        batch.clear()
        batched = 0

    offset = 0
    for entry in sources.entries():
        previous: tuple[bool, bytes] | None = None
        for held, text in split.parts(entry.name, entry.chunks, offset):
            if previous is not None:
                add(previous[0], previous[1], previous[0] != held)
            previous = held, text
            offset += len(text)
        if previous is not None:
            add(previous[0], previous[1], True)
    flush()
    if offset != split.bytes:
        raise ConfigError(f"corpus {sources.description} changed while it was read ({split.bytes:,} bytes, then "
                          f"{offset:,}); run again once nothing writes to it")
