"""Alpha-beta model of one FSDP training step, flat or hybrid sharded, on ``n`` GPUs.

Everything here is plain arithmetic (no torch), so the tests run in milliseconds.

Collectives are NCCL rings. For ``k`` ranks, a buffer of ``B`` bytes (the full, unsharded size) and a link with
per-step latency ``alpha`` and bus bandwidth ``bw``:

* all-gather / reduce-scatter: ``t = (k - 1) * alpha + (k - 1) / k * B / bw``
* all-reduce (reduce-scatter + all-gather): ``t = 2 (k - 1) * alpha + 2 (k - 1) / k * B / bw``

A ring that crosses nodes runs every step at the pace of its slowest hop: ``alpha`` and ``bw`` are the inter-node
ones (the per-GPU NIC bandwidth, each GPU with its own NIC).

One step (see :func:`step_time`)::

    gpu  = max(compute_fwd_bwd, overlappable_comm) + exposed_comm + optimizer(P / shard)
    host = host_ms_per_unit * units
    step = max(gpu, host)

``exposed_comm`` is the root unit's all-gather at the start of forward (nothing to hide it behind) and its
reduce-scatter (and, hybrid, its inter-node all-reduce) at the end of backward; every other collective overlaps
compute. ``wire="fp8"`` sends the decoder layers' linear weights as float8 (1 byte per parameter instead of bf16's 2)
in both all-gathers and adds one small all-reduce per layer (the weights' amax, for their scales) to the overlapped
communication; the root unit (embedding, output projection, final norm) stays bf16. The host term is the
Python/launch time to enqueue one step; the host runs ahead of the GPU, so the step is whichever of the two is
longer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "Link",
    "ModelShape",
    "Hardware",
    "Calibration",
    "StepBreakdown",
    "MODELS",
    "ring_time",
    "step_time",
    "one_gpu_step_ms",
    "WIRES",
    "small_all_reduce_time",
]

BF16 = 2
FP32 = 4
FP8 = 1
ADAM_STATE_BYTES = 16  # fp32 parameter + fp32 gradient + two fp32 AdamW moments, per parameter
WIRES = ("bf16", "fp8")  # the dtype the layers' weights are all-gathered in


@dataclass(frozen=True)
class ModelShape:
    """A Llama-style decoder: FSDP units are the decoder layers plus the root (embedding, final norm, output)."""

    name: str
    dim: int
    n_layers: int
    n_heads: int
    ffn_dim: int
    vocab_size: int
    n_kv_heads: int | None = None  # None: multi-head attention (k, v as wide as q)

    @property
    def kv_dim(self) -> int:
        kv = self.n_kv_heads or self.n_heads
        return self.dim * kv // self.n_heads

    @property
    def layer_params(self) -> int:
        d = self.dim
        return 2 * d * d + 2 * d * self.kv_dim + 3 * d * self.ffn_dim + 2 * d

    @property
    def layer_linear_params(self) -> int:
        """A layer's matrix weights (all but its two norms): the ones float8 training gathers in fp8."""
        return self.layer_params - 2 * self.dim

    @property
    def root_params(self) -> int:
        return 2 * self.vocab_size * self.dim + self.dim  # untied embedding and output, final norm

    @property
    def params(self) -> int:
        return self.n_layers * self.layer_params + self.root_params

    @property
    def units(self) -> int:
        return self.n_layers + 1

    def flops_per_token(self, seq: int) -> float:
        """Forward + backward: 6 x the matmul parameters (all but the embedding lookup) + 12 L d s attention
        (QK^T and AV, the causal mask not halved: the same convention as the calibration, so it cancels)."""
        matmul_params = self.params - self.vocab_size * self.dim
        return 6.0 * matmul_params + 12.0 * self.n_layers * self.dim * seq


