"""How busy the host was when a benchmark row was measured: every result row carries ``host_load``.

A captured step barely touches the host, but every eager implementation launches its kernels from Python, so a
second job on the same machine (another suite on the other GPUs, a compile) slows the eager rows much more than
the captured ones. Such rows still show the regime, but not what the planner should be compared against:
``bench.plan_accuracy`` skips every row whose ``host_load`` is set, with this text as the reason.

``host_load`` is None on a quiet host, else a short reason:

- ``BENCH_HOST_SHARED=1`` in the environment (the caller knows another job runs on this host);
- or the 1-minute load average, less this job's own ranks (``own_processes``), above ``BENCH_HOST_LOAD_MAX``
  (default 0.25) per core.

``load1_per_core`` (that same number, or None where the OS does not report it) is recorded beside it.
"""

from __future__ import annotations

import os
from typing import Any

DEFAULT_MAX_LOAD_PER_CORE = 0.25


def _load1() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):  # not on every OS
        return None


def load_per_core(own_processes: int = 0, load1: float | None = None, cores: int | None = None) -> float | None:
    """The 1-minute load average per core, without the ``own_processes`` this job keeps busy (its ranks)."""
    load1 = _load1() if load1 is None else load1
    cores = cores or os.cpu_count() or 1
    if load1 is None:
        return None
    return max(0.0, load1 - own_processes) / cores


def host_load_reason(per_core: float | None, env: dict[str, str] | None = None) -> str | None:
    """Why this host counts as loaded (None: quiet), from the load per core and the environment."""
    env = dict(os.environ) if env is None else env
    if env.get("BENCH_HOST_SHARED", "").strip() not in ("", "0"):
        return "BENCH_HOST_SHARED is set: another job ran on this host at the same time"
    limit_text = env.get("BENCH_HOST_LOAD_MAX", "")
    try:
        limit = float(limit_text) if limit_text else DEFAULT_MAX_LOAD_PER_CORE
    except ValueError:
        raise ValueError(
            f"BENCH_HOST_LOAD_MAX={limit_text!r} is not a number: give the load per core above which a row "
            f"counts as measured on a loaded host (default {DEFAULT_MAX_LOAD_PER_CORE})"
        ) from None
    if per_core is not None and per_core > limit:
        return f"1-minute load {per_core:.2f} per core (above {limit:g}) besides this job's own processes"
    return None


def host_load_fields(own_processes: int = 0) -> dict[str, Any]:
    """``{"host_load": reason or None, "load1_per_core": ...}``, to merge into a result row."""
    per_core = load_per_core(own_processes)
    return {"host_load": host_load_reason(per_core),
            "load1_per_core": None if per_core is None else round(per_core, 3)}
