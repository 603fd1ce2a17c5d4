"""The public ``pre_divide_pad``: one gradient, or a list of gradients in one launch through a pointer table.

The list form serves the public API and the sharding runtime's gradients kept apart by the unflatten node
(``sharding/core/_fused_grads.py``, through ``_data_path.pre_divide_pad_pieces``); a flat gradient goes to
``_grad_divide.pre_divide_pad_unchecked`` directly. The multi-tensor kernel, its launch plans and their cache
live here. A list's plan (the metadata table and launch arguments) is cached per set of tensors and stream, found
by their addresses (``_common.guarded_key``) and checked by one C++ guard of their layouts (``_common.layout_guard``):
a repeat call skips validation, table building and the host-to-device copy. The runtime's gradients come back with
the same shapes at other addresses every step (autograd allocates them anew): a plan is also found by the shapes
(``_BY_SHAPE``), and then, after the call is validated, only the changed source addresses of its device table are
rewritten, by one ``torch._foreach_add_`` whose operands travel as launch arguments. Not by a host-to-device copy:
copies share the GPU's copy engine in the order they were queued, so behind megabytes of other host-to-device
traffic (activation offload bringing activations back, uploads of offloaded parameters) the backward would stall on
a table of a few hundred bytes.

Layout: ``@triton.jit`` kernel, plan, launcher (``pre_divide_pad``); the reference is
``_grad_divide.pre_divide_pad_ref``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from shardfuse._profiling import profiled
from shardfuse.kernels import _common as common
from shardfuse.kernels._grad_divide import (
    _pre_divide_pad_torch,
    check_pre_divide_pad,
    pre_divide_pad_unchecked,
    scale_block,
)
from shardfuse.kernels._launch import DirectLauncher

__all__ = ["pre_divide_pad"]

_FOREACH_ADD = hasattr(torch, "_foreach_add_")
_PLANS = common.GuardedPlanCache()  # by the addresses of the gradients and out (``common.guarded_key``)
_BY_SHAPE = common.GuardedPlanCache()  # the same plans by the stream, the overrides and the tensors' sizes


# ----------------------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------------------

@triton.jit
def _pre_divide_pad_multi_kernel(
    meta_ptr,
    like_ptr,
    out_ptr,
    num_tensors,
    n_total,
    total,
    factor,
    DIVIDE: tl.constexpr,
    MULTIPLY: tl.constexpr,
    ALIGNED: tl.constexpr,
    OUT_VEC: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Many tensors in one launch. meta (int64) = [src pointers | numels | out offsets | block starts (T+1) |
    owner of every tensor block].

    Program ids map to (tensor, block) through the per-tensor block-start prefix table; programs past the
    last tensor block zero the padding out[n_total:total].
    """
    pid = tl.program_id(0).to(tl.int64)
    numel_tab = meta_ptr + num_tensors
    offset_tab = meta_ptr + 2 * num_tensors
    start_tab = meta_ptr + 3 * num_tensors
    pad_start = tl.load(start_tab + num_tensors)
    if pid >= pad_start:
        offs = n_total + (pid - pad_start) * BLOCK + tl.arange(0, BLOCK)
        zero = tl.zeros([BLOCK], dtype=tl.float32)
        tl.store(out_ptr + offs, zero.to(out_ptr.dtype.element_ty), mask=offs < total)
    else:
        # One load finds the tensor (the host built the owner column); empty tensors own no program.
        lo = tl.load(start_tab + num_tensors + 1 + pid)
        n = tl.load(numel_tab + lo)
        src_addr = tl.load(meta_ptr + lo)
        dst_off = tl.load(offset_tab + lo)
        if ALIGNED:
            # The host checked: every source is 16-byte aligned and every destination offset is a
            # multiple of 16 bytes, which lets the full blocks use 16-byte accesses.
            src_addr = tl.multiple_of(src_addr, 16)
            dst_off = tl.multiple_of(dst_off, OUT_VEC)
        src = src_addr.to(tl.pointer_type(like_ptr.dtype.element_ty))
        dst = out_ptr + dst_off
        start = (pid - tl.load(start_tab + lo)) * BLOCK
        scale_block(src, dst, start, n, n, factor, DIVIDE, MULTIPLY, BLOCK)



# ----------------------------------------------------------------------------------------------------------
# Plans and launchers
# ----------------------------------------------------------------------------------------------------------


_pre_divide_pad_multi_launch = DirectLauncher(_pre_divide_pad_multi_kernel)


class _Sources:
    """The source-address column of a plan's device table as the device will hold it once the work queued so far
    has run, and what the plan may take from those addresses. Every change is queued on the plan's stream (part of
    both keys), after the launches that read the old addresses; ``lock`` makes compare, rewrite and launch one step
    for threads sharing a stream (docs/concurrency.md)."""

    __slots__ = ("addresses", "aligned", "column", "lock", "offsets_aligned", "views")

    def __init__(self, table: torch.Tensor, addresses: tuple[int, ...], offsets_aligned: bool) -> None:
        num = len(addresses) - 1  # the last address is out's: a launch argument, not in the table
        self.column = table[:num]
        self.views: list[torch.Tensor] | None = None  # one per entry, made by the first rewrite
        self.offsets_aligned = offsets_aligned
        self.addresses = addresses
        self.aligned = offsets_aligned and all(p % 16 == 0 for p in addresses[:num])
        self.lock = threading.Lock()

    def rewrite(self, addresses: tuple[int, ...]) -> None:
        """Point the table at ``addresses`` (the gradients', then out's: a validated call's): only the entries
        that changed, each by the difference, in one launch (never run while a CUDA graph is captured: the
        keys are None then, so no plan is found to rewrite)."""
        num = self.column.numel()
        changed = [i for i in range(num) if addresses[i] != self.addresses[i]]
        if changed:
            if self.views is None:
                self.views = list(self.column.unbind())
            views = [self.views[i] for i in changed]
            deltas = [addresses[i] - self.addresses[i] for i in changed]
            if _FOREACH_ADD:
                torch._foreach_add_(views, deltas)
            else:  # one launch per entry, each value still a launch argument
                for view, delta in zip(views, deltas):
                    view.add_(delta)
        self.addresses = addresses
        self.aligned = self.offsets_aligned and all(p % 16 == 0 for p in addresses[:num])


