"""Chunked microbatch concat: join per-microbatch tensors along dim 0 into one preallocated buffer in one
launch, replacing ``torch.cat(list)`` for the outputs (and input gradients) of an offloaded model slice.

Each contiguous input is a contiguous segment of the output, so the kernel is a multi-tensor copy: a pointer
table, a per-tensor block-start prefix table and a per-program owner column map every program to
(tensor, block) with one dependent load. The launch plan (table included) is cached per set of inputs. The
copy moves raw bits (the tensors are addressed as integers of the same width), so it is exact for every
dtype of 1, 2, 4 or 8 bytes, NaN payloads included.

Non-contiguous inputs are copied straight into their slot of the output with ``Tensor.copy_`` (one extra
copy kernel per such input, but no temporary); the contiguous ones still share the single launch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from shardfuse._profiling import profiled
from shardfuse.kernels import _common as common
from shardfuse.kernels import _crossover
from shardfuse.kernels._launch import DirectLauncher
from shardfuse.kernels._overlap import check_no_overlap

__all__ = ["concat_microbatches", "split_microbatches", "concat_microbatches_ref"]

# Same-width integer dtypes the kernel copies through: a copy of raw bits is exact for any dtype.
_BITS_DTYPE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_WIDE_BYTES = 4  # narrower dtypes are copied as 4-byte words where sizes and addresses allow

_PLANS = common.GuardedPlanCache()


# ----------------------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _concat_kernel(
    meta_ptr,
    out_ptr,
    num_tensors,
    ALIGNED: tl.constexpr,
    VEC: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """meta (int64) = [src pointers | numels | out offsets | block starts | owner of every program]; out_ptr
    is typed as an integer of the element width, and so are the sources."""
    pid = tl.program_id(0).to(tl.int64)
    # One load finds the tensor (the host built the owner column); empty tensors own no program.
    i = tl.load(meta_ptr + 4 * num_tensors + pid)
    n = tl.load(meta_ptr + num_tensors + i)
    src_addr = tl.load(meta_ptr + i)
    dst_off = tl.load(meta_ptr + 2 * num_tensors + i)
    if ALIGNED:
        # Host-checked: sources 16-byte aligned, destination offsets whole 16-byte vectors.
        src_addr = tl.multiple_of(src_addr, 16)
        dst_off = tl.multiple_of(dst_off, VEC)
    src = src_addr.to(tl.pointer_type(out_ptr.dtype.element_ty))
    dst = out_ptr + dst_off
    start = (pid - tl.load(meta_ptr + 3 * num_tensors + i)) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    if start + BLOCK <= n:
        tl.store(dst + offs, tl.load(src + offs))
    else:
        mask = offs < n
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


# ----------------------------------------------------------------------------------------------------------
# Launchers (public API)
# ----------------------------------------------------------------------------------------------------------


_concat_launch = DirectLauncher(_concat_kernel)


def _validate(tensors: Sequence[torch.Tensor], out: torch.Tensor | None) -> tuple[list[torch.Tensor], tuple]:
    """Check the inputs (and ``out``); return them as a list and the output shape."""
    tensors = common.check_tensors(tensors, "tensors", "concat_microbatches")
    if not tensors:
        raise ValueError("concat_microbatches got an empty list of tensors: pass at least one tensor")
    for i, t in enumerate(tensors):
        if t.dim() == 0:
            raise ValueError(f"tensors[{i}] is 0-dimensional and cannot be joined along dim 0: use t.reshape(1)")
    t0 = tensors[0]
    trailing = tuple(t0.shape[1:])
    odd = next((i for i, t in enumerate(tensors) if tuple(t.shape[1:]) != trailing), None)
    if odd is not None:
        raise ValueError(
            f"concat_microbatches needs one trailing shape: tensors[0].shape={tuple(t0.shape)} "
            f"but tensors[{odd}].shape={tuple(tensors[odd].shape)}: only dim 0 may differ"
        )
    odd = next((i for i, t in enumerate(tensors) if t.dtype != t0.dtype), None)
    if odd is not None:
        raise TypeError(
            f"concat_microbatches needs one dtype: tensors[0] is {t0.dtype} but tensors[{odd}] is "
            f"{tensors[odd].dtype}: cast them first"
        )
    names = [f"tensors[{i}]" for i in range(len(tensors))]
    if out is not None:
        common.check_tensor(out, "out")
    common.check_same_device(tensors + ([out] if out is not None else []), names + (["out"] if out is not None else []))
    shape = (sum(t.shape[0] for t in tensors), *trailing)
    if out is not None:
        if tuple(out.shape) != shape:
            raise ValueError(
                f"concat_microbatches out has shape {tuple(out.shape)}, expected {shape}: "
                f"allocate torch.empty({shape}, dtype={tensors[0].dtype})"
            )
        if out.dtype != tensors[0].dtype:
            raise TypeError(
                f"concat_microbatches out has dtype {out.dtype} but the tensors are {tensors[0].dtype}: "
                f"pass an out of the tensors' dtype"
            )
        if not out.is_contiguous():
            raise ValueError(
                f"concat_microbatches out must be contiguous (got stride={out.stride()}): pass a contiguous buffer"
            )
        fix = "concatenate into a buffer apart from the inputs (or pass out=None)"
        check_no_overlap("concat_microbatches", list(zip(names, tensors)), [("out", out)], fix)
    return tensors, shape


class _TorchPlan(NamedTuple):
    """A call below the crossover (``_crossover``, family "concat"): ``torch.cat`` (same bits)."""

    device: torch.device
    shape: tuple
    dtype: torch.dtype
    check: Callable[..., bool] | None = None  # the layout guard of the tensors (and out) it was built for


class _Plan(NamedTuple):
    device: torch.device
    shape: tuple  # of the output
    dtype: torch.dtype
    bits: torch.dtype  # integer dtype of the element width: the kernel copies raw bits
    grid: int  # 0: no contiguous input, nothing to launch
    table: torch.Tensor | None
    num_tensors: int
    aligned: bool  # sources and offsets 16-byte aligned, given a 16-byte aligned out
    vec: int
    strided: tuple[tuple[int, int], ...]  # (input index, element offset) of each non-contiguous input
    check: Callable[..., bool] | None = None  # the layout guard of the tensors (and out) it was built for


def _key(guarded: list[torch.Tensor], has_out: bool) -> tuple | None:
    """``guarded``: the inputs, then ``out`` if given. The key holds their addresses, the plan their layout guard."""
    return common.guarded_key(guarded, has_out)


def _copy_width(tensors: list[torch.Tensor]) -> int:
    """Bytes per copied element: 1- and 2-byte dtypes go as 4-byte words when every size and address allows.

    With BLOCK_SIZE elements per program a 2-byte copy moves half the bytes per program of a 4-byte one and
    falls short of the copy bandwidth (bf16 concat ran at 70-87% where fp32 ran at 90-100%, H100/H200).
    """
    size = tensors[0].element_size()
    if size >= _WIDE_BYTES:
        return size
    k = _WIDE_BYTES // size
    if all(t.numel() % k == 0 and (not t.is_contiguous() or t.data_ptr() % _WIDE_BYTES == 0) for t in tensors):
        return _WIDE_BYTES
    return size


def _build_plan(tensors: list[torch.Tensor], shape: tuple, device: torch.device, widen: bool = True) -> _Plan:
    """The launch for validated inputs (whose element width the kernel can copy)."""
    t0 = tensors[0]
    width = _copy_width(tensors) if widen else t0.element_size()
    k = width // t0.element_size()  # original elements per copied element
    vec = 16 // width
    ptrs, numels, offsets, counts, strided = [], [], [], [], []
    offset = 0
    for i, t in enumerate(tensors):
        n = t.numel()
        if n and t.is_contiguous():
            ptrs.append(t.data_ptr())
            numels.append(n // k)
            offsets.append(offset // k)
            counts.append(-(-(n // k) // common.BLOCK_SIZE))
        elif n:
            strided.append((i, offset))  # in elements of the output's dtype
        offset += n
    table = common.block_table([ptrs, numels, offsets, common.block_starts(counts)], counts, device) if ptrs else None
    aligned = all(p % 16 == 0 for p in ptrs) and all(o % vec == 0 for o in offsets)
    return _Plan(device, shape, t0.dtype, _BITS_DTYPE[width], sum(counts), table, len(ptrs), aligned, vec,
                 tuple(strided))


def _run(plan: _Plan, tensors: list[torch.Tensor], out: torch.Tensor) -> None:
    flat = out.view(-1)
    for i, offset in plan.strided:
        # No strided path in the kernel: copy_ writes the slot directly, with no temporary.
        t = tensors[i]
        flat[offset : offset + t.numel()].view(t.shape).copy_(t)
    if not plan.grid:
        return
    width = plan.bits.itemsize
    if out.data_ptr() % width:
        # out itself sits off the word boundary (a view into a larger buffer): copy element by element
        plan = _build_plan(tensors, plan.shape, plan.device, widen=False)
    with common.device_guard(plan.device):
        _concat_launch[(plan.grid,)](
            plan.table,
            flat.view(plan.bits),
            plan.num_tensors,
            ALIGNED=plan.aligned and out.data_ptr() % 16 == 0,
            VEC=plan.vec,
            BLOCK=common.BLOCK_SIZE,
            num_warps=common.NUM_WARPS,
        )


def concat_microbatches(tensors: Sequence[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.cat(tensors, dim=0, out=out)`` in one launch for any number of tensors.

    All tensors share the trailing shape (``shape[1:]``), dtype and device; ``out`` (allocated when not
    given) must be contiguous with shape ``(sum of dim 0, *trailing)`` and the same dtype. Contiguous inputs
    are copied by one Triton kernel; each non-contiguous input is copied into its slot with ``copy_``.
    A repeat call with the same inputs (addresses, shapes, dtype, device, stream) reuses the cached launch
    plan. Below the measured crossover of the GPU (``shardfuse.kernels._crossover``, family ``"concat"``) the call
    is ``torch.cat(tensors, out=out)``: the same bits, faster there. Returns ``out``.
    """
    with profiled("shardfuse.kernels:concat_microbatches"):
        tensors = common.as_list(tensors)
        guarded = None if type(tensors) is not list else (tensors if out is None else [*tensors, out])
        key = None if guarded is None else _key(guarded, out is not None)
        plan = _PLANS.get(key, guarded)
        if plan is None:
            tensors, shape = _validate(tensors, out)
            if out is None:
                out = torch.empty(shape, dtype=tensors[0].dtype, device=tensors[0].device)
            if out.element_size() not in _BITS_DTYPE or not common.use_triton(*tensors, out):
                return concat_microbatches_ref(tensors, out=out)
            nbytes = 2 * out.numel() * out.element_size()  # every input read once, out written once
            if _crossover.use_triton_at("concat", out.device, len(tensors), nbytes):
                plan = _build_plan(tensors, shape, out.device)
            else:
                plan = _TorchPlan(out.device, shape, out.dtype)
            if key is not None and guarded is not None:
                plan = plan._replace(check=common.layout_guard(guarded))
                _PLANS.put(key, plan)
        elif out is None:
            out = torch.empty(plan.shape, dtype=plan.dtype, device=plan.device)
        if isinstance(plan, _TorchPlan):
            return torch.cat(tensors, dim=0, out=out)
        _run(plan, tensors, out)
        return out


