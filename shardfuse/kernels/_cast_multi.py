"""Multi-tensor shard cast: ``cast_shards``, many tensors in one launch per (source dtype, destination dtype).

The public multi-tensor form of :mod:`shardfuse.kernels._cast`, kept in a module of its own: the sharding
runtime casts one flat shard per gather (``_cast.cast_shard_unchecked``) and never reaches this code. A
host-built owner column maps each program to its tensor in one load, so the launch count does not grow with
the tensor count and nothing waits on the host. The launch plans (device tables included) are cached per set
of tensors, so a repeat call costs little more than the launch itself, plus reading each tensor's address for
the plan key and checking their layouts against the plan's guard (one C++ call for all of them). From
``FOREACH_MIN_TENSORS`` tensors on (from ``FOREACH_SMALL_MIN_TENSORS`` when the first and last are small), that
per-tensor Python work costs more than PyTorch's C++ ``torch._foreach_copy_``, so the list form hands over to it,
unless the first and last are large enough that the copies, not the host, bound the call (docs/kernels.md,
"Dispatch").

Layout: ``@triton.jit`` kernel, launcher (``cast_shards``), reference (``cast_shards_ref``).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from shardfuse._profiling import profiled
from shardfuse.kernels import _common as common
from shardfuse.kernels import _crossover
from shardfuse.kernels._cast import cast_block, check_src
from shardfuse.kernels._launch import DirectLauncher
from shardfuse.kernels._overlap import check_no_overlap

__all__ = ["cast_shards", "cast_shards_ref"]


# From this many tensors on, the list form of cast_shards on CUDA runs torch._foreach_copy_: the measured
# crossover (bench/results, bench/kernels/bench_cast.py "crossover" cases; docs/kernels.md, "Dispatch").
FOREACH_MIN_TENSORS = 32
# From this many, already, when the first and the last source hold at most FOREACH_SMALL_MAX_NUMEL elements each (a
# sample of two, so the decision stays O(1)): a plan keys and guards sources and destinations, 2 x 16-31 tensors, on
# top of one launch, and such tiny copies take the GPU less time than that host work. On H200 hosts 31 tensors x
# 1024 took 14.8 us through the plan (either path) against 4.7-5.3 for _foreach_copy_, in every round of two runs of
# three; 16 tensors x 16K took 5.4-7.8 through the kernel against 11.4 (docs/kernels.md, "Dispatch").
FOREACH_SMALL_MIN_TENSORS = 16
FOREACH_SMALL_MAX_NUMEL = 4096
# ... but not when the first and the last source hold at least FOREACH_LARGE_MIN_NUMEL elements each and the GPU's
# measured crossover ("cast_shards_list", its big_tensor_bytes) takes the kernel for such a call: there the copies,
# not the host, bound the call. The plan keys and guards every tensor, 0.4-0.7 us a tensor pair on a slow H200 host, so
# the kernel wins only where a tensor's copy takes the GPU longer than that whatever the host: 1000 tensors of 537K
# elements on average, fp32 -> bf16 (3.2 MB moved each), took 852.0-852.4 us through it against 1053.9-1056.6 for
# _foreach_copy_ on all three hosts measured (7faacaa, c7c0c05, 241027f), while at 256K it won on the faster ones
# (437.6 against 563.5) and lost on the slowest (682.8 against 563.1); at 64K it lost on one host of two, at 16K from
# 256 tensors on every one.
FOREACH_LARGE_MIN_NUMEL = 1 << 19

_LIST_FIX = (
    "give every source a destination of its own that no other source or destination shares "
    "(a source may be its own destination, in place)"
)


# --------------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------------


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
        cast_block(src, dst, offs, n, False)
    else:
        cast_block(src, dst, offs, n, True)


_cast_shards_launch = DirectLauncher(_cast_shards_kernel)


# --------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------

_PLANS = common.GuardedPlanCache()


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
    torch_path: bool = False  # below the crossover: the PyTorch sequence (``_torch_copy``), no launch
    # Torch path, flat out: the sizes that cut out.view(-1) into the destinations (and the gaps between them),
    # and each source's piece (None: the first len(srcs) pieces, in order; see _flat_pieces).
    split_sizes: tuple[int, ...] = ()
    pick: tuple[int, ...] | None = None
    flatten: bool = False  # torch path: some source's shape differs from its destination's (copy 1-D views)
    # The layout guard of the tensors the plan was built for (_common.layout_guard; the key holds their addresses).
    check: Callable[..., bool] | None = None


def _check_offsets(offsets: Sequence[int], numels: list[int]) -> list[int]:
    try:
        offsets = [operator.index(o) for o in offsets]
    except TypeError:
        raise TypeError(f"offsets must be ints (element offsets into out), got {list(offsets)[:8]}") from None
    if len(offsets) != len(numels):
        raise ValueError(f"len(offsets)={len(offsets)} != len(srcs)={len(numels)}: give one offset per source")
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
    return offsets


def _validate_cast_shards(
    srcs: list[torch.Tensor], out: torch.Tensor | Sequence[torch.Tensor], offsets: Sequence[int] | None
) -> list[torch.Tensor]:
    """Validate; return the destination of every source (views of ``out`` when it is one flat tensor)."""
    srcs = common.check_tensors(srcs, "srcs")
    for i, s in enumerate(srcs):
        check_src(s, f"srcs[{i}]")
    src_names = [f"srcs[{i}]" for i in range(len(srcs))]
    if isinstance(out, torch.Tensor):
        common.check_same_device([*srcs, out], [*src_names, "out"])
        numels = [s.numel() for s in srcs]
        # Default: back to back from element 0.
        offsets = common.block_starts(numels) if offsets is None else _check_offsets(offsets, numels)
        common.check_out(out, max((o + k for o, k in zip(offsets, numels)), default=0))
        flat = out.view(-1)
        dsts = [flat[o : o + k] for o, k in zip(offsets, numels)]
        dst_names = [f"out[{o}:{o + k}]" for o, k in zip(offsets, numels)]
    else:
        if offsets is not None:
            raise ValueError("offsets only apply when out is one flat tensor; drop offsets or pass a flat out")
        dsts = common.check_tensors(out, "out")
        if len(dsts) != len(srcs):
            raise ValueError(f"len(out)={len(dsts)} != len(srcs)={len(srcs)}: give one destination per source")
        dst_names = [f"out[{i}]" for i in range(len(dsts))]
        if srcs:
            common.check_same_device([*srcs, *dsts], [*src_names, *dst_names])
        for i, (s, o) in enumerate(zip(srcs, dsts)):
            common.check_out(o, s.numel(), f"out[{i}]")
            if o.numel() != s.numel():
                raise ValueError(
                    f"out[{i}].numel()={o.numel()} != srcs[{i}].numel()={s.numel()}: "
                    f"destinations must match their sources"
                )
    check_no_overlap("cast_shards", list(zip(src_names, srcs)), list(zip(dst_names, dsts)), _LIST_FIX, in_place=True)
    return dsts


def _key(tensors: list[torch.Tensor], num_srcs: int, flat: bool, offsets: Sequence[int] | None) -> tuple | None:
    """``tensors``: the sources, then the flat ``out`` or the destinations (one list: one read of each address).
    The key holds their addresses, where the sources end and the offsets (a flat out's destination addresses are
    its address plus the offsets); the plan's layout guard checks every tensor's shape, strides, dtype and device.
    """
    if offsets is None:
        return common.guarded_key(tensors, num_srcs, flat)
    if not flat:
        return None  # offsets with a list out: no key, the validating path explains
    try:
        placement = tuple(map(operator.index, offsets))
    except TypeError:
        return None
    return common.guarded_key(tensors, num_srcs, flat, placement)


def _build_plan(
    srcs: list[torch.Tensor], out: torch.Tensor | list[torch.Tensor], offsets: Sequence[int] | None
) -> _Plan | None:
    """Validate and build the launches; None when the reference path should run (CPU tensors)."""
    dsts = _validate_cast_shards(srcs, out, offsets)
    flat = isinstance(out, torch.Tensor)
    if not common.use_triton(*srcs, *dsts, *([out] if isinstance(out, torch.Tensor) else [])):
        return None
    device = out.device if isinstance(out, torch.Tensor) else (srcs[0].device if srcs else torch.device("cpu"))
    family = "cast_shards_flat" if flat else "cast_shards_list"
    nbytes = sum(s.numel() * (s.element_size() + d.element_size()) for s, d in zip(srcs, dsts))
    if not _crossover.use_triton_at(family, device, len(srcs), nbytes):
        reshape = any(s.shape != d.shape for s, d in zip(srcs, dsts))
        if not isinstance(out, torch.Tensor):
            return _Plan(device, (), True, flatten=reshape)
        numels = [s.numel() for s in srcs]
        places = common.block_starts(numels) if offsets is None else [operator.index(o) for o in offsets]
        return _Plan(device, (), True, *_flat_pieces(places, numels, out.numel()), reshape)
    groups: dict[tuple[torch.dtype, torch.dtype], list[int]] = {}
    for i, (s, d) in enumerate(zip(srcs, dsts)):
        if s.numel():
            groups.setdefault((s.dtype, d.dtype), []).append(i)
    dst_addrs = [d.data_ptr() for d in dsts]
    return _Plan(device, tuple(_plan_group(srcs, idx, dst_addrs, device, flat) for idx in groups.values()))


def _flat_pieces(offsets: list[int], numels: list[int], total: int) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """How the PyTorch path cuts a flat ``out`` of ``total`` elements with one ``split_with_sizes`` (one C++
    call, where a slice per destination costs a Python call each): sizes covering all of it (a gap between
    destinations, or after the last, is a piece of its own; an empty destination off the boundaries gets an empty
    piece at the end), and each source's piece (None: the first ``len(numels)`` pieces in order, the case of
    sources back to back). Validated offsets: the non-empty ranges are disjoint and inside ``out``."""
    sizes: list[int] = []
    pick = [-1] * len(numels)
    pos = 0
    for offset, i in sorted(zip(offsets, range(len(numels)))):
        k = numels[i]
        if k == 0 and offset != pos:
            continue  # the empty piece at the end serves it
        if offset > pos:
            sizes.append(offset - pos)  # a gap nobody writes
        pick[i] = len(sizes)
        sizes.append(k)
        pos = offset + k
    if total > pos:
        sizes.append(total - pos)
    if -1 in pick:
        sizes.append(0)
        pick = [len(sizes) - 1 if p < 0 else p for p in pick]
    return tuple(sizes), (None if pick == list(range(len(numels))) else tuple(pick))


def _plan_group(
    srcs: list[torch.Tensor], idx: list[int], dst_addrs: list[int], device: torch.device, flat: bool
) -> _Launch:
    """One launch for tensors sharing (source dtype, destination dtype); all have numel > 0."""
    numels = [srcs[i].numel() for i in idx]
    block, num_warps = common.multi_block(numels)
    counts = [-(-k // block) for k in numels]
    src_addrs = [srcs[i].data_ptr() for i in idx]
    dst = [dst_addrs[i] for i in idx]
    aligned = all(a % 16 == 0 for a in src_addrs) and all(a % 16 == 0 for a in dst)
    # One table, one host->device copy: starts, numels, source and destination addresses, owners.
    table = common.block_table([common.block_starts(counts), numels, src_addrs, dst], counts, device)
    return _Launch(sum(counts), table, len(idx), idx[0], -1 if flat else idx[0], aligned, block, num_warps)


def _run_plan(plan: _Plan, srcs: list[torch.Tensor], out: torch.Tensor | list[torch.Tensor]) -> None:
    with common.device_guard(plan.device):
        for la in plan.launches:
            dst_like = out if la.dst_like < 0 else out[la.dst_like]
            _cast_shards_launch[(la.grid,)](
                la.table, la.num_tensors, srcs[la.src_like], dst_like, ALIGNED=la.aligned, BLOCK=la.block,
                num_warps=la.num_warps,
            )


def _torch_copy(plan: _Plan, srcs: list[torch.Tensor], out: torch.Tensor | list[torch.Tensor]) -> None:
    """The PyTorch sequence the kernel replaces, for calls below the crossover: ``torch._foreach_copy_`` into the
    destinations (views of a flat ``out`` at the planned spans). Same bits as the kernel on CUDA."""
    if not srcs:
        return
    if isinstance(out, torch.Tensor):
        pieces = (out if out.dim() == 1 else out.view(-1)).split_with_sizes(plan.split_sizes)
        dsts = pieces[: len(srcs)] if plan.pick is None else [pieces[i] for i in plan.pick]
    else:
        dsts = [d.view(-1) for d in out] if plan.flatten else out
    torch._foreach_copy_(dsts, [s.view(-1) for s in srcs] if plan.flatten else srcs)


def use_foreach(srcs: Sequence[torch.Tensor], dests: Sequence[torch.Tensor] | None = None) -> bool:
    """Whether the list form of :func:`cast_shards` runs ``torch._foreach_copy_``, decided from the count and the
    first and last tensors alone (reading every tensor's layout is the cost being avoided): from
    ``FOREACH_MIN_TENSORS`` tensors, or from ``FOREACH_SMALL_MIN_TENSORS`` when the first and last source hold at most
    ``FOREACH_SMALL_MAX_NUMEL`` elements each; not from ``FOREACH_MIN_TENSORS`` when both hold at least
    ``FOREACH_LARGE_MIN_NUMEL`` and the GPU's measured crossover takes the kernel for a call of ``len(srcs)`` such
    tensors (``dests``: the destinations, whose first one gives the bytes written; default, a same-dtype copy). The
    sample only moves calls between two paths that give the same bits (a call of mostly large tensors between two
    small ones runs ``_foreach_copy_``, at its speed)."""
    n = len(srcs)
    if n < min(FOREACH_MIN_TENSORS, FOREACH_SMALL_MIN_TENSORS) or not isinstance(srcs[0], torch.Tensor) or (
            not common.triton_device(srcs[0])):
        return False
    first, last = srcs[0], srcs[-1]
    if n >= FOREACH_MIN_TENSORS:
        if not (isinstance(last, torch.Tensor) and first.numel() >= FOREACH_LARGE_MIN_NUMEL
                and last.numel() >= FOREACH_LARGE_MIN_NUMEL):
            return True
        dst = dests[0] if dests else None
        written = dst.element_size() if isinstance(dst, torch.Tensor) else first.element_size()
        nbytes = n * first.numel() * (first.element_size() + written)  # as if every tensor were the first
        return not _crossover.use_triton_at("cast_shards_list", first.device, n, nbytes)
    if n < FOREACH_SMALL_MIN_TENSORS:
        return False
    return (isinstance(last, torch.Tensor) and first.numel() <= FOREACH_SMALL_MAX_NUMEL
            and last.numel() <= FOREACH_SMALL_MAX_NUMEL)


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

    No destination may share memory with another destination or with another source (a source may be its
    own destination). Returns ``out`` as given (the tensor, or the list of tensors).

    A repeat call with the same tensors (same addresses, sizes, dtypes, layouts and device, on the same
    stream) reuses the cached launch plan: no validation, no table building, no host->device copy. With a
    list ``out`` of at least ``FOREACH_MIN_TENSORS`` CUDA tensors (or ``FOREACH_SMALL_MIN_TENSORS`` whose first and
    last source are small; not where both are large and the GPU's crossover takes the kernel: :func:`use_foreach`),
    the call is ``torch._foreach_copy_(out, srcs)`` (same bits;
    PyTorch's own argument checks apply, see docs/kernels.md, "Dispatch"). On CUDA, below
    the GPU's measured size crossover (``shardfuse.kernels._crossover``, families ``"cast_shards_list"`` and
    ``"cast_shards_flat"``) the call is ``torch._foreach_copy_`` into the destinations: the same bits, faster there.
    """
    with profiled("shardfuse.kernels:cast_shards"):
        srcs = common.as_list(srcs)
        dests: torch.Tensor | list[torch.Tensor]
        if isinstance(out, torch.Tensor):
            dests = out
        elif type(out) is list or isinstance(out, Iterable):  # a list first: the ABC check costs more
            dests = out if type(out) is list else list(out)  # a list as given: no copy of a thousand entries
            if offsets is None and use_foreach(srcs, dests):
                try:
                    torch._foreach_copy_(dests, srcs)
                    return dests
                except (RuntimeError, TypeError):
                    pass  # PyTorch refused the arguments: the validating path says why, or handles them
        else:
            raise TypeError(f"out must be a tensor or a list of tensors, got a {type(out).__name__}")
        # Every tensor the plan reads or writes: the key's addresses and the plan's layout guard cover them all.
        guarded: list[torch.Tensor] | None = None
        if type(srcs) is list:
            guarded = [*srcs, dests] if isinstance(dests, torch.Tensor) else srcs + dests
        key = None if guarded is None else _key(guarded, len(srcs), isinstance(dests, torch.Tensor), offsets)
        plan = _PLANS.get(key, guarded)
        if plan is None:
            plan = _build_plan(srcs, dests, offsets)
            if plan is not None and key is not None and guarded is not None:
                plan = plan._replace(check=common.layout_guard(guarded))
                _PLANS.put(key, plan)
        if plan is None:
            _copy_all(srcs, _validate_cast_shards(srcs, dests, offsets))  # the reference's copies
        elif plan.torch_path:
            _torch_copy(plan, srcs, dests)
        else:
            _run_plan(plan, srcs, dests)
        return dests


# --------------------------------------------------------------------------------------------------
# References (plain PyTorch, same signatures and semantics)
# --------------------------------------------------------------------------------------------------


def cast_shards_ref(
    srcs: Sequence[torch.Tensor],
    out: torch.Tensor | Sequence[torch.Tensor],
    *,
    offsets: Sequence[int] | None = None,
) -> torch.Tensor | list[torch.Tensor]:
    """Reference for :func:`cast_shards`: one ``copy_`` per tensor."""
    srcs = list(srcs)
    _copy_all(srcs, _validate_cast_shards(srcs, out, offsets))
    return out if isinstance(out, torch.Tensor) else list(out)


def _copy_all(srcs: list[torch.Tensor], dsts: list[torch.Tensor]) -> None:
    for s, d in zip(srcs, dsts):
        d.view(-1).copy_(s.view(-1))
