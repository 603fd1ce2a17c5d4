"""Padding and flattening: many tensors <-> one flat buffer padded to a multiple of ``world_size``.

``flatten_pad`` gathers tensors of any shapes and strides (and mixed float dtypes, cast to one) back to back
into one contiguous 1-D buffer whose length is a multiple of ``world_size``, zeroing the padding tail, in
one launch per source dtype; the zero tail is written by the same launch (it is one more segment of the
launch's table). ``unflatten_into`` is the inverse: it scatters consecutive slices of a flat buffer into
separate tensors of any strides (full state dicts, loading), one launch per destination dtype.

Each launch covers a list of *segments* (one per tensor, plus the padding). A per-segment table holds the
block-start prefix sums, numels, the strided tensor's address, the offset into the flat buffer and up to
four coalesced sizes/strides, then the owning segment of every program (one load, no search). Launch plans
(tables included) are cached per set of tensors: the FSDP data path repeats the same call every step. A plan is
found by the tensors' addresses and stream (``_common.guarded_key``) and holds one C++ check of their shapes,
strides and dtypes (``_common.layout_guard``): the same addresses in another layout miss and validate again.

Transposed matrices (``w.t()``, or a batch of them: the unit-stride dim is the next-to-last one) move in
TILE x TILE tiles rather than in flat order, which would touch one element per memory line on the strided
side: a tile is read down its unit-stride rows and written along its flat rows (or the reverse, in
``unflatten_into``), and Triton transposes it in shared memory between the two.

Layout: ``@triton.jit`` kernels, launchers (``padded_numel``, ``flatten_pad``, ``unflatten_into``),
references (``*_ref``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from shardfuse._profiling import profiled
from shardfuse.kernels import _common as common
from shardfuse.kernels._launch import DirectLauncher
from shardfuse.kernels._overlap import check_no_overlap

__all__ = ["padded_numel", "flatten_pad", "unflatten_into", "flatten_pad_ref", "unflatten_into_ref"]

_MAX_DIMS = 4  # strided tensors with more dims after coalescing are made contiguous first
_TILE = 64  # tiles of 64 x 64: 16 KiB of fp32 through shared memory, 16 elements per thread at 8 warps
_MIN_TILE_SIDE = 16  # thinner transposed matrices keep the flat-order path: a tile would be mostly masked

# Segment kinds in the table.
_CONTIGUOUS, _STRIDED, _ZERO, _TILED = 0, 1, 2, 3
# Table columns after the T + 1 block starts, each T long. _flat_segments_kernel reads them by position
# (column c at c * num_segs past the starts, the owner column at 12 * num_segs): a change here is a change
# there (tests/kernels/test_flatten.py::test_table_columns_match_the_kernel holds the two together).
_COLUMNS = ("numel", "kind", "addr", "flat_off", "size1", "size2", "size3", "stride0", "stride1", "stride2", "stride3")


# --------------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------------


@triton.jit
def _move_block(other, other_offs, flat, offs, n, FLAT_IS_DST: tl.constexpr, MASKED: tl.constexpr):
    # Copy one block between the strided tensor (``other``) and the flat buffer, casting to the
    # destination dtype. Only tail blocks are masked: a mask on an unaligned n would force scalar accesses.
    if FLAT_IS_DST:
        src = other + other_offs
        dst = flat + offs
    else:
        src = flat + offs
        dst = other + other_offs
    if MASKED:
        mask = offs < n
        x = tl.load(src, mask=mask)
        tl.store(dst, x.to(dst.dtype.element_ty), mask=mask)
    else:
        x = tl.load(src)
        tl.store(dst, x.to(dst.dtype.element_ty))


@triton.jit
def _move_tile(other, flat, tile, rows, cols, stride_b, stride_c, FLAT_IS_DST: tl.constexpr, TILE: tl.constexpr):
    # Tile ``tile`` of a batch of rows x cols matrices whose rows are the unit-stride dim (row r, column c
    # of matrix b at other[b * stride_b + r + c * stride_c], flat[(b * rows + r) * cols + c]). The strided
    # side is addressed with r along the tile's first axis and the flat side with c along its second, so
    # both are accessed in full lines; Triton converts between the two layouts through shared memory.
    tiles_c = tl.cdiv(cols, TILE)
    per_matrix = tl.cdiv(rows, TILE) * tiles_c
    b = tile // per_matrix
    t = tile - b * per_matrix
    r = (t // tiles_c) * TILE + tl.arange(0, TILE)
    c = (t % tiles_c) * TILE + tl.arange(0, TILE)
    mask = (r < rows)[:, None] & (c < cols)[None, :]
    strided = other + b * stride_b + r[:, None] + c[None, :] * stride_c
    row_major = flat + b * rows * cols + r[:, None] * cols + c[None, :]
    if FLAT_IS_DST:
        x = tl.load(strided, mask=mask)
        tl.store(row_major, x.to(flat.dtype.element_ty), mask=mask)
    else:
        x = tl.load(row_major, mask=mask)
        tl.store(strided, x.to(other.dtype.element_ty), mask=mask)


@triton.jit
def _flat_segments_kernel(table, num_segs, flat_ptr, other_like, FLAT_IS_DST: tl.constexpr, STRIDED: tl.constexpr,
                          TILED: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr, TILE: tl.constexpr):
    """Copy/cast between one flat buffer and T segments (tensors, or the zero padding).

    ``table`` (int64): block starts [T], then T-long columns numel, kind, addr, flat_off, size1..3,
    stride0..3 (see ``_COLUMNS``), then the owning segment of every program. ``other_like`` is only there
    for the strided side's element type. A tiled segment's programs are its TILE x TILE tiles, not blocks.
    """
    pid = tl.program_id(0).to(tl.int64)  # int64 before any multiply: flat buffers can pass 2^31 elements
    seg = tl.load(table + 12 * num_segs + pid)  # owners follow starts + 11 columns; one load, no search
    col = table + num_segs + seg  # column c of segment seg lives at col + c * num_segs
    block = pid - tl.load(table + seg)
    n = tl.load(col)
    kind = tl.load(col + num_segs)
    other = tl.load(col + 2 * num_segs).to(other_like.dtype)
    flat = flat_ptr + tl.load(col + 3 * num_segs)
    offs = block * BLOCK + tl.arange(0, BLOCK)
    if kind == 0:  # contiguous segment: straight streaming copy
        if ALIGNED:
            # The host checked that every contiguous segment starts 16-byte aligned on both sides.
            other = tl.multiple_of(other, 16)
            flat = tl.multiple_of(flat, 16)
        if (block + 1) * BLOCK <= n:
            _move_block(other, offs, flat, offs, n, FLAT_IS_DST, False)
        else:
            _move_block(other, offs, flat, offs, n, FLAT_IS_DST, True)
    elif kind == 1:
        if STRIDED:
            # Row-major index -> up to 4 coalesced dims -> element offset in the strided tensor.
            size3 = tl.load(col + 6 * num_segs)
            size2 = tl.load(col + 5 * num_segs)
            size1 = tl.load(col + 4 * num_segs)
            i3 = offs % size3
            rest = offs // size3
            i2 = rest % size2
            rest = rest // size2
            i1 = rest % size1
            i0 = rest // size1
            other_offs = (i0 * tl.load(col + 7 * num_segs) + i1 * tl.load(col + 8 * num_segs)
                          + i2 * tl.load(col + 9 * num_segs) + i3 * tl.load(col + 10 * num_segs))
            _move_block(other, other_offs, flat, offs, n, FLAT_IS_DST, True)
    elif kind == 3:
        if TILED:
            # Sizes [1, batch, rows, cols], strides [0, stride_b, 1, stride_c].
            _move_tile(other, flat, block, tl.load(col + 5 * num_segs), tl.load(col + 6 * num_segs),
                       tl.load(col + 8 * num_segs), tl.load(col + 10 * num_segs), FLAT_IS_DST, TILE)
    else:  # the zero padding tail (only in flatten launches)
        if FLAT_IS_DST:
            tl.store(flat + offs, tl.zeros([BLOCK], dtype=flat_ptr.dtype.element_ty), mask=offs < n)


# --------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------


_flat_segments_launch = DirectLauncher(_flat_segments_kernel)


def padded_numel(numel: int, world_size: int) -> int:
    """Smallest multiple of ``world_size`` that is >= ``numel`` (0 for 0)."""
    world_size = common.check_world_size(world_size, "padded_numel")
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel=!r}: pass an int element count")
    return -(-numel // world_size) * world_size


def _coalesce(t: torch.Tensor) -> tuple[list[int], list[int]]:
    """Sizes/strides with size-1 dims dropped and mergeable neighbours merged (row-major order kept)."""
    sizes: list[int] = []
    strides: list[int] = []
    for size, stride in zip(t.shape, t.stride()):
        if size == 1:
            continue
        if sizes and strides[-1] == size * stride:
            sizes[-1] *= size
            strides[-1] = stride
        else:
            sizes.append(size)
            strides.append(stride)
    return sizes, strides


def _check_no_overlap(t: torch.Tensor, name: str) -> None:
    if t.numel() > 1 and any(st == 0 and sz > 1 for sz, st in zip(t.shape, t.stride())):
        raise ValueError(
            f"{name} has overlapping memory (shape={tuple(t.shape)} stride={t.stride()}, e.g. from expand()): "
            f"pass {name}.contiguous() instead"
        )


_PLANS = common.GuardedPlanCache()


class _Launch(NamedTuple):
    """One ``_flat_segments_kernel`` launch (one dtype on the strided side)."""

    grid: int
    table: torch.Tensor
    num_segs: int
    like: int  # index of a tensor of this launch's dtype in the launcher's list (types its addresses)
    strided: bool
    tiled: bool  # compiles the tile branch, which takes up to 16 KiB of shared memory per program
    aligned: bool  # every contiguous segment 16-byte aligned, given a 16-byte aligned flat buffer
    block: int
    num_warps: int


class _Plan(NamedTuple):
    device: torch.device
    dtype: torch.dtype  # of the flat buffer
    numel: int  # of the flat buffer flatten_pad writes
    launches: tuple[_Launch, ...]
    # The layout guard of the tensors the plan was built for (_common.layout_guard; the key holds their addresses).
    check: Callable[..., bool] | None = None


class _Segments:
    """Host-side table builder for one launch (one strided-side dtype)."""

    def __init__(self, like: int) -> None:
        self.cols: list[list[int]] = [[] for _ in _COLUMNS]
        self.like = like
        self.strided = False
        self.tiled = False

    def __len__(self) -> int:
        return len(self.cols[0])

    def add(self, kind: int, addr: int, flat_off: int, numel: int, sizes: list[int], strides: list[int]) -> None:
        pad = _MAX_DIMS - len(sizes)
        sizes = [1] * pad + sizes
        strides = [0] * pad + strides
        row = (numel, kind, addr, flat_off, sizes[1], sizes[2], sizes[3], *strides)
        for col, value in zip(self.cols, row):
            col.append(value)
        self.strided |= kind == _STRIDED
        self.tiled |= kind == _TILED

    def add_tensor(self, t: torch.Tensor, flat_off: int, sizes: list[int], strides: list[int]) -> None:
        if not sizes or (len(sizes) == 1 and strides[0] == 1):
            self.add(_CONTIGUOUS, t.data_ptr(), flat_off, t.numel(), [t.numel()], [1])
        elif _is_transposed(sizes, strides):
            pad = 3 - len(sizes)  # always [batch, rows, cols]: the kernel reads one set of slots
            self.add(_TILED, t.data_ptr(), flat_off, t.numel(), [1] * pad + sizes, [0] * pad + strides)
        else:
            self.add(_STRIDED, t.data_ptr(), flat_off, t.numel(), sizes, strides)

    def plan(self, flat_element_size: int, device: torch.device) -> _Launch:
        numels, kinds, addrs, flat_offs = self.cols[:4]
        block, num_warps = common.multi_block(numels)
        counts = [
            _tile_count(*sizes) if kind == _TILED else -(-k // block)
            for k, kind, *sizes in zip(numels, kinds, *self.cols[4:7])
        ]
        # Vector hints only when every contiguous segment starts 16-byte aligned on both sides.
        aligned = all(
            a % 16 == 0 and (o * flat_element_size) % 16 == 0
            for kind, a, o in zip(kinds, addrs, flat_offs)
            if kind == _CONTIGUOUS
        )
        table = common.block_table([common.block_starts(counts), *self.cols], counts, device)  # one copy, no sync
        return _Launch(sum(counts), table, len(self), self.like, self.strided, self.tiled, aligned, block, num_warps)


def _is_transposed(sizes: list[int], strides: list[int]) -> bool:
    """A (batch of) matrices whose rows, not columns, are unit-stride after coalescing, and wide enough on
    both sides to fill tiles: flat order would read (or write) it one element per memory line."""
    return 2 <= len(sizes) <= 3 and strides[-2] == 1 and min(sizes[-2:]) >= _MIN_TILE_SIDE


def _tile_count(batch: int, rows: int, cols: int) -> int:
    return batch * -(-rows // _TILE) * -(-cols // _TILE)


def _run(plan: _Plan, flat: torch.Tensor, others: list[torch.Tensor], flat_is_dst: bool) -> None:
    flat_aligned = flat.data_ptr() % 16 == 0
    with common.device_guard(plan.device):
        for la in plan.launches:
            _flat_segments_launch[(la.grid,)](
                la.table, la.num_segs, flat, others[la.like], FLAT_IS_DST=flat_is_dst, STRIDED=la.strided,
                TILED=la.tiled, ALIGNED=la.aligned and flat_aligned, BLOCK=la.block, TILE=_TILE,
                num_warps=la.num_warps,
            )


def _flatten_key(guarded: list[torch.Tensor], world_size: int, dtype: torch.dtype | None, has_out: bool):
    """``guarded``: the tensors, then ``out`` if given. The key holds their addresses (and which way the plan
    copies: an unflatten of ``flat=tensors[0]`` into ``[out]`` has the same tensors), the plan their layout guard."""
    # type(world_size): True == 1, but only an int passes validation.
    return common.guarded_key(guarded, "flatten_pad", world_size, type(world_size), dtype, has_out)


def _store(key: tuple | None, plan: _Plan, guarded: list[torch.Tensor] | None) -> None:
    """Cache ``plan`` with the layout guard of ``guarded``, the caller's own tensors its table addresses."""
    if key is not None and guarded is not None:
        _PLANS.put(key, plan._replace(check=common.layout_guard(guarded)))


