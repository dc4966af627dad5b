"""Tokenizers: byte-level by default, or a Hugging Face ``tokenizer.json`` read from a local file.

A tokenizer turns parts of UTF-8 text into token ids and names one id, ``eot``, that ends every
corpus entry in a token stream. ``digest`` identifies it: peers of a run must tokenize alike, so a
non-default tokenizer's digest joins the run fingerprint (byte-level has none: it is fixed).
``train_bpe`` trains a byte-level BPE tokenizer on local text (``p2ploco data train-tokenizer``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from p2ploco.data.entries import Sources
from p2ploco.data.split import text_parts
from p2ploco.errors import ConfigError

# Names that end a text (a corpus entry) in common tokenizers; train_bpe adds the first one.
EOT_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>")
# Text handed to the tokenizer at once: a Hugging Face tokenizer encodes a batch on all cores, and holds
# about 25 bytes per token of it while it does.
ENCODE_BYTES = 1 << 22


class Tokenizer(Protocol):
    vocab_size: int
    eot: int
    name: str  # shown to people: "byte-level", or the tokenizer file
    digest: str  # "" for byte-level; else the sha256 of the tokenizer's canonical JSON

    def encode_batch(self, parts: Sequence[bytes]) -> list[np.ndarray]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes are tokens 0..255; 256 separates entries."""

    vocab_size = 257
    eot = 256
    name = "byte-level"
    digest = ""

    def encode(self, data: bytes) -> np.ndarray:
        return np.frombuffer(data, dtype=np.uint8).astype(np.uint16)

    def encode_batch(self, parts: Sequence[bytes]) -> list[np.ndarray]:
        return [self.encode(part) for part in parts]

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HuggingFaceTokenizer:
    """A ``tokenizers`` tokenizer from a local ``tokenizer.json``; nothing is downloaded."""

    def __init__(self, path: Path):
        import tokenizers

        if not path.is_file():
            raise ConfigError(f"tokenizer file {path} does not exist; pass a Hugging Face tokenizer.json "
                              f"(or train one: p2ploco data train-tokenizer)")
        try:
            self.tokenizer = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # the library raises bare Exception for every parse error; a subclass is no parse error
            if type(e) is not Exception:
                raise
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ConfigError(f"tokenizer file {path} is not a Hugging Face tokenizer.json ({reason})") from None
        specials = {token.content: token_id for token_id, token in self.tokenizer.get_added_tokens_decoder().items()}
        eot = next((specials[name] for name in EOT_NAMES if name in specials), None)
        if eot is None:
            raise ConfigError(f"tokenizer {path} has no end-of-text token (one of {', '.join(EOT_NAMES)}) to "
                              f"separate documents: add one as a special token")
        self.eot = eot
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        self.name = str(path)
        self.digest = hashlib.sha256(self.tokenizer.to_str().encode()).hexdigest()

    def encode_batch(self, parts: Sequence[bytes]) -> list[np.ndarray]:
        texts = [part.decode("utf-8", errors="replace") for part in parts]
        encodings = self.tokenizer.encode_batch_fast(texts, add_special_tokens=False)
        return [np.asarray(encoding.ids, dtype=np.uint32) for encoding in encodings]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode(list(ids))

    def save(self, path: Path) -> None:
        self.tokenizer.save(str(path))


def load_tokenizer(path: str) -> Tokenizer:
    """``data.tokenizer``: empty means byte-level; else a path to a tokenizer.json."""
    return HuggingFaceTokenizer(Path(path).expanduser()) if path else ByteTokenizer()


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned type that holds every id (nanoGPT's convention: uint16 where it fits)."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def train_bpe(texts: Iterator[str], vocab_size: int, out: Path) -> HuggingFaceTokenizer:
    """A byte-level BPE tokenizer (GPT-2 style pre-tokenization) with ``<|endoftext|>``, trained on ``texts``."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 1:
        raise ConfigError(f"--vocab-size {vocab_size} is too small: a byte-level BPE needs at least "
                          f"{len(alphabet) + 1} (256 bytes + end-of-text)")
    tokenizer = RustTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT_NAMES[0]], initial_alphabet=alphabet,
                                  show_progress=False)
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.save(str(out))
    return HuggingFaceTokenizer(out)


def train_bpe_on_sources(sources: Sources, vocab_size: int, out: Path, progress: Callable[[int], None],
                         ) -> tuple[HuggingFaceTokenizer, int]:
    """``train_bpe`` on the text of every entry of ``sources``, in parts cut at line ends (``text_parts``);
    ``progress`` is told the bytes of text read so far after each part. Returns the tokenizer and the bytes read."""
    read = 0

    def texts() -> Iterator[str]:
        nonlocal read
        for entry in sources.entries():
            for part in text_parts(entry.chunks):
                yield part.decode("utf-8", errors="replace")
                read += len(part)
                progress(read)

    tokenizer = train_bpe(texts(), vocab_size, out)
    return tokenizer, read
