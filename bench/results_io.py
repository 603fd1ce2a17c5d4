"""Reading stored benchmark results: what both ``bench.report`` (tables, plots) and ``bench.regress``
(regression check) need, so that neither imports the other's internals.

Result files are the JSON that the runners write through ``bench.common.write_result``, one folder per GPU
architecture: ``bench/results/<gpu>/<name>.json``. Standard library only (no torch), like the report.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEFAULT_RESULTS = REPO / "bench" / "results"

__all__ = ["DEFAULT_RESULTS", "REPO", "Result", "detect_kind", "load_file", "load_results"]


@dataclass
class Result:
    """One stored result file."""

    gpu: str  # the folder name under results/, e.g. "h200"
    name: str  # the file stem, e.g. "e2e_2gpu"
    path: Path
    kind: str  # "kernels", "e2e", "offload", "unknown" or "unreadable"
    data: dict[str, Any] = field(default_factory=dict)
    problem: str | None = None

    @property
    def env(self) -> dict[str, Any]:
        env = self.data.get("env")
        return env if isinstance(env, dict) else {}


def detect_kind(name: str, data: Any) -> str:
    """Which runner wrote ``data`` (by its keys, then by the file name)."""
    if not isinstance(data, dict):
        return "unknown"
    rows = data.get("rows")
    if isinstance(rows, list) and (not rows or any(isinstance(r, dict) and "family" in r for r in rows)):
        return "kernels"
    if isinstance(data.get("results"), list):
        return "e2e"
    if isinstance(data.get("variants"), dict):
        return "offload"
    if name == "kernels":
        return "kernels"
    if name.startswith("e2e"):
        return "e2e"
    if name.startswith("offload"):
        return "offload"
    return "unknown"


def load_file(path: Path, gpu: str | None = None) -> Result:
    """Read one result file; a file that cannot be parsed becomes a Result of kind ``unreadable``."""
    gpu = gpu if gpu is not None else path.parent.name
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        return Result(gpu, path.stem, path, "unreadable", {}, f"{type(exc).__name__}: {exc}")
    if not isinstance(data, dict):
        return Result(gpu, path.stem, path, "unknown", {}, "top level is not a JSON object")
    return Result(gpu, path.stem, path, detect_kind(path.stem, data), data)


def _result_sort_key(r: Result) -> tuple[int, int, str]:
    order = {"e2e": 0, "offload": 1, "kernels": 2, "unknown": 3, "unreadable": 4}
    m = re.search(r"(\d+)gpu", r.name)
    return order.get(r.kind, 5), int(m.group(1)) if m else 0, r.name


def load_results(results_dir: Path) -> dict[str, list[Result]]:
    """``{gpu: [results...]}`` for every ``<results_dir>/<gpu>/*.json``, GPUs and files in a stable order."""
    out: dict[str, list[Result]] = {}
    if not results_dir.is_dir():
        return out
    for gpu_dir in sorted(p for p in results_dir.iterdir() if p.is_dir() and not p.name.startswith(".")):
        files = sorted(gpu_dir.glob("*.json"))
        if files:
            out[gpu_dir.name] = sorted((load_file(f, gpu_dir.name) for f in files), key=_result_sort_key)
    return out
