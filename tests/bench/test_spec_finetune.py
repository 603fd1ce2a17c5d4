"""``bench.offload.spec_finetune``: speculative clipping on a two-phase fine-tune, on the CPU with the tiny model.
Clipping that never fires commits every fine-tune step; clipping that always fires redoes every one; the losses are
the same bits as without speculation either way (the bench's own check, exit status 0)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from bench.offload import spec_finetune


@pytest.mark.parametrize("max_norm,fires", [(1e9, False), (1e-9, True)], ids=["never-fires", "always-fires"])
def test_commits_when_clipping_does_not_fire_and_redoes_when_it_does(tmp_path: Path, max_norm: float,
                                                                     fires: bool) -> None:
    pytest.importorskip("transformers")
    out = tmp_path / "spec.json"
    steps = 4
    env_before = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    code = spec_finetune.main(["--config", "tiny", "--device", "cpu", "--pretrain-steps", "2", "--steps", str(steps),
                               "--seq", "48", "--skip", "1", "--max-norm", str(max_norm), "--spec-backoff", "0",
                               "--out", str(out)])  # 0: speculate on every step (no back-off)
    # The one-rank group's variables are gone again: a script started later must not think it runs under torchrun.
    assert {k: os.environ.get(k) for k in env_before} == env_before
    result = json.loads(out.read_text())
    assert code == 0 and result["losses_equal"] is True
    plain, spec = result["rows"]
    assert (plain["speculative_clip"], spec["speculative_clip"]) == (False, True)
    for row in (plain, spec):
        assert row["steps"] == steps and row["clip_fired"] == (steps if fires else 0)
    committed, redone = spec["finetune_steps_committed"], spec["finetune_steps_redone"]
    assert (committed, redone) == ((0, steps) if fires else (steps, 0)), spec
    assert spec["commit_share"] == committed / steps
    assert (spec["finetune_units_redone"] > 0) == fires and (spec["finetune_units_committed"] > 0) != fires
    # The pre-training ran once (resident), the fine-tune in both runs.
    assert len(result["pretrain"]["steps"]) == 2 and result["pretrain"]["resident"] is True
    for run in result["runs"]:
        assert "prose" not in run and len(run["code"]["steps"]) == steps


def test_fine_tune_starts_from_the_pretrained_weights(tmp_path: Path) -> None:
    """The offloaded model is built from the resident pre-training's weights: its first fine-tune loss is the
    loss of those weights on that batch (and not a fresh model's)."""
    pytest.importorskip("transformers")
    import torch

    args = spec_finetune.parse_args(["--config", "tiny", "--device", "cpu", "--pretrain-steps", "3", "--steps", "1",
                                     "--seq", "48", "--max-norm", "1e9"])
    weights, rows = spec_finetune.pretrain(args, torch.device("cpu"))
    assert len(rows) == 3 and rows[-1]["loss"] < rows[0]["loss"] + 1.0
    fresh = spec_finetune._plain_model("tiny").state_dict()
    assert any(not torch.equal(weights[k], fresh[k]) for k in fresh), "pre-training changed nothing"
    ids = spec_finetune.windows(spec_finetune.corpus("code") % 256, 1, 1, 48, seed=2)[0]
    want = spec_finetune._plain_model("tiny")
    want.load_state_dict(weights)
    want_loss = want(input_ids=ids, labels=ids).loss.item()
    code = spec_finetune.main(["--config", "tiny", "--device", "cpu", "--pretrain-steps", "3", "--steps", "1",
                               "--seq", "48", "--max-norm", "1e9", "--skip", "0", "--out", str(tmp_path / "o.json")])
    result = json.loads((tmp_path / "o.json").read_text())
    assert code == 0
    for run in result["runs"]:
        assert abs(run["code"]["steps"][0]["loss"] - want_loss) < 1e-5 * max(1.0, abs(want_loss))


def test_corpus_is_the_repository_text_and_windows_fit() -> None:
    prose, code = spec_finetune.corpus("prose"), spec_finetune.corpus("code")
    assert prose.numel() > 10_000 and code.numel() > 10_000 and int(prose.max()) < 256
    batches = spec_finetune.windows(code, 3, 2, 17, seed=5)
    assert [tuple(b.shape) for b in batches] == [(2, 17)] * 3
    assert all(bytes(row.tolist()) in bytes(code.tolist()) for row in batches[0])  # contiguous windows
    with pytest.raises(ValueError, match="lower --seq"):
        spec_finetune.windows(code[:10], 1, 1, 17, seed=0)


def test_gpu_suite_stage_passes_the_clip_and_the_tag(tmp_path: Path) -> None:
    """``SF_MAX_NORM=8 SF_TAG=_clip8 bash bench/gpu_suite.sh spec-finetune`` runs the bench with that clip and
    writes its own JSON; without them, clip 1.0 into spec_finetune.json (a stand-in python3 records the call)."""
    import os
    import subprocess

    repo = Path(__file__).resolve().parents[2]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stand_in = bin_dir / "python3"
    stand_in.write_text('#!/usr/bin/env bash\n[ "$1" = "-m" ] && [ "$2" = bench.offload.spec_finetune ] && '
                        'echo "$@" >> "$CALLS"\nexit 0\n')
    stand_in.chmod(0o755)
    calls = tmp_path / "calls.txt"
    for extra in ({}, {"SF_MAX_NORM": "8", "SF_TAG": "_clip8"}):
        env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(tmp_path / "out"),
               "CALLS": str(calls), **extra}
        proc = subprocess.run(["bash", str(repo / "bench" / "gpu_suite.sh"), "spec-finetune"], cwd=repo, env=env,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-2000:]
    plain, clip8 = calls.read_text().splitlines()
    assert "--max-norm 1.0" in plain and "--commit-steps 80" in plain
    assert plain.endswith(f"--out {tmp_path / 'out'}/spec_finetune.json")
    assert "--max-norm 8" in clip8 and clip8.endswith(f"--out {tmp_path / 'out'}/spec_finetune_clip8.json")


