"""What ``bench.e2e.run`` records beside its timings, after an implementation's timed steps: ``--profile``'s
profiled steps (a chrome trace, and a summary of the GPU kernels: their time per step, the step's span split into
compute, exposed communication and idle time, and the longest idle gaps with the kernels around them) and
``--memory-peak``'s step under the allocator's history (``bench.e2e.memory_peak``)."""

from __future__ import annotations

import argparse
import bisect
import contextlib
import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bench.e2e import memory_peak
from bench.e2e._timeline import Kernel, collective_kind, is_comm, length, split_step, union

PROFILE_STEPS = 3
TOP_GAPS = 15


@contextlib.contextmanager
def maybe_profile(path: Path | None, device: torch.device, steps: int = PROFILE_STEPS) -> Iterator[None]:
    """Record a chrome trace to ``path`` when given, and beside it a summary of the GPU kernels' time per step."""
    if path is None:
        yield
        return
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        yield
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    summary = kernel_summary(prof.events(), steps)
    write_json = path.with_suffix(".kernels.json")
    write_json.write_text(json.dumps(summary, indent=1))
    print_summary(summary, f"wrote profiler trace {path} and {write_json.name}")


def print_summary(summary: dict[str, Any], title: str) -> None:
    t = summary["timeline_ms_per_step"]
    print(f"{title}: per step {summary['kernels_per_step']:.0f} kernels, NCCL {summary['nccl_ms_per_step']:.1f} ms, "
          f"other kernels {summary['other_ms_per_step']:.1f} ms; span {t['span']:.1f} ms = compute {t['compute']:.1f} "
          f"+ exposed communication {t['exposed_comm']:.1f} + idle {t['idle']:.1f}", flush=True)
    for k in summary["top_other"][:12]:
        print(f"    {k['ms_per_step']:7.2f} ms {k['count_per_step']:6.1f}x  {k['name'][:100]}", flush=True)
    for kind, c in sorted(summary["collectives"].items()):
        print(f"  {kind}: {c['count'] / summary['steps']:.0f} per step, {c['us'] / 1e3 / summary['steps']:.1f} ms, "
              f"{100 * c['overlapped_share']:.0f}% under compute", flush=True)
    print("  longest exposed communication (a collective, no compute): ms at ms, collectives, after -> before")
    for r in summary["exposed_comm"][:10]:
        print(f"    {r['ms']:7.3f} at {r['at_ms']:8.1f}  {','.join(r['collectives'])}  {r['after'][:50]} -> "
              f"{r['before'][:50]}", flush=True)
    print("  longest idle gaps (nothing on the GPU): ms, after -> before", flush=True)
    for g in summary["idle_gaps"][:8]:
        print(f"    {g['ms']:7.3f}  {g['after'][:60]} -> {g['before'][:60]}", flush=True)


def kernels_of(events: Any) -> list[Kernel]:
    """``(start_us, end_us, name)`` of every GPU kernel, copy and memset among the profiler's events."""
    out = []
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CUDA or getattr(e, "is_user_annotation", False):
            continue
        out.append((float(e.time_range.start), float(e.time_range.end), e.name))
    return out


def kernel_summary(events: Any, steps: int) -> dict[str, Any]:
    """GPU kernel time per step from profiler events: NCCL kernels apart from the others, and the others' top
    names (summed durations: overlapping kernels both count); the profiled window's span split by
    ``_timeline.split_step`` (per step) and its longest idle gaps."""
    return summarize(kernels_of(events), steps)


def summarize(kernels: Sequence[Kernel], steps: int) -> dict[str, Any]:
    per_name: dict[str, list[float]] = {}
    for s, e, n in kernels:
        per_name.setdefault(n, []).append((e - s) / 1e3)
    nccl = sum(sum(v) for n, v in per_name.items() if "nccl" in n.lower())
    other = {n: v for n, v in per_name.items() if "nccl" not in n.lower()}
    top = sorted(other.items(), key=lambda kv: -sum(kv[1]))
    split = split_step(kernels)
    return {
        "steps": steps,
        "kernels_per_step": sum(len(v) for v in per_name.values()) / steps,
        "nccl_ms_per_step": nccl / steps,
        "other_ms_per_step": sum(sum(v) for v in other.values()) / steps,
        "top_other": [{"name": n, "ms_per_step": sum(v) / steps, "count_per_step": len(v) / steps}
                      for n, v in top[:40]],
        "timeline_ms_per_step": {k: split[f"{k}_us"] / 1e3 / steps
                                 for k in ("span", "compute", "exposed_comm", "idle")},
        "idle_gaps": idle_gaps(kernels),
        "collectives": split["collectives"],
        "exposed_comm": exposed_runs(kernels),
    }


