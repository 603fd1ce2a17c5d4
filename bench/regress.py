"""Regression check: compare a new end-to-end or offload result with the stored one for the same GPU.

    python -m bench.regress NEW.json                       # against bench/results/<gpu>/<NEW's name>.json
    python -m bench.regress NEW.json --baseline OLD.json   # against a given file
    python -m bench.regress NEW.json --noise 0.03

Run from the repository root. ``NEW.json`` is a file written by ``bench.e2e.run``, ``bench.offload.run`` or
``bench.offload.big`` (for example from ``$OUT/work/results/<gpu>/`` after ``bench/gpu_suite.sh``). The GPU comes
from the file's ``env.gpu_key`` (else ``--gpu``, else the name of the folder it lies in); the stored result is the
file of the same name under ``--results/<gpu>/``.

Compared, lower is better, for every row: its time and its peak GPU memory (offload_big: and its host RSS).

- e2e: ``step_ms`` and ``peak_gib`` of every (implementation, regime); in a file of interleaved rounds the
  median step time over the rounds and the lowest peak over them (the report's numbers);
- offload: ``step_ms`` and ``peak_gib`` of every variant, and of the capped run;
- offload_big: ``step_ms``, ``gpu_peak_gib`` and ``host_rss_gib`` of every (implementation, configuration,
  variant); host memory is what an offload trades GPU memory for, so its growth fails as GPU memory's does.

A shardfuse row (``shardfuse`` and ``shardfuse-graph`` in e2e files, the ``shardfuse*`` variants and the capped
run in offload files, the ``shardfuse*`` implementations with their variants in offload_big files) regresses when
its time grew by more than the noise band (``new > old * (1 + noise)``, ``--noise``, default 5%), when its peak
memory grew by 10% or more (``new >= old * (1 + mem_growth)``, ``--mem-growth``, default 0.10: memory is not
noisy, so a fixed band), or when it was measured before and now failed or is missing. Rows of the other
implementations (FSDP2, FSDP1, FairScale, DeepSpeed, the plain or resident model, shardfuse at a reference commit)
are shown for context only: if they slowed down by the same amount, the machine changed rather than shardfuse.
Both files' commits (``env.commit``, which every runner records) head the report.
Exit status: 0 no regression (or nothing stored to compare with), 1 regression, 2 bad input.

Kernel results (``kernels.json``) are not compared here: kernel regressions go through pytest-benchmark's own
``--benchmark-autosave`` / ``--benchmark-compare`` on ``bench/kernels/test_bench_kernels.py`` (the ``kernels-pb``
stage of ``bench/gpu_suite.sh``).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.results_io import DEFAULT_RESULTS, Env, Result, load_file

DEFAULT_NOISE = 0.05
DEFAULT_MEM_GROWTH = 0.10
KINDS = ("e2e", "offload", "offload_big")  # what this check compares; kernels go through pytest-benchmark
KERNELS_HINT = (
    "kernel results are compared by pytest-benchmark, not here: run bench/kernels/test_bench_kernels.py with "
    "--benchmark-autosave / --benchmark-compare (bash bench/gpu_suite.sh kernels-pb)"
)
E2E_OURS = ("shardfuse", "shardfuse-graph")  # shardfuse at HEAD, eager and captured (not shardfuse-ref)
TIME, MEMORY, HOST_MEMORY = "step ms", "peak GiB", "host RSS GiB"
MEMORY_UNITS = (MEMORY, HOST_MEMORY)  # compared with the memory growth band


@dataclass(frozen=True)
class Metric:
    """One comparable number: ``value`` (None when the row failed), its unit (TIME, MEMORY or HOST_MEMORY), and
    whether it is shardfuse's own."""

    value: float | None
    ours: bool
    unit: str = TIME


def _pos(v: float | None) -> float | None:
    return v if v is not None and v > 0 else None


def _e2e_metrics(res: Result) -> dict[str, Metric]:
    f = res.e2e()
    out: dict[str, Metric] = {}
    medians = {(e.impl, e.regime): e for e in f.summary}
    for r in f.rows:
        if r.skipped is not None:
            continue  # not runnable in that environment (e.g. FairScale not installed): nothing measured
        ours, key = r.impl in E2E_OURS, f"{r.impl} {r.regime}"
        e = medians.get((r.impl, r.regime))
        step = _pos(e.step_ms_median) if e is not None else _pos(r.step_ms)
        peaks = [p for x in f.rows if (x.impl, x.regime) == (r.impl, r.regime) and (p := _pos(x.peak_gib))]
        peak = (min(peaks) if peaks else None) if e is not None else _pos(r.peak_gib)
        if key not in out or step is not None:  # rounds: the medians; a failed round leaves them standing
            out[key] = Metric(step, ours)
            out[f"{key} {MEMORY}"] = Metric(peak, ours, MEMORY)
    return out


