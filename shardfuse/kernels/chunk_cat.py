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
from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch.profiler import record_function

from shardfuse.kernels._common import (
    BLOCK_SIZE,
    check_float,
    check_same_device,
    int64_table,
    use_triton,
)

logger = logging.getLogger(__name__)

# BLOCK_SIZE=4096 over 256 threads: 16 elements each, several 16-byte vectors in flight per thread.
_NUM_WARPS = 8

__all__ = ["chunk_cat", "chunk_cat_ref"]


# ----------------------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _chunk_cat_kernel(
    meta_ptr,
    like_ptr,
    out_ptr,
    num_tensors,
    search_steps,
    row_numel,
    factor,
    DIVIDE: tl.constexpr,
    ALIGNED: tl.constexpr,
    IN_VEC: tl.constexpr,
    OUT_VEC: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """meta (int64) = [src pointers | numels | chunk numels | column offsets | block starts (T+1)].

    Tensor i owns world_size * cdiv(chunk_numel_i, BLOCK) programs: (row r, block b) copies elements
    [b*BLOCK, (b+1)*BLOCK) of chunk r, i.e. source elements r*chunk_numel_i + [b*BLOCK, ...), into
    out[r, col_i + b*BLOCK + ...]. Source elements past numel_i are the dim-0 padding and come out zero.
    """
    pid = tl.program_id(0).to(tl.int64)
    numel_tab = meta_ptr + num_tensors
    chunk_tab = meta_ptr + 2 * num_tensors
    col_tab = meta_ptr + 3 * num_tensors
    start_tab = meta_ptr + 4 * num_tensors
    # Binary search for the tensor i with start[i] <= pid < start[i + 1]; empty tensors own no program.
    lo = pid * 0
    hi = lo + num_tensors
    for _ in range(search_steps):
        mid = (lo + hi) // 2
        go_right = tl.load(start_tab + mid) <= pid
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid)
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
        if DIVIDE:
            x = tl.math.div_rn(x, factor)
        tl.store(dst + offs, x.to(out_ptr.dtype.element_ty))
    else:
        in_chunk = j0 + offs < m
        # Masked-off loads read 0 and 0 / factor == +0: the padding rows come out exactly zero.
        x = tl.load(src + offs, mask=in_chunk & (src_start + offs < n), other=0.0).to(tl.float32)
        if DIVIDE:
            x = tl.math.div_rn(x, factor)
        tl.store(dst + offs, x.to(out_ptr.dtype.element_ty), mask=in_chunk)


# ----------------------------------------------------------------------------------------------------------
# Launcher (public API)
# ----------------------------------------------------------------------------------------------------------


def _layout(t: torch.Tensor, world_size: int) -> tuple[int, int]:
    """(numel, chunk numel) of ``t`` viewed as (dim0, rest); 0-dim tensors count as shape (1,)."""
    dim0 = t.shape[0] if t.dim() > 0 else 1
    rest = math.prod(t.shape[1:]) if t.dim() > 1 else 1
    return t.numel(), -(-dim0 // world_size) * rest


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
    factor = float(factor)
    if not math.isfinite(factor) or factor <= 0.0:
        raise ValueError(f"the divide factor must be a finite number > 0, got {factor=}: use 1.0 for no division")
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
    with record_function("shardfuse.kernels:chunk_cat"):
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
        cols, block_starts, running = [], [0], 0
        for m in chunks:
            cols.append(running)
            running += m
            block_starts.append(block_starts[-1] + world_size * triton.cdiv(m, BLOCK_SIZE))
        ptrs = [t.data_ptr() for t in tensors]
        in_vec = 16 // tensors[0].element_size()
        out_vec = 16 // out.element_size()
        aligned = (
            out.data_ptr() % 16 == 0
            and row_numel % out_vec == 0
            and all(p % 16 == 0 for p in ptrs)
            and all(m % in_vec == 0 for m in chunks)
            and all(c % out_vec == 0 for c in cols)
        )
        num_tensors = len(tensors)
        meta = int64_table(ptrs + numels + chunks + cols + block_starts, out.device)
        # `like` only types the source pointers: a non-empty tensor (empty CUDA tensors have null pointers).
        like = next(t for t in tensors if t.numel())
        _chunk_cat_kernel[(block_starts[-1],)](
            meta,
            like,
            out,
            num_tensors,
            math.ceil(math.log2(num_tensors)) if num_tensors > 1 else 0,
            row_numel,
            factor,
            DIVIDE=factor != 1.0,
            ALIGNED=aligned,
            IN_VEC=in_vec,
            OUT_VEC=out_vec,
            BLOCK=BLOCK_SIZE,
            num_warps=_NUM_WARPS,
        )
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
