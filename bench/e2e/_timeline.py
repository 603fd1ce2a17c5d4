"""The arithmetic of a GPU kernel timeline: where a step's time goes (compute, exposed communication, idle).

Input: one step's kernels as ``(start_us, end_us, name)``. A kernel is communication when its name says NCCL
(``"nccl"`` in it): inside a replayed CUDA graph the profiler no longer tells the capture's streams apart, so the
name is what remains. Everything else that ran on the GPU (GEMMs, Triton kernels, copies, memsets) is compute.

- ``span``: the first kernel's start to the last kernel's end;
- ``compute``: the time any compute kernel runs (the union of their intervals);
- ``exposed communication``: the time a collective runs and no compute kernel does;
- ``idle``: the time nothing runs.

The three add up to the span. A collective's ``overlapped`` time is the part of its own duration during which
some compute kernel ran. ``gap`` splits the difference between two steps (a sharded one and the one-GPU one) the
same way, so compute delta + exposed communication delta + idle delta = the gap.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

Kernel = tuple[float, float, str]
Interval = tuple[float, float]

COLLECTIVE_KINDS = (("allgather", ("allgather", "all_gather")), ("reducescatter", ("reducescatter", "reduce_scatter")),
                    ("allreduce", ("allreduce", "all_reduce")))  # fmt: skip


def is_comm(name: str) -> bool:
    return "nccl" in name.lower()


def collective_kind(name: str) -> str:
    """allgather / reducescatter / allreduce / other (send, recv, ...) for an NCCL kernel's name."""
    low = name.lower().replace(" ", "")
    return next((kind for kind, keys in COLLECTIVE_KINDS if any(k in low for k in keys)), "other")


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering the same time as ``intervals`` (empty ones dropped)."""
    merged: list[list[float]] = []
    for s, e in sorted((s, e) for s, e in intervals if e > s):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return [(s, e) for s, e in merged]


def length(disjoint: Sequence[Interval]) -> float:
    return sum(e - s for s, e in disjoint)


def covered(intervals: Iterable[Interval], disjoint: Sequence[Interval]) -> float:
    """Summed time of ``intervals`` (each counted on its own) that falls inside the disjoint ``disjoint``."""
    return sum(max(0.0, min(e0, e1) - max(s0, s1)) for s0, e0 in intervals for s1, e1 in disjoint)


def split_step(kernels: Sequence[Kernel]) -> dict[str, Any]:
    """Span, compute, exposed communication and idle time of one step (us), and per collective kind its kernels'
    count, summed duration and the part of it overlapped by compute."""
    if not kernels:
        return {"kernels": 0, "span_us": 0.0, "compute_us": 0.0, "exposed_comm_us": 0.0, "idle_us": 0.0,
                "comm_us": 0.0, "collectives": {}}  # fmt: skip
    compute = union((s, e) for s, e, n in kernels if not is_comm(n))
    comm = union((s, e) for s, e, n in kernels if is_comm(n))
    span = max(e for _, e, _ in kernels) - min(s for s, _, _ in kernels)
    busy = length(union([*compute, *comm]))
    compute_us = length(compute)
    collectives: dict[str, dict[str, float]] = {}
    for s, e, n in kernels:
        if is_comm(n):
            c = collectives.setdefault(collective_kind(n), {"count": 0, "us": 0.0, "overlapped_us": 0.0})
            c["count"] += 1
            c["us"] += e - s
            c["overlapped_us"] += covered([(s, e)], compute)
    for c in collectives.values():
        c["overlapped_share"] = c["overlapped_us"] / c["us"] if c["us"] > 0 else 0.0
    return {"kernels": len(kernels), "span_us": span, "compute_us": compute_us, "exposed_comm_us": busy - compute_us,
            "idle_us": span - busy, "comm_us": length(comm), "collectives": collectives}  # fmt: skip


def gap(sharded: dict[str, Any], base: dict[str, Any]) -> dict[str, float]:
    """The sharded step's extra time over ``base`` (both from ``split_step``), split into its parts."""
    return {
        "gap_us": sharded["span_us"] - base["span_us"],
        "compute_delta_us": sharded["compute_us"] - base["compute_us"],
        "exposed_comm_delta_us": sharded["exposed_comm_us"] - base["exposed_comm_us"],
        "idle_delta_us": sharded["idle_us"] - base["idle_us"],
    }


def kernel_totals(kernels: Iterable[Kernel]) -> dict[str, tuple[int, float]]:
    """Per kernel name: (count, summed duration in us)."""
    out: dict[str, tuple[int, float]] = {}
    for s, e, n in kernels:
        count, us = out.get(n, (0, 0.0))
        out[n] = (count + 1, us + (e - s))
    return out


def top_kernels(kernels: Sequence[Kernel], base: Sequence[Kernel] = (), n: int = 10) -> list[dict[str, Any]]:
    """The compute kernels that add the most time over ``base`` (by name; without a base, the longest): with
    a one-GPU base these are sharding's own kernels (casts, pads, divides) and the GEMMs that got slower."""
    mine, theirs = kernel_totals(kernels), kernel_totals(base)
    rows = []
    for name, (count, us) in mine.items():
        if is_comm(name):
            continue
        base_count, base_us = theirs.get(name, (0, 0.0))
        rows.append({"name": name, "count": count, "us": us, "base_us": base_us, "delta_us": us - base_us})
    rows.sort(key=lambda r: (-r["delta_us"], r["name"]))
    return rows[:n]
