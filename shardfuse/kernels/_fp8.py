"""Float8 shard cast: per-tensor amax and the tensorwise float8 cast of shard segments into the all-gather
buffer, each for many tensors in one launch.

This is torchao's tensorwise dynamic recipe (``torchao.float8``: ``tensor_to_amax``, ``amax_to_scale``,
``to_fp8_saturated``) for the weights an fp8 all-gather sends:

- ``amax[i] = max(|x_i|)`` over tensor (segment) ``i`` (NaN if any element is NaN): :func:`fp8_amax`, one launch
  for all segments. Across ranks the amaxes are all-reduced with MAX by the sharding layer, not here;
- ``scale[i] = float32(fp8_max / max(float64(amax[i]), 1e-12))``: :func:`amax_to_scale`, a few elementwise ops
  on the vector of amaxes (the same IEEE operations torchao runs on each scalar, hence the same bits);
- ``out[offsets[i] + j] = float8(clamp(float32(x_i[j]) * scale[i], -fp8_max, fp8_max))``: :func:`cast_fp8_shards`,
  one launch for all segments, into a flat float8 (or uint8) buffer at the given offsets.

The float8 rounding is written out on the fp32 bit pattern (round to nearest, ties to even; NaN keeps its sign as
``0x7f | sign``, as PyTorch's ``Tensor.to(torch.float8_e4m3fn)`` does) rather than left to the hardware's convert
instruction, so that the kernel gives the reference's bytes both on the GPU and under Triton's interpreter (whose
float8 conversion truncates). Only ``torch.float8_e4m3fn`` (the weights' dtype in torchao's recipe) is supported.

Layout: ``@triton.jit`` kernels, launchers, references (``fp8_amax_ref``, ``cast_fp8_shards_ref``).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from shardfuse._profiling import profiled
from shardfuse.kernels import _common as common
from shardfuse.kernels._launch import DirectLauncher
from shardfuse.kernels._overlap import check_no_overlap

__all__ = ["FP8_DTYPE", "amax_to_scale", "cast_fp8_shards", "cast_fp8_shards_ref", "fp8_amax", "fp8_amax_ref"]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
EPS = 1e-12  # torchao's floor on amax (avoids a division by zero for an all-zero tensor)


# --------------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------------


@triton.jit
def _e4m3_bits(x):
    """fp32 ``x`` (already within [-448, 448] or NaN) as float8_e4m3fn bits in an int32, round to nearest even."""
    u = x.to(tl.int32, bitcast=True)
    sign = (u >> 24) & 0x80
    a = u & 0x7FFFFFFF
    # Normal results (|x| >= 2**-6): keep 3 mantissa bits with ties to even, then rebias the exponent 127 -> 7.
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
    # Subnormal results: adding 2**-6 * 2**17 (fp32 bits 141 << 23) makes the fp32 adder round |x| to a multiple
    # of 2**-9 (ties to even); the low bits of the sum are then the e4m3 subnormal mantissa.
    magic = tl.full(a.shape, 141 << 23, tl.int32)
    sub = (a.to(tl.float32, bitcast=True) + magic.to(tl.float32, bitcast=True)).to(tl.int32, bitcast=True) - magic
    bits = tl.where(a < (121 << 23), sub, normal)
    bits = tl.where(a > 0x7F800000, 0x7F, bits)  # NaN
    return bits | sign


@triton.jit
def _fp8_block(src, dst, offs, n, scale, MASKED: tl.constexpr):
    if MASKED:
        mask = offs < n
        x = tl.load(src + offs, mask=mask).to(tl.float32)
    else:
        x = tl.load(src + offs).to(tl.float32)  # no cache hint: see _cast.cast_block
    y = x * scale
    # clamp keeps NaN (torch.clamp does): min/max would drop it.
    y = tl.where(y > 448.0, 448.0, tl.where(y < -448.0, -448.0, y))
    bits = _e4m3_bits(y).to(tl.uint8)
    if MASKED:
        tl.store(dst + offs, bits, mask=mask)
    else:
        tl.store(dst + offs, bits)


@triton.jit
def _cast_fp8_kernel(table, scales, num_tensors, src_like, out_ptr, BLOCK: tl.constexpr):
    """``table`` (int64): block starts [T], numels [T], source addresses [T], out offsets [T], scale indices
    [T], then the owning tensor of every program. ``out_ptr`` is the flat output viewed as uint8."""
    pid = tl.program_id(0).to(tl.int64)
    t = tl.load(table + 5 * num_tensors + pid)
    block = pid - tl.load(table + t)
    n = tl.load(table + num_tensors + t)
    src = tl.load(table + 2 * num_tensors + t).to(src_like.dtype)
    dst = out_ptr + tl.load(table + 3 * num_tensors + t)
    scale = tl.load(scales + tl.load(table + 4 * num_tensors + t))
    offs = block * BLOCK + tl.arange(0, BLOCK)
    if (block + 1) * BLOCK <= n:
        _fp8_block(src, dst, offs, n, scale, False)
    else:
        _fp8_block(src, dst, offs, n, scale, True)


_cast_fp8_launch = DirectLauncher(_cast_fp8_kernel)


@triton.jit
def _amax_kernel(table, num_tensors, src_like, amax_bits, BLOCK: tl.constexpr):
    """``amax_bits`` (int32, zeroed) gets max |x| of each tensor as fp32 bits: for non-negative floats the bit
    patterns order as the values do, and NaN (0x7fc00000 and up) sorts above +inf, so NaN wins, as in torch.max.
    ``table`` (int64): block starts [T], numels [T], source addresses [T], indices into ``amax_bits`` [T], owners."""
    pid = tl.program_id(0).to(tl.int64)
    t = tl.load(table + 4 * num_tensors + pid)
    block = pid - tl.load(table + t)
    n = tl.load(table + num_tensors + t)
    src = tl.load(table + 2 * num_tensors + t).to(src_like.dtype)
    offs = block * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(src + offs, mask=offs < n, other=0.0).to(tl.float32)
    a = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    tl.atomic_max(amax_bits + tl.load(table + 3 * num_tensors + t), tl.max(a, axis=0))


_amax_launch = DirectLauncher(_amax_kernel)


# --------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------

# Plans found by the tensors' addresses (``_common.guarded_key``), each holding the layout guard of the tensors its
# table addresses and its launch is given (``_common.layout_guard``): another layout at the same addresses misses.
_CAST_PLANS = common.GuardedPlanCache()
# The same tables by the sources' addresses and the offsets alone: ``scales`` and ``out`` are launch arguments, not in
# the table, so a gather buffer that comes back elsewhere (its storage is freed and allocated again every step) costs a
# validation, not a new table and its copy to the device (which would queue behind other host-to-device copies).
_CAST_BY_SOURCES = common.GuardedPlanCache()
_AMAX_PLANS = common.GuardedPlanCache()


class _Plan(NamedTuple):
    device: torch.device
    grid: int
    table: torch.Tensor | None
    num_tensors: int
    like: int  # index of a non-empty source (types the source addresses)
    block: int
    num_warps: int
    check: Callable[..., bool] | None = None  # the layout guard of the tensors it was built for


def _check_srcs(srcs: Sequence[torch.Tensor], caller: str) -> list[torch.Tensor]:
    srcs = common.check_tensors(srcs, "srcs", caller)
    for i, s in enumerate(srcs):
        common.check_float(s, f"srcs[{i}]")
        if not s.is_contiguous():
            raise ValueError(
                f"{caller}: srcs[{i}] must be contiguous (stride={s.stride()}): pass srcs[{i}].contiguous()"
            )
    dtypes = {s.dtype for s in srcs}
    if len(dtypes) > 1:  # the launch reads every source address as one element type
        raise TypeError(f"{caller} needs all srcs in one dtype, got {sorted(str(d) for d in dtypes)}: group them by "
                        f"dtype and call once per group")
    if srcs:
        common.check_same_device(srcs, [f"srcs[{i}]" for i in range(len(srcs))])
    return srcs


def _plan(srcs: list[torch.Tensor], extra: list[list[int]], device: torch.device) -> _Plan:
    """One launch over the non-empty sources: table columns block starts, numels, addresses, ``extra``, owners."""
    idx = [i for i, s in enumerate(srcs) if s.numel()]
    if not idx:
        return _Plan(device, 0, None, 0, 0, 0, 0)
    numels = [srcs[i].numel() for i in idx]
    block, num_warps = common.multi_block(numels)
    counts = [-(-k // block) for k in numels]
    addrs = [srcs[i].data_ptr() for i in idx]
    cols = [common.block_starts(counts), numels, addrs, *([c[i] for i in idx] for c in extra)]
    return _Plan(device, sum(counts), common.block_table(cols, counts, device), len(idx), idx[0], block, num_warps)


def fp8_amax(srcs: Sequence[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """``out[i] = max(|srcs[i]|)`` in fp32 (0 for an empty tensor, NaN if any element is NaN), one launch.

    ``srcs``: contiguous float tensors of one dtype on one device (the segments of a flat shard, say). ``out``: a
    float32 tensor of ``len(srcs)`` elements (allocated when None); it is zeroed first. Returns ``out``.
    """
    with profiled("shardfuse.kernels:fp8_amax"):
        srcs = common.as_list(srcs)
        # The table reads the sources alone: ``out`` is checked below on every call, so the key and guard leave it
        # out (a fresh out per call still finds the plan).
        guarded = srcs if type(srcs) is list else None
        key = None if guarded is None else common.guarded_key(guarded)
        plan = _AMAX_PLANS.get(key, guarded)
        if plan is None:
            srcs = _check_srcs(srcs, "fp8_amax")
            if not srcs or not common.use_triton(*srcs):
                return fp8_amax_ref(srcs, out)
            plan = _plan(srcs, [list(range(len(srcs)))], srcs[0].device)
            if key is not None and guarded is not None:
                plan = plan._replace(check=common.layout_guard(guarded))
                _AMAX_PLANS.put(key, plan)
        if out is None:
            out = torch.empty(len(srcs), dtype=torch.float32, device=plan.device)
        elif out.dtype != torch.float32 or out.numel() != len(srcs) or not out.is_contiguous():
            raise ValueError(f"fp8_amax out must be a contiguous float32 tensor of {len(srcs)} elements, got "
                             f"{out.dtype} shape={tuple(out.shape)}: allocate torch.empty({len(srcs)})")
        out.zero_()
        if plan.grid:
            with common.device_guard(plan.device):
                _amax_launch[(plan.grid,)](plan.table, plan.num_tensors, srcs[plan.like], out.view(torch.int32),
                                           BLOCK=plan.block, num_warps=plan.num_warps)
        return out


def amax_to_scale(amax: torch.Tensor) -> torch.Tensor:
    """torchao's tensorwise scale of every amax: ``float32(448 / max(float64(amax), 1e-12))``."""
    return (FP8_MAX / amax.to(torch.float64).clamp(min=EPS)).to(torch.float32)


