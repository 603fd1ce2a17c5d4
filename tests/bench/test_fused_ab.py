"""``bench.e2e.fused_ab``: the table of the gpu_suite ``fused-ab`` stage (the fused gradient pre-divide off and on),
checked on fresh random rounds against medians computed here; a setting without runs gives no row."""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

from bench.common import gpu_key
from bench.e2e import fused_ab


def _write(folder: Path, rnd: int, fused: int, rows: list[dict]) -> None:
    (folder / f"fused_ab_r{rnd}_f{fused}.json").write_text(json.dumps({"results": rows}))


def test_medians_spreads_and_ratio_over_rounds(tmp_path: Path, capsys) -> None:
    rng = random.Random()
    times: dict[tuple[str, int], list[float]] = {}
    for rnd in range(3):
        for fused in (0, 1):
            rows = []
            for impl in ("shardfuse", "shardfuse-graph"):
                t = rng.uniform(20, 90)
                times.setdefault((impl, fused), []).append(t)
                rows.append({"impl": impl, "step_ms": t, "peak_gib": 10.0 + fused})
            rows.append({"impl": "fsdp2", "step_ms": None})  # a failed run: no step time
            _write(tmp_path, rnd, fused, rows)
    out = tmp_path / "cmp.json"
    assert fused_ab.main(["--dir", str(tmp_path), "--out", str(out)]) == 0
    table = {row["impl"]: row for row in json.loads(out.read_text())["comparison"]}
    assert sorted(table) == ["shardfuse", "shardfuse-graph"]
    for impl, row in table.items():
        off, on = times[(impl, 0)], times[(impl, 1)]
        assert row["rounds"] == [3, 3]
        assert row["step_ms"]["off"] == {"median": statistics.median(off), "min": min(off), "max": max(off)}
        assert row["step_ms"]["on"]["median"] == statistics.median(on)
        assert row["step_ms_off_over_on"] == statistics.median(off) / statistics.median(on)
        assert row["peak_gib_off_over_on"] == 10.0 / 11.0
    text = capsys.readouterr().out
    assert f"{statistics.median(times[('shardfuse-graph', 1)]):.2f}" in text


def test_one_setting_only_gives_no_row(tmp_path: Path, capsys) -> None:
    _write(tmp_path, 0, 0, [{"impl": "shardfuse", "step_ms": 30.0, "peak_gib": 1.0}])
    assert fused_ab.main(["--dir", str(tmp_path)]) == 1
    assert "no implementation" in capsys.readouterr().out


def test_gpu_suite_stage_alternates_the_settings_and_prints_the_table(tmp_path: Path) -> None:
    """The fused-ab stage as bench/gpu_suite.sh runs it, with a stand-in torchrun that records its arguments and
    environment and writes a result file where bench.e2e.run would."""
    repo = Path(__file__).resolve().parents[2]
    out = tmp_path / "out"
    results = out / "work" / "results" / gpu_key()
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "torchrun").write_text(
        "#!/bin/sh\n"
        'name=""; prev=""\n'
        'for a in "$@"; do [ "$prev" = "--name" ] && name=$a; prev=$a; done\n'
        'echo "$name $SHARDFUSE_FUSED_GRADS" >> "$OUT/calls.txt"\n'
        f'mkdir -p "{results}"\n'
        'ms=$((30 + SHARDFUSE_FUSED_GRADS))\n'
        f'printf \'{{"results": [{{"impl": "shardfuse-graph", "step_ms": %s, "peak_gib": 2.0}}]}}\' "$ms" '
        f'> "{results}/$name.json"\n')
    (fake / "torchrun").chmod(0o755)
    # The suite's python3 is this interpreter (its environment has torch, as on the device machine).
    path = f"{fake}:{Path(sys.executable).parent}:{os.environ['PATH']}"
    env = {**os.environ, "PATH": path, "OUT": str(out), "FA_ROUNDS": "2"}
    proc = subprocess.run(["bash", str(repo / "bench" / "gpu_suite.sh"), "fused-ab"], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    calls = (out / "work" / "calls.txt").read_text().split("\n")
    assert calls[:4] == ["fused_ab_r0_f0 0", "fused_ab_r0_f1 1", "fused_ab_r1_f1 1", "fused_ab_r1_f0 0"]
    table = json.loads((out / "fused_ab.json").read_text())["comparison"]
    assert [row["impl"] for row in table] == ["shardfuse-graph"]
    assert table[0]["step_ms_off_over_on"] == 30 / 31
    assert "| shardfuse-graph | 2/2 | 30.00" in proc.stdout