class _Plan(NamedTuple):
    device: torch.device
    grid: int
    table: torch.Tensor
    num_tensors: int
    n: int  # gradient elements; out[n:] is padding
    total: int  # out.numel()
    like: int  # index of a non-empty gradient (types the source addresses); -1: none
    sources: _Sources  # the addresses the table holds; aligned given a 16-byte aligned out
    out_vec: int
    check: Callable[..., bool] | None = None  # the layout guard of the gradients and out it was built for


def _plan_multi(grads: list[torch.Tensor], out_flat: torch.Tensor, n: int) -> _Plan:
    numels = [g.numel() for g in grads]
    offsets = common.block_starts(numels)
    counts = [-(-k // common.BLOCK_SIZE) for k in numels]
    total = out_flat.numel()
    pad_blocks = -(-(total - n) // common.BLOCK_SIZE)
    ptrs = [g.data_ptr() for g in grads]
    out_vec = 16 // out_flat.element_size()
    starts = [*common.block_starts(counts), sum(counts)]  # T + 1: the last is the first padding program
    meta = common.block_table([ptrs, numels, offsets, starts], counts, out_flat.device)
    # `like` only types the source pointers: a non-empty tensor (empty CUDA tensors have null pointers).
    like = next((i for i, k in enumerate(numels) if k), -1)
    sources = _Sources(meta, (*ptrs, out_flat.data_ptr()), all(o % out_vec == 0 for o in offsets))
    return _Plan(out_flat.device, sum(counts) + pad_blocks, meta, len(grads), n, total, like, sources, out_vec)


def _run_multi(plan: _Plan, grads: list[torch.Tensor], out_flat: torch.Tensor, factor: float) -> None:
    if not plan.total:
        return
    kernel_factor, divide, multiply = common.scale_args(factor)
    aligned = plan.sources.aligned and out_flat.data_ptr() % 16 == 0
    src_like = out_flat if plan.like < 0 else grads[plan.like]
    with common.device_guard(plan.device):
        _pre_divide_pad_multi_launch[(plan.grid,)](
            plan.table, src_like, out_flat, plan.num_tensors, plan.n, plan.total, kernel_factor, DIVIDE=divide,
            MULTIPLY=multiply, ALIGNED=aligned, OUT_VEC=plan.out_vec, BLOCK=common.BLOCK_SIZE,
            num_warps=common.NUM_WARPS,
        )

def pre_divide_pad(grads: torch.Tensor | Sequence[torch.Tensor], out: torch.Tensor, factor: float) -> torch.Tensor:
    """Scale, cast and pad gradients into the reduce-scatter input, in one pass.

    ``out[:n] = (cat([g.flatten() for g in grads]).float() / factor).to(out.dtype)`` and ``out[n:] = 0``,
    where ``n`` is the total number of gradient elements. ``out`` must be contiguous with
    ``out.numel() >= n`` (typically ``n`` rounded up to a multiple of the world size), and must not overlap
    the gradients (a gradient that is exactly its own slice of ``out`` is scaled in place). A list of
    gradients (one dtype, each contiguous) is handled in a single launch through a pointer table.
    ``factor == 1`` skips the division but still casts and pads. Returns ``out``.
    """
    grads = [grads] if isinstance(grads, torch.Tensor) else common.as_list(grads)
    if isinstance(grads, list) and len(grads) > 1:
        return _pre_divide_pad_list(grads, out, factor)
    grads, _, factor = check_pre_divide_pad(grads, out, factor)
    return pre_divide_pad_unchecked(grads[0], out, factor)


def _pre_divide_pad_list(grads: list[torch.Tensor], out: torch.Tensor, factor: float) -> torch.Tensor:
    with profiled("shardfuse.kernels:pre_divide_pad"):
        # Every tensor the plan reads and writes: the key holds their addresses, the plan their layout guard (the
        # factor is checked on every call: the launch takes it, the table does not).
        guarded = [*grads, out]
        key = common.guarded_key(guarded)
        plan = _PLANS.get(key, guarded)
        if plan is not None and key is not None:
            with plan.sources.lock:
                if plan.sources.addresses == key[-1]:  # the table holds these addresses: a validated call's
                    _run_multi(plan, grads, out.view(-1), common.check_factor(factor))
                    return out
        grads, n, factor = check_pre_divide_pad(grads, out, factor)
        if not common.use_triton(*grads, out):
            return _pre_divide_pad_torch(grads, out, n, factor)
        if out.numel() == 0:
            return out
        out_flat = out.view(-1)
        shape_key = None if key is None else (*key[:-1], tuple(map(torch.Tensor.numel, guarded)))
        plan = _BY_SHAPE.get(shape_key, guarded)
        if plan is None:
            plan = _plan_multi(grads, out_flat, n)
            if key is not None:
                plan = plan._replace(check=common.layout_guard(guarded))
                _BY_SHAPE.put(shape_key, plan)
        if key is None:
            _run_multi(plan, grads, out_flat, factor)
            return out
        _PLANS.put(key, plan)
        with plan.sources.lock:
            plan.sources.rewrite(key[-1])
            _run_multi(plan, grads, out_flat, factor)
        return out
