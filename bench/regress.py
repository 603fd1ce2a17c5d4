"""Regression check: compare a new end-to-end or offload result with the stored one for the same GPU.

    python -m bench.regress NEW.json                       # against bench/results/<gpu>/<NEW's name>.json
    python -m bench.regress NEW.json --baseline OLD.json   # against a given file
    python -m bench.regress NEW.json --noise 0.03

Run from the repository root. ``NEW.json`` is a file written by ``bench.e2e.run`` or ``bench.offload.run`` (for
example from ``$OUT/work/results/<gpu>/`` after ``bench/gpu_suite.sh``). The GPU comes from the file's
``env.gpu_key`` (else ``--gpu``, else the name of the folder it lies in); the stored result is the file of the
same name under ``--results/<gpu>/``.

Compared times (lower is better):

- e2e: ``step_ms`` of every (implementation, regime) row;
- offload: ``step_ms`` of every variant, and of the capped run.

A shardfuse time that grew by more than the noise band (``new > old * (1 + noise)``) is a regression; so is a
shardfuse row that was measured before and now failed or is missing. Times of the other implementations
(FSDP2, FSDP1, FairScale, the plain model) are shown for context only: if they slowed down by the same amount,
the machine changed rather than shardfuse. Exit status: 0 no regression (or nothing stored to compare with),
1 regression, 2 bad input.

Kernel results (``kernels.json``) are not compared here: kernel regressions go through pytest-benchmark's own
``--benchmark-autosave`` / ``--benchmark-compare`` on ``bench/kernels/test_bench_kernels.py`` (the ``kernels-pb``
stage of ``bench/gpu_suite.sh``).
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.results_io import DEFAULT_RESULTS, Result, load_file

DEFAULT_NOISE = 0.05
KINDS = ("e2e", "offload")  # what this check compares; kernels go through pytest-benchmark
KERNELS_HINT = (
    "kernel results are compared by pytest-benchmark, not here: run bench/kernels/test_bench_kernels.py with "
    "--benchmark-autosave / --benchmark-compare (bash bench/gpu_suite.sh kernels-pb)"
)


@dataclass(frozen=True)
class Metric:
    """One comparable time: ``value`` in ms (None when the row failed), and whether it is shardfuse's own."""

    value: float | None
    ours: bool


