"""``bench.ab``: medians, ratios and verdicts against the noise thresholds; the subprocess plumbing on two fake
trees (the before tree inside the after one, as ``.before/`` on the device) whose "benchmark" writes a result
like ``bench.offload.run``'s: each run imports its own tree, the order alternates, a slower tree fails."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import ab

FAKE_BENCH = """\
import json, os, sys, time
from pathlib import Path
STEP_MS, PEAK_GIB, SLEEP_S = {step_ms!r}, {peak_gib!r}, {sleep_s!r}
time.sleep(SLEEP_S)
out = Path(os.environ["BENCH_OUT"]) / "cpu" / "fake.json"
out.parent.mkdir(parents=True, exist_ok=True)
variants = {{"v": {{"step_ms": STEP_MS, "peak_gib": PEAK_GIB, "losses": [2.0, 1.5]}}, "gone": {{"skipped": "no"}}}}
out.write_text(json.dumps({{"env": {{"gpu_key": "cpu", "commit": os.environ["SHARDFUSE_COMMIT"]}},
                            "variants": variants, "cwd": os.getcwd(), "argv": sys.argv[1:]}}))
"""


def fake_tree(root: Path, step_ms: float, peak_gib: float = 1.0, sleep_s: float = 0.0) -> Path:
    for pkg in ("shardfuse", "bench"):
        (root / pkg).mkdir(parents=True)
        (root / pkg / "__init__.py").write_text("")
    (root / "bench" / "fake.py").write_text(FAKE_BENCH.format(step_ms=step_ms, peak_gib=peak_gib, sleep_s=sleep_s))
    return root


FAKE = ab.Bench("fake", "bench.fake", ("--flag", "x"), "fake", ab.parse_offload)


def make_job(tmp_path: Path, before_ms: float, after_ms: float, rounds: int = 2, **kw: Any) -> ab.Job:
    after = fake_tree(tmp_path / "tree", after_ms, peak_gib=kw.pop("after_gib", 1.0), sleep_s=kw.pop("sleep_s", 0))
    before = fake_tree(after / ".before", before_ms)
    (before / "COMMIT").write_text("cd970f2\n")
    trees = {"before": ab.make_tree("before", before), "after": ab.make_tree("after", after, "abc1234")}
    return ab.Job(trees, [FAKE], rounds, tmp_path / "out" / "ab.json", tmp_path / "out" / "logs", **kw)


def test_runs_alternate_import_their_own_tree_and_a_slower_after_fails(tmp_path: Path) -> None:
    job = make_job(tmp_path, before_ms=100.0, after_ms=120.0, rounds=3)
    payload = ab.run_job(job)
    assert [(r["round"], r["tree"]) for r in payload["runs"]] == [
        (0, "before"), (0, "after"), (1, "after"), (1, "before"), (2, "before"), (2, "after")]  # fmt: skip
    for r in payload["runs"]:
        tree = job.trees[r["tree"]].path
        assert "error" not in r and r["rc"] == 0
        assert Path(r["imported"]["shardfuse"]) == tree / "shardfuse" / "__init__.py"
        assert Path(r["imported"]["bench"]) == tree / "bench" / "__init__.py"
        assert Path(r["log"]).read_text().startswith(ab.MARKER)
    assert payload["trees"]["before"]["commit"] == "cd970f2" and payload["trees"]["after"]["commit"] == "abc1234"
    time_row = next(c for c in payload["comparison"] if c["metric"] == "time_ms")
    assert time_row["row"] == "v" and time_row["before_values"] == [100.0] * 3
    assert time_row["ratio"] == pytest.approx(1.2) and time_row["verdict"] == "FAIL"
    assert not payload["ok"] and json.loads(job.out.read_text())["ok"] is False
    assert {c["row"] for c in payload["comparison"]} == {"v"}  # a skipped variant is not compared


def test_child_runs_in_its_tree_with_the_arguments_and_commit(tmp_path: Path) -> None:
    job = make_job(tmp_path, before_ms=100.0, after_ms=101.0, rounds=1)
    with_out = tmp_path / "bench_out"
    bootstrap = tmp_path / "boot.py"
    bootstrap.write_text(ab.BOOTSTRAP)
    rec = ab.run_one(FAKE, job.trees["before"], 0, bootstrap, with_out, tmp_path, timeout=60)
    written = json.loads(next(with_out.glob("*/*/fake.json")).read_text())
    assert Path(written["cwd"]) == job.trees["before"].path and written["argv"] == ["--flag", "x"]
    assert written["env"]["commit"] == "cd970f2" and rec["rows"]["v"]["time_ms"] == 100.0
    assert rec["rows"]["v"]["loss"] == 1.5 and rec["rows"]["gone"] == {"skipped": "no"}


def test_within_noise_passes_and_memory_has_its_own_threshold(tmp_path: Path) -> None:
    payload = ab.run_job(make_job(tmp_path, before_ms=100.0, after_ms=104.0, rounds=2, after_gib=1.06))
    verdicts = {c["metric"]: c["verdict"] for c in payload["comparison"]}
    assert verdicts == {"time_ms": "PASS", "peak_gib": "FAIL", "loss": "INFO"}


def test_a_run_past_its_timeout_is_an_error_and_its_rows_are_missing(tmp_path: Path) -> None:
    job = make_job(tmp_path, before_ms=100.0, after_ms=100.0, rounds=1, sleep_s=30, timeout=2.0)
    payload = ab.run_job(job)
    after = next(r for r in payload["runs"] if r["tree"] == "after")
    assert after["error"] == "timed out after 2s" and after["rows"] == {}
    assert next(c for c in payload["comparison"] if c["metric"] == "time_ms")["verdict"] == "MISSING"
    assert not payload["ok"]


def test_the_deadline_stops_between_rounds(tmp_path: Path) -> None:
    payload = ab.run_job(make_job(tmp_path, before_ms=100.0, after_ms=100.0, rounds=3, deadline_s=0.001))
    assert payload["rounds_run"] == 1 and len(payload["runs"]) == 2 and payload["stopped"].startswith("after 1")
    assert payload["ok"]


def test_main_prints_the_table_and_exits_1_on_a_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    job = make_job(tmp_path, before_ms=100.0, after_ms=130.0)
    monkeypatch.setattr(ab, "make_benches", lambda *a: {"fake": FAKE})
    out = tmp_path / "cli.json"
    argv = ["--before", str(job.trees["before"].path), "--after", str(job.trees["after"].path), "--bench", "fake",
            "--rounds", "2", "--out", str(out)]  # fmt: skip
    assert ab.main(argv) == 1
    printed = capsys.readouterr().out
    assert "1.300" in printed and "FAIL" in printed and "NOT OK" in printed
    assert (tmp_path / "cli_logs" / "fake_before_r1.log").is_file() and json.loads(out.read_text())["runs"]


def test_compare_medians_spread_and_verdicts() -> None:
    row = ab.compare_row({"before": [100.0, 300.0, 100.0], "after": [105.0, 104.0, 90.0]}, "time_ms", 0.10)
    assert (row["before_median"], row["after_median"]) == (100.0, 104.0)
    assert row["before_spread"] == [100.0, 300.0] and row["ratio"] == pytest.approx(1.04)
    assert row["verdict"] == "PASS" and row["noisy"]
    assert ab.compare_row({"before": [100.0], "after": [111.0]}, "time_ms", 0.10)["verdict"] == "FAIL"
    assert ab.compare_row({"before": [100.0], "after": [85.0]}, "time_ms", 0.10)["verdict"] == "BETTER"
    assert ab.compare_row({"before": [10.0], "after": [10.6]}, "peak_gib", 0.05)["verdict"] == "FAIL"
    assert ab.compare_row({"before": [10.0], "after": [10.4]}, "peak_gib", 0.05)["verdict"] == "PASS"
    assert ab.compare_row({"before": [1.0]}, "time_ms", 0.10)["verdict"] == "MISSING"
    assert ab.compare_row({"before": [2.0], "after": [3.0]}, "loss", None)["verdict"] == "INFO"


def test_a_row_in_error_is_missing_and_better_fails_only_when_strict() -> None:
    runs = [{"bench": "e2e", "tree": "before", "rows": {"shardfuse/1k": {"time_ms": 50.0}, "x/1k": {"time_ms": 9.0}}},
            {"bench": "e2e", "tree": "after", "rows": {"shardfuse/1k": {"error": "boom"}, "x/1k": {"time_ms": 7.0}}}]
    rows = ab.compare(runs, 0.10, 0.05)
    assert [(r["row"], r["verdict"]) for r in rows] == [("shardfuse/1k", "MISSING"), ("x/1k", "BETTER")]
    assert not ab.outcome(runs, rows, strict=False)
    assert ab.outcome(runs, rows[1:], strict=False) and not ab.outcome(runs, rows[1:], strict=True)


def test_round_order_alternates() -> None:
    assert [ab.round_order(r) for r in range(3)] == [("before", "after"), ("after", "before"), ("before", "after")]


def test_parse_e2e_rows() -> None:
    payload = {"results": [
        {"impl": "shardfuse", "regime": "1k", "step_ms": 70.0, "peak_gib": 12.5, "loss_last": 10.3},
        {"impl": "fairscale", "regime": "1k", "skipped": "not importable"},
        {"impl": "fsdp2", "regime": "1k", "error": "rank 0: RuntimeError: x"},
        {"impl": "shardfuse", "regime": "8k", "step_ms": 9.0, "loss_last": 5.0},  # a CPU run: no peak memory
    ]}  # fmt: skip
    assert ab.parse_e2e(payload) == {
        "shardfuse/1k": {"time_ms": 70.0, "peak_gib": 12.5, "loss": 10.3},
        "fairscale/1k": {"skipped": "not importable"},
        "fsdp2/1k": {"error": "rank 0: RuntimeError: x"},
        "shardfuse/8k": {"time_ms": 9.0, "loss": 5.0},
    }


def test_child_env_puts_the_tree_first_and_drops_other_trees(tmp_path: Path) -> None:
    tree = ab.make_tree("after", fake_tree(tmp_path / "a", 1.0), "c0ffee")
    other = fake_tree(tmp_path / "other", 1.0)
    plain = tmp_path / "site"
    plain.mkdir()
    env = ab.child_env(tree, tmp_path / "o", {"PYTHONPATH": os.pathsep.join([str(other), str(plain)]), "X": "1"})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(tree.path), str(plain)]
    assert (env["BENCH_OUT"], env["SHARDFUSE_COMMIT"], env["X"]) == (str(tmp_path / "o"), "c0ffee", "1")
    assert env["OUT"] == str(tmp_path / "o")  # a runner's default output stays out of the tree


def test_parse_offload_big_rows() -> None:
    payload = {"results": [
        {"config": "2.9b-4k", "impl": "shardfuse", "status": "ok", "step_ms": 990.0, "gpu_peak_gib": 15.0,
         "host_rss_gib": 46.8, "losses": [11.0, 10.5]},
        {"config": "2.9b-4k", "impl": "shardfuse", "variant": "step-in-backward, no clipping", "status": "ok",
         "step_ms": 800.0, "gpu_peak_gib": 15.0, "host_rss_gib": 46.9, "losses": [11.0, 10.6]},
        {"config": "2.9b-4k", "impl": "fsdp2", "status": "skipped", "reason": "not importable"},
        {"config": "2.9b-4k", "impl": "shardfuse-budget", "status": "oom", "reason": "GPU out of memory"},
    ]}  # fmt: skip
    assert ab.parse_offload_big(payload) == {
        "2.9b-4k/shardfuse": {"time_ms": 990.0, "peak_gib": 15.0, "host_gib": 46.8, "loss": 10.5},
        "2.9b-4k/shardfuse [step-in-backward, no clipping]": {"time_ms": 800.0, "peak_gib": 15.0, "host_gib": 46.9,
                                                              "loss": 10.6},
        "2.9b-4k/fsdp2": {"skipped": "skipped: not importable"},
        "2.9b-4k/shardfuse-budget": {"error": "oom: GPU out of memory"},
    }  # fmt: skip
    rows = ab.compare([{"bench": "offload-big", "tree": t, "rows": {"r": {"time_ms": 1.0, "host_gib": g}}}
                       for t, g in (("before", 40.0), ("after", 44.0))], 0.10, 0.05)  # fmt: skip
    assert {r["metric"]: r["verdict"] for r in rows} == {"time_ms": "PASS", "host_gib": "FAIL"}  # host RSS judged


def test_origin_error_wants_exactly_the_trees_packages(tmp_path: Path) -> None:
    tree = ab.make_tree("after", fake_tree(tmp_path / "a", 1.0))
    nested = tree.path / ".before" / "shardfuse" / "__init__.py"  # under the after tree, but not its own
    line = ab.MARKER + json.dumps({"shardfuse": str(nested), "bench": str(tree.path / "bench" / "__init__.py")})
    _, err = ab.origin_error(tree, "noise\n" + line)
    assert err is not None and "shardfuse was imported from" in err
    ok = ab.MARKER + json.dumps({m: str(tree.path / m / "__init__.py") for m in ("shardfuse", "bench")})
    assert ab.origin_error(tree, ok)[1] is None
    assert ab.origin_error(tree, "no marker")[1] == "the child never reported where shardfuse came from"


def test_tree_commit_from_git_then_commit_file(tmp_path: Path) -> None:
    repo = fake_tree(tmp_path / "repo", 1.0)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run([*git, "init", "-q"], cwd=repo, check=True)
    subprocess.run([*git, "add", "."], cwd=repo, check=True)
    subprocess.run([*git, "commit", "-qm", "x"], cwd=repo, check=True)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
    assert ab.tree_commit(repo) == (head, False)
    (repo / "shardfuse" / "__init__.py").write_text("x = 1\n")
    assert ab.tree_commit(repo) == (head, True)
    nested = fake_tree(repo / ".before", 1.0)  # inside the repository, without a .git of its own
    assert ab.tree_commit(nested) == ("unknown", None)
    (nested / "COMMIT").write_text("cd970f2\n")
    assert ab.tree_commit(nested) == ("cd970f2", None) and ab.tree_commit(nested, "given") == ("given", None)
    assert ab.tree_digest(repo) != ab.tree_digest(nested)


def test_cli_arguments() -> None:
    args = ab.parse_args(["--before", "b", "--after", "a", "--bench", "offload", "--offload-args", "--steps 9"])
    assert [b.name for b in args.bench_list] == ["offload"] and args.bench_list[0].args[-2:] == ("--steps", "9")
    with pytest.raises(SystemExit):
        ab.parse_args(["--before", "b", "--after", "a", "--bench", "e2e,nope"])
    cmd = ab.make_benches()["e2e"].command(Path("/t/boot.py"))
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"] and cmd[-len(ab.E2E_ARGS):] == list(ab.E2E_ARGS)


def test_default_arguments_fit_the_benchmarks() -> None:
    from bench.e2e import run as e2e_run
    from bench.offload import big

    big_args = big.parse_args(list(ab.OFFLOAD_BIG_ARGS))
    assert big_args.no_floor and big_args.save and big_args.impl_list == ["shardfuse", "shardfuse-sib"]
    assert big.plan(big_args) == [("2.9b-4k", "shardfuse"), ("2.9b-4k", "shardfuse-sib")]  # no resident run
    assert ab.make_benches()["offload-big"].result == "offload_big"

    args = e2e_run.parse_args(list(ab.E2E_ARGS))
    assert args.impl_list == ["shardfuse"] and args.regime_list == ["1k"] and args.no_baseline
    source = (Path(e2e_run.__file__).parents[1] / "offload" / "run.py").read_text()
    assert all(f'("{v}", run_' in source for v in ab.OFFLOAD_VARIANTS)
