"""Time every kernel family against the PyTorch sequences it replaces and this GPU's copy bandwidth.

    python -m bench.kernels.run [--sizes 1M,16M,64M,256M,512M] [--families cast,chunk_cat,...] [--no-crossover]
                                [--rounds 3]

(from the repository root). After the size sweep, the families that have a dispatch rule (a point past
which the PyTorch op is faster and runs instead) time cases on both sides of it (``crossover_cases``).

Times are medians of CUDA-event timings (``triton.testing.do_bench``), taken in ``--rounds`` rounds per case with
the implementations interleaved (shardfuse, then each baseline, then again): a row's time is the median of its
rounds, and the rounds' min and max are kept (``*_spread``), so one noisy timing on a shared host moves no speedup
by itself. A case whose every timing is under 20 us gets 7 rounds in all (``FLOOR_ROUNDS``), one whose rounds
disagree by more than 20% 9 (``NOISY_ROUNDS``; the row's ``rounds``).
GB/s counts the fewest bytes the operation must move (each input read once, each output written once), so a
multi-pass baseline scores lower for the extra passes it makes. Writes ``bench/results/<gpu>/kernels.json`` (or
under $BENCH_OUT), with ``kernels_source``: the digest of the kernels' code the crossover fit pools runs by
(``bench.kernels.crossover.run_files``).
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib
import statistics
from collections.abc import Callable
from typing import Any

import torch

from bench.common import copy_bandwidth_gbps, write_result
from bench.kernels.cases import FORCED_PATHS, ForcedPath, KernelCase
from bench.kernels.crossover import kernels_source_digest

FAMILY_MODULES = (
    "bench_cast", "bench_flatten", "bench_grad_divide", "bench_chunk_cat", "bench_concat", "bench_fp8",
)
DEFAULT_SIZES = "1M,16M,64M,256M,512M"
SHARDFUSE = "\0shardfuse"  # the case's own entry in the interleaved timings (no baseline label starts with NUL)
# A case whose every timing is under FLOOR_MS gets FLOOR_ROUNDS rounds in all: at a few microseconds a round's median
# moves by ~0.6 us (10%) from round to round for the same work (concat_microbatches runs torch.cat(out=) itself there,
# and timed 7.6 against 7.0 us for the bare call, 6.9-7.7 over three rounds each, at f19e517), while such rounds
# cost milliseconds. More rounds narrow the median; both sides get the same number.
FLOOR_MS = 0.02
FLOOR_ROUNDS = 7
# A case whose rounds disagree, some implementation's slowest round more than NOISY_SPREAD x its fastest, gets
# NOISY_ROUNDS rounds in all: a round is one do_bench window per implementation, and on a shared host the load
# moves between windows (the list cast_shards of 1000 tensors, which runs torch._foreach_copy_ itself, took 262.3-384.4
# us over three rounds against 260.5-371.1 for the bare call at 3805688: medians 355.2 and 265.6). Both sides alike.
NOISY_SPREAD = 1.2
NOISY_ROUNDS = 9


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def time_ms(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


def interleaved_ms(fns: dict[str, Callable[[], object]], rounds: int,
                   timer: Callable[[Callable[[], object]], float]) -> dict[str, list[float]]:
    """Each of ``fns`` timed ``rounds`` times, the implementations interleaved round by round."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    times: dict[str, list[float]] = {label: [] for label in fns}
    for _ in range(rounds):
        for label, fn in fns.items():
            if isinstance(fn, ForcedPath):  # the path forced once around the timing, not in every timed call
                with fn.forcing():
                    times[label].append(timer(fn.fn))
            else:
                times[label].append(timer(fn))
    return times


def _rounds_wanted(times: dict[str, list[float]], rounds: int, floor_rounds: int) -> int:
    """Rounds in all for a case after its first ``rounds`` (more than one): more at the timer's floor and where the
    rounds disagree (``FLOOR_MS``, ``NOISY_SPREAD``)."""
    if rounds < 2:
        return rounds
    wanted = rounds
    if max(t for ts in times.values() for t in ts) < FLOOR_MS:
        wanted = max(wanted, floor_rounds)
    if any(max(ts) > NOISY_SPREAD * min(ts) for ts in times.values()):
        wanted = max(wanted, NOISY_ROUNDS)
    return wanted