def _plan_flatten(tensors: list[torch.Tensor], out: torch.Tensor, total: int) -> tuple[_Plan, list[torch.Tensor]]:
    """Build the launches of a validated flatten; return the plan and the tensors its table addresses
    (contiguous copies where a tensor has too many dims). The plan may be cached only if those are the
    caller's own tensors."""
    groups: dict[torch.dtype, _Segments] = {}
    sources = list(tensors)
    pos = 0
    for i, t in enumerate(tensors):
        if t.numel():
            sizes, strides = _coalesce(t)
            if len(sizes) > _MAX_DIMS:
                # More than 4 dims after coalescing (rare: e.g. permuted 5-D conv weights): the kernel's
                # table has 4 size/stride slots, so pay one extra copy for this tensor.
                t = sources[i] = t.contiguous()
                sizes, strides = [t.numel()], [1]
            groups.setdefault(t.dtype, _Segments(i)).add_tensor(t, pos, sizes, strides)
            pos += t.numel()
    if out.numel() > total:
        # The padding rides in the last launch as one more segment (no separate fill kernel);
        # padding > 0 implies total > 0, so there is a launch to ride in.
        pad = out.numel() - total
        groups[next(reversed(groups))].add(_ZERO, 0, total, pad, [pad], [1])
    launches = tuple(segs.plan(out.element_size(), out.device) for segs in groups.values())
    return _Plan(out.device, out.dtype, out.numel(), launches), sources


