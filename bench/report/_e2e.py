"""The page's section of one end-to-end training file (``bench.e2e.run``)."""

from __future__ import annotations

from pathlib import Path

from bench.report._capture import sft_loss_lines
from bench.report._common import (
    CAPTURED,
    DASH,
    IMPL_ORDER,
    REGIME_ORDER,
    env_line,
    fmt,
    notes_block,
    ordered,
    rel,
    table,
)
from bench.report._e2e_common import captured_memory_notes, config_line, regime_heading
from bench.report._models import e2e_model, impl_label
from bench.report._plots import Plotter
from bench.report._rounds import e2e_rounds_body
from bench.results_io import E2EFile, Result


def e2e_section(res: Result, plots: Plotter, out_dir: Path) -> list[str]:
    f = res.e2e()
    world = f.config.world_size
    title = f"End-to-end training, {world} GPUs" if world else "End-to-end training"
    model = e2e_model(f.config).title
    title += f", {model}" if model else ""
    lines = [f"### {title} (`{res.name}.json`)", "", env_line(res.env), ""]
    rounds = max((e.rounds for e in f.summary), default=0)
    setup = config_line(f.config, rounds)
    if setup:
        lines += [setup, ""]
    if f.summary:
        return lines + e2e_rounds_body(res, f, plots, out_dir) + sft_loss_lines(res.data)
    if not f.rows:
        return lines + ["No rows in this file.", ""]
    for regime in ordered({r.regime for r in f.rows}, REGIME_ORDER):
        lines += _single_run_regime(res, f, regime)
    lines += ["_vs FSDP2: FSDP2's step time divided by this step time (above 1.00x is faster)._", ""]
    img = plots.e2e(res, f)
    if img is not None:
        lines += [f"![tokens/s/GPU, {res.gpu} {res.name}]({rel(img, out_dir)})", ""]
    return lines


def _single_run_regime(res: Result, f: E2EFile, regime: str) -> list[str]:
    """One regime of a file of one run per implementation (no rounds): a table of the runs and their notes."""
    rr = [r for r in f.rows if r.regime == regime]
    lines = regime_heading(f, regime, rr)
    fsdp2 = next((r.step_ms for r in rr if r.impl == "fsdp2" and r.step_ms), None)
    body: list[list[str]] = []
    notes: list[str] = []
    for impl in ordered({r.impl for r in rr}, IMPL_ORDER):
        for r in (x for x in rr if x.impl == impl):
            label = impl_label(res, impl)
            step = r.step_ms
            if step is None:
                body.append([label, "failed" if r.error else "skipped", DASH, DASH, DASH, DASH])
                notes.append(f"{label}: {'error' if r.error else 'skipped'}: {r.why}")
                continue
            speed = f"{fsdp2 / step:.2f}x" if fsdp2 and impl != "baseline" else DASH
            mfu = DASH if r.mfu is None else f"{100 * r.mfu:.1f}"
            body.append([label, fmt(step, ".1f"), fmt(r.tok_s_gpu, ",.0f"), mfu, fmt(r.peak_gib, ".2f"), speed])
            if r.note:
                notes.append(f"{label}: {r.note}")
            notes += captured_memory_notes(label, [r]) if impl == CAPTURED else []
    lines += table(["implementation", "step ms", "tokens/s/GPU", "MFU %", "peak GiB", "vs FSDP2"], body)
    lines.append("")
    return lines + notes_block(notes)
