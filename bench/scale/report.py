"""Text, JSON record and plot of :mod:`bench.scale`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.scale.calibrate import Measured, validation_points
from bench.scale.model import MODELS, Calibration, Hardware, ModelShape, one_gpu_step_ms, step_time

__all__ = ["assumptions", "validate", "validation_text", "build_record", "table_text", "wire_table_text", "plot"]

TARGET_ERROR = 0.15


def assumptions(
    shape: ModelShape, tokens: int, seq: int, hw: Hardware, cal: Calibration, m: Measured, inter_gbps: float,
    wire: str = "bf16",
) -> list[str]:
    """Every assumption of the model, one line each."""
    ag2, ag4 = hw.intra(2, False), hw.intra(4, False)
    rs2, rs4 = hw.intra(2, True), hw.intra(4, True)
    gqa = f", {shape.n_kv_heads} kv heads (GQA)" if shape.n_kv_heads else ""
    return [
        "Assumptions (bench.scale):",
        f"  model {shape.name}: dim {shape.dim}, {shape.n_layers} layers, ffn {shape.ffn_dim}, vocab "
        f"{shape.vocab_size}{gqa}: {shape.params:,} params; FSDP units = {shape.n_layers} layers + root",
        f"  {tokens} tokens/GPU at sequence {seq}; weak scaling (tokens/GPU fixed as GPUs grow)",
        "  ring collectives: AG/RS t = (k-1) alpha + (k-1)/k B/bw; all-reduce twice that; B = full buffer",
        "  bytes per unit: bf16 params all-gathered in forward and again in backward (reshard_after_forward), "
        "fp32 grads reduce-scattered; hybrid adds an inter-node all-reduce of the fp32 1/shard gradient shard",
        f"  NVLink fit (ANCHORS.md bus bw, H200 NV18): AG k=2 alpha {ag2.alpha_s * 1e6:.1f} us bw "
        f"{ag2.bw_bps / 1e9:.0f} GB/s, k=4 alpha {ag4.alpha_s * 1e6:.1f} us bw {ag4.bw_bps / 1e9:.0f} GB/s; "
        f"RS k=2 {rs2.bw_bps / 1e9:.0f} GB/s, k=4 {rs4.bw_bps / 1e9:.0f} GB/s",
        "  rings of 8 GPUs in a node: the 4-GPU fit (not measured at 8; bus bw grows with k, so conservative)",
        f"  inter-node: {inter_gbps:g} Gb/s per GPU = {hw.inter.bw_bps / 1e9:.1f} GB/s, alpha "
        f"{hw.inter.alpha_s * 1e6:.1f} us per ring step (inputs, not measured here); {hw.gpus_per_node} GPUs/node",
        "  flat sharding over > 1 node: one ring over all GPUs at the inter-node bw and alpha (slowest hop)",
        "  hybrid: shard within a node, replicate across nodes; inter-node all-reduce on a side stream, its time "
        "added to the overlappable communication (no credit for NVLink and network running concurrently)",
        f"  compute: {cal.achieved_flops / 1e12:.0f} TFLOP/s achieved = FLOPs of the 953M one-GPU 8K step "
        f"({m.one_gpu_8k_ms:.1f} ms, minus its AdamW) [{m.sources['one_gpu_8k_ms']}]; FLOPs/token = 6 x matmul "
        "params + 12 L d s",
        f"  AdamW (foreach): {cal.optimizer_s_per_param * 1e12:.1f} ps/param held, from {m.optimizer_ms_2gpu} ms "
        f"at 2 GPUs [{m.sources['optimizer_ms_2gpu']}]; runs after backward, not overlapped",
        f"  host: {cal.host_s_per_unit * 1e3:.2f} ms per FSDP unit per step = {m.host_enqueue_ms} ms / 17 units "
        f"[{m.sources['host_enqueue_ms']}]; the host runs ahead, so step = max(GPU path, host path)",
        "  overlap: GPU path = max(compute, overlappable comm) + exposed comm + AdamW; exposed = the root unit's "
        "first all-gather and last reduce-scatter (+ its inter-node all-reduce)",
        "  efficiency = (compute + AdamW of this GPU's shard) / step: the step with free communication and host over "
        "the step; vs_one_gpu (JSON) = unsharded one-GPU GPU time / step, > 100% when AdamW shards",
        "  not modelled: activation memory, NCCL tree/PAT algorithms, SM contention of comm kernels, stragglers",
        *([] if wire == "bf16" else [
            f"  wire fp8: each layer's {shape.layer_linear_params:,} linear weights all-gathered in fp8 (1 B/param, "
            f"its norms in bf16), twice per step as in bf16; plus one all-reduce of the weights' amax per layer over "
            "the shard group, latency only (2 ceil(log2 k) alpha, a tree), overlapped like the gathers; the root "
            "unit stays bf16, gradients fp32; compute unchanged (the float8 matmuls' own speed-up is not modelled: "
            "this is the wire's effect alone)"]),
    ]


def validate(results: Path, hw: Hardware, cal: Calibration) -> list[dict[str, Any]]:
    """The model's 2-GPU prediction next to every stored 2-GPU measurement."""
    rows: list[dict[str, Any]] = []
    for v in validation_points(results):
        s = step_time(MODELS[v.model], 2, v.tokens, v.seq, "flat", hw, cal)
        err = s.step_ms / v.measured_ms - 1.0
        rows.append({"regime": v.label, "model": v.model, "tokens_per_gpu": v.tokens, "seq": v.seq,
                     "predicted_ms": s.step_ms, "measured_ms": v.measured_ms, "error": err, "bound": s.bound,
                     "within_target": abs(err) <= TARGET_ERROR, "source": v.source})
    return rows