def _prepare_flatten(
    tensors: Sequence[torch.Tensor], world_size: int, dtype: torch.dtype | None, out: torch.Tensor | None
) -> tuple[list[torch.Tensor], torch.Tensor, int]:
    """Validate; return (tensors, out (allocated if None), total numel)."""
    tensors = common.check_tensors(tensors, "tensors")
    world_size = common.check_world_size(world_size, "flatten_pad")
    common.check_dtype_arg(dtype)
    for i, t in enumerate(tensors):
        common.check_float(t, f"tensors[{i}]")
        _check_no_overlap(t, f"tensors[{i}]")
    if out is not None:
        common.check_tensor(out, "out")
    if dtype is None:
        if out is not None:
            dtype = out.dtype
        elif tensors:
            dtype = tensors[0].dtype
        else:
            raise ValueError("flatten_pad of no tensors needs dtype= or out= to know the buffer's dtype")
    elif out is not None and out.dtype != dtype:
        raise ValueError(f"dtype={dtype} does not match out.dtype={out.dtype}: pass one of them, or make them agree")
    if dtype not in common.FLOAT_DTYPES:
        raise TypeError(f"dtype={dtype} is not supported; flatten_pad writes one of {list(common.FLOAT_DTYPES)}")
    names = [f"tensors[{i}]" for i in range(len(tensors))]
    if out is not None:
        common.check_same_device([*tensors, out], [*names, "out"])
    elif tensors:
        common.check_same_device(tensors, names)
    total = sum(t.numel() for t in tensors)
    padded = padded_numel(total, world_size)
    if out is None:
        out = torch.empty(padded, dtype=dtype, device=tensors[0].device if tensors else "cpu")
    else:
        common.check_out(out, padded)
        if out.numel() != padded:
            raise ValueError(
                f"out must hold exactly padded_numel({total}, {world_size})={padded} elements, got "
                f"out.numel()={out.numel()}: allocate torch.empty({padded}) or pass out[:{padded}]"
            )
        fix = "allocate out apart from the tensors it gathers (or pass out=None)"
        check_no_overlap("flatten_pad", list(zip(names, tensors)), [("out", out)], fix)
    return tensors, out, total


