"""Benchmark cases for chunk_cat (the reduce-scatter input layout with the gradient scale and cast fused)
against ``torch._chunk_cat`` + ``div_`` (and with the per-tensor ``.to`` cast FSDP2 does first).

Inputs look like a decoder block's gradients: 2-D weights (rows x 1024) of a few sizes plus 1-D norm and
bias vectors of odd lengths, in two groupings: 8 tensors, and many small tensors (up to 1024).
World size 8, FairScale predivide 4. GPU only; tensors are built on "cuda" inside :func:`cases`.

``crossover_cases`` put tensor counts and output bytes per tensor on both sides of the rule by which
chunk_cat hands over to ``torch._chunk_cat`` (``TORCH_MIN_TENSORS``, ``TORCH_MAX_OUT_BYTES_PER_TENSOR``):
and the GPU's size crossover (``shardfuse.kernels._crossover``): each row is also timed with each path forced, so
a run shows what the rules pick and what they save (and ``python -m bench.kernels.crossover`` can fit them).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from bench.kernels.cases import TORCH_PATH, TRITON_PATH, KernelCase, forced_path
from shardfuse.kernels import _chunk_cat, _crossover
from shardfuse.kernels._chunk_cat import chunk_cat
from shardfuse.kernels._grad_divide import gradient_divide_factors

WORLD_SIZE = 8
PRE, _ = gradient_divide_factors(WORLD_SIZE)
SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
PAIRS = [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float32, torch.float32)]


def _shapes(n: int, num: int) -> list[tuple[int, ...]]:
    """About n elements in num tensors: 2-D weights with uneven row counts, then two odd 1-D vectors."""
    hidden = max(1, min(1024, n // (4 * num)))  # small sizes: narrower rows, so the total stays near n
    per = max(1, n // num // hidden)
    shapes: list[tuple[int, ...]] = [(max(1, per - 1 + i % 3), hidden) for i in range(max(1, num - 2))]
    left = max(3, n - sum(r * c for r, c in shapes))  # both vectors non-empty (torch._chunk_cat needs that)
    shapes += [(left // 2 + 1,), (left - left // 2 - 1,)]
    return shapes


def _case(n: int, num: int, src: torch.dtype, dst: torch.dtype) -> KernelCase:
    tensors = [torch.randn(s, device="cuda").to(src) for s in _shapes(n, num)]
    out = chunk_cat(tensors, WORLD_SIZE, factor=PRE, dtype=dst)

    def chunk_cat_div():
        torch._chunk_cat(tensors, 0, WORLD_SIZE, out=out)
        out.div_(PRE)

    def to_chunk_cat_div():
        torch._chunk_cat([t.to(dst) for t in tensors], 0, WORLD_SIZE, out=out)
        out.div_(PRE)

    in_bytes = sum(t.numel() * t.element_size() for t in tensors)
    return KernelCase(
        family="chunk_cat",
        name=f"{SHORT[src]}->{SHORT[dst]} {len(tensors)} tensors n={sum(t.numel() for t in tensors)}",
        numel=out.numel(),
        bytes_moved=in_bytes + out.numel() * out.element_size(),
        shardfuse=lambda: chunk_cat(tensors, WORLD_SIZE, factor=PRE, out=out),
        baselines={"to+_chunk_cat+div_": to_chunk_cat_div} if src != dst else {"_chunk_cat+div_": chunk_cat_div},
        num_tensors=len(tensors),
    )


def cases(sizes: Sequence[int]) -> list[KernelCase]:
    """chunk_cat cases at each size (total gradient elements): 8 tensors, and many small ones."""
    result = []
    for n in sizes:
        many = max(8, min(1024, n // 65536))
        result += [_case(n, 8, s, d) for s, d in PAIRS]
        if many > 8:
            result += [_case(n, many, s, d) for s, d in PAIRS[:1]]
    return result


def _crossover_case(num: int, per_tensor: int) -> KernelCase:
    """num bf16 tensors of about per_tensor elements each (uneven rows of 256), world size 8, factor 4."""
    tensors = [torch.randn(per_tensor // 256 + i % 3, 256, device="cuda").to(torch.bfloat16) for i in range(num)]
    out = chunk_cat(tensors, WORLD_SIZE, factor=PRE)

    def chunk_cat_div():
        torch._chunk_cat(tensors, 0, WORLD_SIZE, out=out)
        out.div_(PRE)

    def run():
        return chunk_cat(tensors, WORLD_SIZE, factor=PRE, out=out)

    in_bytes = sum(t.numel() * t.element_size() for t in tensors)
    nbytes = in_bytes + out.numel() * out.element_size()
    torch_side = _chunk_cat.use_torch_chunk_cat(tensors, PRE, None, out) or not _crossover.use_triton_at(
        "chunk_cat", out.device, num, nbytes
    )
    side = "torch" if torch_side else "triton"
    return KernelCase(
        family="chunk_cat_dispatch",
        name=f"bf16 {num} tensors x{per_tensor // 1024}K ({side})",
        numel=out.numel(),
        bytes_moved=nbytes,
        shardfuse=run,
        baselines={
            "_chunk_cat+div_": chunk_cat_div,
            TRITON_PATH: forced_path("triton", ["chunk_cat"], run, (_chunk_cat, "TORCH_MIN_TENSORS", 1 << 62)),
            TORCH_PATH: forced_path(
                "torch", ["chunk_cat"], run,
                (_chunk_cat, "TORCH_MAX_OUT_BYTES_PER_TENSOR", 1 << 62), (_chunk_cat, "TORCH_MIN_TENSORS", 1),
            ),
        },
        num_tensors=num,
    )


def crossover_cases() -> list[KernelCase]:
    """Counts around TORCH_MIN_TENSORS and output sizes per tensor around TORCH_MAX_OUT_BYTES_PER_TENSOR."""
    t = _chunk_cat.TORCH_MIN_TENSORS
    per_bytes = _chunk_cat.TORCH_MAX_OUT_BYTES_PER_TENSOR
    # 48-192: where the guarded-plan path once had a size crossover of its own (now the kernel at every size)
    counts = sorted({16, 48, 96, 192, t // 2, t - 1, t, min(2 * t, 1024)})
    # bf16 elements per tensor: 16 KB to 1 MB of output each (the rows of every stored run), and the threshold
    # (per_bytes // 2 elements) among them.
    sizes = sorted({8 << 10, 32 << 10, 64 << 10, 128 << 10, 256 << 10, 512 << 10, per_bytes // 2})
    return [_crossover_case(num, k) for k in sizes for num in counts if num * k <= 1 << 28]
