"""Synthetic result files of every benchmark runner's schema, for the report and regression-check tests.

Each builder returns the JSON payload a runner writes through ``bench.common.write_result`` (environment
included); ``write_results`` lays them out as ``<root>/<gpu>/<name>.json``, as ``bench/results/`` is.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

ENV = {
    "date": "2026-11-30T12:00:00+00:00",
    "commit": "abc1234",
    "python": "3.12.3",
    "torch": "2.13.0+cu130",
    "gpu_key": "h200",
    "triton": "3.6.0",
    "gpu_name": "NVIDIA H200",
    "gpu_count": 2,
    "cuda": "13.0",
    "nccl": "2.28.9",
}


def e2e_payload(world: int = 2, shardfuse_ms: tuple[float, float] = (113.7, 52.3)) -> dict[str, Any]:
    """An ``e2e_<N>gpu.json`` as ``bench.e2e.run`` writes it (rows of every kind: measured, skipped)."""
    rows: list[dict[str, Any]] = []
    times = {"baseline": (121.8, 38.7), "shardfuse": shardfuse_ms, "fsdp2": (120.7, 70.0), "fsdp1": (121.7, 76.5)}
    for k, (regime, (batch, seq)) in enumerate({"8k": (4, 2048), "1k": (1, 1024)}.items()):
        for impl, ms in times.items():
            rows.append(
                {
                    "impl": impl,
                    "regime": regime,
                    "batch": batch,
                    "seq": seq,
                    "gpus": 1 if impl == "baseline" else world,
                    "step_ms": ms[k],
                    "step_ms_rank0": ms[k],
                    "step_ms_list_rank0": [ms[k]] * 3,
                    "tok_s_gpu": batch * seq / (ms[k] * 1e-3),
                    "loss_last": 10.37,
                    "mfu": 0.4321,
                    "peak_gib": 17.25,
                    "mem_after_wrap_gib_rank0": 2.0,
                }
            )
        rows.append({"impl": "fairscale", "regime": regime, "skipped": "not importable: No module named 'fairscale'"})
    config = {
        "model": "bench",
        "dim": 2048,
        "n_layers": 16,
        "n_heads": 16,
        "ffn_dim": 5632,
        "vocab_size": 32000,
        "max_seq_len": 2048,
        "params": 953223168,
        "world_size": world,
        "device": "cuda",
        "steps": 15,
        "warmup": 3,
        "lr": 1e-4,
        "optimizer": "AdamW (foreach default)",
        "compute_dtype": "bfloat16",
        "reduce_dtype": "float32",
        "peak_tflops": 989.0,
        "regimes": {"8k": [4, 2048], "1k": [1, 1024]},
        "nccl_nvls_enable": "0",
    }
    return {"env": dict(ENV, gpu_count=world), "config": config, "results": rows}


# Step times per round of ``e2e_rounds_payload``: medians 8K 102 / 97 / 98 / 108 / 104 ms and
# 1K 42 / 50 / 52 / 54 / 69 ms (one GPU, shardfuse, shardfuse-ref, FairScale, FSDP2).
ROUND_MS = {
    "8k": {
        "baseline": (100.0, 104.0, 102.0),
        "shardfuse": (99.0, 95.0, 97.0),
        "shardfuse-ref": (98.0, 96.0, 100.0),
        "fairscale": (110.0, 106.0, 108.0),
        "fsdp2": (103.0, 105.0, 104.0),
    },
    "1k": {
        "baseline": (40.0, 44.0, 42.0),
        "shardfuse": (50.0, 65.0, 48.0),
        "shardfuse-ref": (52.0, 51.0, 70.0),
        "fairscale": (53.0, 55.0, 54.0),
        "fsdp2": (70.0, 68.0, 69.0),
    },
}
LEAK_GIB = 1.5  # what every run leaves allocated for the next (the memory after wrapping grows by it)
# Step times per round of ``shardfuse-graph`` (``e2e_rounds_payload(captured=True)``): medians 8K 95 ms, 1K 30 ms.
CAPTURED_MS = {"8k": (96.0, 94.0, 95.0), "1k": (30.0, 31.0, 29.0)}


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``summary`` entries ``bench.e2e.run`` writes, rebuilt here (the report must not need torch)."""
    by: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        if "step_ms" in r:
            by.setdefault((r["impl"], r["regime"]), []).append(r)
    medians = {k: statistics.median(x["step_ms"] for x in v) for k, v in by.items()}
    out = []
    for (impl, regime), runs in by.items():
        ms = [x["step_ms"] for x in runs]
        entry: dict[str, Any] = {
            "impl": impl,
            "regime": regime,
            "rounds": len(ms),
            "step_ms_median": medians[(impl, regime)],
            "step_ms_min": min(ms),
            "step_ms_max": max(ms),
            "tok_s_gpu_median": statistics.median(x["tok_s_gpu"] for x in runs),
            "peak_gib_max": max(x["peak_gib"] for x in runs),
        }
        for other in ("fsdp2", "fairscale", "shardfuse", "shardfuse-ref", "baseline"):
            if (other, regime) in medians and other != impl:
                entry[f"vs_{other}"] = medians[(other, regime)] / medians[(impl, regime)]
        out.append(entry)
    return out