def _offload_metrics(res: Result) -> dict[str, Metric]:
    f = res.offload()
    out: dict[str, Metric] = {}
    for name, v in f.variants.items():
        if v.skipped is None:
            ours = name.startswith("shardfuse")
            out[name] = Metric(_pos(v.step_ms), ours)
            out[f"{name} {MEMORY}"] = Metric(_pos(v.peak_gib), ours, MEMORY)
    if f.capped is not None:
        out["capped (shardfuse)"] = Metric(_pos(f.capped.step_ms), True)
        out[f"capped (shardfuse) {MEMORY}"] = Metric(_pos(f.capped.peak_gib), True, MEMORY)
    return out


def _offload_big_metrics(res: Result) -> dict[str, Metric]:
    """Per (impl, config, variant): the median step time, the GPU peak and the host RSS (None where the row did not
    measure them: oom, error); rows skipped (not runnable there) are left out, as in e2e files."""
    out: dict[str, Metric] = {}
    for r in res.offload_big().rows:
        if r.status == "skipped":
            continue
        ours, key = r.impl.startswith("shardfuse"), f"{r.impl} {r.config}" + (f" ({r.variant})" if r.variant else "")
        out[key] = Metric(_pos(r.step_ms) if r.measured else None, ours)
        out[f"{key} {MEMORY}"] = Metric(_pos(r.gpu_peak_gib) if r.measured else None, ours, MEMORY)
        out[f"{key} {HOST_MEMORY}"] = Metric(_pos(r.host_rss_gib) if r.measured else None, ours, HOST_MEMORY)
    return out


def metrics(res: Result) -> dict[str, Metric]:
    """Every comparable time and peak memory of one result file, keyed by a readable name."""
    if res.kind == "e2e":
        return _e2e_metrics(res)
    if res.kind == "offload":
        return _offload_metrics(res)
    if res.kind == "offload_big":
        return _offload_big_metrics(res)
    return {}


@dataclass
class Row:
    key: str
    old: float | None
    new: float | None
    ours: bool
    status: str  # "REGRESSION", "faster", "smaller", "ok", "new", "failed", "missing", "context"
    unit: str = TIME

    @property
    def change(self) -> float | None:
        return None if self.old is None or self.new is None else self.new / self.old - 1.0


def _status(o: float | None, n: float | None, m: Metric, failed: bool, bands: tuple[float, float, float]) -> str:
    noise, min_ms, mem_growth = bands
    if o is None and n is None:
        return "context" if not m.ours else "not measured"
    if o is None:
        return "new"
    if n is None:
        return ("failed" if failed else "missing") if m.ours else "context"
    if not m.ours:
        return "context"
    if m.unit in MEMORY_UNITS:
        return "REGRESSION" if n >= o * (1.0 + mem_growth) else "smaller" if n < o * (1.0 - mem_growth) else "ok"
    if o < min_ms:
        return "ok"  # too short to time reliably (launch-bound); see --min-ms
    return "REGRESSION" if n > o * (1.0 + noise) else "faster" if n < o * (1.0 - noise) else "ok"


def compare(
    old: Result, new: Result, noise: float = DEFAULT_NOISE, min_ms: float = 0.0, mem_growth: float = DEFAULT_MEM_GROWTH
) -> list[Row]:
    """Row by row comparison of two results of the same kind; see the module docstring for the rules."""
    a, b = metrics(old), metrics(new)
    rows = []
    for key in list(dict.fromkeys([*a, *b])):
        ma, mb = a.get(key), b.get(key)
        m = mb if mb is not None else ma
        if m is None:  # cannot happen: the key came from one of them
            continue
        o = ma.value if ma else None
        n = mb.value if mb else None
        rows.append(Row(key, o, n, m.ours, _status(o, n, m, mb is not None, (noise, min_ms, mem_growth)), m.unit))
    return rows


def is_regression(rows: list[Row]) -> bool:
    """True when any shardfuse time regressed, failed or went missing."""
    return any(r.ours and r.status in ("REGRESSION", "failed", "missing") for r in rows)


def _env_diff(old: Env, new: Env) -> list[str]:
    keys = ("gpu_name", "gpu_count", "torch", "triton", "cuda", "nccl")
    return [f"{k}: {old.get(k)} -> {new.get(k)}" for k in keys if old.get(k) != new.get(k)]


