"""Where text comes from: files, JSONL files (an entry a line), folders of them, or the standard library.

A corpus is a sequence of entries (a text file, or one line of a JSONL file), each a name and a text.
It is read twice, in the same order: once for its entries' names and sizes (enough to decide the
train/eval split, and it finds a malformed JSONL line before any tokenizing starts), once for their
text. Names are stable across machines (a path relative to the folder given, a JSONL file and line),
because an entry-level split is decided by them.
"""

from __future__ import annotations

import json
import sysconfig
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from p2ploco.errors import ConfigError

TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst", ".jsonl")


CHUNK_BYTES = 1 << 22  # text files are read this much at a time: a 1 GB file never sits in memory whole


@dataclass(frozen=True)
class Entry:
    name: str  # stable across machines: it decides an entry-level split
    chunks: Iterable[bytes]  # its UTF-8 text, in order (to be read once)


class Sources:
    """The entries of ``data.paths`` (text files, JSONL files, folders of them), or of the standard library."""

    def __init__(self, paths: Sequence[str] = (), origin: str = "data.paths"):
        """``origin`` names where the paths came from in error messages (a config key, a CLI argument)."""
        if paths:
            self.files = [file for given in paths for file in _files_of(given, origin)]
            self.description = ", ".join(paths)
        else:
            root = Path(sysconfig.get_paths()["stdlib"])
            self.files = [(path, path.relative_to(root).as_posix()) for path in sorted(root.rglob("*.py"))
                          if not {"site-packages", "dist-packages", "__pycache__"} & set(path.relative_to(root).parts)]
            self.description = f"Python {sysconfig.get_python_version()} standard library"

    @property
    def file_bytes(self) -> int:
        return sum(path.stat().st_size for path, _ in self.files)

    def sizes(self) -> Iterator[tuple[str, int]]:
        """Each entry's name and size in bytes, without reading text files (JSONL files are parsed)."""
        for path, name in self.files:
            if path.suffix == ".jsonl":
                for entry in _jsonl_entries(path, name):
                    yield entry.name, sum(map(len, entry.chunks))
            else:
                yield name, path.stat().st_size

    def entries(self) -> Iterator[Entry]:
        for path, name in self.files:
            if path.suffix == ".jsonl":
                yield from _jsonl_entries(path, name)
            else:
                yield Entry(name, _chunks_of(path))


def _files_of(given: str, origin: str) -> list[tuple[Path, str]]:
    """(path, entry name) of each file one path of data.paths names."""
    root = Path(given).expanduser()
    if root.is_dir():
        files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
        if not files:
            raise ConfigError(f"{origin}: folder {root} holds no {'/'.join(TEXT_SUFFIXES)} files")
        return [(p, f"{root.name}/{p.relative_to(root).as_posix()}") for p in files]
    if root.is_file():
        return [(root, root.name)]
    raise ConfigError(f"{origin}: {root} does not exist; list text/JSONL files or folders")


def _chunks_of(path: Path) -> Iterator[bytes]:
    with path.open("rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            yield chunk


def _jsonl_entries(path: Path, name: str) -> Iterator[Entry]:
    """One entry per line's "text"; a malformed line stops the reading with its file and line number."""
    with path.open("rb") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                text = json.loads(line)["text"]
            except (ValueError, KeyError, TypeError):
                raise ConfigError(f"{path}:{number}: expected a JSON object with a string field \"text\"; "
                                  f"fix or remove the line") from None
            if not isinstance(text, str):
                raise ConfigError(f"{path}:{number}: field \"text\" must be a string, not "
                                  f"{type(text).__name__}; fix or remove the line")
            yield Entry(f"{name}:{number}", (text.encode("utf-8", errors="replace"),))
