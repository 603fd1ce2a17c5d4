"""The rows of ``bench.offload.big``: the implementation names it knows (``IMPLS``), the variants, each
recorded as another implementation's row with a ``variant`` string (``VARIANTS``), and each one's rough time for
the plan (``ESTIMATE``). How each is built is in ``bench.offload.big_impls``."""

from __future__ import annotations

IMPLS = ("resident", "shardfuse", "shardfuse-budget", "shardfuse-host-accum", "shardfuse-sib",
         "shardfuse-budget-sib", "shardfuse-sib-allcores", "shardfuse-keep", "shardfuse-sib-keep", "shardfuse-ssd",
         "shardfuse-hcc", "shardfuse-sib-hcc", "shardfuse-keep-hcc", "shardfuse-sib-keep-hcc",
         "shardfuse-budget-sib-hcc", "shardfuse-spec", "shardfuse-spec-nofire", "shardfuse-budget-ao",
         "shardfuse-budget-ao-sib", "shardfuse-cu", "shardfuse-budget-cu", "shardfuse-cu-kl", "shardfuse-budget-cu-kl",
         "shardfuse-nofire", "shardfuse-budget-nofire", "shardfuse-tl", "shardfuse-tl-nofire", "shardfuse-sib-tl",
         "shardfuse-budget-tl", "shardfuse-budget-sib-tl", "shardfuse-ntl", "shardfuse-budget-ntl",
         "shardfuse-gs", "shardfuse-gs-nofire", "shardfuse-sib-gs", "shardfuse-budget-gs", "shardfuse-budget-sib-gs",
         "torchao", "fairscale", "fsdp2", "deepspeed-zero2", "deepspeed-zero3")  # fmt: skip
AO_VARIANT = "budget = torchao's GPU peak"
AO_FALLBACK_BUDGET_GIB = 30.0  # torchao's GPU peak for the 2.9B decoder measured on an H100 (29.6 GiB, issue 30)
# Variants recorded as another implementation's row with a ``variant`` (internal name -> (row impl, variant)).
# ``-sib``: OffloadOptimizer(step_in_backward=True), each unit's host update overlapping backward; it cannot clip
# by the global norm, so these rows train WITHOUT clipping (every other row clips at MAX_NORM).
VARIANTS = {"shardfuse-host-accum": ("shardfuse", "host-accum"),
            "shardfuse-sib": ("shardfuse", "step-in-backward, no clipping"),
            "shardfuse-budget-sib": ("shardfuse-budget", "step-in-backward, no clipping"),
            "shardfuse-keep": ("shardfuse", "reshard_after_forward=False"),
            "shardfuse-sib-keep": ("shardfuse", "step-in-backward, no clipping, reshard_after_forward=False"),
            "shardfuse-sib-allcores": ("shardfuse",
                                       "step-in-backward, no clipping, host_threads=all cores"),
            "shardfuse-hcc": ("shardfuse", "host_compute_copy"),
            "shardfuse-sib-hcc": ("shardfuse", "step-in-backward, no clipping, host_compute_copy"),
            "shardfuse-keep-hcc": ("shardfuse", "reshard_after_forward=False, host_compute_copy"),
            "shardfuse-sib-keep-hcc": ("shardfuse",
                                       "step-in-backward, no clipping, reshard_after_forward=False, host_compute_copy"),
            "shardfuse-budget-sib-hcc": ("shardfuse-budget",
                                         "step-in-backward, no clipping, host_compute_copy"),
            "shardfuse-budget-ao": ("shardfuse-budget", AO_VARIANT),
            "shardfuse-budget-ao-sib": ("shardfuse-budget", f"step-in-backward, no clipping, {AO_VARIANT}"),
            "shardfuse-cu": ("shardfuse", "clip_in_update"),
            "shardfuse-budget-cu": ("shardfuse-budget", "clip_in_update"),
            "shardfuse-cu-kl": ("shardfuse", "clip_in_update, keep_params_gib=auto, bf16 gradients"),
            "shardfuse-budget-cu-kl": ("shardfuse-budget", "clip_in_update, keep_params_gib=auto, bf16 gradients"),
            "shardfuse-spec": ("shardfuse", "speculative_clip"),
            "shardfuse-spec-nofire": ("shardfuse", "speculative_clip, max_norm 1e9 (never fires)"),
            "shardfuse-nofire": ("shardfuse", "max_norm 1e9 (never fires)"),
            "shardfuse-budget-nofire": ("shardfuse-budget", "max_norm 1e9 (never fires)"),
            "shardfuse-tl": ("shardfuse", "host tiles"),
            "shardfuse-tl-nofire": ("shardfuse", "host tiles, max_norm 1e9 (never fires)"),
            "shardfuse-sib-tl": ("shardfuse", "step-in-backward, no clipping, host tiles"),
            "shardfuse-budget-tl": ("shardfuse-budget", "host tiles"),
            "shardfuse-budget-sib-tl": ("shardfuse-budget", "step-in-backward, no clipping, host tiles"),
            "shardfuse-ntl": ("shardfuse", "no host tiles"),
            "shardfuse-budget-ntl": ("shardfuse-budget", "no host tiles"),
            "shardfuse-gs": ("shardfuse", "gpu_update_share"),
            "shardfuse-gs-nofire": ("shardfuse", "gpu_update_share, max_norm 1e9 (never fires)"),
            "shardfuse-sib-gs": ("shardfuse", "step-in-backward, no clipping, gpu_update_share"),
            "shardfuse-budget-gs": ("shardfuse-budget", "gpu_update_share"),
            "shardfuse-budget-sib-gs": ("shardfuse-budget",
                                        "step-in-backward, no clipping, gpu_update_share")}  # fmt: skip
