"""The body of an e2e file measured in interleaved rounds: per regime a table of medians over the rounds."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path

from bench.report._common import (
    CAPTURED,
    DASH,
    IMPL_ORDER,
    REGIME_LABEL,
    REGIME_ORDER,
    fmt,
    notes_block,
    ordered,
    pct,
    rel,
    span,
    table,
)
from bench.report._e2e_common import captured_memory_notes, regime_heading
from bench.report._models import impl_label, impl_short, ref_label
from bench.report._plots import Plotter
from bench.results_io import E2EFile, E2ERow, E2ESummary, Result


def _noise_line(res: Result, rows: Sequence[E2ERow], summary: Sequence[E2ESummary], regime: str) -> str:
    """How far rounds (and steps within a round) of one implementation moved in one regime, from the data."""
    spans = [
        (pct(e.step_ms_max, e.step_ms_min), e.impl)
        for e in summary
        if e.regime == regime and e.rounds > 1 and e.step_ms_min and e.step_ms_max
    ]
    if not spans:
        return ""
    lo, hi = min(spans), max(spans)
    text = (
        f"the mean step time of one implementation moved by {lo[0]:.0f}-{hi[0]:.0f}% from its fastest to its "
        f"slowest round (most: {impl_short(res, hi[1])})"
    )
    steps: list[tuple[float, str]] = []
    for r in rows:
        ms = r.step_ms_list_rank0
        if r.regime == regime and r.round is not None and ms and all(ms):
            vals = [x for x in ms if x is not None]
            steps.append((pct(max(vals), min(vals)), r.impl))
    if steps:
        top = max(steps)
        text += f", single steps within one round by up to {top[0]:.0f}% ({impl_short(res, top[1])}, rank 0)"
    return text


def _leak_line(rows: Sequence[E2ERow]) -> str:
    """A note when the memory after wrapping the same implementation grows from round to round: something an
    earlier run left allocated then inflates every later peak."""
    after: dict[tuple[str, str], dict[int, float]] = {}
    for r in rows:
        if r.mem_after_wrap_gib_rank0 is not None and r.round is not None:
            after.setdefault((r.impl, r.regime), {})[r.round] = r.mem_after_wrap_gib_rank0
    growth = [(by[max(by)] - by[min(by)]) / (max(by) - min(by)) for by in after.values() if len(by) > 1]
    if not growth or max(growth) < 0.25:
        return ""
    everything = [v for by in after.values() for v in by.values()]
    return (
        "Memory: in this job the memory allocated right after wrapping the same implementation grew by up to "
        f"{max(growth):.2f} GiB from one round to the next (rank 0, {min(everything):.2f} to "
        f"{max(everything):.2f} GiB over the job): earlier runs left memory allocated, and it inflates the peaks "
        "of later runs. *peak GiB* is therefore the lowest peak over rounds, which still carries what the runs "
        "before it left; *peak above wrap GiB* (peak minus the memory right after wrapping, median over rounds) "
        "does not carry it, and leaves out the wrapped model itself."
    )


def _intro(res: Result, f: E2EFile, rounds: int) -> list[str]:
    """The order the job ran in (the first round's)."""
    first = [r for r in f.rows if r.round == 0]
    regimes = list(dict.fromkeys(r.regime for r in first))
    impls = list(dict.fromkeys(r.impl for r in first))
    order = " -> ".join(impl_short(res, i) for i in impls)  # short names may hold commas ("FSDP2, float8")
    regimes_text = " then ".join(REGIME_LABEL.get(x, x).split(" (")[0] for x in regimes)
    if first and rounds > 1:
        return [
            f"Each round runs {regimes_text}, every implementation once per regime in this order: {order}; "
            f"{rounds} such rounds, interleaved in one job. The tables give medians over the rounds:",
            "",
        ]
    if first:  # ``--rounds 1``: one run each, in the layout of rounds
        return [f"The job ran {regimes_text}, every implementation once per regime in this order: {order}.", ""]
    return []


def _ratio_columns(res: Result, summary: Sequence[E2ESummary]) -> list[tuple[str, str]]:
    """A ratio column per implementation measured in this file (a file without the one-GPU baseline, such as
    the 7B model's, has no column against it)."""
    measured_impls = {e.impl for e in summary}
    cols = [
        (impl, name)
        for impl, name in (("fairscale", "vs FairScale"), ("baseline", "vs one GPU"),
                           ("baseline-graph", "vs one GPU captured"), ("fsdp2", "vs FSDP2"))
        if impl in measured_impls
    ]
    if any(e.impl == CAPTURED for e in summary):
        cols.append(("shardfuse", "vs eager shardfuse"))
    if any(e.impl == "shardfuse-ref" for e in summary):
        cols.append(("shardfuse-ref", f"vs {ref_label(res, short=True)}"))
    return cols


def _medians_row(
    label: str, e: E2ESummary, measured: Sequence[E2ERow], with_wrap: bool, ratio_cols: Sequence[tuple[str, str]]
) -> list[str]:
    mfu = [r.mfu for r in measured if r.mfu is not None]
    peaks = [r.peak_gib for r in measured if r.peak_gib is not None]
    peak = min(peaks) if peaks else e.peak_gib_max
    wraps = [(r.peak_gib, r.mem_after_wrap_gib_rank0) for r in measured]
    added = [p - w for p, w in wraps if p is not None and w is not None]
    lo, hi = e.step_ms_min, e.step_ms_max
    row = [
        label,
        str(e.rounds),
        fmt(e.step_ms_median, ".1f"),
        span(lo, hi, ".1f", "") if lo is not None and hi is not None else DASH,
        fmt(e.tok_s_gpu_median, ",.0f"),
        f"{100 * statistics.median(mfu):.1f}" if mfu else DASH,
        fmt(peak, ".2f"),
    ]
    if with_wrap:
        row.append(fmt(statistics.median(added), ".2f") if added else DASH)
    return row + [fmt(e.vs.get(other), ".2f", "x") if other != e.impl else DASH for other, _ in ratio_cols]


def _rounds_named(rounds: Sequence[int | None]) -> str:
    """`` (round 2)``, `` (rounds 0, 1, 2)``, or nothing for rows without a round."""
    known = [r for r in rounds if r is not None]
    if not known:
        return ""
    return f" (round {known[0]})" if len(known) == 1 else f" (rounds {', '.join(map(str, known))})"


def _regime_table(
    res: Result, f: E2EFile, regime: str, ratio_cols: Sequence[tuple[str, str]], with_wrap: bool
) -> list[str]:
    rr = [r for r in f.rows if r.regime == regime]
    ss = {e.impl: e for e in f.summary if e.regime == regime}
    lines = regime_heading(f, regime, rr)
    body: list[list[str]] = []
    notes: list[str] = []
    for impl in ordered(set(ss) | {r.impl for r in rr}, IMPL_ORDER):
        label = impl_label(res, impl)
        mine = [r for r in rr if r.impl == impl]
        loaded: dict[str, list[int | None]] = {}  # one note per host-load text, naming its rounds
        for r in mine:
            where = f" (round {r.round})" if r.round is not None else ""
            if r.step_ms is None:
                notes.append(f"{label}: {'error' if r.error else 'skipped'}{where}: {r.why}")
            elif r.host_load:
                loaded.setdefault(r.host_load, []).append(r.round)
        notes += [f"{label}{_rounds_named(rounds)}: measured on a loaded host: {text}"
                  for text, rounds in loaded.items()]
        e = ss.get(impl)
        if e is None:
            blank = [DASH] * (5 + with_wrap + len(ratio_cols))
            body.append([label, "failed" if any(r.error for r in mine) else "skipped", *blank])
            continue
        measured = [r for r in mine if r.step_ms is not None]
        body.append(_medians_row(label, e, measured, with_wrap, ratio_cols))
        notes += captured_memory_notes(label, measured) if impl == CAPTURED else []
    header = ["implementation", "rounds", "median step ms", "min-max ms", "median tokens/s/GPU", "MFU %"]
    header += ["peak GiB"]
    header += ["peak above wrap GiB"] if with_wrap else []
    header += [c for _, c in ratio_cols]
    lines += table(header, body)
    lines.append("")
    return lines + notes_block(notes)


def _footer(f: E2EFile, rounds: int, noise: Sequence[str]) -> list[str]:
    vs_one_gpu = (
        "; vs one GPU compares with one GPU training the same tokens per GPU without communication"
        if any(e.impl == "baseline" for e in f.summary)
        else ""
    )
    if any(e.impl == "baseline-graph" for e in f.summary):
        vs_one_gpu += ("; vs one GPU captured compares with that one-GPU step captured by `capture_step` (no host "
                       "work, no communication: the limit a captured sharded step can reach)")
    if rounds > 1:
        lines = [
            f"_vs X: X's median step time divided by this one's (above 1.00x is faster): ratios of the medians over "
            f"{rounds} interleaved rounds in one job, not of single runs; min-max: the fastest and the slowest "
            f"round's mean step time; MFU %: median over rounds{vs_one_gpu}._",
            "",
        ]
    else:
        lines = [
            "_vs X: X's step time divided by this one's (above 1.00x is faster), one run each in the same job"
            f"{vs_one_gpu}._",
            "",
        ]
    if noise:
        lines += [
            "The hosts are noisy, so read differences inside the min-max spreads as ties. " + "; ".join(noise) + ".",
            "",
        ]
    leak = _leak_line(f.rows)
    return lines + ([leak, ""] if leak else [])


def e2e_rounds_body(res: Result, f: E2EFile, plots: Plotter, out_dir: Path) -> list[str]:
    """Per regime one table of medians over the interleaved rounds of one job (files with a ``summary``)."""
    rounds = max(e.rounds for e in f.summary)
    lines = _intro(res, f, rounds)
    ratio_cols = _ratio_columns(res, f.summary)
    with_wrap = any(r.mem_after_wrap_gib_rank0 is not None for r in f.rows)
    noise: list[str] = []
    for regime in ordered({e.regime for e in f.summary} | {r.regime for r in f.rows}, REGIME_ORDER):
        lines += _regime_table(res, f, regime, ratio_cols, with_wrap)
        moved = _noise_line(res, [r for r in f.rows if r.regime == regime], f.summary, regime)
        if moved:
            noise.append(f"{REGIME_LABEL.get(regime, regime).split(' (')[0]}: {moved}")
    lines += _footer(f, rounds, noise)
    img = plots.e2e(res, f)
    if img is not None:
        lines += [f"![tokens/s/GPU, {res.gpu} {res.name}]({rel(img, out_dir)})", ""]
    return lines
