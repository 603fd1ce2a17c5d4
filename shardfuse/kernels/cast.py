"""Shard cast: cast flat parameter shards between fp32 and the compute dtype in one pass.

Before every all-gather the local fp32 shard is cast to bf16/fp16 directly into the all-gather input
buffer (FSDP2 makes two passes here: a per-parameter ``.to()`` and a ``_foreach_copy_`` into the buffer).
The multi-tensor form does all flat shards of a group, or thousands of small tensors, in one launch per
(source dtype, destination dtype) pair: a per-tensor block-start prefix table maps each program to its
(tensor, block) by binary search, so the launch count does not grow with the tensor count and nothing
waits on the host.

Layout: ``@triton.jit`` kernels, launchers (``cast_shard``, ``cast_shards``), references (``*_ref``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch.profiler import record_function

from shardfuse.kernels._common import (
    BLOCK_SIZE,
    check_float,
    check_out,
    check_same_device,
    int64_table,
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
def _cast_shards_kernel(table, num_tensors, search_steps, src_like, dst_like, ALIGNED: tl.constexpr,
                        BLOCK: tl.constexpr):
    """Multi-tensor cast. ``table`` (int64) holds, for T tensors, one after the other:
    block starts [T + 1] (prefix sums of per-tensor block counts), numels [T], source addresses [T],
    destination addresses [T]. ``src_like``/``dst_like`` are only there for their element types.
    """
    pid = tl.program_id(0).to(tl.int64)
    # Binary search for the last tensor t with starts[t] <= pid (invariant starts[lo] <= pid < starts[hi]).
    lo = pid * 0
    hi = lo + num_tensors
    for _ in range(search_steps):
        mid = (lo + hi) // 2
        right = tl.load(table + mid) <= pid
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
    block = pid - tl.load(table + lo)
    n = tl.load(table + num_tensors + 1 + lo)
    src = tl.load(table + 2 * num_tensors + 1 + lo).to(src_like.dtype)
    dst = tl.load(table + 3 * num_tensors + 1 + lo).to(dst_like.dtype)
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


def _device_guard(device: torch.device):
    # Triton launches on the current CUDA device; make it the tensors' device.
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


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
    with record_function("shardfuse.kernels:cast_shard"):
        out = _check_cast_shard(src, out, dtype)
        if not use_triton(src, out):
            return cast_shard_ref(src, out)
        n = src.numel()
        if n == 0:
            return out
        with _device_guard(src.device):
            _cast_shard_kernel[(triton.cdiv(n, BLOCK_SIZE),)](src, out, n, BLOCK=BLOCK_SIZE, num_warps=_NUM_WARPS)
        return out


def _check_cast_shards(
    srcs: Sequence[torch.Tensor], out: torch.Tensor | Sequence[torch.Tensor], offsets: Sequence[int] | None
) -> tuple[list[torch.Tensor], list[torch.Tensor], bool]:
    """Validate; return (srcs, destination views, flat_mode). Destinations are views of ``out`` in flat mode."""
    srcs = list(srcs)
    for i, s in enumerate(srcs):
        _check_src(s, f"srcs[{i}]")
    if isinstance(out, torch.Tensor):
        check_same_device([*srcs, out], [*(f"srcs[{i}]" for i in range(len(srcs))), "out"])
        numels = [s.numel() for s in srcs]
        if offsets is None:
            offsets, pos = [], 0
            for k in numels:
                offsets.append(pos)
                pos += k
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
        flat = out.view(-1)
        outs = [flat[o : o + k] for o, k in zip(offsets, numels)]
        return srcs, outs, True
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
    return srcs, outs, False


def _launch_cast_group(srcs: list[torch.Tensor], dsts: list[torch.Tensor]) -> None:
    """One launch for tensors sharing (source dtype, destination dtype); all have numel > 0."""
    numels = [s.numel() for s in srcs]
    block = min(BLOCK_SIZE, max(_MIN_MULTI_BLOCK, triton.next_power_of_2(max(numels))))
    starts = [0]
    for k in numels:
        starts.append(starts[-1] + triton.cdiv(k, block))
    src_addrs = [s.data_ptr() for s in srcs]
    dst_addrs = [d.data_ptr() for d in dsts]
    aligned = all(a % 16 == 0 for a in src_addrs) and all(a % 16 == 0 for a in dst_addrs)
    device = srcs[0].device
    # One table, one host->device copy: starts, numels, source and destination addresses.
    table = int64_table(starts + numels + src_addrs + dst_addrs, device)
    steps = max(1, (len(srcs) - 1).bit_length())  # ceil(log2(T)) halvings of [0, T)
    with _device_guard(device):
        _cast_shards_kernel[(starts[-1],)](
            table, len(srcs), steps, srcs[0], dsts[0], ALIGNED=aligned, BLOCK=block,
            num_warps=_NUM_WARPS if block >= 2048 else 4,
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
    """
    with record_function("shardfuse.kernels:cast_shards"):
        srcs, dsts, flat_mode = _check_cast_shards(srcs, out, offsets)
        result = out if flat_mode else list(out)
        if not use_triton(*srcs, *dsts) or (flat_mode and not use_triton(out)):
            _copy_all(srcs, dsts)  # the reference's copies, without validating twice
            return result
        groups: dict[tuple[torch.dtype, torch.dtype], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for s, d in zip(srcs, dsts):
            if s.numel():
                g = groups.setdefault((s.dtype, d.dtype), ([], []))
                g[0].append(s)
                g[1].append(d)
        for gsrcs, gdsts in groups.values():
            _launch_cast_group(gsrcs, gdsts)
        return result


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
