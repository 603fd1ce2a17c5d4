"""The page's section of a ``spec_finetune*.json`` (``python -m bench.offload.spec_finetune``): speculative clipping
on an offloaded fine-tune, plain against speculative, at the fine-tune's clip and at a clip the norms stay under,
each judged against the floor measured in the same process."""

from __future__ import annotations

from typing import Any

from bench.report._common import env_line, fmt, table
from bench.results_io import Result

HEADER = ["clip", "speculative_clip", "steps", "median ms", "min-max ms", "clipping fired", "committed",
          "vs clipped floor", "vs overlapped floor"]
ALIGN = ["r", "l", "r", "r", "r", "r", "r", "r", "r"]


def _row(row: dict[str, Any]) -> list[Any]:
    steps = row.get("steps", 0)
    committed = "-"
    if row.get("speculative_clip"):
        committed = f"{row.get('finetune_steps_committed', 0):.0f}/{steps}"
        paused = row.get("finetune_steps_paused", 0)
        committed += f" ({paused:.0f} paused)" if paused else ""
    return [f"{row.get('max_norm', float('nan')):.3g}", "yes" if row.get("speculative_clip") else "no", steps,
            f"{row['step_ms']:.1f}", f"{row['step_ms_min']:.0f}-{row['step_ms_max']:.0f}",
            f"{row.get('clip_fired', 0)}/{steps}", committed, fmt(row.get("vs_clipped_floor"), ".2f", "x"),
            fmt(row.get("vs_overlap_floor"), ".2f", "x")]


def _floor_line(floor: dict[str, Any]) -> str:
    terms = [f"{label} {floor[key]:.1f} ms" for key, label in (("fwd_ms", "forward"), ("bwd_ms", "backward"),
                                                               ("cpu_opt_ms", "CPU AdamW alone"),
                                                               ("pcie_ms", "PCIe"))
             if isinstance(floor.get(key), (int, float))]
    text = f"Floor, measured in the same process ({floor.get('threads', '?')} threads): " + ", ".join(terms)
    if isinstance(floor.get("clipped_floor_ms"), (int, float)):
        text += f"; clipped floor (backward + host update) {floor['clipped_floor_ms']:.1f} ms"
    if isinstance(floor.get("overlap_floor_ms"), (int, float)):
        text += f"; overlapped floor (the largest term) {floor['overlap_floor_ms']:.1f} ms"
    return text + "."


def spec_finetune_section(res: Result) -> list[str]:
    d = res.data
    cfg = d.get("config", {})
    rows = [r for r in d.get("rows", []) if isinstance(r, dict) and r.get("step_ms") is not None]
    commit = d.get("commit") or {}
    rows += [r for r in commit.get("rows", []) if isinstance(r, dict) and r.get("step_ms") is not None]
    lines = [f"### Speculative clipping on an offloaded fine-tune (`{res.name}.json`)", "", env_line(res.env), "",
             f"`python -m bench.offload.spec_finetune`: HF Llama `{cfg.get('config', '?')}` fully offloaded "
             f"(`move_params_to_cpu`, `OffloadOptimizer(gpu_budget_gib=0)`, fused CPU AdamW), pre-trained "
             f"{cfg.get('pretrain_steps', '?')} steps resident on prose, then fine-tuned on code at "
             f"{cfg.get('seq', '?')} tokens a step, plain and with `speculative_clip=True` from the same weights; "
             "then the same pair at a clip the norms stay under (the case where speculation commits). Median step "
             f"time after {cfg.get('skip', '?')} steps.", ""]
    shared = (d.get("measured") or {}).get("host_shared") or (d.get("host") or {}).get("host_shared")
    if shared:
        why = shared if isinstance(shared, str) else "BENCH_HOST_SHARED was set: another job ran on this host"
        lines += [f"Measured on a shared host ({why}): read the step times as such.", ""]
    if isinstance(d.get("floor"), dict):
        lines += [_floor_line(d["floor"]), ""]
    pairs = [("at the fine-tune's clip", d.get("losses_equal"))]
    pairs += [("at the commit clip", commit.get("losses_equal"))] if commit else []
    said = [f"{'the same bits' if equal else 'DIFFERENT'} {where}" for where, equal in pairs if equal is not None]
    lines += [*table(HEADER, [_row(r) for r in rows], ALIGN), "",
              "Fine-tune losses of the speculative run against the plain one: " + "; ".join(said) + ".", ""]
    return lines
