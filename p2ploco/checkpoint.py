"""Checkpoints: all a node needs to continue, written atomically, refused when corrupt or foreign.

A checkpoint directory holds ``state-<round>.safetensors`` (tensors under ``param/``, ``shared/`` and
``local/``) and ``checkpoint.json`` (round, run, config fingerprint, the tensor file's name and
sha256, the parameters' hash, and JSON-able extras). Both files are written to temporary names,
synced and renamed, the JSON last: a crash at any moment leaves the previous checkpoint intact, and a
torn or edited file is caught by its checksum. The previous tensor file is kept until the next save.

A running node saves through ``BackgroundSaver``: the tensors are copied at once (the checkpoint is the
state of that moment) and serialized, written and synced on a thread of its own, since at a few hundred
megabytes that takes seconds the next round's inner steps need not wait for.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from p2ploco.errors import CheckpointError
from p2ploco.metrics import params_sha256

FORMAT = 1
POINTER = "checkpoint.json"
SECTIONS = ("param", "shared", "local")


@dataclass
class Checkpoint:
    round: int  # the next round to train
    params: dict[str, torch.Tensor]  # the global parameters
    shared: dict[str, torch.Tensor]  # outer state all peers hold alike (DiLoCo momentum)
    local: dict[str, torch.Tensor]  # this peer's own state (error feedback, inner optimizer)
    extras: dict[str, Any] = field(default_factory=dict)  # JSON-able odds and ends (optimizer settings)


def _write_atomically(path: Path, data: bytes) -> None:
    temporary = path.with_name(path.name + f".tmp-{os.getpid()}")
    with open(temporary, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)


def save(directory: Path, checkpoint: Checkpoint, run_id: str, fingerprint: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {f"{section}/{name}": tensor.detach().to("cpu").contiguous()
               for section, group in zip(SECTIONS, (checkpoint.params, checkpoint.shared, checkpoint.local))
               for name, tensor in group.items()}
    data = save_tensors(tensors)
    tensor_file = directory / f"state-{checkpoint.round}.safetensors"
    _write_atomically(tensor_file, data)
    pointer = {
        "format": FORMAT, "run_id": run_id, "fingerprint": fingerprint, "round": checkpoint.round,
        "file": tensor_file.name, "sha256": hashlib.sha256(data).hexdigest(),
        "params_sha256": params_sha256(list(checkpoint.params), checkpoint.params.values()),
        "saved_at": time.time(), "extras": checkpoint.extras,
    }
    previous = _read_pointer(directory).get("file") if (directory / POINTER).exists() else None
    _write_atomically(directory / POINTER, json.dumps(pointer, indent=1).encode())
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    for stale in directory.glob("state-*.safetensors"):
        if stale.name not in (tensor_file.name, previous):
            stale.unlink(missing_ok=True)
    return tensor_file


class BackgroundSaver:
    """Saves a node's checkpoints to ``directory`` one at a time, each on a background thread."""

    def __init__(self, directory: Path, run_id: str, fingerprint: str):
        self.directory, self.run_id, self.fingerprint = directory, run_id, fingerprint
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="checkpoint")
        self._writing: Future[Path] | None = None

    def save(self, checkpoint: Checkpoint) -> None:
        """Start saving a copy of ``checkpoint`` (after the previous save has finished)."""
        self.wait()
        frozen = Checkpoint(checkpoint.round, *({name: t.detach().to("cpu", copy=True) for name, t in group.items()}
                                                for group in (checkpoint.params, checkpoint.shared, checkpoint.local)),
                            json.loads(json.dumps(checkpoint.extras)))
        self._writing = self._thread.submit(save, self.directory, frozen, self.run_id, self.fingerprint)

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


def exists(directory: Path) -> bool:
    return (directory / POINTER).exists()


def load(directory: Path, run_id: str | None, fingerprint: str | None) -> Checkpoint:
    """The checkpoint in ``directory``, fully verified; CheckpointError (one line) otherwise. ``run_id`` and
    ``fingerprint`` None: of whichever run wrote it (a reader such as ``p2ploco export``, not a node resuming)."""
    if not exists(directory):
        raise CheckpointError(f"no checkpoint in {directory}: pass the --log-dir (and --identity) of the run "
                              f"to resume, or start without --resume")
    pointer = _read_pointer(directory)
    if pointer.get("format") != FORMAT:
        raise CheckpointError(f"{directory / POINTER} has format {pointer.get('format')!r}; this p2ploco reads "
                              f"format {FORMAT}")
    if run_id is not None and (pointer.get("run_id") != run_id or pointer.get("fingerprint") != fingerprint):
        raise CheckpointError(f"the checkpoint in {directory} is from run {pointer.get('run_id')!r} with config "
                              f"{pointer.get('fingerprint')}, not run {run_id!r} with {fingerprint}: use that run's "
                              f"config and --run-id, or start without --resume")
    name = pointer.get("file")
    if not isinstance(name, str) or "/" in name or not isinstance(pointer.get("round"), int):
        raise CheckpointError(f"{directory / POINTER} is corrupt: bad 'file' or 'round' field")
    try:
        data = (directory / name).read_bytes()
    except OSError as e:
        raise CheckpointError(f"checkpoint file {directory / name} is missing or unreadable ({e.strerror})") from None
    if hashlib.sha256(data).hexdigest() != pointer.get("sha256"):
        raise CheckpointError(f"checkpoint file {directory / name} is corrupt (checksum mismatch)")
    try:
        tensors = load_tensors(data)
    except (SafetensorError, ValueError, TypeError, OverflowError) as e:  # what safetensors raises on garbage
        raise CheckpointError(f"checkpoint file {directory / name} is corrupt ({e})") from None
    sections: dict[str, dict[str, torch.Tensor]] = {s: {} for s in SECTIONS}
    for key, tensor in tensors.items():
        section, _, tensor_name = key.partition("/")
        if section not in sections:
            raise CheckpointError(f"checkpoint file {directory / name} holds an unknown tensor {key!r}")
        sections[section][tensor_name] = tensor
    checkpoint = Checkpoint(pointer["round"], sections["param"], sections["shared"], sections["local"],
                            pointer.get("extras") or {})
    if params_sha256(list(checkpoint.params), checkpoint.params.values()) != pointer.get("params_sha256"):
        raise CheckpointError(f"checkpoint in {directory} is inconsistent: its parameters do not match their hash")
    return checkpoint
