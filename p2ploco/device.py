"""Where a worker's outer work runs next to its inner steps: a CUDA side stream and pinned host copies, or, on
the CPU, simply in order.

The inner steps keep the device's current stream busy. Outer work (a pseudo-gradient, its compression, the
copy of a new global state to the device) that a round schedule hands to its background thread runs on a
side stream of its own, so the GPU never idles for it; events order the two streams where one reads what the
other wrote. Results go to the host through pinned buffers with asynchronous copies, waited for once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch


class SideStream:
    """The stream a worker's background outer work runs on (None on the CPU: there, work runs in order)."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def mark(self) -> torch.cuda.Event | None:
        """An event on the calling thread's current stream: what was queued on it so far (None on the CPU)."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    @contextlib.contextmanager
    def running(self, after: torch.cuda.Event | None = None) -> Iterator[None]:
        """Run the block's device work on the side stream, after ``after`` (a ``mark`` of the main stream)."""
        if self.stream is None:
            yield
            return
        with torch.cuda.stream(self.stream):
            if after is not None:
                self.stream.wait_event(after)
            yield

    def holds(self, tensors: Sequence[torch.Tensor]) -> None:
        """``tensors``, made on another stream, are used on the side stream too: the caching allocator must not
        hand their memory out again before the side stream is done with them."""
        if self.stream is not None:
            for tensor in tensors:
                if tensor.device.type == "cuda":
                    tensor.record_stream(self.stream)

    def done(self) -> torch.cuda.Event | None:
        """An event on the side stream: what was queued on it so far (for the main stream to wait on)."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event


def wait_for(event: torch.cuda.Event | None, tensors: Sequence[torch.Tensor] = ()) -> None:
    """Make the calling thread's current stream wait for ``event`` (a ``SideStream.done``) before it uses
    ``tensors``, which the side stream made (and which the allocator must then keep for this stream too); no-op
    on the CPU."""
    if event is not None:
        stream = torch.cuda.current_stream()
        stream.wait_event(event)
        for tensor in tensors:
            if tensor.device.type == "cuda":
                tensor.record_stream(stream)


def to_host(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """CPU copies of ``tensors``: from CUDA through pinned buffers, asynchronously, then one wait on the current
    stream; CPU tensors come back as they are."""
    on_device = [t for t in tensors if t.device.type == "cuda"]
    if not on_device:
        return list(tensors)
    copies = []
    for tensor in tensors:
        if tensor.device.type == "cuda":
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            copies.append(host)
        else:
            copies.append(tensor)
    torch.cuda.current_stream().synchronize()
    return copies


def to_device(tensors: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """``tensors`` on ``device``: host tensors are pinned first so that the copies run asynchronously on the
    current stream (the same tensors on the CPU)."""
    if device.type != "cuda":
        return [t.to(device) for t in tensors]
    return [t.pin_memory().to(device, non_blocking=True) if t.device.type == "cpu" else t.to(device)
            for t in tensors]
