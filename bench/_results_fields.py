"""Reading the fields of stored result files (``bench.results_io``), and the ``env`` record that every file carries.

Numbers are finite floats or None (missing, non-numeric, NaN, infinite); texts are str or None; a field of the wrong
JSON type reads as missing, so a damaged file renders with dashes instead of failing. Standard library only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


def _pos(v: Any) -> float | None:
    """A positive finite number as float, else None."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or math.isinf(v) or v <= 0:
        return None
    return float(v)


def num(v: Any) -> float | None:
    """A finite number as float, else None (bools are not numbers here)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return None if math.isnan(v) or math.isinf(v) else float(v)


def _int(v: Any) -> int | None:
    """An int (bools are not), else None."""
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _text(v: Any) -> str | None:
    """A value to print as text: None when missing or empty (as the runners leave optional fields)."""
    return str(v) if v not in (None, "") else None


def _obj(v: Any) -> dict[str, Any]:
    """A JSON object, else an empty one."""
    return v if isinstance(v, dict) else {}


def _objs(v: Any) -> list[dict[str, Any]]:
    """The JSON objects of a list (anything else dropped); [] for a non-list."""
    return [x for x in v if isinstance(x, dict)] if isinstance(v, list) else []


@dataclass(frozen=True)
class Env:
    """``env``: where and when a file was measured (``bench.common.env_info``)."""

    date: str | None = None
    commit: str | None = None
    python: str | None = None
    torch: str | None = None
    triton: str | None = None
    gpu_key: str | None = None
    gpu_name: str | None = None
    gpu_count: int | None = None
    cuda: str | None = None
    nccl: str | None = None
    host_cpus: int | None = None  # the CPUs the run could use (files from before 2026-11-30 lack it)
    cpu_model: str | None = None
    recorded: bool = False  # False when the file has no (or an empty) ``env``

    @classmethod
    def parse(cls, v: Any) -> Env:
        d = _obj(v)
        texts = {k: _text(d.get(k)) for k in ("date", "commit", "python", "torch", "triton", "gpu_key", "gpu_name")}
        return cls(**texts, gpu_count=_int(d.get("gpu_count")), cuda=_text(d.get("cuda")),
                   nccl=_text(d.get("nccl")), host_cpus=_int(d.get("host_cpus")), cpu_model=_text(d.get("cpu_model")),
                   recorded=bool(d))  # fmt: skip

    def get(self, key: str) -> str | int | None:
        """A field by its JSON name (for listing several at once)."""
        value: str | int | None = getattr(self, key)
        return value
