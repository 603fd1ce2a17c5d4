"""One offloaded step's host timeline, from ``OffloadOptimizer.trace_host`` (``BIG_TRACE=1`` in bench.offload.big).

``summarize`` turns the recorded events of one step (perf_counter seconds) into milliseconds from the step's start:
per offloaded unit (forward order) when its update was queued, taken by the worker, had its gradient on the host,
ran and finished, and how long callers (the next forward's gathers) waited for it; and the totals that say where
the step went: the worker updating, the worker waiting for gradient copies, callers waiting for the worker.
``table`` prints it. A step's window also holds the tail of the previous step's updates (the forward waits for
them), so units can show two updates.
"""

from __future__ import annotations

from typing import Any

Event = tuple[float, str, int]  # (perf_counter seconds, kind, unit; -1 for "step")


def _pairs(events: list[Event], unit: int, first: str, second: str) -> list[tuple[float, float]]:
    """(start, end) of each ``first`` event of ``unit`` and the next ``second`` after it."""
    out, start = [], None
    for t, kind, u in events:
        if u != unit:
            continue
        if kind == first:
            start = t
        elif kind == second and start is not None:
            out.append((start, t))
            start = None
    return out


def summarize(events: list[Event], start: float, end: float, step_end: float | None = None) -> dict[str, Any]:
    """The timeline of the window ``[start, end]`` (perf_counter seconds), in ms from ``start``; ``step_end``: when
    the step itself ended (its timed part; the window may go on to the end of its host updates)."""
    window = sorted(e for e in events if start <= e[0] <= end)
    ms = lambda t: round((t - start) * 1e3, 2)  # noqa: E731
    units: dict[int, dict[str, list[float]]] = {}
    for t, kind, unit in window:
        if unit >= 0:
            units.setdefault(unit, {}).setdefault(kind, []).append(ms(t))
    total = {"updating": 0.0, "grad_wait": 0.0, "caller_wait": 0.0}
    for unit in units:
        total["updating"] += sum(b - a for a, b in _pairs(window, unit, "update", "done"))
        total["grad_wait"] += sum(b - a for a, b in _pairs(window, unit, "task", "grad_ready"))
        total["caller_wait"] += sum(b - a for a, b in _pairs(window, unit, "wait", "waited"))
    return {"window_ms": ms(end), "step_end_ms": ms(step_end) if step_end is not None else None,
            "steps_ms": [ms(t) for t, kind, _ in window if kind == "step"],
            "updating_ms": round(total["updating"] * 1e3, 2), "grad_wait_ms": round(total["grad_wait"] * 1e3, 2),
            "caller_wait_ms": round(total["caller_wait"] * 1e3, 2),
            "units": {str(u): units[u] for u in sorted(units)}}


COLUMNS = ("queued", "task", "grad_ready", "update", "done", "wait", "waited")


def table(summary: dict[str, Any]) -> list[str]:
    """Printable lines: the totals, then one line per unit with the ms of each event (several: comma-separated)."""
    ended = f"step ended at {summary['step_end_ms']:.0f} ms, " if summary.get("step_end_ms") is not None else ""
    lines = [f"   host timeline of one step ({summary['window_ms']:.0f} ms window; {ended}step() at "
             f"{', '.join(f'{t:.0f}' for t in summary['steps_ms']) or '-'} ms): worker updating "
             f"{summary['updating_ms']:.0f} ms, waiting for gradient copies {summary['grad_wait_ms']:.0f} ms; callers "
             f"waited {summary['caller_wait_ms']:.0f} ms",
             "   unit " + " ".join(f"{c:>13}" for c in COLUMNS)]
    for unit, kinds in summary["units"].items():
        cells = [",".join(f"{t:.0f}" for t in kinds.get(c, [])) or "-" for c in COLUMNS]
        lines.append(f"   {unit:>4} " + " ".join(f"{c:>13}" for c in cells))
    return lines
