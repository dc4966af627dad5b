"""Prepared corpora: a corpus tokenized once into flat token shards on disk, read through numpy.memmap.

Layout of a prepared folder (nanoGPT's ``train.bin`` convention, cut into shards)::

    manifest.json          written last (atomically): a folder without it is an unfinished prepare
    tokenizer.json         a copy of the Hugging Face tokenizer used (absent for byte-level)
    train-00000.bin ...    token ids, little-endian uint16 (uint32 if the vocabulary needs it), no header;
    eval-00000.bin ...     entries end with the tokenizer's end-of-text id

``manifest.json`` records the tokenizer (kind, vocabulary size, end-of-text id, sha256), the
element type, the split, and for each side its token count and shards (file, tokens, sha256).
Its ``digest`` is the sha256 of those fields alone (not of where the text came from, nor when):
two folders prepared from the same text with the same tokenizer and settings have the same
digest, and the peers of a run must share it (it joins the run fingerprint). A node checks every
shard's size and sha256 before it joins a swarm, so a truncated or edited shard is found at start.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

import numpy as np
import pydantic

from p2ploco.data.entries import Sources
from p2ploco.data.split import Split, plan_split
from p2ploco.data.streams import TokenStream
from p2ploco.data.tokenize import tokenize_corpus
from p2ploco.data.tokenizer import HuggingFaceTokenizer, Tokenizer, token_dtype
from p2ploco.errors import ConfigError

FORMAT = "p2ploco-tokens/1"
MANIFEST = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
DEFAULT_SHARD_TOKENS = 1 << 27  # 256 MiB of uint16 per shard
SIDES = ("train", "eval")


class _Strict(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)


class TokenizerInfo(_Strict):
    kind: Literal["byte", "huggingface"]
    vocab_size: int = pydantic.Field(ge=2)
    eot: int = pydantic.Field(ge=0)
    sha256: str  # of the tokenizer's canonical JSON; "" for byte-level


class ShardInfo(_Strict):
    file: str = pydantic.Field(pattern=r"^(train|eval)-\d{5}\.bin$")
    tokens: int = pydantic.Field(ge=1)
    sha256: str = pydantic.Field(pattern=r"^[0-9a-f]{64}$")


class SideInfo(_Strict):
    tokens: int = pydantic.Field(ge=0)
    shards: list[ShardInfo]


class SplitInfo(_Strict):
    """``split.Split`` as the manifest holds it: these keys are digested, so "documents" (a corpus's entries) stays."""

    kind: Literal["documents", "blocks"]
    eval_percent: float
    documents: int
    bytes: int
    held_out_documents: int
    block_bytes: int
    held_out_blocks: int


DIGESTED = {"format", "tokenizer", "dtype", "split", "train", "eval"}


class Manifest(_Strict):
    format: Literal["p2ploco-tokens/1"]
    tokenizer: TokenizerInfo
    dtype: Literal["uint16", "uint32"]
    split: SplitInfo
    train: SideInfo
    eval: SideInfo
    digest: str  # sha256 of the fields in DIGESTED
    sources: list[str]  # what was prepared, as given (informational)
    created: str  # UTC time of the prepare (informational)

    def computed_digest(self) -> str:
        return hashlib.sha256(json.dumps(self.model_dump(include=DIGESTED), sort_keys=True).encode()).hexdigest()

    def side(self, name: str) -> SideInfo:
        return self.train if name == "train" else self.eval


class ShardWriter:
    """Appends tokens to ``<side>-NNNNN.bin`` files of at most ``shard_tokens`` each, hashing as it writes."""

    def __init__(self, folder: Path, side: str, dtype: np.dtype, shard_tokens: int):
        self.folder, self.side, self.shard_tokens = folder, side, shard_tokens
        self.dtype = dtype.newbyteorder("<")
        self.shards: list[ShardInfo] = []
        self._file, self._hash, self._tokens = None, hashlib.sha256(), 0

    def append(self, tokens: np.ndarray) -> None:
        tokens = tokens.astype(self.dtype, copy=False)
        while len(tokens):
            if self._file is None:
                self._file = (self.folder / f"{self.side}-{len(self.shards):05d}.bin").open("wb")
            take = min(len(tokens), self.shard_tokens - self._tokens)
            data = tokens[:take].tobytes()
            self._file.write(data)
            self._hash.update(data)
            self._tokens += take
            tokens = tokens[take:]
            if self._tokens == self.shard_tokens:
                self._close_shard()

    def _close_shard(self) -> None:
        self._file.close()
        self.shards.append(ShardInfo(file=Path(self._file.name).name, tokens=self._tokens,
                                     sha256=self._hash.hexdigest()))
        self._file, self._hash, self._tokens = None, hashlib.sha256(), 0

    def close(self) -> SideInfo:
        if self._file is not None:
            self._close_shard()
        return SideInfo(tokens=sum(s.tokens for s in self.shards), shards=self.shards)


def prepare(paths: Sequence[str], out: Path, tokenizer: Tokenizer, eval_percent: float,
            shard_tokens: int = DEFAULT_SHARD_TOKENS, scanned: Callable[[Split], None] = lambda split: None,
            progress: Callable[[int], None] = lambda done: None) -> Manifest:
    """Tokenize ``paths`` into shards under ``out`` (a new or empty folder) and write the manifest last.
    ``scanned`` hears the split once the entries were listed; ``progress`` the bytes tokenized so far."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {out} already exists and is not an empty folder; choose a new one "
                          f"(nothing was written)")
    if not 0 < eval_percent < 50:
        raise ConfigError(f"--eval-percent {eval_percent} must be in (0, 50)")
    if shard_tokens < 1:
        raise ConfigError(f"--shard-tokens {shard_tokens} must be at least 1")
    sources = Sources(paths, origin="PATHS")
    split = plan_split(sources.sizes(), eval_percent)
    scanned(split)
    out.mkdir(parents=True, exist_ok=True)
    dtype = token_dtype(tokenizer.vocab_size)
    writers = {side: ShardWriter(out, side, dtype, shard_tokens) for side in SIDES}
    tokenize_corpus(sources, tokenizer, split, writers["train"], writers["eval"], progress)
    if isinstance(tokenizer, HuggingFaceTokenizer):
        tokenizer.save(out / TOKENIZER_FILE)
    fields = {
        "format": FORMAT,
        "tokenizer": TokenizerInfo(kind="huggingface" if tokenizer.digest else "byte", vocab_size=tokenizer.vocab_size,
                                   eot=tokenizer.eot, sha256=tokenizer.digest),
        "dtype": dtype.name,
        "split": SplitInfo(**dataclasses.asdict(split)),
        "train": writers["train"].close(), "eval": writers["eval"].close(),
        "sources": [str(p) for p in paths] or [sources.description],
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    draft = Manifest(**fields, digest="")
    manifest = draft.model_copy(update={"digest": draft.computed_digest()})
    temporary = out / (MANIFEST + ".tmp")
    temporary.write_text(manifest.model_dump_json(indent=2) + "\n")
    os.replace(temporary, out / MANIFEST)
    return manifest


def read_manifest(folder: Path) -> Manifest:
    """The manifest of a prepared folder, checked against its digest; one-line errors otherwise."""
    path = folder / MANIFEST
    if not folder.is_dir():
        raise ConfigError(f"data.prepared: {folder} is not a folder; make one with "
                          f"`p2ploco data prepare PATHS... --out {folder}`")
    if not path.is_file():
        raise ConfigError(f"data.prepared: {folder} holds no {MANIFEST} (not prepared, or the prepare did not "
                          f"finish); run `p2ploco data prepare PATHS... --out NEW_FOLDER`")
    try:
        manifest = Manifest.model_validate_json(path.read_bytes())
    except pydantic.ValidationError as e:
        first = e.errors()[0]
        where = ".".join(map(str, first["loc"])) or "the file"
        raise ConfigError(f"data.prepared: {path} is not a valid manifest ({where}: {first['msg']}); "
                          f"prepare the corpus again") from None
    if manifest.computed_digest() != manifest.digest:
        raise ConfigError(f"data.prepared: {path} was edited (its digest does not match its content); "
                          f"prepare the corpus again")
    return manifest


def tokenizer_path(folder: Path, manifest: Manifest) -> str:
    """The tokenizer ``folder`` was prepared with, as ``data.tokenizer`` names one: the folder's copy of its
    tokenizer.json, or "" for byte-level."""
    return "" if manifest.tokenizer.kind == "byte" else str(folder / TOKENIZER_FILE)


def open_prepared(folder: Path) -> tuple[Manifest, TokenStream, TokenStream]:
    """The manifest and the train and eval streams (memory-mapped) of a prepared folder, once every shard's
    size and sha256 were checked (read in chunks, not mapped: memory stays flat)."""
    manifest = read_manifest(folder)
    dtype = np.dtype(manifest.dtype).newbyteorder("<")
    streams = []
    for side in SIDES:
        info = manifest.side(side)
        if sum(s.tokens for s in info.shards) != info.tokens:
            raise ConfigError(f"data.prepared: {folder / MANIFEST} lists {side} shards that do not add up to "
                              f"{info.tokens} tokens; prepare the corpus again")
        for shard in info.shards:
            _check_shard(folder / shard.file, shard, dtype.itemsize)
        streams.append(TokenStream([np.memmap(folder / s.file, dtype=dtype, mode="r") for s in info.shards]))
    return manifest, streams[0], streams[1]


def _check_shard(path: Path, shard: ShardInfo, itemsize: int) -> None:
    expected = shard.tokens * itemsize
    if not path.is_file():
        raise ConfigError(f"data.prepared: shard {path} is missing; copy the whole prepared folder, or prepare "
                          f"the corpus again")
    size = path.stat().st_size
    if size != expected:
        state = "truncated" if size < expected else "longer than recorded"
        raise ConfigError(f"data.prepared: shard {path} is {state} ({size:,} bytes, the manifest says "
                          f"{expected:,}); copy it again or prepare the corpus again")
    with path.open("rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    if digest != shard.sha256:
        raise ConfigError(f"data.prepared: shard {path} does not match its sha256 in the manifest (edited or "
                          f"damaged); copy it again or prepare the corpus again")
