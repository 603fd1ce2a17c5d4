"""``bench.regress``: flags a 20% slowdown of an e2e or offload result and passes a 1% one, flags 11% more peak
memory of a shardfuse row and passes 5%; kernel results go to pytest-benchmark instead; ``bench.report --compare``
runs the same check."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from bench import regress, report
from tests.bench._payloads import e2e_payload, e2e_rounds_payload, kernels_payload, offload_payload, write_results


def _regress(tmp_path: Path, name: str, old: dict[str, Any], new: dict[str, Any], *extra: str) -> int:
    root = tmp_path / "stored"
    write_results(root, "h200", **{name: old})
    new_path = tmp_path / "new" / f"{name}.json"
    new_path.parent.mkdir(exist_ok=True)
    new_path.write_text(json.dumps(new))
    return regress.main([str(new_path), "--results", str(root), *extra])


@pytest.mark.parametrize(
    ("name", "make", "slower"),
    [
        ("e2e_2gpu", lambda f: e2e_payload(2, (113.7 * f, 52.3)), "shardfuse 8k"),
        ("offload", lambda f: offload_payload(587.4 * f), "shardfuse"),
    ],
    ids=["e2e", "offload"],
)
def test_regression_check(tmp_path: Path, capsys: pytest.CaptureFixture, name: str, make: Any, slower: str) -> None:
    old = make(1.0)
    assert _regress(tmp_path, name, old, make(1.20)) == 1
    out = capsys.readouterr().out
    assert "REGRESSION" in out and "+20.0%" in out and slower in out and "FAIL" in out
    assert _regress(tmp_path, name, old, make(1.01)) == 0
    assert "PASS" in capsys.readouterr().out
    assert _regress(tmp_path, name, old, make(0.80)) == 0  # faster is fine
    assert _regress(tmp_path, name, old, make(1.20), "--noise", "0.25") == 0  # a wider band


def _grow_peaks(payload: dict[str, Any], factor: float, impls: tuple[str, ...] = ("shardfuse",)) -> dict[str, Any]:
    """``payload`` with the peak memory of ``impls`` (e2e rows; offload: variants starting with them) scaled."""
    out = copy.deepcopy(payload)
    for row in out.get("results", []):
        if row["impl"] in impls and "peak_gib" in row:
            row["peak_gib"] *= factor
    for name, v in out.get("variants", {}).items():
        if name.startswith(impls) and "peak_gib" in v:
            v["peak_gib"] *= factor
    return out


@pytest.mark.parametrize(
    ("name", "make"),
    [("e2e_2gpu", e2e_payload), ("e2e_2gpu", e2e_rounds_payload), ("offload", offload_payload)],
    ids=["e2e", "e2e-rounds", "offload"],
)
def test_memory_growth_fails(tmp_path: Path, capsys: pytest.CaptureFixture, name: str, make: Any) -> None:
    old = make()
    assert _regress(tmp_path, name, old, _grow_peaks(old, 1.11)) == 1  # same times, 11% more memory
    out = capsys.readouterr().out
    assert "peak GiB" in out and "+11.0%" in out and "REGRESSION" in out and "FAIL" in out, out
    assert _regress(tmp_path, name, old, _grow_peaks(old, 1.05)) == 0
    assert "PASS" in capsys.readouterr().out
    assert _regress(tmp_path, name, old, _grow_peaks(old, 0.5)) == 0  # less memory is fine
    assert _regress(tmp_path, name, old, _grow_peaks(old, 1.11), "--mem-growth", "0.2") == 0
    # Another implementation's memory is context only.
    other = "fsdp2_cpu_offload" if name == "offload" else "fsdp2"
    assert _regress(tmp_path, name, old, _grow_peaks(old, 1.5, (other,))) == 0


def test_memory_of_capped_and_captured_rows_is_checked(tmp_path: Path) -> None:
    old = offload_payload()
    new = copy.deepcopy(old)
    new["capped"]["peak_gib"] *= 1.11
    assert _regress(tmp_path, "offload", old, new) == 1
    old = e2e_rounds_payload(captured=True)
    assert _regress(tmp_path, "e2e_2gpu", old, _grow_peaks(old, 1.11, ("shardfuse-graph",))) == 1


def test_the_report_names_both_commits(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    old, new = e2e_payload(), e2e_payload()
    old["env"] = dict(old["env"], commit="aaaaaaa")
    new["env"] = dict(new["env"], commit="bbbbbbb")
    assert _regress(tmp_path, "e2e_2gpu", old, new) == 0
    assert "stored: commit aaaaaaa" in (out := capsys.readouterr().out) and "new: commit bbbbbbb" in out


def test_kernel_results_are_left_to_pytest_benchmark(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert _regress(tmp_path, "kernels", kernels_payload(1.0), kernels_payload(1.5)) == 2
    err = capsys.readouterr().err
    assert "pytest-benchmark" in err and "--benchmark-compare" in err and "kernels-pb" in err
    rows = regress.metrics(regress.load_file(tmp_path / "new" / "kernels.json"))
    assert rows == {}  # nothing of a kernels file is compared here


def test_regression_check_flags_a_failed_row_and_ignores_baselines(tmp_path: Path) -> None:
    old = e2e_payload()
    broken = copy.deepcopy(old)
    for row in broken["results"]:
        if row["impl"] == "shardfuse" and row["regime"] == "1k":
            for k in ("step_ms", "tok_s_gpu", "mfu", "peak_gib"):
                row.pop(k)
            row["error"] = "rank 0: RuntimeError: boom"
    assert _regress(tmp_path, "e2e_2gpu", old, broken) == 1
    slower_fsdp2 = copy.deepcopy(old)
    for row in slower_fsdp2["results"]:
        if row["impl"] == "fsdp2":
            row["step_ms"] *= 1.5
    assert _regress(tmp_path, "e2e_2gpu", old, slower_fsdp2) == 0


def test_regression_check_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    new = tmp_path / "e2e_2gpu.json"
    new.write_text(json.dumps(e2e_payload()))
    assert regress.main([str(new), "--noise", "-0.1"]) == 2
    assert regress.main([str(new), "--baseline", str(new)]) == 2  # the stored file itself
    other = tmp_path / "offload.json"
    other.write_text(json.dumps(offload_payload()))
    assert regress.main([str(new), "--baseline", str(other)]) == 2  # different kinds
    junk = tmp_path / "junk.json"
    junk.write_text("{ not json")
    assert regress.main([str(junk)]) == 2
    err = capsys.readouterr().err
    assert "--noise must be >= 0" in err and "is a offload result" in err and "not a benchmark result" in err


def test_regression_check_without_stored_result(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    new = tmp_path / "e2e_2gpu.json"
    new.write_text(json.dumps(e2e_payload()))
    assert regress.main([str(new), "--results", str(tmp_path / "none")]) == 0
    assert "nothing to compare" in capsys.readouterr().out
    assert report.main(["--compare", str(new), "--results", str(tmp_path / "none")]) == 0


def test_report_compare_runs_the_check(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    root = tmp_path / "stored"
    write_results(root, "h200", offload=offload_payload())
    new = tmp_path / "new" / "offload.json"
    new.parent.mkdir()
    new.write_text(json.dumps(offload_payload(587.4 * 1.3)))
    assert report.main(["--compare", str(new), "--results", str(root)]) == 1
    assert "REGRESSION" in capsys.readouterr().out
    assert report.main(["--compare", str(new), "--results", str(root), "--noise", "0.5"]) == 0
