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
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from shardfuse._profiling import profiled
from shardfuse.kernels import _common as common
from shardfuse.kernels import _crossover
from shardfuse.kernels._common import apply_scale
from shardfuse.kernels._launch import DirectLauncher
from shardfuse.kernels._overlap import check_no_overlap

logger = logging.getLogger(__name__)

__all__ = ["chunk_cat", "chunk_cat_ref"]

# On CUDA, torch._chunk_cat and one scaling pass take over from this many tensors on when they carry less
# than TORCH_MAX_OUT_BYTES_PER_TENSOR of output each: there the per-tensor host work of a launch plan (its key
# and layout guard, ~0.25 us a tensor on a slow host) is as much as torch._chunk_cat's own, and skipping it is
# worth the branch's extra buffer. Measured with direct launches (``_launch``) on H200 hosts, bf16, world size 8,
# factor 4 (docs/kernels.md, "Dispatch"): the kernel through its plan as fast as the branch or faster up to 1023
# tensors, and 1.6-2.5x the bare pair from 256 KiB of output per tensor at any count. At 1024 tensors the branch
# won at 16 KiB a tensor (8K bf16 elements) in six stored runs of seven (174 against 182 us at 81ed8f3),
# the kernel at 64 and 128 KiB in all seven (1024 x 32K: 174 against 183, 1024 x 64K: 177 against 191 at 81ed8f3;
# by 2-57 us elsewhere): the threshold lies between, at 32 KiB.
TORCH_MIN_TENSORS = 1024
TORCH_MAX_OUT_BYTES_PER_TENSOR = 32 * 1024

_PLANS = common.GuardedPlanCache()


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


_chunk_cat_launch = DirectLauncher(_chunk_cat_kernel)


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
    tensors = common.check_tensors(tensors, "tensors", "chunk_cat")
    if not tensors:
        raise ValueError("chunk_cat got an empty list of tensors: pass at least one tensor")
    world_size = common.check_world_size(world_size, "chunk_cat")
    factor = common.check_factor(factor)
    common.check_dtype_arg(dtype)
    names = [f"tensors[{i}]" for i in range(len(tensors))]
    for t, name in zip(tensors, names):
        common.check_float(t, name)
    if out is not None:
        common.check_tensor(out, "out")
    in_dtypes = {t.dtype for t in tensors}
    if len(in_dtypes) > 1:
        raise TypeError(
            f"chunk_cat needs all tensors in one dtype, got {sorted(str(d) for d in in_dtypes)}: "
            f"group them by dtype and call once per group"
        )
    if out is not None and dtype is not None and out.dtype != dtype:
        raise TypeError(f"chunk_cat got {dtype=} but out.dtype={out.dtype}: pass one or make them agree")
    out_dtype = dtype if dtype is not None else (out.dtype if out is not None else tensors[0].dtype)
    if out_dtype not in common.FLOAT_DTYPES:
        raise TypeError(f"chunk_cat output dtype {out_dtype} is not supported: use float32, bfloat16 or float16")
    common.check_same_device(tensors + ([out] if out is not None else []), names + (["out"] if out is not None else []))
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
        fix = "write into a buffer apart from the inputs (or pass out=None)"
        check_no_overlap("chunk_cat", list(zip(names, tensors)), [("out", out)], fix)
    return tensors, factor, out_dtype, list(numels), list(chunks), row_numel


class _TorchPlan(NamedTuple):
    """A call below the crossover (``_crossover``, family "chunk_cat"): ``torch._chunk_cat`` into ``out``, then
    the scale in place. Only built where PyTorch computes the kernel's bits (see :func:`_torch_computes_same`)."""

    device: torch.device
    shape: tuple[int, int]
    dtype: torch.dtype
    check: Callable[..., bool]  # the layout guard of the tensors (and out) it was built for


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
    check: Callable[..., bool] | None = None  # the layout guard of the tensors (and out) it was built for