def test_commit_pair_runs_under_a_clip_the_norms_stay_under_and_both_floors_are_reported(tmp_path: Path) -> None:
    """``--commit-steps``: a second pair at 1.25x the plain run's largest norm, where every speculative step commits
    and the losses are the same bits; the floor terms are measured in the process and each row is judged by them."""
    pytest.importorskip("transformers")
    out = tmp_path / "spec.json"
    code = spec_finetune.main(["--config", "tiny", "--device", "cpu", "--pretrain-steps", "3", "--steps", "4",
                               "--seq", "48", "--skip", "1", "--max-norm", "1e-9", "--commit-steps", "3",
                               "--out", str(out)])
    result = json.loads(out.read_text())
    assert code == 0 and result["losses_equal"] and result["commit"]["losses_equal"]
    largest = max(r["norm"] for r in result["runs"][0]["code"]["steps"])
    plain, spec = result["commit"]["rows"]
    assert plain["max_norm"] == spec["max_norm"] == pytest.approx(1.25 * largest)
    assert (spec["finetune_steps_committed"], spec["finetune_steps_redone"]) == (3, 0)
    assert plain["clip_fired"] == spec["clip_fired"] == 0
    # The first pair, at 1e-9: clipping fired on every step; the library's back-off (3) paused the fourth.
    first = result["rows"][1]
    assert (first["finetune_steps_redone"], first["finetune_steps_paused"], first["finetune_steps_committed"]) == (
        3, 1, 0)
    floor = result["floor"]
    assert floor["params"] == sum(p.numel() for p in spec_finetune._plain_model("tiny").parameters())
    assert floor["clipped_floor_ms"] == pytest.approx(floor["bwd_ms"] + floor["cpu_opt_ms"])
    assert floor["overlap_floor_ms"] == pytest.approx(max(floor["fwd_ms"] + floor["bwd_ms"], floor["cpu_opt_ms"]))
    for row in result["rows"] + result["commit"]["rows"]:
        assert row["vs_clipped_floor"] == pytest.approx(row["step_ms"] / floor["clipped_floor_ms"])
        assert row["vs_overlap_floor"] == pytest.approx(row["step_ms"] / floor["overlap_floor_ms"])


