"""Benchmark cases for gradient pre-/post-division against the PyTorch sequences they replace.

Pre-division (before reduce-scatter, world size 8, FairScale predivide 4): shardfuse's one pass versus
``F.pad(g.div(f), ...).to(reduce_dtype)`` (allocating), the preallocated ``div`` + ``copy_`` (cast) + padding
``zero_``, and FSDP2's ``foreach_reduce`` sequence (``.to(reduce_dtype)``, ``div_``, ``_chunk_cat``).
Post-division (after reduce-scatter, postdivide 2): shardfuse versus ``div`` + ``.to`` + ``copy_``/``add_``.
Every row times what the sharding runtime runs after each backward, marked ``[runtime]``: the trusted launches
``pre_divide_pad_unchecked`` (one flat gradient) and ``post_divide_unchecked``, the same kernels as the public
``pre_divide_pad`` / ``post_divide`` without their argument checks. The public list form of ``pre_divide_pad``
is not timed here (the runtime never uses it).
GPU only; tensors are built on "cuda" inside :func:`cases`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from bench.kernels.cases import KernelCase
from shardfuse.kernels._grad_divide import gradient_divide_factors, post_divide_unchecked, pre_divide_pad_unchecked

WORLD_SIZE = 8
PRE, POST = gradient_divide_factors(WORLD_SIZE)
SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}

# (gradient dtype, reduce dtype): fp32 params, bf16 compute with fp32 or bf16 reduce-scatter.
PRE_PAIRS = [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16)]
# (reduce-scatter output dtype, sharded gradient dtype, accumulate)
POST_CASES = [
    (torch.float32, torch.float32, False),
    (torch.float32, torch.float32, True),
    (torch.bfloat16, torch.float32, True),
]


def _pre_case(n: int, gd: torch.dtype, rd: torch.dtype) -> KernelCase:
    # An odd gradient length, so the padded buffer really has padding to zero.
    grad_numel = n - 3 if n > 3 else n
    total = -(-grad_numel // WORLD_SIZE) * WORLD_SIZE
    pad = total - grad_numel
    g = torch.randn(grad_numel, device="cuda").to(gd)
    out = torch.empty(total, device="cuda", dtype=rd)
    scratch = torch.empty(grad_numel, device="cuda", dtype=rd)

    def div_copy_zero():
        torch.div(g.to(rd), PRE, out=scratch)  # .to is a no-op when the dtypes agree
        out[:grad_numel].copy_(scratch)
        out[grad_numel:].zero_()

    def fsdp2_foreach_reduce():
        x = g.to(rd)  # _to_dtype_if_needed (a no-op when the dtypes agree)
        torch.div(x, PRE, out=scratch)  # div_ in FSDP2; out-of-place here so repeats do not decay to 0
        torch._chunk_cat([scratch], 0, WORLD_SIZE, out=out.view(WORLD_SIZE, -1))

    return KernelCase(
        family="pre_divide",
        name=f"{SHORT[gd]}->{SHORT[rd]} [runtime] n={grad_numel} ws={WORLD_SIZE}",
        numel=total,
        bytes_moved=grad_numel * g.element_size() + total * out.element_size(),
        shardfuse=lambda: pre_divide_pad_unchecked(g, out, PRE),
        baselines={
            "F.pad(div).to": lambda: F.pad(g.div(PRE), (0, pad)).to(rd),
            "div+copy_+zero_": div_copy_zero,
            "fsdp2 to+div_+_chunk_cat": fsdp2_foreach_reduce,
        },
    )


def _post_case(n: int, sd: torch.dtype, od: torch.dtype, accumulate: bool) -> KernelCase:
    src = torch.randn(n, device="cuda").to(sd)
    out = torch.randn(n, device="cuda").to(od)

    if accumulate:
        baseline = {"div.to+add_": lambda: out.add_(src.div(POST).to(od))}
    else:
        baseline = {"div.to+copy_": lambda: out.copy_(src.div(POST).to(od))}
    return KernelCase(
        family="post_divide",
        name=f"{SHORT[sd]}->{SHORT[od]} {'+=' if accumulate else '='} [runtime] n={n}",
        numel=n,
        bytes_moved=n * src.element_size() + n * out.element_size() * (2 if accumulate else 1),
        shardfuse=lambda: post_divide_unchecked(src, out, POST, accumulate=accumulate),
        baselines=baseline,
    )


def cases(sizes: Sequence[int]) -> list[KernelCase]:
    """Pre- and post-division cases at each size (elements of the gradient / of the shard)."""
    result = []
    for n in sizes:
        result += [_pre_case(n, gd, rd) for gd, rd in PRE_PAIRS]
        result += [_post_case(n, sd, od, acc) for sd, od, acc in POST_CASES]
    return result
