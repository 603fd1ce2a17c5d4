"""Shard cast: cast flat parameter shards between fp32 and the compute dtype in one pass.

Before every all-gather the local fp32 shard is cast to bf16/fp16 directly into the all-gather input
buffer (FSDP2 makes two passes here: a per-parameter ``.to()`` and a ``_foreach_copy_`` into the buffer).
The multi-tensor form does all flat shards of a group, or thousands of small tensors, in one launch per
(source dtype, destination dtype) pair: a host-built owner column maps each program to its tensor in one
load, so the launch count does not grow with the tensor count and nothing waits on the host. The launch
plans (device tables included) are cached per set of tensors, so a repeat call costs little more than
the launch itself.

Layout: ``@triton.jit`` kernels, launchers (``cast_shard``, ``cast_shards``), references (``*_ref``).
"""

from __future__ import annotations

import logging
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
    block_starts,
    block_table,
    check_float,
    check_out,
    check_same_device,
    device_guard,
    interpreting,
    stream_key,
    use_triton,
)

logger = logging.getLogger(__name__)

__all__ = ["cast_shard", "cast_shards", "cast_shard_ref", "cast_shards_ref"]

_NUM_WARPS = 8  # 4096 elements / 256 threads = 16 per thread: four 16-byte fp32 vectors in flight
_MIN_MULTI_BLOCK = 512  # smallest block of the multi-tensor kernel (tiny tensors waste fewer lanes)


# --------------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------------


@triton.jit
def _cast_block(src, dst, offs, n, MASKED: tl.constexpr):
    # One block: masked only for the tail block, so full blocks keep 16-byte vector accesses even when
    # n is odd (a mask that depends on an unaligned n would force scalar accesses everywhere).
    if MASKED:
        mask = offs < n
        x = tl.load(src + offs, mask=mask, eviction_policy="evict_first")
        tl.store(dst + offs, x.to(dst.dtype.element_ty), mask=mask, eviction_policy="evict_first")
    else:
        x = tl.load(src + offs, eviction_policy="evict_first")
        tl.store(dst + offs, x.to(dst.dtype.element_ty), eviction_policy="evict_first")


