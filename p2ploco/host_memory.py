"""The host's memory: how much a run's model needs of it, and its allocator, set for a training process.

An inner step frees its gradients and activations and allocates them again at the next step. glibc's malloc hands
chunks above its mmap threshold to the kernel on free, and trims the top of its heap once that much is free, so on
a CPU each step pays for page faults on memory it had a moment ago (the 21.4M model's inner loop ran at 0.90x a bare
loop's in the node, which also holds the outer state; with the thresholds raised, at 0.92-1.03x across runs, as
near as this machine's noise tells: docs/design.md, "A node at the speed of plain PyTorch"). A training process
keeps what it freed instead: it needs the same memory again.
"""

from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
# Bytes of fp32 training state per parameter that a node holds in host memory at the least: on the CPU its params,
# gradients, AdamW's two moments, the global copy and the outer algorithm's buffer; beside an accelerator, which holds
# the first four, the last two.
HOST_BYTES_PER_PARAMETER = {"cpu": 24}
ACCELERATOR_HOST_BYTES_PER_PARAMETER = 8
MMAP_THRESHOLD = 32 << 20  # bytes: glibc's largest on 64-bit; chunks above it are mapped and unmapped alone
TRIM_THRESHOLD = 1 << 30  # bytes free at the heap's top before it is given back


def keep_freed_memory() -> None:
    """Raise glibc's mmap and trim thresholds for this process (fixed: glibc's dynamic threshold is off then); where
    the C library is not glibc, its allocator is left as it is."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return
    mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)


def total_memory() -> int:
    """Bytes of this machine's physical memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def host_bytes_needed(parameters: int, device: str) -> int:
    """The least host memory a node training a model of ``parameters`` on a device of kind ``device`` holds."""
    return parameters * HOST_BYTES_PER_PARAMETER.get(device, ACCELERATOR_HOST_BYTES_PER_PARAMETER)
