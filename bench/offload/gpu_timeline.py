"""Where one offloaded step's time goes on the GPU side: busy time per engine from a profiler trace.

``BIG_PROFILE=1`` in ``bench.offload.big``: after the timed steps a child runs one more optimizer step under
``torch.profiler`` (CPU and CUDA activities; its host timeline recorded too when the optimizer has ``trace_host``),
and ``attribute`` reduces the Chrome trace of that step to the busy time of each engine, each interval set merged
(a union, so concurrent kernels count once):

- ``compute``: GPU kernels; ``h2d`` / ``d2h``: host<->device copies (the copy engines); ``dtod``: device copies;
- ``gpu_any``: the union of all of them; ``gpu_idle`` = window - ``gpu_any``;
- ``h2d_hidden`` / ``d2h_hidden``: the part of each copy direction that ran while a kernel ran;
- ``compute_only``: kernels with no copy beside them; ``copy_only``: copies with no kernel beside them.

The window is the ``bench.offload.profiled_step`` range: from the step's start to the end of its host updates
(``synchronize()``). The host side (the worker updating, waiting for gradient copies, callers waiting for it)
comes from ``bench.offload.host_timeline``. The full trace may be written gzipped (``BIG_PROFILE_DIR``).
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

WINDOW_NAME = "bench.offload.profiled_step"
Interval = tuple[float, float]


def union(intervals: list[Interval]) -> list[Interval]:
    """The sorted, merged intervals covering the same points."""
    out: list[Interval] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            if b > out[-1][1]:
                out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def length(intervals: list[Interval]) -> float:
    return sum(b - a for a, b in union(intervals))


def intersect(xs: list[Interval], ys: list[Interval]) -> list[Interval]:
    """The points covered by both (each side merged first)."""
    xs, ys = union(xs), union(ys)
    out, i, j = [], 0, 0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if a < b:
            out.append((a, b))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return out


def engine_of(event: dict[str, Any]) -> str | None:
    """``compute``, ``h2d``, ``d2h``, ``dtod`` or None (not a GPU activity) for one Chrome-trace event."""
    cat = str(event.get("cat", "")).lower()
    name = str(event.get("name", ""))
    if cat == "kernel":
        return "compute"
    if cat in ("gpu_memcpy", "gpu_memset"):
        if "HtoD" in name:
            return "h2d"
        if "DtoH" in name:
            return "d2h"
        return "dtod"
    return None


def clip_to(intervals: list[Interval], lo: float, hi: float) -> list[Interval]:
    return [(max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi]


def attribute(events: list[dict[str, Any]], window: Interval | None = None) -> dict[str, Any]:
    """The busy times (ms) of one window of a Chrome trace's ``traceEvents`` (timestamps in microseconds).

    ``window``: (start, end) in the trace's microseconds; by default the ``WINDOW_NAME`` range's."""
    if window is None:
        # the CPU range (the profiler mirrors it on the GPU timeline as a gpu_user_annotation spanning only the
        # kernels launched inside it)
        marks = [e for e in events if e.get("name") == WINDOW_NAME and e.get("ph") == "X"
                 and e.get("cat") != "gpu_user_annotation"]
        if not marks:
            raise ValueError(f"no {WINDOW_NAME!r} range in the trace: profile the step inside profiled_step()")
        window = (float(marks[-1]["ts"]), float(marks[-1]["ts"]) + float(marks[-1]["dur"]))
    lo, hi = window
    by_engine: dict[str, list[Interval]] = {"compute": [], "h2d": [], "d2h": [], "dtod": []}
    for e in events:
        engine = engine_of(e) if e.get("ph") == "X" else None
        if engine is not None:
            ts = float(e["ts"])
            by_engine[engine].append((ts, ts + float(e.get("dur", 0.0))))
    by_engine = {k: clip_to(v, lo, hi) for k, v in by_engine.items()}
    copies = by_engine["h2d"] + by_engine["d2h"]
    gpu_any = union(by_engine["compute"] + copies + by_engine["dtod"])
    ms = lambda us: round(us / 1e3, 2)  # noqa: E731
    return {
        "window_ms": ms(hi - lo),
        **{f"{k}_ms": ms(length(v)) for k, v in by_engine.items()},
        "gpu_any_ms": ms(length(gpu_any)),
        "gpu_idle_ms": ms((hi - lo) - length(gpu_any)),
        "h2d_hidden_ms": ms(length(intersect(by_engine["h2d"], by_engine["compute"]))),
        "d2h_hidden_ms": ms(length(intersect(by_engine["d2h"], by_engine["compute"]))),
        "compute_only_ms": ms(length(by_engine["compute"]) - length(intersect(by_engine["compute"], copies))),
        "copy_only_ms": ms(length(copies) - length(intersect(copies, by_engine["compute"]))),
        "kernels": len(by_engine["compute"]),
        "copies": len(copies),
    }


@contextlib.contextmanager
def profiled_step(enabled: bool, tag: str = "step") -> Iterator[Callable[[], dict[str, Any] | None]]:
    """Profile the body (one optimizer step and the wait for its host updates) when ``enabled``; the yielded
    callable returns ``attribute`` of it afterwards (None when disabled). Writes the trace gzipped into
    ``$BIG_PROFILE_DIR`` when that is set, as ``trace_<tag>.json.gz``."""
    result: dict[str, Any] | None = None
    if not enabled:
        yield lambda: None
        return
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        with record_function(WINDOW_NAME):
            yield lambda: result
        if cuda:
            torch.cuda.synchronize()
    path = Path(os.environ.get("BIG_PROFILE_DIR") or "/tmp") / f"offload_step_trace_{os.getpid()}.json"
    prof.export_chrome_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    result = attribute(events)
    if os.environ.get("BIG_PROFILE_DIR"):
        with gzip.open(path.with_name(f"trace_{tag}.json.gz"), "wt") as f:
            json.dump({"traceEvents": events}, f)
    path.unlink(missing_ok=True)


COLUMNS = ("window", "compute", "h2d", "d2h", "gpu_idle", "h2d_hidden", "d2h_hidden", "copy_only")


def table(attr: dict[str, Any]) -> str:
    """One printable line of the GPU side of the profiled step."""
    return "   GPU side of one profiled step (ms): " + ", ".join(f"{c} {attr[c + '_ms']:.0f}" for c in COLUMNS) + (
        f" ({attr['kernels']} kernels, {attr['copies']} copies)")
