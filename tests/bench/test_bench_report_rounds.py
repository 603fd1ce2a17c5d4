"""``bench.report`` on e2e files of interleaved rounds (``bench.e2e.run --rounds N``): one table of medians per
regime with the spread and the ratios of medians, README rows from the medians; files without rounds as before."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import report
from bench.results_io import e2e_summary
from tests.bench._payloads import e2e_payload, e2e_rounds_payload, summarize, write_results

MEDIANS_HEADER = (
    "| implementation | rounds | median step ms | min-max ms | median tokens/s/GPU | MFU % | peak GiB "
    "| peak above wrap GiB | vs FairScale | vs one GPU | vs FSDP2 | vs shardfuse at b3aa59b |"
)
# 1K medians (ms): one GPU 42, shardfuse 50, shardfuse-ref 52, FairScale 54, FSDP2 69 (see _payloads.ROUND_MS)
SHARDFUSE_1K = (
    "| shardfuse `FullyShardedDataParallel` | 3 | 50.0 | 48.0-65.0 | 20,480 | 30.0 | 21.00 | 10.00 "
    "| 1.08x | 0.84x | 1.38x | 1.04x |"
)
README_1K = (
    "| H200 | training, 2 GPUs, 1K tokens/GPU | tokens/s/GPU, median of 3 rounds "
    "| 20,480 (1.08x FairScale, 0.84x one GPU, 1.38x FSDP2) | 18,963 | 24,381 | 14,841 | - |"
)


def _render(tmp_path: Path, readme: bool = False, **payloads: dict) -> tuple[str, str]:
    root = tmp_path / "results"
    write_results(root, "h200", **payloads)
    out = tmp_path / "docs" / "benchmarks.md"
    args = ["--results", str(root), "--out", str(out), "--no-plots"]
    if readme:
        (tmp_path / "README.md").write_text("# p\n\nRESULTS_TABLE\n")
        args += ["--readme", str(tmp_path / "README.md")]
    assert report.main(args) == 0
    return out.read_text(), (tmp_path / "README.md").read_text() if readme else ""


def _section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n#### ", start + len(heading))
    return text[start : end if end != -1 else len(text)]


def test_medians_table_per_regime(tmp_path: Path) -> None:
    text, _ = _render(tmp_path, e2e_2gpu=e2e_rounds_payload())
    assert text.count(MEDIANS_HEADER) == 2  # one table per regime
    one_k = _section(text, "#### 1K tokens per GPU")
    assert SHARDFUSE_1K in one_k
    assert "| shardfuse at `b3aa59b` (reference) | 3 | 52.0 | 51.0-70.0 | 19,692 |" in one_k
    assert "| 1.04x | 0.81x | 1.33x | - |" in one_k  # its own ratio against itself is a dash
    assert "| one GPU, no sharding (autocast) | 3 | 42.0 | 40.0-44.0 | 24,381 |" in one_k
    assert "| FairScale FSDP | 3 | 54.0 | 53.0-55.0 | 18,963 | 30.0 | 24.00 | 10.00 | - | 0.78x | 1.28x | 0.96x |" in (
        one_k
    )
    assert "| FSDP1 | skipped | - | - | - | - | - | - | - | - | - | - |" in one_k
    assert "- FSDP1: skipped: not requested in this test" in one_k
    eight_k = _section(text, "#### 8K tokens per GPU")
    assert "| shardfuse `FullyShardedDataParallel` | 3 | 97.0 | 95.0-99.0 | 84,454 |" in eight_k
    # one row per implementation, not one per round
    assert one_k.count("| shardfuse `FullyShardedDataParallel` |") == 1
    # the text says what the ratios are and that the hosts are noisy, with the spreads of this file
    assert "ratios of the medians over 3 interleaved rounds in one job" in text
    assert "The hosts are noisy" in text
    assert "1K tokens per GPU: the mean step time of one implementation moved by 3-37%" in text
    assert "(most: shardfuse at b3aa59b)" in text
    assert "each round the mean of 8 steps after 3 warm-up; 3 interleaved rounds" in text
    assert "in this order: one GPU -> shardfuse -> shardfuse at b3aa59b -> FairScale -> FSDP2" in text
    # memory left behind by earlier runs is detected; the peak shown is the lowest over rounds
    assert "grew by up to 15.00 GiB from one round to the next" in text
    # no table of single runs for this file
    assert "| implementation | step ms |" not in text


def test_readme_rows_from_medians(tmp_path: Path) -> None:
    text, readme = _render(tmp_path, readme=True, e2e_2gpu=e2e_rounds_payload())
    assert README_1K in text  # the page's summary
    assert (
        "| H200 | training, 2 GPUs, 8K tokens/GPU | tokens/s/GPU, median of 3 rounds "
        "| 84,454 (1.11x FairScale, 1.05x one GPU, 1.07x FSDP2) | 75,852 | 80,314 | 78,769 | - |"
    ) in text
    assert "one GPU's (the same tokens per GPU, unsharded, no communication)" in text
    assert "medians over rounds interleaved in one job on noisy hosts" in text
    # the README's headline rows: the medians too, against the best peer's median (FairScale in both regimes)
    assert "| 2x H200 | training, 953M decoder, sharded | 8,192 | 84,454 tok/s/GPU | FairScale 80,314 | 1.05x |" \
        not in readme  # (one GPU is no peer: the baseline's 80,314 must not be taken for one)
    assert "| 2x H200 | training, 953M decoder, sharded | 8,192 | 84,454 tok/s/GPU | FSDP2 78,769 | 1.07x |" in readme
    assert "| 1,024 | 20,480 tok/s/GPU | FairScale 18,963 | 1.08x | `abc1234` |" in readme
    assert README_1K not in readme


def test_stored_ratios_are_used(tmp_path: Path) -> None:
    """The ratios come from the file's summary when it has them (the runner's numbers, not recomputed)."""
    payload = e2e_rounds_payload()
    for e in payload["summary"]:
        if e["impl"] == "shardfuse" and e["regime"] == "1k":
            e["vs_fairscale"] = 1.5
    text, _ = _render(tmp_path, readme=True, e2e_2gpu=payload)
    assert "20,480 (1.50x FairScale, 0.84x one GPU, 1.38x FSDP2)" in text
    assert "| 1.50x | 0.84x | 1.38x | 1.04x |" in text


def test_rounds_without_summary_are_summarised(tmp_path: Path) -> None:
    """A file written mid-run (rows with ``round``, no summary yet) gets the same medians."""
    text, readme = _render(tmp_path, readme=True, e2e_2gpu=e2e_rounds_payload(with_summary=False))
    assert SHARDFUSE_1K in text and README_1K in text
    assert "| 1,024 | 20,480 tok/s/GPU | FairScale 18,963 | 1.08x |" in readme
    stored = e2e_rounds_payload()
    computed = e2e_summary(e2e_rounds_payload(with_summary=False))
    key = lambda e: (e["impl"], e["regime"])  # noqa: E731
    got, want = sorted(computed, key=key), sorted(stored["summary"], key=key)
    assert [key(e) for e in got] == [key(e) for e in want]
    for g, w in zip(got, want):  # entry by entry: pytest.approx takes flat mappings of numbers only
        assert g.keys() == w.keys(), key(g)
        for k, v in w.items():
            assert g[k] == (pytest.approx(v) if isinstance(v, float) else v), (key(g), k)


def test_summary_fills_missing_ratios() -> None:
    payload = e2e_rounds_payload()
    for e in payload["summary"]:
        e.pop("vs_baseline", None)
    got = {(e["impl"], e["regime"]): e for e in e2e_summary(payload)}
    assert got[("shardfuse", "1k")]["vs_baseline"] == pytest.approx(42 / 50)
    assert "vs_baseline" not in got[("baseline", "1k")]
    assert e2e_summary(e2e_payload()) == []  # no rounds: nothing to summarise
    assert e2e_summary({"results": [{"impl": "x", "regime": "1k", "round": 0, "error": "boom"}]}) == []


def test_failed_round_is_noted(tmp_path: Path) -> None:
    payload = e2e_rounds_payload(with_summary=False)
    for r in payload["results"]:
        if r.get("impl") == "fsdp2" and r.get("regime") == "1k" and r.get("round") == 1:
            for k in ("step_ms", "tok_s_gpu", "peak_gib", "mfu"):
                r.pop(k)
            r["error"] = "RuntimeError: NCCL timeout"
    payload["summary"] = summarize(payload["results"])
    text, _ = _render(tmp_path, e2e_2gpu=payload)
    one_k = _section(text, "#### 1K tokens per GPU")
    assert "| FSDP2 `fully_shard` | 2 | 69.5 | 69.0-70.0 |" in one_k
    assert "- FSDP2 `fully_shard`: error (round 1): RuntimeError: NCCL timeout" in one_k


def test_file_without_summary_renders_as_before(tmp_path: Path) -> None:
    """An e2e file of one run per implementation (the older layout): the table of single runs, as before."""
    text, readme = _render(tmp_path, readme=True, e2e_4gpu=e2e_payload(4, (118.4, 47.9)))
    assert "median step ms" not in text and "The hosts are noisy" not in text
    assert "| implementation | step ms | tokens/s/GPU | MFU % | peak GiB | vs FSDP2 |" in text
    one_k = _section(text, "#### 1K tokens per GPU")
    assert "| one GPU, no sharding (autocast) | 38.7 | 26,460 | 43.2 | 17.25 | - |" in one_k
    assert "| shardfuse `FullyShardedDataParallel` | 47.9 | 21,378 | 43.2 | 17.25 | 1.46x |" in one_k
    assert "| FSDP2 `fully_shard` | 70.0 | 14,629 | 43.2 | 17.25 | 1.00x |" in one_k
    assert "| FSDP1 | 76.5 | 13,386 | 43.2 | 17.25 | 0.92x |" in one_k
    assert "| FairScale FSDP | skipped | - | - | - | - |" in one_k
    assert "_vs FSDP2: FSDP2's step time divided by this step time (above 1.00x is faster)._" in text
    # the summary: no FairScale measured, so its column and ratio are left out / dashed
    assert (
        "| H200 | training, 4 GPUs, 1K tokens/GPU | tokens/s/GPU | 21,378 (0.81x one GPU, 1.46x FSDP2) | - "
        "| 26,460 | 14,629 | 13,386 |"
    ) in text
    # the README's 4-GPU headline (8K): FSDP2 the best of the measured peers
    assert "| 4x H200 | training, 953M decoder, 4 GPUs | 8,192 | 69,189 tok/s/GPU | FSDP2 67,871 | 1.02x |" in readme


def test_rounds_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    root = tmp_path / "results"
    write_results(root, "h200", e2e_2gpu=e2e_rounds_payload(), e2e_4gpu=e2e_payload(4))
    out = tmp_path / "site" / "benchmarks.md"
    assert report.main(["--results", str(root), "--out", str(out)]) == 0
    pngs = sorted(p.name for p in (out.parent / "img").glob("*.png"))
    assert pngs == ["h200_e2e_2gpu_tokens.png", "h200_e2e_4gpu_tokens.png"]
    assert "](img/h200_e2e_2gpu_tokens.png)" in out.read_text()


# ``shardfuse-graph`` (e2e_rounds_payload(captured=True)): medians 8K 95 ms, 1K 30 ms (see _payloads.CAPTURED_MS)
README_CAPTURED_1K = (
    "| H200 | training, 2 GPUs, 1K tokens/GPU, step captured (capture_step) | tokens/s/GPU, median of 3 rounds "
    "| 34,133 (1.80x FairScale, 1.40x one GPU, 2.30x FSDP2, 1.67x eager shardfuse) | 18,963 | 24,381 | 14,841 | - |"
)
README_CAPTURED_8K = (
    "| H200 | training, 2 GPUs, 8K tokens/GPU, step captured (capture_step) | tokens/s/GPU, median of 3 rounds "
    "| 86,232 (1.14x FairScale, 1.07x one GPU, 1.09x FSDP2, 1.02x eager shardfuse) | 75,852 | 80,314 | 78,769 | - |"
)
CAPTURED_LABEL = "shardfuse, step captured by `capture_step` (CUDA graph)"


def _table_rows(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("| H200 | training")]


def test_captured_step_summary_rows(tmp_path: Path) -> None:
    """A file with ``shardfuse-graph``: one more summary row per regime, right after shardfuse's, with the ratios
    of shardfuse's row and the one against eager shardfuse; the other rows as without it. The README's headline
    shows the 1K captured step against the best peer."""
    text, readme = _render(tmp_path, readme=True, e2e_2gpu=e2e_rounds_payload(captured=True, graph_pool_gib=1.25))
    rows = _table_rows(text)
    assert len(rows) == 4
    assert rows[2] == README_1K and rows[3] == README_CAPTURED_1K
    assert rows[1] == README_CAPTURED_8K and rows[0].startswith("| H200 | training, 2 GPUs, 8K tokens/GPU | ")
    assert "1.11x FairScale, 1.05x one GPU, 1.07x FSDP2) |" in rows[0]  # shardfuse's own row: no eager ratio
    assert 'Rows "step captured (capture_step)"' in text
    assert (
        "| 2x H200 | training, 953M decoder, small batch, `capture_step` | 1,024 | 34,133 tok/s/GPU | FairScale "
        "18,963 | 1.80x | `abc1234` |"
    ) in readme
    # the stored ratios are the ones shown (not recomputed from the medians)
    payload = e2e_rounds_payload(captured=True)
    for e in payload["summary"]:
        if e["impl"] == "shardfuse-graph" and e["regime"] == "1k":
            e["vs_shardfuse"] = 2.5
    page, _ = _render(tmp_path / "stored", readme=True, e2e_2gpu=payload)
    assert "| 34,133 (1.80x FairScale, 1.40x one GPU, 2.30x FSDP2, 2.50x eager shardfuse) |" in page
    # a file written mid-run (no summary yet): the same rows from the medians of its rows
    page, _ = _render(tmp_path / "mid", readme=True, e2e_2gpu=e2e_rounds_payload(with_summary=False, captured=True))
    assert README_CAPTURED_1K in page and README_CAPTURED_8K in page
    # without shardfuse-graph: no such row and no word of it
    page, readme = _render(tmp_path / "plain", readme=True, e2e_2gpu=e2e_rounds_payload())
    summary = page.split("\n## H200", 1)[0]
    assert len(_table_rows(summary)) == 2 and "step captured" not in summary and "capture_step" not in readme


def test_captured_step_docs_table(tmp_path: Path) -> None:
    """The page's medians tables: the captured step right after shardfuse, with a column against eager shardfuse
    and its graph pool as a note; rows without a graph pool say that their peaks cover the replays only."""
    text, _ = _render(tmp_path, e2e_2gpu=e2e_rounds_payload(captured=True, graph_pool_gib=1.25))
    header = MEDIANS_HEADER.replace(" | vs shardfuse at b3aa59b |", " | vs eager shardfuse | vs shardfuse at b3aa59b |")
    assert text.count(header) == 2
    one_k = _section(text, "#### 1K tokens per GPU")
    captured = f"| {CAPTURED_LABEL} | 3 | 30.0 | 29.0-31.0 | 34,133 | 30.0 |"
    assert captured in one_k
    assert "| 1.80x | 1.40x | 2.30x | 1.67x | 1.73x |" in one_k.split(captured)[1].splitlines()[0]
    eager = one_k.index("| shardfuse `FullyShardedDataParallel` | 3 | 50.0 |")
    assert eager < one_k.index(captured) < one_k.index("| shardfuse at `b3aa59b` (reference) |")
    assert "| 1.08x | 0.84x | 1.38x | - | 1.04x |" in one_k  # eager shardfuse against itself: a dash
    assert f"- {CAPTURED_LABEL}: the CUDA graph's private memory pool kept 2.25 GiB reserved" in one_k
    assert "in this order: one GPU -> shardfuse -> shardfuse (captured) -> shardfuse at b3aa59b" in text
    text, _ = _render(tmp_path / "nopool", e2e_2gpu=e2e_rounds_payload(captured=True))
    one_k = _section(text, "#### 1K tokens per GPU")
    assert f"- {CAPTURED_LABEL}: these rows carry no graph pool (`graph_pool_gib_rank0`)" in one_k
    assert "its peaks cover the replays only" in one_k
    # without shardfuse-graph the tables keep their columns
    text, _ = _render(tmp_path / "plain", e2e_2gpu=e2e_rounds_payload())
    assert "vs eager shardfuse" not in text and "graph pool" not in text