def e2e_rounds_payload(
    world: int = 2, with_summary: bool = True, captured: bool = False, graph_pool_gib: float | None = None
) -> dict[str, Any]:
    """An ``e2e_<N>gpu.json`` of ``bench.e2e.run --rounds 3``: rows with a ``round`` key, run interleaved (round,
    regime, implementation), FSDP1 skipped, and the ``summary`` of medians (left out: a file written mid-run).
    ``captured``: ``shardfuse-graph`` (``CAPTURED_MS``) runs right after shardfuse, its rows with
    ``graph_pool_gib_rank0`` when ``graph_pool_gib`` is given."""
    payload = e2e_payload(world)
    payload["config"].update(steps=8, shardfuse_ref_commit="b3aa59b")
    rows: list[dict[str, Any]] = [
        {"impl": "fsdp1", "regime": regime, "skipped": "not requested in this test"} for regime in ROUND_MS
    ]
    leaked = 0.0
    for rnd in range(3):
        for regime, (batch, seq) in (("8k", (4, 2048)), ("1k", (1, 1024))):
            impls: dict[str, tuple[float, ...]] = {}
            for impl, times in ROUND_MS[regime].items():
                impls[impl] = times
                if captured and impl == "shardfuse":  # right after it, as bench.e2e.run's IMPLS order them
                    impls["shardfuse-graph"] = CAPTURED_MS[regime]
            for impl, times in impls.items():
                ms = times[rnd]
                own = 4.0 if impl == "baseline" else 2.0  # the wrapped model's memory
                rows.append(
                    {
                        "impl": impl,
                        "regime": regime,
                        "batch": batch,
                        "seq": seq,
                        "gpus": 1 if impl == "baseline" else world,
                        "step_ms": ms,
                        "step_ms_rank0": ms,
                        "step_ms_list_rank0": [ms * 0.9, ms, ms * 1.1],
                        "tok_s_gpu": batch * seq / (ms * 1e-3),
                        "loss_last": 10.37,
                        "mfu": 0.3,
                        "peak_gib": leaked + own + 10.0,
                        "mem_after_wrap_gib_rank0": leaked + own,
                        "round": rnd,
                    }
                )
                if impl == "shardfuse-graph" and graph_pool_gib is not None:
                    rows[-1]["graph_pool_gib_rank0"] = graph_pool_gib + rnd  # medians: graph_pool_gib + 1
                leaked += LEAK_GIB
    payload["results"] = rows
    if with_summary:
        payload["summary"] = summarize(rows)
    return payload


# ``e2e_hf_payload``: step times per round, 1K tokens (batch 1 x seq 1024) per GPU; medians one GPU 41,
# shardfuse 51, shardfuse-graph 26, FairScale 61, FSDP2 56 ms.
HF_ROUND_MS = {
    "baseline": (40.0, 42.0, 41.0),
    "shardfuse": (50.0, 52.0, 51.0),
    "shardfuse-graph": (25.0, 27.0, 26.0),
    "fairscale": (60.0, 62.0, 61.0),
    "fsdp2": (55.0, 57.0, 56.0),
}
HF_PARAMS = 852559872  # bench.e2e.run --model hf-llama --config bench
# ``e2e_7b_payload``: one round at 4K tokens (batch 1 x seq 4096) per GPU, no one-GPU baseline, FairScale skipped.
SEVEN_B_MS = {"shardfuse": 400.0, "shardfuse-graph": 390.0, "fsdp2": 440.0}
SEVEN_B_PARAMS = 6738415616  # examples.llama.LlamaConfig.llama_7b()


