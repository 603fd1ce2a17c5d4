"""The closing table of ``bench/offload/gpu_spec_check.sh``: the host step's out-of-place update against the
in-place one per chunk, then the full clipped 2.9B steps (plain, speculation, keep, keep + speculation).

    python -m bench.offload.spec_table OUT_DIR

Reads ``OUT_DIR/host_step_spec.json`` (``bench.offload.host_step --spec``) and ``OUT_DIR/big_*.json``
(``bench.offload.big``); a file that is missing (a step that timed out) is said so, not an error.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _load(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def host_step_lines(data: dict[str, Any] | None) -> list[str]:
    """Per chunk and setting (alone / beside copies): ms per billion parameters in place and out of place."""
    if data is None:
        return ["host step: no host_step_spec.json (the sweep did not finish)"]
    plain = {(r["variant"], r["with_copies"]): r["ms_per_billion"] for r in data.get("rows", [])
             if r.get("setting") == "plain"}
    lines = [f"host step ({data.get('params', 0) / 1e9:.2f}B params, {data.get('cores', '?')} cores; ms per billion "
             "parameters): chunk | copies | in place | out of place | ratio"]
    specs = sorted((copies, int(variant.split("=", 1)[1]), ms) for (variant, copies), ms in plain.items()
                   if variant.startswith("spec "))
    for copies, chunk, spec_ms in specs:
        in_place = plain.get((f"chunk={chunk}", copies))
        ratio = f"{spec_ms / in_place:.2f}x" if in_place else "-"
        in_text = f"{in_place:.0f}" if in_place else "-"
        lines.append(f"  {chunk:>9} | {'yes' if copies else 'no':>6} | {in_text:>8} | {spec_ms:>12.0f} | {ratio}")
    lines.append(f"  fastest out-of-place chunk: {data.get('spec_fastest_chunk')}")
    return lines


def _name(r: dict[str, Any]) -> str:
    keep = r.get("keep_params_gib", 0.0)  # None: "auto"
    parts = [str(r.get("impl")), str(r.get("variant") or "clipped")]
    if keep is None or keep:
        parts.append("keep_params_gib=" + ("auto" if keep is None else f"{keep:g}"))
    if r.get("spec_chunk_elements"):
        parts.append(f"spec chunk {r['spec_chunk_elements']}")
    return ", ".join(parts)


def step_lines(name: str, data: dict[str, Any] | None) -> list[str]:
    if data is None:
        return [f"{name}: no result file (the run did not finish)"]
    out = []
    for r in data.get("results", []):
        if not r.get("step_ms"):
            out.append(f"  {_name(r)}: {r.get('status')}: {r.get('reason', '')}")
            continue
        spec = ""
        if r.get("spec_spare_gib") is not None:
            spec = (f"; spec steps committed {r.get('spec_steps_committed')}, redone {r.get('spec_steps_redone')}, "
                    f"units late {r.get('spec_units_late')}, spare {r['spec_spare_gib']:.1f} GiB")
        out.append(f"  {_name(r)}: {r['step_ms']:.0f} ms ({r.get('step_ms_min', 0):.0f}-{r.get('step_ms_max', 0):.0f}),"
                   f" GPU peak {r.get('gpu_peak_gib') or 0:.1f} GiB, host {r.get('host_rss_gib') or 0:.1f} GiB{spec}")
    return [f"{name}:", *out]


def main(argv: list[str] | None = None) -> int:
    out = Path((argv if argv is not None else sys.argv[1:] or ["out"])[0])
    lines = host_step_lines(_load(out / "host_step_spec.json"))
    for name in ("spec", "keep"):
        lines += step_lines(f"2.9b-4k, {name}", _load(out / f"big_{name}.json"))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
