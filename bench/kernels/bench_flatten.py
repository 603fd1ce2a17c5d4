"""Padding and flattening benchmark cases: ~16 parameters <-> one flat buffer padded for world size 8.

Each case moves the fewest bytes the operation must move (each input read once, the padded output written
once); the baselines are the PyTorch sequences they replace:

- flatten_pad: ``F.pad(torch.cat([t.reshape(-1) for t in ts]), ...)`` (plus ``.to(bf16)`` with a cast),
  also on transposed (non-contiguous) parameters, where ``reshape`` has to copy first;
- unflatten_into: ``torch._foreach_copy_`` of the split views of the flat buffer into the parameters.

GPU only: every tensor is built on "cuda" inside ``cases``. The runner is ``bench/kernels/run.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from bench.kernels.cases import KernelCase
from shardfuse.kernels._flatten import flatten_pad, padded_numel, unflatten_into

FAMILY = "flatten_pad"
NUM_PARAMS = 16
WORLD_SIZE = 8
COLS = 1027  # odd row length: parameter sizes that are not multiples of anything convenient


def param_shapes(n: int) -> list[tuple[int, ...]]:
    """NUM_PARAMS shapes of about ``n`` elements in all: 2-D weights and a few 1-D biases/norms."""
    per = max(1, n // NUM_PARAMS)
    shapes: list[tuple[int, ...]] = []
    for i in range(NUM_PARAMS):
        if i % 4 == 3:
            shapes.append((per + i,))
        else:
            cols = min(COLS, per)
            shapes.append((max(1, per // cols) + (i % 3), cols))
    return shapes


def cases(sizes: Sequence[int]) -> list[KernelCase]:
    """flatten_pad (fp32, fp32->bf16, transposed inputs) and unflatten_into at each size."""
    out: list[KernelCase] = []
    for n in sizes:
        out += _cases(n)
    return out


def _cases(n: int) -> list[KernelCase]:
    dev = "cuda"
    params = [torch.randn(s, device=dev) for s in param_shapes(n)]
    # Transposed views of the same storage: the strided path (e.g. flattening W.t() parameters).
    transposed = [p.t() if p.dim() == 2 else p for p in params]
    total = sum(p.numel() for p in params)
    padded = padded_numel(total, WORLD_SIZE)
    pad = padded - total
    flat32 = torch.empty(padded, device=dev)
    flat16 = torch.empty(padded, dtype=torch.bfloat16, device=dev)

    def cat_pad(ts):
        return F.pad(torch.cat([t.reshape(-1) for t in ts]), (0, pad))

    def cast_cat_pad():
        return F.pad(torch.cat([t.reshape(-1).to(torch.bfloat16) for t in params]), (0, pad))

    tag = f"{len(params)} params ws{WORLD_SIZE} n={total}"
    unflatten = _unflatten_case(params, total, padded, tag)
    return [
        KernelCase(
            family=FAMILY,
            name=f"fp32 {tag}",
            numel=padded,
            bytes_moved=total * 4 + padded * 4,
            shardfuse=lambda: flatten_pad(params, WORLD_SIZE, out=flat32),
            baselines={"cat+pad": lambda: cat_pad(params)},
            num_tensors=len(params),
        ),
        KernelCase(
            family=FAMILY,
            name=f"fp32->bf16 {tag}",
            numel=padded,
            bytes_moved=total * 4 + padded * 2,
            shardfuse=lambda: flatten_pad(params, WORLD_SIZE, out=flat16),
            baselines={
                "cat+pad+to": lambda: cat_pad(params).to(torch.bfloat16),
                "to+cat+pad": cast_cat_pad,
            },
            num_tensors=len(params),
        ),
        KernelCase(
            family=FAMILY,
            name=f"fp32 transposed {tag}",
            numel=padded,
            bytes_moved=total * 4 + padded * 4,
            shardfuse=lambda: flatten_pad(transposed, WORLD_SIZE, out=flat32),
            baselines={"cat+pad": lambda: cat_pad(transposed)},
            num_tensors=len(params),
        ),
        unflatten,
    ]


def _unflatten_case(params: list[torch.Tensor], total: int, padded: int, tag: str) -> KernelCase:
    """unflatten_into from a padded flat buffer into ``params``' shapes, against ``_foreach_copy_`` of its views."""
    outs = [torch.empty_like(p) for p in params]
    src = torch.randn(padded, device=params[0].device)
    views = [v.view(p.shape) for v, p in zip(src[:total].split([p.numel() for p in params]), params)]
    return KernelCase(
        family="unflatten",
        name=f"fp32 unflatten_into {tag}",
        numel=total,
        bytes_moved=total * 4 * 2,
        shardfuse=lambda: unflatten_into(src, outs),
        baselines={"foreach_copy_": lambda: torch._foreach_copy_(outs, views)},
        num_tensors=len(params),
    )
