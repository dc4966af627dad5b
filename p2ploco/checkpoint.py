"""Checkpoints: all a node needs to continue, written atomically, refused when corrupt or foreign.

A checkpoint directory holds ``state-<round>.safetensors`` files (tensors under ``param/``, ``shared/`` and
``local/``) and ``checkpoint.json``, which lists the last ``KEEP`` of them, newest first: each with its round,
file name and sha256, the parameters' hash and JSON-able extras; and the run and config fingerprint they are of.
A save writes the tensor file, then the list with it first (both to temporary names, synced and renamed), and
only then deletes the files the list no longer names: a crash at any moment leaves a list whose files are all
there, and a torn or edited file is caught by its checksum.

Every node keeps the last ``KEEP`` = 3 rounds: the stages of a pipeline group stopped at once may write their exit
checkpoints a round apart, but their periodic ones are of the same rounds, so ``p2ploco export`` finds a round all
stages hold; and a node whose newest checkpoint is corrupt resumes from the intact one beside it (``load``). A
checkpoint is about 16 bytes a parameter (params, error feedback, AdamW's two moments): at 150M, 2.4 GB each and
about 7 GB for three.

A checkpoint is written and read tensor by tensor (``tensorfile.py``): neither a save nor a load holds the file
whole, or a second copy of the state. A running node saves through ``BackgroundSaver``: the local state, which
the next inner steps write in place, is written at once on the node's thread (the checkpoint is the state of that
moment: at 150M, 1.8 GB into the page cache, about a second), and the global params and shared state, which are
never written in place, are written and synced on a thread of its own while the next round trains. A load reads
the params and shared state (which a node takes as they are) and leaves the local section in the file, each tensor
a ``tensorfile.Deferred`` read when the node takes it: a node resuming never holds its error feedback twice, nor
its optimizer's moments beside a model still being built.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

from p2ploco.errors import CheckpointError
from p2ploco.metrics import params_sha256
from p2ploco.tensorfile import Deferred, TensorWriter, file_sha256
from p2ploco.tensorfile import read as read_tensors

FORMAT = 2  # 1 (still read): the pointer named one checkpoint, its fields at the top level
POINTER = "checkpoint.json"
KEEP = 3  # checkpoints a directory keeps, of the last rounds saved
SECTIONS = ("param", "shared", "local")


@dataclass
class Checkpoint:
    round: int  # the next round to train
    params: dict[str, torch.Tensor]  # the global parameters
    shared: dict[str, torch.Tensor]  # outer state all peers hold alike (DiLoCo momentum)
    # this peer's own state (error feedback, inner optimizer); a Deferred one is made when written (a copy of live
    # state in another layout) or taken (one read from a loaded checkpoint's file)
    local: dict[str, torch.Tensor | Deferred]
    extras: dict[str, Any] = field(default_factory=dict)  # JSON-able odds and ends (optimizer settings)


def _write_atomically(path: Path, data: bytes) -> None:
    temporary = path.with_name(path.name + f".tmp-{os.getpid()}")
    with open(temporary, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)


class _Saving:
    """One checkpoint being written, tensor by tensor (``tensorfile.TensorWriter``): its local section first (the
    state the next steps write in place), then the global params and shared state (never written in place: a
    published state), then the list."""

    def __init__(self, directory: Path, checkpoint: Checkpoint):
        directory.mkdir(parents=True, exist_ok=True)
        self.directory, self.checkpoint = directory, checkpoint
        self.path = directory / f"state-{checkpoint.round}.safetensors"
        self.temporary = self.path.with_name(self.path.name + f".tmp-{os.getpid()}")
        self.file = open(self.temporary, "wb")  # noqa: SIM115 (closed by finish or abandon)
        try:
            self.writer = TensorWriter(self.file, [(f"{section}/{name}", tensor) for section, tensors in
                                                   zip(("local", "param", "shared"),
                                                       (checkpoint.local, checkpoint.params, checkpoint.shared))
                                                   for name, tensor in tensors.items()])
        except BaseException:
            self.abandon()
            raise

    def write_local(self) -> None:
        """Write the local section (its deferred tensors made one at a time), and let its tensors go."""
        try:
            self.writer.write(len(self.checkpoint.local))
        except BaseException:
            self.abandon()
            raise
        self.checkpoint.local.clear()

    def abandon(self) -> None:
        self.file.close()
        self.temporary.unlink(missing_ok=True)

    def finish(self, run_id: str, fingerprint: str) -> Path:
        """Write the rest, then the list with this checkpoint first; the oldest beyond ``KEEP`` are deleted."""
        try:
            self.writer.write()
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()
        except BaseException:
            self.abandon()
            raise
        # Written over a file of the same round the list still names: a crash before the list below is written
        # leaves that entry failing its checksum, and ``load`` resumes from the one before it.
        os.replace(self.temporary, self.path)
        checkpoint, directory = self.checkpoint, self.directory
        entry = {"round": checkpoint.round, "file": self.path.name, "sha256": self.writer.sha256.hexdigest(),
                 "params_sha256": params_sha256(list(checkpoint.params), checkpoint.params.values()),
                 "saved_at": time.time(), "extras": checkpoint.extras}
        older = [e for e in _entries(directory) if e["round"] != checkpoint.round] if exists(directory) else []
        listed = [entry, *older][:KEEP]
        pointer = {"format": FORMAT, "run_id": run_id, "fingerprint": fingerprint, "checkpoints": listed}
        _write_atomically(directory / POINTER, json.dumps(pointer, indent=1).encode())
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        for stale in directory.glob("state-*.safetensors"):
            if stale.name not in {e["file"] for e in listed}:
                stale.unlink(missing_ok=True)
        return self.path


def save(directory: Path, checkpoint: Checkpoint, run_id: str, fingerprint: str) -> Path:
    """Write ``checkpoint`` to ``directory``, first in its list; the oldest beyond ``KEEP`` are deleted. A round
    saved again (a node's exit checkpoint at the round of its last periodic one) replaces its entry."""
    return _Saving(directory, checkpoint).finish(run_id, fingerprint)


class BackgroundSaver:
    """Saves a node's checkpoints to ``directory`` one at a time: the local state (error feedback, AdamW's moments,
    which the next steps write in place) on the caller's thread before it goes on, the global params and shared
    state (a published state: never written in place) on a background thread. Nothing is copied to do so."""

    def __init__(self, directory: Path, run_id: str, fingerprint: str):
        self.directory, self.run_id, self.fingerprint = directory, run_id, fingerprint
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="checkpoint")
        self._writing: Future[Path] | None = None

    def save(self, checkpoint: Checkpoint) -> None:
        """Start saving ``checkpoint`` (after the previous save has finished); it returns once the local state is
        written, and the rest is written in the background."""
        self.wait()
        saving = _Saving(self.directory, Checkpoint(checkpoint.round, dict(checkpoint.params),
                                                    dict(checkpoint.shared), dict(checkpoint.local),
                                                    json.loads(json.dumps(checkpoint.extras))))
        saving.write_local()
        self._writing = self._thread.submit(saving.finish, self.run_id, self.fingerprint)

    def wait(self) -> Path | None:
        """Wait for the save under way; the path it wrote (None if none was under way). Its error, if it failed."""
        writing, self._writing = self._writing, None
        return writing.result() if writing is not None else None

    def close(self) -> None:
        """Finish the save under way and stop the thread (its error, if it failed, is raised)."""
        try:
            self.wait()
        finally:
            self._thread.shutdown()


