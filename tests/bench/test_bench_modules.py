"""The benchmark code runs as modules from the repository root, without ``sys.path`` hacks.

``python -m bench.report`` / ``bench.regress`` / ``bench.e2e.host_overhead`` and ``torchrun -m bench.e2e.run``
run in subprocesses started in the repository root with no ``PYTHONPATH``: ``-m`` alone must make ``bench``,
``examples`` and ``shardfuse`` importable. ``bench/gpu_suite.sh`` must start every benchmark that way, and
its ``regress`` and ``kernels-pb`` stages are run here on the CPU (nothing to time, the plumbing only).
"""

from __future__ import annotations

import ast
import json
import math
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.common import free_port
from tests.bench._payloads import e2e_payload, kernels_payload, make_results_dir

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"


def _module_env(**extra: str) -> dict[str, str]:
    """This environment without PYTHONPATH (``-m`` from the root must suffice), the reference kernels on CPU."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(TRITON_INTERPRET="0", OMP_NUM_THREADS="1", **extra)
    return env


def _run(args: list[str], timeout: float = 120, **extra_env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=REPO, env=_module_env(**extra_env), capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


# ------------------------------------------------------------------------------------------------ static checks


def _sys_path_uses(path: Path) -> list[int]:
    """Lines of ``path`` that touch ``sys.path`` (insert, append, assignment, reading)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return sorted(
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr == "path"
        and isinstance(node.value, ast.Name) and node.value.id == "sys"
    )  # fmt: skip


NO_SYS_PATH = sorted(
    [*BENCH.rglob("*.py"), *(REPO / "examples").rglob("*.py"), REPO / "tests" / "test_docs.py"],
)


@pytest.mark.parametrize("path", NO_SYS_PATH, ids=lambda p: str(p.relative_to(REPO)))
def test_no_sys_path_hacks(path: Path) -> None:
    lines = _sys_path_uses(path)
    assert not lines, (
        f"{path.relative_to(REPO)} touches sys.path at lines {lines}: run it as a module from the repository "
        "root (python -m bench.x.y) instead; pytest gets the root through pyproject's pythonpath"
    )


def _suite_commands() -> list[str]:
    """bench/gpu_suite.sh's lines, continuation lines joined."""
    return (BENCH / "gpu_suite.sh").read_text().replace("\\\n", " ").splitlines()


def test_gpu_suite_starts_benchmarks_as_modules() -> None:
    lines = [ln for ln in _suite_commands() if not ln.lstrip().startswith("#")]
    as_script = [ln.strip() for ln in lines if re.search(r"(python3?|torchrun)\b[^|;]*\sbench/\S+\.py\b", ln)
                 and "pytest" not in ln]  # fmt: skip
    assert not as_script, f"benchmarks started as scripts (use python3 -m / torchrun -m): {as_script}"
    modules = sorted({m for ln in lines for m in re.findall(r"\s-m\s+(bench(?:\.\w+)+)", ln)})
    assert {"bench.e2e.run", "bench.offload.run", "bench.kernels.run", "bench.regress"} <= set(modules), modules
    missing = [m for m in modules if not (REPO / (m.replace(".", "/") + ".py")).is_file()]
    assert not missing, f"gpu_suite.sh runs modules that do not exist: {missing}"


def test_gpu_suite_compares_kernels_with_pytest_benchmark() -> None:
    text = " ".join(_suite_commands())
    for flag in ("--benchmark-autosave", "--benchmark-compare", "--benchmark-compare-fail", "--benchmark-storage"):
        assert flag in text, f"gpu_suite.sh's kernels-pb stage lacks {flag}"
    assert "bench/kernels/test_bench_kernels.py" in text
    assert not re.search(r"bench\.regress\S*\s+\S*kernels\.json", text), "kernels.json goes to pytest-benchmark"


def test_free_port_is_bindable() -> None:
    port = free_port()
    assert 0 < port < 65536
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


# ------------------------------------------------------------------------------------------------ as modules


