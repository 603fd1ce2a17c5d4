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

Each kernel has two forms of one launch: the trusted launch the sharding runtime calls after every
backward (``pre_divide_pad_unchecked`` for one flat gradient, ``post_divide_unchecked``), whose arguments
were validated once where the buffers were made, and the public validated form (``post_divide`` here;
``pre_divide_pad``, which also takes a list of gradients in one launch, in :mod:`_grad_divide_multi`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from shardfuse._profiling import profiled
from shardfuse.kernels import _common as common
from shardfuse.kernels._common import apply_scale
from shardfuse.kernels._launch import DirectLauncher
from shardfuse.kernels._overlap import check_no_overlap, meets

_IN_PLACE_FIX = "use separate buffers (a tensor written in place, src is out, is fine)"

__all__ = [
    "check_post_divide",
    "check_pre_divide_pad",
    "gradient_divide_factors",
    "post_divide",
    "post_divide_ref",
    "post_divide_unchecked",
    "pre_divide_pad_ref",
    "pre_divide_pad_unchecked",
]


# ----------------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def scale_block(src, dst, start, n, limit, factor, DIVIDE: tl.constexpr, MULTIPLY: tl.constexpr,
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
    scale_block(src_ptr, out_ptr, start, n, total, factor, DIVIDE, MULTIPLY, BLOCK)


_pre_divide_pad_launch = DirectLauncher(_pre_divide_pad_kernel)


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


_post_divide_launch = DirectLauncher(_post_divide_kernel)


# ----------------------------------------------------------------------------------------------------------
# Checks
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


def as_grad_list(grads: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(grads, torch.Tensor):
        return [grads]
    grads = common.check_tensors(grads, "grads")
    if not grads:
        raise ValueError("pre_divide_pad got an empty list of gradients: pass at least one tensor")
    return grads


def check_pre_divide_pad(
    grads: torch.Tensor | Sequence[torch.Tensor], out: torch.Tensor, factor: float
) -> tuple[list[torch.Tensor], int, float]:
    """Validate the arguments of ``pre_divide_pad``; return (the gradients as a list, their total number of
    elements, the factor as a float): what :func:`pre_divide_pad_unchecked` takes for granted."""
    grads = as_grad_list(grads)
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
    return grads, n, factor


def check_post_divide(src: torch.Tensor, out: torch.Tensor, factor: float) -> float:
    """Validate the arguments of :func:`post_divide`; return the factor as a float: what
    :func:`post_divide_unchecked` takes for granted."""
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


# ----------------------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------------------


def _launch_pre(grad: torch.Tensor, out: torch.Tensor, factor: float) -> torch.Tensor:
    if not common.use_triton(grad, out):
        return _pre_divide_pad_torch([grad], out, grad.numel(), factor)
    total = out.numel()
    if total == 0:
        return out
    n = grad.numel()
    out_flat = out.view(-1)
    # An empty CUDA tensor has a null data pointer, which Triton may refuse; its loads are all masked off
    # anyway, so any valid pointer will do.
    src = grad if n else out_flat
    kernel_factor, divide, multiply = common.scale_args(factor)
    with common.device_guard(out.device):
        _pre_divide_pad_launch[(-(-total // common.BLOCK_SIZE),)](
            src, out_flat, n, total, kernel_factor, DIVIDE=divide, MULTIPLY=multiply, BLOCK=common.BLOCK_SIZE,
            num_warps=common.NUM_WARPS,
        )
    return out


def pre_divide_pad_unchecked(grad: torch.Tensor, out: torch.Tensor, factor: float) -> torch.Tensor:
    """The trusted launch of ``pre_divide_pad`` for one gradient: the same result, no argument checks.

    ``out[:n] = (grad.float() / factor).to(out.dtype)``, ``out[n:] = 0`` with ``n = grad.numel()``. For callers
    that validated the arguments once where the buffers were made (with :func:`check_pre_divide_pad` or
    equivalent): ``grad`` and ``out`` contiguous float tensors on one device, ``out.numel() >= n``, no overlap
    unless ``grad`` is exactly ``out[:n]``, and ``factor`` a finite float > 0. Arguments that break this are
    not detected: on CUDA they read or write the wrong memory. Returns ``out``.
    """
    with profiled("shardfuse.kernels:pre_divide_pad"):
        return _launch_pre(grad, out, factor)


def _launch_post(src: torch.Tensor, out: torch.Tensor, factor: float, accumulate: bool) -> torch.Tensor:
    if not common.use_triton(src, out):
        return _post_divide_torch(src, out, factor, accumulate)
    n = src.numel()
    if n == 0:
        return out
    kernel_factor, divide, multiply = common.scale_args(factor)
    with common.device_guard(out.device):
        # No FMA contraction: out + x * (1 / factor) must round twice, as out + x / factor does (an FMA
        # rounds once: seen differing on H200 in the subnormal range and where x * (1 / factor) overflows).
        _post_divide_launch[(-(-n // common.BLOCK_SIZE),)](
            src, out, n, kernel_factor, DIVIDE=divide, MULTIPLY=multiply, ACCUMULATE=bool(accumulate),
            BLOCK=common.BLOCK_SIZE, num_warps=common.NUM_WARPS, enable_fp_fusion=False,
        )
    return out


def post_divide_unchecked(
    src: torch.Tensor, out: torch.Tensor, factor: float, *, accumulate: bool = False
) -> torch.Tensor:
    """The trusted launch of :func:`post_divide`: the same result, no argument checks.

    For callers that validated the arguments once where the buffers were made (with :func:`check_post_divide`
    or equivalent): ``src`` and ``out`` contiguous float tensors on one device with the same number of
    elements, not overlapping unless ``src is out``, and ``factor`` a finite float > 0. Arguments that break
    this are not detected: on CUDA they read or write the wrong memory. Returns ``out``.
    """
    with profiled("shardfuse.kernels:post_divide"):
        return _launch_post(src, out, factor, accumulate)


def post_divide(src: torch.Tensor, out: torch.Tensor, factor: float, *, accumulate: bool = False) -> torch.Tensor:
    """Scale the reduce-scatter output by ``1/factor`` and cast (or accumulate) it into ``out``, in one pass.

    ``out = (src.float() / factor).to(out.dtype)``; with ``accumulate=True``
    ``out = (out.float() + src.float() / factor).to(out.dtype)``, for gradient accumulation into an
    existing sharded gradient. ``src`` and ``out`` must be contiguous with the same number of elements
    (``src`` may be a slice of a larger buffer); ``src is out`` (in place) is allowed, other overlaps are
    not. Returns ``out``.
    """
    with profiled("shardfuse.kernels:post_divide"):
        return _launch_post(src, out, check_post_divide(src, out, factor), accumulate)


# ----------------------------------------------------------------------------------------------------------
# References (plain PyTorch, same signatures)
# ----------------------------------------------------------------------------------------------------------


def _true_div(x: torch.Tensor, factor: float) -> torch.Tensor:
    # A device tensor divisor, not a Python scalar: CUDA turns `x / scalar` into `x * (1 / scalar)`.
    return x / torch.tensor(factor, dtype=torch.float32, device=x.device)


def _pre_divide_pad_torch(grads: list[torch.Tensor], out: torch.Tensor, n: int, factor: float) -> torch.Tensor:
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


def _post_divide_torch(src: torch.Tensor, out: torch.Tensor, factor: float, accumulate: bool) -> torch.Tensor:
    x = src.reshape(-1).float()
    if factor != 1.0:
        x = _true_div(x, factor)
    if accumulate:
        x = out.reshape(-1).float() + x
    out.view(-1).copy_(x)
    return out


def pre_divide_pad_ref(grads: torch.Tensor | Sequence[torch.Tensor], out: torch.Tensor, factor: float) -> torch.Tensor:
    """Plain-PyTorch ``pre_divide_pad``."""
    grads, n, factor = check_pre_divide_pad(grads, out, factor)
    return _pre_divide_pad_torch(grads, out, n, factor)


def post_divide_ref(src: torch.Tensor, out: torch.Tensor, factor: float, *, accumulate: bool = False) -> torch.Tensor:
    """Plain-PyTorch :func:`post_divide`."""
    return _post_divide_torch(src, out, check_post_divide(src, out, factor), accumulate)
