"""Issue 31's capture-table bench: the timeline split (``bench.e2e._timeline``) against a brute-force count on
random intervals; the report's "vs one GPU captured" column, SFT loss line and profile section; host_load rows
skipped by the planner's accuracy check; and, on 2 gloo ranks with the tiny HF Llama, that ``bench.e2e.sft``'s
captured loop gives the eager loop's losses and that its bucket padding gives the unpadded loss."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from bench import plan_accuracy, report
from bench.e2e import _timeline as tl
from bench.e2e.run import summarize
from bench.host_load import host_load_reason, load_per_core
from tests.bench._payloads import ENV, write_results

# ------------------------------------------------------------------------------------------------ timeline


def _random_kernels(rng: random.Random, n: int) -> list[tl.Kernel]:
    names = ["gemm", "_cast_shard_kernel", "ncclDevKernel_AllGather_RING", "ncclKernel_ReduceScatter_Sum",
             "ncclDevKernel_AllReduce", "Memcpy DtoD"]  # fmt: skip
    out = []
    for _ in range(n):
        s = rng.randrange(0, 200)
        out.append((float(s), float(s + rng.randrange(0, 30)), rng.choice(names)))
    return out


def _brute_force(kernels: list[tl.Kernel]) -> dict[str, Any]:
    """Unit by unit on the integer grid: what runs in [t, t+1)."""
    lo, hi = int(min(s for s, _, _ in kernels)), int(max(e for _, e, _ in kernels))
    compute = exposed = idle = 0
    comp_at = set()
    for t in range(lo, hi):
        c = any(s <= t < e for s, e, n in kernels if "nccl" not in n.lower())
        m = any(s <= t < e for s, e, n in kernels if "nccl" in n.lower())
        comp_at.update([t] if c else [])
        compute, exposed, idle = compute + c, exposed + (m and not c), idle + (not c and not m)
    overlapped: dict[str, float] = {}
    for s, e, n in kernels:
        if "nccl" in n.lower():
            kind = tl.collective_kind(n)
            overlapped[kind] = overlapped.get(kind, 0.0) + sum(1 for t in range(int(s), int(e)) if t in comp_at)
    return {"span_us": hi - lo, "compute_us": compute, "exposed_comm_us": exposed, "idle_us": idle,
            "overlapped": overlapped}  # fmt: skip


@pytest.mark.parametrize("seed", range(6))
def test_split_step_equals_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    kernels = _random_kernels(rng, rng.randrange(1, 40))
    got, want = tl.split_step(kernels), _brute_force(kernels)
    for key in ("span_us", "compute_us", "exposed_comm_us", "idle_us"):
        assert got[key] == want[key], (key, got, want)
    assert got["compute_us"] + got["exposed_comm_us"] + got["idle_us"] == got["span_us"]
    assert {k: c["overlapped_us"] for k, c in got["collectives"].items()} == want["overlapped"]
    assert sum(c["count"] for c in got["collectives"].values()) == sum("nccl" in n.lower() for _, _, n in kernels)


def test_gap_and_top_kernels() -> None:
    rng = random.Random(7)
    sharded, base = _random_kernels(rng, 30), [k for k in _random_kernels(rng, 30) if "nccl" not in k[2].lower()]
    g = tl.gap(tl.split_step(sharded), tl.split_step(base))
    assert g["gap_us"] == pytest.approx(g["compute_delta_us"] + g["exposed_comm_delta_us"] + g["idle_delta_us"])
    top = tl.top_kernels(sharded, base, n=3)
    for row in top:
        mine = sum(e - s for s, e, n in sharded if n == row["name"])
        theirs = sum(e - s for s, e, n in base if n == row["name"])
        assert (row["us"], row["base_us"], row["delta_us"]) == (mine, theirs, mine - theirs)
        assert "nccl" not in row["name"].lower()
    assert [r["delta_us"] for r in top] == sorted((r["delta_us"] for r in top), reverse=True)
    assert tl.split_step([])["span_us"] == 0.0


def test_host_load_reason() -> None:
    assert load_per_core(own_processes=2, load1=10.0, cores=16) == 0.5
    assert host_load_reason(0.1, {}) is None
    assert "0.50 per core" in (host_load_reason(0.5, {}) or "")
    assert "BENCH_HOST_SHARED" in (host_load_reason(0.0, {"BENCH_HOST_SHARED": "1"}) or "")
    assert host_load_reason(0.5, {"BENCH_HOST_LOAD_MAX": "0.6"}) is None
    with pytest.raises(ValueError, match="BENCH_HOST_LOAD_MAX='x'"):
        host_load_reason(0.5, {"BENCH_HOST_LOAD_MAX": "x"})


# ------------------------------------------------------------------------------------------------ report

# medians over 3 rounds (ms) at 1K tokens/GPU: one GPU captured 28, captured 32, eager 55, FSDP2+compile 95
CT_MS = {"baseline-graph": (28.0, 27.0, 29.0), "shardfuse": (55.0, 39.0, 58.0), "shardfuse-graph": (31.0, 32.0, 34.0),
         "fsdp2-compile": (87.0, 104.0, 95.0)}  # fmt: skip


def _capture_payload(loaded_round: int | None = None) -> dict[str, Any]:
    rows = []
    for rnd in range(3):
        for impl, times in CT_MS.items():
            rows.append({"impl": impl, "regime": "1k", "round": rnd, "batch": 1, "seq": 1024, "step_ms": times[rnd],
                         "tok_s_gpu": 1024 / (times[rnd] * 1e-3), "loss_last": 10.0,
                         "host_load": "BENCH_HOST_SHARED is set" if rnd == loaded_round else None})  # fmt: skip
    return {"env": ENV, "config": {"model": "bench", "model_kind": "decoder", "world_size": 4, "device": "cuda",
                                   "steps": 20, "warmup": 3, "optimizer": "AdamW (fused)", "dim": 2048,
                                   "n_layers": 16, "n_heads": 16, "n_kv_heads": 16, "ffn_dim": 5632,
                                   "vocab_size": 32000},
            "results": rows, "summary": summarize(rows)}  # fmt: skip


def _overlap_payload() -> dict[str, Any]:
    kernels = [(0.0, 30000.0, "gemm"), (1000.0, 4000.0, "ncclDevKernel_AllGather"), (29000.0, 33000.0,
               "ncclKernel_ReduceScatter"), (33500.0, 34500.0, "_cast_shard_kernel")]  # fmt: skip
    base = [(0.0, 28000.0, "gemm")]
    captured, baseline = tl.split_step(kernels), tl.split_step(base)
    return {"env": ENV, "kind": "overlap", "host_load": None,
            "config": {"model_kind": "decoder", "model": "bench", "world_size": 4, "batch": 1, "seq": 1024,
                       "replays": 5, "optimizer": "AdamW (fused, capturable)"},
            "captured": captured, "baseline": baseline, "gap": tl.gap(captured, baseline),
            "top_kernels": tl.top_kernels(kernels, base)}  # fmt: skip


def _render(tmp_path: Path, **payloads: dict[str, Any]) -> str:
    root = tmp_path / "results"
    write_results(root, "h100", **payloads)
    out = tmp_path / "docs" / "benchmarks.md"
    assert report.main(["--results", str(root), "--out", str(out), "--no-plots"]) == 0
    return out.read_text()


def test_report_vs_one_gpu_captured_column_sft_and_profile(tmp_path: Path) -> None:
    sft = _capture_payload()
    for r in sft["results"]:
        r["regime"] = "sft"
    sft["results"] = [r for r in sft["results"] if r["impl"] in ("shardfuse", "shardfuse-graph")]
    sft["summary"] = summarize(sft["results"])
    sft["sft"] = [{"round": k, "losses_equal": k != 1, "max_rel_loss_diff": 0.0 if k != 1 else 2e-3} for k in range(3)]
    text = _render(tmp_path, e2e_capture_4gpu=_capture_payload(loaded_round=2), e2e_capture_sft_4gpu=sft,
                   overlap_captured_4gpu=_overlap_payload())
    header = next(line for line in text.splitlines() if line.startswith("| implementation | rounds") and
                  "vs one GPU captured" in line)  # fmt: skip
    cols = [c.strip() for c in header.strip("|").split("|")]
    row = next(line for line in text.splitlines() if line.startswith("| shardfuse, step captured"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[cols.index("median step ms")] == "32.0"
    assert cells[cols.index("vs one GPU captured")] == f"{28.0 / 32.0:.2f}x"  # 0.88x: the limit ratio
    assert cells[cols.index("vs eager shardfuse")] == f"{55.0 / 32.0:.2f}x"
    assert "FSDP2 `fully_shard` + per-layer `torch.compile` | 3 | 95.0" in text
    assert "(round 2): measured on a loaded host: BENCH_HOST_SHARED is set" in text
    assert "#### many-shape SFT (variable lengths padded to 4 buckets" in text
    assert "| H100 | training, 4 GPUs, decoder, fused AdamW, many-shape SFT, step captured (capture_step) |" in text
    assert "round 0: equal; round 1: different (largest relative difference 2.0e-03); round 2: equal" in text
    profile = text[text.index("### Profile of the captured step, 4 GPUs"):]
    assert "| shardfuse, captured | 34.50 | 31.00 | 3.00 | 0.50 | 100% | 25% |" in profile
    assert "| one GPU, captured | 28.00 | 28.00 | 0.00 | 0.00 | - | - |" in profile
    assert "Gap to the one-GPU captured step: +6.50 ms = compute +3.00 + exposed communication +3.00 + idle +0.50" in (
        profile)
    assert "| `_cast_shard_kernel` | 1 | 1.00 | 0.00 | +1.00 |" in profile
    assert text == _render(tmp_path, e2e_capture_4gpu=_capture_payload(loaded_round=2), e2e_capture_sft_4gpu=sft,
                           overlap_captured_4gpu=_overlap_payload())  # deterministic


def test_plan_accuracy_skips_rows_on_a_loaded_host(tmp_path: Path) -> None:
    payload = _capture_payload(loaded_round=1)
    for r in payload["results"]:
        r["impl"] = "shardfuse" if r["impl"] == "fsdp2-compile" else r["impl"]
    hf = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
              num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048)  # sft_buckets' "1b"
    sft = {"env": ENV, "config": {"model": "1b", "model_kind": "hf-llama", "world_size": 2, "device": "cuda",
                                  "hf_config": hf, "optimizer": "AdamW (fused, capturable)"},
           "results": [{"impl": "shardfuse", "regime": "sft", "round": 0, "batch": 4, "seq": 2048, "step_ms": 99.0,
                        "tok_s_gpu": 13000.0, "host_load": None}]}  # fmt: skip
    write_results(tmp_path, "h100", e2e_capture_4gpu=payload, e2e_capture_sft_2gpu=sft)
    everything = plan_accuracy.collect(tmp_path)
    checks = [c for c in everything if c.row.startswith("1k shardfuse ")]
    loaded = [c for c in checks if c.row.endswith("round 1")]
    assert loaded and all(c.skipped and "loaded host (BENCH_HOST_SHARED is set)" in c.skipped for c in loaded)
    assert any(c.skipped is None for c in checks)  # the other rounds' rows are predicted
    (sft_check,) = [c for c in everything if c.file == "e2e_capture_sft_2gpu"]
    assert sft_check.skipped and "many-shape SFT" in sft_check.skipped
    assert "loaded host" in plan_accuracy.markdown(plan_accuracy.collect(tmp_path))


# ------------------------------------------------------------------------------------------------ SFT bench, gloo


def check_sft_bench_loops(steps: int, bf16: bool = False) -> dict[str, Any]:
    """The bench's eager and captured loops on the same plan (on the CPU the captured step runs eagerly under
    capture_step's contract: graphs per bucket bookkept, warm-up at capture time, the same calls)."""
    from bench.e2e.sft import plan_batches, run_loop

    plan = plan_batches("tiny", steps, 2, torch.device("cpu"))
    eager = run_loop("tiny", plan, torch.device("cpu"), captured=False, lr=1e-3, bf16=bf16)
    captured = run_loop("tiny", plan, torch.device("cpu"), captured=True, lr=1e-3, bf16=bf16)
    return {"eager": eager["losses"], "captured": captured["losses"], "graphs": captured["graphs"],
            "warm": [b.bucket for b in plan["warm"]], "timed": [b.bucket for b in plan["timed"]],
            "real": eager["real_tokens"], "padded": eager["padded_tokens"]}  # fmt: skip