def validation_text(rows: list[dict[str, Any]]) -> str:
    lines = ["2-GPU validation (H200, shardfuse eager, foreach AdamW; target |error| <= 15%):",
             f"  {'regime':<18}{'predicted ms':>14}{'measured ms':>13}{'error':>9}  bound"]
    for r in rows:
        lines.append(f"  {r['regime']:<18}{r['predicted_ms']:>14.1f}{r['measured_ms']:>13.1f}"
                     f"{100 * r['error']:>+8.1f}%  {r['bound']}{'' if r['within_target'] else '  MISS'}")
    if not rows:
        lines.append("  (no stored 2-GPU measurements found)")
    return "\n".join(lines)


def build_record(
    shape: ModelShape, tokens: int, seq: int, gpus: list[int], hw: Hardware, cal: Calibration, m: Measured,
    validation: list[dict[str, Any]], inter_gbps: float, wire: str = "bf16",
) -> dict[str, Any]:
    """The ``scale_model`` JSON record; with ``wire`` "fp8" each row also has the bf16 wire's step and the ratio."""
    one = one_gpu_step_ms(shape, tokens, seq, cal)
    rows: list[dict[str, Any]] = []
    for n in gpus:
        for strategy in ("flat", "hybrid"):
            s = step_time(shape, n, tokens, seq, strategy, hw, cal, wire)
            rows.append({"gpus": n, "strategy": strategy, "shard": s.shard, "replicas": s.replicas,
                         "step_ms": s.step_ms, "tok_s_gpu": tokens / s.step_ms * 1e3,
                         "efficiency": (s.compute_ms + s.optimizer_ms) / s.step_ms, "vs_one_gpu": one / s.step_ms,
                         "compute_ms": s.compute_ms, "optimizer_ms": s.optimizer_ms, "comm_ms": s.comm_ms,
                         "exposed_ms": s.exposed_ms, "host_ms": s.host_ms, "bound": s.bound,
                         "state_gib_per_gpu": s.state_gib, "wire": wire})
            if wire != "bf16":
                bf16 = step_time(shape, n, tokens, seq, strategy, hw, cal).step_ms
                rows[-1].update(step_ms_bf16_wire=bf16, speedup_vs_bf16_wire=bf16 / s.step_ms)
    return {
        "kind": "scale_model", "wire": wire,
        "model": {"name": shape.name, "params": shape.params, "dim": shape.dim, "n_layers": shape.n_layers,
                  "ffn_dim": shape.ffn_dim, "vocab_size": shape.vocab_size, "n_kv_heads": shape.n_kv_heads},
        "tokens_per_gpu": tokens, "seq": seq, "one_gpu_ms": one,
        "hardware": {"gpus_per_node": hw.gpus_per_node, "inter_node_gbps": inter_gbps,
                     "inter_node_alpha_us": hw.inter.alpha_s * 1e6,
                     "nvlink_ag": {str(k): [v.alpha_s * 1e6, v.bw_bps / 1e9] for k, v in hw.ag_intra.items()},
                     "nvlink_rs": {str(k): [v.alpha_s * 1e6, v.bw_bps / 1e9] for k, v in hw.rs_intra.items()}},
        "calibration": {"achieved_tflops": cal.achieved_flops / 1e12,
                        "optimizer_ps_per_param": cal.optimizer_s_per_param * 1e12,
                        "host_ms_per_unit": cal.host_s_per_unit * 1e3, "sources": m.sources},
        "validation_2gpu": validation,
        "rows": rows,
    }


