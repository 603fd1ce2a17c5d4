"""CUDA side streams and events for the sharding data path; every helper is a no-op on CPU.

The all-gather stream rebuilds full parameters ahead of the compute stream; the post-backward stream runs
the gradient reduction behind it. Nothing here synchronises the host.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class Streams:
    """The side streams of one root and its nested units (``None`` members on CPU)."""

    def __init__(self, device: torch.device) -> None:
        """Create the side streams on ``device`` (high priority, so communication is issued promptly)."""
        self.device = device
        self.is_cuda = device.type == "cuda"
        if self.is_cuda:
            self.all_gather: torch.cuda.Stream | None = torch.cuda.Stream(device=device, priority=-1)
            self.post_backward: torch.cuda.Stream | None = torch.cuda.Stream(device=device, priority=-1)
        else:
            self.all_gather = None
            self.post_backward = None

    def current(self) -> torch.cuda.Stream | None:
        """The stream the caller's kernels go to now (the compute stream), or None on CPU."""
        return torch.cuda.current_stream(self.device) if self.is_cuda else None


@contextlib.contextmanager
def use_stream(stream: torch.cuda.Stream | None) -> Iterator[None]:
    """Make ``stream`` current inside the block (nothing on CPU)."""
    if stream is None:
        yield
        return
    with torch.cuda.stream(stream):
        yield


def record_event(stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
    """Record a fresh event on ``stream`` (None on CPU)."""
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event


def wait_event(stream: torch.cuda.Stream | None, event: torch.cuda.Event | None) -> None:
    """Make ``stream`` wait for ``event`` on the device, without blocking the host."""
    if stream is not None and event is not None:
        stream.wait_event(event)


def wait_stream(waiter: torch.cuda.Stream | None, target: torch.cuda.Stream | None) -> None:
    """Make ``waiter`` wait for all work queued so far on ``target`` (device-side only)."""
    if waiter is not None and target is not None and waiter != target:
        if torch.cuda.is_current_stream_capturing() and _capturing(waiter) and not _capturing(target):
            # Under CUDA-graph capture a side stream that got no work in this capture (no reduce-scatter
            # in a no_sync() micro-step) is outside the graph: nothing of it to wait for, and waiting on it
            # would be an error (cudaErrorStreamCaptureIsolation).
            return
        waiter.wait_stream(target)


def _capturing(stream: torch.cuda.Stream) -> bool:
    with torch.cuda.stream(stream):
        return torch.cuda.is_current_stream_capturing()


def current_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The stream the caller's kernels go to now on ``device`` (None on CPU)."""
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


def new_stream(device: torch.device, priority: int = 0) -> torch.cuda.Stream | None:
    """A fresh side stream on ``device`` (None on CPU)."""
    return torch.cuda.Stream(device=device, priority=priority) if device.type == "cuda" else None
