"""Benchmark cases for concat_microbatches (one launch into a preallocated buffer) against ``torch.cat``
of 4 microbatches (allocating, and with ``out=``), as the offloaded model joins each slice's
per-microbatch outputs. Microbatches are uneven, as ``torch.chunk`` gives them. The row's own time is the entry
point as users call it (``torch.cat`` below the GPU's size crossover, ``shardfuse.kernels._crossover``); the
kernel itself is timed beside it (``triton path``), which ``python -m bench.kernels.crossover`` fits on.
GPU only; tensors are built on "cuda" inside :func:`cases`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from bench.kernels.cases import TRITON_PATH, KernelCase, forced_path
from shardfuse.kernels._concat import concat_microbatches

NUM_MICROBATCHES = 4
HIDDEN = 2048
SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _case(n: int, dtype: torch.dtype) -> KernelCase:
    # (rows, hidden) activations with an odd row count, so the microbatches are uneven.
    hidden = HIDDEN if n >= 4 * HIDDEN else 1
    rows = max(NUM_MICROBATCHES, n // hidden - 1)
    full = torch.randn(rows, hidden, device="cuda").to(dtype)
    parts = [p.clone() for p in full.chunk(NUM_MICROBATCHES)]  # separate allocations, like real outputs
    out = torch.empty_like(full)
    return KernelCase(
        family="concat",
        name=f"{SHORT[dtype]} {len(parts)}x uneven n={full.numel()}",
        numel=full.numel(),
        bytes_moved=2 * full.numel() * full.element_size(),
        shardfuse=lambda: concat_microbatches(parts, out=out),  # the entry point: torch.cat below the crossover
        baselines={
            "torch.cat": lambda: torch.cat(parts),
            "torch.cat(out=)": lambda: torch.cat(parts, out=out),
            TRITON_PATH: forced_path("triton", ["concat"], lambda: concat_microbatches(parts, out=out)),
        },
        num_tensors=len(parts),
    )


def cases(sizes: Sequence[int]) -> list[KernelCase]:
    """Concat cases at each size (total output elements), bf16 and fp32."""
    return [_case(n, dtype) for n in sizes for dtype in (torch.bfloat16, torch.float32)]
