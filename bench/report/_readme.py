"""The short results table: the README's (between its markers) and the benchmarks page's summary."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from bench.report._common import CAPTURED, DASH, MODIFIER_SHORT, REGIME_ORDER, fmt, modifier_text, ordered, span, table
from bench.report._kernels import kernel_summary
from bench.report._models import DEFAULT_DECODER_CONFIG, e2e_model, e2e_models
from bench.report._offload_big import README_BENCH as OFFLOAD_BIG_BENCH
from bench.report._offload_big import README_NOTE as OFFLOAD_BIG_NOTE
from bench.report._offload_big import readme_rows as offload_big_rows
from bench.results_io import Result

START_MARK = "<!-- results:start -->"
END_MARK = "<!-- results:end -->"
PLACEHOLDER = "RESULTS_TABLE"

# The ratios a training row of the README table gives for shardfuse, in this order, and the columns it has.
README_RATIOS = (("fairscale", "FairScale"), ("baseline", "one GPU"), ("fsdp2", "FSDP2"))
README_COLUMNS = ("fairscale", "baseline", "fsdp2", "fsdp1")
# The row of the captured step (right after shardfuse's) gives these too, and the one against eager shardfuse.
README_CAPTURED_RATIOS = (*README_RATIOS, ("baseline-graph", "one GPU captured"), ("shardfuse", "eager shardfuse"))
README_CAPTURED_BENCH = ", step captured (capture_step)"
HEADER = ["GPU", "benchmark", "metric", "shardfuse", "FairScale", "one GPU", "FSDP2", "FSDP1"]
ALIGN = ["l", "l", "l", "r", "r", "r", "r", "r"]


def _training_cells(
    res: Result, regime: str, impl: str = "shardfuse", ratios: Sequence[tuple[str, str]] = README_RATIOS
) -> tuple[str, dict[str, str], int] | None:
    """(``impl``'s tokens/s/GPU with its ``ratios``, tokens/s/GPU per README column, rounds) for one regime of
    an e2e file: medians over rounds when it has a summary (``rounds`` > 0), else the single run's numbers."""
    f = res.e2e()
    summary = [e for e in f.summary if e.regime == regime]
    if summary:
        tok = {e.impl: e.tok_s_gpu_median for e in summary}
        ours = next((e for e in summary if e.impl == impl), None)
        ratio = {other: ours.vs.get(other) if ours else None for other, _ in ratios}
        rounds = max(e.rounds for e in summary)
    else:
        tok = {x.impl: x.tok_s_gpu for x in f.rows if x.regime == regime}
        mine = tok.get(impl)
        # same tokens per GPU and step in every implementation: the tokens/s ratio is the step time ratio
        ratio = {o: mine / t if mine and (t := tok.get(o)) else None for o, _ in ratios}
        rounds = 0
    if not any(v is not None for v in tok.values()):
        return None
    ours_text = fmt(tok.get(impl), ",.0f")
    parts = [f"{r:.2f}x {name}" for o, name in ratios if (r := ratio.get(o))]
    if ours_text != DASH and parts:
        ours_text += f" ({', '.join(parts)})"
    return ours_text, {c: fmt(tok.get(c), ",.0f") for c in README_COLUMNS}, rounds


def _has_captured(res: Result, regime: str) -> bool:
    """Whether an e2e file measured the captured step in ``regime`` (its summary, else its rows)."""
    f = res.e2e()
    summary = [e for e in f.summary if e.regime == regime]
    if summary:
        return any(e.impl == CAPTURED and e.tok_s_gpu_median for e in summary)
    return any(r.impl == CAPTURED and r.tok_s_gpu for r in f.rows if r.regime == regime)


def _e2e_rows(gpu: str, r: Result) -> list[list[str]]:
    """One row per regime of an e2e file (and one more where the captured step was measured)."""
    f = r.e2e()
    world = f.config.world_size
    model = e2e_model(f.config).short  # "" for the decoder's bench config, as the rows always were
    named = f"{model}, " if model else ""
    rows = []
    for regime in ordered({x.regime for x in f.rows} | {e.regime for e in f.summary}, REGIME_ORDER):
        size = SIZE_LABEL.get(regime, f"{regime.upper()} tokens/GPU")
        bench = f"training, {world} GPUs, {named}{size}" if world else f"training, {named}{regime}"
        kinds: list[tuple[str, Sequence[tuple[str, str]], str]] = [("shardfuse", README_RATIOS, "")]
        if _has_captured(r, regime):
            kinds.append((CAPTURED, README_CAPTURED_RATIOS, README_CAPTURED_BENCH))
        for impl, ratios, what in kinds:
            cells = _training_cells(r, regime, impl, ratios)
            if cells is None:
                continue
            ours, others, rounds = cells
            if ours == DASH and impl == "shardfuse" and len(kinds) > 1:  # only the captured step ran (HF rows)
                continue
            metric = f"tokens/s/GPU, median of {rounds} rounds" if rounds > 1 else "tokens/s/GPU"
            rows.append([gpu.upper(), bench + what, metric, ours, *(others[c] for c in README_COLUMNS)])
        best = _best_of_each_row(r, regime)
        if best is not None:
            rows.append([gpu.upper(), bench + ", best configuration of each", *best])
    return rows


SIZE_LABEL = {"sft": "many-shape SFT", "8k1": "8K tokens/GPU"}  # bench.e2e.sft's regime; batch 1 x seq 8192


def _variant_short(impl: str) -> str:
    """``shardfuse+fp8`` -> ``shardfuse (float8)``: the base and its modifiers' short names."""
    base, *mods = impl.split("+")
    return f"{base} ({', '.join(modifier_text(m, MODIFIER_SHORT) or m for m in mods)})" if mods else base


def _best_of_each_row(r: Result, regime: str) -> list[str] | None:
    """Where a file has variants (``fsdp2+fp8+ac``, ``shardfuse+fp8``): shardfuse's fastest configuration that ran
    against FSDP2's fastest (metric, shardfuse cell, one cell per README column), else None."""
    summary = [e for e in r.e2e().summary if e.regime == regime and e.tok_s_gpu_median and e.step_ms_median]
    if not any("+" in e.impl for e in summary):
        return None
    ours = [e for e in summary if e.impl.split("+")[0] in ("shardfuse", "shardfuse-budget")]
    theirs = [e for e in summary if e.impl.split("+")[0] == "fsdp2"]
    if not ours or not theirs:
        return None
    a = min(ours, key=lambda e: e.step_ms_median or 0.0)
    b = min(theirs, key=lambda e: e.step_ms_median or 0.0)
    ratio = (b.step_ms_median or 0.0) / (a.step_ms_median or 1.0)
    cell = f"{a.tok_s_gpu_median:,.0f} ({_variant_short(a.impl)}; {ratio:.2f}x FSDP2's best, {_variant_short(b.impl)})"
    others = {c: DASH for c in README_COLUMNS} | {"fsdp2": f"{b.tok_s_gpu_median:,.0f}"}
    rounds = min(a.rounds, b.rounds)
    metric = f"tokens/s/GPU, median of {rounds} rounds" if rounds > 1 else "tokens/s/GPU"
    return [metric, cell, *(others[c] for c in README_COLUMNS)]


# The offload rows: FairScale's settings (checkpointing), then the fastest fp32 setting: activations on the host,
# no recompute, optimizer in backward (with its memory, the other half of the target).
OFFLOAD_ROWS = (
    ("shardfuse", "offload, 1 GPU"),
    ("shardfuse_offload_acts_opt_in_bwd", "offload, 1 GPU, `offload_activations` + optimizer in backward"),
)


def _offload_rows(gpu: str, r: Result) -> list[list[str]]:
    variants = r.offload().variants
    ms = {k: v.step_ms for k, v in variants.items()}
    if not any(x is not None for x in ms.values()):
        return []
    plain = ms.get("plain")
    gib = {k: v.peak_gib for k, v in variants.items()}
    plain_gib = gib.get("plain")
    metric = f"step ms (plain GPU {plain:.1f})" if plain else "step ms"
    rows = []
    for variant, what in OFFLOAD_ROWS:
        step = ms.get(variant)
        ours = fmt(step, ".1f")
        if ours == DASH and variant != "shardfuse":
            continue
        if step is not None and plain:
            peak = gib.get(variant)
            ours += f" ({step / plain:.2f}x plain"
            ours += f", {peak / plain_gib:.2f}x its memory" if peak is not None and plain_gib else ""
            ours += ")"
        others = [fmt(ms.get("fairscale"), ".1f"), DASH, fmt(ms.get("fsdp2_cpu_offload"), ".1f"), DASH]
        rows.append([gpu.upper(), what, metric, ours, *others])
    return rows


def _kernel_rows(gpu: str, r: Result) -> list[list[str]]:
    summ = kernel_summary(r)
    lows = [x[2] for x in summ if x[2] is not None]
    highs = [x[3] for x in summ if x[3] is not None]
    smin = [x[4] for x in summ if x[4] is not None]
    smax = [x[5] for x in summ if x[5] is not None]
    rows = []
    if lows:
        pct = span(min(lows), max(highs), ".0f", "%")
        rows.append([gpu.upper(), "kernels, buffers >= 64 MB", "% of copy bandwidth", pct, DASH, DASH, DASH, DASH])
    if smin:
        sp = span(min(smin), max(smax), ".2f", "x")
        what = "speedup vs the PyTorch sequence replaced"
        rows.append([gpu.upper(), "kernels, all sizes", what, sp, DASH, DASH, DASH, DASH])
    return rows


def summary_rows(results: dict[str, list[Result]]) -> list[list[str]]:
    """Rows of the short table: one per (GPU, e2e file, regime), one per offload file, shardfuse's and
    shardfuse-budget's per configuration of an offload_big file, one per kernel file."""
    by_kind = {"e2e": _e2e_rows, "offload": _offload_rows, "offload_big": offload_big_rows, "kernels": _kernel_rows}
    return [row for gpu, rs in results.items() for r in rs if r.kind in by_kind for row in by_kind[r.kind](gpu, r)]


def _notes(results: dict[str, list[Result]], rows: list[list[str]]) -> tuple[str, str]:
    """The sentences on the captured-step rows and on the named models, where the table has them."""
    captured = ""
    if any(row[1].endswith(README_CAPTURED_BENCH) for row in rows):
        captured = (
            ' Rows "step captured (capture_step)": shardfuse\'s whole training step captured by `capture_step` '
            "into one CUDA graph and replayed (shardfuse column), with the same ratios and one more, against eager "
            "shardfuse."
        )
    named = [
        m
        for m in e2e_models(results)
        if any(row[1].startswith("training, ") and f" {m.short}, " in row[1] for row in rows)
    ]
    models = ""
    if named:
        models = (
            f" Training rows name their model unless it is the Llama-style decoder's `{DEFAULT_DECODER_CONFIG}` "
            "config: " + "; ".join(f'"{m.short}" = {m.about}' for m in named) + "."
        )
    return captured, models


def summary_table(results: dict[str, list[Result]], link: str | None = "docs/benchmarks.md") -> list[str]:
    """The short results table (markdown lines) for the README (``link``: to benchmarks.md) or the page itself."""
    rows = summary_rows(results)
    where = f"[{Path(link).name}]({link})" if link else "the sections below"
    if not rows:
        return [f"No benchmark results are stored yet (see {where} for how to produce them)."]
    captured, models = _notes(results, rows)
    big = OFFLOAD_BIG_NOTE if any(row[1].startswith(OFFLOAD_BIG_BENCH) for row in rows) else ""
    lines = table(HEADER, rows, ALIGN)
    lines += [
        "",
        "Ratios in parentheses: training, shardfuse's step time against FairScale's, one GPU's (the same tokens "
        "per GPU, unsharded, no communication) and FSDP2's (above 1.00x is faster; where the metric says "
        '"median of N rounds", medians over rounds interleaved in one job on noisy hosts, else one run each); '
        "offload, against the plain GPU step (lower is better). Offload columns: FSDP2 = `fully_shard` with "
        f"`CPUOffloadPolicy`, FairScale = its `OffloadModel`.{captured}{models}{big} Every number comes from "
        "`bench/results/`; "
        f"environments, spreads over rounds and details in {where}.",
    ]
    return lines


def update_readme(text: str, table_lines: Sequence[str]) -> str:
    """``text`` with the results table put between the markers (or in place of the ``RESULTS_TABLE`` line)."""
    block = "\n".join([START_MARK, *table_lines, END_MARK])
    start, end = text.find(START_MARK), text.find(END_MARK)
    if start != -1 and end != -1:
        if end < start:
            raise ValueError(f"{END_MARK!r} comes before {START_MARK!r}: fix the README by hand")
        return text[:start] + block + text[end + len(END_MARK) :]
    if start != -1 or end != -1:
        raise ValueError(f"the README has only one of {START_MARK!r} and {END_MARK!r}: add the other one")
    lines = text.split("\n")
    hits = [i for i, line in enumerate(lines) if line == PLACEHOLDER]
    if not hits:
        raise ValueError(f"the README has neither {START_MARK!r} ... {END_MARK!r} nor a line {PLACEHOLDER!r}")
    i = hits[0]
    return "\n".join(lines[:i] + [block] + lines[i + 1 :])
