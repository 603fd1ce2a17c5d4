"""Shard cast benchmark cases: fp32 -> bf16 into the all-gather input, one shard or many tensors.

Each case moves the fewest bytes a one-pass cast must move (read fp32 once, write bf16 once); the
baselines are what PyTorch / FSDP2 run today:

- one flat shard: ``out.copy_(src)`` (a single cast kernel, the ceiling to match);
- the FSDP2 two-pass sequence on ~16 per-parameter shards: ``torch._foreach_copy_`` of the fp32 shards into
  bf16 per-parameter tensors, then ``torch._foreach_copy_`` (or ``torch.cat``) into the all-gather input;
- 1000 small tensors: ``torch._foreach_copy_`` into per-tensor bf16 outputs.

``crossover_cases`` put tensor counts on both sides of ``FOREACH_MIN_TENSORS``, where the list form hands
over to ``torch._foreach_copy_``, and sizes on both sides of the GPU's size crossover
(``shardfuse.kernels._crossover``): the row's own time is the entry point as users call it (the path it picks is
in the row's name), and each row is also timed with the Triton path forced, so a run shows what the dispatch
saves on each side and ``python -m bench.kernels.crossover`` can fit the thresholds again. The flat form's rows
time it against the ``_foreach_copy_`` into split views of the buffer that FSDP2 runs.

Which path each row times, in its name: ``[runtime]`` rows call ``cast_shard_unchecked``, the trusted launch
the sharding runtime runs before every all-gather (the same kernel as the public ``cast_shard``, without its
argument checks); ``[public API]`` rows call ``cast_shards`` (shardfuse.kernels._cast_multi), which users call
directly and the runtime never does.

GPU only: every tensor is built on "cuda" inside ``cases``. The runner is ``python -m bench.kernels.run``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from bench.kernels.cases import TORCH_PATH, TRITON_PATH, KernelCase, forced_path
from shardfuse.kernels import _cast_multi, _crossover
from shardfuse.kernels._cast import cast_shard_unchecked
from shardfuse.kernels._cast_multi import cast_shards

FAMILY = "shard_cast"
DISPATCH_FAMILY = "shard_cast_dispatch"
# Elements per tensor, from host-bound to GPU-bound; 64K and 256K on either side of the list form's
# FOREACH_LARGE_MIN_NUMEL (from 32 tensors, ends this large take the kernel where the GPU's rule does).
CROSSOVER_NUMELS = (1 << 10, 1 << 14, 1 << 16, 1 << 18)
NUM_PARAMS = 16  # per-parameter shards in one FSDP unit's flat shard
NUM_SMALL = 1000  # tensors in the multi-tensor case
WORLD_SIZE = 2  # the all-gather input is this rank's slice of a WORLD_SIZE-times larger buffer


def split_sizes(n: int, parts: int, seed: int = 0) -> list[int]:
    """``parts`` uneven positive sizes summing to ``n`` (uneven like real parameters)."""
    parts = max(1, min(parts, n))
    gen = torch.Generator().manual_seed(seed)
    weights = torch.rand(parts, generator=gen) + 0.25
    sizes = [max(1, int(w)) for w in (weights / weights.sum() * n).tolist()]
    sizes[-1] += n - sum(sizes)
    if sizes[-1] < 1:  # rounding pushed the last one under 1: take the excess from the largest
        big = max(range(parts), key=sizes.__getitem__)
        sizes[big] += sizes[-1] - 1
        sizes[-1] = 1
    return sizes


def _shard_cases(n: int) -> list[KernelCase]:
    dev = "cuda"
    nbytes = n * (4 + 2)  # read fp32 once, write bf16 once
    # The all-gather input: this rank (rank 1) writes its slice, as before a real all-gather.
    ag = torch.empty(WORLD_SIZE * n, dtype=torch.bfloat16, device=dev)
    ag_in = ag[n : 2 * n]
    shard = torch.randn(n, device=dev)

    # FSDP2 keeps one fp32 shard per parameter; emulate with NUM_PARAMS uneven ones of the same total.
    sizes = split_sizes(n, NUM_PARAMS)
    params = list(torch.randn(n, device=dev).split(sizes))
    params = [p.clone() for p in params]  # separate allocations, like real per-parameter shards
    bf16_params = [torch.empty_like(p, dtype=torch.bfloat16) for p in params]
    ag_views = list(ag_in.split(sizes))

    def fsdp2_foreach_x2():
        torch._foreach_copy_(bf16_params, params)  # pass 1: cast each parameter shard
        torch._foreach_copy_(ag_views, bf16_params)  # pass 2: copy into the all-gather input

    def fsdp2_to_cat():
        torch.cat([p.to(torch.bfloat16) for p in params], out=ag_in)

    baselines = {"fsdp2_foreach_copy_x2": fsdp2_foreach_x2, "fsdp2_to+cat": fsdp2_to_cat}
    return [
        KernelCase(
            family=FAMILY,
            name=f"fp32->bf16 flat shard [runtime] n={n}",
            numel=n,
            bytes_moved=nbytes,
            shardfuse=lambda: cast_shard_unchecked(shard, ag_in),
            baselines={"copy_": lambda: ag_in.copy_(shard), **baselines},
        ),
        KernelCase(
            family=FAMILY,
            name=f"fp32->bf16 {len(params)} params [public API] n={n}",
            numel=n,
            bytes_moved=nbytes,
            shardfuse=lambda: cast_shards(params, ag_in),
            baselines=baselines,
            num_tensors=len(params),
        ),
    ]


def _multi_case(n: int) -> KernelCase:
    dev = "cuda"
    sizes = split_sizes(n, NUM_SMALL, seed=1)
    srcs = [torch.randn(k, device=dev) for k in sizes]
    outs = [torch.empty(k, dtype=torch.bfloat16, device=dev) for k in sizes]
    return KernelCase(
        family=FAMILY,
        name=f"fp32->bf16 {len(sizes)} tensors [public API] n={n}",
        numel=n,
        bytes_moved=n * (4 + 2),
        shardfuse=lambda: cast_shards(srcs, outs),
        baselines={"foreach_copy_": lambda: torch._foreach_copy_(outs, srcs)},
        num_tensors=len(sizes),
    )


def cases(sizes: Sequence[int]) -> list[KernelCase]:
    """The shard-cast cases at each size (elements of the fp32 shard): one shard, 16 params, 1000 tensors."""
    out: list[KernelCase] = []
    for n in sizes:
        out += _shard_cases(n)
        out.append(_multi_case(n))
    return out


def _list_case(num: int, per_tensor: int) -> KernelCase:
    sizes = split_sizes(num * per_tensor, num, seed=2)
    srcs = [torch.randn(k, device="cuda") for k in sizes]
    outs = [torch.empty(k, dtype=torch.bfloat16, device="cuda") for k in sizes]
    run = lambda: cast_shards(srcs, outs)  # noqa: E731
    return KernelCase(
        family=DISPATCH_FAMILY,
        name=f"list fp32->bf16 {num} tensors x{per_tensor} ({_list_side(srcs, outs, sum(sizes) * 6)})",
        numel=sum(sizes),
        bytes_moved=sum(sizes) * (4 + 2),
        shardfuse=run,
        baselines={
            "foreach_copy_": lambda: torch._foreach_copy_(outs, srcs),
            TRITON_PATH: forced_path("triton", ["cast_shards_list"], run,
                                     (_cast_multi, "FOREACH_MIN_TENSORS", 1 << 62),
                                     (_cast_multi, "FOREACH_SMALL_MIN_TENSORS", 1 << 62)),
            # the entry point's own PyTorch path through its plan (key, guard, then _foreach_copy_): what the rule
            # weighs the kernel against where the count rules leave the call to the plan
            TORCH_PATH: forced_path("torch", ["cast_shards_list"], run,
                                    (_cast_multi, "FOREACH_MIN_TENSORS", 1 << 62),
                                    (_cast_multi, "FOREACH_SMALL_MIN_TENSORS", 1 << 62)),
        },
        num_tensors=num,
    )


def _flat_case(num: int, per_tensor: int) -> KernelCase:
    sizes = split_sizes(num * per_tensor, num, seed=3)
    srcs = [torch.randn(k, device="cuda") for k in sizes]
    flat = torch.empty(sum(sizes), dtype=torch.bfloat16, device="cuda")
    return KernelCase(
        family=DISPATCH_FAMILY,
        name=f"flat fp32->bf16 {num} tensors x{per_tensor} ({_side('cast_shards_flat', num, sum(sizes) * 6)})",
        numel=sum(sizes),
        bytes_moved=sum(sizes) * (4 + 2),
        shardfuse=lambda: cast_shards(srcs, flat),
        baselines={
            "foreach_copy_(split)": lambda: torch._foreach_copy_(flat.split(sizes), srcs),
            TRITON_PATH: forced_path("triton", ["cast_shards_flat"], lambda: cast_shards(srcs, flat)),
            TORCH_PATH: forced_path("torch", ["cast_shards_flat"], lambda: cast_shards(srcs, flat)),
        },
        num_tensors=num,
    )


def _side(family: str, num: int, nbytes: int) -> str:
    """The path the entry point takes for such a call on this GPU (the row's name carries it)."""
    return "triton" if _crossover.use_triton_at(family, torch.device("cuda"), num, nbytes) else "torch"


def _list_side(srcs: list[torch.Tensor], outs: list[torch.Tensor], nbytes: int) -> str:
    """:func:`_side` of the list form: its count rules first (``_cast_multi.use_foreach``)."""
    return "foreach" if _cast_multi.use_foreach(srcs, outs) else _side("cast_shards_list", len(srcs), nbytes)


def crossover_cases() -> list[KernelCase]:
    """The list form at tensor counts around FOREACH_SMALL_MIN_TENSORS and FOREACH_MIN_TENSORS (and 1000), and the
    flat form beside it."""
    t, small = _cast_multi.FOREACH_MIN_TENSORS, _cast_multi.FOREACH_SMALL_MIN_TENSORS
    counts = sorted({t // 4, small - 1, small, t - 1, t, 2 * t, 256, 1000})
    out = [_list_case(num, k) for k in CROSSOVER_NUMELS for num in counts]
    out += [_flat_case(num, k) for k in CROSSOVER_NUMELS for num in (16, t, 1000)]
    return out
