"""The memory model: GPU peak per rank, host memory and disk per node, for one setup (bytes).

What lives where, read from the code (``shardfuse/sharding``) and checked against the stored rows:

* **sharded** (``FullyShardedDataParallel``, mixed precision): per rank the fp32 shard (4 B/param / shard), its
  optimizer state (AdamW 8 B, SGD momentum 4 B) and, from backward to ``zero_grad``, the fp32 sharded gradient
  (4 B); while a unit computes its gathered bf16 parameters (and the next one's, prefetched), its bf16 gradient and
  the fp32 reduce-scatter input: :data:`UNIT_TRANSIENT_BYTES` per element of a block, and the root unit's gathered
  bf16 parameters (it keeps them from forward to backward; its gradient buffers come after the activations are
  freed); the activations
  (:func:`activation_bytes`). The peak is the larger of forward's end (state + activations) and the optimizer step
  (state + gradients; with ``StepInBackward``, where the workload does not clip, one unit's gradient: each is freed
  as its unit is updated in backward). Under ``no_sync`` accumulation the unsharded bf16 gradients (2 B/param) are
  kept.
* **offload** (``move_params_to_cpu=True`` + ``OffloadOptimizer``): the GPU holds the units the budget keeps
  resident (16 B/param with AdamW: shard, gradient, state, as ``choose_resident`` counts) and the transients; the
  host the offloaded fp32 shards and their optimizer state, and a pinned gradient buffer for *every* unit, made at
  the first backward when all are offloaded: torch's caching host allocator rounds each to a power of two and keeps
  it (the stored rows' host RSS matches this to 0.1 GiB: 2.9B full offload 46.8 GiB, with a 40 GiB budget 28.1).
  ``accumulate_on_gpu`` keeps the gathered bf16 parameters (2 B/param), ``reshard_after_forward=False`` too.
* **ssd** (``OffloadConfig(offload_type="ssd_offload", optimizer_state=True)``): shards and optimizer state in
  files (disk: 4 + state B/param), read ahead ``READ_AHEAD`` units; gradients in pinned host memory as above.
* **plain** (one GPU, no shardfuse, fp32 weights under bf16 autocast): 12 B/param + autocast's bf16 weight copies
  (2 B/param) + its activations, which keep fp32 residuals (:data:`PLAIN_ACT_BYTES`).
"""

from __future__ import annotations

from dataclasses import dataclass

from shardfuse.plan._setup import Setup, Workload, state_bytes
from shardfuse.plan._shapes import ModelShape

__all__ = ["MemoryEstimate", "activation_bytes", "choose_resident", "estimate_memory", "pinned_round"]

GIB = 2**30
# Calibrated on the stored shardfuse rows (least squares on relative error, tests/test_plan.py checks all of them;
# the unit transients' split between a block and the root came later, 2026-11-28, from the first 4-GPU row's peak):
# bench/results/h200/e2e_2gpu.json (953M, 8K and 1K tokens), e2e_4gpu.json (8K), e2e_7b_fused_2gpu.json (6.7B,
# 4K), e2e_hf_2gpu.json (HF Llama 853M, 1K) and the full-offload rows of offload_big.json (2.9B 4K, 6.7B 2K).
ACT_BYTES = 44.5  # activation bytes per token, per unit of width, per block (bf16 compute, SDPA attention)
LOGIT_BYTES = 9.2  # bytes per token per vocabulary entry (bf16 logits, the fp32 loss and its gradient)
# One-GPU autocast rows (offload_big resident 2.9B 4K, 6.7B 2K; e2e baseline 953M 8K): fp32 residual stream.
PLAIN_ACT_BYTES = 53.2
PLAIN_LOGIT_BYTES = 17.4
UNIT_TRANSIENT_BYTES = 14  # two gathered bf16 blocks (4), a block's bf16 gradient (2), fp32 reduce-scatter in/out (8)
CKPT_SAVED_BYTES = 2.0  # activation checkpointing keeps each block's bf16 input: 2 B per token per unit of width
HOST_BASE_BYTES = 1.3 * GIB  # a CUDA process's own RSS (torch, the CUDA context): the resident rows' 1.05-1.35 GiB
READ_AHEAD = 2  # OffloadConfig.read_ahead's default


@dataclass(frozen=True)
class MemoryEstimate:
    gpu_peak: float  # bytes, per GPU
    host: float  # bytes, per node
    disk: float  # bytes, per node
    resident_params: int = 0  # offload: parameters the budget keeps on the GPU


