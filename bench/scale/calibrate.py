"""Calibration of :mod:`bench.scale.model` on what was measured on the 2-GPU (and 4-GPU) H200 machines.

* NVLink all-gather / reduce-scatter: the bus bandwidths of ANCHORS.md (NCCL 2.28.9, NV18), fitted to
  ``t = (k - 1) alpha + (k - 1) / k * B / bw`` by least squares on the relative error.
* Achieved FLOP/s: the one-GPU 8K step of the 953M decoder (``e2e_2gpu.json``, impl ``baseline``, mean of the
  rounds) minus its AdamW step, divided into the step's FLOPs.
* AdamW time per parameter: the profiled ``Optimizer.step#AdamW.step`` of shardfuse at 2 GPUs
  (``logs/h200x2-profile.log``; each rank holds half of the parameters).
* Host time per FSDP unit: the median host enqueue time of a shardfuse step at 2 GPUs, 1K tokens
  (``logs/h200x2-host-profile.log``), over the 17 units of the 953M decoder.

The measured 2-GPU steps that validate the model (:func:`validation_points`) are the ``shardfuse`` rows of
``e2e_2gpu.json`` (8K and 1K) and ``e2e_7b_2gpu.json`` (4K), mean over rounds.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from statistics import mean
from typing import Any

from bench.scale.model import MODELS, Calibration, Hardware, Link

__all__ = [
    "ANCHOR_AG_BUSBW",
    "ANCHOR_RS_BUSBW_1GB",
    "Measured",
    "ValidationPoint",
    "fit_link",
    "nvlink_fits",
    "load_measured",
    "make_calibration",
    "make_hardware",
    "validation_points",
]

REPO = Path(__file__).resolve().parents[2]
MB = 2**20
GB = 2**30
# ANCHORS.md (2026-11-22, H200, NCCL 2.28.9): all-gather bf16 bus bandwidth GB/s by message size, per ring size
ANCHOR_AG_BUSBW: dict[int, list[tuple[int, float]]] = {
    2: [(16 * MB, 121.0), (64 * MB, 193.0), (256 * MB, 236.0), (1 * GB, 266.0)],
    4: [(16 * MB, 121.0), (64 * MB, 216.0), (256 * MB, 269.0), (1 * GB, 322.0)],
}
# reduce-scatter fp32 bus bandwidth at 1 GB, GB/s
ANCHOR_RS_BUSBW_1GB: dict[int, float] = {2: 278.0, 4: 334.0}

# Used only when the logs below are missing (the values they held on 2026-11-23).
FALLBACK_OPTIMIZER_MS_2GPU = 10.45
FALLBACK_HOST_ENQUEUE_MS = 73.6
FALLBACK_ONE_GPU_8K_MS = 155.2


@dataclass(frozen=True)
class ValidationPoint:
    label: str
    model: str
    tokens: int
    seq: int
    measured_ms: float
    source: str


@dataclass(frozen=True)
class Measured:
    """The raw numbers the calibration uses, with where each came from."""

    one_gpu_8k_ms: float
    optimizer_ms_2gpu: float
    host_enqueue_ms: float
    sources: dict[str, str]


def fit_link(points: list[tuple[int, float]], k: int) -> Link:
    """Fit ``t = (k-1) alpha + x / bw`` (``x`` the bus bytes, ``(k-1)/k`` of the buffer) to ``(bytes, busbw GB/s)``
    points by least squares on the relative error (weights 1/t^2); alpha is kept >= 0."""
    xs = [(k - 1) / k * b for b, _ in points]
    ts = [x / (bw * 1e9) for x, (_, bw) in zip(xs, points)]
    ws = [1.0 / t**2 for t in ts]
    sw = sum(ws)
    swx = sum(w * x for w, x in zip(ws, xs))
    swt = sum(w * t for w, t in zip(ws, ts))
    swxx = sum(w * x * x for w, x in zip(ws, xs))
    swxt = sum(w * x * t for w, x, t in zip(ws, xs, ts))
    slope = (sw * swxt - swx * swt) / (sw * swxx - swx * swx)
    intercept = (swt - slope * swx) / sw
    if intercept < 0:
        intercept, slope = 0.0, swxt / swxx
    return Link(alpha_s=intercept / (k - 1), bw_bps=1.0 / slope)


def nvlink_fits() -> tuple[dict[int, Link], dict[int, Link]]:
    """(all-gather, reduce-scatter) NVLink links per ring size. Reduce-scatter has one measured size (1 GB): it
    keeps the all-gather alpha and takes the bandwidth that reproduces its 1 GB point."""
    ag = {k: fit_link(pts, k) for k, pts in ANCHOR_AG_BUSBW.items()}
    rs: dict[int, Link] = {}
    for k, busbw in ANCHOR_RS_BUSBW_1GB.items():
        x = (k - 1) / k * GB
        t = x / (busbw * 1e9)
        rs[k] = Link(ag[k].alpha_s, x / (t - (k - 1) * ag[k].alpha_s))
    return ag, rs


def make_hardware(
    inter_gbps: float, inter_alpha_us: float, gpus_per_node: int, intra_gbps: float | None = None
) -> Hardware:
    """NVLink from the fits (or a flat ``intra_gbps`` bus bandwidth in GB/s); the network link is an input:
    ``inter_gbps`` Gb/s per GPU (400 = InfiniBand NDR = 50 GB/s) and ``inter_alpha_us`` per ring step."""
    ag, rs = nvlink_fits()
    if intra_gbps is not None:
        ag = {k: Link(v.alpha_s, intra_gbps * 1e9) for k, v in ag.items()}
        rs = {k: Link(v.alpha_s, intra_gbps * 1e9) for k, v in rs.items()}
    inter = Link(inter_alpha_us * 1e-6, inter_gbps / 8 * 1e9)
    return Hardware(ag_intra=ag, rs_intra=rs, inter=inter, gpus_per_node=gpus_per_node)


def _shardfuse_mean(path: Path, regime: str) -> float | None:
    data: dict[str, Any] = json.loads(path.read_text())
    rows = [r["step_ms"] for r in data.get("results", []) if r.get("impl") == "shardfuse" and r.get("regime") == regime]
    return mean(rows) if rows else None


def _baseline_mean(path: Path, regime: str) -> float | None:
    data: dict[str, Any] = json.loads(path.read_text())
    rows = [r["step_ms"] for r in data.get("results", []) if r.get("impl") == "baseline" and r.get("regime") == regime]
    return mean(rows) if rows else None


def _rel(path: Path) -> str:
    """``path`` relative to the repository root when inside it (records carry no machine paths)."""
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def _grep_ms(path: Path, pattern: str) -> float | None:
    if not path.is_file():
        return None
    m = re.search(pattern, path.read_text(errors="replace"))
    return float(m.group(1)) if m else None


def load_measured(results: Path) -> Measured:
    """Read the calibration numbers from ``results`` (``bench/results``: ``h200/`` and ``logs/``)."""
    e2e = results / "h200" / "e2e_2gpu.json"
    prof = results / "logs" / "h200x2-profile.log"
    host = results / "logs" / "h200x2-host-profile.log"
    one = _baseline_mean(e2e, "8k") if e2e.is_file() else None
    opt = _grep_ms(prof, r"([\d.]+) ms\s+[\d.]+x\s+Optimizer\.step#AdamW\.step")
    enq = _grep_ms(host, r"shardfuse: median host enqueue ([\d.]+) ms")
    sources = {
        "one_gpu_8k_ms": f"{_rel(e2e)} baseline 8k, mean of rounds" if one else "fallback constant",
        "optimizer_ms_2gpu": f"{_rel(prof)} Optimizer.step#AdamW.step (shardfuse 1k)" if opt else "fallback constant",
        "host_enqueue_ms": f"{_rel(host)} shardfuse median host enqueue" if enq else "fallback constant",
    }
    return Measured(
        one_gpu_8k_ms=one or FALLBACK_ONE_GPU_8K_MS,
        optimizer_ms_2gpu=opt or FALLBACK_OPTIMIZER_MS_2GPU,
        host_enqueue_ms=enq or FALLBACK_HOST_ENQUEUE_MS,
        sources=sources,
    )


def make_calibration(m: Measured) -> Calibration:
    bench = MODELS["953m"]
    opt_per_param = m.optimizer_ms_2gpu * 1e-3 / (bench.params / 2)
    compute_8k = m.one_gpu_8k_ms * 1e-3 - opt_per_param * bench.params
    flops = bench.flops_per_token(2048) * 4 * 2048 / compute_8k
    host = m.host_enqueue_ms * 1e-3 / bench.units
    return Calibration(achieved_flops=flops, optimizer_s_per_param=opt_per_param, host_s_per_unit=host)


def validation_points(results: Path) -> list[ValidationPoint]:
    """The stored 2-GPU shardfuse steps (eager, foreach AdamW), mean over rounds."""
    out: list[ValidationPoint] = []
    specs = [
        ("953M 8K tok/GPU", "953m", "e2e_2gpu.json", "8k", 8192, 2048),
        ("953M 1K tok/GPU", "953m", "e2e_2gpu.json", "1k", 1024, 1024),
        ("7B 4K tok/GPU", "7b", "e2e_7b_2gpu.json", "4k", 4096, 4096),
    ]
    for label, model, name, regime, tokens, seq in specs:
        path = results / "h200" / name
        ms = _shardfuse_mean(path, regime) if path.is_file() else None
        if ms is not None:
            out.append(ValidationPoint(label, model, tokens, seq, ms, f"{_rel(path)} shardfuse {regime}"))
    return out
