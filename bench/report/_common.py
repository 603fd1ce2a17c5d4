"""Names, display orders and markdown formatting shared by the sections of the report."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from bench.results_io import Env, Result

# Display order and names of the end-to-end implementations (bench/e2e/run.py's --impls plus its baseline).
IMPL_ORDER = ("baseline", "baseline-graph", "shardfuse", "shardfuse-graph", "shardfuse-ref", "fsdp2", "fsdp2-compile",
              "fsdp1", "fairscale")
IMPL_LABEL = {
    "baseline": "one GPU, no sharding (autocast)",
    "baseline-graph": "one GPU, no sharding (autocast), step captured by `capture_step`",
    "shardfuse": "shardfuse `FullyShardedDataParallel`",
    "shardfuse-graph": "shardfuse, step captured by `capture_step` (CUDA graph)",
    "shardfuse-ref": "shardfuse at an older commit (reference)",  # with the commit: see impl_label()
    "fsdp2": "FSDP2 `fully_shard`",
    "fsdp2-compile": "FSDP2 `fully_shard` + per-layer `torch.compile`",
    "fsdp1": "FSDP1",
    "fairscale": "FairScale FSDP",
}
IMPL_SHORT = {
    "baseline": "one GPU",
    "baseline-graph": "one GPU captured",
    "shardfuse": "shardfuse",
    "shardfuse-graph": "shardfuse (captured)",
    "fsdp2": "FSDP2",
    "fsdp2-compile": "FSDP2 + compile",
    "fsdp1": "FSDP1",
    "fairscale": "FairScale",
}
# bench.e2e._variants' modifiers (``fsdp2+fp8+ac``): what each adds to the base's name.
MODIFIER_LABEL = {
    "fp8": "torchao float8 (tensorwise)",
    "fp8row": "torchao float8 (rowwise)",
    "ac": "activation checkpointing",
    "acop": "op-level selective activation checkpointing (attention and every other matrix product kept)",
    "compile": "per-layer `torch.compile`",
    "split": "embedding and output head as units of their own",
    "fused": "fused gradient pre-divide (`SHARDFUSE_FUSED_GRADS=1`)",
    "unfused": "concatenated gradients (`SHARDFUSE_FUSED_GRADS=0`)",
    "rspg": "reduce-scatters on a separate group of the same ranks",
    "once": "one round",
    # which layers: the first N before 4da66db, spread from it on (the result's notes say which)
    "aoff": "activation offload of {n} layers (`offload_activations`)",
    "acK": "activation checkpointing of one layer in {n}",
    "keep": "the last {n} layers kept gathered for backward",
}
MODIFIER_SHORT = {"fp8": "float8", "fp8row": "float8 rowwise", "ac": "AC", "acop": "op-level AC", "compile": "compile",
                  "split": "split",
                  "fused": "fused grads", "unfused": "unfused grads", "rspg": "RS group", "once": "once",
                  "aoff": "{n} layers' activations offloaded", "acK": "AC of 1 layer in {n}",
                  "keep": "{n} layers kept gathered"}


def modifier_text(mod: str, names: dict[str, str]) -> str | None:
    """What ``mod`` adds to a name, from ``names`` (``MODIFIER_LABEL`` or ``MODIFIER_SHORT``); ``aoffN`` (activation
    offload of N layers), ``acK`` (checkpointing of one layer in K) and ``keepN`` (the last N layers kept gathered)
    fill in their count; None for a modifier ``names`` does not know."""
    if mod.startswith("aoff") and mod[4:].isdigit():
        return names["aoff"].format(n=int(mod[4:]))
    if re.fullmatch(r"ac\d+", mod):  # +acK: checkpointing of one layer in K
        return names["acK"].format(n=int(mod[2:]))
    if re.fullmatch(r"keep\d+", mod):  # +keepN: the last N layers not resharded after forward
        return names["keep"].format(n=int(mod[4:]))
    return names.get(mod) if mod not in ("aoff", "acK", "keep") else None
CAPTURED = "shardfuse-graph"  # shardfuse's whole step captured by ``capture_step`` into a CUDA graph, replayed
REGIME_ORDER = ("8k", "4k", "1k", "sft")
REGIME_LABEL = {
    "8k": "8K tokens per GPU (compute-bound)",
    "4k": "4K tokens per GPU",  # batch 1 x seq 4096: the 7B-class decoder's regime
    "1k": "1K tokens per GPU (communication-bound)",
    # bench.e2e.sft: examples/sft_buckets.py's loop, variable lengths padded to 4 buckets
    "sft": "many-shape SFT (variable lengths padded to 4 buckets; tokens/s/GPU count the real, unpadded tokens)",
}

# Offload variants of bench/offload/run.py.
OFFLOAD_ORDER = (
    "plain",
    "plain_bf16_autocast",
    "shardfuse",
    "shardfuse_bf16",
    "shardfuse_opt_in_bwd",
    "shardfuse_bf16_opt_in_bwd",
    "shardfuse_keep_acts_opt_in_bwd",
    "shardfuse_offload_acts",
    "shardfuse_offload_acts_opt_in_bwd",
    "shardfuse_offload_acts_opt_in_bwd_4sl",
    "fairscale",
    "fsdp2_cpu_offload",
)
OFFLOAD_LABEL = {
    "plain": "plain GPU, everything resident",
    "plain_bf16_autocast": "plain GPU, bf16 autocast",
    "shardfuse": "shardfuse `OffloadModel`",
    "shardfuse_bf16": "shardfuse `OffloadModel`, `compute_dtype=bf16`",
    "shardfuse_opt_in_bwd": "shardfuse `OffloadModel`, `optimizer_in_backward`",
    "shardfuse_bf16_opt_in_bwd": "shardfuse `OffloadModel`, bf16 + `optimizer_in_backward`",
    "shardfuse_keep_acts_opt_in_bwd": "shardfuse `OffloadModel`, no checkpointing + `optimizer_in_backward`",
    "shardfuse_offload_acts": "shardfuse `OffloadModel`, `offload_activations` (8 slices)",
    "shardfuse_offload_acts_opt_in_bwd": "shardfuse `OffloadModel`, `offload_activations` + `optimizer_in_backward` "
    "(8 slices)",
    "shardfuse_offload_acts_opt_in_bwd_4sl": "shardfuse `OffloadModel`, `offload_activations` + "
    "`optimizer_in_backward` (4 slices)",
    "fairscale": "FairScale `OffloadModel`",
    "fsdp2_cpu_offload": "FSDP2 `fully_shard` + `CPUOffloadPolicy`",
}
# Implementations of bench/offload/big.py (rows of offload_big.json), and the short names of the README's text.
OFFLOAD_BIG_ORDER = (
    "resident",
    "shardfuse",
    "shardfuse-budget",
    "shardfuse-ssd",
    "torchao",
    "fairscale",
    "fsdp2",
    "deepspeed-zero2",
    "deepspeed-zero3",
)
OFFLOAD_BIG_LABEL = {
    "resident": "resident (all on the GPU, bf16 autocast, fused AdamW)",
    "shardfuse": "shardfuse `move_params_to_cpu`, `OffloadOptimizer`, full offload",
    "shardfuse-budget": "shardfuse `move_params_to_cpu`, `OffloadOptimizer`, GPU budget",  # + the budget
    "shardfuse-ssd": "shardfuse, optimizer state on SSD",
    "torchao": "torchao `CPUOffloadOptimizer` (fp32 model on the GPU, fused CPU AdamW, no clipping)",
    "fairscale": "FairScale FSDP `move_params_to_cpu`, fused CPU AdamW",
    "fsdp2": "FSDP2 `CPUOffloadPolicy(pin_memory=True)`, fused CPU AdamW",
    "deepspeed-zero2": "DeepSpeed ZeRO-2, optimizer offloaded (its CPUAdam)",
    "deepspeed-zero3": "DeepSpeed ZeRO-3, parameters + optimizer offloaded",
}
OFFLOAD_BIG_SHORT = {
    "resident": "one GPU",
    "shardfuse": "shardfuse",
    "shardfuse-budget": "shardfuse-budget",
    "torchao": "torchao",
    "fairscale": "FairScale",
    "fsdp2": "FSDP2",
    "deepspeed-zero2": "DeepSpeed ZeRO-2",
    "deepspeed-zero3": "DeepSpeed ZeRO-3",
}
KERNEL_BIG_BYTES = 64e6  # the "large buffer" threshold of the kernel summaries (bench/kernels/run.py uses it)
DASH = "-"


def fmt(v: float | None, spec: str, suffix: str = "") -> str:
    """``format(v, spec) + suffix``, or a dash for missing values."""
    return DASH if v is None else f"{format(v, spec)}{suffix}"


def fmt_bytes(x: float | None) -> str:
    """Decimal units, as GB/s is: 1 MB = 1e6 bytes."""
    if x is None:
        return DASH
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if x >= scale:
            return f"{x / scale:.1f} {unit}"
    return f"{x:.0f} B"


def cell(text: Any) -> str:
    """A markdown table cell: pipes escaped, newlines flattened."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def table(header: Sequence[str], rows: Iterable[Sequence[Any]], align: Sequence[str] | None = None) -> list[str]:
    """A markdown table; ``align`` holds "l" or "r" per column (default: first left, the rest right)."""
    align = align or ["l"] + ["r"] * (len(header) - 1)
    lines = [
        "| " + " | ".join(cell(h) for h in header) + " |",
        "|" + "|".join("---" if a == "l" else "---:" for a in align) + "|",
    ]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return lines