def activation_bytes(shape: ModelShape, tokens: int, checkpointing: bool = False, plain: bool = False) -> float:
    """Activations of one forward pass over ``tokens`` tokens, held at the start of backward."""
    per_layer, logits = (PLAIN_ACT_BYTES, PLAIN_LOGIT_BYTES) if plain else (ACT_BYTES, LOGIT_BYTES)
    if checkpointing:  # every block's input kept, one block's activations alive while it recomputes
        layers = CKPT_SAVED_BYTES * shape.n_layers + per_layer
    else:
        layers = per_layer * shape.n_layers
    return tokens * (layers * shape.dim + logits * shape.vocab_size)


def pinned_round(nbytes: float) -> float:
    """What torch's caching host allocator takes for a pinned block: the next power of two."""
    if nbytes <= 0:
        return 0.0
    size = 1
    while size < nbytes:
        size *= 2
    return float(size)


def choose_resident(sizes: list[int], room_bytes: float, bytes_per_param: float) -> int:
    """The units, counted from the start of the forward order, whose shard, gradient and state fit ``room_bytes``
    (``OffloadOptimizer``'s placement); returns their parameter count."""
    used, params = 0.0, 0
    for n in sizes:
        if used + n * bytes_per_param > room_bytes:
            break
        used += n * bytes_per_param
        params += n
    return params


def _transients(shape: ModelShape, setup: Setup, work: Workload) -> float:
    """The GPU bytes of a forward/backward on top of the persistent ones: activations, the units in flight, and the
    unsharded bf16 parameters/gradients that accumulation or ``reshard_after_forward=False`` keep."""
    act = activation_bytes(shape, work.micro_tokens, setup.checkpointing, plain=setup.kind == "plain")
    if setup.kind == "plain":
        return act + 2.0 * shape.params  # autocast's cached bf16 copies of the weights
    # At the peak (forward's end, backward's start) a block is in flight with its full transients, while the root
    # unit, which keeps its parameters gathered, holds only those (2 B/param): its own gradient and reduce-scatter
    # buffers come last in backward, after the activations were freed.
    extra = float(UNIT_TRANSIENT_BYTES * shape.layer_params + 2.0 * shape.root_params)
    if work.micro_batches > 1:
        extra += 2.0 * shape.params  # no_sync keeps the unsharded bf16 gradients
        if setup.offloaded and setup.accumulate_on_gpu:
            extra += 2.0 * shape.params  # and the gathered bf16 parameters
    if not setup.reshard_after_forward:
        extra += 2.0 * shape.params
    return act + extra


def estimate_memory(shape: ModelShape, setup: Setup, work: Workload) -> MemoryEstimate:
    """GPU peak per rank, host and disk per node (each node holds ``ranks_per_node`` ranks of the setup)."""
    state = state_bytes(work.optimizer)
    per_param = 4.0 + 4.0 + state  # shard, gradient, optimizer state
    transient = _transients(shape, setup, work)
    if setup.kind in ("plain", "sharded"):
        params = shape.params / setup.shard
        grads_kept = 4.0 * params if work.micro_batches > 1 and setup.kind == "plain" else 0.0
        forward = (4.0 + state) * params + grads_kept + transient
        # The end of backward holds every sharded gradient, or with StepInBackward the last unit's alone.
        grads = 4.0 * (shape.largest_unit / setup.shard if setup.step_in_backward else params)
        gpu = max(forward, (4.0 + state) * params + grads)
        return MemoryEstimate(gpu, HOST_BASE_BYTES * setup.ranks_per_node, 0.0)
    full_peak = transient
    resident = setup.resident_params
    gpu = full_peak + per_param * resident / setup.shard
    off = (shape.params - resident) / setup.shard
    grads = sum(pinned_round(4.0 * n / setup.shard) for n in shape.unit_sizes())
    if setup.kind == "ssd":
        ahead = READ_AHEAD * (4.0 + state) * shape.largest_unit / setup.shard
        host = HOST_BASE_BYTES + grads + ahead
        disk = (4.0 + state) * off
    else:
        copy = 2.0 if setup.host_compute_copy else 0.0
        host = HOST_BASE_BYTES + grads + max(4.0 * shape.params / setup.shard, (4.0 + state + copy) * off)
        disk = 0.0
    ranks = setup.ranks_per_node
    return MemoryEstimate(gpu, host * ranks, disk * ranks, resident)

