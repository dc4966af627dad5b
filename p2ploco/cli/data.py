"""``p2ploco data``: prepare corpora and tokenizers for training."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from p2ploco.cli.command import reports_errors
from p2ploco.errors import ConfigError


@click.group()
def data() -> None:
    """Prepare corpora and tokenizers for training."""


def _progress() -> Any:
    """A progress bar on stderr (bytes done, speed, time left), shown on a terminal only: logs get the summary."""
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    console = Console(stderr=True)
    return Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                    TimeRemainingColumn(), console=console, disable=not console.is_terminal)


@data.command("prepare")
@click.argument("paths", nargs=-1, required=True)
@click.option("--out", required=True, type=click.Path(file_okay=False),
              help="New (or empty) folder for the token shards and manifest.json.")
@click.option("--tokenizer", default="", help="A Hugging Face tokenizer.json [byte-level].")
@click.option("--eval-percent", default=2.0, show_default=True, type=float,
              help="Share held out for the eval loss: of the documents, or of blocks of text when few.")
@click.option("--shard-tokens", default=None, type=click.IntRange(min=1),
              help="Tokens per shard file [134217728: 256 MiB of uint16].")
@reports_errors
def data_prepare(paths: tuple[str, ...], out: str, tokenizer: str, eval_percent: float,
                 shard_tokens: int | None) -> None:
    """Tokenize text files, JSONL files (one "text" per line) and folders of them once, into token shards
    that nodes read through numpy.memmap (--set data.prepared=OUT)."""
    import time

    from p2ploco.data import Split, load_tokenizer, prepare
    from p2ploco.data.prepared import DEFAULT_SHARD_TOKENS
    from p2ploco.metrics import format_table, human_bytes

    chosen = load_tokenizer(tokenizer)
    started = time.perf_counter()
    with _progress() as bar:
        listing = bar.add_task("listing documents", total=None)

        def scanned(split: Any) -> None:
            bar.update(listing, total=split.bytes, completed=split.bytes)
            bar.update(tokenizing, total=split.bytes, visible=True)

        tokenizing = bar.add_task("tokenizing", total=None, visible=False)
        manifest = prepare(paths, Path(out), chosen, eval_percent, shard_tokens or DEFAULT_SHARD_TOKENS, scanned,
                           lambda done: bar.advance(tokenizing, done))
    seconds = time.perf_counter() - started
    text_bytes = manifest.split.bytes
    itemsize = 2 if manifest.dtype == "uint16" else 4
    rows = [
        ("text", f"{human_bytes(text_bytes)} in {manifest.split.documents:,} "
                 f"document{'s' if manifest.split.documents != 1 else ''}"),
        ("tokenizer", f"{chosen.name} ({manifest.tokenizer.vocab_size:,} tokens, {manifest.dtype})"),
        ("split", Split(**manifest.split.model_dump()).describe()),
        ("train", f"{manifest.train.tokens:,} tokens in {len(manifest.train.shards)} shard(s)"),
        ("eval", f"{manifest.eval.tokens:,} tokens in {len(manifest.eval.shards)} shard(s)"),
        ("on disk", human_bytes((manifest.train.tokens + manifest.eval.tokens) * itemsize)),
        ("time", f"{seconds:.2f} s ({text_bytes / 1e6 / max(seconds, 1e-9):.1f} MB/s of text)"),
        ("digest", manifest.digest[:16]),
    ]
    click.echo(format_table(("prepared", str(out)), rows))
    click.echo(f"train on it with: --set data.prepared={out} --set model.vocab_size={manifest.tokenizer.vocab_size}")


@data.command("train-tokenizer")
@click.argument("paths", nargs=-1, required=True)
@click.option("--vocab-size", required=True, type=click.IntRange(min=2), help="Tokens in the vocabulary.")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="Where the tokenizer.json goes (new).")
@reports_errors
def data_train_tokenizer(paths: tuple[str, ...], vocab_size: int, out: str) -> None:
    """Train a byte-level BPE tokenizer (with <|endoftext|>) on text files, JSONL files or folders."""
    import time

    from p2ploco.data import Sources
    from p2ploco.data.tokenizer import train_bpe_on_sources
    from p2ploco.metrics import format_table, human_bytes

    if Path(out).exists():
        raise ConfigError(f"--out {out} already exists; choose a new file (nothing was written)")
    sources = Sources(paths, origin="PATHS")
    started = time.perf_counter()
    with _progress() as bar:
        reading = bar.add_task("training on", total=sources.file_bytes)
        tokenizer, read = train_bpe_on_sources(
            sources, vocab_size, Path(out), lambda done: bar.update(reading, completed=min(done, sources.file_bytes)))
    seconds = time.perf_counter() - started
    rows = [("text", human_bytes(read)), ("vocabulary", f"{tokenizer.vocab_size:,} tokens"),
            ("end of text", f"id {tokenizer.eot}"), ("time", f"{seconds:.1f} s")]
    click.echo(format_table(("tokenizer", out), rows))
    if tokenizer.vocab_size < vocab_size:
        click.echo(f"note: the vocabulary has {tokenizer.vocab_size:,} tokens, not the {vocab_size:,} asked for: the "
                   f"text offers no more merges; train on more text for a larger one")
    click.echo(f"use it with: --set data.tokenizer={out} --set model.vocab_size={tokenizer.vocab_size}, "
               f"or p2ploco data prepare PATHS... --tokenizer {out} --out DIR")
