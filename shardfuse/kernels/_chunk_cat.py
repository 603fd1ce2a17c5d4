"""Chunk-cat: the ``torch._chunk_cat(tensors, dim=0, num_chunks=world_size)`` layout with the gradient
scale and the cast fused in, in one launch.

This is the reduce-scatter input FSDP2 builds for gradients that are not already flat: each tensor is
viewed as ``(dim0, rest)``, ``dim0`` is padded with zero rows up to a multiple of ``world_size``, the
result is split into ``world_size`` equal chunks along ``dim0``, and row ``r`` of the output (shape
``(world_size, row_numel)``) is chunk ``r`` of every tensor, concatenated. Rank ``r`` then receives row
``r`` from the reduce-scatter, which holds its dim-0 shard of every gradient. FSDP2 runs ``div_`` and
``_chunk_cat`` (and a cast) as separate kernels; this is one pass.

Layout details (checked against ``torch._chunk_cat``): a tensor with ``dim0`` rows contributes
``ceil(dim0 / world_size) * rest`` elements to every row; when ``dim0 < world_size`` the trailing rows are
all padding. Beyond ``torch._chunk_cat``, which rejects empty tensors and crashes on 0-dim ones, a 0-dim
tensor is treated as shape ``(1,)`` and an empty tensor contributes nothing.
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

__all__ = ["chunk_cat", "chunk_cat_ref"]

_PLANS = PlanCache()
_DTYPE = operator.attrgetter("dtype")
_SHAPE = operator.attrgetter("shape")


# ----------------------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _chunk_cat_kernel(
    meta_ptr,
    like_ptr,
    out_ptr,
    num_tensors,
    row_numel,
    factor,
    DIVIDE: tl.constexpr,
    MULTIPLY: tl.constexpr,
    ALIGNED: tl.constexpr,
    IN_VEC: tl.constexpr,
    OUT_VEC: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """meta (int64) = [src pointers | numels | chunk numels | column offsets | block starts | owner of
    every program].

    Tensor i owns world_size * cdiv(chunk_numel_i, BLOCK) programs: (row r, block b) copies elements
    [b*BLOCK, (b+1)*BLOCK) of chunk r, i.e. source elements r*chunk_numel_i + [b*BLOCK, ...), into
    out[r, col_i + b*BLOCK + ...]. Source elements past numel_i are the dim-0 padding and come out zero.
    """
    pid = tl.program_id(0).to(tl.int64)
    numel_tab = meta_ptr + num_tensors
    chunk_tab = meta_ptr + 2 * num_tensors
    col_tab = meta_ptr + 3 * num_tensors
    start_tab = meta_ptr + 4 * num_tensors
    # One load finds the tensor (the host built the owner column); empty tensors own no program.
    lo = tl.load(meta_ptr + 5 * num_tensors + pid)
    n = tl.load(numel_tab + lo)
    m = tl.load(chunk_tab + lo)
    col = tl.load(col_tab + lo)
    src_addr = tl.load(meta_ptr + lo)
    blocks_per_row = (m + BLOCK - 1) // BLOCK
    local = pid - tl.load(start_tab + lo)
    row = local // blocks_per_row
    j0 = (local - row * blocks_per_row) * BLOCK
    src_start = row * m + j0
    dst_start = row * row_numel + col + j0
    if ALIGNED:
        # Host-checked: sources 16-byte aligned, chunk numels, column offsets and row_numel multiples of
        # one 16-byte vector, so full blocks can use 16-byte loads and stores.
        src_addr = tl.multiple_of(src_addr, 16)
        src_start = tl.multiple_of(src_start, IN_VEC)
        dst_start = tl.multiple_of(dst_start, OUT_VEC)
    src = src_addr.to(tl.pointer_type(like_ptr.dtype.element_ty)) + src_start
    dst = out_ptr + dst_start
    offs = tl.arange(0, BLOCK)
    if (j0 + BLOCK <= m) & (src_start + BLOCK <= n):
        x = tl.load(src + offs).to(tl.float32)
        x = apply_scale(x, factor, DIVIDE, MULTIPLY)
        tl.store(dst + offs, x.to(out_ptr.dtype.element_ty))
    else:
        in_chunk = j0 + offs < m
        # Masked-off loads read 0 and 0 / factor == +0: the padding rows come out exactly zero.
        x = tl.load(src + offs, mask=in_chunk & (src_start + offs < n), other=0.0).to(tl.float32)
        x = apply_scale(x, factor, DIVIDE, MULTIPLY)
        tl.store(dst + offs, x.to(out_ptr.dtype.element_ty), mask=in_chunk)


# ----------------------------------------------------------------------------------------------------------
# Launcher (public API)
# ----------------------------------------------------------------------------------------------------------


def _layout(t: torch.Tensor, world_size: int) -> tuple[int, int]:
    """(numel, chunk numel) of ``t`` viewed as (dim0, rest); 0-dim tensors count as shape (1,)."""
    dim0 = t.shape[0] if t.dim() > 0 else 1
    rest = math.prod(t.shape[1:]) if t.dim() > 1 else 1
    return t.numel(), -(-dim0 // world_size) * rest


def _check_factor(factor: float) -> float:
    factor = float(factor)
    if not math.isfinite(factor) or factor <= 0.0:
        raise ValueError(f"the divide factor must be a finite number > 0, got {factor=}: use 1.0 for no division")
    return factor


def _validate(
    tensors: Sequence[torch.Tensor],
    world_size: int,
    factor: float,
    dtype: torch.dtype | None,
    out: torch.Tensor | None,
) -> tuple[list[torch.Tensor], float, torch.dtype, list[int], list[int], int]:
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence):
        raise TypeError(f"chunk_cat takes a sequence of tensors, got {type(tensors).__name__}: wrap it in a list")
    tensors = list(tensors)
    if not tensors:
        raise ValueError("chunk_cat got an empty list of tensors: pass at least one tensor")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"chunk_cat needs an integer world_size >= 1, got {world_size=!r}")
    factor = _check_factor(factor)
    names = [f"tensors[{i}]" for i in range(len(tensors))]
    for t, name in zip(tensors, names):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} is a {type(t).__name__}, not a torch.Tensor")
        check_float(t, name)
    in_dtypes = {t.dtype for t in tensors}
    if len(in_dtypes) > 1:
        raise TypeError(
            f"chunk_cat needs all tensors in one dtype, got {sorted(str(d) for d in in_dtypes)}: "
            f"group them by dtype and call once per group"
        )
    if out is not None and dtype is not None and out.dtype != dtype:
        raise TypeError(f"chunk_cat got {dtype=} but out.dtype={out.dtype}: pass one or make them agree")
    out_dtype = dtype if dtype is not None else (out.dtype if out is not None else tensors[0].dtype)
    if out_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"chunk_cat output dtype {out_dtype} is not supported: use float32, bfloat16 or float16")
    check_same_device(tensors + ([out] if out is not None else []), names + (["out"] if out is not None else []))
    numels, chunks = zip(*(_layout(t, world_size) for t in tensors))
    row_numel = sum(chunks)
    if out is not None:
        if tuple(out.shape) != (world_size, row_numel):
            raise ValueError(
                f"chunk_cat out has shape {tuple(out.shape)}, expected (world_size, row_numel)="
                f"{(world_size, row_numel)}: allocate torch.empty({world_size}, {row_numel})"
            )
        if not out.is_contiguous():
            raise ValueError(f"chunk_cat out must be contiguous (got stride={out.stride()}): pass a contiguous buffer")
    return tensors, factor, out_dtype, list(numels), list(chunks), row_numel


class _Plan(NamedTuple):
    device: torch.device
    shape: tuple[int, int]  # of the output
    dtype: torch.dtype  # of the output
    grid: int
    table: torch.Tensor
    num_tensors: int
    row_numel: int
    like: int  # index of a non-empty input (types the source addresses)
    aligned: bool  # given a 16-byte aligned out
    in_vec: int
    out_vec: int


def _key(tensors: Sequence[torch.Tensor], world_size: int, dtype: torch.dtype | None,
         out: torch.Tensor | None) -> tuple | None:
    """The plan-cache key: everything validation and the table read from the inputs (and out's layout:
    out is a kernel argument, its address is not in the table); None when nothing may be cached (CUDA
    graph capture, malformed arguments: the validating path then says what is wrong)."""
    if not isinstance(tensors, (list, tuple)) or not tensors:
        return None
    T = torch.Tensor
    try:
        stream = stream_key(tensors[0].device)
        if stream is None:
            return None
        layout = None if out is None else (tuple(out.shape), out.dtype, out.is_contiguous(), out.device)
        return (
            stream,
            world_size,
            type(world_size),  # True == 1, but only an int passes validation
            dtype,
            layout,
            tuple(map(T.data_ptr, tensors)),
            tuple(map(_DTYPE, tensors)),
            tuple(map(T.get_device, tensors)),  # ints: cheaper to build and compare than devices
            tuple(map(_SHAPE, tensors)),
            tuple(map(T.is_contiguous, tensors)),
        )
    except (TypeError, AttributeError, ValueError, RuntimeError):
        return None


def _build_plan(tensors: list[torch.Tensor], world_size: int, out: torch.Tensor, numels: list[int],
                chunks: list[int], row_numel: int) -> _Plan:
    """The launch for validated, contiguous inputs with a non-empty output."""
    cols, counts, running = [], [], 0
    for m in chunks:
        cols.append(running)
        running += m
        counts.append(world_size * -(-m // BLOCK_SIZE))
    ptrs = [t.data_ptr() for t in tensors]
    in_vec = 16 // tensors[0].element_size()
    out_vec = 16 // out.element_size()
    aligned = (
        row_numel % out_vec == 0
        and all(p % 16 == 0 for p in ptrs)
        and all(m % in_vec == 0 for m in chunks)
        and all(c % out_vec == 0 for c in cols)
    )
    device = tensors[0].device
    table = block_table([ptrs, numels, chunks, cols, block_starts(counts)], counts, device)
    # `like` only types the source pointers: a non-empty tensor (empty CUDA tensors have null pointers).
    like = next(i for i, t in enumerate(tensors) if t.numel())
    return _Plan(device, (world_size, row_numel), out.dtype, sum(counts), table, len(tensors), row_numel, like,
                 aligned, in_vec, out_vec)


def _run(plan: _Plan, tensors: Sequence[torch.Tensor], out: torch.Tensor, factor: float) -> None:
    kernel_factor, divide, multiply = scale_args(factor)
    with device_guard(plan.device):
        _chunk_cat_kernel[(plan.grid,)](
            plan.table,
            tensors[plan.like],
            out,
            plan.num_tensors,
            plan.row_numel,
            kernel_factor,
            DIVIDE=divide,
            MULTIPLY=multiply,
            ALIGNED=plan.aligned and out.data_ptr() % 16 == 0,
            IN_VEC=plan.in_vec,
            OUT_VEC=plan.out_vec,
            BLOCK=BLOCK_SIZE,
            num_warps=_NUM_WARPS,
        )


def chunk_cat(
    tensors: Sequence[torch.Tensor],
    world_size: int,
    *,
    factor: float = 1.0,
    dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``torch._chunk_cat(tensors, dim=0, num_chunks=world_size)`` fused with ``/ factor`` and a cast.

    Returns (or fills) a ``(world_size, row_numel)`` tensor whose row ``r`` is chunk ``r`` of every tensor
    (each viewed as ``(dim0, rest)`` and zero-padded along dim 0 to a multiple of ``world_size``), divided
    by ``factor`` in fp32 (IEEE division) and cast to ``dtype`` (default: ``out.dtype``, else the inputs'
    dtype). All tensors share one floating dtype and one device. Contiguous inputs are read in place;
    a non-contiguous input is first copied with ``.contiguous()`` (one extra copy kernel and a temporary).
    One Triton launch for any number of tensors.
    """
    with profiled("shardfuse.kernels:chunk_cat"):
        key = _key(tensors, world_size, dtype, out)
        plan = None if key is None else _PLANS.get(key)
        if plan is not None and (plan.device.type == "cuda" or interpreting()):
            factor = _check_factor(factor)
            if out is None:
                out = torch.empty(plan.shape, dtype=plan.dtype, device=plan.device)
            _run(plan, tensors, out, factor)
            return out
        tensors, factor, out_dtype, numels, chunks, row_numel = _validate(tensors, world_size, factor, dtype, out)
        if out is None:
            out = torch.empty((world_size, row_numel), dtype=out_dtype, device=tensors[0].device)
        if not use_triton(*tensors, out):
            return chunk_cat_ref(tensors, world_size, factor=factor, dtype=out_dtype, out=out)
        if out.numel() == 0:
            return out
        strided = [i for i, t in enumerate(tensors) if not t.is_contiguous()]
        if strided:
            logger.debug("chunk_cat: copying non-contiguous tensors %s to contiguous first", strided)
            tensors = [t.contiguous() for t in tensors]
        plan = _build_plan(tensors, world_size, out, numels, chunks, row_numel)
        if key is not None and not strided:  # a table of temporaries' addresses must not outlive them
            _PLANS.put(key, plan)
        _run(plan, tensors, out, factor)
        return out


