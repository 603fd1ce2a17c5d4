"""Reading stored benchmark results: what both ``bench.report`` (tables, plots) and ``bench.regress``
(regression check) need, so that neither imports the other's internals.

Result files are the JSON that the runners write through ``bench.common.write_result``, one folder per GPU
architecture: ``bench/results/<gpu>/<name>.json``. Standard library only (no torch), like the report.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEFAULT_RESULTS = REPO / "bench" / "results"

__all__ = [
    "DEFAULT_RESULTS",
    "E2E_RATIO_IMPLS",
    "REPO",
    "Result",
    "detect_kind",
    "e2e_summary",
    "load_file",
    "load_results",
]

# The implementations ``bench.e2e.run`` states ratios of median step times against (``vs_<impl>`` keys).
E2E_RATIO_IMPLS = ("fsdp2", "fairscale", "shardfuse", "shardfuse-ref", "baseline")


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


# ------------------------------------------------------------------------------------------------ e2e rounds


def _pos(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or math.isinf(v) or v <= 0:
        return None
    return float(v)


def e2e_summary(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Per (impl, regime) medians over the interleaved rounds of an e2e file (``bench.e2e.run --rounds N``).

    The file's own ``summary`` when it has one; else one computed from the rows that carry a ``round`` key, as
    ``bench.e2e.run.summarize`` does (a file written mid-run has rows but no summary yet); ``[]`` for a file of
    one run without rounds (the older layout). Each entry has ``impl``, ``regime``, ``rounds``,
    ``step_ms_median``, ``step_ms_min``, ``step_ms_max``, ``tok_s_gpu_median``, ``peak_gib_max`` (where
    measured) and ``vs_<other>`` for every other implementation of ``E2E_RATIO_IMPLS`` measured in that
    regime: the other's median step time divided by this one's (above 1 this one is faster). Ratios the stored
    summary lacks are filled in from its medians; stored ones are kept as they are.
    """
    stored = data.get("summary")
    entries: list[dict[str, Any]] = []
    if isinstance(stored, list):
        entries = [
            dict(e)
            for e in stored
            if isinstance(e, dict) and e.get("impl") and e.get("regime") and _pos(e.get("step_ms_median"))
        ]
    if not entries:
        rows = data.get("results")
        rows = [r for r in rows if isinstance(r, dict)] if isinstance(rows, list) else []
        by: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for r in rows:
            if "round" in r and r.get("impl") and r.get("regime") and _pos(r.get("step_ms")):
                by.setdefault((str(r["impl"]), str(r["regime"])), []).append(r)
        for (impl, regime), runs in by.items():
            ms = [float(x["step_ms"]) for x in runs]
            tok = [float(x["tok_s_gpu"]) for x in runs if _pos(x.get("tok_s_gpu"))]
            peaks = [float(x["peak_gib"]) for x in runs if _pos(x.get("peak_gib"))]
            entry: dict[str, Any] = {
                "impl": impl,
                "regime": regime,
                "rounds": len(ms),
                "step_ms_median": statistics.median(ms),
                "step_ms_min": min(ms),
                "step_ms_max": max(ms),
            }
            if tok:
                entry["tok_s_gpu_median"] = statistics.median(tok)
            if peaks:
                entry["peak_gib_max"] = max(peaks)
            entries.append(entry)
    medians = {(e["impl"], e["regime"]): float(e["step_ms_median"]) for e in entries}
    for e in entries:
        for other in E2E_RATIO_IMPLS:
            theirs = medians.get((other, e["regime"]))
            if other != e["impl"] and theirs is not None and _pos(e.get(f"vs_{other}")) is None:
                e[f"vs_{other}"] = theirs / float(e["step_ms_median"])
    return entries
