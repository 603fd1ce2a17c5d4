"""The GPU-marked tests on every local GPU at once: the one-GPU tests split over the GPUs by file, then the
multi-GPU tests on all of them (``bash bench/gpu_suite.sh tests`` runs this).

    python -m bench.gpu_tests [--gpus N] [--out DIR] [--timeout S] [--dry-run] [-- PYTEST_ARGS...]

Run one after the other, the 225 GPU tests took ~470 s on 2 H200s (2026-11-28), device time a session pays twice
over on a 2-GPU machine. Here each GPU runs its own pytest process over a share of the test files that need
one GPU (``gpu and not multigpu``), balanced by test count; the ``multigpu`` tests (2 ranks each) then run in one
process that sees every GPU, or on 4 GPUs and more in one process per pair of GPUs. Every process logs one line per
test and each failure's traceback as it happens (``bench._instant_failures``; ``-v --tb=short -rfE``) to
``DIR/tests-<part>.log`` and writes ``DIR/tests-<part>-junit.xml``; the summary last lists every FAILED/ERROR line
and each part's pytest result. Exit status: 0 when every part passed (or had nothing to run), else 1.
``--dry-run`` prints the plan (the commands and their files) without running it: no GPU needed.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ONE_GPU_MARK = "gpu and not multigpu"
MULTI_GPU_MARK = "multigpu"
RESULT_LINE = re.compile(r"\d+ (passed|failed|error|errors|skipped|deselected)")
FAILURE_LINE = re.compile(r"(^FAILED |^ERROR | (FAILED|ERROR)( \[|$))")


def collect(mark: str, pytest_args: list[str], paths: tuple[str, ...] = ("tests",)) -> list[str]:
    """The node ids pytest would run under ``mark`` (collected only) from ``paths``."""
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *paths, "-m", mark,
           *pytest_args]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode not in (0, 5):  # 5: nothing collected
        raise SystemExit(f"collecting the {mark!r} tests failed (pytest exit {out.returncode}):\n{out.stdout[-3000:]}"
                         f"\n{out.stderr[-3000:]}")
    return [line.strip() for line in out.stdout.splitlines() if "::" in line and not line.startswith(" ")]


def split_files(node_ids: list[str], parts: int) -> list[list[str]]:
    """The files of ``node_ids`` in ``parts`` groups of about equal test counts (largest file first into the group
    with the fewest tests); each group keeps the files' collection order. Empty groups are dropped."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    counts = Counter(node.split("::", 1)[0] for node in node_ids)
    order = list(dict.fromkeys(node.split("::", 1)[0] for node in node_ids))
    groups: list[list[str]] = [[] for _ in range(parts)]
    sizes = [0] * parts
    for path in sorted(order, key=lambda p: (-counts[p], order.index(p))):
        i = sizes.index(min(sizes))
        groups[i].append(path)
        sizes[i] += counts[path]
    return [sorted(g, key=order.index) for g in groups if g]


def pytest_command(files: list[str], mark: str, junit: Path, timeout_per_test: int, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "pytest", "-v", "--tb=short", "-rfE", "--durations=10",
            f"--timeout={timeout_per_test}", "-p", "no:cacheprovider", "-p", "bench._instant_failures", *files,
            "-m", mark, f"--junitxml={junit}", *extra]


def plan(gpus: int, out: Path, timeout_per_test: int, extra: list[str],
         one_gpu: list[str], multi_gpu: list[str]) -> list[list[tuple[str, dict[str, str], list[str]]]]:
    """Stages of (part name, environment additions, command): the parts of a stage run at once."""
    stages: list[list[tuple[str, dict[str, str], list[str]]]] = []
    groups = split_files(one_gpu, max(1, gpus))
    if groups:
        stages.append([(f"gpu{i}", {"CUDA_VISIBLE_DEVICES": str(i)},
                        pytest_command(files, ONE_GPU_MARK, out / f"tests-gpu{i}-junit.xml", timeout_per_test, extra))
                       for i, files in enumerate(groups)])
    if multi_gpu and gpus >= 2:
        # The multi-GPU tests run 2 ranks: on 4 GPUs or more, one process per pair of GPUs, each over a share of
        # the files (they ran ~9 s each, one after the other, and set the length of the whole stage).
        pairs = split_files(multi_gpu, gpus // 2) if gpus >= 4 else [list(dict.fromkeys(
            node.split("::", 1)[0] for node in multi_gpu))]
        stage = []
        for i, files in enumerate(pairs):
            name = "multigpu" if len(pairs) == 1 else f"multigpu{i}"
            env = {} if len(pairs) == 1 else {"CUDA_VISIBLE_DEVICES": f"{2 * i},{2 * i + 1}"}
            stage.append((name, env, pytest_command(files, MULTI_GPU_MARK, out / f"tests-{name}-junit.xml",
                                                    timeout_per_test, extra)))
        stages.append(stage)
    return stages


def run_stage(parts: list[tuple[str, dict[str, str], list[str]]], out: Path, deadline: float) -> dict[str, int]:
    """Start every part, wait until each ends or the deadline passes (then kill what is left: exit 124)."""
    procs = {}
    for name, env_add, cmd in parts:
        log = open(out / f"tests-{name}.log", "w")  # noqa: SIM115 - closed below, after the process ends
        procs[name] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env_add}),
                       log)
    codes: dict[str, int] = {}
    for name, (proc, log) in procs.items():
        try:
            codes[name] = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            codes[name] = 124
        log.close()
    return codes


def summarize(out: Path, codes: dict[str, int]) -> list[str]:
    """Per part its pytest result line (or why there is none), then every FAILED/ERROR line of every log."""
    lines, failures = [], []
    for name, code in codes.items():
        text = (out / f"tests-{name}.log").read_text(errors="replace")
        results = [ln.strip() for ln in text.splitlines() if RESULT_LINE.search(ln) and ln.startswith("=")]
        verdict = results[-1] if results else ("cut by the time limit" if code == 124 else "no result line")
        lines.append(f"tests {name}: exit {code}: {verdict}")
        failures += [f"{name}: {ln.strip()}" for ln in text.splitlines() if FAILURE_LINE.search(ln)]
    return lines + sorted(set(failures))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=None, help="GPUs to spread the one-GPU tests over (default: all)")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"), help="folder for the logs and JUnit files")
    ap.add_argument("--timeout", type=float, default=540.0, help="seconds for the whole run")
    ap.add_argument("--timeout-per-test", type=int, default=150,
                    help="seconds one test may run (pytest-timeout; the slowest GPU test took ~40 s)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan, run nothing")
    ap.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    args = ap.parse_args(argv)
    if args.gpus is None:
        import torch

        args.gpus = torch.cuda.device_count()
    if args.gpus < 1 and not args.dry_run:
        print("no CUDA GPU visible: the GPU tests need one (the CPU suite is `pytest tests`)", file=sys.stderr)
        return 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stages = plan(args.gpus, out, args.timeout_per_test, args.pytest_args,
                  collect(ONE_GPU_MARK, args.pytest_args), collect(MULTI_GPU_MARK, args.pytest_args))
    if args.dry_run:
        for i, stage in enumerate(stages):
            for name, env_add, cmd in stage:
                env = " ".join(f"{k}={v}" for k, v in env_add.items())
                print(f"stage {i} {name}: {env + ' ' if env else ''}{' '.join(cmd)}")
        return 0
    deadline = time.monotonic() + args.timeout
    codes: dict[str, int] = {}
    for stage in stages:
        codes.update(run_stage(stage, out, deadline))
    print("\n".join(summarize(out, codes)))
    return 0 if all(code in (0, 5) for code in codes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
