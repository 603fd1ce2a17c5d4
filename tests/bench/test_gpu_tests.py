"""bench.gpu_tests (the GPU suite's tests stage): the one-GPU test files split over the GPUs, the multi-GPU ones
after, and a summary that names every failure; checked on the CPU with a plan and with fake pytest logs."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import gpu_tests


def _nodes(counts: dict[str, int]) -> list[str]:
    return [f"{path}::test_{i}" for path, n in counts.items() for i in range(n)]


def test_split_balances_test_counts_and_keeps_every_file_once() -> None:
    counts = {"tests/a.py": 41, "tests/b.py": 34, "tests/c.py": 29, "tests/d.py": 11, "tests/e.py": 7, "tests/f.py": 1}
    groups = gpu_tests.split_files(_nodes(counts), 2)
    assert sorted(p for g in groups for p in g) == sorted(counts)  # each file in exactly one group
    sizes = [sum(counts[p] for p in g) for g in groups]
    assert max(sizes) - min(sizes) <= max(counts.values()) - min(counts.values()) and abs(sizes[0] - sizes[1]) <= 7
    for g in groups:  # collection order kept inside a group
        assert g == sorted(g, key=list(counts).index)
    assert gpu_tests.split_files(_nodes({"tests/a.py": 3}), 4) == [["tests/a.py"]]  # no empty groups
    assert gpu_tests.split_files([], 2) == []
    with pytest.raises(ValueError, match="parts must be >= 1"):
        gpu_tests.split_files(_nodes(counts), 0)


def test_plan_one_process_per_gpu_then_the_multi_gpu_tests(tmp_path: Path) -> None:
    one = _nodes({"tests/k.py": 5, "tests/o.py": 5, "tests/s.py": 2})
    multi = _nodes({"tests/m.py": 3})
    stages = gpu_tests.plan(2, tmp_path, 300, ["-x"], one, multi)
    assert [[name for name, _, _ in stage] for stage in stages] == [["gpu0", "gpu1"], ["multigpu"]]
    assert [env for _, env, _ in stages[0]] == [{"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": "1"}]
    files = [[a for a in cmd if a.startswith("tests/")] for _, _, cmd in stages[0]]
    assert sorted(f for fs in files for f in fs) == ["tests/k.py", "tests/o.py", "tests/s.py"]
    for _, _, cmd in stages[0]:
        assert cmd[cmd.index("-m", 3) + 1] == gpu_tests.ONE_GPU_MARK and cmd[-1] == "-x"
    _, env, cmd = stages[1][0]
    assert env == {} and "tests/m.py" in cmd and cmd[cmd.index("-m", 3) + 1] == gpu_tests.MULTI_GPU_MARK
    # one GPU: everything one-GPU in one process, the multi-GPU tests not at all
    single = gpu_tests.plan(1, tmp_path, 300, [], one, multi)
    assert [[name for name, _, _ in stage] for stage in single] == [["gpu0"]]


def test_summary_names_each_part_and_every_failure(tmp_path: Path) -> None:
    (tmp_path / "tests-gpu0.log").write_text(
        "tests/a.py::test_x PASSED [ 50%]\ntests/a.py::test_y FAILED [100%]\n"
        "FAILED tests/a.py::test_y - AssertionError: boom\n===== 1 failed, 1 passed in 3.2s =====\n")
    (tmp_path / "tests-gpu1.log").write_text("tests/b.py::test_z PASSED [ 10%]\n")  # cut by the limit
    (tmp_path / "tests-multigpu.log").write_text("===== 4 passed in 9.0s =====\n")
    lines = gpu_tests.summarize(tmp_path, {"gpu0": 1, "gpu1": 124, "multigpu": 0})
    assert lines[:3] == ["tests gpu0: exit 1: ===== 1 failed, 1 passed in 3.2s =====",
                         "tests gpu1: exit 124: cut by the time limit",
                         "tests multigpu: exit 0: ===== 4 passed in 9.0s ====="]
    assert "gpu0: FAILED tests/a.py::test_y - AssertionError: boom" in lines
    assert "gpu0: tests/a.py::test_y FAILED [100%]" in lines
    assert not any(ln.startswith("gpu1:") or ln.startswith("multigpu:") for ln in lines[3:])


def test_collect_sorts_the_real_tests_by_marker() -> None:
    files = ("tests/sharding/test_capture_gpu.py", "tests/kernels/test_fp8.py", "tests/bench/test_gpu_tests.py")
    one, multi = (gpu_tests.collect(mark, [], files) for mark in (gpu_tests.ONE_GPU_MARK, gpu_tests.MULTI_GPU_MARK))
    assert one and {n.split("::")[0] for n in one} == {"tests/kernels/test_fp8.py"}
    assert multi and {n.split("::")[0] for n in multi} == {"tests/sharding/test_capture_gpu.py"}


def test_dry_run_prints_the_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    found = {gpu_tests.ONE_GPU_MARK: _nodes({"tests/k.py": 4, "tests/o.py": 3}),
             gpu_tests.MULTI_GPU_MARK: _nodes({"tests/m.py": 2})}
    monkeypatch.setattr(gpu_tests, "collect", lambda mark, args: found[mark])
    assert gpu_tests.main(["--gpus", "2", "--dry-run", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "stage 0 gpu0: CUDA_VISIBLE_DEVICES=0" in out and "stage 0 gpu1: CUDA_VISIBLE_DEVICES=1" in out
    assert "stage 1 multigpu:" in out and "tests/m.py" in out
    assert not list(tmp_path.glob("tests-*.log")), "a dry run ran something"


def test_four_gpus_run_the_multi_gpu_tests_on_two_pairs(tmp_path: Path) -> None:
    one = _nodes({"tests/k.py": 4})
    multi = _nodes({"tests/capture.py": 24, "tests/fsdp.py": 11, "tests/fused.py": 9, "tests/dcp.py": 1})
    stages = gpu_tests.plan(4, tmp_path, 150, [], one, multi)
    assert [name for name, _, _ in stages[1]] == ["multigpu0", "multigpu1"]
    assert [env for _, env, _ in stages[1]] == [{"CUDA_VISIBLE_DEVICES": "0,1"}, {"CUDA_VISIBLE_DEVICES": "2,3"}]
    files = [[a for a in cmd if a.startswith("tests/")] for _, _, cmd in stages[1]]
    assert sorted(f for fs in files for f in fs) == ["tests/capture.py", "tests/dcp.py", "tests/fsdp.py",
                                                     "tests/fused.py"]
    assert files[0] == ["tests/capture.py"]  # balanced by count: 24 against 21
    for name, _, cmd in stages[1]:
        assert f"--junitxml={tmp_path / f'tests-{name}-junit.xml'}" in cmd and "--timeout=150" in cmd
    # 3 GPUs: one pair only, in one process that sees every GPU (as on 2)
    assert [(n, e) for n, e, _ in gpu_tests.plan(3, tmp_path, 150, [], one, multi)[1]] == [("multigpu", {})]


def test_failures_print_their_traceback_as_they_happen(tmp_path: Path) -> None:
    """The plugin every part loads: the traceback comes right after the failing test's line, before the next
    test runs (a run killed at its limit keeps it), not only in the final summary."""
    import subprocess
    import sys

    (tmp_path / "test_x.py").write_text(
        "def test_fails():\n    assert 1 + 1 == 3, 'arithmetic moved'\n\n"
        "def test_next():\n    print('NEXT RAN')\n")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-v", "-s", "-p", "no:cacheprovider", "-p",
                           "bench._instant_failures", str(tmp_path / "test_x.py")],
                          capture_output=True, text=True, cwd=gpu_tests.Path(gpu_tests.__file__).parents[1])
    assert proc.returncode == 1, proc.stdout[-2000:]
    out = proc.stdout
    first = out.index("--- ")
    assert "test_x.py::test_fails failed in call" in out[first:first + 200]
    assert "arithmetic moved" in out[first:out.index("NEXT RAN")]