def _model_rows(
    times: dict[str, tuple[float, ...]], regime: str, batch: int, seq: int, world: int
) -> list[dict[str, Any]]:
    """Rows of ``bench.e2e.run --rounds len(times)`` in one regime, interleaved (round, implementation)."""
    rows = []
    for rnd in range(len(next(iter(times.values())))):
        for impl, ms in times.items():
            rows.append(
                {
                    "impl": impl,
                    "regime": regime,
                    "batch": batch,
                    "seq": seq,
                    "gpus": 1 if impl == "baseline" else world,
                    "step_ms": ms[rnd],
                    "step_ms_rank0": ms[rnd],
                    "step_ms_list_rank0": [ms[rnd] * 0.98, ms[rnd], ms[rnd] * 1.02],
                    "tok_s_gpu": batch * seq / (ms[rnd] * 1e-3),
                    "loss_last": 10.4,
                    "mfu": 0.25,
                    "peak_gib": 30.0,
                    "mem_after_wrap_gib_rank0": 8.0,
                    "round": rnd,
                }
            )
            if impl == "shardfuse-graph":
                rows[-1]["graph_pool_gib_rank0"] = 1.5
    return rows


def _model_config(world: int, regime: str, shape: tuple[int, int], **model: Any) -> dict[str, Any]:
    return {
        **model,
        "world_size": world,
        "device": "cuda",
        "steps": 15,
        "warmup": 3,
        "lr": 1e-4,
        "optimizer": "AdamW (foreach default)",
        "compute_dtype": "bfloat16",
        "reduce_dtype": "float32",
        "peak_tflops": 989.0,
        "regimes": {regime: list(shape)},
        "nccl_nvls_enable": "0",
    }


def e2e_hf_payload(world: int = 2) -> dict[str, Any]:
    """An ``e2e_hf_<N>gpu.json`` of ``bench.e2e.run --model hf-llama --regime 1k --rounds 3`` (``HF_ROUND_MS``),
    its ``config`` as the runner's ModelSpec writes it (the decoder's keys, then transformers' own)."""
    hf_config = {
        "vocab_size": 32000,
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 16,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-6,
        "attn_implementation": "sdpa",
        "use_cache": False,
    }
    config = _model_config(
        world,
        "1k",
        (1, 1024),
        model="bench",
        model_kind="hf-llama",
        dim=2048,
        n_layers=16,
        n_heads=16,
        n_kv_heads=4,
        ffn_dim=5632,
        vocab_size=32000,
        max_seq_len=4096,
        hf_class="transformers.LlamaForCausalLM",
        transformers="4.57.1",
        hf_config=hf_config,
        params=HF_PARAMS,
    )
    rows = _model_rows(HF_ROUND_MS, "1k", 1, 1024, world)
    return {"env": dict(ENV, gpu_count=world), "config": config, "results": rows, "summary": summarize(rows)}


def e2e_7b_payload(world: int = 2) -> dict[str, Any]:
    """An ``e2e_7b_<N>gpu.json`` of ``bench.e2e.run --config 7b --regime 4k --no-baseline`` (one round,
    ``SEVEN_B_MS``; FairScale not importable)."""
    config = _model_config(
        world,
        "4k",
        (1, 4096),
        model="7b",
        model_kind="decoder",
        dim=4096,
        n_layers=32,
        n_heads=32,
        ffn_dim=11008,
        vocab_size=32000,
        max_seq_len=4096,
        norm_eps=1e-5,
        rope_theta=10000.0,
        params=SEVEN_B_PARAMS,
    )
    rows: list[dict[str, Any]] = [
        {"impl": "fairscale", "regime": "4k", "skipped": "not importable: No module named 'fairscale'"}
    ]
    measured = _model_rows({k: (v,) for k, v in SEVEN_B_MS.items()}, "4k", 1, 4096, world)
    rows += measured
    return {"env": dict(ENV, gpu_count=world), "config": config, "results": rows, "summary": summarize(measured)}