def flatten_pad(
    tensors: Sequence[torch.Tensor],
    world_size: int = 1,
    *,
    dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Flatten ``tensors`` back to back into one 1-D buffer padded with zeros to a multiple of ``world_size``.

    Args:
        tensors: float tensors of any shapes and strides (non-contiguous views welcome; overlapping memory,
            e.g. ``expand()``, is rejected), possibly of mixed dtypes.
        world_size: a positive int; the buffer length is ``padded_numel(sum of numels, world_size)``.
        dtype: dtype of the buffer (default: ``out.dtype`` if given, else the first tensor's dtype).
        out: contiguous buffer of exactly the padded length, written in place (allocated when None); it
            must not overlap any of ``tensors``.

    Returns:
        The flat buffer; one launch per source dtype, the zero tail written by the last one.
    """
    with profiled("shardfuse.kernels:flatten_pad"):
        tensors = common.as_list(tensors)
        # Every tensor the plan reads and writes: the key holds their addresses, the plan their layout guard.
        guarded = None if type(tensors) is not list else (tensors if out is None else [*tensors, out])
        key = None if guarded is None else _flatten_key(guarded, world_size, dtype, out is not None)
        plan = _PLANS.get(key, guarded)
        if plan is not None:
            if out is None:
                out = torch.empty(plan.numel, dtype=plan.dtype, device=plan.device)
            _run(plan, out, tensors, flat_is_dst=True)
            return out
        tensors, out, total = _prepare_flatten(tensors, world_size, dtype, out)
        if not common.use_triton(out, *tensors):
            return flatten_pad_ref(tensors, world_size, out=out)
        plan, sources = _plan_flatten(tensors, out, total)
        if all(s is t for s, t in zip(sources, tensors)):  # no table of temporaries' addresses
            _store(key, plan, guarded)
        _run(plan, out, sources, flat_is_dst=True)
        return out


def _prepare_unflatten(flat: torch.Tensor, outs: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], int]:
    common.check_float(flat, "flat")
    outs = common.check_tensors(outs, "outs")
    names = [f"outs[{i}]" for i in range(len(outs))]
    for o, name in zip(outs, names):
        common.check_float(o, name)
        _check_no_overlap(o, name)
    common.check_same_device([flat, *outs], ["flat", *names])
    total = sum(o.numel() for o in outs)
    common.check_out(flat, total, "flat")
    fix = "give every output memory of its own, apart from flat"
    check_no_overlap("unflatten_into", [("flat", flat)], list(zip(names, outs)), fix)
    return outs, total


def _plan_unflatten(outs: list[torch.Tensor], flat: torch.Tensor) -> tuple[_Plan, list[torch.Tensor], list]:
    """Build the launches of a validated unflatten; return the plan, the tensors its table addresses and
    the (output, temporary) pairs to copy over after the launch (outputs with too many dims)."""
    groups: dict[torch.dtype, _Segments] = {}
    targets = list(outs)
    fixups: list[tuple[torch.Tensor, torch.Tensor]] = []
    pos = 0
    for i, o in enumerate(outs):
        if o.numel():
            sizes, strides = _coalesce(o)
            if len(sizes) > _MAX_DIMS:
                # More than 4 dims after coalescing: write a contiguous temporary, copy it over after.
                targets[i] = torch.empty(o.shape, dtype=o.dtype, device=o.device)
                fixups.append((o, targets[i]))
                sizes, strides = [o.numel()], [1]
            groups.setdefault(o.dtype, _Segments(i)).add_tensor(targets[i], pos, sizes, strides)
            pos += o.numel()
    launches = tuple(segs.plan(flat.element_size(), flat.device) for segs in groups.values())
    return _Plan(flat.device, flat.dtype, flat.numel(), launches), targets, fixups


def unflatten_into(flat: torch.Tensor, outs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Copy consecutive slices of ``flat`` (from element 0; any padding after them is ignored) into ``outs``.

    Args:
        flat: contiguous float buffer with at least ``sum(o.numel() for o in outs)`` elements.
        outs: float tensors of any shapes, strides and dtypes; each gets the next ``o.numel()`` elements of
            ``flat`` in row-major order, cast to ``o.dtype``. No two may share memory (interleaved views
            of one tensor, such as column slices, are fine), and none may overlap ``flat``.

    Returns:
        ``outs`` as a list; one launch per destination dtype.
    """
    with profiled("shardfuse.kernels:unflatten_into"):
        outs = common.as_list(outs)
        guarded = [flat, *outs] if type(outs) is list else None  # the key's addresses, the plan's layout guard
        key = None if guarded is None else common.guarded_key(guarded, "unflatten_into")
        plan = _PLANS.get(key, guarded)
        if plan is not None:
            _run(plan, flat, outs, flat_is_dst=False)
            return outs
        outs, _ = _prepare_unflatten(flat, outs)
        if not common.use_triton(flat, *outs):
            return unflatten_into_ref(flat, outs)
        plan, targets, fixups = _plan_unflatten(outs, flat)
        if not fixups:  # no table of temporaries' addresses
            _store(key, plan, guarded)
        _run(plan, flat, targets, flat_is_dst=False)
        for o, target in fixups:
            o.copy_(target)
        return outs


# --------------------------------------------------------------------------------------------------
# References (plain PyTorch, same signatures and semantics)
# --------------------------------------------------------------------------------------------------


def flatten_pad_ref(tensors: Sequence[torch.Tensor], world_size: int = 1, *, dtype: torch.dtype | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Reference for :func:`flatten_pad`: one ``copy_`` per tensor into views of ``out``, then ``zero_``."""
    tensors, out, total = _prepare_flatten(tensors, world_size, dtype, out)
    flat = out.view(-1)
    pos = 0
    for t in tensors:
        flat[pos : pos + t.numel()].view(t.shape).copy_(t)
        pos += t.numel()
    flat[total:].zero_()
    return out


def unflatten_into_ref(flat: torch.Tensor, outs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Reference for :func:`unflatten_into`: one ``copy_`` per output from a view of ``flat``."""
    outs, _ = _prepare_unflatten(flat, outs)
    view = flat.view(-1)
    pos = 0
    for o in outs:
        o.copy_(view[pos : pos + o.numel()].view(o.shape))
        pos += o.numel()
    return outs