def split_microbatches(buffer: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
    """Views of ``buffer`` along dim 0 of the given sizes (the inverse of :func:`concat_microbatches`).

    ``sizes`` must be non-negative integers summing to ``buffer.shape[0]``. No copy is made.
    """
    with profiled("shardfuse.kernels:split_microbatches"):
        common.check_tensor(buffer, "buffer")
        if buffer.dim() == 0:
            raise ValueError("split_microbatches needs a buffer with at least one dimension, got a 0-dim tensor")
        if not isinstance(sizes, Iterable):
            raise ValueError(f"split_microbatches sizes must be a list of non-negative ints, got {sizes=!r}")
        sizes = list(sizes)
        for i, s in enumerate(sizes):
            if isinstance(s, bool) or not isinstance(s, int) or s < 0:
                raise ValueError(f"split_microbatches sizes must be non-negative ints, got sizes[{i}]={s!r}")
        if sum(sizes) != buffer.shape[0]:
            raise ValueError(
                f"split_microbatches sizes sum to {sum(sizes)} but buffer.shape[0]={buffer.shape[0]}: "
                f"{sizes=} must add up to the buffer's dim 0"
            )
        return list(buffer.split(sizes, dim=0))


# ----------------------------------------------------------------------------------------------------------
# Reference (plain PyTorch, same signature)
# ----------------------------------------------------------------------------------------------------------


def concat_microbatches_ref(tensors: Sequence[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """Plain-PyTorch :func:`concat_microbatches` (``torch.cat``)."""
    tensors, shape = _validate(tensors, out)
    if out is None:
        return torch.cat(tensors, dim=0)
    return torch.cat(tensors, dim=0, out=out)