# ----------------------------------------------------------------------------------------------------------
# Reference (plain PyTorch, same signature)
# ----------------------------------------------------------------------------------------------------------


def chunk_cat_ref(
    tensors: Sequence[torch.Tensor],
    world_size: int,
    *,
    factor: float = 1.0,
    dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-PyTorch :func:`chunk_cat` (pad, reshape and copy per tensor; fp32 math, one final cast)."""
    tensors, factor, out_dtype, _, chunks, row_numel = _validate(tensors, world_size, factor, dtype, out)
    device = tensors[0].device
    if out is None:
        out = torch.empty((world_size, row_numel), dtype=out_dtype, device=device)
    full = torch.zeros((world_size, row_numel), dtype=torch.float32, device=device)
    col = 0
    for t, m in zip(tensors, chunks):
        if m:
            x = t.reshape(t.shape[0] if t.dim() > 0 else 1, -1).float()
            rows_per_chunk = m // x.shape[1]
            x = torch.nn.functional.pad(x, (0, 0, 0, world_size * rows_per_chunk - x.shape[0]))
            full[:, col : col + m] = x.reshape(world_size, m)
        col += m
    if factor != 1.0:
        # A device-tensor divisor: CUDA turns `x / python_scalar` into `x * (1 / scalar)`.
        full = full / torch.tensor(factor, dtype=torch.float32, device=device)
    return out.copy_(full)
