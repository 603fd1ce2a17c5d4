"""An opt-in timeline of the overlapped host step (``OffloadOptimizer.trace_host``).

Each offloaded unit's events are recorded with ``time.perf_counter()``: its update queued (``queued``), taken by
the worker (``task``), its gradient found on the host (``grad_ready``, step_in_backward only), its update started
and finished (``update``, ``done``), a compute-dtype gradient widened to fp32 on the host (``widened``, by the worker
or the end of backward), and a caller blocked on it and released (``wait``, ``waited``); ``step`` marks
each ``OffloadOptimizer.step()``. A benchmark reads them to tell where an offloaded step's time goes: the worker
idle, waiting for gradient copies or updating while the GPU waits. Off by default: nothing is recorded, and the
hooks cost one attribute test.
"""

from __future__ import annotations

import time
from collections.abc import Callable

KINDS = ("step", "queued", "task", "grad_ready", "update", "done", "widened", "wait", "waited")


class HostTrace:
    """The recorded events, ``(perf_counter seconds, kind, unit)``: unit is the shard's position in the forward
    order (-1 for ``step``). Appends come from the main and the worker thread (a list append is atomic)."""

    def __init__(self) -> None:
        self.events: list[tuple[float, str, int]] = []

    def mark(self, kind: str, unit: int = -1) -> None:
        self.events.append((time.perf_counter(), kind, unit))

    def recorder(self, unit: int) -> Callable[[str], None]:
        """What a HostShard calls with each event's kind."""
        return lambda kind: self.mark(kind, unit)

    def between(self, start: float, end: float) -> list[tuple[float, str, int]]:
        """The events in ``[start, end]`` (perf_counter seconds)."""
        return [e for e in self.events if start <= e[0] <= end]
