"""Own data at pre-training scale: prepare throughput, shard sizes, and a training node's peak memory.

Generates a text corpus of ``--size-mb`` (1 GB by default: the standard library's source repeated,
each copy with its letters rotated by the copy number, so that no two copies are alike) and a
small one of ``--small-mb`` under a temporary folder, and deletes both at the end. Then:

- ``p2ploco data prepare`` on each (byte-level; and a BPE tokenizer trained on the small corpus,
  on the first ``--bpe-mb`` of the large one), as separate processes: seconds, MB/s of text,
  shards, and the process's peak RSS;
- one real training node (``p2ploco node start``, alone, on loopback, ``--rounds`` rounds of
  configs/tiny.yaml) per corpus: its peak RSS (the node process's high-water mark, from wait4),
  with the prepared corpora (memory-mapped) and, for contrast, with the small and a 10x larger
  text read into memory through ``data.paths``.

    python benchmarks/data.py                        # 1 GB; takes a few minutes on 2 cores
    python benchmarks/data.py --size-mb 100 --bpe-mb 10 --rounds 2
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sysconfig
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from p2ploco.data import read_manifest
from p2ploco.launch import TINY_CONFIG, cli
from p2ploco.metrics import format_table, human_bytes

LOWER = b"abcdefghijklmnopqrstuvwxyz"
UPPER = LOWER.upper()


def stdlib_text() -> bytes:
    root = Path(sysconfig.get_paths()["stdlib"])
    return b"".join(path.read_bytes() for path in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py"))
                    if "site-packages" not in path.parts)


def write_corpus(folder: Path, size: int, base: bytes, first_copy: int = 0) -> Path:
    """``size`` bytes of text in files of one varied copy of ``base`` each."""
    folder.mkdir(parents=True)
    written, copy = 0, first_copy
    while written < size:
        shift = copy % 25 + 1
        table = bytes.maketrans(LOWER + UPPER, LOWER[shift:] + LOWER[:shift] + UPPER[shift:] + UPPER[:shift])
        text = base.translate(table)[: size - written]
        (folder / f"copy-{copy:04d}.txt").write_bytes(text)
        written += len(text)
        copy += 1
    return folder


@dataclass
class Run:
    seconds: float
    peak_rss: int  # bytes
    output: str


def run_measured(argv: list[str], log: Path, timeout: float) -> Run:
    """Run a process in a session of its own; its peak RSS comes from wait4 (the kernel's high-water mark).
    Past ``timeout`` its whole session is killed."""
    started = time.perf_counter()
    with log.open("w") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    watchdog = threading.Timer(timeout, os.killpg, (process.pid, signal.SIGKILL))
    watchdog.start()
    try:
        _, status, usage = os.wait4(process.pid, 0)
    finally:
        watchdog.cancel()
    process.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
    try:
        os.killpg(process.pid, signal.SIGKILL)  # anything left in its session (a p2p daemon)
    except ProcessLookupError:
        pass
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[2:5])} exited with {process.returncode}; see {log}:\n"
                           f"{log.read_text()[-2000:]}")
    return Run(time.perf_counter() - started, usage.ru_maxrss * 1024, log.read_text())


def mb(n: float) -> str:
    return f"{n / 1e6:,.0f} MB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mb", type=float, default=1024, help="the large generated corpus (MB of text)")
    parser.add_argument("--small-mb", type=float, default=10, help="the small generated corpus (MB of text)")
    parser.add_argument("--bpe-mb", type=float, default=100, help="text prepared with a BPE tokenizer (0: skip)")
    parser.add_argument("--bpe-vocab", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=3, help="outer rounds each measured node trains")
    parser.add_argument("--workdir", help="where the generated corpora go [a new folder under /tmp]")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="p2ploco-data-bench-", dir=args.workdir or "/tmp"))
    try:
        report(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def report(args: argparse.Namespace, work: Path) -> None:
    base = stdlib_text()
    large_bytes, small_bytes = int(args.size_mb * 1e6), int(args.small_mb * 1e6)
    t = time.perf_counter()
    large = write_corpus(work / "large", large_bytes, base)
    small = write_corpus(work / "small", small_bytes, base, first_copy=1000)
    plain = write_corpus(work / "plain10x", 10 * small_bytes, base, first_copy=2000)
    print(f"generated {mb(large_bytes)} + {mb(small_bytes)} + {mb(10 * small_bytes)} of text in {work} "
          f"({time.perf_counter() - t:.0f} s)\n", flush=True)

    prepares = [("small", small, ""), ("large", large, "")]
    if args.bpe_mb:
        bpe_text = write_corpus(work / "bpe", int(args.bpe_mb * 1e6), base, first_copy=3000)
        run_measured(cli("data", "train-tokenizer", str(small), "--vocab-size", str(args.bpe_vocab), "--out",
                         str(work / "bpe.json")), work / "train-tokenizer.log", 1800)
        prepares.append(("bpe", bpe_text, str(work / "bpe.json")))
    rows, prepared = [], {}
    for name, folder, tokenizer in prepares:
        out = work / f"prepared-{name}"
        with_tokenizer = ["--tokenizer", tokenizer] if tokenizer else []
        argv = cli("data", "prepare", str(folder), "--out", str(out), *with_tokenizer)
        run = run_measured(argv, work / f"prepare-{name}.log", 3600)
        manifest = read_manifest(out)
        text = manifest.split.bytes
        sizes = [(out / s.file).stat().st_size for side in (manifest.train, manifest.eval) for s in side.shards]
        seconds = float(re.search(r"time\s+([\d.]+) s", run.output).group(1))  # as the command measured it
        rows.append((f"{mb(text)} ({name})", "byte-level" if not tokenizer else f"BPE {manifest.tokenizer.vocab_size}",
                     f"{manifest.train.tokens + manifest.eval.tokens:,}", f"{len(manifest.train.shards)} + "
                     f"{len(manifest.eval.shards)}", human_bytes(max(sizes)), human_bytes(sum(sizes)),
                     f"{seconds:.2f}", f"{text / 1e6 / max(seconds, 0.01):.1f}", f"{run.seconds:.1f}",
                     mb(run.peak_rss)))
        prepared[name] = out
        print(f"prepared {name} in {run.seconds:.1f} s", flush=True)
    print("\nPrepare (p2ploco data prepare, one process each: listing, tokenizing, writing and hashing the shards; "
          "wall s adds the process's start-up)")
    print(format_table(("text", "tokenizer", "tokens", "shards (train + eval)", "largest shard", "on disk",
                        "seconds", "MB/s", "wall s", "peak RSS"), rows))

    nodes = [("prepared", f"data.prepared={prepared['small']}", small_bytes),
             ("prepared", f"data.prepared={prepared['large']}", large_bytes),
             ("data.paths (in memory)", f"data.paths={small}", small_bytes),
             ("data.paths (in memory)", f"data.paths={plain}", 10 * small_bytes)]
    rows, peaks = [], {}
    for i, (kind, setting, text) in enumerate(nodes):
        argv = cli("node", "start", "--config", str(TINY_CONFIG), "--run-id", f"data-bench-{i}", "--max-rounds",
                   str(args.rounds), "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--log-dir", str(work / f"node-{i}"),
                   "--set", setting)
        run = run_measured(argv, work / f"node-{i}.log", 1800)
        tokens = re.search(r"(\S+ train / \S+ eval tokens)", run.output)
        rows.append((kind, mb(text), tokens.group(1) if tokens else "-", f"{run.seconds:.1f}", mb(run.peak_rss)))
        peaks[(kind, text)] = run.peak_rss
        print(f"node on {kind} {mb(text)}: peak RSS {mb(run.peak_rss)}", flush=True)
    print(f"\nA training node's peak RSS (configs/tiny.yaml, {args.rounds} rounds, alone on loopback)")
    print(format_table(("data", "text", "tokens", "wall s", "peak RSS"), rows))
    difference = peaks[("prepared", large_bytes)] - peaks[("prepared", small_bytes)]
    print(f"\nprepared {mb(large_bytes)} against prepared {mb(small_bytes)}: {difference / 1e6:+.0f} MB of peak RSS "
          f"(target: within ~100 MB)")


if __name__ == "__main__":
    main()
