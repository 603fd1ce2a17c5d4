"""Before/after on one machine: the same benchmarks from two source trees, interleaved, compared with medians.

    python -m bench.ab --before .before --after . --rounds 3 --bench e2e,offload --out ab.json

Every round runs every benchmark once from each tree, the tree that goes first alternating from round to round
(round 0: before then after, round 1: after then before, ...), each run in its own subprocess with
``PYTHONPATH=<tree>`` and the tree as its working directory, so that the ``shardfuse`` and ``bench`` it imports
are the tree's own. A small bootstrap (written to a temporary folder, the same for both trees) prints where
``shardfuse`` and ``bench`` were imported from and then runs the benchmark module as ``__main__``; a run whose
``shardfuse`` is not under its tree is an error. Each run writes its result JSON under its own ``$BENCH_OUT``
(a temporary folder: nothing is written into either tree) and its output to ``<logs>/<bench>_<tree>_r<N>.log``.

Benchmarks (the extra arguments of ``--e2e-args`` / ``--offload-args`` go after the defaults, so they override
them; both trees must accept the arguments):

- ``e2e``: ``torchrun --standalone --nproc_per_node 1 -m bench.e2e.run --regime 1k --impls shardfuse
  --steps 20 --warmup 3 --no-baseline --name ab_e2e``; a row per (impl, regime): the mean step time (ms) and the
  peak GPU memory (GiB; GPU runs only).
- ``offload``: ``python -m bench.offload.run --only plain,shardfuse,shardfuse_offload_acts_opt_in_bwd --steps 3
  --warmup 2`` (the full-size 1074M model, one GPU; CUDA only); a row per variant. ``plain`` does not touch
  shardfuse: its ratio shows the machine's own noise.
- ``offload-big`` (not in the default set; ``--offload-big-args`` extends it): ``python -m bench.offload.big
  --configs 2.9b-4k --impls shardfuse,shardfuse-sib --steps 3 --warmup 1 --no-floor --save --out <its $OUT>``
  (the 2.9B decoder offloaded, with clipping and with step_in_backward; about 70 s per run on one H100/H200);
  a row per (config, impl and variant): the median step time, GPU peak and host peak RSS (``host_gib``, judged
  with the memory threshold).

Per benchmark, row and metric: the median over rounds of each tree, after / before, each tree's spread (min-max
over rounds) and a verdict against the noise threshold (``--time-noise`` 10%, ``--mem-noise`` 5%): PASS within
it, FAIL above it (slower, more memory), BETTER below it (not a failure unless ``--strict``); MISSING when a row
has no value from one of the trees (a failed or timed-out run). The last step's loss is shown for information.
``noisy`` marks a row whose spread over rounds is wider than the threshold on either side. The JSON (``--out``)
records both trees (commit: ``git rev-parse HEAD`` where the tree has its own ``.git``, else its ``COMMIT`` file,
else ``--before-commit`` / ``--after-commit``; a digest of its ``shardfuse/*.py``), every run and the comparison;
it is rewritten after every run, so a job cut short keeps what was measured. Exit status 1 on any FAIL or
MISSING (and BETTER under ``--strict``) or a failed run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TREES = ("before", "after")
MARKER = "AB_CHILD "
# Runs in the child before the benchmark module: where shardfuse and bench come from, then the module as __main__.
BOOTSTRAP = """\
import os, runpy, sys
import bench, shardfuse
if os.environ.get("RANK", "0") == "0":
    paths = {m.__name__: os.path.abspath(m.__file__ or list(m.__path__)[0]) for m in (shardfuse, bench)}
    print("AB_CHILD " + __import__("json").dumps(paths), flush=True)
module = sys.argv[1]
sys.argv = [module, *sys.argv[2:]]
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""
E2E_ARGS = ("--regime", "1k", "--impls", "shardfuse", "--steps", "20", "--warmup", "3", "--no-baseline",
            "--name", "ab_e2e")  # fmt: skip