class _Neighbours:
    """The kernel of ``kernels`` that ended last by a time, and the one that started first from a time."""

    def __init__(self, kernels: Sequence[Kernel]) -> None:
        self.ends = sorted((e, n) for _, e, n in kernels)
        self.starts = sorted((s, n) for s, _, n in kernels)
        self.end_times, self.start_times = [e for e, _ in self.ends], [s for s, _ in self.starts]

    def ended_by(self, t: float) -> str:
        i = bisect.bisect_right(self.end_times, t) - 1
        return self.ends[i][1] if i >= 0 else "-"

    def starting_from(self, t: float) -> str:
        j = bisect.bisect_left(self.start_times, t)
        return self.starts[j][1] if j < len(self.starts) else "-"


def exposed_runs(kernels: Sequence[Kernel], top: int = TOP_GAPS) -> list[dict[str, Any]]:
    """The longest stretches in which a collective runs and no compute kernel does: each with its collectives'
    names, the compute kernel that ended last before it and the one that started it (``at_ms`` from the window's
    first kernel)."""
    compute = [(s, e, n) for s, e, n in kernels if not is_comm(n)]
    comm = [(s, e, n) for s, e, n in kernels if is_comm(n)]
    if not compute or not comm:
        return []
    busy = union((s, e) for s, e, _ in compute)
    first = min(s for s, _, _ in kernels)
    around = _Neighbours(compute)
    runs = []
    # The holes between compute runs (and before the first / after the last), each cut to the collectives in it.
    holes = [(first, busy[0][0]), *((a[1], b[0]) for a, b in zip(busy, busy[1:])), (busy[-1][1], float("inf"))]
    for lo, hi in holes:
        there = [(s, e, n) for s, e, n in comm if e > lo and s < hi]
        if not there:
            continue
        inside = union((max(s, lo), min(e, hi)) for s, e, _ in there)
        runs.append({"ms": length(inside) / 1e3, "at_ms": (lo - first) / 1e3,
                     "collectives": sorted({collective_kind(n) for _, _, n in there}),
                     "after": around.ended_by(lo), "before": around.starting_from(hi)})
    runs.sort(key=lambda r: -r["ms"])
    return runs[:top]


def idle_gaps(kernels: Sequence[Kernel], top: int = TOP_GAPS) -> list[dict[str, Any]]:
    """The longest stretches with no kernel running on the GPU, each with the name of the kernel that ended
    last before it and the one that started it."""
    busy = union((s, e) for s, e, _ in kernels)
    around = _Neighbours(kernels)
    # A kernel ends exactly where each busy run ends, and one starts where the next run starts.
    gaps = [{"ms": (start - end) / 1e3, "at_ms": (end - busy[0][0]) / 1e3, "after": around.ended_by(end),
             "before": around.starting_from(start)} for (_, end), (start, _) in zip(busy, busy[1:])]
    gaps.sort(key=lambda g: -g["ms"])
    return gaps[:top]


def record_extras(impl: str, regime: str, args: argparse.Namespace, device: torch.device, rank: int,
                  one_step: Callable[[torch.Tensor], Any], data: list[torch.Tensor],
                  sync: Callable[[torch.device], None]) -> None:
    """After the timed steps: ``--profile``'s profiled steps, then ``--memory-peak``'s step under the allocator's
    history. Every rank runs the same steps (collectives stay matched); rank 0 records them."""
    # "+" of a variant's name is "_" in file names (the device tool brings back plain names only).
    stem = f"{impl.replace('+', '_')}_{regime}_{dist.get_world_size()}gpu_rank0"
    if args.profile:
        with maybe_profile(Path(args.profile) / f"{stem}.json" if rank == 0 else None, device):
            for i in range(PROFILE_STEPS):
                with torch.profiler.record_function(f"bench.e2e:{impl}_step"):
                    one_step(data[i % len(data)])
            sync(device)
    if args.memory_peak:
        path = Path(args.memory_peak) / f"{stem}.memory_peak.json" if rank == 0 else None
        with memory_peak.recording(path, device, f"{impl} {regime}"):
            one_step(data[0])