def test_commit_max_norm_given_is_used_and_bad_values_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    args = spec_finetune.parse_args(["--commit-steps", "2", "--commit-max-norm", "7.5"])
    assert spec_finetune.commit_norm(args, {"code": {"steps": [{"norm": 100.0}]}}) == 7.5
    args = spec_finetune.parse_args(["--commit-steps", "2"])
    assert spec_finetune.commit_norm(args, {"code": {"steps": [{"norm": 2.0}, {"norm": 4.0}]}}) == 5.0
    for bad in (["--commit-steps", "-1"], ["--commit-max-norm", "0"]):
        with pytest.raises(SystemExit):
            spec_finetune.parse_args(bad)
        assert "--commit-max-norm > 0" in capsys.readouterr().err


def test_report_renders_the_stored_file_with_both_pairs_and_the_floor(tmp_path: Path) -> None:
    """What bench.offload.spec_finetune writes (here on the CPU, tiny model) is a known kind for bench.report, and
    its section shows the floor, both pairs' rows with their ratios, and whether the losses agreed."""
    pytest.importorskip("transformers")
    from bench import report
    from bench.results_io import load_file

    gpu_dir = tmp_path / "results" / "h100"
    gpu_dir.mkdir(parents=True)
    out = gpu_dir / "spec_finetune.json"
    assert spec_finetune.main(["--config", "tiny", "--device", "cpu", "--pretrain-steps", "2", "--steps", "3",
                               "--seq", "48", "--skip", "0", "--max-norm", "1e-9", "--commit-steps", "2",
                               "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    data["env"]["gpu_key"] = "h100"  # as a GPU run records it (a CPU run is not shown)
    out.write_text(json.dumps(data))
    assert load_file(out).kind == "spec_finetune"
    page = tmp_path / "benchmarks.md"
    assert report.main(["--results", str(tmp_path / "results"), "--out", str(page), "--no-plots"]) == 0
    text = page.read_text()
    section = text[text.index("### Speculative clipping on an offloaded fine-tune (`spec_finetune.json`)"):]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "---" not in line][1:5]
    plain, spec = data["rows"]
    assert rows[0].startswith("| 1e-09 | no | 3 |") and f"| {plain['vs_clipped_floor']:.2f}x |" in rows[0]
    assert rows[1].startswith("| 1e-09 | yes | 3 |") and "| 0/3 |" in rows[1]
    assert "| yes | 2 |" in rows[3] and "| 2/2 |" in rows[3]
    assert f"CPU AdamW alone {data['floor']['cpu_opt_ms']:.1f} ms" in section
    assert "the same bits at the fine-tune's clip; the same bits at the commit clip" in section


def test_host_topology_reads_numa_nodes_and_affinity(tmp_path: Path) -> None:
    """bench.common.host_topology: the NUMA node count from sysfs (a fake root here), this process's CPUs, and no
    GPU node without a GPU index."""
    from bench.common import host_topology

    for node in ("node0", "node1", "possible"):
        (tmp_path / "devices/system/node" / node).mkdir(parents=True)
    topo = host_topology(None, sys_root=tmp_path)
    assert topo["numa_nodes"] == 2 and topo["affinity_cores"] == len(os.sched_getaffinity(0))
    assert topo["gpu_numa_node"] is None
    assert host_topology(None, sys_root=tmp_path / "missing")["numa_nodes"] is None
