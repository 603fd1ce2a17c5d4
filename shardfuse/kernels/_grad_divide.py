"""Gradient pre-/post-division: the scale-cast-pad pass before reduce-scatter and the scale-cast-(accumulate)
pass after it.

FairScale divides the gradient by ``predivide`` before the reduce-scatter (so fp16 sums do not overflow) and
by ``postdivide`` after it, with ``predivide * postdivide == world_size``. FSDP2 spends one kernel on the
``div_``, one on the cast and one on the copy into the padded reduce-scatter input; here each side is one
pass over memory:

- :func:`pre_divide_pad` — ``out[:n] = (cat(grads).float() / factor).to(out.dtype)``, ``out[n:] = 0``.
- :func:`post_divide` — ``out = (src.float() / factor).to(out.dtype)``, or with ``accumulate=True``
  ``out = (out.float() + src.float() / factor).to(out.dtype)`` (gradient accumulation into the shard).

Division is IEEE round-to-nearest in fp32 (``div_rn``), or a multiply by the reciprocal where that is the
same (power-of-two factors, the usual ones: see ``scale_args``). Note that PyTorch on CUDA computes
``tensor / python_scalar`` as ``tensor * (1 / scalar)``, which can differ from true division by one ulp for
factors that are not powers of two; the references here divide by a device tensor, which is true division.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from shardfuse._profiling import profiled
from shardfuse.kernels import _common as common
from shardfuse.kernels._common import apply_scale
from shardfuse.kernels._overlap import check_no_overlap, meets

_PLANS = common.PlanCache()
_IN_PLACE_FIX = "use separate buffers (a tensor written in place, src is out, is fine)"

__all__ = [
    "gradient_divide_factors",
    "pre_divide_pad",
    "post_divide",
    "pre_divide_pad_ref",
    "post_divide_ref",
]


# ----------------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _scale_block(src, dst, start, n, limit, factor, DIVIDE: tl.constexpr, MULTIPLY: tl.constexpr,
                 BLOCK: tl.constexpr):
    """dst[i] = cast(src[i] / factor) in fp32 for the BLOCK elements from ``start``; elements in [n, limit)
    are the padding and come out zero (masked-off loads read 0, and 0 / factor == +0)."""
    offs = start + tl.arange(0, BLOCK)
    if start + BLOCK <= n:
        # Full block: no mask, so the accesses vectorise whatever n is.
        x = tl.load(src + offs).to(tl.float32)
        x = apply_scale(x, factor, DIVIDE, MULTIPLY)
        tl.store(dst + offs, x.to(dst.dtype.element_ty))
    else:
        x = tl.load(src + offs, mask=offs < n, other=0.0).to(tl.float32)
        x = apply_scale(x, factor, DIVIDE, MULTIPLY)
        tl.store(dst + offs, x.to(dst.dtype.element_ty), mask=offs < limit)


@triton.jit
def _pre_divide_pad_kernel(
    src_ptr, out_ptr, n, total, factor, DIVIDE: tl.constexpr, MULTIPLY: tl.constexpr, BLOCK: tl.constexpr
):
    """One tensor: out[:n] = cast(src / factor), out[n:total] = 0."""
    # int64 before multiplying: a flat gradient can pass 2^31 elements.
    start = tl.program_id(0).to(tl.int64) * BLOCK
    _scale_block(src_ptr, out_ptr, start, n, total, factor, DIVIDE, MULTIPLY, BLOCK)


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
        _scale_block(src, dst, start, n, n, factor, DIVIDE, MULTIPLY, BLOCK)


@triton.jit
def _post_divide_kernel(
    src_ptr, out_ptr, n, factor, DIVIDE: tl.constexpr,
    MULTIPLY: tl.constexpr, ACCUMULATE: tl.constexpr, BLOCK: tl.constexpr
):
    """out = cast(src / factor), or out = cast(out + src / factor); all arithmetic in fp32."""
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    if start + BLOCK <= n:
        x = tl.load(src_ptr + offs).to(tl.float32)
        x = apply_scale(x, factor, DIVIDE, MULTIPLY)
        if ACCUMULATE:
            x = tl.load(out_ptr + offs).to(tl.float32) + x
        tl.store(out_ptr + offs, x.to(out_ptr.dtype.element_ty))
    else:
        mask = offs < n
        x = tl.load(src_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        x = apply_scale(x, factor, DIVIDE, MULTIPLY)
        if ACCUMULATE:
            x = tl.load(out_ptr + offs, mask=mask, other=0.0).to(tl.float32) + x
        tl.store(out_ptr + offs, x.to(out_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------------------
# Launchers (public API)
# ----------------------------------------------------------------------------------------------------------


def gradient_divide_factors(world_size: int) -> tuple[float, float]:
    """FairScale's default ``(predivide, postdivide)`` factors for ``world_size`` ranks.

    ``predivide`` is the power of two reached by doubling from 1 while ``world_size % f == 0`` and
    ``world_size / f > f`` (about sqrt(world_size), so fp16 partial sums neither overflow nor underflow);
    ``postdivide = world_size / predivide``, so ``predivide * postdivide == world_size``. For example
    1 -> (1, 1), 2 -> (2, 1), 4 -> (2, 2), 6 -> (4, 1.5), 8 -> (4, 2).
    """
    world_size = common.check_world_size(world_size, "gradient_divide_factors")
    factor = 1
    while world_size % factor == 0 and world_size / factor > factor:
        factor *= 2
    return float(factor), world_size / factor


def _as_list(grads: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(grads, torch.Tensor):
        return [grads]
    grads = common.check_tensors(grads, "grads")
    if not grads:
        raise ValueError("pre_divide_pad got an empty list of gradients: pass at least one tensor")
    return grads


def _validate_pre_divide(grads: list[torch.Tensor], out: torch.Tensor, factor: float) -> tuple[int, float]:
    names = [f"grads[{i}]" for i in range(len(grads))]
    for g, name in zip(grads, names):
        common.check_float(g, name)
        if not g.is_contiguous():
            raise ValueError(
                f"{name} is not contiguous (shape={tuple(g.shape)} stride={g.stride()}): call .contiguous() on it first"
            )
    dtypes = {g.dtype for g in grads}
    if len(dtypes) > 1:
        raise TypeError(
            f"pre_divide_pad needs all grads in one dtype, got {sorted(str(d) for d in dtypes)}: "
            f"group them by dtype and call once per group"
        )
    common.check_tensor(out, "out")
    common.check_same_device([*grads, out], [*names, "out"])
    n = sum(g.numel() for g in grads)
    common.check_out(out, n)
    factor = common.check_factor(factor)
    if any(meets(g, out) for g in grads):
        # Each gradient element is read and written by the same lane, so a gradient that is exactly its own
        # slice of out is scaled in place; any other overlap (the padding included) is not safe.
        out_flat, offsets = out.view(-1), common.block_starts([g.numel() for g in grads])
        writes = [(f"out[{o}:{o + g.numel()}]", out_flat[o : o + g.numel()]) for o, g in zip(offsets, grads)]
        writes.append((f"out[{n}:]", out_flat[n:]))
        check_no_overlap("pre_divide_pad", list(zip(names, grads)), writes, _IN_PLACE_FIX, in_place=True)
    return n, factor


def pre_divide_pad(grads: torch.Tensor | Sequence[torch.Tensor], out: torch.Tensor, factor: float) -> torch.Tensor:
    """Scale, cast and pad gradients into the reduce-scatter input, in one pass.

    ``out[:n] = (cat([g.flatten() for g in grads]).float() / factor).to(out.dtype)`` and ``out[n:] = 0``,
    where ``n`` is the total number of gradient elements. ``out`` must be contiguous with
    ``out.numel() >= n`` (typically ``n`` rounded up to a multiple of the world size), and must not overlap
    the gradients (a gradient that is exactly its own slice of ``out`` is scaled in place). A list of
    gradients (one dtype, each contiguous) is handled in a single launch through a pointer table.
    ``factor == 1`` skips the division but still casts and pads. Returns ``out``.
    """
    with profiled("shardfuse.kernels:pre_divide_pad"):
        grads = [grads] if isinstance(grads, torch.Tensor) else common.as_list(grads)
        key = _multi_key(grads, out) if isinstance(grads, list) and len(grads) > 1 else None
        plan = _PLANS.get(key)
        if plan is not None:
            _run_multi(plan, grads, out.view(-1), common.check_factor(factor))
            return out
        grads = _as_list(grads)
        n, factor = _validate_pre_divide(grads, out, factor)
        if not common.use_triton(*grads, out):
            return pre_divide_pad_ref(grads, out, factor)
        total = out.numel()
        if total == 0:
            return out
        out_flat = out.view(-1)
        if len(grads) == 1:
            # An empty CUDA tensor has a null data pointer, which Triton may refuse; its loads are all
            # masked off anyway, so any valid pointer will do.
            src = grads[0] if n else out_flat
            kernel_factor, divide, multiply = common.scale_args(factor)
            with common.device_guard(out.device):
                _pre_divide_pad_kernel[(-(-total // common.BLOCK_SIZE),)](
                    src, out_flat, n, total, kernel_factor, DIVIDE=divide, MULTIPLY=multiply, BLOCK=common.BLOCK_SIZE,
                    num_warps=common.NUM_WARPS,
                )
            return out
        plan = _plan_multi(grads, out_flat, n)
        _PLANS.put(key, plan)
        _run_multi(plan, grads, out_flat, factor)
        return out


class _Plan(NamedTuple):
    device: torch.device
    grid: int
    table: torch.Tensor
    num_tensors: int
    n: int  # gradient elements; out[n:] is padding
    total: int  # out.numel()
    like: int  # index of a non-empty gradient (types the source addresses); -1: none
    aligned: bool  # given a 16-byte aligned out
    out_vec: int


@common.plan_key
def _multi_key(grads: list[torch.Tensor], out: torch.Tensor):
    return out.device, (common.tensor_key(out), common.tensors_key(grads, "flat"))


def _plan_multi(grads: list[torch.Tensor], out_flat: torch.Tensor, n: int) -> _Plan:
    numels = [g.numel() for g in grads]
    offsets = common.block_starts(numels)
    counts = [-(-k // common.BLOCK_SIZE) for k in numels]
    total = out_flat.numel()
    pad_blocks = -(-(total - n) // common.BLOCK_SIZE)
    ptrs = [g.data_ptr() for g in grads]
    out_vec = 16 // out_flat.element_size()
    aligned = all(p % 16 == 0 for p in ptrs) and all(o % out_vec == 0 for o in offsets)
    starts = [*common.block_starts(counts), sum(counts)]  # T + 1: the last is the first padding program
    meta = common.block_table([ptrs, numels, offsets, starts], counts, out_flat.device)
    # `like` only types the source pointers: a non-empty tensor (empty CUDA tensors have null pointers).
    like = next((i for i, k in enumerate(numels) if k), -1)
    return _Plan(out_flat.device, sum(counts) + pad_blocks, meta, len(grads), n, total, like, aligned, out_vec)


def _run_multi(plan: _Plan, grads: list[torch.Tensor], out_flat: torch.Tensor, factor: float) -> None:
    if not plan.total:
        return
    kernel_factor, divide, multiply = common.scale_args(factor)
    aligned = plan.aligned and out_flat.data_ptr() % 16 == 0
    src_like = out_flat if plan.like < 0 else grads[plan.like]
    with common.device_guard(plan.device):
        _pre_divide_pad_multi_kernel[(plan.grid,)](
            plan.table, src_like, out_flat, plan.num_tensors, plan.n, plan.total, kernel_factor, DIVIDE=divide,
            MULTIPLY=multiply, ALIGNED=aligned, OUT_VEC=plan.out_vec, BLOCK=common.BLOCK_SIZE,
            num_warps=common.NUM_WARPS,
        )


def _validate_post_divide(src: torch.Tensor, out: torch.Tensor, factor: float) -> float:
    common.check_float(src, "src")
    common.check_tensor(out, "out")
    common.check_same_device([src, out], ["src", "out"])
    if not src.is_contiguous():
        raise ValueError(
            f"src is not contiguous (shape={tuple(src.shape)} stride={src.stride()}): call .contiguous() on it first"
        )
    common.check_out(out, src.numel())
    if out.numel() != src.numel():
        raise ValueError(
            f"post_divide needs src and out of the same size, got src.numel()={src.numel()} "
            f"out.numel()={out.numel()}: pass out[:src.numel()] or the matching shard"
        )
    if meets(src, out):
        # Element i is read and written by the same lane, so src is out is safe; any other overlap would read
        # elements another program has already overwritten.
        check_no_overlap("post_divide", [("src", src)], [("out", out)], _IN_PLACE_FIX, in_place=True)
    return common.check_factor(factor)


def post_divide(src: torch.Tensor, out: torch.Tensor, factor: float, *, accumulate: bool = False) -> torch.Tensor:
    """Scale the reduce-scatter output by ``1/factor`` and cast (or accumulate) it into ``out``, in one pass.

    ``out = (src.float() / factor).to(out.dtype)``; with ``accumulate=True``
    ``out = (out.float() + src.float() / factor).to(out.dtype)``, for gradient accumulation into an
    existing sharded gradient. ``src`` and ``out`` must be contiguous with the same number of elements
    (``src`` may be a slice of a larger buffer); ``src is out`` (in place) is allowed, other overlaps are
    not. Returns ``out``.
    """
    with profiled("shardfuse.kernels:post_divide"):
        factor = _validate_post_divide(src, out, factor)
        if not common.use_triton(src, out):
            return post_divide_ref(src, out, factor, accumulate=accumulate)
        n = src.numel()
        if n == 0:
            return out
        kernel_factor, divide, multiply = common.scale_args(factor)
        with common.device_guard(out.device):
            # No FMA contraction: out + x * (1 / factor) must round twice, as out + x / factor does (an FMA
            # rounds once: seen differing on H200 in the subnormal range and where x * (1 / factor) overflows).
            _post_divide_kernel[(-(-n // common.BLOCK_SIZE),)](
                src, out, n, kernel_factor, DIVIDE=divide, MULTIPLY=multiply, ACCUMULATE=bool(accumulate),
                BLOCK=common.BLOCK_SIZE, num_warps=common.NUM_WARPS, enable_fp_fusion=False,
            )
        return out


# ----------------------------------------------------------------------------------------------------------
# References (plain PyTorch, same signatures)
# ----------------------------------------------------------------------------------------------------------


def _true_div(x: torch.Tensor, factor: float) -> torch.Tensor:
    # A device tensor divisor, not a Python scalar: CUDA turns `x / scalar` into `x * (1 / scalar)`.
    return x / torch.tensor(factor, dtype=torch.float32, device=x.device)


def pre_divide_pad_ref(grads: torch.Tensor | Sequence[torch.Tensor], out: torch.Tensor, factor: float) -> torch.Tensor:
    """Plain-PyTorch :func:`pre_divide_pad`."""
    grads = _as_list(grads)
    n, factor = _validate_pre_divide(grads, out, factor)
    out_flat = out.view(-1)
    offset = 0
    for g in grads:
        x = g.reshape(-1).float()
        if factor != 1.0:
            x = _true_div(x, factor)
        out_flat[offset : offset + g.numel()].copy_(x)
        offset += g.numel()
    out_flat[n:].zero_()
    return out


def post_divide_ref(src: torch.Tensor, out: torch.Tensor, factor: float, *, accumulate: bool = False) -> torch.Tensor:
    """Plain-PyTorch :func:`post_divide`."""
    factor = _validate_post_divide(src, out, factor)
    x = src.reshape(-1).float()
    if factor != 1.0:
        x = _true_div(x, factor)
    if accumulate:
        x = out.reshape(-1).float() + x
    out.view(-1).copy_(x)
    return out
