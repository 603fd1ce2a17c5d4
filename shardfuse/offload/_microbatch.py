"""Pytrees and microbatches: a block's tensor leaves, split along dim 0 and joined with the concat kernel."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from shardfuse.kernels._concat import concat_microbatches, split_microbatches


class Packed:
    """A pytree split into its tensor leaves (what autograd sees) and everything else (kept as is)."""

    def __init__(self, tree: Any) -> None:
        leaves, self.spec = tree_flatten(tree)
        self.tensor_pos = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        self.tensors: list[torch.Tensor] = [leaves[i] for i in self.tensor_pos]
        self._leaves = [None if isinstance(x, torch.Tensor) else x for x in leaves]

    def drop_tensors(self) -> None:
        """Forget the tensor leaves, keeping the structure: a call kept for backward must not pin them."""
        self.tensors = []

    def rebuild(self, tensors: Sequence[torch.Tensor]) -> Any:
        """The same pytree with its tensor leaves replaced by ``tensors`` (in order)."""
        leaves = list(self._leaves)
        for pos, t in zip(self.tensor_pos, tensors):
            leaves[pos] = t
        return tree_unflatten(leaves, self.spec)


# ----------------------------------------------------------------------------------------- microbatches


def microbatch_sizes(batch: int, num_microbatches: int) -> list[int]:
    """Balanced microbatch sizes (the first ``batch % n`` get one more row), like ``torch.tensor_split``."""
    if batch < num_microbatches:
        raise ValueError(
            f"batch size {batch} is smaller than num_microbatches={num_microbatches}: "
            f"use a batch of at least {num_microbatches} rows or lower num_microbatches"
        )
    base, rem = divmod(batch, num_microbatches)
    return [base + (1 if i < rem else 0) for i in range(num_microbatches)]


def batch_size_of(tensors: Sequence[torch.Tensor], what: str) -> int | None:
    """The common dim-0 size of the batched tensors (``ndim >= 1``); None when there are none."""
    sizes = {t.shape[0] for t in tensors if t.dim() >= 1}
    if len(sizes) > 1:
        shapes = [tuple(t.shape) for t in tensors]
        raise ValueError(
            f"{what}: every batched tensor must have the same size along dim 0 to be split into microbatches, "
            f"got shapes {shapes}; use num_microbatches=1 or give all inputs the batch as dim 0"
        )
    return sizes.pop() if sizes else None


def split_batch(t: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """Views of ``t`` per microbatch along dim 0; a 0-dim tensor is shared by every microbatch."""
    if len(sizes) == 1 or t.dim() == 0:
        return [t] * len(sizes)
    return split_microbatches(t, sizes)


def join_batch(parts: list[torch.Tensor]) -> torch.Tensor:
    """Join per-microbatch tensors along dim 0 with the chunked concat kernel (one launch, any dtype).

    Not differentiable: only called where autograd is not recording (inside the Function).
    """
    if len(parts) == 1:
        return parts[0]
    if parts[0].dim() == 0:
        raise ValueError(
            f"cannot join {len(parts)} microbatch results that are 0-dim tensors (shape ()): a block that reduces "
            "the batch (e.g. returns a loss) cannot be split into microbatches; use num_microbatches=1"
        )
    return concat_microbatches(parts)
