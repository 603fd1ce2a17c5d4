"""The gathered flat parameter unflattened into its parameters' views by one autograd node whose backward keeps
the views' gradients apart: the reduction pre-divides them straight into the padded reduce-scatter input, one
multi-tensor launch, where ``torch.split_with_sizes``'s backward would first concatenate them into a full flat
gradient (one more write and read of every gradient byte) for the pre-divide to copy again.

The flat buffer ``full_param`` is not an input of the node (its views are made inside it, so they still share
its storage and version counter): the node's backward returns nothing for it, and its gradient accumulator
never runs. Instead every node feeds an empty leaf, the handle's ``grad_token``, so the engine runs the token's
accumulator once per backward pass after the last node of the handle, as it ran ``full_param``'s: the token's
post-accumulate hook is the post-backward hook of this path.

Exactness: what the backward keeps (:func:`add_contribution`) and what the hook makes of it
(:func:`materialize`) are elementwise the sums the engine and ``AccumulateGrad`` form from the concatenated
gradients (zeros where a view got none), so the reduce-scatter input is the same bytes either way.
"""

from __future__ import annotations

import os
import weakref
from typing import Any, Protocol

import torch

from shardfuse.sharding.core._step_state import HandleStep


class FlatParamHandle(Protocol):
    """What this module reads of a ``_flat_param.FlatParamHandle`` (which imports this module)."""

    split_sizes: list[int]
    shapes: list[torch.Size]
    numels: list[int]
    numel: int
    padded_numel: int
    full_param: torch.Tensor | None
    step: HandleStep

    def made(self, full: torch.Tensor | None) -> torch.Tensor: ...

FUSED_GRADS_ENV = "SHARDFUSE_FUSED_GRADS"


def requested_by_environment() -> bool | None:
    """``SHARDFUSE_FUSED_GRADS``: ``1`` this path, ``0`` the concatenating one, for every handle initialised from
    now on (read at each unit's lazy init), whatever ``FlatParamHandle.fuse_grads`` says; None when unset (the
    class attribute decides: on by default)."""
    value = os.environ.get(FUSED_GRADS_ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{FUSED_GRADS_ENV}={value!r}: set it to 1 (the fused gradient pre-divide, the default) or "
                         f"0 (the concatenating path), or unset it")
    return None if value == "" else value == "1"


# What a handle's views received in this backward pass: their gradients (None: no gradient), or, once a second
# node of the handle contributed, their sum as one padded flat gradient.
Stash = list[torch.Tensor | None] | torch.Tensor


class Unflatten(torch.autograd.Function):
    """``(token, [full_param], handle)`` -> the parameters' views of ``full_param``; backward: stash the views'
    gradients on the handle, an empty gradient for the token."""

    @staticmethod
    def forward(ctx: Any, token: torch.Tensor, box: list[torch.Tensor], handle: FlatParamHandle) -> tuple:
        ctx.set_materialize_grads(False)  # a view without gradient stays None: no zeros made for it here
        ctx.handle = weakref.ref(handle)  # a graph the user keeps must not keep the model alive
        ctx.token_meta = (token.dtype, token.device)
        chunks = torch.split_with_sizes(box[0], handle.split_sizes)
        return tuple(c.view(s) for c, s in zip(chunks, handle.shapes))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor, None, None]:
        handle = ctx.handle()
        if handle is not None:
            handle.step.fused = add_contribution(handle, handle.step.fused, grads)
        dtype, device = ctx.token_meta
        return torch.empty(0, dtype=dtype, device=device), None, None


def flat_of(handle: FlatParamHandle, grads: list[torch.Tensor | None] | tuple) -> torch.Tensor:
    """The padded flat gradient ``split_with_sizes``'s backward makes of the views' gradients (zeros for a view
    without one and for the padding tail)."""
    full = handle.made(handle.full_param)
    parts = [torch.zeros(n, dtype=full.dtype, device=full.device) if g is None else g.reshape(-1)
             for g, n in zip(grads, handle.numels)]
    parts.append(torch.zeros(handle.padded_numel - handle.numel, dtype=full.dtype, device=full.device))
    return torch.cat(parts)


def accumulate_into(handle: FlatParamHandle, flat: torch.Tensor, grads: list[torch.Tensor | None] | tuple) -> None:
    """``flat += flat_of(grads)`` piece by piece, without making the concatenation: the same elementwise sums
    (a view without gradient still adds its zeros: -0.0 + 0.0 is +0.0; the padding tail is +0.0 already)."""
    offset = 0
    for g, n in zip(grads, handle.numels):
        piece = flat.narrow(0, offset, n)
        if g is None:
            piece.add_(0.0)
        else:
            piece.add_(g.reshape(-1))
        offset += n


def add_contribution(handle: FlatParamHandle, stash: Stash | None, grads: tuple) -> Stash:
    """The stash after one more node's gradients: kept apart while there is one, summed into a flat gradient (in
    arrival order, as the engine sums the gradients of one accumulator's inputs) from the second on."""
    if stash is None:
        return list(grads)
    flat = stash if isinstance(stash, torch.Tensor) else flat_of(handle, stash)
    accumulate_into(handle, flat, grads)
    return flat


def materialize(handle: FlatParamHandle, full_param: torch.Tensor, stash: Stash) -> None:
    """Into ``full_param.grad`` what ``AccumulateGrad`` would have put there from the concatenated gradient: set
    when there is none, added otherwise (``no_sync`` accumulation)."""
    held = full_param.grad
    if held is None:
        full_param.grad = stash if isinstance(stash, torch.Tensor) else flat_of(handle, stash)
    elif isinstance(stash, torch.Tensor):
        held.add_(stash)
    else:
        accumulate_into(handle, held, stash)