MODELS: dict[str, ModelShape] = {
    # examples/llama.py LlamaConfig.bench(): 953,223,168 parameters
    "953m": ModelShape("953m", dim=2048, n_layers=16, n_heads=16, ffn_dim=5632, vocab_size=32000),
    # LlamaConfig.llama_7b(): 6,738,415,616 parameters
    "7b": ModelShape("7b", dim=4096, n_layers=32, n_heads=32, ffn_dim=11008, vocab_size=32000),
    # Llama-2-70B shape with grouped-query attention (8 kv heads): 68,976,648,192 parameters
    "70b": ModelShape("70b", dim=8192, n_layers=80, n_heads=64, ffn_dim=28672, vocab_size=32000, n_kv_heads=8),
    # Llama-3-8B (LlamaConfig.llama3_8b(), untied output): 8,030,261,248 parameters
    "8b": ModelShape("8b", dim=4096, n_layers=32, n_heads=32, ffn_dim=14336, vocab_size=128256, n_kv_heads=8),
}


@dataclass(frozen=True)
class Link:
    """A ring over one kind of link: per-step latency (s) and bus bandwidth (bytes/s)."""

    alpha_s: float
    bw_bps: float


def ring_time(nbytes: float, k: int, link: Link, all_reduce: bool = False) -> float:
    """Seconds for an all-gather / reduce-scatter (or all-reduce) of ``nbytes`` (full size) over ``k`` ranks."""
    if k <= 1 or nbytes <= 0:
        return 0.0
    factor = 2.0 if all_reduce else 1.0
    return factor * ((k - 1) * link.alpha_s + (k - 1) / k * nbytes / link.bw_bps)


@dataclass(frozen=True)
class Hardware:
    """Links of the cluster. ``ag_intra`` / ``rs_intra`` map a ring size (2, 4, ...) to the NVLink fit; a ring
    larger than any key uses the largest key's fit."""

    ag_intra: dict[int, Link]
    rs_intra: dict[int, Link]
    inter: Link
    gpus_per_node: int = 8

    def intra(self, k: int, reduce: bool) -> Link:
        table = self.rs_intra if reduce else self.ag_intra
        fits = [key for key in sorted(table) if key >= k]
        return table[fits[0] if fits else max(table)]

    def ring_link(self, k: int, reduce: bool) -> Link:
        """The link a ring of ``k`` GPUs runs at: NVLink inside a node, the slower of the two across nodes."""
        nv = self.intra(min(k, self.gpus_per_node), reduce)
        if k <= self.gpus_per_node:
            return nv
        return Link(max(nv.alpha_s, self.inter.alpha_s), min(nv.bw_bps, self.inter.bw_bps))


@dataclass(frozen=True)
class Calibration:
    """Constants measured on the 2-GPU H200 machines (see :mod:`bench.scale.calibrate`)."""

    achieved_flops: float  # fwd+bwd FLOP/s of one GPU, compute-bound
    optimizer_s_per_param: float  # AdamW step time per parameter held
    host_s_per_unit: float  # host enqueue time per FSDP unit per step (eager, no CUDA graph)


@dataclass(frozen=True)
class StepBreakdown:
    """One predicted step, milliseconds."""

    gpus: int
    strategy: str
    shard: int
    replicas: int
    compute_ms: float
    optimizer_ms: float
    comm_ms: float  # all communication of the step, overlapped or not
    exposed_ms: float
    gpu_ms: float
    host_ms: float
    step_ms: float
    state_gib: float  # sharded fp32 parameters + gradients + AdamW moments per GPU

    @property
    def bound(self) -> str:
        if self.host_ms >= self.gpu_ms:
            return "host"
        return "comm" if self.comm_ms - self.exposed_ms > self.compute_ms else "compute"


def small_all_reduce_time(k: int, link: Link) -> float:
    """Seconds for an all-reduce of a few bytes over ``k`` ranks: latency only, a tree's ``2 ceil(log2 k)`` steps
    (NCCL picks a tree for tiny all-reduces; a ring's ``2 (k - 1)`` steps would be 57x that at 512 GPUs)."""
    return 0.0 if k <= 1 else 2 * math.ceil(math.log2(k)) * link.alpha_s


