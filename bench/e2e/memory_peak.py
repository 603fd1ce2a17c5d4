"""What is alive at a training step's memory peak, and who allocated it (``bench.e2e.run --memory-peak DIR``).

One more step of an implementation runs under PyTorch's allocator history (``torch.cuda.memory._record_memory_history``,
Python frames only); its trace of allocations and frees is then replayed from the bytes allocated when the step
began, and the blocks alive at the step's highest point are grouped by where they were allocated: the innermost
frame outside PyTorch (shardfuse, torchao, the benchmark, the model, inductor's generated code) and the benchmark's
own line that the step was on (forward, backward, optimizer step). Blocks alive before the step (parameters,
optimizer state, anything kept from the step before) have no frames: one group, "before the step", less what the
step freed of them before its peak.

Frees count at ``free_completed`` (a block freed with work pending on another stream is unusable until that work
ends), so the replayed peak can sit a little above ``max_memory_allocated``'s; both are in the summary.

    python -m bench.e2e.memory_peak SUMMARY.json   # print a summary this module wrote
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

MAX_ENTRIES = 2_000_000  # trace events kept (a 7B step allocates some 10^5 blocks)
TOP_GROUPS = 40
TIMELINE_POINTS = 200
BEFORE = "before the step (parameters, optimizer state, what the last step kept)"
# Frames of these packages are where a block was allocated; the first one (innermost out) names the group.
OWN_MARKERS = ("/shardfuse/", "/torchao/", "/bench/", "/examples/", "torchinductor", "/transformers/")
PHASE_MARKER = "/bench/"  # the benchmark's own frame: which line of the step (forward, backward, step)


def _short(frame: dict[str, Any]) -> str:
    name = str(frame.get("filename", "?"))
    for marker in ("/shardfuse/", "/torchao/", "/bench/", "/examples/", "/transformers/", "/torch/"):
        at = name.rfind(marker)
        if at >= 0:
            name = name[at + 1:]
            break
    else:
        if "torchinductor" in name:
            name = "inductor:" + name.rsplit("/", 1)[-1]
    return f"{name}:{frame.get('line', '?')} ({frame.get('name', '?')})"


def where_allocated(frames: Sequence[dict[str, Any]]) -> tuple[str, str]:
    """(the innermost frame of our own or a library's code, the benchmark's frame) of one allocation's stack
    (innermost first, as the allocator records it); "torch" when every frame is PyTorch's."""
    where = phase = ""
    for f in frames:
        name = str(f.get("filename", ""))
        if not where and any(m in name for m in OWN_MARKERS):
            where = _short(f)
        if not phase and PHASE_MARKER in name and "memory_peak" not in name:
            phase = _short(f)
        if where and phase:
            break
    if not where:
        where = _short(frames[0]) if frames else "no frames"
    return where, phase or "-"


def replay(events: Sequence[dict[str, Any]], start_bytes: int) -> dict[str, Any]:
    """Replay one device's trace from ``start_bytes`` allocated: the peak, when it came, and what was alive then,
    grouped by :func:`where_allocated` (largest first)."""
    live: dict[int, tuple[int, int]] = {}  # address -> (size, index of its alloc event)
    before = current = start_bytes
    peak, peak_at, peak_live, peak_before = start_bytes, -1, dict(live), before
    timeline: list[tuple[int, int]] = []
    stride = max(1, len(events) // TIMELINE_POINTS)
    for i, ev in enumerate(events):
        action, addr, size = ev.get("action"), int(ev.get("addr", 0)), int(ev.get("size", 0))
        if action == "alloc":
            live[addr] = (size, i)
            current += size
            if current > peak:
                peak, peak_at, peak_live, peak_before = current, i, dict(live), before
        elif action == "free_completed":
            if addr in live:
                current -= live.pop(addr)[0]
            else:  # allocated before the recording began
                current -= size
                before -= size
        if i % stride == 0:
            timeline.append((i, current))
    groups: dict[tuple[str, str], list[int]] = {}
    for size, index in peak_live.values():
        key = where_allocated(events[index].get("frames") or [])
        acc = groups.setdefault(key, [0, 0])
        acc[0] += size
        acc[1] += 1
    rows = [{"where": BEFORE, "phase": "-", "bytes": peak_before, "count": None}]
    rows += [{"where": w, "phase": p, "bytes": b, "count": n} for (w, p), (b, n) in groups.items()]
    rows.sort(key=lambda r: -r["bytes"])
    made_peak = events[peak_at].get("frames") if peak_at >= 0 else None
    return {
        "start_bytes": start_bytes, "peak_bytes": peak, "peak_event": peak_at, "events": len(events),
        "peak_alloc_where": where_allocated(made_peak or []) if peak_at >= 0 else None,
        "at_peak": rows[:TOP_GROUPS], "at_peak_rest_bytes": sum(r["bytes"] for r in rows[TOP_GROUPS:]),
        "timeline": timeline,
    }


@contextlib.contextmanager
def recording(path: Path | None, device: torch.device, label: str) -> Iterator[None]:
    """Record the allocator's history on ``device`` around the body; when ``path`` is given (rank 0), write the
    replayed peak's summary there and print its largest groups. Every rank records alike (same work)."""
    if device.type != "cuda":
        yield
        return
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    start = torch.cuda.memory_allocated(device)
    torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES, stacks="python", device=device,
                                             clear_history=True)
    try:
        yield
        torch.cuda.synchronize(device)
        snapshot = torch.cuda.memory._snapshot(device) if path is not None else None
    finally:
        torch.cuda.memory._record_memory_history(enabled=None, device=device)
    if path is None or snapshot is None:
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    summary = replay(snapshot["device_traces"][index], start)
    summary.update(label=label, max_memory_allocated=torch.cuda.max_memory_allocated(device))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=1))
    print_summary(summary)


def print_summary(summary: dict[str, Any], top: int = 20) -> None:
    gib = 1 << 30
    print(f"memory peak of {summary.get('label', '?')}: {summary['peak_bytes'] / gib:.2f} GiB replayed "
          f"(max_memory_allocated {summary.get('max_memory_allocated', 0) / gib:.2f}), "
          f"{summary['start_bytes'] / gib:.2f} GiB at the step's start; peak at event {summary['peak_event']} of "
          f"{summary['events']}, made by {summary['peak_alloc_where']}", flush=True)
    for r in summary["at_peak"][:top]:
        count = "" if r["count"] is None else f"{r['count']:6d}x"
        print(f"  {r['bytes'] / gib:8.3f} GiB {count:>7s}  {r['where'][:90]}  [{r['phase'][:60]}]", flush=True)


def main(argv: list[str] | None = None) -> int:
    for name in argv if argv is not None else sys.argv[1:]:
        print_summary(json.loads(Path(name).read_text()), top=TOP_GROUPS)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
