"""The single doorway from the sharding layer to the shardfuse kernels.

Every byte the wrapper moves through a kernel goes through one of these functions, so the kernels can be
swapped, instrumented or checked in one place.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shardfuse.kernels import (
    cast_shard,
    flatten_pad,
    gradient_divide_factors,
    post_divide,
    pre_divide_pad,
    unflatten_into,
)

__all__ = [
    "cast_into",
    "default_divide_factors",
    "flatten_padded",
    "reduce_input",
    "reduce_output",
    "unflatten",
]


def flatten_padded(tensors: Sequence[torch.Tensor], world_size: int, dtype: torch.dtype) -> torch.Tensor:
    """One new flat ``dtype`` buffer holding ``tensors`` back to back, zero-padded to a multiple of ``world_size``."""
    if not tensors:
        return torch.empty(0, dtype=dtype)
    return flatten_pad(list(tensors), world_size, dtype=dtype)


def cast_into(src: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Cast (or copy) ``src`` into ``out`` in one pass; ``out`` may be a slice of the all-gather buffer."""
    return cast_shard(src, out=out)


def unflatten(flat: torch.Tensor, outs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Copy consecutive slices of ``flat`` into ``outs`` (casting to each one's dtype)."""
    return unflatten_into(flat, list(outs))


def default_divide_factors(world_size: int) -> tuple[float, float]:
    """FairScale's default ``(predivide, postdivide)`` for ``world_size`` ranks."""
    return gradient_divide_factors(world_size)


def reduce_input(grad: torch.Tensor, out: torch.Tensor, predivide: float) -> torch.Tensor:
    """``out[:n] = (grad / predivide).to(out.dtype)``, padding zeroed: the reduce-scatter input."""
    return pre_divide_pad(grad, out, predivide)


def reduce_output(src: torch.Tensor, out: torch.Tensor, postdivide: float, accumulate: bool) -> torch.Tensor:
    """``out (+)= (src / postdivide).to(out.dtype)``: the reduce-scatter output into the sharded gradient."""
    return post_divide(src, out, postdivide, accumulate=accumulate)