def _unit_comm(unit_params: int, shard: int, replicas: int, hw: Hardware,
               gather_bytes: float | None = None) -> tuple[float, float, float]:
    """(all-gather, reduce-scatter, replica all-reduce) seconds for one unit; the all-gather moves
    ``gather_bytes`` (default: every parameter in bf16)."""
    gather = BF16 * unit_params if gather_bytes is None else gather_bytes
    ag = ring_time(gather, shard, hw.ring_link(shard, reduce=False))
    rs = ring_time(FP32 * unit_params, shard, hw.ring_link(shard, reduce=True))
    ar = ring_time(FP32 * unit_params / shard, replicas, hw.inter, all_reduce=True) if replicas > 1 else 0.0
    return ag, rs, ar


def step_time(
    shape: ModelShape, gpus: int, tokens: int, seq: int, strategy: str, hw: Hardware, cal: Calibration,
    wire: str = "bf16",
) -> StepBreakdown:
    """Predict one step of ``strategy`` ("flat" or "hybrid") on ``gpus`` GPUs with ``tokens`` tokens per GPU, the
    layers' weights all-gathered in ``wire`` (one of WIRES)."""
    if strategy not in ("flat", "hybrid"):
        raise ValueError(f"strategy must be 'flat' or 'hybrid', got {strategy!r}")
    if wire not in WIRES:
        raise ValueError(f"wire must be one of {', '.join(WIRES)}, got {wire!r}")
    if gpus < 1:
        raise ValueError(f"gpus must be >= 1, got {gpus}")
    shard = gpus if strategy == "flat" else min(gpus, hw.gpus_per_node)
    if gpus % shard:
        raise ValueError(f"hybrid sharding needs gpus ({gpus}) divisible by gpus per node ({shard})")
    replicas = gpus // shard
    compute = shape.flops_per_token(seq) * tokens / cal.achieved_flops
    optimizer = cal.optimizer_s_per_param * shape.params / shard
    gather_bytes, amax = None, 0.0
    if wire == "fp8":  # the linear weights in fp8, the norms in bf16; the amax all-reduce over the shard group
        gather_bytes = FP8 * shape.layer_linear_params + BF16 * (shape.layer_params - shape.layer_linear_params)
        amax = small_all_reduce_time(shard, hw.ring_link(shard, reduce=True))
    lag, lrs, lar = _unit_comm(shape.layer_params, shard, replicas, hw, gather_bytes)
    rag, rrs, rar = _unit_comm(shape.root_params, shard, replicas, hw)
    # forward all-gather + backward all-gather again (reshard_after_forward) + reduce-scatter (+ all-reduce)
    total = shape.n_layers * (2 * lag + lrs + lar + amax) + (rag + rrs + rar)
    exposed = rag + rrs + rar
    gpu = max(compute, total - exposed) + exposed + optimizer
    host = cal.host_s_per_unit * shape.units
    state = ADAM_STATE_BYTES * shape.params / shard / 2**30
    return StepBreakdown(
        gpus=gpus, strategy=strategy, shard=shard, replicas=replicas, compute_ms=1e3 * compute,
        optimizer_ms=1e3 * optimizer, comm_ms=1e3 * total, exposed_ms=1e3 * exposed, gpu_ms=1e3 * gpu,
        host_ms=1e3 * host, step_ms=1e3 * max(gpu, host), state_gib=state,
    )


def one_gpu_step_ms(shape: ModelShape, tokens: int, seq: int, cal: Calibration) -> float:
    """The GPU time of an unsharded one-GPU step (compute + the whole optimizer, no communication). Large models
    do not fit one GPU: this is the ideal the efficiency is measured against, not a runnable configuration."""
    compute = shape.flops_per_token(seq) * tokens / cal.achieved_flops
    return 1e3 * (compute + cal.optimizer_s_per_param * shape.params)
