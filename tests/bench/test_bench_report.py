"""``bench.report`` renders synthetic results of every runner's schema and rewrites a README's results table."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import report
from tests.bench._payloads import e2e_payload, kernels_payload, make_results_dir, write_results


@pytest.fixture
def results_dir(tmp_path: Path) -> Path:
    return make_results_dir(tmp_path / "results")


def test_report_renders_synthetic_results(results_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "docs" / "benchmarks.md"
    assert report.main(["--results", str(results_dir), "--out", str(out), "--no-plots"]) == 0
    text = out.read_text()
    # one section per GPU, with the environment of each table
    assert "## H100 (NVIDIA H200)" in text and "## H200 (NVIDIA H200)" in text
    assert "NCCL 2.28.9" in text and "commit `abc1234`" in text and "triton 3.6.0" in text
    # e2e: step ms, tokens/s/GPU, MFU %, peak GiB, speedup vs FSDP2, skipped FairScale
    assert "| shardfuse `FullyShardedDataParallel` | 113.7 | 72,049 | 43.2 | 17.25 | 1.06x |" in text
    assert "| FSDP2 `fully_shard` | 70.0 | 14,629 | 43.2 | 17.25 | 1.00x |" in text
    assert "| shardfuse `FullyShardedDataParallel` | 47.9 | 21,378 |" in text  # the H100 4-GPU file
    assert "FairScale FSDP: skipped: not importable" in text
    # kernels: GB/s, % of copy bandwidth and the speedup over every baseline
    assert "**4,213 GB/s**" in text
    assert "| fp32->bf16 flat shard n=67108864 | 402.7 MB | 0.1030 | 3,911 | 92.8% | 1.01x | 1.87x |" in text
    assert "vs `div.to+add_`" in text and "2.46x" in text
    # offload: step time vs plain, host<->device GB/s (estimated ones marked), peak memory, capped run
    assert "| shardfuse `OffloadModel` | 587.4 | 1.16x | 14.6 | 7.3 | 3.17 |" in text
    assert "| FSDP2 `fully_shard` + `CPUOffloadPolicy` | 771.9 | 1.52x | 11.1* | 5.6* | 7.57 |" in text
    assert "error: RuntimeError: something broke" in text and "912.6" in text
    assert "`h100/broken.json`: not shown" in text
    assert "Plots were skipped" in text
    # the page's full summary table: a file of one run (no rounds) gives its own numbers; no FairScale measured,
    # so a dash and no FairScale ratio
    assert (
        "| H200 | training, 2 GPUs, 8K tokens/GPU | tokens/s/GPU | 72,049 (1.07x one GPU, 1.06x FSDP2) | - | 67,258 "
        "| 67,871 | 67,313 |" in text
    )
    assert "| GPU | benchmark | metric | shardfuse | FairScale | one GPU | FSDP2 | FSDP1 |" in text
    # offload rows keep their meaning: FairScale's and FSDP2's offload step times, no one-GPU or FSDP1 number
    assert "| 587.4 (1.16x plain, 0.35x its memory) | - | - | 771.9 | - |" in text
    # the README's headline table goes to stdout when no --readme is given: speedup over the best peer (FSDP2)
    printed = capsys.readouterr().out
    assert "| GPUs | setup | tokens/GPU/step | shardfuse | best peer, same job | speedup | commit, host |" in printed
    assert "| 2x H200 | training, 953M decoder, sharded | 8,192 | 72,049 tok/s/GPU | FSDP2 67,871 | 1.06x |" in printed
    assert "| GPU | benchmark | metric |" not in printed  # the full table stays on the page


def test_report_plots(results_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "site" / "benchmarks.md"
    assert report.main(["--results", str(results_dir), "--out", str(out)]) == 0
    pngs = sorted(p.name for p in (out.parent / "img").glob("*.png"))
    assert pngs == [
        "h100_e2e_4gpu_tokens.png",
        "h200_e2e_2gpu_tokens.png",
        "h200_kernels_gbps.png",
        "h200_offload_step.png",
    ]
    assert "](img/h200_kernels_gbps.png)" in out.read_text()


def test_report_without_results(tmp_path: Path) -> None:
    out = tmp_path / "benchmarks.md"
    assert report.main(["--results", str(tmp_path / "nothing"), "--out", str(out), "--no-plots"]) == 0
    assert "No benchmark results are stored yet" in out.read_text()
    (tmp_path / "empty" / "h100").mkdir(parents=True)
    assert report.main(["--results", str(tmp_path / "empty"), "--out", str(out)]) == 0
    assert "No benchmark results are stored yet" in out.read_text()


def test_report_tolerates_missing_keys(tmp_path: Path) -> None:
    e2e = e2e_payload()
    for row in e2e["results"]:
        row.pop("mfu", None)
        row.pop("peak_gib", None)
    del e2e["env"], e2e["config"]
    kern = kernels_payload()
    kern["rows"][0].pop("baselines")
    del kern["copy_bandwidth_gbps"]
    root = tmp_path / "r"
    write_results(root, "a100", e2e_2gpu=e2e, kernels=kern, offload={"variants": {}})
    out = tmp_path / "b.md"
    assert report.main(["--results", str(root), "--out", str(out), "--no-plots"]) == 0
    text = out.read_text()
    assert "_Environment: not recorded._" in text and "| 113.7 | 72,049 | - | - | 1.06x |" in text


def test_readme_table_is_rewritten(results_dir: Path, tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("# project\n\n## Results\n\nRESULTS_TABLE\n\n## Documentation\n")
    out = tmp_path / "docs" / "benchmarks.md"
    args = ["--results", str(results_dir), "--out", str(out), "--no-plots", "--readme", str(readme)]
    assert report.main(args) == 0
    first = readme.read_text()
    assert "RESULTS_TABLE" not in first and report.START_MARK in first and report.END_MARK in first
    assert "| 72,049 tok/s/GPU | FSDP2 67,871 | 1.06x | `abc1234` |" in first and "](docs/benchmarks.md)" in first
    assert "72,049 (1.07x one GPU, 1.06x FSDP2)" not in first and "72,049 (1.07x one GPU" in out.read_text()
    assert first.startswith("# project\n") and first.endswith("## Documentation\n")
    assert report.main(args) == 0
    assert readme.read_text() == first  # idempotent: the markers are found the second time
    with pytest.raises(ValueError, match="RESULTS_TABLE"):
        report.update_readme("no table here\n", ["x"])


def test_report_leaves_out_cpu_smoke_runs(results_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A CPU (gloo) run of bench.e2e.run is a smoke test: it must not become a "CPU, 2 GPUs" row or section."""
    smoke = e2e_payload()
    smoke["env"] = {"gpu_key": "cpu", "commit": "abc1234"}
    smoke["config"]["device"] = "cpu"
    write_results(results_dir, "cpu", e2e_2gpu=smoke)
    mislabelled = e2e_payload()  # a GPU folder, but the file says the run was on the CPU
    mislabelled["config"]["device"] = "cpu"
    write_results(results_dir, "a100", e2e_2gpu=mislabelled)
    out = tmp_path / "benchmarks.md"
    assert report.main(["--results", str(results_dir), "--out", str(out), "--no-plots"]) == 0
    printed = capsys.readouterr().out
    assert "left out 2 result file(s) measured without a GPU" in printed
    text = out.read_text()
    assert "| CPU |" not in text and "## CPU" not in text and "smoke run" not in text
    assert "| A100 |" not in text and "## A100" not in text
    assert "| H200 |" in text  # the GPU results stay
    assert report.main(["--results", str(results_dir), "--summary"]) == 0
    assert "| CPU |" not in capsys.readouterr().out


def test_results_name_their_host(tmp_path: Path) -> None:
    # Host-bound rows move with the host's CPU (H200 hosts of one kind up to 11x apart): every result's env says which.
    from bench._results_fields import Env
    from bench.common import cpu_model, env_info
    from bench.report._common import env_line

    env = env_info()
    assert isinstance(env["host_cpus"], int) and env["host_cpus"] >= 1
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: X\nmodel name\t: Test CPU 9000 @ 2.00GHz\n\nprocessor\t: 1\n")
    assert cpu_model(info) == "Test CPU 9000 @ 2.00GHz"
    line = env_line(Env.parse({**env, "host_cpus": 16, "cpu_model": "Test CPU 9000"}))
    assert "host 16 CPUs (Test CPU 9000)" in line
    assert "host" not in env_line(Env.parse({"commit": "abc1234", "gpu_name": "NVIDIA H200"}))  # older files
