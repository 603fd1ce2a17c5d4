"""Issue 31's table from ``bench/gpu_suite.sh capture-table``: the rounds' files joined into one file per part,
and the table printed.

    python -m bench.e2e.capture_table --dir RESULTS/<gpu> --rounds 3 [--copy-to DIR] [--text FILE]

The stage runs each part once per round, interleaved (decoder, HF Llama, SFT, then the next round), every run in
its own process under ``timeout``; each writes ``ct_<part>_r<k>.json`` through ``bench.common.write_result``.
Here the rounds of one part become one e2e file with every row (``round`` = k) and the summary over rounds
(``bench.e2e.run.summarize``: medians and ratios, among them ``vs_baseline-graph``, the one-GPU captured step):
``e2e_capture_<N>gpu.json`` (the decoder), ``e2e_capture_hf_<N>gpu.json``, ``e2e_capture_sft_<N>gpu.json``; the
captured step's profile (``overlap_captured_<N>gpu.json``, ``bench.e2e.overlap --captured``) is copied as it is.
A round that failed (no file) is left out and named. ``--copy-to``: also copy the joined files there (the device
tool brings back a few files only); ``--text``: also write the table there.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

PARTS = (("decoder", "e2e_capture_{n}gpu"), ("hf", "e2e_capture_hf_{n}gpu"), ("sft", "e2e_capture_sft_{n}gpu"))
RATIOS = (("baseline-graph", "vs 1 GPU captured"), ("shardfuse", "vs eager"), ("fairscale", "vs FairScale"),
          ("fsdp2-compile", "vs FSDP2+compile"))  # fmt: skip


def join_rounds(files: list[tuple[int, dict[str, Any]]]) -> dict[str, Any]:
    """One e2e payload from the rounds' payloads (``(round, payload)``): every row with its round, the SFT loss
    checks, the summary over rounds."""
    from bench.e2e.run import summarize

    first = files[0][1]
    rows, checks = [], []
    for rnd, data in files:
        rows += [{**r, "round": rnd} for r in data.get("results", [])]
        checks += [{**c, "round": rnd} for c in data.get("sft", [])]
    out: dict[str, Any] = {"env": first.get("env", {}), "config": {**first.get("config", {}), "rounds": len(files)},
                           "results": rows}  # fmt: skip
    if checks:
        out["sft"] = checks
    out["summary"] = summarize(rows)
    return out


def load_rounds(folder: Path, part: str, rounds: int) -> tuple[list[tuple[int, dict[str, Any]]], list[int]]:
    """The rounds' payloads of one part that exist, and the rounds that have none."""
    found, missing = [], []
    for k in range(rounds):
        path = folder / f"ct_{part}_r{k}.json"
        if path.is_file():
            found.append((k, json.loads(path.read_text())))
        else:
            missing.append(k)
    return found, missing


def part_table(title: str, data: dict[str, Any]) -> list[str]:
    """Medians over rounds and the ratios of medians (> 1: this row is faster), one line per implementation."""
    lines = [f"{title}:", f"  {'impl':16s} {'rounds':>6s} {'median ms':>10s} {'min-max':>13s} {'tok/s/GPU':>10s} "
             + " ".join(f"{label:>18s}" for _, label in RATIOS)]  # fmt: skip
    for s in data["summary"]:
        ratios = " ".join(f"{s['vs_' + o]:17.2f}x" if f"vs_{o}" in s else f"{'-':>18s}" for o, _ in RATIOS)
        spread = f"{s['step_ms_min']:.1f}-{s['step_ms_max']:.1f}"
        lines.append(f"  {s['impl']:16s} {s['rounds']:6d} {s['step_ms_median']:10.1f} {spread:>13s} "
                     f"{s['tok_s_gpu_median']:10,.0f} {ratios}")
    errors = sorted({f"{r['impl']}: {r.get('error') or r.get('skipped')}" for r in data["results"]
                     if "step_ms" not in r})  # fmt: skip
    lines += [f"  not measured: {e}" for e in errors]
    loaded = sorted({r["impl"] for r in data["results"] if r.get("host_load")})
    if loaded:
        lines.append(f"  host_load set on rows of: {', '.join(loaded)} (see the rows' host_load)")
    for c in data.get("sft", []):
        lines.append(f"  round {c['round']}: eager and captured losses {'equal' if c['losses_equal'] else 'DIFFER'}"
                     f" (largest relative difference {c['max_rel_loss_diff']:.2e})")
    return lines


def overlap_table(data: dict[str, Any]) -> list[str]:
    """The profile's split of the captured step (and of its gap to the one-GPU captured step), in ms."""
    lines = ["profile of the captured step (ms):"]
    for label in ("eager", "captured", "baseline"):
        s = data.get(label)
        if not s:
            continue
        shares = ", ".join(f"{k} {100 * c['overlapped_share']:.0f}% overlapped"
                           for k, c in sorted(s["collectives"].items()))  # fmt: skip
        lines.append(f"  {label:9s} span {s['span_us'] / 1e3:6.2f}: compute {s['compute_us'] / 1e3:6.2f}, exposed "
                     f"comm {s['exposed_comm_us'] / 1e3:5.2f}, idle {s['idle_us'] / 1e3:5.2f}"
                     + (f"; {shares}" if shares else ""))  # fmt: skip
    g = data.get("gap")
    if g:
        lines.append(f"  gap to one GPU captured {g['gap_us'] / 1e3:+.2f}: compute {g['compute_delta_us'] / 1e3:+.2f},"
                     f" exposed comm {g['exposed_comm_delta_us'] / 1e3:+.2f}, idle {g['idle_delta_us'] / 1e3:+.2f}")
    for k in data.get("top_kernels", [])[:6]:
        lines.append(f"    {k['delta_us'] / 1e3:+6.2f} ({k['count']}x)  {k['name'][:80]}")
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", type=Path, required=True, help="the folder the rounds wrote into ($BENCH_OUT/<gpu>)")
    p.add_argument("--rounds", type=int, required=True)
    p.add_argument("--copy-to", type=Path, default=None)
    p.add_argument("--text", type=Path, default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    lines: list[str] = []
    written = []
    for part, pattern in PARTS:
        found, missing = load_rounds(args.dir, part, args.rounds)
        if missing:
            lines.append(f"{part}: no file for round(s) {missing} (see their logs)")
        if not found:
            continue
        data = join_rounds(found)
        path = args.dir / (pattern.format(n=data["config"].get("world_size", "?")) + ".json")
        path.write_text(json.dumps(data, indent=2) + "\n")
        written.append(path)
        lines += part_table(f"{part} ({path.name}, {len(found)} rounds)", data)
    profiles = sorted(args.dir.glob("overlap_captured_*gpu.json"))
    for path in profiles:
        written.append(path)
        lines += [f"{path.name}:", *overlap_table(json.loads(path.read_text()))]
    if args.copy_to is not None:
        args.copy_to.mkdir(parents=True, exist_ok=True)
        for path in written:
            shutil.copy(path, args.copy_to / path.name)
    text = "\n".join(lines) + "\n"
    if args.text is not None:
        args.text.write_text(text)
    print(text, end="")
    return 0 if written else 1


if __name__ == "__main__":
    raise SystemExit(main())
