"""The page's section of an offload file (``bench.offload.run``)."""

from __future__ import annotations

from pathlib import Path

from bench.report._common import DASH, OFFLOAD_LABEL, OFFLOAD_ORDER, env_line, fmt, notes_block, ordered, rel, table
from bench.report._plots import Plotter
from bench.results_io import CappedRun, OffloadConfig, OffloadVariant, Result


def _q(v: object) -> object:
    return "?" if v is None else v


def _setup_line(cfg: OffloadConfig) -> list[str]:
    if not cfg.present:
        return []
    width = _q(cfg.width)
    model = (
        f"{_q(cfg.layers)} x (Linear({width}, {width}) + ReLU)"
        + (f", {cfg.params_m:.0f}M fp32 parameters" if cfg.params_m else "")
        + (f" ({cfg.model_gib:.2f} GiB)" if cfg.model_gib else "")
    )
    return [
        f"Setup: {model}; batch {_q(cfg.batch)}; SGD; {_q(cfg.slices)} slices, "
        f"{_q(cfg.microbatches)} microbatches, activation checkpointing; mean of "
        f"{_q(cfg.steps)} steps after {_q(cfg.warmup)} warm-up.",
        "",
    ]


def _variants_table(variants: dict[str, OffloadVariant]) -> list[str]:
    body, notes, estimated = [], [], False
    for name in ordered(variants, OFFLOAD_ORDER):
        v = variants[name]
        label = OFFLOAD_LABEL.get(name, name)
        if v.step_ms is None:
            body.append([label, "failed" if v.error else "skipped", DASH, DASH, DASH, DASH])
            notes.append(f"{label}: {'error' if v.error else 'skipped'}: {v.error or v.skipped or 'no measurement'}")
            continue
        mark = "*" if v.estimated_traffic else ""
        estimated |= bool(mark)
        body.append(
            [
                label,
                fmt(v.step_ms, ".1f"),
                fmt(v.vs_plain, ".2f", "x"),
                fmt(v.h2d_gbps, ".1f", mark),
                fmt(v.d2h_gbps, ".1f", mark),
                fmt(v.peak_gib, ".2f"),
            ]
        )
    lines = table(
        ["variant", "step ms", "vs plain GPU", "host->device GB/s", "device->host GB/s", "peak GPU GiB"], body
    )
    lines.append("")
    lines += notes_block(notes)
    lines.append(
        "_vs plain GPU: this step time divided by the plain GPU step time (lower is better). "
        "GB/s: bytes copied per step / step time"
        + ("; * estimated from the parameter traffic rather than counted" if estimated else "")
        + "._"
    )
    return [*lines, ""]


def _floor_table(cfg: OffloadConfig, variants: dict[str, OffloadVariant]) -> list[str]:
    """Each shardfuse variant against its PCIe floor (files written before the floor existed: nothing)."""
    names = [n for n in ordered(variants, OFFLOAD_ORDER) if variants[n].floor_ms is not None]
    if not names:
        return []
    link = (
        f"pinned host->device {fmt(cfg.link_h2d_gbps, '.1f')} GB/s, device->host {fmt(cfg.link_d2h_gbps, '.1f')} GB/s"
        + (f", {fmt(cfg.link_duplex_gbps, '.1f')} GB/s each way at once" if cfg.link_duplex_gbps else "")
    )
    lines = [f"Against the PCIe floor ({link}, measured in the same job):", ""]
    body = []
    for name in names:
        v = variants[name]
        body.append(
            [
                OFFLOAD_LABEL.get(name, name),
                fmt(v.step_ms, ".1f"),
                fmt(v.floor_h2d_gb, ".2f"),
                fmt(v.floor_d2h_gb, ".2f"),
                f"{fmt(v.floor_ms, '.1f')} ({v.floor_bound or '?'})",
                fmt(v.vs_floor, ".2f", "x"),
                fmt(v.phase_floor_ms, ".1f"),
                fmt(v.vs_phase_floor, ".2f", "x"),
            ]
        )
    header = ["variant", "step ms", "needs H2D GB", "needs D2H GB", "floor ms (bound)", "x floor", "phase floor ms",
              "x phase floor"]  # fmt: skip
    lines += table(header, body)
    lines += [
        "",
        "_needs: the bytes one steady step of the variant's schedule must move each way (parameters, fp32 masters, "
        "gradients, bf16 shadows, activations; `bench/offload/floor.py` lists them). floor: max(H2D bytes / H2D "
        "GB/s, D2H bytes / D2H GB/s, the resident step, bf16 autocast for bf16 variants). phase floor: the "
        "forward's bus time plus the backward's (a forward has nothing to send home; the backward's first copy "
        "home waits for its first gradient)._",
        "",
    ]
    return lines


def _capped_table(capped: CappedRun) -> list[str]:
    lines = ["Capped run (the process is held to a GPU memory budget smaller than the model):", ""]
    if capped.step_ms is None:
        return lines + [f"- failed: {capped.error if capped.error is not None else 'no measurement'}", ""]
    body = [
        [
            capped.model if capped.model is not None else DASH,
            fmt(capped.model_gib, ".2f"),
            fmt(capped.budget_gib, ".2f"),
            fmt(capped.model_over_budget, ".1f", "x"),
            fmt(capped.step_ms, ".1f"),
            fmt(capped.samples_per_s, ",.0f"),
            fmt(capped.peak_gib, ".2f"),
        ]
    ]
    header = ["model", "model GiB", "budget GiB", "model / budget", "step ms", "samples/s", "peak GPU GiB"]
    return lines + table(header, body) + [""]


def offload_section(res: Result, plots: Plotter, out_dir: Path) -> list[str]:
    f = res.offload()
    lines = [f"### Offload (`{res.name}.json`)", "", env_line(res.env), ""]
    lines += _setup_line(f.config)
    lines += _variants_table(f.variants) if f.variants else ["No variants in this file.", ""]
    lines += _floor_table(f.config, f.variants)
    if f.capped is not None:
        lines += _capped_table(f.capped)
    img = plots.offload(res, f.variants)
    if img is not None:
        lines += [f"![offload step time, {res.gpu}]({rel(img, out_dir)})", ""]
    return lines
