"""The page's parts for issue 31's captured-step table: the many-shape SFT file's loss check and the captured
step's profile (``overlap_captured_<N>gpu.json``, ``bench.e2e.overlap --captured``)."""

from __future__ import annotations

from typing import Any

from bench._results_fields import num
from bench.report._common import DASH, env_line, fmt, table
from bench.results_io import Result

STEPS = (("eager", "shardfuse, eager"), ("captured", "shardfuse, captured"), ("baseline", "one GPU, captured"))
COLLECTIVES = (("allgather", "all-gather"), ("reducescatter", "reduce-scatter"))


def _ms(v: Any) -> str:
    us = num(v)
    return fmt(None if us is None else us / 1e3, ".2f")


def _signed_ms(v: Any) -> str:
    us = num(v)
    return DASH if us is None else f"{us / 1e3:+.2f}"


def sft_loss_lines(data: dict[str, Any]) -> list[str]:
    """Whether the eager and the captured SFT loops gave equal losses, round by round (``bench.e2e.sft``)."""
    checks = [c for c in data.get("sft") or [] if isinstance(c, dict)]
    if not checks:
        return []
    parts = []
    for c in checks:
        diff = num(c.get("max_rel_loss_diff"))
        if c.get("losses_equal") is True:
            parts.append(f"round {c.get('round', '?')}: equal")
        else:
            parts.append(f"round {c.get('round', '?')}: different" + ("" if diff is None else f" (largest relative "
                                                                       f"difference {diff:.1e})"))  # fmt: skip
    return ["Losses of the eager and the captured SFT loop on the same batches, every timed step: "
            + "; ".join(parts) + ".", ""]  # fmt: skip


def _split_row(label: str, s: dict[str, Any]) -> list[str]:
    coll = s.get("collectives") if isinstance(s.get("collectives"), dict) else {}
    shares = []
    for key, _ in COLLECTIVES:
        share = num((coll.get(key) or {}).get("overlapped_share")) if isinstance(coll.get(key), dict) else None
        shares.append(DASH if share is None else f"{100 * share:.0f}%")
    return [label, _ms(s.get("span_us")), _ms(s.get("compute_us")), _ms(s.get("exposed_comm_us")),
            _ms(s.get("idle_us")), *shares]  # fmt: skip


def overlap_section(res: Result) -> list[str]:
    """The captured step split into compute, exposed communication and idle, beside the eager and the one-GPU
    captured step; the gap to the one-GPU step split the same way; the kernels that add the most time."""
    d = res.data
    cfg = d.get("config") if isinstance(d.get("config"), dict) else {}
    world = cfg.get("world_size")
    lines = [f"### Profile of the captured step, {world} GPUs (`{res.name}.json`)", "", env_line(res.env), ""]
    lines += [f"Setup: `{cfg.get('model_kind', '?')}` model `{cfg.get('model', '?')}`, batch {cfg.get('batch', '?')} x "
              f"seq {cfg.get('seq', '?')} per GPU, {cfg.get('optimizer', '?')}; the median of "
              f"{cfg.get('replays', '?')} profiled steps (CUPTI kernel records); communication told apart by kernel "
              f"name (a replayed graph hides its streams).", ""]  # fmt: skip
    body = [_split_row(label, d[key]) for key, label in STEPS if isinstance(d.get(key), dict)]
    header = ["step", "span ms", "compute ms", "exposed communication ms", "idle ms"]
    lines += table(header + [f"{name} overlapped by compute" for _, name in COLLECTIVES], body) + [""]
    g = d.get("gap")
    if isinstance(g, dict):
        lines += [f"Gap to the one-GPU captured step: {_signed_ms(g.get('gap_us'))} ms = compute "
                  f"{_signed_ms(g.get('compute_delta_us'))} + exposed communication "
                  f"{_signed_ms(g.get('exposed_comm_delta_us'))} + idle {_signed_ms(g.get('idle_delta_us'))} ms.",
                  ""]  # fmt: skip
    top = [k for k in d.get("top_kernels") or [] if isinstance(k, dict)]
    if top:
        what = ("add the most time over the one-GPU step" if isinstance(d.get("baseline"), dict)
                else "take the most time")
        lines += [f"Compute kernels that {what} (by name, per step):", ""]
        rows = [[f"`{str(k.get('name', '?'))[:90]}`", str(k.get("count", DASH)), _ms(k.get("us")),
                 _ms(k.get("base_us")), _signed_ms(k.get("delta_us"))] for k in top]  # fmt: skip
        lines += table(["kernel", "launches", "ms", "one GPU ms", "added ms"], rows) + [""]
    if d.get("host_load"):
        lines += [f"_Measured on a loaded host: {d['host_load']}._", ""]
    return lines
