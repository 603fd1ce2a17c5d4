"""What the sections of e2e files share: regime headings, the setup line, notes on the captured step's memory."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from bench.report._common import REGIME_LABEL
from bench.report._models import e2e_model
from bench.results_io import E2EConfig, E2EFile, E2ERow


def regime_shape(f: E2EFile, regime: str, rows: Sequence[E2ERow]) -> str:
    for r in rows:
        if r.regime == regime and r.batch and r.seq:
            return f"batch {r.batch} x seq {r.seq}"
    shape = f.config.regimes.get(regime)
    return f"batch {shape[0]} x seq {shape[1]}" if shape is not None else ""


def regime_heading(f: E2EFile, regime: str, rows: Sequence[E2ERow]) -> list[str]:
    shape = regime_shape(f, regime, rows)
    return [f"#### {REGIME_LABEL.get(regime, regime)}" + (f", {shape}" if shape else ""), ""]


def config_line(cfg: E2EConfig, rounds: int = 0) -> str:
    if not cfg.present:
        return ""
    bits = []
    model = e2e_model(cfg).setup
    if model:
        bits.append(model)
    if cfg.compute_dtype:
        bits.append(f"{cfg.compute_dtype} compute")
    if cfg.reduce_dtype:
        bits.append(f"{cfg.reduce_dtype} gradient reduction")
    if cfg.optimizer:
        bits.append(cfg.optimizer)
    if cfg.steps is not None:
        each = f"each round the mean of {cfg.steps} steps" if rounds > 1 else f"mean of {cfg.steps} steps"
        bits.append(f"{each} after {cfg.warmup if cfg.warmup is not None else '?'} warm-up")
    if rounds > 1:
        bits.append(f"{rounds} interleaved rounds")
    if cfg.peak_tflops:
        bits.append(f"MFU against {cfg.peak_tflops:g} TFLOP/s")
    if cfg.device and cfg.device != "cuda":
        bits.append(f"device {cfg.device} (smoke run, not a measurement)")
    return "Setup: " + "; ".join(bits) + "." if bits else ""


def captured_memory_notes(label: str, measured: Sequence[E2ERow]) -> list[str]:
    """What the peaks of the captured step mean: its graph pool where the rows carry one; without it (rows
    measured before ``bench.e2e.run`` recorded ``capture_step``'s own numbers) the peak covers the replays only."""
    pools = [r.graph_pool_gib_rank0 for r in measured if r.graph_pool_gib_rank0 is not None]
    if pools:
        return [
            f"{label}: the CUDA graph's private memory pool kept {statistics.median(pools):.2f} GiB reserved "
            f"(rank 0{', median over rounds' if len(pools) > 1 else ''})"
        ]
    if any(r.peak_gib is not None for r in measured):
        return [
            f"{label}: these rows carry no graph pool (`graph_pool_gib_rank0`): they were measured before "
            "`bench.e2e.run` recorded `capture_step`'s own memory numbers, so its peaks cover the replays only "
            "(not the warm-up, the capture or the memory the graph keeps in its private pool) and do not "
            "compare with the eager peaks"
        ]
    return []
