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
    """What :func:`shardfuse.capture_step` cannot capture or replay; the message names it and the fix.

    Raised for CPU offload (``move_params_to_cpu`` / ``cpu_offload`` units, ``OffloadModel``: refused during the
    warm-up, before anything is captured), a step that synchronises the host or steps an optimizer built without
    ``capturable=True`` (the CUDA error's first line, the step's line and the fix are in the message), a call
    whose inputs differ in structure, device or ``requires_grad`` from the example inputs, a new input signature
    past ``max_graphs``, and a call after :meth:`shardfuse.CapturedStep.close`. A ``RuntimeError``; public as
    ``shardfuse.CaptureError``.
    """


# Defined in this leaf module (the runtime imports it without importing the package); public, and printed in
# tracebacks and pickled, as shardfuse.CaptureError.
CaptureError.__module__ = "shardfuse"


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
