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


def _state_of(shards: list) -> list[list[torch.Tensor]]:
    out = []
    for p, opt, _ in shards:
        st = opt.state[p]
        out.append([p.detach().clone(), p.grad.clone(), st["exp_avg"].clone(), st["exp_avg_sq"].clone(),
                    st["step"].clone()])
    return out


@pytest.mark.parametrize("chunk", [4096, 8192, 1 << 21])
def test_the_speculative_update_writes_the_in_place_result_into_the_spares(chunk):
    """Out of place, chunked as the speculation does: the spares hold bit for bit what the in-place update (torch's
    public fused AdamW step) then writes into the originals, and the originals do not change until then."""
    torch.manual_seed(chunk)
    shards = host_step._shards(0.00004, 2)  # 2 shards of 16384 elements, one step taken (the state exists)
    for p, _, _ in shards:
        p.grad.normal_(0, 1e-2)  # a fresh gradient, so this step differs from the first
    before = _state_of(shards)
    spares = host_step._spares(shards, pinned=False)
    for spare in spares:  # garbage first: every value the update leaves must be its own
        for t in spare.values():
            t.fill_(float("nan"))
    host_step._speculative_update(shards, spares, chunk)
    after = _state_of(shards)
    assert all(torch.equal(a, b) for x, y in zip(before, after) for a, b in zip(x, y)), "an original changed"
    for _p, opt, _ in shards:
        opt.step()  # the in-place update, torch's own public step
    for (p, opt, _), spare in zip(shards, spares):
        st = opt.state[p]
        assert torch.equal(spare["param"], p.detach()) and torch.equal(spare["exp_avg"], st["exp_avg"])
        assert torch.equal(spare["exp_avg_sq"], st["exp_avg_sq"]) and torch.equal(spare["step"], st["step"])
    assert not torch.equal(after[0][0], shards[0][0].detach()), "the update changed nothing: the test cannot fail"


def test_the_speculative_chunk_must_be_aligned():
    shards = host_step._shards(0.00004, 1)
    with pytest.raises(ValueError, match="positive multiple of 4096"):
        host_step._speculative_update(shards, host_step._spares(shards, pinned=False), 1000)


def test_spec_rows_beside_the_in_place_ones(tmp_path, capsys):
    result = host_step.main(["--params", "0.002", "--shards", "2", "--chunks", "4096,8192", "--rounds", "2",
                             "--threads", "1", "--spec", "--out", str(tmp_path / "hs.json")])
    plain = {r["variant"]: r for r in result["rows"] if r["setting"] == "plain"}
    assert {"spec chunk=4096", "spec chunk=8192", "chunk=4096", "chunk=8192"} <= set(plain)
    assert not any(r["variant"].startswith("spec") for r in result["rows"] if r["setting"] != "plain")
    fastest = min((4096, 8192), key=lambda c: plain[f"spec chunk={c}"]["ms_per_billion"])
    assert result["spec_fastest_chunk"] == fastest
    out = capsys.readouterr().out
    assert f"fastest out-of-place chunk: {fastest} elements" in out and "x the in-place update" in out


def test_gpu_spec_check_script_and_its_table(tmp_path, capsys):
    """gpu_spec_check.sh: the sweep with --spec --pinned --dma, then the 2.9B rows at the fastest chunk (plain,
    spec, keep, keep + spec), every python step under timeout, the table last; the table reads what they write."""
    import subprocess
    from pathlib import Path

    from bench.offload import spec_table

    script = Path(__file__).resolve().parents[2] / "bench" / "offload" / "gpu_spec_check.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    text = script.read_text()
    assert "host_step --spec --pinned --dma" in text and 'BIG_SPEC_CHUNK="$CHUNK"' in text
    assert "run spec shardfuse,shardfuse-spec-nofire" in text and "BIG_KEEP_GIB=auto" in text
    runs = [ln for ln in text.replace("\\\n", " ").splitlines() if "python3 -m bench.offload." in ln]
    assert len(runs) == 3 and all("timeout" in ln for ln in runs[:2]) and "spec_table" in runs[-1]
    host_step.main(["--params", "0.002", "--shards", "2", "--chunks", "4096,8192", "--rounds", "1", "--threads", "1",
                    "--spec", "--out", str(tmp_path / "host_step_spec.json")])
    row = {"impl": "shardfuse", "variant": "speculative_clip, max_norm 1e9 (never fires)", "step_ms": 1207.4,
           "step_ms_min": 1150.2, "step_ms_max": 1286.0, "gpu_peak_gib": 19.8, "host_rss_gib": 60.2,
           "keep_params_gib": None, "spec_chunk_elements": 524288, "spec_steps_committed": 4,
           "spec_steps_redone": 0, "spec_units_late": 22, "spec_spare_gib": 32.5}
    failed = {"impl": "shardfuse", "status": "error", "reason": "timed out after 260 s", "step_ms": None}
    (tmp_path / "big_keep.json").write_text(json.dumps({"results": [row, failed]}))
    capsys.readouterr()
    assert spec_table.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "fastest out-of-place chunk:" in out and "   4096 |     no |" in out
    assert "2.9b-4k, spec: no result file" in out
    assert ("keep_params_gib=auto, spec chunk 524288: 1207 ms (1150-1286), GPU peak 19.8 GiB, host 60.2 GiB; spec "
            "steps committed 4, redone 0, units late 22") in out
    assert "clipped: error: timed out after 260 s" in out
