"""Progress lines of the long benchmark runs (``bench.offload.big``, ``bench.e2e.run``). Standard library only."""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["Progress", "fmt_duration"]


def fmt_duration(s: float) -> str:
    """``42 s``, ``3m05s``, ``1h02m``: short, for progress lines."""
    s = max(0.0, s)
    if s < 60:
        return f"{s:.0f} s"
    if s < 3600:
        return f"{int(s // 60)}m{int(s % 60):02d}s"
    return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"


class Progress:
    """A line per measurement: ``-- [i/n] label (elapsed ..., left ...)``.

    The time left is the remaining measurements' ``estimates`` (seconds each), scaled by how long the finished
    ones took against theirs; without estimates, the mean time of the finished ones times the remaining count
    (``?`` before the first has finished).
    """

    def __init__(self, count: int, estimates: list[float] | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:  # fmt: skip
        if estimates is not None and len(estimates) != count:
            raise ValueError(f"{len(estimates)} estimates for {count} measurements: give one per measurement")
        self.count = count
        self.estimates = estimates
        self.clock = clock
        self.t0 = clock()
        self.started = 0

    def _left(self, elapsed: float) -> float | None:
        done = self.started
        if self.estimates is not None:
            rest = sum(self.estimates[done:])
            planned = sum(self.estimates[:done])
            return rest * (elapsed / planned if done and planned > 0 else 1.0)
        return elapsed / done * (self.count - done) if done else None

    def line(self, label: str) -> str:
        """The line to print as measurement ``label`` (the next one) starts."""
        elapsed = self.clock() - self.t0
        left = self._left(elapsed)
        self.started += 1
        eta = "?" if left is None else f"~{fmt_duration(left)}"
        return f"-- [{self.started}/{self.count}] {label} (elapsed {fmt_duration(elapsed)}, left {eta})"
