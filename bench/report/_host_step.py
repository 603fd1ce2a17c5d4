"""The page's section of a ``host_step.json`` (``python -m bench.offload.host_step``): the host optimizer's passes
on a machine's CPU, separate against chunked, at several thread counts, alone and beside pinned copies."""

from __future__ import annotations

import statistics
from typing import Any

from bench.report._common import env_line, table
from bench.results_io import Result

HEADER = ["setting", "variant", "threads", "beside copies", "ms per billion params", "min-max", "host GB/s"]
ALIGN = ["l", "l", "r", "l", "r", "r", "r"]


def _row(r: dict[str, Any], threads: Any) -> list[Any]:
    """A table row; ``threads``: the file's single thread count, for rows from before rows recorded their own."""
    runs = [float(t) for t in r.get("runs_s") or []]  # seconds per step; ms_per_billion is their median, scaled
    spread = "-"
    med = float(r["ms_per_billion"])
    if runs:
        scale = med / statistics.median(runs)
        spread = f"{min(runs) * scale:.0f}-{max(runs) * scale:.0f}"
    return [r.get("setting", "?"), r.get("variant", "?"), r.get("threads", threads),
            "yes" if r.get("with_copies") else "no", f"{med:.0f}", spread, f"{float(r.get('host_gbps', 0)):.1f}"]


def host_step_section(res: Result) -> list[str]:
    d = res.data
    rows = [r for r in d.get("rows", []) if isinstance(r, dict) and r.get("ms_per_billion") is not None]
    params = d.get("params")
    what = f"{params / 1e9:.2f}B fp32 parameters" if isinstance(params, (int, float)) else "? parameters"
    lines = [f"### Host optimizer step on this machine's CPU (`{res.name}.json`)", "", env_line(res.env), "",
             f"`python -m bench.offload.host_step`: one step of torch's fused CPU AdamW over {what}, as "
             "OffloadOptimizer steps a host shard: `separate` = clipping's scale, the update and the bf16 copy each "
             "a pass over the whole shard; `chunk=C` = the three in one pass per C-element chunk; `spec chunk=C` "
             "(`--spec`) = speculative clipping's out-of-place update (each chunk of the parameters and moments "
             "copied into spare buffers, then updated there; the originals untouched); settings: `clip+copy` = "
             "scale, update and bf16 copy, `clip` = scale and update (the clipped step without the host compute "
             "copy), `plain` = the update alone; `kernel-scale` (under `clip`) = the fused kernel divides by "
             "`1 / coef` itself (its `grad_scale`, `OffloadOptimizer(clip_in_update=True)`), one pass. "
             f"Host: {d.get('cores', '?')} cores, torch {d.get('torch', '?')}; rounds interleave the "
             "variants (median, min-max).", ""]
    if d.get("copies_gbps"):
        lines += [f"Beside copies: pinned host->device and device->host copies of 1 GiB kept running on a side "
                  f"thread, {float(d['copies_gbps']):.1f} GB/s both ways together.", ""]
    counts = d.get("threads")
    single = counts if isinstance(counts, int) else counts[0] if isinstance(counts, list) and len(counts) == 1 else "-"
    return [*lines, *table(HEADER, [_row(r, single) for r in rows], ALIGN), ""]