def _ms(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or math.isinf(v) or v <= 0:
        return None
    return float(v)


def metrics(res: Result) -> dict[str, Metric]:
    """Every comparable time of one result file, keyed by a readable name."""
    out: dict[str, Metric] = {}
    data = res.data
    if res.kind == "e2e":
        for r in data.get("results") or []:
            if not isinstance(r, dict) or "skipped" in r:
                continue  # not runnable in that environment (e.g. FairScale not installed): nothing measured
            impl = r.get("impl")
            out[f"{impl} {r.get('regime')}"] = Metric(_ms(r.get("step_ms")), impl == "shardfuse")
    elif res.kind == "offload":
        variants = data.get("variants") if isinstance(data.get("variants"), dict) else {}
        for name, v in variants.items():
            if isinstance(v, dict) and "skipped" not in v:
                out[name] = Metric(_ms(v.get("step_ms")), str(name).startswith("shardfuse"))
        capped = data.get("capped")
        if isinstance(capped, dict) and capped:
            out["capped (shardfuse)"] = Metric(_ms(capped.get("step_ms")), True)
    return out


@dataclass
class Row:
    key: str
    old: float | None
    new: float | None
    ours: bool
    status: str  # "REGRESSION", "faster", "ok", "new", "failed", "missing", "context"

    @property
    def change(self) -> float | None:
        return None if self.old is None or self.new is None else self.new / self.old - 1.0


def compare(old: Result, new: Result, noise: float = DEFAULT_NOISE, min_ms: float = 0.0) -> list[Row]:
    """Row by row comparison of two results of the same kind; see the module docstring for the rules."""
    a, b = metrics(old), metrics(new)
    rows = []
    for key in list(dict.fromkeys([*a, *b])):
        ma, mb = a.get(key), b.get(key)
        ours = (mb or ma).ours
        o = ma.value if ma else None
        n = mb.value if mb else None
        if o is None and n is None:
            status = "context" if not ours else "not measured"
        elif o is None:
            status = "new"
        elif n is None:
            status = ("failed" if mb is not None else "missing") if ours else "context"
        elif not ours:
            status = "context"
        elif o < min_ms:
            status = "ok"  # too short to time reliably (launch-bound); see --min-ms
        elif n > o * (1.0 + noise):
            status = "REGRESSION"
        elif n < o * (1.0 - noise):
            status = "faster"
        else:
            status = "ok"
        rows.append(Row(key, o, n, ours, status))
    return rows


def is_regression(rows: list[Row]) -> bool:
    """True when any shardfuse time regressed, failed or went missing."""
    return any(r.ours and r.status in ("REGRESSION", "failed", "missing") for r in rows)


def _env_diff(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    keys = ("gpu_name", "gpu_count", "torch", "triton", "cuda", "nccl")
    return [f"{k}: {old.get(k)} -> {new.get(k)}" for k in keys if old.get(k) != new.get(k)]


def format_report(old: Result, new: Result, rows: list[Row], noise: float) -> str:
    width = max([len(r.key) for r in rows] + [10])
    lines = [
        f"regression check: {new.path} against {old.path} (noise band {100 * noise:.1f}%)",
        f"  stored: commit {old.env.get('commit', '?')} on {old.env.get('date', '?')}; "
        f"new: commit {new.env.get('commit', '?')} on {new.env.get('date', '?')}",
    ]
    diff = _env_diff(old.env, new.env)
    if diff:
        lines.append("  environment differs, compare with care: " + "; ".join(diff))
    lines.append(f"  {'time (ms)':<{width}} {'stored':>10} {'new':>10} {'change':>8}  status")
    for r in rows:
        ch = f"{100 * r.change:+.1f}%" if r.change is not None else "-"
        o = f"{r.old:.4g}" if r.old is not None else "-"
        n = f"{r.new:.4g}" if r.new is not None else "-"
        status = r.status if r.ours else f"{r.status} (not shardfuse)" if r.status != "context" else "context"
        lines.append(f"  {r.key:<{width}} {o:>10} {n:>10} {ch:>8}  {status}")
    drift = sorted(r.change for r in rows if not r.ours and r.change is not None)
    if drift and abs(drift[len(drift) // 2]) > noise:
        lines.append(
            f"  note: the other implementations changed by {100 * drift[len(drift) // 2]:+.1f}% (median) as well: "
            f"the machine or the software stack probably differs from the stored run"
        )
    bad = [r for r in rows if r.ours and r.status in ("REGRESSION", "failed", "missing")]
    if bad:
        lines.append(
            f"FAIL: {len(bad)} shardfuse time(s) regressed beyond {100 * noise:.1f}% or failed: "
            + ", ".join(r.key for r in bad)
        )
    else:
        lines.append(f"PASS: no shardfuse time slower than the stored one by more than {100 * noise:.1f}%")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("new", type=Path, help="the new result file")
    p.add_argument("--baseline", type=Path, default=None, help="the stored result (default: looked up in --results)")
    p.add_argument("--results", type=Path, default=DEFAULT_RESULTS, help="folder of stored <gpu>/*.json results")
    p.add_argument("--gpu", default=None, help="GPU folder to compare with (default: the new file's env.gpu_key)")
    p.add_argument("--noise", type=float, default=DEFAULT_NOISE, help="allowed slowdown, a fraction (default 0.05)")
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
        gpu = new.env.get("gpu_key") or args.gpu or args.new.resolve().parent.name
        if args.gpu and new.env.get("gpu_key") and args.gpu != new.env["gpu_key"]:
            print(f"note: --gpu {args.gpu} overrides the new file's gpu_key {new.env['gpu_key']}")
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
    rows = compare(old, new, args.noise, args.min_ms)
    print(format_report(old, new, rows, args.noise))
    return 1 if is_regression(rows) else 0


if __name__ == "__main__":
    sys.exit(main())