# plain: no shardfuse in it, the machine's own noise; shardfuse: checkpointing and microbatches; the last: activations
# offloaded and the optimizer in backward.
OFFLOAD_VARIANTS = ("plain", "shardfuse", "shardfuse_offload_acts_opt_in_bwd")
OFFLOAD_ARGS = ("--only", ",".join(OFFLOAD_VARIANTS), "--steps", "3", "--warmup", "2")
OFFLOAD_BIG_ARGS = ("--configs", "2.9b-4k", "--impls", "shardfuse,shardfuse-sib", "--steps", "3", "--warmup", "1",
                    "--no-floor", "--save")  # fmt: skip
Rows = dict[str, dict[str, Any]]


@dataclass(frozen=True)
class Bench:
    """One benchmark: the module the bootstrap runs, how it is launched, where its JSON lands, how it is read."""

    name: str
    module: str
    args: tuple[str, ...]
    result: str  # the JSON's name: $BENCH_OUT/<gpu>/<result>.json
    parse: Callable[[dict[str, Any]], Rows]
    torchrun: bool = False

    def command(self, bootstrap: Path) -> list[str]:
        launcher = [sys.executable]
        if self.torchrun:
            launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"]
        return [*launcher, str(bootstrap), self.module, *self.args]


def _metrics(step_ms: float, peak_gib: float | None, loss: float | None,
             host_gib: float | None = None) -> dict[str, float]:
    out = {"time_ms": float(step_ms)}
    if peak_gib is not None:
        out["peak_gib"] = float(peak_gib)
    if host_gib is not None:
        out["host_gib"] = float(host_gib)
    if loss is not None:
        out["loss"] = float(loss)
    return out


def parse_e2e(payload: dict[str, Any]) -> Rows:
    """``bench.e2e.run``'s rows: ``impl/regime`` -> step time, peak memory, last loss (or the row's error)."""
    rows: Rows = {}
    for r in payload.get("results", []):
        key = f"{r['impl']}/{r['regime']}"
        if "step_ms" in r:
            rows[key] = _metrics(r["step_ms"], r.get("peak_gib"), r.get("loss_last"))
        else:
            rows[key] = {"skipped": r["skipped"]} if "skipped" in r else {"error": str(r.get("error", "no time"))}
    return rows


def parse_offload(payload: dict[str, Any]) -> Rows:
    """``bench.offload.run``'s variants (and its capped run, when it ran): step time, peak memory, last loss."""
    rows: Rows = {}
    items = list(payload.get("variants", {}).items())
    if payload.get("capped"):
        items.append(("capped", payload["capped"]))
    for name, r in items:
        if "step_ms" in r:
            losses = r.get("losses") or [None]
            rows[name] = _metrics(r["step_ms"], r.get("peak_gib"), losses[-1])
        else:
            rows[name] = {"skipped": r["skipped"]} if "skipped" in r else {"error": str(r.get("error", "no time"))}
    return rows


def parse_offload_big(payload: dict[str, Any]) -> Rows:
    """``bench.offload.big``'s rows: ``config/impl`` (``[variant]`` where there is one) -> step time, GPU peak,
    host peak RSS, last loss (or the row's status and reason)."""
    rows: Rows = {}
    for r in payload.get("results", []):
        key = f"{r['config']}/{r['impl']}" + (f" [{r['variant']}]" if r.get("variant") else "")
        if r.get("status") == "ok" and r.get("step_ms"):
            losses = r.get("losses") or [None]
            rows[key] = _metrics(r["step_ms"], r.get("gpu_peak_gib"), losses[-1], r.get("host_rss_gib"))
        else:
            what = "skipped" if r.get("status") == "skipped" else "error"
            rows[key] = {what: f"{r.get('status')}: {r.get('reason', 'no step time')}"}
    return rows


def make_benches(e2e_extra: Sequence[str] = (), offload_extra: Sequence[str] = (),
                 offload_big_extra: Sequence[str] = ()) -> dict[str, Bench]:
    return {
        "e2e": Bench("e2e", "bench.e2e.run", (*E2E_ARGS, *e2e_extra), "ab_e2e", parse_e2e, torchrun=True),
        "offload": Bench("offload", "bench.offload.run", (*OFFLOAD_ARGS, *offload_extra), "offload", parse_offload),
        "offload-big": Bench("offload-big", "bench.offload.big", (*OFFLOAD_BIG_ARGS, *offload_big_extra),
                             "offload_big", parse_offload_big),
    }


