"""Whether a step is being prepared for CUDA-graph capture, and the error for what cannot be captured.

A leaf module: the sharding runtime and the offload engine ask it (during the warm-up steps, so that what
cannot be captured fails eagerly with a clear message instead of corrupting or hanging a capture), and
``shardfuse._capture`` sets it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

_depth = 0  # process-wide, not per thread: autograd runs backward hooks on threads of its own


class CaptureError(RuntimeError):
    """The step cannot be captured into a CUDA graph (the message says what and how to fix it)."""


@contextlib.contextmanager
def preparing_capture() -> Iterator[None]:
    """Mark the warm-up and capture of a step."""
    global _depth
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1


def is_preparing_capture() -> bool:
    """True while :func:`preparing_capture` is active."""
    return _depth > 0


def refuse_in_capture(what: str, fix: str) -> None:
    """Raise :class:`CaptureError` for ``what`` while a capture is being prepared; nothing otherwise."""
    if _depth > 0:
        raise CaptureError(f"shardfuse.capture_step cannot capture {what}: {fix}")
