"""What a failed CUDA-graph capture says: the op that failed, the line of the step that called it, and the fix.

A stream capture fails at the first operation it cannot record (a host synchronisation, a copy from pageable
host memory, an optimizer that checks ``capturable``); torch raises there, and the capture's end raises again
with that first error as its context. The first error's traceback still holds the frames of the step: the
innermost frame outside torch and shardfuse is the user's line (the step's own code, or a model library's),
and the innermost frame overall names the library function that raised, when it is Python.
"""

from __future__ import annotations

import os
import re
import sysconfig
import traceback
from types import TracebackType

from shardfuse._graph_guard import CaptureError

HOST_SYNC_HINTS = (
    "anything that waits for the GPU on the host inside the step (.item(), .cpu(), .tolist(), printing a "
    "tensor, Python control flow on a tensor's value, torch.cuda.synchronize()), tensors created on the host "
    "inside the step, or an optimizer without capturable=True"
)

# (where to look: "error" text, the user's "line" or the failing library "function"; pattern; what it is; fix)
_KNOWN: tuple[tuple[str, str, str, str], ...] = (
    ("error", r"capturable", "an optimizer built without capturable=True",
     "build it with capturable=True (fused=True too, for speed): torch.optim.AdamW(..., capturable=True, "
     "fused=True)"),
    ("function", r"capture_health_check", "an optimizer built without capturable=True",
     "build it with capturable=True (fused=True too, for speed)"),
    ("function", r"_tensor_str|__repr__|__format__", "printing a tensor (a host synchronisation)",
     "print the returned values after the call"),
    ("line", r"\.item\(\)|\.tolist\(\)|\.numpy\(\)|\.cpu\(\)|\.to\(['\"]cpu['\"]\)",
     "a host synchronisation (a value read on the host)",
     "return the tensor from step_fn and read it after the call (loss = train_step(batch); loss.item())"),
    ("line", r"^\s*(if|elif|while|assert)\b|\bbool\(",
     "Python control flow on a tensor's value (a data-dependent branch reads the value on the host)",
     "compute both sides and select on the GPU (torch.where), or decide outside step_fn"),
    ("line", r"\bprint\(", "printing a tensor (a host synchronisation)", "print the returned values after the call"),
    ("line", r"synchronize\(", "a synchronisation inside the step", "remove it: replays run in stream order"),
    ("line", r"torch\.(tensor|as_tensor|arange|zeros|ones|full|empty|randn?|randint)\(|\.cuda\(|\.to\(|pin_memory",
     "a tensor made on the host and copied to the GPU inside the step",
     "create it with device=<the GPU>, or once outside step_fn and pass it in"),
)


def _is_library(path: str) -> bool:
    """Whether a frame's file is torch's, shardfuse's or the standard library's (not a user's, nor another
    installed package's such as a model library)."""
    import torch

    path = os.path.realpath(path)
    own = [os.path.dirname(torch.__file__), os.path.dirname(os.path.abspath(__file__))]
    if any(path.startswith(os.path.realpath(d) + os.sep) for d in own):
        return True
    paths = sysconfig.get_paths()
    installed = {os.path.realpath(paths[k]) + os.sep for k in ("purelib", "platlib")}
    if any(path.startswith(d) for d in installed) or "site-packages" in path or "dist-packages" in path:
        return False
    return path.startswith(os.path.realpath(paths["stdlib"]) + os.sep)


def _frames(tb: TracebackType | None) -> list[traceback.FrameSummary]:
    return list(traceback.extract_tb(tb)) if tb is not None else []


def user_frame(frames: list[traceback.FrameSummary]) -> traceback.FrameSummary | None:
    """The innermost frame that is not torch's, shardfuse's or the standard library's."""
    for frame in reversed(frames):
        if not frame.filename.startswith("<frozen") and not _is_library(frame.filename):
            return frame
    return None


def _first_error(err: BaseException) -> BaseException:
    """The first error of the context chain: the capture's end fails too, with the real cause as context."""
    first, seen = err, {id(err)}
    while first.__context__ is not None and id(first.__context__) not in seen:
        first = first.__context__
        seen.add(id(first))
    return first


def _diagnose(clues: dict[str, str]) -> tuple[str, str] | None:
    for where, pattern, what, fix in _KNOWN:
        if re.search(pattern, clues[where]):
            return what, fix
    return None


def capture_failed(err: BaseException) -> CaptureError:
    """The :class:`CaptureError` for a capture that raised ``err``: the cause's first line, where in the step
    it happened (file, line, source) and inside which library function, what that is and how to fix it."""
    first = _first_error(err)
    cause = (str(first).strip().split("\n") or [""])[0]
    frames = _frames(first.__traceback__)
    mine = user_frame(frames)
    where = ""
    if mine is not None:
        where = f" at {mine.filename}:{mine.lineno} in {mine.name} (`{(mine.line or '').strip()}`)"
    inner = frames[-1] if frames else None
    if inner is not None and inner is not mine:
        where += f", inside {inner.name} ({os.path.basename(inner.filename)}:{inner.lineno})"
    clues = {"error": cause, "line": (mine.line or "") if mine else "",
             "function": f"{inner.name} {inner.filename}" if inner is not None and inner is not mine else ""}
    found = _diagnose(clues)
    if found is not None:
        what, fix = found
        advice = f"this looks like {what}: {fix}"
    else:
        advice = f"common causes: {HOST_SYNC_HINTS}. Move host work out of step_fn, or run the step eagerly"
    return CaptureError(
        f"shardfuse.capture_step could not capture the step ({type(first).__name__}: {cause}){where}; {advice}"
    )