def _read_pointer(directory: Path) -> dict[str, Any]:
    try:
        pointer = json.loads((directory / POINTER).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{directory / POINTER} is unreadable or corrupt ({e}); "
                              f"remove it or resume from another --log-dir") from None
    if not isinstance(pointer, dict):
        raise CheckpointError(f"{directory / POINTER} is corrupt: not a JSON object")
    return pointer


def _entries(directory: Path, pointer: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The checkpoints ``directory``'s pointer lists, newest first, each with a sound round and file name."""
    pointer = _read_pointer(directory) if pointer is None else pointer
    if pointer.get("format") not in (1, FORMAT):
        raise CheckpointError(f"{directory / POINTER} has format {pointer.get('format')!r}; this p2ploco reads "
                              f"formats 1 to {FORMAT}")
    entries = ([{key: value for key, value in pointer.items() if key not in ("format", "run_id", "fingerprint")}]
               if pointer["format"] == 1 else pointer.get("checkpoints"))
    if (not isinstance(entries, list) or not entries
            or not all(isinstance(e, dict) and isinstance(e.get("round"), int) and isinstance(e.get("file"), str)
                       and "/" not in e["file"] for e in entries)):
        raise CheckpointError(f"{directory / POINTER} is corrupt: bad 'file' or 'round' field")
    return entries


def exists(directory: Path) -> bool:
    return (directory / POINTER).exists()


def rounds(directory: Path) -> list[int]:
    """The rounds of the checkpoints in ``directory``, newest first (not verified: ``load`` verifies one)."""
    return [e["round"] for e in _entries(directory)]


def load(directory: Path, run_id: str | None, fingerprint: str | None, round_index: int | None = None,
         skipped: Callable[[str], None] = lambda line: None) -> Checkpoint:
    """The checkpoint of round ``round_index`` in ``directory``, fully verified; CheckpointError (one line) if it is
    not listed or not intact. ``round_index`` None: the newest intact one; each newer one that is not is left in
    place and told to ``skipped`` (one line). ``run_id`` and ``fingerprint`` None: of whichever run wrote it (a
    reader such as ``p2ploco export``, not a node resuming)."""
    if not exists(directory):
        raise CheckpointError(f"no checkpoint in {directory}: pass the --log-dir (and --identity) of the run "
                              f"to resume, or start without --resume")
    pointer = _read_pointer(directory)
    entries = _entries(directory, pointer)
    if run_id is not None and (pointer.get("run_id") != run_id or pointer.get("fingerprint") != fingerprint):
        raise CheckpointError(f"the checkpoint in {directory} is from run {pointer.get('run_id')!r} with config "
                              f"{pointer.get('fingerprint')}, not run {run_id!r} with {fingerprint}: use that run's "
                              f"config and --run-id, or start without --resume")
    if round_index is not None:
        chosen = [e for e in entries if e["round"] == round_index]
        if not chosen:
            raise CheckpointError(f"{directory} holds no checkpoint of round {round_index} (it holds round(s) "
                                  f"{', '.join(str(e['round']) for e in entries)})")
        return _verified(directory, chosen[0])
    failures: list[CheckpointError] = []
    for entry in entries:
        try:
            found = _verified(directory, entry)
        except CheckpointError as e:
            failures.append(e)
            continue
        for failure, bad in zip(failures, entries):
            skipped(f"skipped the checkpoint of round {bad['round']} ({failure}); resuming from round {found.round}, "
                    f"the newest intact checkpoint in {directory}")
        return found
    older = f" (and the {len(entries) - 1} older one(s) beside it: not intact either)" if len(entries) > 1 else ""
    raise CheckpointError(f"{failures[0]}{older}")


def _verified(directory: Path, entry: dict[str, Any]) -> Checkpoint:
    """The checkpoint ``entry`` of ``directory``'s pointer lists, its file checked against the entry's hashes."""
    name = entry["file"]
    try:
        sha256 = file_sha256(directory / name)
    except OSError as e:
        raise CheckpointError(f"checkpoint file {directory / name} is missing or unreadable ({e.strerror})") from None
    if sha256 != entry.get("sha256"):
        raise CheckpointError(f"checkpoint file {directory / name} is corrupt (checksum mismatch)")
    try:
        tensors = read_tensors(directory / name, deferred=lambda key: key.startswith("local/"))
    except (SafetensorError, ValueError, TypeError, OverflowError, OSError) as e:  # what safetensors raises on garbage
        raise CheckpointError(f"checkpoint file {directory / name} is corrupt ({e})") from None
    sections: dict[str, dict[str, torch.Tensor | Deferred]] = {s: {} for s in SECTIONS}
    for key, tensor in tensors.items():
        section, _, tensor_name = key.partition("/")
        if section not in sections:
            raise CheckpointError(f"checkpoint file {directory / name} holds an unknown tensor {key!r}")
        sections[section][tensor_name] = tensor
    checkpoint = Checkpoint(entry["round"], sections["param"], sections["shared"], sections["local"],
                            entry.get("extras") or {})
    if params_sha256(list(checkpoint.params), checkpoint.params.values()) != entry.get("params_sha256"):
        raise CheckpointError(f"checkpoint file {directory / name} is inconsistent: its parameters do not match "
                              f"their hash")
    return checkpoint