@triton.jit
def _cast_shard_kernel(src_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """out[i] = src[i] cast to out's dtype (round to nearest even), one BLOCK per program."""
    # int64 before the multiply: flat shards can pass 2^31 elements.
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    if (pid + 1) * BLOCK <= n:
        _cast_block(src_ptr, out_ptr, offs, n, False)
    else:
        _cast_block(src_ptr, out_ptr, offs, n, True)


@triton.jit
def _cast_shards_kernel(table, num_tensors, src_like, dst_like, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    """Multi-tensor cast. ``table`` (int64) holds, for T tensors, one after the other: block starts [T],
    numels [T], source addresses [T], destination addresses [T], then the owning tensor of every program.
    ``src_like``/``dst_like`` are only there for their element types.
    """
    pid = tl.program_id(0).to(tl.int64)
    t = tl.load(table + 4 * num_tensors + pid)  # one load, not a search: the host built the owner column
    block = pid - tl.load(table + t)
    n = tl.load(table + num_tensors + t)
    src = tl.load(table + 2 * num_tensors + t).to(src_like.dtype)
    dst = tl.load(table + 3 * num_tensors + t).to(dst_like.dtype)
    if ALIGNED:
        # The host checked every address is 16-byte aligned: let the compiler emit vector accesses.
        src = tl.multiple_of(src, 16)
        dst = tl.multiple_of(dst, 16)
    offs = block * BLOCK + tl.arange(0, BLOCK)
    if (block + 1) * BLOCK <= n:
        _cast_block(src, dst, offs, n, False)
    else:
        _cast_block(src, dst, offs, n, True)


# --------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------

_PLANS = PlanCache()
_DTYPE = operator.attrgetter("dtype")


class _Launch(NamedTuple):
    """One ``_cast_shards_kernel`` launch: tensors sharing (source dtype, destination dtype)."""

    grid: int
    table: torch.Tensor
    num_tensors: int
    src_like: int  # index of a source of this group (types the source addresses)
    dst_like: int  # index of a destination of this group; -1: the flat ``out``
    aligned: bool
    block: int
    num_warps: int


class _Plan(NamedTuple):
    device: torch.device
    launches: tuple[_Launch, ...]


def _check_src(src: torch.Tensor, name: str) -> None:
    check_float(src, name)
    if not src.is_contiguous():
        raise ValueError(
            f"{name} must be contiguous (got shape={tuple(src.shape)} stride={src.stride()}): "
            f"use flatten_pad for strided tensors or pass {name}.contiguous()"
        )


def _check_cast_shard(src: torch.Tensor, out: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor:
    """Validate and return ``out`` (allocated when None)."""
    _check_src(src, "src")
    if out is None:
        out = torch.empty(src.shape, dtype=src.dtype if dtype is None else dtype, device=src.device)
    elif dtype is not None and dtype != out.dtype:
        raise ValueError(f"dtype={dtype} does not match out.dtype={out.dtype}: pass one of them, or make them agree")
    check_same_device([src, out], ["src", "out"])
    check_out(out, src.numel())
    if out.numel() != src.numel():
        raise ValueError(
            f"out must hold exactly src.numel() elements: out.numel()={out.numel()} src.numel()={src.numel()}; "
            f"pass out[:{src.numel()}] or a buffer of the right size"
        )
    return out


def cast_shard(src: torch.Tensor, out: torch.Tensor | None = None, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Cast ``src`` elementwise into ``out`` in one pass (round to nearest even, as ``Tensor.to``).

    Args:
        src: contiguous float tensor (fp32/bf16/fp16) of any shape.
        out: contiguous float tensor with exactly ``src.numel()`` elements, of any shape; may be a slice
            of a larger buffer (e.g. this rank's part of the all-gather input). Allocated with ``src``'s
            shape and ``dtype`` (default: ``src.dtype``) when None.
        dtype: destination dtype when ``out`` is None; must equal ``out.dtype`` if both are given.

    Returns:
        ``out``. Works fp32 -> bf16/fp16 (before all-gather), bf16/fp16 -> fp32 (loading) and same dtype (copy).
    """
    with profiled("shardfuse.kernels:cast_shard"):
        out = _check_cast_shard(src, out, dtype)
        if not use_triton(src, out):
            return cast_shard_ref(src, out)
        n = src.numel()
        if n == 0:
            return out
        with device_guard(src.device):
            _cast_shard_kernel[(-(-n // BLOCK_SIZE),)](src, out, n, BLOCK=BLOCK_SIZE, num_warps=_NUM_WARPS)
        return out


def _validate_cast_shards(
    srcs: list[torch.Tensor], out: torch.Tensor | Sequence[torch.Tensor], offsets: Sequence[int] | None
) -> tuple[list[torch.Tensor] | None, list[int] | None]:
    """Validate; return (destinations, None) for a list ``out``, (None, offsets) for a flat one."""
    for i, s in enumerate(srcs):
        _check_src(s, f"srcs[{i}]")
    if isinstance(out, torch.Tensor):
        check_same_device([*srcs, out], [*(f"srcs[{i}]" for i in range(len(srcs))), "out"])
        numels = [s.numel() for s in srcs]
        if offsets is None:
            offsets = block_starts(numels)  # back to back
        else:
            offsets = [int(o) for o in offsets]
            if len(offsets) != len(srcs):
                raise ValueError(f"len(offsets)={len(offsets)} != len(srcs)={len(srcs)}: give one offset per source")
        end = max((o + k for o, k in zip(offsets, numels)), default=0)
        check_out(out, end)
        if any(o < 0 for o in offsets):
            raise ValueError(f"offsets must be >= 0, got {[o for o in offsets if o < 0][:8]}")
        # Overlapping destination ranges would make the result depend on program order.
        ranges = sorted((o, o + k, i) for i, (o, k) in enumerate(zip(offsets, numels)) if k)
        for (_, e0, i0), (b1, _, i1) in zip(ranges, ranges[1:]):
            if b1 < e0:
                raise ValueError(
                    f"destination ranges overlap: srcs[{i0}] ends at {e0} but srcs[{i1}] starts at {b1}; "
                    f"fix offsets so that each range [offset, offset + numel) is disjoint"
                )
        return None, offsets
    if offsets is not None:
        raise ValueError("offsets only apply when out is one flat tensor; drop offsets or pass a flat out")
    outs = list(out)
    if len(outs) != len(srcs):
        raise ValueError(f"len(out)={len(outs)} != len(srcs)={len(srcs)}: give one destination per source")
    names = [f"srcs[{i}]" for i in range(len(srcs))] + [f"out[{i}]" for i in range(len(outs))]
    if srcs:
        check_same_device([*srcs, *outs], names)
    for i, (s, o) in enumerate(zip(srcs, outs)):
        check_out(o, s.numel(), f"out[{i}]")
        if o.numel() != s.numel():
            raise ValueError(
                f"out[{i}].numel()={o.numel()} != srcs[{i}].numel()={s.numel()}: destinations must match their sources"
            )
    return outs, None


def _check_cast_shards(
    srcs: Sequence[torch.Tensor], out: torch.Tensor | Sequence[torch.Tensor], offsets: Sequence[int] | None
) -> tuple[list[torch.Tensor], list[torch.Tensor], bool]:
    """Validate; return (srcs, destination views, flat_mode). Destinations are views of ``out`` in flat mode."""
    srcs = list(srcs)
    outs, offsets = _validate_cast_shards(srcs, out, offsets)
    if outs is not None:
        return srcs, outs, False
    flat = out.view(-1)
    return srcs, [flat[o : o + s.numel()] for o, s in zip(offsets, srcs)], True


def _meta(tensors: list[torch.Tensor]) -> tuple:
    """Everything validation and the table read from ``tensors``: addresses, sizes, dtypes, layout, devices.
    ``map`` over the unbound methods is several times cheaper than a loop building one tuple per tensor."""
    T = torch.Tensor
    return (
        tuple(map(T.data_ptr, tensors)),
        tuple(map(T.numel, tensors)),
        tuple(map(_DTYPE, tensors)),
        tuple(map(T.is_contiguous, tensors)),
        tuple(map(T.get_device, tensors)),  # ints: cheaper to build and compare than devices
    )


def _cast_key(
    srcs: list[torch.Tensor], out: torch.Tensor | list[torch.Tensor], offsets: Sequence[int] | None
) -> tuple | None:
    """The plan-cache key, or None when nothing may be cached (CUDA graph capture, malformed arguments:
    the validating slow path then says what is wrong)."""
    try:
        if isinstance(out, torch.Tensor):
            dst = (out.data_ptr(), out.numel(), out.dtype, out.is_contiguous(), out.device,
                   None if offsets is None else tuple(map(int, offsets)))
            device = out.device
        else:
            if offsets is not None or not out:
                return None
            dst = _meta(out)
            device = out[0].device
        stream = stream_key(device)
        return None if stream is None else (stream, _meta(srcs), dst)
    except (TypeError, AttributeError, ValueError, RuntimeError):
        return None


def _build_plan(
    srcs: list[torch.Tensor], out: torch.Tensor | list[torch.Tensor], offsets: Sequence[int] | None
) -> _Plan | None:
    """Validate and build the launches; None when the reference path should run (CPU tensors)."""
    dsts, offsets = _validate_cast_shards(srcs, out, offsets)
    if dsts is None:
        if not use_triton(out, *srcs):
            return None
        device, base, esize = out.device, out.data_ptr(), out.element_size()
        dst_addrs = [base + o * esize for o in offsets]
        dst_dtypes = [out.dtype] * len(srcs)
    else:
        if not use_triton(*srcs, *dsts):
            return None
        device = srcs[0].device if srcs else torch.device("cpu")
        dst_addrs = [d.data_ptr() for d in dsts]
        dst_dtypes = [d.dtype for d in dsts]
    groups: dict[tuple[torch.dtype, torch.dtype], list[int]] = {}
    for i, (s, ddt) in enumerate(zip(srcs, dst_dtypes)):
        if s.numel():
            groups.setdefault((s.dtype, ddt), []).append(i)
    launches = tuple(
        _plan_group(srcs, idx, dst_addrs, device, flat=dsts is None) for idx in groups.values()
    )
    return _Plan(device, launches)


def _plan_group(
    srcs: list[torch.Tensor], idx: list[int], dst_addrs: list[int], device: torch.device, flat: bool
) -> _Launch:
    """One launch for tensors sharing (source dtype, destination dtype); all have numel > 0."""
    numels = [srcs[i].numel() for i in idx]
    # Many tiny tensors: a smaller block wastes fewer masked lanes (one compile per power of two).
    block = min(BLOCK_SIZE, max(_MIN_MULTI_BLOCK, 1 << (max(numels) - 1).bit_length()))
    counts = [-(-k // block) for k in numels]
    src_addrs = [srcs[i].data_ptr() for i in idx]
    dst = [dst_addrs[i] for i in idx]
    aligned = all(a % 16 == 0 for a in src_addrs) and all(a % 16 == 0 for a in dst)
    # One table, one host->device copy: starts, numels, source and destination addresses, owners.
    table = block_table([block_starts(counts), numels, src_addrs, dst], counts, device)
    return _Launch(sum(counts), table, len(idx), idx[0], -1 if flat else idx[0], aligned, block,
                   _NUM_WARPS if block >= 2048 else 4)


def _run_plan(plan: _Plan, srcs: list[torch.Tensor], out: torch.Tensor | list[torch.Tensor]) -> None:
    with device_guard(plan.device):
        for la in plan.launches:
            dst_like = out if la.dst_like < 0 else out[la.dst_like]
            _cast_shards_kernel[(la.grid,)](
                la.table, la.num_tensors, srcs[la.src_like], dst_like, ALIGNED=la.aligned, BLOCK=la.block,
                num_warps=la.num_warps,
            )


def cast_shards(
    srcs: Sequence[torch.Tensor],
    out: torch.Tensor | Sequence[torch.Tensor],
    *,
    offsets: Sequence[int] | None = None,
) -> torch.Tensor | list[torch.Tensor]:
    """Cast many tensors in one launch per (source dtype, destination dtype) pair.

    Args:
        srcs: contiguous float tensors of any shapes and sizes (thousands are fine).
        out: either one contiguous float tensor, where ``srcs[i]`` goes to
            ``out.view(-1)[offsets[i] : offsets[i] + srcs[i].numel()]``, or a list of contiguous float tensors
            with ``out[i].numel() == srcs[i].numel()`` (dtypes may differ per entry).
        offsets: element offsets into a flat ``out`` (default: back to back from 0); ranges must not overlap.

    Returns:
        ``out`` as given (the tensor, or the list of tensors).

    A repeat call with the same tensors (same addresses, sizes, dtypes, layouts and device, on the same
    stream) reuses the cached launch plan: no validation, no table building, no host->device copy.
    """
    with profiled("shardfuse.kernels:cast_shards"):
        srcs = list(srcs)
        dests = out if isinstance(out, torch.Tensor) else list(out)
        key = _cast_key(srcs, dests, offsets)
        plan = None if key is None else _PLANS.get(key)
        if plan is None:
            plan = _build_plan(srcs, dests, offsets)
            if plan is not None and key is not None:
                _PLANS.put(key, plan)
        elif plan.device.type == "cpu" and not interpreting():
            plan = None  # the interpreter was switched off since the plan was built
        if plan is None:
            _, views, _ = _check_cast_shards(srcs, dests, offsets)
            _copy_all(srcs, views)  # the reference's copies
        else:
            _run_plan(plan, srcs, dests)
        return dests


# --------------------------------------------------------------------------------------------------
# References (plain PyTorch, same signatures and semantics)
# --------------------------------------------------------------------------------------------------


def cast_shard_ref(
    src: torch.Tensor, out: torch.Tensor | None = None, *, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Reference for :func:`cast_shard`: ``out.copy_(src)`` on flat views."""
    out = _check_cast_shard(src, out, dtype)
    out.view(-1).copy_(src.view(-1))
    return out


def cast_shards_ref(
    srcs: Sequence[torch.Tensor],
    out: torch.Tensor | Sequence[torch.Tensor],
    *,
    offsets: Sequence[int] | None = None,
) -> torch.Tensor | list[torch.Tensor]:
    """Reference for :func:`cast_shards`: one ``copy_`` per tensor."""
    srcs, dsts, flat_mode = _check_cast_shards(srcs, out, offsets)
    _copy_all(srcs, dsts)
    return out if flat_mode else list(out)


def _copy_all(srcs: list[torch.Tensor], dsts: list[torch.Tensor]) -> None:
    for s, d in zip(srcs, dsts):
        d.view(-1).copy_(s.view(-1))