def test_report_and_regress_run_as_modules(tmp_path: Path) -> None:
    results = make_results_dir(tmp_path / "results")
    proc = _run([sys.executable, "-m", "bench.report", "--results", str(results), "--summary"], timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "tokens/s/GPU" in proc.stdout
    new = tmp_path / "e2e_2gpu.json"
    new.write_text(json.dumps(e2e_payload(2, (113.7 * 1.2, 52.3))))
    stored = results / "h200" / "e2e_2gpu.json"
    proc = _run([sys.executable, "-m", "bench.regress", str(new), "--baseline", str(stored)], timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAIL" in proc.stdout and "shardfuse 8k" in proc.stdout
    kern = tmp_path / "kernels.json"
    kern.write_text(json.dumps(kernels_payload(1.2)))
    proc = _run([sys.executable, "-m", "bench.regress", str(kern), "--results", str(results)], timeout=60)
    assert proc.returncode == 2 and "pytest-benchmark" in proc.stderr, proc.stdout + proc.stderr


def test_host_overhead_runs_as_module(capsys: pytest.CaptureFixture) -> None:
    proc = _run([sys.executable, "-m", "bench.e2e.host_overhead", "--units", "2", "--reps", "2", "--steps", "3"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    m = re.search(r"plain ([\d.]+) ms/step, shardfuse ([\d.]+) ms/step: (-?[\d.]+) ms per step", proc.stdout)
    assert m, proc.stdout
    assert float(m.group(1)) > 0 and float(m.group(2)) > 0
    from bench.e2e.host_overhead import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--steps", "0"])
    assert "--steps must be >= 1, got 0" in capsys.readouterr().err


def test_e2e_bench_cpu_smoke(tmp_path: Path) -> None:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "-m", "bench.e2e.run", "--device", "cpu", "--config", "tiny", "--regime", "1k",
        "--impls", "shardfuse,fsdp2", "--steps", "2", "--warmup", "1", "--profile", str(tmp_path / "prof"),
    ]  # fmt: skip
    proc = _run(cmd, timeout=180, BENCH_OUT=str(tmp_path))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    result = json.loads((tmp_path / "cpu" / "e2e_2gpu.json").read_text())
    rows = {r["impl"]: r for r in result["results"]}
    assert set(rows) == {"baseline", "shardfuse", "fsdp2"}
    for impl, row in rows.items():
        assert "error" not in row and "skipped" not in row, (impl, row)
        assert row["step_ms"] > 0 and math.isfinite(row["loss_last"]) and row["seq"] == 32
    # Same weights, same data, one step of lr 1e-4 apart: the sharded runs train alike.
    assert abs(rows["shardfuse"]["loss_last"] - rows["fsdp2"]["loss_last"]) < 1e-2
    assert list((tmp_path / "prof").glob("shardfuse_1k_*.json")), "no profiler trace written"


def test_e2e_bench_argument_errors(capsys: pytest.CaptureFixture) -> None:
    from bench.e2e.run import parse_args

    for argv, message in [
        (["--impls", "shardfuse,deepspeed"], "unknown ['deepspeed']"),
        (["--steps", "0"], "need --steps >= 1"),
    ] + ([] if torch.cuda.is_available() else [(["--device", "cuda"], "no CUDA GPU is visible")]):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert message in capsys.readouterr().err
    assert parse_args(["--impls", "fsdp2, shardfuse", "--device", "cpu"]).impl_list == ["fsdp2", "shardfuse"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU run of the suite's stages (nothing is timed)")
def test_gpu_suite_regress_and_kernels_pb_stages(tmp_path: Path) -> None:
    out = tmp_path / "out"
    results = out / "work" / "results" / "cpu"
    results.mkdir(parents=True)
    payload = e2e_payload()
    payload["env"]["gpu_key"] = "cpu"
    (results / "e2e_2gpu.json").write_text(json.dumps(payload))
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])  # its python3 is ours
    proc = _run(["bash", str(BENCH / "gpu_suite.sh"), "regress", "kernels-pb"], timeout=300, OUT=str(out), PATH=path)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    summary = (out / "work" / "summary.txt").read_text()
    assert re.search(r"^regress\s+rc=0\b", summary, re.MULTILINE), summary + log[-3000:]
    assert re.search(r"^kernels-pb\s+rc=0\b", summary, re.MULTILINE), summary + log[-3000:]
    assert "nothing to compare" in (out / "work" / "regress.log").read_text()  # no stored cpu results
    assert "saving only" in log  # no stored pytest-benchmark run for the cpu
    assert (out / "suite.tgz").is_file()
