"""A node's training data, loaded and checked before it joins a swarm.

``data.prepared`` opens a prepared folder (memory-mapped: memory does not grow with the corpus);
otherwise ``data.paths`` (or the standard library) is read and tokenized into memory, which suits
small corpora. Every problem a person can fix (a missing file, a malformed JSONL line, a
vocabulary that does not fit the model, a corpus too small for one window on each side, a
damaged shard) ends the start-up with one line, before any peer has seen this node.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from p2ploco.config import Config
from p2ploco.data.entries import Sources
from p2ploco.data.prepared import open_prepared, read_manifest, tokenizer_path
from p2ploco.data.split import Split, plan_split
from p2ploco.data.streams import MemorySink, TokenStream
from p2ploco.data.tokenize import tokenize_corpus
from p2ploco.data.tokenizer import Tokenizer, load_tokenizer, token_dtype
from p2ploco.errors import ConfigError
from p2ploco.metrics import human_count


@dataclass
class TrainingData:
    train: TokenStream
    eval: TokenStream
    source: str  # what a person reads: the files, or the prepared folder
    tokenizer: str  # the tokenizer's name
    vocab_size: int
    split: str  # how the eval share was held out
    # What every peer of the run must share about the data (joins the run fingerprint): the prepared
    # corpus's digest, or a non-default tokenizer's; "" for byte-level text read from data.paths.
    fingerprint: str

    def describe(self) -> str:
        return (f"corpus {self.source}: {human_count(self.train.tokens)} train / {human_count(self.eval.tokens)} eval "
                f"tokens ({self.split}), {self.tokenizer} tokenizer")


def load_training_data(config: Config) -> TrainingData:
    d = config.data
    if d.prepared:
        data = _load_prepared(config)
    else:
        tokenizer = load_tokenizer(d.tokenizer)
        _check_vocab(config, tokenizer.vocab_size, tokenizer.name)
        sources = Sources(d.paths)
        split = plan_split(sources.sizes(), d.eval_percent)
        dtype = token_dtype(tokenizer.vocab_size)
        train, held_out = MemorySink(dtype), MemorySink(dtype)
        tokenize_corpus(sources, tokenizer, split, train, held_out)
        data = TrainingData(train.stream(), held_out.stream(), sources.description, tokenizer.name,
                            tokenizer.vocab_size, split.describe(),
                            f"tokenizer:{tokenizer.digest}" if tokenizer.digest else "")
    _check_size(config, data)
    return data


def run_tokenizer(config: Config) -> Tokenizer:
    """The tokenizer a run trains with: its prepared corpus's (byte-level, or the folder's tokenizer.json), or
    ``data.tokenizer`` (byte-level when unset)."""
    if config.data.prepared:
        folder = Path(config.data.prepared).expanduser()
        return load_tokenizer(tokenizer_path(folder, read_manifest(folder)))
    return load_tokenizer(config.data.tokenizer)


def _load_prepared(config: Config) -> TrainingData:
    folder = Path(config.data.prepared).expanduser()
    manifest, train, held_out = open_prepared(folder)
    t = manifest.tokenizer
    name = tokenizer_path(folder, manifest) or "byte-level"
    if config.data.tokenizer:
        chosen = load_tokenizer(config.data.tokenizer)
        if chosen.digest != t.sha256:
            raise ConfigError(f"data.tokenizer {config.data.tokenizer} is not the tokenizer {folder} was prepared "
                              f"with ({name}); leave data.tokenizer unset with data.prepared")
    _check_vocab(config, t.vocab_size, name)
    return TrainingData(train, held_out, f"{folder} (prepared)", name, t.vocab_size,
                        Split(**manifest.split.model_dump()).describe(), f"prepared:{manifest.digest}")


def _check_vocab(config: Config, vocab_size: int, tokenizer: str) -> None:
    if config.model.vocab_size != vocab_size:
        raise ConfigError(f"model.vocab_size is {config.model.vocab_size} but the {tokenizer} tokenizer has "
                          f"{vocab_size} tokens; set model.vocab_size={vocab_size}")


def _check_size(config: Config, data: TrainingData) -> None:
    window = config.data.seq_len + 1
    fix = ("prepare it again with a larger --eval-percent" if config.data.prepared
           else "raise data.eval_percent")
    if data.train.tokens + data.eval.tokens < 2 * window:
        raise ConfigError(f"corpus {data.source} holds {data.train.tokens + data.eval.tokens:,} tokens, too few for "
                          f"one training and one held-out window of data.seq_len+1={window} tokens; add text or "
                          f"lower data.seq_len")
    if data.eval.windows(config.data.seq_len) < 1:
        raise ConfigError(f"corpus {data.source}: the held-out share ({data.split}) holds {data.eval.tokens:,} "
                          f"tokens, not one window of data.seq_len+1={window}; {fix}, or lower data.seq_len")
    if data.train.windows(config.data.seq_len) < 1:
        raise ConfigError(f"corpus {data.source}: the training share holds {data.train.tokens:,} tokens, not one "
                          f"window of data.seq_len+1={window}; add text or lower data.seq_len")
