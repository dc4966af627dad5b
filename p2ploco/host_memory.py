"""The host's memory: how much a run's model needs of it, and its allocator, set for a training process.

An inner step frees its gradients and activations and allocates them again at the next step. glibc's malloc hands
chunks above its mmap threshold to the kernel on free, and trims the top of its heap once that much is free, so on
a CPU each step pays for page faults on memory it had a moment ago (the 21.4M model's inner loop ran at 0.90x a bare
loop's in the node, which also holds the outer state; with the thresholds raised, at 0.92-1.03x across runs, as
near as this machine's noise tells: docs/design.md, "A node at the speed of plain PyTorch"). A training process
keeps what it freed instead: it needs the same memory again, in one heap for all its threads (``ARENAS``).

**What a node holds, per parameter, in fp32.** On a CPU: 24 bytes at the least (``HOST_BYTES_PER_PARAMETER``: the
model's params, their gradients, AdamW's two moments, the global copy, the outer algorithm's buffer); a whole run
at 150M peaks at 31-32 (``benchmarks/memory.py`` measures it per phase; docs/design.md, "A node's memory"): the state
a node serves is read range by range from the published tensors (``swarm/state.py``'s ``TensorBlob``), the round
before it from the next one's tensors with what its sparse step changed put back (``PatchedBlob``); a joiner writes
each checked range of its download into the tensors it then trains from; checkpoints are written and read tensor
by tensor (``tensorfile.py``), the local state on the node's thread (the error feedback converted to the parameters'
shapes one tensor at a time), the published state (never written in place) beside the next round. An outer step
builds its new global tensors out of place (4 bytes) once the inner steps have let their gradients go (4 bytes), and
the freed heap goes back to the kernel as it begins (``give_back_freed``). What is above the floor is the process's
own (torch, Python, the data: about half a gigabyte, 3 bytes a parameter at 150M, a larger share of a small model),
the updates and the patched round a node keeps for peers catching up (about 2 at 150M), and the all-reduce's
buffers beside the step.

Beside an accelerator (CUDA), which holds the params, gradients, AdamW's moments and SparseLoCo's error feedback,
the host holds the global copy and the outer state that is not on the device (DiLoCo's momentum): 4 to 8 bytes a
parameter (``ACCELERATOR_HOST_BYTES_PER_PARAMETER`` counts 8), and at its peak, while an outer step builds the new
global state out of place (4 more; with momentum, 8 more), about 12 to 16. Tensors moved off the device to be
written (the error feedback, AdamW's moments) are moved one at a time. So the global copy
and its out-of-place step dominate a GPU node's host memory; by the code's reasoning, not measured (no device was
lent when this was written).
"""

from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8  # mallopt's parameters (malloc.h)
# Bytes of fp32 training state per parameter that a node holds in host memory at the least: on the CPU its params,
# gradients, AdamW's two moments, the global copy and the outer algorithm's buffer; beside an accelerator, which holds
# the first four, the last two.
HOST_BYTES_PER_PARAMETER = {"cpu": 24}
ACCELERATOR_HOST_BYTES_PER_PARAMETER = 8
MMAP_THRESHOLD = 32 << 20  # bytes: glibc's largest on 64-bit; chunks above it are mapped and unmapped alone
TRIM_THRESHOLD = 1 << 30  # bytes free at the heap's top before it is given back
# One heap for every thread: memory a thread frees (the event loop's all-reduce buffers, a checkpoint thread's) is
# memory the training thread reuses, rather than kept in an arena of the thread's own (glibc makes up to 8 a core).
# At 150M, two trainers and a joiner: 46-49 bytes a parameter at the peak with glibc's arenas, 40-41 with one
# (benchmarks/memory.py, before the state of the round before was let go at the round's end).
ARENAS = 1


def keep_freed_memory() -> None:
    """Raise glibc's mmap and trim thresholds for this process (fixed: glibc's dynamic threshold is off then); where
    the C library is not glibc, its allocator is left as it is."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return
    mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    mallopt(M_ARENA_MAX, ARENAS)


def give_back_freed() -> None:
    """Hand the kernel the pages of this process's free heap memory (glibc's ``malloc_trim``, which returns free
    pages inside the heap too, not only at its top). The thresholds above keep what a step frees for the next step;
    at the three points of a round where a share of the model's size has just been let go (the inner steps'
    gradients and activations, as they end; the all-reduce's buffers, before the step is prepared; what the step let
    go of, before the diff of the new state: ``Swarm.serve_state``) it would otherwise stay resident under the outer
    step's new tensors and that diff, at the round's peak (150M: 34-37 bytes a parameter with none, 32-35 with the
    last alone, 31 with all three: ``benchmarks/memory.py``). The next inner step faults in again what it needs.
    Where the C library is not glibc, nothing."""
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


def total_memory() -> int:
    """Bytes of this machine's physical memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def host_bytes_needed(parameters: int, device: str) -> int:
    """The least host memory a node training a model of ``parameters`` on a device of kind ``device`` holds."""
    return parameters * HOST_BYTES_PER_PARAMETER.get(device, ACCELERATOR_HOST_BYTES_PER_PARAMETER)
