"""``bench.offload.big`` on the CPU: the plumbing on a tiny model (no GPU), the JSON schema, the time plan.

One end-to-end run (``--device cpu --configs tiny-acc``: the floor process, the resident and shardfuse processes;
the GPU-only implementations skipped), the refusal without CUDA, a killed measurement, and the floor arithmetic.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import shardfuse
from bench.offload import big
from bench.offload.big_impls import CONFIGS, GPU_ONLY, MODELS, Job

REPO = Path(__file__).resolve().parents[2]
ROW_KEYS = {"impl": str, "tokens_per_step": int, "params": int, "status": str, "config": str}
NUMBER_KEYS = ("step_ms", "floor_ms", "gpu_peak_gib", "host_rss_gib")


def _run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "OUT")}
    env.update(TRITON_INTERPRET="0", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "bench.offload.big", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


def _check_row(row: dict[str, Any]) -> None:
    for k, t in ROW_KEYS.items():
        assert isinstance(row[k], t), (k, row)
    for k in NUMBER_KEYS:
        assert k in row and (row[k] is None or isinstance(row[k], float)), (k, row)
    assert row["impl"] in {"resident", "shardfuse", "shardfuse-budget", "fairscale", "fsdp2", "deepspeed-zero2",
                           "deepspeed-zero3"}, row  # fmt: skip
    assert row["status"] in {"ok", "skipped", "oom", "error", "compute-only"}, row
    if row["status"] != "ok":
        assert row["reason"], row


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    out = tmp_path_factory.mktemp("offload_big") / "offload_big.json"
    # --bw-gib: the floor's host copy bandwidth on 64 MiB buffers, not 1 GiB (~5 s of page faults on the CPU)
    proc = _run("--device", "cpu", "--configs", "tiny-acc", "--impls", "shardfuse,fsdp2,deepspeed-zero2",
                "--steps", "1", "--warmup", "0", "--bw-gib", "0.0625", "--out", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads(out.read_text())


def test_cpu_run_schema(cpu_run: tuple[subprocess.CompletedProcess[str], dict[str, Any]]) -> None:
    proc, data = cpu_run
    for key in ("env", "host", "hardware_floor", "config", "floors", "results"):
        assert key in data, key
    assert data["env"]["torch"] == torch.__version__ and data["env"]["commit"]
    assert data["host"]["cpu_count"] >= 1
    hw = data["hardware_floor"]
    assert hw["opt_s_per_param"] > 0 and hw["opt_threads"] >= 1
    assert hw["host_copy_gbps"] > 0 and hw["host_copy_bytes"] == 2**26  # --bw-gib 0.0625
    floor = data["floors"]["tiny-acc"]
    assert floor["params"] == MODELS["tiny"].num_params() and floor["floor_ms"] > 0
    assert floor["floor_ms"] == max(v for k, v in floor.items() if k in ("compute_ms", "pcie_ms", "cpu_opt_ms") and v)
    rows = {(r["impl"], r.get("variant")): r for r in data["results"]}
    for r in data["results"]:
        _check_row(r)
        assert r["config"] == "tiny-acc" and r["tokens_per_step"] == CONFIGS["tiny-acc"].tokens_per_step
    resident = rows[("resident", None)]
    assert resident["status"] == "ok" and resident["step_ms"] > 0 and resident["fwd_bwd_ms"] > 0
    assert resident["host_rss_gib"] > 0 and resident["floor_ms"] == floor["floor_ms"]
    sf = rows[("shardfuse", None)]
    if hasattr(shardfuse, "OffloadOptimizer"):  # the lead's API: on a CPU compute device it may refuse
        assert sf["status"] in ("ok", "error"), sf
    else:
        assert sf["status"] == "ok" and sf["offload_optimizer"] is False, sf
        assert ("shardfuse-budget", None) not in rows  # not asked for
    if sf["status"] == "ok":
        assert sf["vs_floor"] == pytest.approx(sf["step_ms"] / floor["floor_ms"])
        assert sf["vs_resident"] == pytest.approx(sf["step_ms"] / resident["step_ms"])
        assert len(sf["losses"]) == 1
        assert sf["warmup_steps"] == data["config"]["warmup"]  # nothing placed on a CPU compute device
    for impl in ("fsdp2", "deepspeed-zero2"):
        assert rows[(impl, None)]["status"] == "skipped" and "CUDA" in rows[(impl, None)]["reason"]
    assert "config" in proc.stdout.splitlines()[-len(rows) - 3]  # the table comes last
    assert "hardware floor" in proc.stdout
    # A progress line per measurement, with the time left from the plan's estimates.
    line = r"^-- \[(\d+)/(\d+)\] tiny-acc (\S+) \.\.\. \(elapsed \d+ s, left ~[\dmhs ]+\)$"
    starts = re.findall(line, proc.stdout, re.M)
    assert [(int(i), int(n)) for i, n, _ in starts] == [(i, 4) for i in range(1, 5)], proc.stdout[-3000:]
    assert [impl for _, _, impl in starts] == ["resident", "shardfuse", "fsdp2", "deepspeed-zero2"]


def test_refuses_without_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the real run would start")
    proc = _run("--configs", "2.9b-4k", timeout=120)
    assert proc.returncode != 0 and "needs a CUDA GPU" in proc.stderr, proc.stderr[-2000:]


def test_estimate_plan_fits_split_calls() -> None:
    args = big.parse_args(["--estimate"])
    todo = big.plan(args)
    assert todo[0] == ("2.9b-4k", "resident")
    assert ("2.9b-4k", "shardfuse-host-accum") not in todo and ("2.9b-32k", "shardfuse-host-accum") in todo
    for config in ("2.9b-4k", "2.9b-32k", "6.7b-2k"):  # each configuration alone fits one 10-minute command
        total = big.FLOOR_ESTIMATE_S + sum(big.estimate_s(c, i, args) for c, i in todo if c == config)
        assert total < 570, (config, total)


def test_cpu_only_configs_on_cpu() -> None:
    with pytest.raises(SystemExit):
        big.parse_args(["--device", "cpu", "--configs", "2.9b-4k"])
    with pytest.raises(SystemExit):
        big.parse_args(["--impls", "nope"])


def test_bw_gib_must_be_positive() -> None:
    assert big.parse_args(["--bw-gib", "0.5"]).bw_gib == 0.5
    with pytest.raises(SystemExit):
        big.parse_args(["--bw-gib", "0"])


def test_floor_arithmetic_and_rows() -> None:
    n = MODELS["2.9b"].num_params()
    hw = {"h2d_gbps": 50.0, "d2h_gbps": 25.0, "opt_s_per_param": 0.5 / n}
    floor = big.config_floor("2.9b-4k", hw, {"fwd_bwd_ms": 100.0})
    assert floor["h2d_ms"] == pytest.approx(2 * n / 50e9 * 1e3) and floor["d2h_ms"] == pytest.approx(4 * n / 25e9 * 1e3)
    assert floor["cpu_opt_ms"] == pytest.approx(500.0)
    assert floor["floor_ms"] == pytest.approx(max(100.0, floor["d2h_ms"], 500.0))
    assert big.config_floor("tiny", {}, {})["floor_ms"] is None  # nothing measured: no floor, no crash
    job = Job(impl="shardfuse-host-accum", config="2.9b-32k")
    row = big.make_row("2.9b-32k", "shardfuse-host-accum", job, {"status": "ok", "step_ms": 1000.0})
    assert row["impl"] == "shardfuse" and row["variant"] == "host-accum" and row["tokens_per_step"] == 32768
    assert row["tokens_per_s"] == pytest.approx(32768.0)
    budget_job = Job(impl="shardfuse-budget", config="2.9b-4k", budget_gib=40.0)
    budget = big.make_row("2.9b-4k", "shardfuse-budget", budget_job, {"status": "skipped", "reason": "x"})
    assert budget["gpu_budget_gib"] == 40.0 and budget["step_ms"] is None
    floor32 = big.config_floor("2.9b-32k", hw, {"fwd_bwd_ms": 800.0})
    big.add_ratios([row, budget], floor32)
    assert row["floor_ms"] == floor32["floor_ms"] and row["vs_floor"] == pytest.approx(1000.0 / floor32["floor_ms"])
    assert budget["floor_ms"] is None and "vs_floor" not in budget  # another configuration's row: untouched


def test_killed_measurement_is_a_row_not_a_crash() -> None:
    result = big.run_child(Job(impl="resident", config="tiny", device="cpu"), timeout=0.3)
    assert result["status"] == "error" and "timed out" in result["reason"]
    assert result["host_rss_gib"] is not None


def test_gpu_only_impls_are_marked() -> None:
    assert {"fairscale", "fsdp2", "deepspeed-zero2", "deepspeed-zero3", "torchao"} == set(GPU_ONLY)


def test_gpu_suite_stage_by_name_only() -> None:
    text = (REPO / "bench" / "gpu_suite.sh").read_text().replace("\\\n", " ")
    stage = text[text.index("    offload-big)") : text.index(";;", text.index("    offload-big)"))]
    assert "-m bench.offload.big" in stage and '"${BIG_CONFIGS:-2.9b-4k}"' in stage and "--save" in stage
    assert "--target /tmp/site" in stage and ".whl/*.whl" in stage and "step offload-big" in stage
    defaults = " ".join(ln for ln in text.splitlines() if "STAGES=(" in ln or "STAGES+=(" in ln)
    assert "offload-big" not in defaults  # slow: asked for by name, one configuration per 10-minute command


def test_ssd_row_takes_the_disk_floor(tmp_path) -> None:
    """``shardfuse-ssd``: the disk probe measures both directions, and that row's floor is the larger of the
    configuration's floor and read + write of 12 B/param (fp32 shards and AdamW state) at the disk's speed."""
    from bench.offload import disk

    bw = disk.measure(str(tmp_path), gib=1 / 64)
    assert bw["read_gbps"] > 0 and bw["write_gbps"] > 0 and not list(tmp_path.iterdir())
    n = MODELS["6.7b"].num_params()
    slow = {"read_gbps": 2.0, "write_gbps": 1.0}
    assert disk.floor_ms(n, slow, True) == pytest.approx((12 * n / 2e9 + 12 * n / 1e9) * 1e3)
    rows = [{"impl": i, "config": "6.7b-2k", "params": n, "step_ms": 200_000.0, "ssd_optimizer_state": True}
            for i in ("shardfuse", "shardfuse-ssd")]
    big.add_ratios(rows, {"config": "6.7b-2k", "floor_ms": 1000.0}, slow)
    assert rows[0]["floor_ms"] == 1000.0 and "disk_floor_ms" not in rows[0]
    assert rows[1]["floor_ms"] == rows[1]["disk_floor_ms"] == pytest.approx(disk.floor_ms(n, slow, True))
    assert rows[1]["vs_floor"] == pytest.approx(200_000.0 / rows[1]["floor_ms"])


def test_ssd_settings_direct_io_and_the_mode_recorded(tmp_path, monkeypatch) -> None:
    """``BIG_SSD_DIRECT`` (default 1) reaches ``OffloadConfig(direct_io=)``; the row records the mode the store
    actually used (``direct`` on a file system that takes O_DIRECT, else buffered and why)."""
    from bench.offload import big_impls
    from shardfuse.sharding.ssd import _ssd_direct, _ssd_store

    monkeypatch.delenv("BIG_SSD_DIRECT", raising=False)
    assert big_impls.ssd_settings()["ssd_direct_io"] is True
    monkeypatch.setenv("BIG_SSD_DIRECT", "0")
    assert big_impls.ssd_settings()["ssd_direct_io"] is False
    seen: dict[str, Any] = {}

    def config(**kw: Any) -> None:
        seen.update(kw)
        raise KeyboardInterrupt  # stop before wrapping (no process group here)

    fields = big_impls._offload_config_fields()
    assert "direct_io" in fields
    monkeypatch.setattr(big_impls, "_offload_config_fields", lambda: fields)
    monkeypatch.setattr(shardfuse, "OffloadConfig", config)
    with pytest.raises(KeyboardInterrupt):
        big_impls._wrap_shardfuse(torch.nn.Linear(8, 8), torch.device("cpu"), {
            "ssd_dir": str(tmp_path), "ssd_optimizer_state": True, "reshard_after_forward": False,
            "ssd_direct_io": True})
    assert seen["direct_io"] is True
    monkeypatch.undo()
    for direct in (True, False):
        where = tmp_path / str(direct)
        where.mkdir()
        store = _ssd_store.new_store(str(where), 1, 1, direct)
        f = store.new_file("probe")  # the first file settles the mode
        modes = {store.dir: store.io_mode}
        assert big_impls.ssd_io_mode(str(tmp_path), modes) == "unknown"  # no store of the model there
        if not direct:
            assert big_impls.ssd_io_mode(str(where), modes) == "buffered"
        elif _ssd_direct.refusal(str(tmp_path)) is None:
            assert big_impls.ssd_io_mode(str(where), modes) == "direct"
        else:
            assert big_impls.ssd_io_mode(str(where), modes).startswith("buffered (O_DIRECT refused")
        del f


def test_merge_keeps_each_rows_commit(tmp_path) -> None:
    def result(commit: str, impl: str, step_ms: float) -> dict[str, Any]:
        cores = 16 if commit == "aaaa" else 32
        return {"kind": "offload_big", "env": {"gpu_name": "G", "commit": commit, "date": f"d-{commit}"},
                "host": {"cpu_count": cores}, "floors": {},
                "results": [{"config": "tiny", "impl": impl, "step_ms": step_ms, "step_ms_min": step_ms,
                             "step_ms_max": step_ms, "tokens_per_step": 64, "tokens_per_s": 64e3 / step_ms}]}

    a, b, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "m.json"
    a.write_text(json.dumps(result("aaaa", "shardfuse", 5.0)))
    b.write_text(json.dumps(result("bbbb", "deepspeed-zero3", 7.0)))
    big.main(["--merge", str(a), str(b), "--out", str(out)])
    merged = json.loads(out.read_text())
    assert {r["impl"]: r["commit"] for r in merged["results"]} == {"shardfuse": "aaaa", "deepspeed-zero3": "bbbb"}
    # hosts differ (a 16- and a 32-core one differ 1.5x in CPU optimizer speed): each row keeps its own
    assert {r["impl"]: (r["host_cores"], r["date"]) for r in merged["results"]} == {
        "shardfuse": (16, "d-aaaa"), "deepspeed-zero3": (32, "d-bbbb")}
    assert merged["env"]["commit"] == "bbbb" and [m["commit"] for m in merged["merged_from"]] == ["aaaa", "bbbb"]


def test_torchao_side_by_side_plan_budget_and_speed(capsys) -> None:
    """torchao runs first (after resident); the -ao rows take its GPU peak of the same configuration as their
    budget (the fallback where it measured none); speed vs torchao = torchao's step time over the row's."""
    from bench.offload.big_impls import AO_FALLBACK_BUDGET_GIB, AO_VARIANT

    assert "torchao" not in big.DEFAULT_IMPLS and not any("-ao" in i for i in big.DEFAULT_IMPLS)
    args = big.parse_args(["--estimate", "--configs", "2.9b-4k", "--impls",
                           "shardfuse-budget-ao,shardfuse,torchao,shardfuse-budget-ao-sib,shardfuse-budget"])
    assert big.plan(args) == [("2.9b-4k", i) for i in ("resident", "torchao", "shardfuse-budget-ao", "shardfuse",
                                                       "shardfuse-budget-ao-sib", "shardfuse-budget")]
    assert big.budget_gib("shardfuse-budget-ao", "2.9b-4k", [], args) == AO_FALLBACK_BUDGET_GIB == 30.0
    assert "no torchao GPU peak measured" in capsys.readouterr().out
    ao = {"impl": "torchao", "config": "2.9b-4k", "status": "ok", "gpu_peak_gib": 29.6312, "step_ms": 817.5}
    other = {**ao, "config": "2.9b-32k", "gpu_peak_gib": 50.0}
    failed = {**ao, "status": "oom", "gpu_peak_gib": 70.0}
    assert big.budget_gib("shardfuse-budget-ao", "2.9b-4k", [other, failed, ao], args) == 29.63
    assert big.budget_gib("shardfuse-budget-ao-sib", "2.9b-4k", [ao], args) == 29.63
    assert big.budget_gib("shardfuse-budget", "2.9b-4k", [ao], args) == 40.0
    assert big.budget_gib("shardfuse", "2.9b-4k", [ao], args) is None
    job = Job(impl="shardfuse-budget-ao", config="2.9b-4k", budget_gib=29.63)
    row = big.make_row("2.9b-4k", "shardfuse-budget-ao", job, {"status": "ok", "step_ms": 545.0})
    assert row["impl"] == "shardfuse-budget" and row["variant"] == AO_VARIANT and row["gpu_budget_gib"] == 29.63
    sib = big.make_row("2.9b-4k", "shardfuse-budget-ao-sib", job, {"status": "ok", "step_ms": 400.0})
    assert sib["variant"].startswith("step-in-backward, no clipping")
    ao_row = big.make_row("2.9b-4k", "torchao", Job(impl="torchao", config="2.9b-4k"),
                          {"status": "ok", "step_ms": 817.5, "gpu_peak_gib": 29.6})
    elsewhere = big.make_row("2.9b-32k", "shardfuse", Job(impl="shardfuse", config="2.9b-32k"),
                             {"status": "ok", "step_ms": 100.0})
    rows = [ao_row, row, sib, elsewhere]
    for r in rows:
        r.update(step_ms_min=r["step_ms"] - 1, step_ms_max=r["step_ms"] + 1)
    big.vs_torchao(rows, "2.9b-4k")
    assert row["speed_vs_torchao"] == pytest.approx(817.5 / 545.0)
    assert sib["speed_vs_torchao"] == pytest.approx(817.5 / 400.0)
    assert ao_row["speed_vs_torchao"] == 1.0 and "speed_vs_torchao" not in elsewhere
    big.print_table(rows)
    out = capsys.readouterr().out
    assert "shardfuse-budget+ao " in out and "shardfuse-budget+sib+ao" in out and "torchao " in out


def test_torchao_row_is_skipped_with_a_reason(monkeypatch) -> None:
    from bench.offload import big_impls

    assert big_impls.unavailable_reason("torchao", "cpu") == "needs a CUDA GPU"
    monkeypatch.setitem(sys.modules, "torchao", None)  # as if it were not importable
    monkeypatch.setitem(sys.modules, "torchao.optim", None)
    with pytest.raises(big_impls.Skip, match="torchao is not importable here .*install torchao 0.18"):
        big_impls.make_torchao(Job(impl="torchao", config="tiny", device="cpu"), torch.device("cpu"))


def test_spec_chunk_from_the_environment(monkeypatch) -> None:
    from bench.offload.big_knobs import set_spec_chunk
    from shardfuse.sharding.host import _speculative

    monkeypatch.setattr(_speculative, "SPEC_CHUNK_ELEMENTS", _speculative.SPEC_CHUNK_ELEMENTS)
    assert set_spec_chunk(None) == _speculative.SPEC_CHUNK_ELEMENTS == 1 << 21
    assert set_spec_chunk("524288") == 524288 == _speculative.SPEC_CHUNK_ELEMENTS
    with pytest.raises(ValueError, match="BIG_SPEC_CHUNK=1000: .*multiple of 4096"):
        set_spec_chunk("1000")
    assert _speculative.SPEC_CHUNK_ELEMENTS == 524288


def test_every_impl_has_a_time_estimate():
    """The time plan (``--estimate``, and the child timeouts) knows every implementation ``--impls`` accepts."""
    from bench.offload.big import ESTIMATE
    from bench.offload.big_impls import IMPLS

    assert set(IMPLS) <= set(ESTIMATE), f"no estimate for {sorted(set(IMPLS) - set(ESTIMATE))}"


def test_budget_rows_warm_up_through_the_placements() -> None:
    """A row whose OffloadOptimizer still has budget placements to make warms up through them and one step more."""
    from types import SimpleNamespace

    from bench.offload.big_child import settle_steps

    def trainer(stats: Any) -> Any:
        return SimpleNamespace(opt=SimpleNamespace(host_stats=lambda: stats) if stats is not None else object())

    assert settle_steps(trainer({"placements_left": 2.0})) == 3
    assert settle_steps(trainer({"placements_left": 1.0})) == 2
    assert settle_steps(trainer({"placements_left": 0.0})) == 0
    assert settle_steps(trainer({})) == 0  # an older shardfuse: nothing reported
    assert settle_steps(trainer(None)) == 0  # another optimizer
