"""Safetensors files written and read tensor by tensor: a model's state is never held twice to store or load it.

safetensors' ``save`` builds the whole file as one ``bytes`` and ``load`` parses one: at 150M parameters a
checkpoint's 2.4 GB twice over. Here the header is built from the tensors' names, dtypes and shapes, and each
tensor's bytes go straight from its storage to the file (and to the file's sha256, on the way); a reader hashes
the file in chunks and takes each tensor from it alone. The layout is safetensors' own (an 8-byte little-endian
header length; the header, compact JSON padded with spaces to 8 bytes; the tensors' bytes in the header's order),
so any safetensors reader reads these files, and for float32 tensors listed by sorted name the bytes are those
``save`` writes (a state blob, ``swarm/state.py``, is served so). A tensor kept in another layout than the one
written (SparseLoCo's error feedback, in chunk order) is a ``Deferred``: converted when its turn comes, so that one
tensor's copy exists at a time, never the whole state's; and a reader may leave tensors in the file as ``Deferred``
ones, each read when it is taken (a checkpoint's local section, copied into live buffers one at a time).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import BinaryIO

import torch
from safetensors import safe_open

DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL"}
DTYPE_OF = {name: dtype for dtype, name in DTYPES.items()}
READ_CHUNK = 8 << 20  # bytes hashed at a time when a file is checked


@dataclass(frozen=True)
class Deferred:
    """A tensor of ``shape`` and ``dtype`` that ``make`` builds (a fresh tensor each call) when it is written, or,
    read from a file (``read``), when it is taken."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    make: Callable[[], torch.Tensor]

    def __deepcopy__(self, memo: dict) -> torch.Tensor:
        """The tensor, made now: a deep copy of a checkpoint holds its state as of the copy, as one written does."""
        return self.make()


def made(tensor: torch.Tensor | Deferred) -> torch.Tensor:
    """``tensor``, or the tensor it defers."""
    return tensor.make() if isinstance(tensor, Deferred) else tensor


def header(entries: Sequence[tuple[str, torch.dtype, tuple[int, ...]]]) -> bytes:
    """The 8-byte length and the header of a file of tensors ``(name, dtype, shape)``, their bytes in this order."""
    described, at = {}, 0
    for name, dtype, shape in entries:
        size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        described[name] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [at, at + size]}
        at += size
    text = json.dumps(described, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def raw_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, in place."""
    return memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy())


class TensorWriter:
    """Writes one safetensors file of ``tensors`` (name -> tensor, in file order) to ``file``, its header first,
    then each tensor as ``write`` is called for it (in the same order), hashing all of it on the way: a tensor is
    copied only to move it off an accelerator or to make it contiguous (or made, if ``Deferred``), one at a time."""

    def __init__(self, file: BinaryIO, tensors: Iterable[tuple[str, torch.Tensor | Deferred]]):
        self.file, self.sha256 = file, hashlib.sha256()
        self.pending = list(tensors)
        self._put(header([(name, t.dtype, tuple(t.shape)) for name, t in self.pending]))

    def _put(self, data: bytes | memoryview) -> None:
        self.file.write(data)
        self.sha256.update(data)

    def write(self, count: int | None = None) -> None:
        """Write the next ``count`` tensors (None: all that are left)."""
        count = len(self.pending) if count is None else count
        for _, tensor in self.pending[:count]:
            self._put(raw_bytes(made(tensor).detach().to("cpu").contiguous()))
        del self.pending[:count]


def file_sha256(path) -> str:
    """The sha256 of the file at ``path``, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(READ_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def read(path, deferred: Callable[[str], bool] = lambda name: False) -> dict[str, torch.Tensor | Deferred]:
    """The tensors of the safetensors file at ``path``, each read from it alone; those ``deferred`` names are read
    when made (``Deferred``: the file is opened again for each, so that none of it stays mapped), the rest now. What
    safetensors raises on a file that is not one (SafetensorError, ValueError, ...) goes to the caller; a deferred
    tensor's read, to whoever makes it."""
    with safe_open(str(path), framework="pt") as f:
        tensors: dict[str, torch.Tensor | Deferred] = {}
        for name in f.keys():  # noqa: SIM118 (safe_open is no mapping)
            if deferred(name):
                described = f.get_slice(name)
                dtype = DTYPE_OF.get(described.get_dtype())
                if dtype is None:
                    raise ValueError(f"tensor {name!r} has a dtype this reader does not take: {described.get_dtype()}")
                tensors[name] = Deferred(tuple(described.get_shape()), dtype, functools.partial(_read_one, path, name))
            else:
                tensors[name] = f.get_tensor(name)
        return tensors


def _read_one(path, name: str) -> torch.Tensor:
    with safe_open(str(path), framework="pt") as f:
        return f.get_tensor(name)