@dataclass
class Tree:
    """A source tree to import shardfuse and bench from."""

    label: str
    path: Path
    commit: str = "unknown"
    dirty: bool | None = None
    digest: str = ""
    info: dict[str, Any] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return {"dir": str(self.path), "commit": self.commit, "dirty": self.dirty, "shardfuse_digest": self.digest}


def _git(path: Path, *args: str) -> str | None:
    try:
        res = subprocess.run(["git", *args], cwd=path, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout.strip() if res.returncode == 0 else None


def tree_commit(path: Path, override: str | None = None) -> tuple[str, bool | None]:
    """(commit, dirty): the override; ``git rev-parse HEAD`` where the tree has its own ``.git`` (dirty: changes
    to tracked files); its ``COMMIT`` file; else 'unknown'. A tree inside another repository (``.before/`` in
    the working tree) has no ``.git`` of its own, so git is not asked about it."""
    if override:
        return override, None
    if (path / ".git").exists():
        head = _git(path, "rev-parse", "HEAD")
        if head:
            status = _git(path, "status", "--porcelain", "--untracked-files=no")
            return head, None if status is None else bool(status)
    commit_file = path / "COMMIT"
    if commit_file.is_file():
        lines = commit_file.read_text().split()
        return (lines[0] if lines else "unknown"), None
    return "unknown", None


def tree_digest(path: Path) -> str:
    """sha256 (12 hex digits) of the tree's ``shardfuse/**/*.py``, names and contents: what was actually run."""
    h = hashlib.sha256()
    for f in sorted((path / "shardfuse").rglob("*.py")):
        h.update(f.relative_to(path).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def make_tree(label: str, path: str | Path, commit: str | None = None) -> Tree:
    root = Path(path).resolve()
    if not (root / "shardfuse").is_dir() or not (root / "bench").is_dir():
        raise SystemExit(f"bench.ab: --{label} {path}: no shardfuse/ and bench/ there")
    sha, dirty = tree_commit(root, commit)
    return Tree(label, root, sha, dirty, tree_digest(root))


def child_env(tree: Tree, bench_out: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a run: the tree first on PYTHONPATH, inherited entries that hold another ``shardfuse``
    or ``bench`` (the suite puts the repository root there) dropped, results under ``bench_out``."""
    env = dict(os.environ if base is None else base)
    inherited = [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                 if p and not (Path(p) / "shardfuse").exists() and not (Path(p) / "bench").exists()]  # fmt: skip
    # OUT too: a runner's own default output ($OUT/..., bench.offload.big's --out) lands there, not in the tree.
    env.update(PYTHONPATH=os.pathsep.join([str(tree.path), *inherited]), BENCH_OUT=str(bench_out),
               OUT=str(bench_out), SHARDFUSE_COMMIT=tree.commit, PYTHONUNBUFFERED="1")  # fmt: skip
    return env


def origin_error(tree: Tree, output: str) -> tuple[dict[str, str], str | None]:
    """The child's reported import paths, and an error unless shardfuse and bench both come from ``tree``."""
    lines = [ln for ln in output.splitlines() if ln.startswith(MARKER)]
    if not lines:
        return {}, "the child never reported where shardfuse came from"
    paths: dict[str, str] = json.loads(lines[0][len(MARKER):])
    for mod in ("shardfuse", "bench"):  # exactly <tree>/<mod>/: the before tree may sit inside the after one
        where = Path(paths.get(mod, "?")).resolve()
        if where.parent != tree.path / mod:
            return paths, f"{mod} was imported from {where}, not from the {tree.label} tree {tree.path}"
    return paths, None


def read_result(bench: Bench, bench_out: Path) -> tuple[Rows, dict[str, Any]]:
    """The rows and the ``env`` of the one ``<result>.json`` the run wrote under ``bench_out``."""
    found = sorted(bench_out.glob(f"*/{bench.result}.json"))
    if len(found) != 1:
        raise ValueError(f"expected one {bench.result}.json under {bench_out}, found {len(found)}")
    payload = json.loads(found[0].read_text())
    return bench.parse(payload), payload.get("env", {})


def run_one(bench: Bench, tree: Tree, rnd: int, bootstrap: Path, work: Path, logs: Path,
            timeout: float) -> dict[str, Any]:
    """One benchmark from one tree in its own subprocess; the record of the run (rows, or an error)."""
    bench_out = work / f"{bench.name}_{tree.label}_r{rnd}"
    log = logs / f"{bench.name}_{tree.label}_r{rnd}.log"
    cmd = bench.command(bootstrap)
    rec: dict[str, Any] = {"bench": bench.name, "tree": tree.label, "round": rnd, "log": str(log),
                           "command": shlex.join(cmd), "rows": {}}  # fmt: skip
    print(f"-- round {rnd} {bench.name} {tree.label}: {rec['command']}", flush=True)
    t0 = time.perf_counter()
    try:
        res = subprocess.run(cmd, cwd=tree.path, env=child_env(tree, bench_out), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, timeout=timeout)  # fmt: skip
        output, rec["rc"] = res.stdout, res.returncode
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout or ""
        output, rec["rc"] = out.decode(errors="replace") if isinstance(out, bytes) else out, None
        rec["error"] = f"timed out after {timeout:.0f}s"
    rec["wall_s"] = round(time.perf_counter() - t0, 2)
    log.write_text(output)
    rec["imported"], origin = origin_error(tree, output)
    try:
        rec["rows"], tree.info = read_result(bench, bench_out)
    except (ValueError, KeyError, json.JSONDecodeError) as exc:
        rec.setdefault("error", f"no result: {exc}")
    if origin or rec["rc"]:
        rec["error"] = origin or rec.get("error") or f"exit status {rec['rc']}"
        rec["rows"] = {} if origin else rec["rows"]  # numbers from the wrong code are not kept
        print(f"   error: {rec['error']} (log {log}); last lines:\n" + "\n".join(output.splitlines()[-8:]), flush=True)
    else:
        print(f"   {rec['wall_s']:.1f}s, rows: {', '.join(rec['rows'])}", flush=True)
    return rec


def round_order(rnd: int) -> tuple[str, str]:
    """Which tree runs first in a round: before in even rounds, after in odd ones."""
    return ("before", "after") if rnd % 2 == 0 else ("after", "before")


def verdict(ratio: float, tol: float) -> str:
    if ratio > 1 + tol:
        return "FAIL"
    return "BETTER" if ratio < 1 - tol else "PASS"


def _spread(values: list[float]) -> list[float]:
    return [min(values), max(values)]


def compare_row(values: dict[str, list[float]], metric: str, tol: float | None) -> dict[str, Any]:
    """One (bench, row, metric): each tree's median and spread, after / before, the verdict (INFO: no threshold)."""
    out: dict[str, Any] = {"metric": metric, "threshold": tol}
    for label in TREES:
        vals = values.get(label, [])
        out[f"{label}_values"] = vals
        out[f"{label}_median"] = statistics.median(vals) if vals else None
        out[f"{label}_spread"] = _spread(vals) if vals else None
    before, after = out["before_median"], out["after_median"]
    if before is None or after is None:
        out.update(ratio=None, verdict="MISSING" if tol is not None else "INFO", noisy=False)
        return out
    out["ratio"] = after / before if before else (1.0 if after == before else float("inf"))
    out["verdict"] = "INFO" if tol is None else verdict(out["ratio"], tol)
    out["noisy"] = tol is not None and any(
        (hi - lo) > tol * abs(med) for (lo, hi), med in
        ((out[f"{t}_spread"], out[f"{t}_median"]) for t in TREES)
    )  # fmt: skip
    return out


def compare(runs: list[dict[str, Any]], time_noise: float, mem_noise: float) -> list[dict[str, Any]]:
    """Every (bench, row, metric) any run reported, in the order first seen."""
    tolerances: dict[str, float | None] = {"time_ms": time_noise, "peak_gib": mem_noise, "host_gib": mem_noise,
                                           "loss": None}
    seen: dict[tuple[str, str, str], dict[str, list[float]]] = {}
    for rec in runs:
        for row, metrics in rec["rows"].items():
            for metric in tolerances:  # a row in error has no values: MISSING for its time
                if metric in metrics or (metric == "time_ms" and "error" in metrics):
                    slot = seen.setdefault((rec["bench"], row, metric), {})
                    slot.setdefault(rec["tree"], []).extend([metrics[metric]] if metric in metrics else [])
    return [{"bench": b, "row": r, **compare_row(vals, m, tolerances[m])} for (b, r, m), vals in seen.items()]


def _fmt(v: float | None, digits: int) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def print_table(rows: list[dict[str, Any]]) -> None:
    head = f"{'bench':8s} {'row':38s} {'metric':8s} {'before':>10s} {'after':>10s} {'ratio':>7s} " \
           f"{'before min-max':>17s} {'after min-max':>17s}  verdict"  # fmt: skip
    print("\n" + head)
    for r in rows:
        d = 4 if r["metric"] == "loss" else 2
        spreads = ["-" if r[f"{t}_spread"] is None else "-".join(_fmt(v, d) for v in r[f"{t}_spread"]) for t in TREES]
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
        note = " (noisy)" if r.get("noisy") else ""
        print(f"{r['bench']:8s} {r['row']:38s} {r['metric']:8s} {_fmt(r['before_median'], d):>10s} "
              f"{_fmt(r['after_median'], d):>10s} {ratio:>7s} {spreads[0]:>17s} {spreads[1]:>17s}  "
              f"{r['verdict']}{note}")
    print("(ratio: after / before median; time_ms step time, peak_gib peak GPU memory, host_gib peak host RSS, "
          "loss the last step's;"
          " FAIL above the threshold, BETTER below it)", flush=True)


def outcome(runs: list[dict[str, Any]], rows: list[dict[str, Any]], strict: bool) -> bool:
    """True when every run succeeded and every thresholded row passed (BETTER counts as failed if strict)."""
    bad = {"FAIL", "MISSING"} | ({"BETTER"} if strict else set())
    return not any("error" in r for r in runs) and not any(r["verdict"] in bad for r in rows)


@dataclass
class Job:
    """What one ``bench.ab`` invocation runs and where it writes."""

    trees: dict[str, Tree]
    benches: list[Bench]
    rounds: int
    out: Path
    logs: Path
    timeout: float = 180.0
    time_noise: float = 0.10
    mem_noise: float = 0.05
    strict: bool = False
    deadline_s: float | None = None  # no round starts that would, at the longest round's pace, end after it
    runs: list[dict[str, Any]] = field(default_factory=list)
    stopped: str | None = None

    def payload(self) -> dict[str, Any]:
        rows = compare(self.runs, self.time_noise, self.mem_noise)
        env = next((t.info for t in self.trees.values() if t.info), {})
        return {
            "kind": "ab",
            "env": {k: env.get(k) for k in ("gpu_name", "gpu_key", "torch", "triton", "cuda", "python")},
            "trees": {label: t.as_json() for label, t in self.trees.items()},
            "config": {"rounds": self.rounds,
                       "benches": {b.name: shlex.join([b.module, *b.args]) for b in self.benches},
                       "time_noise": self.time_noise, "mem_noise": self.mem_noise, "timeout_s": self.timeout,
                       "strict": self.strict, "order": "before first in even rounds, after first in odd ones"},
            "runs": self.runs,
            "comparison": rows,
            "rounds_run": len({r["round"] for r in self.runs}),
            "stopped": self.stopped,
            "ok": outcome(self.runs, rows, self.strict),
        }  # fmt: skip

    def write(self) -> dict[str, Any]:
        payload = self.payload()
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps(payload, indent=2) + "\n")
        return payload


def run_job(job: Job) -> dict[str, Any]:
    """Every round, every benchmark, both trees in the round's order; the JSON rewritten after each run."""
    job.logs.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench_ab_") as tmp:
        work = Path(tmp)
        bootstrap = work / "ab_bootstrap.py"
        bootstrap.write_text(BOOTSTRAP)
        start, longest = time.monotonic(), 0.0
        for rnd in range(job.rounds):
            elapsed = time.monotonic() - start
            if job.deadline_s is not None and rnd and elapsed + longest > job.deadline_s:
                job.stopped = f"after {rnd} rounds: one more ({longest:.0f}s) would pass {job.deadline_s:.0f}s"
                print(f"stopped {job.stopped}", flush=True)
                break
            for bench in job.benches:
                for label in round_order(rnd):
                    job.runs.append(run_one(bench, job.trees[label], rnd, bootstrap, work, job.logs, job.timeout))
                    job.write()
            longest = max(longest, time.monotonic() - start - elapsed)
    return job.write()


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", required=True, help="the tree before the change (shardfuse/ and bench/ in it)")
    p.add_argument("--after", required=True, help="the tree after it")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--bench", default="e2e,offload", help="comma-separated, from e2e, offload, offload-big")
    p.add_argument("--out", default="ab.json", help="the JSON written (after every run)")
    p.add_argument("--logs", default=None, help="one log per run (default: <out without .json>_logs/)")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds per run")
    p.add_argument("--time-noise", type=float, default=0.10, help="time threshold, a fraction (0.10 = 10%%)")
    p.add_argument("--mem-noise", type=float, default=0.05, help="peak memory threshold, a fraction")
    p.add_argument("--strict", action="store_true", help="BETTER beyond the threshold fails too")
    p.add_argument("--deadline", type=float, default=None, metavar="S",
                   help="start no round that would end later than S seconds from the start (at the slowest "
                        "round's pace): whole rounds only, so both trees keep the same number of samples")
    p.add_argument("--e2e-args", default="", help="more arguments for bench.e2e.run (after the defaults)")
    p.add_argument("--offload-args", default="", help="more arguments for bench.offload.run (after the defaults)")
    p.add_argument("--offload-big-args", default="",
                   help="more arguments for bench.offload.big (after the defaults)")
    p.add_argument("--before-commit", default=None, help="the before tree's commit (else .git, else COMMIT)")
    p.add_argument("--after-commit", default=None, help="the after tree's commit (else .git, else COMMIT)")
    args = p.parse_args(argv)
    benches = make_benches(shlex.split(args.e2e_args), shlex.split(args.offload_args),
                           shlex.split(args.offload_big_args))
    names = [b.strip() for b in args.bench.split(",") if b.strip()]
    if not names or any(n not in benches for n in names) or len(set(names)) != len(names):
        p.error(f"--bench {args.bench!r}: distinct names from {', '.join(benches)}")
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    args.bench_list = [benches[n] for n in names]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out).resolve()
    trees = {"before": make_tree("before", args.before, args.before_commit),
             "after": make_tree("after", args.after, args.after_commit)}  # fmt: skip
    for t in trees.values():
        print(f"{t.label}: {t.path} commit {t.commit}{' (dirty)' if t.dirty else ''}, shardfuse digest {t.digest}")
    if trees["before"].digest == trees["after"].digest:
        print("note: both trees hold the same shardfuse/*.py", flush=True)
    logs = Path(args.logs).resolve() if args.logs else out.with_name(out.stem + "_logs")
    job = Job(trees, args.bench_list, args.rounds, out, logs, args.timeout, args.time_noise, args.mem_noise,
              args.strict, args.deadline)  # fmt: skip
    payload = run_job(job)
    print_table(payload["comparison"])
    failed = [r for r in payload["runs"] if "error" in r]
    for r in failed:
        print(f"run failed: round {r['round']} {r['bench']} {r['tree']}: {r['error']} (log {r['log']})")
    print(f"{'OK' if payload['ok'] else 'NOT OK'}: wrote {out}", flush=True)
    return 0 if payload["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
