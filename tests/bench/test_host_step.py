"""bench.offload.host_step on the CPU: every variant measured at the thread counts asked for, in the JSON."""

from __future__ import annotations

import json

import pytest
import torch

from bench.offload import host_step


def test_host_step_rows(tmp_path):
    out = tmp_path / "hs.json"
    result = host_step.main(["--params", "0.002", "--shards", "2", "--chunks", "4096,8192", "--rounds", "2",
                             "--threads", "1,2", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    got = {(r["setting"], r["variant"], r["threads"]) for r in result["rows"]}
    want = {(s, "separate", t) for s in ("clip+copy", "plain") for t in (1, 2)}
    want |= {(s, f"chunk={c}", 1) for s in ("clip+copy", "plain") for c in (4096, 8192)}
    assert got == want
    assert all(r["ms_per_billion"] > 0 and len(r["runs_s"]) == 2 and r["host_gbps"] > 0 for r in result["rows"])
    assert not any(r["with_copies"] for r in result["rows"]) and "copies_gbps" not in result


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_dma_needs_a_gpu(tmp_path):
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        host_step.main(["--params", "0.001", "--dma", "--out", str(tmp_path / "hs.json")])


def test_the_report_shows_host_step_files(tmp_path):
    from bench import report
    from bench.results_io import detect_kind, load_results

    path = tmp_path / "results" / "h100" / "host_step.json"
    result = host_step.main(["--params", "0.002", "--shards", "2", "--chunks", "4096", "--rounds", "2",
                             "--threads", "1", "--out", str(path)])
    assert result["kind"] == "host_step" and "commit" in result["env"]
    [stored] = load_results(tmp_path / "results")["h100"]
    assert stored.kind == "host_step" and stored.is_gpu == (result["env"].get("gpu_key") != "cpu")
    result["env"]["gpu_key"] = "h100"  # as on a GPU host (this machine's run is a CPU smoke run: left out)
    path.write_text(json.dumps(result))
    old = {k: v for k, v in result.items() if k not in ("kind", "env")}  # a file from before "kind" was written
    assert detect_kind("host_step", old) == "host_step" and detect_kind("other", old) == "unknown"
    out = tmp_path / "benchmarks.md"
    assert report.main(["--results", str(tmp_path / "results"), "--out", str(out), "--no-plots"]) == 0
    text = out.read_text()
    assert "### Host optimizer step on this machine's CPU (`host_step.json`)" in text and "not shown" not in text
    for r in result["rows"]:
        ms = f"{r['ms_per_billion']:.0f}"
        assert f"| {r['setting']} | {r['variant']} | 1 | no | {ms} |" in text
