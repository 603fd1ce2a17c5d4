"""Float8 shard-cast benchmark cases: the amax of every parameter segment of an fp32 flat shard, and the
tensorwise float8_e4m3fn cast of every segment into the all-gather input, against the PyTorch sequences of
torchao's recipe as FSDP2 runs it for an fp8 all-gather:

- amax: ``torch._foreach_norm(segments, inf)`` (one fused reduction launch per group of tensors), and
  ``torch.max(torch.abs(x))`` per segment (torchao's ``tensor_to_amax``);
- cast: per segment ``(x.float() * scale).clamp(-448, 448).to(float8_e4m3fn)`` (torchao's
  ``hp_tensor_and_scale_to_float8``), then ``torch._foreach_copy_`` into the all-gather input (FSDP2's copy-in).

16 uneven segments per shard, as an FSDP unit's parameters. GPU only; tensors are built on "cuda" in ``cases``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from bench.kernels.bench_cast import WORLD_SIZE, split_sizes
from bench.kernels.cases import KernelCase
from shardfuse.kernels._fp8 import FP8_DTYPE, FP8_MAX, amax_to_scale, cast_fp8_shards, fp8_amax

NUM_PARAMS = 16


def _cases(n: int) -> list[KernelCase]:
    sizes = split_sizes(n, NUM_PARAMS, seed=4)
    shard = torch.randn(n, device="cuda")
    segs = list(shard.split(sizes))  # views of one flat shard, as the sharding runtime holds them
    amax = torch.empty(len(segs), device="cuda")
    scales = amax_to_scale(fp8_amax(segs))
    ag = torch.empty(WORLD_SIZE * n, dtype=FP8_DTYPE, device="cuda")
    ag_in = ag[n : 2 * n]  # this rank's slice of the all-gather buffer
    ag_views = list(ag_in.split(sizes))
    scale_list = list(scales)

    def torchao_cast_then_copy():
        fp8 = [(s.float() * c).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE) for s, c in zip(segs, scale_list)]
        torch._foreach_copy_(ag_views, fp8)

    return [
        KernelCase(
            family="fp8_amax",
            name=f"fp32 {len(segs)} segments n={n}",
            numel=n,
            bytes_moved=n * 4,
            shardfuse=lambda: fp8_amax(segs, amax),
            baselines={
                "_foreach_norm(inf)": lambda: torch._foreach_norm(segs, float("inf")),
                "max(abs) per tensor": lambda: torch.stack([torch.max(torch.abs(s)) for s in segs]),
            },
            num_tensors=len(segs),
        ),
        KernelCase(
            family="fp8_cast",
            name=f"fp32->e4m3 {len(segs)} segments n={n}",
            numel=n,
            bytes_moved=n * (4 + 1),
            shardfuse=lambda: cast_fp8_shards(segs, scales, ag_in),
            baselines={"torchao cast+foreach_copy_": torchao_cast_then_copy},
            num_tensors=len(segs),
        ),
    ]


def cases(sizes: Sequence[int]) -> list[KernelCase]:
    """The fp8 amax and cast cases at each size (elements of the fp32 shard)."""
    return [c for n in sizes for c in _cases(n)]