# ``-keep``: wrapped with reshard_after_forward=False: the gathered bf16 parameters stay on the GPU from forward
# to backward, so each offloaded shard crosses PCIe (and is read from host memory) once per step instead of twice,
# for the full compute-dtype parameters on the GPU during the step.
# ``-allcores``: OffloadOptimizer(host_threads=<every core>) instead of its default (the cores less one, left to
# the thread launching GPU work): the measurement behind that default.
# ``-hcc``: OffloadOptimizer(host_compute_copy=True): the host update writes a bf16 copy (in the same cache-sized
# pass), so 2 instead of 4 bytes per parameter cross to the GPU and are read from host memory.
# ``-cu``: OffloadOptimizer(clip_in_update=True): clipping's scale inside the fused kernel (its grad_scale, a
# division by 1 / coef), no pass of its own over host memory; values within a rounding of the multiply's.
# ``-kl`` (after ``-cu``): also keep_params_gib=None (the gathered bf16 parameters kept from forward to backward in
# the room the GPU has: no re-gather in backward) and SHARDFUSE_LOWP_GRADS=1 in the row's process (bf16 gradients
# to the host where exact): the backward without its fp32 host->device copy and with half the device->host bytes.
# ``-tl``: SHARDFUSE_HOST_TILES=1 in the row's process: the scaled host updates run as tiles on a pool of
# single-threaded workers (``_host_tiles``) instead of chunks over torch's intra-op threads (the default since
# 2026-11-29; before, off); ``-ntl``: SHARDFUSE_HOST_TILES=0, the chunks; ``BIG_HOST_TILE=N`` sets the elements per
# tile (``_host_fused.TILE_ELEMENTS``); rows record ``host_tiles`` and ``host_tile_elements``.
# ``-gs``: OffloadOptimizer(gpu_update_share=BIG_GPU_SHARE, default 0.5): the last units' updates stream through
# the GPU (``_gpu_assist``) beside the host's; rows record ``gpu_update_share``.
# ``BIG_HOST_CHUNK=N`` (a diagnostic): ``_host_fused.CHUNK_ELEMENTS`` for every shardfuse row (``whole``: one
# kernel call per parameter); rows record ``host_chunk_elements``.
# ``shardfuse-host-accum``: the shardfuse row of an accumulating configuration with ``accumulate_on_gpu=False``
# (gradients go to the host every micro-batch); its row's impl is ``shardfuse`` with ``variant: host-accum``.
# Rough seconds for the time plan (one H100, 16 cores): per child start, setup per billion parameters, and per
# billion parameters the optimizer part and the per-micro-batch part of a step (from issue 20's measurements).
ESTIMATE: dict[str, tuple[float, float, float, float]] = {
    "resident": (10, 3, 0.006, 0.06),
    "shardfuse": (12, 5, 0.17, 0.2),
    "shardfuse-budget": (12, 5, 0.1, 0.1),
    "shardfuse-host-accum": (12, 5, 0.17, 0.2),
    "shardfuse-sib": (12, 5, 0.17, 0.2),
    "shardfuse-budget-sib": (12, 5, 0.1, 0.1),
    "shardfuse-sib-allcores": (12, 5, 0.17, 0.2),
    "shardfuse-keep": (12, 5, 0.17, 0.2),
    "shardfuse-sib-keep": (12, 5, 0.17, 0.2),
    "shardfuse-hcc": (12, 5, 0.17, 0.2),
    "shardfuse-sib-hcc": (12, 5, 0.17, 0.2),
    "shardfuse-keep-hcc": (12, 5, 0.17, 0.2),
    "shardfuse-sib-keep-hcc": (12, 5, 0.17, 0.2),
    "shardfuse-budget-sib-hcc": (12, 5, 0.1, 0.1),
    "shardfuse-spec": (12, 5, 0.17, 0.2),
    "shardfuse-spec-nofire": (12, 5, 0.17, 0.2),
    "shardfuse-nofire": (12, 5, 0.17, 0.2),
    "shardfuse-budget-nofire": (12, 5, 0.1, 0.1),
    "shardfuse-cu": (12, 5, 0.17, 0.2),
    "shardfuse-budget-cu": (12, 5, 0.1, 0.1),
    "shardfuse-cu-kl": (12, 5, 0.17, 0.2),
    "shardfuse-budget-cu-kl": (12, 5, 0.1, 0.1),
    "shardfuse-tl": (12, 5, 0.17, 0.2),
    "shardfuse-tl-nofire": (12, 5, 0.17, 0.2),
    "shardfuse-sib-tl": (12, 5, 0.17, 0.2),
    "shardfuse-budget-tl": (12, 5, 0.1, 0.1),
    "shardfuse-budget-sib-tl": (12, 5, 0.1, 0.1),
    "shardfuse-ntl": (12, 5, 0.17, 0.2),
    "shardfuse-budget-ntl": (12, 5, 0.1, 0.1),
    "shardfuse-gs": (12, 5, 0.12, 0.2),
    "shardfuse-gs-nofire": (12, 5, 0.12, 0.2),
    "shardfuse-sib-gs": (12, 5, 0.12, 0.2),
    "shardfuse-budget-gs": (12, 5, 0.08, 0.1),
    "shardfuse-budget-sib-gs": (12, 5, 0.08, 0.1),
    "shardfuse-budget-ao": (12, 5, 0.12, 0.12),
    "shardfuse-budget-ao-sib": (12, 5, 0.12, 0.12),
    "torchao": (12, 3, 0.3, 0.06),  # 817.5 ms for the 2.9B step measured on an H100 (issue 30)
    "shardfuse-ssd": (12, 8, 8.0, 4.0),  # disk-bound: ~2 GB/s each way assumed
    "fairscale": (12, 8, 0.17, 0.2),
    "fsdp2": (12, 6, 0.2, 0.22),
    "deepspeed-zero2": (70, 10, 0.25, 0.32),  # the first one compiles DeepSpeedCPUAdam (~50 s)
    "deepspeed-zero3": (20, 12, 0.25, 0.36),
}