def kernels_payload(scale: float = 1.0) -> dict[str, Any]:
    """A ``kernels.json`` as ``bench.kernels.run`` writes it."""
    rows = []
    for n in (1 << 20, 1 << 26):
        for family, name, speedups in (
            ("shard_cast", f"fp32->bf16 flat shard n={n}", {"copy_": 1.01, "fsdp2_foreach_copy_x2": 1.87}),
            ("post_divide", f"fp32->fp32 += n={n}", {"div.to+add_": 2.46}),
        ):
            nbytes = 6 * n
            ms = nbytes / 3911e9 * 1e3 * scale
            gbps = nbytes / (ms * 1e-3) / 1e9
            rows.append(
                {
                    "family": family,
                    "name": name,
                    "numel": n,
                    "num_tensors": 1,
                    "bytes": nbytes,
                    "shardfuse_ms": ms,
                    "shardfuse_gbps": gbps,
                    "pct_copy_bw": 100 * gbps / 4213.0,
                    "baselines": {k: {"ms": ms * v, "speedup": v} for k, v in speedups.items()},
                }
            )
    return {"env": ENV, "copy_bandwidth_gbps": 4213.0, "sizes": [1 << 20, 1 << 26], "rows": rows}


def offload_payload(shardfuse_ms: float = 587.4) -> dict[str, Any]:
    """An ``offload.json`` as ``bench.offload.run`` writes it."""
    variants: dict[str, dict[str, Any]] = {
        "plain": {"step_ms": 508.1, "peak_gib": 8.94, "losses": [1.0], "h2d_gbps": 0.0, "d2h_gbps": 0.0},
        "shardfuse": {
            "step_ms": shardfuse_ms,
            "peak_gib": 3.17,
            "losses": [1.0],
            "h2d_gb_per_step": 8.6,
            "d2h_gb_per_step": 4.3,
            "h2d_gbps": 14.64,
            "d2h_gbps": 7.32,
        },
        "shardfuse_bf16": {"error": "RuntimeError: something broke"},
        "fairscale": {"skipped": "not importable: No module named 'fairscale'"},
        "fsdp2_cpu_offload": {
            "step_ms": 771.9,
            "peak_gib": 7.57,
            "losses": [1.0],
            "h2d_gbps": 11.13,
            "d2h_gbps": 5.56,
            "traffic": "estimated",
        },
    }
    for v in variants.values():
        v["wall_s"] = 1.0
        if "step_ms" in v:
            v["vs_plain"] = v["step_ms"] / 508.1
    config = {
        "width": 8192,
        "layers": 16,
        "batch": 4096,
        "slices": 4,
        "microbatches": 4,
        "lr": 1e-3,
        "warmup": 3,
        "steps": 5,
        "params_m": 1073.9,
        "model_gib": 4.0,
    }
    capped = {
        "model": "64 x Linear(4096, 4096) + ReLU",
        "params_m": 1074.0,
        "model_gib": 4.0,
        "budget_gib": 0.89,
        "model_over_budget": 4.5,
        "plain_weights_fit": False,
        "num_slices": 64,
        "batch": 4096,
        "step_ms": 912.6,
        "samples_per_s": 4488.0,
        "peak_gib": 0.85,
        "losses": [1.0],
    }
    return {"env": dict(ENV, gpu_count=1), "config": config, "variants": variants, "capped": capped}


def write_results(root: Path, gpu: str = "h200", **payloads: dict[str, Any]) -> Path:
    d = root / gpu
    d.mkdir(parents=True, exist_ok=True)
    for name, payload in payloads.items():
        (d / f"{name}.json").write_text(json.dumps(payload))
    return d


def make_results_dir(root: Path) -> Path:
    """A results folder with every kind of file on two GPUs, plus one unreadable file."""
    write_results(root, "h200", e2e_2gpu=e2e_payload(2), kernels=kernels_payload(), offload=offload_payload())
    write_results(root, "h100", e2e_4gpu=e2e_payload(4, (118.4, 47.9)))
    (root / "h100" / "broken.json").write_text("{ not json")
    return root
