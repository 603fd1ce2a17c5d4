"""One timing round of a kernel case: every implementation's calls alternating, one CUDA-event timing each.

``triton.testing.do_bench`` times one function for its whole repetition window (50 ms here) before the next
starts, so on a shared host a change of host load between two windows moves one implementation's median and not
the other's. Host-bound rows (a thousand tensors, a few microseconds of GPU work each) moved by up to 35% from
window to window that way: the list ``cast_shards`` of 1000 tensors, which runs ``torch._foreach_copy_`` itself,
took 355.2 us (262.3-384.4 over three rounds) against 265.6 (260.5-371.1) for the bare call at 3805688.
:func:`paired_round` alternates the implementations call by call instead (their order rotating, so none always
follows another), each call after an L2 flush and between two CUDA events, as ``do_bench`` does: every
implementation's timings span the same window and see the same host.

A forced path (:class:`~bench.kernels.cases.ForcedPath`) is forced around each of its calls, outside the events:
entering the overrides costs host time of its own, which the GPU spends on the flush before it reaches the start
event, so neither the forced path's time nor its neighbours' include it.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Callable, Iterator, Mapping
from typing import Protocol

from bench.kernels.cases import ForcedPath

WARMUP_MS = 10.0  # per implementation, as the do_bench call this replaces (warmup=10, rep=50)
REP_MS = 50.0
MAX_CALLS = 10_000  # per implementation and round: a case at the timer's floor (~5 us) would otherwise make 10,000+
L2_FLUSH_BYTES = 256 << 20  # what do_bench zeroes before each timed call (larger than any L2 of these GPUs)


class Clock(Protocol):
    """What a round needs of the device: a flush of its caches, timestamps in stream order, their distance."""

    def flush(self) -> None: ...

    def mark(self) -> object: ...

    def elapsed_ms(self, start: object, end: object) -> float: ...

    def synchronize(self) -> None: ...


class CudaClock:
    """CUDA events on the current stream, an L2 flush by zeroing a buffer larger than the L2."""

    def __init__(self) -> None:
        import torch

        self._torch = torch
        self._cache = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device="cuda")

    def flush(self) -> None:
        self._cache.zero_()

    def mark(self) -> object:
        event = self._torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def elapsed_ms(self, start: object, end: object) -> float:
        return start.elapsed_time(end)  # type: ignore[attr-defined]

    def synchronize(self) -> None:
        self._torch.cuda.synchronize()


Entry = tuple[str, Callable[[], object], Callable[[], contextlib.AbstractContextManager[None]]]


def _entries(fns: Mapping[str, Callable[[], object]]) -> list[Entry]:
    """(label, the function timed, the context it runs in): a forced path's bare function and its forcing."""
    out: list[Entry] = []
    for label, fn in fns.items():
        if isinstance(fn, ForcedPath):
            out.append((label, fn.fn, fn.forcing))
        else:
            out.append((label, fn, contextlib.nullcontext))
    return out


def _one_cycle(entries: list[Entry], start_at: int, clock: Clock, timed: bool) -> Iterator[tuple[str, object, object]]:
    """Each entry called once after a flush, from entry ``start_at`` on (rotating); yields (label, start, end)."""
    n = len(entries)
    for k in range(n):
        label, fn, context = entries[(start_at + k) % n]
        clock.flush()
        with context():
            start = clock.mark() if timed else None
            fn()
            end = clock.mark() if timed else None
        yield label, start, end


def paired_round(fns: Mapping[str, Callable[[], object]], clock: Clock, *, warmup_ms: float = WARMUP_MS,
                 rep_ms: float = REP_MS, max_calls: int = MAX_CALLS) -> dict[str, float]:
    """The median of each implementation's timings (ms) in one round of alternating calls.

    The round lasts what ``do_bench`` windows of ``rep_ms`` each would in all: ``rep_ms`` times the number of
    implementations over the time of one cycle (every implementation once, each after its flush) gives the cycles
    timed, at least 1 and at most ``max_calls``; ``warmup_ms`` the same way for untimed cycles first."""
    entries = _entries(fns)
    if not entries:
        raise ValueError("paired_round needs at least one function to time")
    list(_one_cycle(entries, 0, clock, timed=False))  # first calls: compilation, plans, allocations
    clock.synchronize()
    first = clock.mark()
    for i in range(5):
        list(_one_cycle(entries, i, clock, timed=False))
    last = clock.mark()
    clock.synchronize()
    cycle_ms = max(clock.elapsed_ms(first, last) / 5, 1e-6)
    calls = len(entries)
    for i in range(max(1, int(warmup_ms * calls / cycle_ms))):
        list(_one_cycle(entries, i, clock, timed=False))
    repeats = min(max_calls, max(1, int(rep_ms * calls / cycle_ms)))
    marks: dict[str, list[tuple[object, object]]] = {label: [] for label, _, _ in entries}
    for i in range(repeats):
        for label, start, end in _one_cycle(entries, i, clock, timed=True):
            marks[label].append((start, end))
    clock.synchronize()
    return {label: statistics.median(clock.elapsed_ms(s, e) for s, e in pairs) for label, pairs in marks.items()}