def format_report(
    old: Result, new: Result, rows: list[Row], noise: float, mem_growth: float = DEFAULT_MEM_GROWTH
) -> str:
    width = max([len(r.key) for r in rows] + [10])
    lines = [
        f"regression check: {new.path} against {old.path} (time noise band {100 * noise:.1f}%, "
        f"memory growth band {100 * mem_growth:.1f}%)",
        f"  stored: commit {old.env.commit or '?'} on {old.env.date or '?'}; "
        f"new: commit {new.env.commit or '?'} on {new.env.date or '?'}",
    ]
    diff = _env_diff(old.env, new.env)
    if diff:
        lines.append("  environment differs, compare with care: " + "; ".join(diff))
    lines.append(f"  {'row':<{width}} {'stored':>10} {'new':>10} {'change':>8}  status")
    for r in rows:
        ch = f"{100 * r.change:+.1f}%" if r.change is not None else "-"
        o = f"{r.old:.4g}" if r.old is not None else "-"
        n = f"{r.new:.4g}" if r.new is not None else "-"
        status = r.status if r.ours else f"{r.status} (not shardfuse)" if r.status != "context" else "context"
        lines.append(f"  {r.key:<{width}} {o:>10} {n:>10} {ch:>8}  {status}")
    drift = sorted(r.change for r in rows if not r.ours and r.unit == TIME and r.change is not None)
    if drift and abs(drift[len(drift) // 2]) > noise:
        lines.append(
            f"  note: the other implementations changed by {100 * drift[len(drift) // 2]:+.1f}% (median) as well: "
            f"the machine or the software stack probably differs from the stored run"
        )
    bad = [r for r in rows if r.ours and r.status in ("REGRESSION", "failed", "missing")]
    if bad:
        lines.append(
            f"FAIL: {len(bad)} shardfuse number(s) regressed (time beyond {100 * noise:.1f}%, peak memory by "
            f"{100 * mem_growth:.1f}% or more) or failed: " + ", ".join(r.key for r in bad)
        )
    else:
        lines.append(
            f"PASS: no shardfuse time slower than the stored one by more than {100 * noise:.1f}%, no peak memory "
            f"{100 * mem_growth:.1f}% or more above it"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("new", type=Path, help="the new result file")
    p.add_argument("--baseline", type=Path, default=None, help="the stored result (default: looked up in --results)")
    p.add_argument("--results", type=Path, default=DEFAULT_RESULTS, help="folder of stored <gpu>/*.json results")
    p.add_argument("--gpu", default=None, help="GPU folder to compare with (default: the new file's env.gpu_key)")
    p.add_argument("--noise", type=float, default=DEFAULT_NOISE, help="allowed slowdown, a fraction (default 0.05)")
    p.add_argument(
        "--mem-growth",
        type=float,
        default=DEFAULT_MEM_GROWTH,
        help="peak memory growth that fails, a fraction (default 0.10)",
    )
    p.add_argument(
        "--min-ms",
        type=float,
        default=0.0,
        help="do not flag times whose stored value is below this many ms (launch-bound cases)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.noise >= 0:
        print(f"--noise must be >= 0, got {args.noise}", file=sys.stderr)
        return 2
    if not args.mem_growth >= 0:
        print(f"--mem-growth must be >= 0, got {args.mem_growth}", file=sys.stderr)
        return 2
    new = load_file(args.new)
    if new.kind in ("unknown", "unreadable"):
        print(f"{args.new}: not a benchmark result ({new.problem or 'unknown format'})", file=sys.stderr)
        return 2
    if new.kind not in KINDS:
        print(f"{args.new}: {KERNELS_HINT}", file=sys.stderr)
        return 2
    if args.baseline is not None:
        baseline_path = args.baseline
    else:
        gpu = new.env.gpu_key or args.gpu or args.new.resolve().parent.name
        if args.gpu and new.env.gpu_key and args.gpu != new.env.gpu_key:
            print(f"note: --gpu {args.gpu} overrides the new file's gpu_key {new.env.gpu_key}")
            gpu = args.gpu
        baseline_path = args.results / str(gpu) / args.new.name
    if not baseline_path.is_file():
        print(f"no stored result at {baseline_path}: nothing to compare {args.new} with (not a failure)")
        return 0
    if baseline_path.resolve() == args.new.resolve():
        print(f"{args.new} is the stored result itself: pass a new file, or --baseline", file=sys.stderr)
        return 2
    old = load_file(baseline_path)
    if old.kind != new.kind:
        print(f"{baseline_path} is a {old.kind} result but {args.new} is a {new.kind} result", file=sys.stderr)
        return 2
    rows = compare(old, new, args.noise, args.min_ms, args.mem_growth)
    print(format_report(old, new, rows, args.noise, args.mem_growth))
    return 1 if is_regression(rows) else 0


if __name__ == "__main__":
    sys.exit(main())
