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

import logging
import math
import operator
from collections.abc import Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from shardfuse._profiling import profiled
from shardfuse.kernels._common import (
    BLOCK_SIZE,
    PlanCache,
    apply_scale,
    block_starts,
    block_table,
    check_float,
    check_out,
    check_same_device,
    device_guard,
    interpreting,
    scale_args,
    stream_key,
    use_triton,
)

logger = logging.getLogger(__name__)

# BLOCK_SIZE=4096 over 256 threads: 16 elements each, several 16-byte vectors in flight per thread.
_NUM_WARPS = 8

_PLANS = PlanCache()
_DTYPE = operator.attrgetter("dtype")

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
def _pre_divide_pad_kernel(
    src_ptr, out_ptr, n, total, factor, DIVIDE: tl.constexpr, MULTIPLY: tl.constexpr, BLOCK: tl.constexpr
):
    """One tensor: out[:n] = cast(src / factor), out[n:total] = 0."""
    # int64 before multiplying: a flat gradient can pass 2^31 elements.
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    if start + BLOCK <= n:
        # Full block: no mask, so the accesses vectorise whatever n is.
        x = tl.load(src_ptr + offs).to(tl.float32)
        x = apply_scale(x, factor, DIVIDE, MULTIPLY)
        tl.store(out_ptr + offs, x.to(out_ptr.dtype.element_ty))
    else:
        # Tail and padding: masked-off loads read 0, and 0 / factor == +0, so the padding comes out zero.
        x = tl.load(src_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
        x = apply_scale(x, factor, DIVIDE, MULTIPLY)
        tl.store(out_ptr + offs, x.to(out_ptr.dtype.element_ty), mask=offs < total)


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
        offs = start + tl.arange(0, BLOCK)
        if start + BLOCK <= n:
            x = tl.load(src + offs).to(tl.float32)
            x = apply_scale(x, factor, DIVIDE, MULTIPLY)
            tl.store(dst + offs, x.to(out_ptr.dtype.element_ty))
        else:
            mask = offs < n
            x = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
            x = apply_scale(x, factor, DIVIDE, MULTIPLY)
            tl.store(dst + offs, x.to(out_ptr.dtype.element_ty), mask=mask)


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
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"gradient_divide_factors needs an integer world_size >= 1, got {world_size=!r}")
    factor = 1
    while world_size % factor == 0 and world_size / factor > factor:
        factor *= 2
    return float(factor), world_size / factor


def _check_factor(factor: float) -> float:
    factor = float(factor)
    if not math.isfinite(factor) or factor <= 0.0:
        raise ValueError(f"the divide factor must be a finite number > 0, got {factor=}: use 1.0 for no division")
    return factor