def _check_cast(srcs: list[torch.Tensor], scales: torch.Tensor, out: torch.Tensor,
                offsets: Sequence[int] | None) -> list[int]:
    """Validate :func:`cast_fp8_shards`; return the offsets."""
    srcs = _check_srcs(srcs, "cast_fp8_shards")
    common.check_tensor(scales, "scales")
    common.check_tensor(out, "out")
    if scales.dtype != torch.float32 or scales.numel() != len(srcs) or not scales.is_contiguous():
        raise ValueError(f"cast_fp8_shards scales must be a contiguous float32 tensor of len(srcs)={len(srcs)} "
                         f"elements, got {scales.dtype} shape={tuple(scales.shape)}: use amax_to_scale(amax)")
    if out.dtype not in (FP8_DTYPE, torch.uint8) or not out.is_contiguous():
        raise ValueError(f"cast_fp8_shards out must be a contiguous {FP8_DTYPE} (or uint8) buffer, got {out.dtype} "
                         f"stride={out.stride()}: allocate torch.empty(n, dtype={FP8_DTYPE})")
    numels = [s.numel() for s in srcs]
    if offsets is None:
        offsets = common.block_starts(numels)
    else:
        offsets = [operator.index(o) for o in offsets]
        if len(offsets) != len(srcs) or any(o < 0 for o in offsets):
            raise ValueError(f"cast_fp8_shards needs one offset >= 0 per source, got {list(offsets)[:8]} for "
                             f"{len(srcs)} sources")
    end = max((o + k for o, k in zip(offsets, numels)), default=0)
    if out.numel() < end:
        raise ValueError(f"cast_fp8_shards out is too small: out.numel()={out.numel()} < required {end}")
    ranges = sorted((o, o + k) for o, k in zip(offsets, numels) if k)
    if any(b < e for (_, e), (b, _) in zip(ranges, ranges[1:])):
        raise ValueError(f"cast_fp8_shards destination ranges overlap: offsets={list(offsets)[:8]} "
                         f"numels={numels[:8]}: give each source its own range")
    names = [(f"srcs[{i}]", s) for i, s in enumerate(srcs)]
    check_no_overlap("cast_fp8_shards", names, [("out", out)], "write into a buffer apart from the sources")
    common.check_same_device([*srcs, scales, out] if srcs else [scales, out],
                             [*(n for n, _ in names), "scales", "out"] if srcs else ["scales", "out"])
    return offsets