def run_case(case: KernelCase, copy_gbps: float, rounds: int = 1, timer=None, floor_rounds: int = FLOOR_ROUNDS) -> dict:
    """One case's row: ``rounds`` interleaved rounds (where ``rounds`` is more than one: ``floor_rounds`` in all where
    every timing is under FLOOR_MS, NOISY_ROUNDS where the rounds disagree), the median of each implementation's
    rounds and their spread."""
    row: dict[str, Any] = {
        "family": case.family,
        "name": case.name,
        "numel": case.numel,
        "num_tensors": case.num_tensors,
        "bytes": case.bytes_moved,
        "rounds": rounds,
    }
    fns = {SHARDFUSE: case.shardfuse, **case.baselines}
    times = interleaved_ms(fns, rounds, timer or time_ms)
    wanted = _rounds_wanted(times, rounds, floor_rounds)
    if wanted > rounds:
        for label, more in interleaved_ms(fns, wanted - rounds, timer or time_ms).items():
            times[label] += more
        row["rounds"] = wanted
    ms = statistics.median(times[SHARDFUSE])
    row["shardfuse_ms"] = ms
    row["shardfuse_ms_spread"] = [min(times[SHARDFUSE]), max(times[SHARDFUSE])]
    row["shardfuse_gbps"] = case.bytes_moved / (ms * 1e-3) / 1e9
    row["pct_copy_bw"] = 100.0 * row["shardfuse_gbps"] / copy_gbps
    baselines: dict[str, dict[str, Any]] = {}
    row["baselines"] = baselines
    for label in case.baselines:
        b_ms = statistics.median(times[label])
        baselines[label] = {"ms": b_ms, "speedup": b_ms / ms, "ms_spread": [min(times[label]), max(times[label])]}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help="comma-separated element counts (K/M/G suffixes)")
    parser.add_argument("--families", default="", help="bench modules to run, e.g. cast,chunk_cat (default: all)")
    parser.add_argument("--no-crossover", action="store_true", help="skip the cases around the dispatch rules")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds per case (median kept)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if not torch.cuda.is_available():
        raise SystemExit("python -m bench.kernels.run needs a CUDA GPU")

    sizes = [parse_size(s) for s in args.sizes.split(",") if s]
    wanted = {f.strip() for f in args.families.split(",") if f.strip()}
    copy_gbps = copy_bandwidth_gbps()
    print(f"device copy bandwidth: {copy_gbps:.0f} GB/s", flush=True)

    rows = []
    modules = [
        importlib.import_module(f"bench.kernels.{m}")
        for m in FAMILY_MODULES
        if not wanted or m.removeprefix("bench_") in wanted or m in wanted
    ]
    for module in modules:
        for size in sizes:
            # Build one size at a time so the largest cases never share memory with others.
            rows += run_cases(module, functools.partial(module.cases, [size]), f"n={size}", copy_gbps, args.rounds)
    if not args.no_crossover:
        for module in modules:
            if hasattr(module, "crossover_cases"):
                rows += run_cases(module, module.crossover_cases, "crossover", copy_gbps, args.rounds)

    path = write_result("kernels", {"copy_bandwidth_gbps": copy_gbps, "sizes": sizes, "rounds": args.rounds,
                                    "kernels_source": kernels_source_digest(), "rows": rows})
    print(f"wrote {path}")
    print_summary(rows, copy_gbps)


def run_cases(module, build, what: str, copy_gbps: float, rounds: int = 1) -> list[dict]:
    """Build one batch of cases (skipped when it does not fit in memory), time them, print a line each."""
    try:
        cases = build()
    except torch.cuda.OutOfMemoryError:
        print(f"{module.__name__} {what}: out of memory, skipped", flush=True)
        return []
    rows = []
    for case in cases:
        row = run_case(case, copy_gbps, rounds)
        rows.append(row)
        base = ", ".join(f"{k} x{v['speedup']:.2f}" for k, v in row["baselines"].items())
        print(
            f"{case.family:12s} {case.name:40s} {row['shardfuse_gbps']:7.0f} GB/s "
            f"{row['pct_copy_bw']:5.1f}% copy  [{base}]",
            flush=True,
        )
    del cases
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def print_summary(rows: list[dict], copy_gbps: float) -> None:
    """The short table: per family, worst % of copy bandwidth at >= 64 MB and worst speedup over baselines."""
    print(f"\n== kernel summary (copy bandwidth {copy_gbps:.0f} GB/s)")
    print(f"{'family':14s} {'min %copy >=64MB':>17s} {'min speedup':>12s} {'max speedup':>12s}")
    for family in dict.fromkeys(r["family"] for r in rows):
        fam = [r for r in rows if r["family"] == family]
        big = [r["pct_copy_bw"] for r in fam if r["bytes"] >= 64e6]
        # Over the PyTorch sequences replaced; the forced paths of a dispatching entry point are not ones.
        speedups = [b["speedup"] for r in fam for k, b in r["baselines"].items() if k not in FORCED_PATHS]
        print(
            f"{family:14s} {min(big) if big else float('nan'):16.1f}% "
            f"{min(speedups) if speedups else float('nan'):11.2f}x {max(speedups) if speedups else float('nan'):11.2f}x"
        )


if __name__ == "__main__":
    main()
