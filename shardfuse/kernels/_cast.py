"""Shard cast: cast a flat parameter shard between fp32 and the compute dtype in one pass.

Before every all-gather the local fp32 shard is cast to bf16/fp16 directly into the all-gather input
buffer (FSDP2 makes two passes here: a per-parameter ``.to()`` and a ``_foreach_copy_`` into the buffer).

Two forms of one launch: :func:`cast_shard` validates its arguments and is the public kernel;
:func:`cast_shard_unchecked` is the trusted launch the sharding runtime calls at every gather, whose
arguments :func:`check_cast_shard` (or the runtime's own plan-time checks) validated once, where the buffers
were made. The multi-tensor form, ``cast_shards``, lives in :mod:`shardfuse.kernels._cast_multi`.

Layout: ``@triton.jit`` kernels, checks, launchers (``cast_shard_unchecked``, ``cast_shard``), reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shardfuse._profiling import profiled
from shardfuse.kernels import _common as common
from shardfuse.kernels._launch import DirectLauncher
from shardfuse.kernels._overlap import check_no_overlap, meets

__all__ = ["cast_shard", "cast_shard_ref", "cast_shard_unchecked", "check_cast_shard"]

_IN_PLACE_FIX = "pass separate buffers (the same tensor as src and out, in place, is fine)"


# --------------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------------


@triton.jit
def cast_block(src, dst, offs, n, MASKED: tl.constexpr):
    # One block: masked only for the tail block, so full blocks keep 16-byte vector accesses even when
    # n is odd (a mask that depends on an unaligned n would force scalar accesses everywhere). No cache hint:
    # evict_first on the loads and stores cost 10% at 64M-256M elements on an H200 (0.90x copy_ against 0.99x
    # without; bench.kernels.sweep_cast_block, 2026-11-28).
    if MASKED:
        mask = offs < n
        tl.store(dst + offs, tl.load(src + offs, mask=mask).to(dst.dtype.element_ty), mask=mask)
    else:
        tl.store(dst + offs, tl.load(src + offs).to(dst.dtype.element_ty))


@triton.jit
def _cast_shard_kernel(src_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """out[i] = src[i] cast to out's dtype (round to nearest even), one BLOCK per program."""
    # int64 before the multiply: flat shards can pass 2^31 elements.
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    if (pid + 1) * BLOCK <= n:
        cast_block(src_ptr, out_ptr, offs, n, False)
    else:
        cast_block(src_ptr, out_ptr, offs, n, True)


# --------------------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------------------


_cast_shard_launch = DirectLauncher(_cast_shard_kernel)


def check_src(src: torch.Tensor, name: str) -> None:
    """A cast source: a contiguous float tensor."""
    common.check_float(src, name)
    if not src.is_contiguous():
        raise ValueError(
            f"{name} must be contiguous (got shape={tuple(src.shape)} stride={src.stride()}): "
            f"use flatten_pad for strided tensors or pass {name}.contiguous()"
        )


def check_cast_shard(src: torch.Tensor, out: torch.Tensor | None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Validate the arguments of :func:`cast_shard` and return ``out`` (allocated when None): what
    :func:`cast_shard_unchecked` takes for granted."""
    check_src(src, "src")
    common.check_dtype_arg(dtype)
    if out is None:
        out = torch.empty(src.shape, dtype=src.dtype if dtype is None else dtype, device=src.device)
    else:
        common.check_tensor(out, "out")
        if dtype is not None and dtype != out.dtype:
            raise ValueError(
                f"dtype={dtype} does not match out.dtype={out.dtype}: pass one of them, or make them agree"
            )
    common.check_same_device([src, out], ["src", "out"])
    common.check_out(out, src.numel())
    if out.numel() != src.numel():
        raise ValueError(
            f"out must hold exactly src.numel() elements: out.numel()={out.numel()} src.numel()={src.numel()}; "
            f"pass out[:{src.numel()}] or a buffer of the right size"
        )
    if meets(src, out):  # element i is read and written by the same lane: src is out is safe, no other overlap
        check_no_overlap("cast_shard", [("src", src)], [("out", out)], _IN_PLACE_FIX, in_place=True)
    return out


# --------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------


def _launch(src: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    if not common.use_triton(src, out):
        out.view(-1).copy_(src.view(-1))  # the reference's copy
        return out
    n = src.numel()
    if n == 0:
        return out
    with common.device_guard(src.device):
        grid = (-(-n // common.BLOCK_SIZE),)
        _cast_shard_launch[grid](src, out, n, BLOCK=common.BLOCK_SIZE, num_warps=common.NUM_WARPS)
    return out


def cast_shard_unchecked(src: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The trusted launch of :func:`cast_shard`: the same result, no argument checks.

    For callers that validated ``(src, out)`` once where the buffers were made (with :func:`check_cast_shard`
    or equivalent) and call again with tensors of the same kind: ``src`` and ``out`` contiguous float tensors
    on one device with ``out.numel() == src.numel()``, not overlapping unless ``out is src``. Arguments
    that break this are not detected: on CUDA they read or write the wrong memory. Returns ``out``.
    """
    with profiled("shardfuse.kernels:cast_shard"):
        return _launch(src, out)


def cast_shard(src: torch.Tensor, out: torch.Tensor | None = None, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Cast ``src`` elementwise into ``out`` in one pass (round to nearest even, as ``Tensor.to``).

    Args:
        src: contiguous float tensor (fp32/bf16/fp16) of any shape.
        out: contiguous float tensor with exactly ``src.numel()`` elements, of any shape; may be a slice
            of a larger buffer (e.g. this rank's part of the all-gather input), but must not overlap
            ``src`` unless it is ``src`` itself. Allocated with ``src``'s shape and ``dtype`` (default:
            ``src.dtype``) when None.
        dtype: destination dtype when ``out`` is None; must equal ``out.dtype`` if both are given.

    Returns:
        ``out``. Works fp32 -> bf16/fp16 (before all-gather), bf16/fp16 -> fp32 (loading) and same dtype (copy).
    """
    with profiled("shardfuse.kernels:cast_shard"):
        return _launch(src, check_cast_shard(src, out, dtype))


# --------------------------------------------------------------------------------------------------
# References (plain PyTorch, same signatures and semantics)
# --------------------------------------------------------------------------------------------------


def cast_shard_ref(
    src: torch.Tensor, out: torch.Tensor | None = None, *, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Reference for :func:`cast_shard`: ``out.copy_(src)`` on flat views."""
    out = check_cast_shard(src, out, dtype)
    out.view(-1).copy_(src.view(-1))
    return out