def _guarded(tensors: list[torch.Tensor], out: torch.Tensor | None) -> list[torch.Tensor]:
    """The tensors a plan reads and writes: the key holds their addresses, the plan their layout guard."""
    return tensors if out is None else [*tensors, out]


def _key(guarded: list[torch.Tensor], world_size: int, dtype: torch.dtype | None, has_out: bool) -> tuple | None:
    # type(world_size): True == 1, but only an int passes validation.
    return common.guarded_key(guarded, world_size, type(world_size), dtype, has_out)


def _build_plan(tensors: list[torch.Tensor], world_size: int, out: torch.Tensor, numels: list[int],
                chunks: list[int], row_numel: int) -> _Plan:
    """The launch for validated, contiguous inputs with a non-empty output."""
    cols, counts, running = [], [], 0
    for m in chunks:
        cols.append(running)
        running += m
        counts.append(world_size * -(-m // common.BLOCK_SIZE))
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
    table = common.block_table([ptrs, numels, chunks, cols, common.block_starts(counts)], counts, device)
    # `like` only types the source pointers: a non-empty tensor (empty CUDA tensors have null pointers).
    like = next(i for i, t in enumerate(tensors) if t.numel())
    return _Plan(device, (world_size, row_numel), out.dtype, sum(counts), table, len(tensors), row_numel, like,
                 aligned, in_vec, out_vec)


def _run(plan: _Plan, tensors: Sequence[torch.Tensor], out: torch.Tensor, factor: float) -> None:
    kernel_factor, divide, multiply = common.scale_args(factor)
    aligned = plan.aligned and out.data_ptr() % 16 == 0
    with common.device_guard(plan.device):
        _chunk_cat_launch[(plan.grid,)](
            plan.table, tensors[plan.like], out, plan.num_tensors, plan.row_numel, kernel_factor, DIVIDE=divide,
            MULTIPLY=multiply, ALIGNED=aligned, IN_VEC=plan.in_vec, OUT_VEC=plan.out_vec, BLOCK=common.BLOCK_SIZE,
            num_warps=common.NUM_WARPS,
        )


def _torch_computes_same(tensors: list[torch.Tensor], factor: float, out_dtype: torch.dtype) -> bool:
    """Whether ``torch._chunk_cat`` and a scale give the kernel's bits for these validated arguments: no cast,
    a factor of 1 or a power of two (a multiply), and tensors ``torch._chunk_cat`` takes (non-empty, >= 1-dim)."""
    _, divide, multiply = common.scale_args(factor)
    if out_dtype != tensors[0].dtype or (divide and not multiply):
        return False
    return all(t.dim() > 0 and t.numel() > 0 for t in tensors)


def _run_torch(tensors: list[torch.Tensor], world_size: int, scale: tuple[float, bool, bool],
               out: torch.Tensor) -> torch.Tensor:
    """The PyTorch sequence for a validated call (``out`` of the right shape, apart from the inputs), given
    ``scale = common.scale_args(factor)`` of a factor it scales exactly (1, or a multiply)."""
    torch._chunk_cat(tensors, 0, world_size, out=out)
    kernel_factor, divide, _ = scale
    if divide:
        out.mul_(kernel_factor)  # x * 2**-k rounds like x / 2**k: one rounding of one value
    return out


def use_torch_chunk_cat(
    tensors: Sequence[torch.Tensor], factor: float, dtype: torch.dtype | None, out: torch.Tensor | None
) -> bool:
    """Whether :func:`chunk_cat` runs ``torch._chunk_cat`` and one scaling pass instead of its kernel
    (:func:`_torch_branch_scale`)."""
    return _torch_branch_scale(tensors, factor, dtype, out) is not None


def _torch_branch_scale(
    tensors: Sequence[torch.Tensor], factor: float, dtype: torch.dtype | None, out: torch.Tensor | None
) -> tuple[float, bool, bool] | None:
    """``common.scale_args`` of ``factor`` where :func:`chunk_cat` runs ``torch._chunk_cat`` and one scaling pass
    instead of its kernel, else None (the branch uses the scale it was judged on: no second check of the factor).

    Decided from the count, the first tensor and ``out`` alone (reading every tensor's layout is the cost
    being avoided): at least TORCH_MIN_TENSORS tensors on CUDA, with less than TORCH_MAX_OUT_BYTES_PER_TENSOR
    of output each when ``out`` tells the size, or more where the GPU's measured crossover (``_crossover``,
    ``"chunk_cat"``) sends the call to PyTorch at any size up to 2 x ``out``'s bytes. Only where PyTorch
    computes the same bits: no cast (the output dtype is the inputs') and a factor whose division is a
    multiplication by an exact power of two.
    """
    if len(tensors) < TORCH_MIN_TENSORS:
        return None
    t0 = tensors[0]
    if not isinstance(t0, torch.Tensor) or t0.dtype not in common.FLOAT_DTYPES or not common.triton_device(t0):
        return None
    if dtype is not None and dtype != t0.dtype:
        return None
    try:
        scale = common.scale_args(common.check_factor(factor))
    except ValueError:
        return None  # the validating path names the bad factor
    _, divide, multiply = scale
    if divide and not multiply:
        return None
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.dtype != t0.dtype or out.device != t0.device:
            return None
        out_bytes = out.numel() * out.element_size()
        # Past the count rule's bytes per tensor the kernel wins, unless the GPU's measured crossover sends the
        # call to PyTorch anyway: judged at 2 x out's bytes, at least what the call moves (no cast: the inputs
        # are out less its padding) and the rule only takes more calls to the kernel as bytes grow, so a call
        # it sends to PyTorch there it sends at its true size too, without the per-tensor sum (and the plan's
        # per-tensor key and guard) that cost ~0.2 us a tensor (1024 tensors: 180 us on an H200 host). Only
        # with a division: the branch concatenates into a new buffer first (``_chunk_cat_torch``), which a
        # division reads into ``out`` in the pass it makes anyway, while without one it is a copy more.
        if out_bytes >= len(tensors) * TORCH_MAX_OUT_BYTES_PER_TENSOR and (not divide or _crossover.use_triton_at(
                "chunk_cat", out.device, len(tensors), 2 * out_bytes)):
            return None
    return scale


def _below_crossover(tensors: list[torch.Tensor], out: torch.Tensor) -> bool:
    """Whether the measured crossover sends this call to the PyTorch sequence (``_crossover``, "chunk_cat")."""
    nbytes = sum(t.numel() for t in tensors) * tensors[0].element_size() + out.numel() * out.element_size()
    return not _crossover.use_triton_at("chunk_cat", out.device, len(tensors), nbytes)


def _chunk_cat_torch(tensors: list[torch.Tensor], world_size: int, scale: tuple[float, bool, bool],
                     out: torch.Tensor | None) -> torch.Tensor | None:
    """``torch._chunk_cat`` into a new buffer, then one pass ``* (1 / factor)`` into ``out`` (``scale``:
    ``common.scale_args(factor)``, a factor of 1 or a multiply); None where
    PyTorch refuses the arguments or its result does not fit ``out`` (the validating path then says why).

    The whole result exists before ``out`` is written, so ``out`` is never resized by PyTorch and an ``out``
    that overlaps the inputs cannot change what is read. The new buffer is an empty one that PyTorch's out=
    variant sizes itself (an empty tensor resizes without a warning): the functional call works the size out in a
    pass over the tensors of its own before the out= variant's, 15-25 us more host time at 1024 tensors on an H200
    host (``logs/h200-chunk-cat-branch-probe-cb130ce.txt``), as much as the whole branch then cost over the bare pair.
    """
    try:
        full = (tensors[0] if out is None else out).new_empty(0)  # the inputs' dtype: use_torch_chunk_cat checked
        torch._chunk_cat(tensors, 0, world_size, out=full)
    except (RuntimeError, TypeError):
        return None
    if out is None:
        out = full
    elif full.shape != out.shape or not out.is_contiguous():
        return None
    kernel_factor, divide, _ = scale
    if divide:
        torch.mul(full, kernel_factor, out=out)  # x * 2**-k rounds like x / 2**k: one rounding of one value
    elif out is not full:
        out.copy_(full)
    return out


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
    dtype). All tensors share one floating dtype and one device; ``out`` must not overlap them. Contiguous
    inputs are read in place; a non-contiguous input is first copied with ``.contiguous()`` (one extra
    copy kernel and a temporary). One Triton launch for any number of tensors, except where PyTorch's
    ``_chunk_cat`` is measured faster and computes the same bits (see :func:`use_torch_chunk_cat`, and below the
    GPU's size crossover: ``shardfuse.kernels._crossover``, family ``"chunk_cat"``).
    """
    with profiled("shardfuse.kernels:chunk_cat"):
        tensors = common.as_list(tensors)
        scale = _torch_branch_scale(tensors, factor, dtype, out) if isinstance(tensors, list) else None
        if scale is not None:
            result = _chunk_cat_torch(tensors, common.check_world_size(world_size, "chunk_cat"), scale, out)
            if result is not None:
                return result
        guarded = _guarded(tensors, out) if type(tensors) is list else None
        key = None if guarded is None else _key(guarded, world_size, dtype, out is not None)
        plan = _PLANS.get(key, guarded)
        if plan is not None:
            if out is None:
                out = torch.empty(plan.shape, dtype=plan.dtype, device=plan.device)
            if isinstance(plan, _TorchPlan):
                # The plan holds only for tensors PyTorch takes, without a cast (key and guard fix both): the
                # factor alone, not in the key, decides whether PyTorch computes the kernel's bits.
                scale = common.scale_args(common.check_factor(factor))
                if scale[2] or not scale[1]:  # a multiply, or no division
                    return _run_torch(tensors, world_size, scale, out)
                plan = None  # a factor the PyTorch sequence cannot scale exactly: build the kernel's plan
            else:
                _run(plan, tensors, out, common.check_factor(factor))
                return out
        tensors, factor, out_dtype, numels, chunks, row_numel = _validate(tensors, world_size, factor, dtype, out)
        if out is None:
            out = torch.empty((world_size, row_numel), dtype=out_dtype, device=tensors[0].device)
        if not common.use_triton(*tensors, out):
            return chunk_cat_ref(tensors, world_size, factor=factor, dtype=out_dtype, out=out)
        if out.numel() == 0:
            return out
        if _below_crossover(tensors, out) and _torch_computes_same(tensors, factor, out_dtype):
            if key is not None and guarded is not None:
                guard = common.layout_guard(guarded)
                _PLANS.put(key, _TorchPlan(out.device, (world_size, row_numel), out_dtype, guard))
            return _run_torch(tensors, world_size, common.scale_args(factor), out)
        strided = [i for i, t in enumerate(tensors) if not t.is_contiguous()]
        if strided:
            logger.debug("chunk_cat: copying non-contiguous tensors %s to contiguous first", strided)
            tensors = [t.contiguous() for t in tensors]
        plan = _build_plan(tensors, world_size, out, numels, chunks, row_numel)
        # Not for copies of strided inputs: a table of temporaries' addresses must not outlive them.
        if not strided and key is not None and guarded is not None:
            _PLANS.put(key, plan._replace(check=common.layout_guard(guarded)))
        _run(plan, tensors, out, factor)
        return out


# ----------------------------------------------------------------------------------------------------------
# Reference (plain PyTorch, same signature)
# ----------------------------------------------------------------------------------------------------------


def chunk_cat_ref(tensors: Sequence[torch.Tensor], world_size: int, *, factor: float = 1.0,
                  dtype: torch.dtype | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
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