def table_text(record: dict[str, Any]) -> str:
    m = record["model"]
    if record.get("wire", "bf16") != "bf16":
        return wire_table_text(record)
    lines = [f"{m['name']} ({m['params'] / 1e9:.2f}B params), {record['tokens_per_gpu']} tokens/GPU, "
             f"{record['hardware']['inter_node_gbps']:g} Gb/s per GPU between nodes; eff = step without "
             "communication or host / step",
             f"{'GPUs':>6} | {'flat ms':>9} {'tok/s/GPU':>10} {'eff':>6} {'bound':>8} | "
             f"{'hybrid ms':>9} {'tok/s/GPU':>10} {'eff':>6} {'bound':>8} | {'state GiB/GPU flat/hyb':>22}"]
    by = {(r["gpus"], r["strategy"]): r for r in record["rows"]}
    for n in sorted({r["gpus"] for r in record["rows"]}):
        f, h = by[(n, "flat")], by[(n, "hybrid")]
        lines.append(
            f"{n:>6} | {f['step_ms']:>9.1f} {f['tok_s_gpu']:>10,.0f} {100 * f['efficiency']:>5.1f}% {f['bound']:>8} | "
            f"{h['step_ms']:>9.1f} {h['tok_s_gpu']:>10,.0f} {100 * h['efficiency']:>5.1f}% {h['bound']:>8} | "
            f"{f['state_gib_per_gpu']:>10.1f} / {h['state_gib_per_gpu']:<9.1f}")
    return "\n".join(lines)


def wire_table_text(record: dict[str, Any]) -> str:
    """The fp8 wire against the bf16 one, per GPU count and strategy."""
    m, wire = record["model"], record["wire"]
    lines = [f"{m['name']} ({m['params'] / 1e9:.2f}B params), {record['tokens_per_gpu']} tokens/GPU, "
             f"{record['hardware']['inter_node_gbps']:g} Gb/s per GPU between nodes: layer weights all-gathered in "
             f"{wire} vs bf16",
             f"{'GPUs':>6} {'strategy':>8} | {'bf16 ms':>9} {wire + ' ms':>9} {'speed-up':>9} | {'comm ms':>9} "
             f"{'compute ms':>10} {'bound':>8}"]
    for r in sorted(record["rows"], key=lambda r: (r["gpus"], r["strategy"])):
        lines.append(f"{r['gpus']:>6} {r['strategy']:>8} | {r['step_ms_bf16_wire']:>9.1f} {r['step_ms']:>9.1f} "
                     f"{r['speedup_vs_bf16_wire']:>8.3f}x | {r['comm_ms']:>9.1f} {r['compute_ms']:>10.1f} "
                     f"{r['bound']:>8}")
    return "\n".join(lines)


def plot(record: dict[str, Any], path: Path) -> None:
    """Efficiency vs GPUs, flat and hybrid (log2 x axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for strategy, style in (("flat", "o-"), ("hybrid", "s-")):
        rows = sorted((r for r in record["rows"] if r["strategy"] == strategy), key=lambda r: r["gpus"])
        ax.plot([r["gpus"] for r in rows], [100 * r["efficiency"] for r in rows], style, label=strategy)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("GPUs")
    ax.set_ylabel("efficiency: step w/o comm / step (%)")
    m = record["model"]
    ax.set_title(f"{m['name']}, {record['tokens_per_gpu']} tok/GPU, "
                 f"{record['hardware']['inter_node_gbps']:g} Gb/s/GPU inter-node (model)")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
