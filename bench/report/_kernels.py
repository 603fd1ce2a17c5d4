"""The page's section of a kernels file (``bench.kernels.run``)."""

from __future__ import annotations

from pathlib import Path

from bench.kernels.cases import FORCED_PATHS
from bench.report._common import DASH, KERNEL_BIG_BYTES, env_line, fmt, fmt_bytes, rel, table, variant
from bench.report._plots import Plotter
from bench.results_io import KernelRow, Result

KernelSummary = tuple[str, int, float | None, float | None, float | None, float | None]


def _speedups(rows: list[KernelRow]) -> list[float]:
    """Speedups over the PyTorch sequences replaced: a forced path of the entry point itself (``FORCED_PATHS``:
    the kernel or the PyTorch sequence whatever the crossover says) is not one."""
    return [b.speedup for r in rows for k, b in r.baselines.items() if b.speedup is not None and k not in FORCED_PATHS]


def kernel_summary(res: Result) -> list[KernelSummary]:
    """Per family: (family, cases, min and max % of copy bandwidth at >= 64 MB, min and max speedup)."""
    out = []
    for family, rows in res.kernels().families.items():
        big = [r.pct_copy_bw for r in rows if (r.bytes or 0) >= KERNEL_BIG_BYTES and r.pct_copy_bw]
        sp = _speedups(rows)
        out.append(
            (
                family,
                len(rows),
                min(big) if big else None,
                max(big) if big else None,
                min(sp) if sp else None,
                max(sp) if sp else None,
            )
        )
    return out


def _family_table(family: str, rows: list[KernelRow]) -> list[str]:
    labels = list(dict.fromkeys(k for r in rows for k in r.baselines))
    body = []
    for r in sorted(rows, key=lambda r: (variant(r.name), r.bytes or 0)):
        speedups = [fmt(b.speedup if (b := r.baselines.get(lb)) else None, ".2f", "x") for lb in labels]
        body.append(
            [
                r.name if r.name is not None else DASH,
                fmt_bytes(r.bytes),
                fmt(r.shardfuse_ms, ".4f"),
                fmt(r.shardfuse_gbps, ",.0f"),
                fmt(r.pct_copy_bw, ".1f", "%"),
                *speedups,
            ]
        )
    header = ["case", "bytes moved", "shardfuse ms", "GB/s", "% of copy BW"] + [f"vs `{lb}`" for lb in labels]
    return [f"#### `{family}`", "", *table(header, body), ""]


def kernels_section(res: Result, plots: Plotter, out_dir: Path) -> list[str]:
    lines = [f"### Kernels (`{res.name}.json`)", "", env_line(res.env), ""]
    f = res.kernels()
    copy_gbps = f.copy_bandwidth_gbps
    if copy_gbps:
        lines += [
            f"Device copy bandwidth measured in the same run (bytes read + written): **{copy_gbps:,.0f} GB/s**. "
            "GB/s counts the fewest bytes each operation must move (every input read once, every output "
            "written once); a PyTorch sequence that makes more passes scores lower for them.",
            "",
        ]
    if not f.families:
        return lines + ["No rows in this file.", ""]
    lines += [
        "Summary (large buffers are those of at least 64 MB moved; min and max speedup over the PyTorch sequences "
        "each entry point replaces, not over its own forced paths):",
        "",
    ]
    body = [
        [f"`{fam}`", n, fmt(lo, ".1f", "%"), fmt(hi, ".1f", "%"), fmt(smin, ".2f", "x"), fmt(smax, ".2f", "x")]
        for fam, n, lo, hi, smin, smax in kernel_summary(res)
    ]
    lines += table(
        ["family", "cases", "min % of copy BW, large", "max % of copy BW, large", "min speedup", "max speedup"], body
    )
    lines.append("")
    for family, rows in f.families.items():
        lines += _family_table(family, rows)
    lines += [
        "_vs X: the time of PyTorch sequence X divided by shardfuse's time for the same case (above 1.00x is faster)._",
        "",
    ]
    img = plots.kernels(res, f.families, copy_gbps)
    if img is not None:
        lines += [f"![kernel GB/s, {res.gpu}]({rel(img, out_dir)})", ""]
    return lines
