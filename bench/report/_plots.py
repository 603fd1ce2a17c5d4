"""PNG plots of the report (matplotlib, when installed)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from bench.report._common import CAPTURED, IMPL_ORDER, IMPL_SHORT, OFFLOAD_ORDER, REGIME_LABEL, REGIME_ORDER, ordered
from bench.report._common import variant as case_variant
from bench.report._models import e2e_model, ref_label
from bench.results_io import E2EFile, KernelRow, OffloadVariant, Result


def _e2e_values(
    f: E2EFile,
) -> tuple[dict[tuple[str, str], float], dict[tuple[str, str], tuple[float, float]]]:
    """tokens/s/GPU per (regime, impl): the medians over rounds with the slowest and fastest round's distance from
    them when the file has a summary, else the rows' single runs."""
    value: dict[tuple[str, str], float] = {}
    spread: dict[tuple[str, str], tuple[float, float]] = {}
    if not f.summary:
        return {(r.regime, r.impl): r.tok_s_gpu for r in f.rows if r.tok_s_gpu}, spread
    for e in f.summary:
        tok, med = e.tok_s_gpu_median, e.step_ms_median
        if not tok:
            continue
        key = (e.regime, e.impl)
        value[key] = tok
        lo_ms, hi_ms = e.step_ms_min, e.step_ms_max
        if med and lo_ms and hi_ms:  # tokens/s/GPU is inverse to the step time
            spread[key] = (tok - tok * med / hi_ms, tok * med / lo_ms - tok)
    return value, spread


class Plotter:
    """Saves PNG plots under ``img_dir`` when matplotlib is importable (and plots are wanted)."""

    def __init__(self, img_dir: Path, enabled: bool = True) -> None:
        self.img_dir = img_dir
        self.plt: Any = None
        self.reason = "" if enabled else "plots were not requested (--no-plots)"
        self.written: list[Path] = []
        if enabled:
            try:
                import matplotlib

                matplotlib.use("Agg")
                import matplotlib.pyplot as plt

                self.plt = plt
            except ImportError:
                self.reason = "matplotlib is not installed (`pip install -e .[plot]`)"

    @property
    def available(self) -> bool:
        return self.plt is not None

    def save(self, fig: Any, name: str) -> Path:
        self.img_dir.mkdir(parents=True, exist_ok=True)
        path = self.img_dir / name
        fig.tight_layout()
        # No software/date metadata: an unchanged plot stays byte-identical between runs.
        fig.savefig(path, dpi=110, metadata={"Software": None})
        self.plt.close(fig)
        self.written.append(path)
        return path

    def e2e(self, res: Result, f: E2EFile) -> Path | None:
        """Grouped bars of tokens/s/GPU per regime and implementation: the medians over rounds, with the
        tokens/s/GPU of the slowest and fastest round as error bars, when there is a ``summary``, else the rows."""
        if not self.available:
            return None
        value, spread = _e2e_values(f)
        regimes = ordered({rg for rg, _ in value}, REGIME_ORDER)
        impls = ordered({impl for _, impl in value}, IMPL_ORDER)
        if not regimes or not impls:
            return None
        fig, ax = self.plt.subplots(figsize=(7, 3.6))
        width = 0.8 / len(impls)
        for i, impl in enumerate(impls):
            xs = [j + (i - (len(impls) - 1) / 2) * width for j in range(len(regimes))]
            ys = [value.get((rg, impl), 0.0) for rg in regimes]
            label = {
                "baseline": "one GPU, unsharded",
                CAPTURED: IMPL_SHORT[CAPTURED],
                "shardfuse-ref": ref_label(res, short=True),
            }.get(impl, impl)
            err = None
            if spread:
                err = [[spread.get((rg, impl), (0.0, 0.0))[k] for rg in regimes] for k in (0, 1)]
            ax.bar(xs, ys, width, label=label, **({"yerr": err, "capsize": 2} if err else {}))
        ax.set_xticks(range(len(regimes)))
        ax.set_xticklabels([REGIME_LABEL.get(r, r) for r in regimes], fontsize=8)
        ax.set_ylabel("tokens/s/GPU")
        world = f.config.world_size if f.config.world_size is not None else "?"
        rounds = max((e.rounds for e in f.summary), default=0)
        how = f", medians of {rounds} rounds (whiskers: slowest to fastest round)" if rounds > 1 else ""
        model = e2e_model(f.config).short
        what = f"{world} GPUs, {model}" if model else f"{world} GPUs"
        ax.set_title(f"{res.gpu.upper()}: end-to-end training, {what}{how}", **({"fontsize": 9} if how else {}))
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
        return self.save(fig, f"{res.gpu}_{res.name}_tokens.png")

    def kernels(self, res: Result, families: dict[str, list[KernelRow]], copy_gbps: float | None) -> Path | None:
        """GB/s against bytes moved, one panel per kernel family: shardfuse, its baselines, the copy line."""
        if not self.available or not families:
            return None
        n = len(families)
        cols = min(3, n)
        nrows = math.ceil(n / cols)
        fig, axes = self.plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.2 * nrows), squeeze=False)
        for ax, (family, rows) in zip([a for row in axes for a in row], families.items()):
            for label, pts in _kernel_series(rows).items():
                pts.sort()
                style = "-o" if label.startswith("shardfuse") else "--x"
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label.strip(), markersize=3)
            if copy_gbps:
                ax.axhline(copy_gbps, color="black", linewidth=0.8, linestyle=":", label="device copy")
            ax.set_xscale("log")
            ax.set_title(family, fontsize=9)
            ax.set_xlabel("bytes moved", fontsize=8)
            ax.set_ylabel("GB/s", fontsize=8)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=5)
        for ax in [a for row in axes for a in row][n:]:
            ax.set_visible(False)
        return self.save(fig, f"{res.gpu}_{res.name}_gbps.png")

    def offload(self, res: Result, variants: dict[str, OffloadVariant]) -> Path | None:
        """Horizontal bars of step time per variant."""
        if not self.available:
            return None
        names = [v for v in ordered(variants, OFFLOAD_ORDER) if variants[v].step_ms]
        if not names:
            return None
        fig, ax = self.plt.subplots(figsize=(7, 0.45 * len(names) + 1.2))
        ax.barh(range(len(names)), [variants[v].step_ms for v in names])
        ax.set_yticks(range(len(names)))
        ax.set_yticklabels(names, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("step time, ms (lower is better)")
        ax.set_title(f"{res.gpu.upper()}: offload")
        ax.grid(axis="x", alpha=0.3)
        return self.save(fig, f"{res.gpu}_{res.name}_step.png")


def _kernel_series(rows: list[KernelRow]) -> dict[str, list[tuple[float, float]]]:
    """(bytes moved, GB/s) points per line of one kernel family's panel: shardfuse's and each baseline's."""
    series: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        nbytes = r.bytes
        if not nbytes:
            continue
        var = case_variant(r.name)
        if r.shardfuse_gbps:
            series.setdefault(f"shardfuse {var}", []).append((nbytes, r.shardfuse_gbps))
        for label, b in r.baselines.items():
            if b.ms:
                series.setdefault(f"{label} {var}", []).append((nbytes, nbytes / (b.ms * 1e-3) / 1e9))
    return series