def _cast_key(guarded: list[torch.Tensor], offsets: Sequence[int] | None) -> tuple | None:
    """``guarded``: the sources, then ``scales`` and ``out`` (or the sources alone: the key of the table itself,
    ``_CAST_BY_SOURCES``). The key holds their addresses and the offsets (where each source lands in ``out``), the
    plan their layout guard."""
    try:
        placement = None if offsets is None else tuple(map(operator.index, offsets))
    except TypeError:
        return None  # no key: the validating path says what is wrong
    return common.guarded_key(guarded, placement)


def cast_fp8_shards(srcs: Sequence[torch.Tensor], scales: torch.Tensor, out: torch.Tensor, *,
                    offsets: Sequence[int] | None = None) -> torch.Tensor:
    """Cast every source to float8_e4m3fn with its tensorwise scale, into one flat buffer, in one launch.

    ``out.view(-1)[offsets[i] : offsets[i] + srcs[i].numel()] = to_fp8_saturated(srcs[i].float() * scales[i])``
    (torchao's recipe; same bytes as :func:`cast_fp8_shards_ref`). ``srcs``: contiguous float tensors of one dtype
    (segments of a flat shard); ``scales``: float32, one per source (:func:`amax_to_scale`); ``out``: a contiguous
    ``torch.float8_e4m3fn`` or ``torch.uint8`` buffer apart from the sources; ``offsets``: element offsets into
    ``out`` (default: back to back from 0), ranges disjoint. Elements of ``out`` outside the ranges are left as
    they are. Returns ``out``.
    """
    with profiled("shardfuse.kernels:cast_fp8_shards"):
        srcs = common.as_list(srcs)
        # Every tensor the launch reads and writes: the key holds their addresses, the plan their layout guard.
        guarded = [*srcs, scales, out] if type(srcs) is list else None
        key = None if guarded is None else _cast_key(guarded, offsets)
        plan = _CAST_PLANS.get(key, guarded)
        if plan is None:
            offs = _check_cast(srcs, scales, out, offsets)
            if not common.use_triton(scales, out, *srcs):
                return cast_fp8_shards_ref(srcs, scales, out, offsets=offsets)
            by_sources = None if key is None else _cast_key(srcs, offsets)
            plan = _CAST_BY_SOURCES.get(by_sources, srcs)
            if plan is None:
                plan = _plan(srcs, [offs, list(range(len(srcs)))], out.device)
                if by_sources is not None:
                    _CAST_BY_SOURCES.put(by_sources, plan._replace(check=common.layout_guard(srcs)))
            if key is not None and guarded is not None:
                plan = plan._replace(check=common.layout_guard(guarded))
                _CAST_PLANS.put(key, plan)
        if plan.grid:
            with common.device_guard(plan.device):
                _cast_fp8_launch[(plan.grid,)](plan.table, scales, plan.num_tensors, srcs[plan.like],
                                               out.view(torch.uint8).view(-1), BLOCK=plan.block,
                                               num_warps=plan.num_warps)
        return out