def check_bucket_padding_gives_the_unpadded_loss() -> list[tuple[float, float]]:
    """For fresh weights, every planned batch's padded loss (the bench's step loss) against the loss of its rows
    run one by one at their own lengths (summed over the labelled tokens, divided by their count)."""
    import torch.nn.functional as F
    from transformers import LlamaConfig

    from bench.e2e.sft import plan_batches
    from examples.sft_buckets import CONFIGS, build

    plan = plan_batches("tiny", 3, 2, torch.device("cpu"), seed=5)
    model = build(LlamaConfig(**CONFIGS["tiny"], attn_implementation="sdpa"), torch.device("cpu"))
    out = []
    with torch.no_grad():
        for b in plan["warm"] + plan["timed"]:
            logits = model(input_ids=b.input_ids, use_cache=False).logits
            padded = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), b.labels[:, 1:].flatten(), ignore_index=-100)
            total, count = torch.zeros((), dtype=torch.float64), 0
            for row, n in enumerate(b.lengths.tolist()):
                ids, labels = b.input_ids[row, :n], b.labels[row, :n]
                lg = model(input_ids=ids[None], use_cache=False).logits[0, :-1].float()
                total += F.cross_entropy(lg, labels[1:], ignore_index=-100, reduction="sum").double()
                count += int((labels[1:] != -100).sum())
            out.append((padded.item(), (total / count).item()))
    return out


