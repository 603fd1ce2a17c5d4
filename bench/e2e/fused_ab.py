"""The fused gradient pre-divide (``SHARDFUSE_FUSED_GRADS``, ``sharding/core/_fused_grads.py``) on and off, side
by side: the table of the gpu_suite ``fused-ab`` stage.

The stage runs ``bench.e2e.run`` (decoder, 1K tokens/GPU, fused AdamW, shardfuse eager and captured, no one-GPU
baseline) once per round with ``SHARDFUSE_FUSED_GRADS=0`` and once with ``=1``, alternating which goes first, each
run saved as ``fused_ab_r<round>_f<0|1>.json``. This module joins those files: per implementation the median step
time and peak memory of each setting over the rounds (min-max), and off / on (> 1: the fused path is faster).

    python -m bench.e2e.fused_ab --dir "$BENCH_OUT/<gpu>" [--out fused_ab.json]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path
from typing import Any

NAME = re.compile(r"fused_ab_r(\d+)_f([01])\.json$")


def load(directory: Path) -> dict[tuple[str, int], list[dict[str, Any]]]:
    """(implementation, fused 0/1) -> one row per round: ``step_ms``, ``peak_gib``, ``round``."""
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for path in sorted(directory.glob("fused_ab_r*_f*.json")):
        match = NAME.search(path.name)
        if match is None:
            continue
        rnd, fused = int(match.group(1)), int(match.group(2))
        for row in json.loads(path.read_text())["results"]:
            if row.get("step_ms") is None:
                continue
            runs.setdefault((row["impl"], fused), []).append(
                {"round": rnd, "step_ms": float(row["step_ms"]), "peak_gib": row.get("peak_gib")})
    return runs


def _stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def compare(runs: dict[tuple[str, int], list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per implementation with both settings: medians, spreads, rounds and the off / on ratios."""
    table = []
    for impl in sorted({impl for impl, _ in runs}):
        off, on = runs.get((impl, 0)), runs.get((impl, 1))
        if not off or not on:
            continue
        row: dict[str, Any] = {"impl": impl, "rounds": (len(off), len(on))}
        for key in ("step_ms", "peak_gib"):
            a = [r[key] for r in off if r[key] is not None]
            b = [r[key] for r in on if r[key] is not None]
            if a and b:
                row[key] = {"off": _stats(a), "on": _stats(b)}
                row[f"{key}_off_over_on"] = statistics.median(a) / statistics.median(b)
        table.append(row)
    return table


def render(table: list[dict[str, Any]]) -> str:
    lines = ["| impl | rounds | step ms off (min-max) | step ms on (min-max) | off / on | peak GiB off / on |",
             "|---|---:|---:|---:|---:|---:|"]
    for row in table:
        t = row.get("step_ms")
        if t is None:
            continue
        off, on = t["off"], t["on"]
        peak = row.get("peak_gib")
        peak_txt = f"{peak['off']['median']:.2f} / {peak['on']['median']:.2f}" if peak else "-"
        lines.append(f"| {row['impl']} | {row['rounds'][0]}/{row['rounds'][1]} | {off['median']:.2f} "
                     f"({off['min']:.2f}-{off['max']:.2f}) | {on['median']:.2f} ({on['min']:.2f}-{on['max']:.2f}) | "
                     f"{row['step_ms_off_over_on']:.3f} | {peak_txt} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", type=Path, required=True, help="folder holding fused_ab_r*_f*.json")
    p.add_argument("--out", type=Path, default=None, help="write the comparison as JSON here")
    args = p.parse_args(argv)
    table = compare(load(args.dir))
    if not table:
        print(f"fused_ab: no implementation has runs with SHARDFUSE_FUSED_GRADS=0 and =1 in {args.dir}")
        return 1
    if args.out is not None:
        args.out.write_text(json.dumps({"comparison": table}, indent=1))
    print(render(table))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