def _as_list(grads: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(grads, torch.Tensor):
        return [grads]
    grads = list(grads)
    if not grads:
        raise ValueError("pre_divide_pad got an empty list of gradients: pass at least one tensor")
    for i, g in enumerate(grads):
        if not isinstance(g, torch.Tensor):
            raise TypeError(f"grads[{i}] is a {type(g).__name__}, not a torch.Tensor")
    return grads


def _validate_pre_divide(grads: list[torch.Tensor], out: torch.Tensor, factor: float) -> tuple[int, float]:
    names = [f"grads[{i}]" for i in range(len(grads))]
    for g, name in zip(grads, names):
        check_float(g, name)
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
    check_same_device([*grads, out], [*names, "out"])
    n = sum(g.numel() for g in grads)
    check_out(out, n)
    return n, _check_factor(factor)


def pre_divide_pad(grads: torch.Tensor | Sequence[torch.Tensor], out: torch.Tensor, factor: float) -> torch.Tensor:
    """Scale, cast and pad gradients into the reduce-scatter input, in one pass.

    ``out[:n] = (cat([g.flatten() for g in grads]).float() / factor).to(out.dtype)`` and ``out[n:] = 0``,
    where ``n`` is the total number of gradient elements. ``out`` must be contiguous with
    ``out.numel() >= n`` (typically ``n`` rounded up to a multiple of the world size). A list of gradients
    (one dtype, each contiguous) is handled in a single launch through a pointer table. ``factor == 1``
    skips the division but still casts and pads. Returns ``out``.
    """
    with profiled("shardfuse.kernels:pre_divide_pad"):
        grads = _as_list(grads)
        key = _multi_key(grads, out) if len(grads) > 1 else None
        plan = None if key is None else _PLANS.get(key)
        if plan is not None and (plan.device.type == "cuda" or interpreting()):
            _run_multi(plan, grads, out.view(-1), _check_factor(factor))
            return out
        n, factor = _validate_pre_divide(grads, out, factor)
        if not use_triton(*grads, out):
            return pre_divide_pad_ref(grads, out, factor)
        total = out.numel()
        if total == 0:
            return out
        out_flat = out.view(-1)
        if len(grads) == 1:
            # An empty CUDA tensor has a null data pointer, which Triton may refuse; its loads are all
            # masked off anyway, so any valid pointer will do.
            src = grads[0] if n else out_flat
            kernel_factor, divide, multiply = scale_args(factor)
            with device_guard(out.device):
                _pre_divide_pad_kernel[(-(-total // BLOCK_SIZE),)](
                    src, out_flat, n, total, kernel_factor, DIVIDE=divide, MULTIPLY=multiply, BLOCK=BLOCK_SIZE,
                    num_warps=_NUM_WARPS,
                )
            return out
        plan = _plan_multi(grads, out_flat, n)
        if key is not None:
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


def _multi_key(grads: list[torch.Tensor], out: torch.Tensor) -> tuple | None:
    """The plan-cache key: everything validation and the table read from the gradients (and out's layout:
    out is a kernel argument, its address is not in the table); None when nothing may be cached (CUDA
    graph capture, malformed arguments: the validating path then says what is wrong)."""
    T = torch.Tensor
    try:
        stream = stream_key(out.device)
        if stream is None:
            return None
        return (
            stream,
            (out.numel(), out.dtype, out.is_contiguous(), out.device),
            tuple(map(T.data_ptr, grads)),
            tuple(map(T.numel, grads)),
            tuple(map(_DTYPE, grads)),
            tuple(map(T.is_contiguous, grads)),
            tuple(map(T.get_device, grads)),  # ints: cheaper to build and compare than devices
        )
    except (TypeError, AttributeError, ValueError, RuntimeError):
        return None


def _plan_multi(grads: list[torch.Tensor], out_flat: torch.Tensor, n: int) -> _Plan:
    numels = [g.numel() for g in grads]
    offsets = block_starts(numels)
    counts = [-(-k // BLOCK_SIZE) for k in numels]
    total = out_flat.numel()
    pad_blocks = -(-(total - n) // BLOCK_SIZE)
    ptrs = [g.data_ptr() for g in grads]
    out_vec = 16 // out_flat.element_size()
    aligned = all(p % 16 == 0 for p in ptrs) and all(o % out_vec == 0 for o in offsets)
    starts = [*block_starts(counts), sum(counts)]  # T + 1: the last is the first padding program
    meta = block_table([ptrs, numels, offsets, starts], counts, out_flat.device)
    # `like` only types the source pointers: a non-empty tensor (empty CUDA tensors have null pointers).
    like = next((i for i, k in enumerate(numels) if k), -1)
    return _Plan(out_flat.device, sum(counts) + pad_blocks, meta, len(grads), n, total, like, aligned, out_vec)


def _run_multi(plan: _Plan, grads: list[torch.Tensor], out_flat: torch.Tensor, factor: float) -> None:
    if not plan.total:
        return
    kernel_factor, divide, multiply = scale_args(factor)
    with device_guard(plan.device):
        _pre_divide_pad_multi_kernel[(plan.grid,)](
            plan.table,
            out_flat if plan.like < 0 else grads[plan.like],
            out_flat,
            plan.num_tensors,
            plan.n,
            plan.total,
            kernel_factor,
            DIVIDE=divide,
            MULTIPLY=multiply,
            ALIGNED=plan.aligned and out_flat.data_ptr() % 16 == 0,
            OUT_VEC=plan.out_vec,
            BLOCK=BLOCK_SIZE,
            num_warps=_NUM_WARPS,
        )


def _check_no_partial_overlap(src: torch.Tensor, out: torch.Tensor) -> None:
    # Element i is read and written by the same lane, so src is out is safe; any other overlap would read
    # elements another program has already overwritten.
    if src.numel() == 0 or src.device != out.device:
        return
    s0, o0 = src.data_ptr(), out.data_ptr()
    s1, o1 = s0 + src.numel() * src.element_size(), o0 + out.numel() * out.element_size()
    if s0 < o1 and o0 < s1 and not (s0 == o0 and src.dtype == out.dtype):
        raise ValueError(
            "post_divide: src and out overlap in memory without being the same tensor "
            f"(src bytes [{s0:#x}, {s1:#x}), out bytes [{o0:#x}, {o1:#x})): use separate buffers or src is out"
        )


def post_divide(src: torch.Tensor, out: torch.Tensor, factor: float, *, accumulate: bool = False) -> torch.Tensor:
    """Scale the reduce-scatter output by ``1/factor`` and cast (or accumulate) it into ``out``, in one pass.

    ``out = (src.float() / factor).to(out.dtype)``; with ``accumulate=True``
    ``out = (out.float() + src.float() / factor).to(out.dtype)``, for gradient accumulation into an
    existing sharded gradient. ``src`` and ``out`` must be contiguous with the same number of elements
    (``src`` may be a slice of a larger buffer); ``src is out`` (in place) is allowed, other overlaps are
    not. Returns ``out``.
    """
    with profiled("shardfuse.kernels:post_divide"):
        check_float(src, "src")
        check_same_device([src, out], ["src", "out"])
        if not src.is_contiguous():
            raise ValueError(
                f"src is not contiguous (shape={tuple(src.shape)} stride={src.stride()}): "
                f"call .contiguous() on it first"
            )
        check_out(out, src.numel())
        if out.numel() != src.numel():
            raise ValueError(
                f"post_divide needs src and out of the same size, got src.numel()={src.numel()} "
                f"out.numel()={out.numel()}: pass out[:src.numel()] or the matching shard"
            )
        _check_no_partial_overlap(src, out)
        factor = _check_factor(factor)
        if not use_triton(src, out):
            return post_divide_ref(src, out, factor, accumulate=accumulate)
        n = src.numel()
        if n == 0:
            return out
        kernel_factor, divide, multiply = scale_args(factor)
        with device_guard(out.device):
            # No FMA contraction: out + x * (1 / factor) must round twice, as out + x / factor does (an FMA
            # rounds once: seen differing on H200 in the subnormal range and where x * (1 / factor) overflows).
            _post_divide_kernel[(-(-n // BLOCK_SIZE),)](
                src, out, n, kernel_factor, DIVIDE=divide, MULTIPLY=multiply, ACCUMULATE=bool(accumulate),
                BLOCK=BLOCK_SIZE, num_warps=_NUM_WARPS, enable_fp_fusion=False,
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
    check_float(src, "src")
    check_out(out, src.numel())
    if out.numel() != src.numel():
        raise ValueError(
            f"post_divide needs src and out of the same size, got src.numel()={src.numel()} "
            f"out.numel()={out.numel()}: pass out[:src.numel()] or the matching shard"
        )
    factor = _check_factor(factor)
    x = src.reshape(-1).float()
    if factor != 1.0:
        x = _true_div(x, factor)
    if accumulate:
        x = out.reshape(-1).float() + x
    out.view(-1).copy_(x)
    return out