def notes_block(notes: Sequence[str]) -> list[str]:
    """Notes under a table as a bullet list (nothing when there are none)."""
    return [f"- {n}" for n in notes] + ([""] if notes else [])


def gpu_label(gpu: str, results: Sequence[Result]) -> str:
    """A heading for one GPU folder: the device name recorded in the results, else the folder name."""
    names = sorted({r.env.gpu_name for r in results if r.env.gpu_name})
    return f"{gpu.upper()} ({', '.join(names)})" if names else gpu.upper()


def env_line(env: Env) -> str:
    """One line with the environment a result was measured in."""
    if not env.recorded:
        return "_Environment: not recorded._"
    parts = []
    if env.gpu_name:
        parts.append(f"GPU {env.gpu_name}" + (f" x{env.gpu_count}" if env.gpu_count else ""))
    elif env.gpu_key:
        parts.append(f"GPU key {env.gpu_key}")
    if env.host_cpus:
        parts.append(f"host {env.host_cpus} CPUs" + (f" ({env.cpu_model})" if env.cpu_model else ""))
    for key, label in (
        ("torch", "torch"),
        ("triton", "triton"),
        ("cuda", "CUDA"),
        ("nccl", "NCCL"),
        ("python", "Python"),
    ):
        if env.get(key):
            parts.append(f"{label} {env.get(key)}")
    if env.date:
        parts.append(f"date {env.date}")
    if env.commit:
        parts.append(f"commit `{env.commit}`")
    return "_Environment: " + "; ".join(parts) + "._"


def rel(target: Path, start_dir: Path) -> str:
    return Path(os.path.relpath(target.resolve(), start_dir.resolve())).as_posix()


def ordered(keys: Iterable[str], preferred: Sequence[str]) -> list[str]:
    keys = list(dict.fromkeys(keys))
    return [k for k in preferred if k in keys] + sorted(k for k in keys if k not in preferred)


def variant(name: str | None) -> str:
    """A kernel case name without its size (``"fp32->bf16 flat shard n=1048576"`` -> ``"fp32->bf16 flat shard"``)."""
    return re.sub(r"\s*\bn=\d+", "", str(name or "")).strip()


def span(lo: float, hi: float, spec: str, suffix: str) -> str:
    a, b = format(lo, spec), format(hi, spec)
    return f"{a}{suffix}" if a == b else f"{a}-{b}{suffix}"


def pct(hi: float, lo: float) -> float:
    return 100.0 * (hi / lo - 1.0)


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")
