"""``bench.scale``: the alpha-beta scale model on small inputs (no torch.distributed, no GPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.scale import __main__ as cli
from bench.scale.calibrate import load_measured, make_calibration, make_hardware, nvlink_fits, validation_points
from bench.scale.model import MODELS, Link, ring_time, step_time

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


def _cal():
    return make_calibration(load_measured(RESULTS))


def test_param_counts_match_examples_llama() -> None:
    from examples.llama import LlamaConfig

    assert MODELS["953m"].params == LlamaConfig.bench().num_params() == 953_223_168
    assert MODELS["7b"].params == LlamaConfig.llama_7b().num_params()
    assert 68e9 < MODELS["70b"].params < 70e9  # Llama-2-70B with 8 kv heads


def test_ring_time_formula() -> None:
    link = Link(alpha_s=1e-5, bw_bps=1e11)
    assert ring_time(1e9, 1, link) == 0.0
    assert ring_time(1e9, 4, link) == pytest.approx(3 * 1e-5 + 0.75 * 1e9 / 1e11)
    assert ring_time(1e9, 4, link, all_reduce=True) == pytest.approx(2 * ring_time(1e9, 4, link))


def test_nvlink_fit_reproduces_anchor_bus_bandwidth() -> None:
    ag, rs = nvlink_fits()
    t = ring_time(2**30, 2, ag[2])
    assert 0.5 * 2**30 / t / 1e9 == pytest.approx(266, rel=0.1)
    t = ring_time(2**30, 4, rs[4])
    assert 0.75 * 2**30 / t / 1e9 == pytest.approx(334, rel=1e-6)


@pytest.mark.parametrize("model", ["953m", "7b", "70b"])
@pytest.mark.parametrize("strategy", ["flat", "hybrid"])
def test_more_inter_node_bandwidth_never_slows(model: str, strategy: str) -> None:
    cal = _cal()
    for gpus in (8, 16, 64, 512):
        steps = [step_time(MODELS[model], gpus, 4096, 2048, strategy, make_hardware(g, 10, 8), cal).step_ms
                 for g in (50, 100, 200, 400, 800, 3200)]
        assert all(a >= b for a, b in zip(steps, steps[1:])), (gpus, steps)


def test_hybrid_equals_flat_within_a_node() -> None:
    cal, hw = _cal(), make_hardware(400, 10, 8)
    for gpus in (1, 2, 4, 8):
        flat = step_time(MODELS["7b"], gpus, 4096, 4096, "flat", hw, cal)
        hybrid = step_time(MODELS["7b"], gpus, 4096, 4096, "hybrid", hw, cal)
        assert flat.step_ms == hybrid.step_ms and hybrid.replicas == 1
    flat = step_time(MODELS["7b"], 64, 4096, 4096, "flat", hw, cal)
    hybrid = step_time(MODELS["7b"], 64, 4096, 4096, "hybrid", hw, cal)
    assert hybrid.step_ms < flat.step_ms and (hybrid.shard, hybrid.replicas) == (8, 8)


def test_two_gpu_prediction_within_15_percent_of_stored_measurements() -> None:
    cal, hw = _cal(), make_hardware(400, 10, 8)
    points = validation_points(RESULTS)
    assert {p.label for p in points} >= {"953M 8K tok/GPU", "953M 1K tok/GPU", "7B 4K tok/GPU"}
    for p in points:
        pred = step_time(MODELS[p.model], 2, p.tokens, p.seq, "flat", hw, cal).step_ms
        assert abs(pred / p.measured_ms - 1) <= 0.15, (p.label, pred, p.measured_ms)


def test_cli_writes_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, png = tmp_path / "scale_model.json", tmp_path / "scale.png"
    assert cli.main(["--gpus", "8,64", "--model", "7b", "--inter-node-gbps", "200", "--json", str(out),
                     "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert "Assumptions" in text and "200 Gb/s per GPU = 25.0 GB/s" in text and "2-GPU validation" in text
    record = json.loads(out.read_text())
    assert record["kind"] == "scale_model" and record["hardware"]["inter_node_gbps"] == 200
    assert {(r["gpus"], r["strategy"]) for r in record["rows"]} == {(8, "flat"), (8, "hybrid"), (64, "flat"),
                                                                  (64, "hybrid")}
    assert all(v["within_target"] for v in record["validation_2gpu"])
    assert png.stat().st_size > 1000


def test_cli_rejects_partial_nodes() -> None:
    with pytest.raises(SystemExit):
        cli.main(["--gpus", "12", "--no-json"])


def test_report_renders_the_scale_model_from_its_file(tmp_path):
    import json

    from bench.report._scale import load_scale, scale_section

    assert load_scale(tmp_path) is None  # no file: no section
    (tmp_path / "scale_model.json").write_text(json.dumps({"kind": "e2e"}))
    assert load_scale(tmp_path) is None  # another kind is not the scale model
    data = {
        "kind": "scale_model", "model": {"name": "7b"}, "tokens_per_gpu": 4096,
        "hardware": {"gpus_per_node": 8, "inter_node_gbps": 200.0},
        "validation_2gpu": [{"regime": "7B 4K", "predicted_ms": 580.0, "measured_ms": 520.0, "error": 0.1154}],
        "rows": [{"gpus": 64, "strategy": "hybrid", "step_ms": 532.6, "tok_s_gpu": 7691.2, "efficiency": 0.983}],
    }
    (tmp_path / "scale_model.json").write_text(json.dumps(data))
    text = "\n".join(scale_section(load_scale(tmp_path)))
    assert "the 7b decoder at 4096 tokens per GPU" in text and "200.0 Gb/s" in text
    assert "| 7B 4K | 580.0 | 520.0 | +11.5% |" in text
    assert "| 64 | hybrid | 532.6 | 7,691 | 98.3% |" in text


def test_fp8_wire_halves_the_layer_gathers_and_adds_the_amax_all_reduce() -> None:
    from bench.scale.model import BF16, FP8, small_all_reduce_time
    from examples.llama import LlamaConfig

    shape = MODELS["8b"]
    assert shape.params == LlamaConfig.named("8b").num_params() == 8_030_261_248
    assert shape.layer_linear_params == shape.layer_params - 2 * 4096 == 218_103_808
    cal, hw = _cal(), make_hardware(400, 10, 8)
    for gpus, strategy in [(8, "flat"), (64, "flat"), (512, "flat"), (512, "hybrid")]:
        bf16 = step_time(shape, gpus, 8192, 8192, strategy, hw, cal)
        fp8 = step_time(shape, gpus, 8192, 8192, strategy, hw, cal, wire="fp8")
        shard = bf16.shard
        link = hw.ring_link(shard, reduce=False)
        norms = BF16 * 2 * shape.dim
        saved_per_gather = (ring_time(BF16 * shape.layer_params, shard, link)
                            - ring_time(FP8 * shape.layer_linear_params + norms, shard, link))
        amax = small_all_reduce_time(shard, hw.ring_link(shard, reduce=True))
        expected = shape.n_layers * (2 * saved_per_gather - amax)  # seconds less communication per step
        assert (bf16.comm_ms - fp8.comm_ms) / 1e3 == pytest.approx(expected, rel=1e-9)
        assert fp8.exposed_ms == bf16.exposed_ms and fp8.compute_ms == bf16.compute_ms  # the root stays bf16
        assert fp8.step_ms <= bf16.step_ms
    assert small_all_reduce_time(512, Link(1e-5, 1e11)) == pytest.approx(2 * 9 * 1e-5)
    with pytest.raises(ValueError, match="wire must be one of bf16, fp8"):
        step_time(shape, 8, 8192, 8192, "flat", hw, cal, wire="fp4")


def test_stored_fp8_wire_prediction_is_the_models_and_the_docs_show_it(tmp_path: Path) -> None:
    """bench/results/scale_model_8b_fp8.json is what `python -m bench.scale --model 8b --wire fp8` writes here
    (deterministic), and docs/scale.md's table holds its numbers."""
    out = tmp_path / "fp8.json"
    assert cli.main(["--model", "8b", "--wire", "fp8", "--gpus", "8,64,512", "--json", str(out)]) == 0
    fresh, stored = json.loads(out.read_text()), json.loads((RESULTS / "scale_model_8b_fp8.json").read_text())
    assert (stored["kind"], stored["wire"], stored["tokens_per_gpu"], stored["seq"]) == ("scale_model", "fp8", 8192,
                                                                                          8192)
    assert len(stored["rows"]) == len(fresh["rows"]) == 6 and fresh["model"] == stored["model"]
    for a, b in zip(fresh["rows"], stored["rows"]):
        assert {k: v for k, v in a.items() if isinstance(v, str)} == {k: v for k, v in b.items() if isinstance(v, str)}
        assert all(a[k] == pytest.approx(b[k], rel=1e-9) for k in a if isinstance(a[k], float))
    by = {(r["gpus"], r["strategy"]): r for r in stored["rows"]}
    assert by[(8, "flat")]["speedup_vs_bf16_wire"] == pytest.approx(1.0)  # compute-bound on one node
    assert by[(512, "flat")]["speedup_vs_bf16_wire"] > 1.05 and by[(512, "flat")]["bound"] == "comm"
    doc = (Path(__file__).resolve().parents[2] / "docs" / "scale.md").read_text()
    section = doc[doc.index("## The fp8 all-gather on the wire"):]
    for r in stored["rows"]:
        line = (f"| {r['gpus']} | {r['strategy']} | {r['step_ms_bf16_wire']:.1f} | {r['step_ms']:.1f} | "
                f"{r['speedup_vs_bf16_wire']:.3f}x | {r['comm_ms']:.1f} | {r['compute_ms']:.1f} | {r['bound']} |")
        assert line in section, line
    assert "bench/results/scale_model_8b_fp8.json" in section and "8,030,261,248" in section


def test_cli_default_json_names_the_wire(monkeypatch: pytest.MonkeyPatch) -> None:
    assert cli.parse_args([]).json == cli.RESULTS / "scale_model.json"
    assert cli.parse_args(["--model", "8b", "--wire", "fp8"]).json == cli.RESULTS / "scale_model_8b_fp8.json"
    with pytest.raises(SystemExit):
        cli.parse_args(["--wire", "fp4"])
