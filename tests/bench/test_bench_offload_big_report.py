"""``offload_big.json`` (``bench.offload.big``) in ``bench.results_io``, ``bench.report`` and ``bench.regress``:
its own kind (not an e2e file), the page's section with status rows, the README rows, and the regression check of
time, GPU peak and host RSS of every shardfuse row."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from bench import regress, report
from bench.report._offload_big import README_BENCH
from bench.report._readme import summary_rows
from bench.results_io import detect_kind, load_file, load_results
from tests.bench._payloads import ENV, e2e_payload, kernels_payload, write_results

GPU_ENV = {**ENV, "gpu_key": "h100", "gpu_name": "NVIDIA H100 80GB HBM3", "gpu_count": 1, "fairscale": "0.4.13",
           "deepspeed": "0.19.8"}  # fmt: skip
SIB = "step-in-backward, no clipping"
N29, N67 = 2_914_667_520, 6_738_415_616


def _row(impl: str, config: str, step_ms: float | None, gpu: float | None, host: float | None, **extra: Any) -> dict:
    tokens, n, mb = (4096, N29, 1) if config == "2.9b-4k" else (2048, N67, 1)
    row = {"impl": impl, "config": config, "tokens_per_step": tokens, "params": n, "step_ms": step_ms,
           "floor_ms": None, "gpu_peak_gib": gpu, "host_rss_gib": host, "status": "ok", "micro_batches": mb,
           "batch": 2 if config == "2.9b-4k" else 1, "seq": 2048}  # fmt: skip
    row.update(extra)
    if row["step_ms"]:
        row.update(step_ms_min=step_ms * 0.99, step_ms_max=step_ms * 1.02, tokens_per_s=tokens / (step_ms / 1e3))
    return row


def big_payload() -> dict[str, Any]:
    """An offload_big.json as ``bench.offload.big`` writes it: two configurations, every kind of row."""
    rows = [
        _row("resident", "2.9b-4k", 250.0, 55.0, 1.3, fwd_bwd_ms=200.0),
        _row("shardfuse", "2.9b-4k", 1500.0, 15.0, 46.8),
        _row("shardfuse", "2.9b-4k", 1300.0, 15.0, 46.7, variant=SIB),
        _row("shardfuse-budget", "2.9b-4k", 900.0, 32.7, 29.1, gpu_budget_gib=40.0),
        _row("shardfuse-budget", "2.9b-4k", 760.0, 32.7, 46.7, variant=SIB, gpu_budget_gib=40.0),
        _row("fsdp2", "2.9b-4k", 5000.0, 14.8, 54.9),
        _row("fairscale", "2.9b-4k", 4600.0, 14.7, 49.2),
        _row("deepspeed-zero2", "2.9b-4k", 1650.0, 18.5, 63.6),
        _row("deepspeed-zero3", "2.9b-4k", None, None, 70.1, status="oom", reason="GPU out of memory: tried 2 GiB"),
        _row("resident", "6.7b-2k", None, 70.0, 2.0, status="compute-only", fwd_bwd_ms=310.0,
             reason="fp32 weights, gradients and AdamW state do not fit on this GPU: forward+backward only"),
        _row("shardfuse", "6.7b-2k", 2600.0, 30.0, 110.0),
        _row("fsdp2", "6.7b-2k", None, None, None, status="skipped", reason="not importable"),
        _row("deepspeed-zero3", "6.7b-2k", None, None, 120.0, status="error", reason="killed by signal 9"),
    ]  # fmt: skip
    floors = {
        "2.9b-4k": {"config": "2.9b-4k", "params": N29, "compute_ms": 200.0, "pcie_ms": 286.0, "h2d_ms": 140.0,
                    "d2h_ms": 286.0, "cpu_opt_ms": 917.0, "floor_ms": 917.0, "bound": "cpu_opt_ms"},
        "6.7b-2k": {"config": "6.7b-2k", "params": N67, "compute_ms": 310.0, "pcie_ms": 660.0, "h2d_ms": 330.0,
                    "d2h_ms": 660.0, "cpu_opt_ms": 2100.0, "floor_ms": 2100.0, "bound": "cpu_opt_ms"},
    }  # fmt: skip
    for r in rows:
        r["floor_ms"] = floors[r["config"]]["floor_ms"]
    hw = {"status": "ok", "h2d_gbps": 41.5, "d2h_gbps": 40.8, "bw_bytes": 2**30, "opt_params_measured": 1e9,
          "opt_s": 0.315, "opt_s_per_param": 3.15e-10, "opt_threads": 16,
          "opt_impl": "torch.optim.AdamW(fused=True) on the CPU, fp32"}  # fmt: skip
    config = {"steps": 3, "warmup": 1, "budget_gib": 40.0, "device": "cuda",
              "step_ms": "median of the timed optimizer steps", "floor_bytes": "bf16 in, fp32 out"}  # fmt: skip
    return {"kind": "offload_big", "env": dict(GPU_ENV), "host": {"cpu_count": 16, "affinity_cores": 16,
            "torch_threads": 16}, "hardware_floor": hw, "config": config, "floors": floors,
            "results": rows}  # fmt: skip


@pytest.fixture
def big_dir(tmp_path: Path) -> Path:
    root = tmp_path / "results"
    write_results(root, "h100", offload_big=big_payload(), kernels=kernels_payload())
    return root


def test_detect_kind() -> None:
    data = big_payload()
    assert detect_kind("offload_big", data) == "offload_big"
    assert detect_kind("e2e_2gpu", data) == "offload_big"  # by its "kind", whatever the name
    assert detect_kind("e2e_2gpu", e2e_payload()) == "e2e"  # a results list alone is still an e2e file
    no_kind = {k: v for k, v in data.items() if k != "kind"}
    assert detect_kind("offload_big", no_kind) == "e2e"  # the runner always writes "kind"


def test_typed_record_and_order(big_dir: Path) -> None:
    (big_dir / "h100" / "e2e_2gpu.json").write_text(json.dumps(e2e_payload()))
    results = load_results(big_dir)["h100"]
    assert [(r.name, r.kind) for r in results] == [
        ("e2e_2gpu", "e2e"), ("offload_big", "offload_big"), ("kernels", "kernels")]  # fmt: skip
    f = results[1].offload_big()
    assert f.configs == ["2.9b-4k", "6.7b-2k"] and f.versions["DeepSpeed"] == "0.19.8"
    assert f.floor_ms("2.9b-4k") == 917.0 and f.step_ms("2.9b-4k", "resident") == 250.0
    assert f.find("2.9b-4k", "shardfuse", SIB).step_ms == 1300.0  # type: ignore[union-attr]
    assert f.find("2.9b-4k", "shardfuse").step_ms == 1500.0  # type: ignore[union-attr]
    oom = f.find("2.9b-4k", "deepspeed-zero3")
    assert oom is not None and not oom.measured and oom.status == "oom"
    assert results[1].is_gpu
    cpu = big_payload()
    cpu["config"]["device"] = "cpu"
    (big_dir / "h100" / "offload_big.json").write_text(json.dumps(cpu))
    assert not load_file(big_dir / "h100" / "offload_big.json").is_gpu  # a CPU plumbing run: left out


def test_section_renders(big_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "docs" / "benchmarks.md"
    assert report.main(["--results", str(big_dir), "--out", str(out), "--no-plots"]) == 0
    text = out.read_text()
    assert "### Offload of models that outgrow the GPU (`offload_big.json`)" in text
    assert "commit `abc1234`" in text and "NVIDIA H100 80GB HBM3" in text
    assert "FairScale 0.4.13, DeepSpeed 0.19.8" in text
    assert "pinned host->device 41.5 GB/s, device->host 40.8 GB/s" in text
    assert "315 ms per billion parameters (measured on 1.00B parameters, 16 threads)" in text
    assert "#### `2.9b-4k`: 2.9B parameters, 4,096 tokens per step (batch 2 x seq 2048)" in text
    assert "Floor 917 ms = max(GPU compute 200 ms, PCIe 286 ms (in 140 ms, out 286 ms), CPU optimizer 917 ms)" in text
    header = ("| implementation | step ms | vs floor | vs resident | tokens/s | GPU peak GiB | host RSS GiB "
              "| host B/param | status |")
    assert text.count(header) == 2
    full = "shardfuse `move_params_to_cpu`, `OffloadOptimizer`, full offload"
    assert f"| {full} | 1500 (1485-1530) | 1.64x | 6.00x | 2,731 | 15.0 | 46.8 | 17.2 | ok |" in text  # 46.8 GiB/2.9B
    assert f"| {full} ({SIB}) | 1300 (1287-1326) | 1.42x | 5.20x |" in text
    assert "GPU budget 40 GiB | 900 (891-918) | 0.98x | 3.60x |" in text
    # Status rows: the status, no numbers, and the reason under the table.
    assert "| DeepSpeed ZeRO-3, parameters + optimizer offloaded | - | - | - | - | - | - | - | oom |" in text
    assert "DeepSpeed ZeRO-3, parameters + optimizer offloaded: oom: GPU out of memory: tried 2 GiB" in text
    resident = "resident (all on the GPU, bf16 autocast, fused AdamW)"
    assert f"| {resident} | - | - | - | - | - | - | - | compute-only |" in text
    assert "do not fit on this GPU: forward+backward only (forward+backward 310 ms)" in text
    fsdp2 = "FSDP2 `CPUOffloadPolicy(pin_memory=True)`, fused CPU AdamW"
    assert f"| {fsdp2} | - | - | - | - | - | - | - | skipped |" in text
    assert ": error: killed by signal 9" in text
    # 6.7B: no resident step, so no ratio to it; the floor still holds.
    assert f"| {full} | 2600 (2574-2652) | 1.24x | - |" in text
    # The order: resident, shardfuse (plain, then variants), budget, FairScale, FSDP2, DeepSpeed.
    section = text[text.index("#### `2.9b-4k`") : text.index("#### `6.7b-2k`")]
    order = ["resident (", f"{full} |", f"{full} ({SIB})", "GPU budget 40 GiB |", "FairScale", "FSDP2", "ZeRO-2",
             "ZeRO-3"]  # fmt: skip
    assert [section.index(x) for x in order] == sorted(section.index(x) for x in order)
    assert "`python -m bench.offload.big`" in text  # the how-measured bullet


def test_ssd_row_is_judged_against_the_disk(tmp_path: Path) -> None:
    payload = big_payload()
    payload["disk"] = {"dir": "/tmp/x", "probe_bytes": 4 * 2**30, "method": "O_DIRECT", "write_gbps": 3.07,
                       "read_gbps": 2.55}  # fmt: skip
    payload["results"].append(_row("shardfuse-ssd", "6.7b-2k", 60000.0, 26.3, 39.3, floor_ms=58000.0,
                                   disk_floor_ms=58000.0, ssd_read_gb_per_step=71.9, ssd_written_gb_per_step=80.4,
                                   ssd_io_mode="direct", ssd_optimizer_state=True))  # fmt: skip
    root = tmp_path / "results"
    write_results(root, "h100", offload_big=payload)
    out = tmp_path / "benchmarks.md"
    assert report.main(["--results", str(root), "--out", str(out), "--no-plots"]) == 0
    text = out.read_text()
    assert "sequential write 3.07 GB/s, read 2.55 GB/s (O_DIRECT, 4.0 GiB file)" in text
    assert "| 60000 (59400-61200) | 1.03x |" in text  # its own (disk) floor, not the configuration's 2100 ms
    assert ("vs floor is against the disk floor 58.00 s" in text and "it read 71.9 GB and wrote 80.4 GB per step "
            "(direct I/O); worst step 1.06x the disk floor" in text)
    ssd = [r for r in summary_rows(load_results(root)) if "(shardfuse-ssd)" in r[1]]
    assert [r[2:4] for r in ssd] == [["step ms (disk floor 58000; DeepSpeed ZeRO-3 error)",
                                      "60000 (1.03x disk floor; 39.3 GiB host memory)"]]  # fmt: skip


def test_readme_rows(big_dir: Path, tmp_path: Path) -> None:
    rows = [r for r in summary_rows(load_results(big_dir)) if r[1].startswith(README_BENCH)]
    assert [r[1] for r in rows] == [
        f"{README_BENCH}, 2.9B, 4096 tokens/step",
        f"{README_BENCH}, 2.9B, 4096 tokens/step, GPU budget 40 GiB (shardfuse-budget)",
        f"{README_BENCH}, 6.7B, 2048 tokens/step",
    ]  # only the plain shardfuse / shardfuse-budget rows; variants are on the page only
    sf, budget, big = rows
    assert sf == ["H100", rows[0][1], "step ms (floor 917; DeepSpeed ZeRO-2 1650, ZeRO-3 oom)",
                  "1500 (1.64x floor; 6.00x one GPU, 0.27x its GPU peak; 0.33x FairScale, 0.30x FSDP2, "
                  "0.91x DeepSpeed ZeRO-2)", "4600", "250", "5000", "-"]  # fmt: skip
    assert budget[3].startswith("900 (0.98x floor; 3.60x one GPU, 0.59x its GPU peak;")
    assert big == ["H100", rows[2][1], "step ms (floor 2100; DeepSpeed ZeRO-3 error)", "2600 (1.24x floor)", "-",
                   "compute-only", "skipped", "-"]  # fmt: skip
    readme = tmp_path / "README.md"
    readme.write_text("# x\n\nRESULTS_TABLE\n")
    out = tmp_path / "docs" / "benchmarks.md"
    assert report.main(["--results", str(big_dir), "--out", str(out), "--no-plots", "--readme", str(readme)]) == 0
    text = out.read_text().split("## H100", 1)[0]  # the page's summary
    assert text.count(README_BENCH) >= 4 and f'Rows "{README_BENCH}"' in text  # three rows and the note
    assert SIB not in text
    # the README's headline: the budget row of H100's file, whose call measured no peer
    assert (
        "| 1x H100 | `OffloadOptimizer` with a 40 GiB GPU budget, 2.9B decoder on one GPU | 4,096 | 900 ms/step "
        "| none in the same job | - | `abc1234`, 16 cores |"  # the commit and host it was measured on
    ) in readme.read_text()


def test_readme_without_offload_big_has_no_note(tmp_path: Path) -> None:
    root = tmp_path / "results"
    write_results(root, "h200", e2e_2gpu=e2e_payload(), kernels=kernels_payload())
    table = "\n".join(report.summary_table(load_results(root)))
    assert README_BENCH not in table


def test_status_of_shardfuse_row_in_readme(tmp_path: Path) -> None:
    data = big_payload()
    for r in data["results"]:
        if r["impl"] == "shardfuse" and not r.get("variant") and r["config"] == "2.9b-4k":
            r.update(step_ms=None, status="oom", reason="GPU out of memory")
    root = tmp_path / "results"
    write_results(root, "h100", offload_big=data)
    rows = [r for r in summary_rows(load_results(root)) if r[1] == f"{README_BENCH}, 2.9B, 4096 tokens/step"]
    assert rows and rows[0][3] == "oom"


# ------------------------------------------------------------------------------------------------ bench.regress


def _regress(tmp_path: Path, old: dict[str, Any], new: dict[str, Any], *extra: str) -> int:
    root = tmp_path / "stored"
    write_results(root, "h100", offload_big=old)
    new_path = tmp_path / "new" / "offload_big.json"
    new_path.parent.mkdir(exist_ok=True)
    new_path.write_text(json.dumps(new))
    return regress.main([str(new_path), "--results", str(root), *extra])


def _scaled(payload: dict[str, Any], key: str, factor: float, impl: str, variant: str | None = None) -> dict:
    out = copy.deepcopy(payload)
    for r in out["results"]:
        if r["impl"] == impl and r.get("variant") == variant and r["config"] == "2.9b-4k":
            r[key] *= factor
    return out


@pytest.mark.parametrize(
    ("key", "shown"),
    [("step_ms", ""), ("gpu_peak_gib", " peak GiB"), ("host_rss_gib", " host RSS GiB")],
    ids=["time", "gpu-peak", "host-rss"],
)
@pytest.mark.parametrize(("impl", "variant"), [("shardfuse", None), ("shardfuse-budget", None), ("shardfuse", SIB)])
def test_regress_fails_on_growth(
    tmp_path: Path, capsys: pytest.CaptureFixture, key: str, shown: str, impl: str, variant: str | None
) -> None:
    old = big_payload()
    assert _regress(tmp_path, old, _scaled(old, key, 1.11, impl, variant)) == 1
    out = capsys.readouterr().out
    name = f"{impl} 2.9b-4k" + (f" ({variant})" if variant else "") + shown
    assert "+11.0%" in out and "FAIL" in out and name in out.split("FAIL")[1], out
    assert _regress(tmp_path, old, _scaled(old, key, 1.05, impl, variant)) == 0
    assert "PASS" in capsys.readouterr().out
    assert _regress(tmp_path, old, _scaled(old, key, 0.8, impl, variant)) == 0  # faster / smaller is fine


def test_regress_context_and_failures(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    old = big_payload()
    # Other implementations are context only, whatever they do.
    for impl in ("fsdp2", "fairscale", "resident", "deepspeed-zero2"):
        assert _regress(tmp_path, old, _scaled(_scaled(old, "step_ms", 1.5, impl), "host_rss_gib", 1.5, impl)) == 0
    capsys.readouterr()
    # A shardfuse row that ran before and now runs out of memory fails.
    new = copy.deepcopy(old)
    row = next(r for r in new["results"] if r["impl"] == "shardfuse-budget" and not r.get("variant"))
    row.update(step_ms=None, status="oom", reason="GPU out of memory")
    assert _regress(tmp_path, old, new) == 1
    assert "shardfuse-budget 2.9b-4k" in capsys.readouterr().out.split("FAIL")[1]
    # Skipped rows are not compared (not runnable there); an e2e baseline of another kind is bad input.
    new = copy.deepcopy(old)
    next(r for r in new["results"] if r["impl"] == "fsdp2" and r["config"] == "6.7b-2k")["status"] = "skipped"
    assert _regress(tmp_path, old, new) == 0
    assert regress.main([str(tmp_path / "new" / "offload_big.json"), "--baseline", str(_e2e(tmp_path))]) == 2


def _e2e(tmp_path: Path) -> Path:
    p = tmp_path / "e2e_2gpu.json"
    p.write_text(json.dumps(e2e_payload()))
    return p


def _git(repo: Path, *args: str) -> str:
    import subprocess

    run = subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                         capture_output=True, text=True)  # fmt: skip
    return run.stdout.strip()


def test_predates_asks_git(tmp_path: Path) -> None:
    from bench.report._offload_big import predates

    _git(tmp_path, "init", "-q")
    shas = []
    for name in ("a", "b"):
        (tmp_path / name).write_text(name)
        _git(tmp_path, "add", name)
        _git(tmp_path, "commit", "-qm", name)
        shas.append(_git(tmp_path, "rev-parse", "--short", "HEAD"))
    older, newer = shas
    assert predates(older, newer, tmp_path)
    assert not predates(newer, older, tmp_path) and not predates(newer, newer, tmp_path)
    assert not predates("0000000", older, tmp_path) and not predates(None, older, tmp_path)  # git cannot tell


def test_rows_measured_before_a_change_to_their_path_say_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from bench.report import _offload_big

    payload = big_payload()
    payload["env"]["commit"] = "1111111"
    payload["results"][1]["commit"] = "2222222"  # the plain shardfuse row: no change to its path is listed
    monkeypatch.setattr(_offload_big, "predates", lambda measured, change, repo=None: measured == "1111111")
    root = tmp_path / "results"
    write_results(root, "h100", offload_big=payload)
    out = tmp_path / "benchmarks.md"
    assert report.main(["--results", str(root), "--out", str(out), "--no-plots"]) == 0
    notes = [line for line in out.read_text().splitlines() if "before ebce2e1" in line]
    assert len(notes) == 2, notes  # the two step-in-backward rows of 2.9b-4k, nothing else
    assert all(f"({SIB}): measured at 1111111, before ebce2e1 (under step_in_backward" in n for n in notes)


def test_speed_vs_torchao_column(tmp_path: Path) -> None:
    """A configuration with a torchao row gets a "speed vs torchao" column (torchao's step time over the row's);
    one without keeps the usual columns."""
    data = big_payload()
    ao_variant = "budget = torchao's GPU peak"
    data["results"] += [
        _row("torchao", "2.9b-4k", 817.5, 29.6, 40.0, clipping=False),
        _row("shardfuse-budget", "2.9b-4k", 545.0, 29.5, 30.0, variant=ao_variant, gpu_budget_gib=29.63),
    ]
    root = tmp_path / "results"
    write_results(root, "h100", offload_big=data)
    out = tmp_path / "benchmarks.md"
    assert report.main(["--results", str(root), "--out", str(out), "--no-plots"]) == 0
    text = out.read_text()
    section = text[text.index("#### `2.9b-4k`") : text.index("#### `6.7b-2k`")]
    assert "| host B/param | speed vs torchao | status |" in section
    assert f"GPU budget 29.63 GiB ({ao_variant}) | 545 (540-556) |" in section
    budget_ao = next(line for line in section.splitlines() if f"({ao_variant}) |" in line)
    assert budget_ao.endswith(f"| {817.5 / 545.0:.2f}x | ok |")
    full = next(line for line in section.splitlines() if line.startswith("| shardfuse `move_params_to_cpu`, "
                                                                         "`OffloadOptimizer`, full offload |"))
    assert full.endswith(f"| {817.5 / 1500.0:.2f}x | ok |")
    assert "| torchao `CPUOffloadOptimizer` (fp32 model on the GPU, fused CPU AdamW, no clipping) | 818" in section
    assert "speed vs torchao: torchao's step time over the row's" in section
    other = text[text.index("#### `6.7b-2k`") :]
    assert "speed vs torchao" not in other.split("####")[1]  # no torchao row there: no column
