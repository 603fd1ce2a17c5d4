"""The README's headline table (``bench.report._headline``): chosen rows, each against the best peer of its job.

Synthetic files under the GPU folders and names that ``HEADLINES`` picks; every expected number below is worked
out from the payloads (tokens per step over step time), not read back from the report.
"""

from __future__ import annotations

from pathlib import Path

from bench import report
from bench.report._headline import HEADLINES, MAX_ROWS, NO_PEER
from bench.report._readme import update_readme
from bench.results_io import DEFAULT_RESULTS, REPO, load_results
from tests.bench._payloads import e2e_payload, offload_payload, write_results


def _rows(root: Path) -> list[list[str]]:
    return report.headline_rows(report.gpu_results(load_results(root)))


def test_best_peer_is_the_fastest_of_the_job(tmp_path: Path) -> None:
    payload = e2e_payload()  # 8k: shardfuse 113.7 ms, FSDP2 120.7, FSDP1 121.7, one GPU 121.8; FairScale skipped
    write_results(tmp_path, "h200", e2e_2gpu=payload)
    first = _rows(tmp_path)[0]
    assert first[:4] == ["2x H200", HEADLINES[0].setup, "8,192", f"{8192 / 0.1137:,.0f} tok/s/GPU"]
    assert first[4:] == [f"FSDP2 {8192 / 0.1207:,.0f}", f"{120.7 / 113.7:.2f}x", "`abc1234`"]
    # FSDP1 made faster than FSDP2 (but still slower than shardfuse): it becomes the peer; the one-GPU baseline,
    # faster than all, is no peer
    for r in payload["results"]:
        if r["regime"] == "8k" and r["impl"] in ("fsdp1", "baseline"):
            r["step_ms"] = 115.0 if r["impl"] == "fsdp1" else 60.0
            r["tok_s_gpu"] = 8192 / (r["step_ms"] * 1e-3)
    write_results(tmp_path, "h200", e2e_2gpu=payload)
    first = _rows(tmp_path)[0]
    assert first[4:6] == [f"FSDP1 {8192 / 0.115:,.0f}", f"{115.0 / 113.7:.2f}x"]
    payload["host"] = {"cpu_count": 16}  # a file that recorded its host: the row names it beside the commit
    write_results(tmp_path, "h200", e2e_2gpu=payload)
    assert _rows(tmp_path)[0][6] == "`abc1234`, 16 cores"


def test_offload_peers_carried_over_from_another_commit_are_not_compared(tmp_path: Path) -> None:
    payload = offload_payload()
    variants = payload["variants"]
    variants["shardfuse_offload_acts_opt_in_bwd"] = {**variants["shardfuse"], "step_ms": 500.0}
    variants["fsdp2_cpu_offload"]["step_ms"] = 800.0
    variants["fairscale"] = {**variants["fsdp2_cpu_offload"], "step_ms": 600.0}
    write_results(tmp_path, "h100", offload=payload)
    (row,) = _rows(tmp_path)
    assert row[3:6] == ["500 ms/step", "FairScale OffloadModel 600", f"{600 / 500:.2f}x"]
    variants["fairscale"]["commit"] = "0ther00"  # measured in another job: FSDP2 is the peer now
    write_results(tmp_path, "h100", offload=payload)
    (row,) = _rows(tmp_path)
    assert row[4:] == ["FSDP2 CPUOffloadPolicy 800", f"{800 / 500:.2f}x", "`abc1234`"]


def test_rows_missing_from_the_files_are_left_out(tmp_path: Path) -> None:
    write_results(tmp_path, "h100", e2e_2gpu=e2e_payload())  # HEADLINES takes e2e_2gpu from h200 only
    assert _rows(tmp_path) == []
    lines = report.headline_table({}, "docs/benchmarks.md")
    assert lines[0].startswith("No benchmark results are stored yet") and "(docs/benchmarks.md)" in lines[0]


def test_stored_results_give_the_readme_block() -> None:
    """README.md's block is what the report makes of bench/results (rerun `python -m bench.report --readme
    README.md` after storing results), at most MAX_ROWS rows, each with its commit, a peer where one ran."""
    results = report.gpu_results(load_results(DEFAULT_RESULTS))
    lines = report.headline_table(results, "docs/benchmarks.md")
    readme = (REPO / "README.md").read_text()
    assert update_readme(readme, lines) == readme, "README's results block is stale: run python -m bench.report"
    rows = report.headline_rows(results)
    assert 5 <= len(rows) <= MAX_ROWS
    assert all(r[6].startswith("`") and r[5] != "-" or r[4] == NO_PEER for r in rows), rows
    assert all(r[2] != "-" for r in rows), rows  # tokens per GPU and step, always known