def test_sft_bench_bf16_trains_apart_from_fp32_on_gloo(pool) -> None:
    """--bf16 (the capture table's SFT rows): the loops still agree, and the compute is not the fp32 one."""
    pytest.importorskip("transformers")
    bf16, fp32 = pool.run(check_sft_bench_loops, 2, True), pool.run(check_sft_bench_loops, 2, False)
    for b, f in zip(bf16, fp32):
        assert b["captured"] == b["eager"] and all(math.isfinite(x) for x in b["eager"])
        assert b["eager"] != f["eager"], "--bf16 gave the fp32 losses: the mixed precision never reached the model"


def test_sft_bench_captured_losses_equal_eager_on_gloo(pool) -> None:
    pytest.importorskip("transformers")
    out = pool.run(check_sft_bench_loops, 4)
    for o in out:
        assert o["captured"] == o["eager"] and len(o["eager"]) == 4
        assert len(set(o["eager"])) > 1  # the model trains: the losses move
        assert sorted(o["warm"][1:]) == sorted(set(o["warm"][1:])) and o["graphs"] == len(set(o["warm"]))
        assert 0 < o["real"] < o["padded"]  # the real tokens are counted, not the padding
    assert out[0]["timed"] == out[1]["timed"]  # the same bucket on both ranks at every step