# --------------------------------------------------------------------------------------------------
# References (plain PyTorch: torchao's formulas)
# --------------------------------------------------------------------------------------------------


def fp8_amax_ref(srcs: Sequence[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """Reference for :func:`fp8_amax`: ``torch.max(torch.abs(x))`` per tensor (as torchao's ``tensor_to_amax``)."""
    srcs = _check_srcs(srcs, "fp8_amax")
    device = srcs[0].device if srcs else torch.device("cpu")
    vals = [torch.max(torch.abs(s)).float() if s.numel() else torch.zeros((), device=device) for s in srcs]
    result = torch.stack(vals) if vals else torch.empty(0, device=device)
    if out is None:
        return result
    return out.copy_(result)


def cast_fp8_shards_ref(srcs: Sequence[torch.Tensor], scales: torch.Tensor, out: torch.Tensor, *,
                        offsets: Sequence[int] | None = None) -> torch.Tensor:
    """Reference for :func:`cast_fp8_shards`: per source ``(x.float() * scale).clamp(-448, 448).to(float8)``
    (torchao's ``hp_tensor_and_scale_to_float8`` with ``to_fp8_saturated``), copied into ``out``."""
    srcs = list(srcs)
    offs = _check_cast(srcs, scales, out, offsets)
    flat = out.view(FP8_DTYPE).view(-1)
    scale = scales.view(-1)  # any shape of len(srcs) elements, as the kernel reads it
    for i, (s, o) in enumerate(zip(srcs, offs)):
        y = (s.reshape(-1).to(torch.float32) * scale[i]).clamp(min=-FP8_MAX, max=FP8_MAX).to(FP8_DTYPE)
        flat[o : o + s.numel()] = y
    return out