def test_sft_bench_bucket_padding_gives_the_unpadded_loss(pool) -> None:
    pytest.importorskip("transformers")
    for pairs in pool.run(check_bucket_padding_gives_the_unpadded_loss):
        assert len(pairs) >= 4
        for padded, unpadded in pairs:
            assert padded == pytest.approx(unpadded, rel=1e-5, abs=1e-6)


def test_capture_table_joins_rounds_into_one_file_per_part(tmp_path: Path, capsys) -> None:
    from bench.e2e import capture_table

    full = _capture_payload()
    for rnd in (0, 2):  # round 1 failed: no file
        rows = [{**r, "round": 0} for r in full["results"] if r["round"] == rnd]
        (tmp_path / f"ct_decoder_r{rnd}.json").write_text(json.dumps({**full, "results": rows, "summary": []}))
    (tmp_path / "overlap_captured_4gpu.json").write_text(json.dumps(_overlap_payload()))
    final = tmp_path / "final"
    assert capture_table.main(["--dir", str(tmp_path), "--rounds", "3", "--copy-to", str(final)]) == 0
    joined = json.loads((final / "e2e_capture_4gpu.json").read_text())
    assert sorted({r["round"] for r in joined["results"]}) == [0, 2] and joined["config"]["rounds"] == 2
    (cap,) = [s for s in joined["summary"] if s["impl"] == "shardfuse-graph"]
    assert cap["step_ms_median"] == (31.0 + 34.0) / 2
    assert cap["vs_baseline-graph"] == pytest.approx((28.0 + 29.0) / (31.0 + 34.0))
    assert sorted(p.name for p in final.iterdir()) == ["e2e_capture_4gpu.json", "overlap_captured_4gpu.json"]
    out = capsys.readouterr().out
    assert "decoder: no file for round(s) [1]" in out and "hf: no file for round(s) [0, 1, 2]" in out
    assert "gap to one GPU captured +6.50: compute +3.00, exposed comm +3.00, idle +0.50" in out


def test_report_names_the_loaded_rounds_once_per_implementation(tmp_path: Path) -> None:
    """Every round on a loaded host: one note per implementation naming its rounds, not one per round."""
    payload = _capture_payload()
    for r in payload["results"]:
        r["host_load"] = "BENCH_HOST_SHARED is set"
    text = _render(tmp_path, e2e_capture_4gpu=payload)
    notes = [line for line in text.splitlines() if "measured on a loaded host" in line]
    impls = {r["impl"] for r in payload["results"]}
    assert len(notes) == len(impls), notes
    assert all("(rounds 0, 1, 2): measured on a loaded host: BENCH_HOST_SHARED is set" in n for n in notes), notes
