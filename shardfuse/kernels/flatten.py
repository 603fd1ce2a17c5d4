"""Padding and flattening: many tensors <-> one flat buffer padded to a multiple of ``world_size``.

``flatten_pad`` gathers tensors of any shapes and strides (and mixed float dtypes, cast to one) back to back
into one contiguous 1-D buffer whose length is a multiple of ``world_size``, zeroing the padding tail, in
one launch per source dtype; the zero tail is written by the same launch (it is one more segment of the
launch's table). ``unflatten_into`` is the inverse: it scatters consecutive slices of a flat buffer into
separate tensors of any strides (full state dicts, loading), one launch per destination dtype.

Each launch covers a list of *segments* (one per tensor, plus the padding). A per-segment table holds the
block-start prefix sums, numels, the strided tensor's address, the offset into the flat buffer and up to
four coalesced sizes/strides; every program finds its segment by binary search over the block starts.

Layout: ``@triton.jit`` kernels, launchers (``padded_numel``, ``flatten_pad``, ``unflatten_into``),
references (``*_ref``).
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
    FLOAT_DTYPES,
    check_float,
    check_out,
    check_same_device,
    int64_table,
    use_triton,
)

logger = logging.getLogger(__name__)

__all__ = ["padded_numel", "flatten_pad", "unflatten_into", "flatten_pad_ref", "unflatten_into_ref"]

_NUM_WARPS = 8  # BLOCK_SIZE=4096 over 256 threads: 16 elements each, several 16-byte vectors in flight
_MIN_BLOCK = 512  # smallest block, for launches of tiny tensors
_MAX_DIMS = 4  # strided tensors with more dims after coalescing are made contiguous first

# Segment kinds in the table.
_CONTIGUOUS, _STRIDED, _ZERO = 0, 1, 2
# Table columns after the T + 1 block starts, each T long.
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
def _flat_segments_kernel(table, num_segs, search_steps, flat_ptr, other_like, FLAT_IS_DST: tl.constexpr,
                          STRIDED: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    """Copy/cast between one flat buffer and T segments (tensors, or the zero padding).

    ``table`` (int64): block starts [T + 1], then T-long columns numel, kind, addr, flat_off, size1..3,
    stride0..3 (see ``_COLUMNS``). ``other_like`` is only there for the strided side's element type.
    """
    pid = tl.program_id(0).to(tl.int64)  # int64 before any multiply: flat buffers can pass 2^31 elements
    # Binary search for the last segment s with starts[s] <= pid (invariant starts[lo] <= pid < starts[hi]).
    lo = pid * 0
    hi = lo + num_segs
    for _ in range(search_steps):
        mid = (lo + hi) // 2
        right = tl.load(table + mid) <= pid
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
    col = table + num_segs + 1 + lo  # column c of segment lo lives at col + c * num_segs
    block = pid - tl.load(table + lo)
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
    else:  # the zero padding tail (only in flatten launches)
        if FLAT_IS_DST:
            tl.store(flat + offs, tl.zeros([BLOCK], dtype=flat_ptr.dtype.element_ty), mask=offs < n)


# --------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------


def _device_guard(device: torch.device):
    # Triton launches on the current CUDA device; make it the tensors' device.
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def padded_numel(numel: int, world_size: int) -> int:
    """Smallest multiple of ``world_size`` that is >= ``numel`` (0 for 0)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size=}")
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel=}")
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


class _Segments:
    """Host-side table builder for one launch (one strided-side dtype)."""

    def __init__(self) -> None:
        self.cols: dict[str, list[int]] = {c: [] for c in _COLUMNS}
        self.strided = False

    def __len__(self) -> int:
        return len(self.cols["numel"])

    def add(self, kind: int, addr: int, flat_off: int, numel: int, sizes: list[int], strides: list[int]) -> None:
        pad = _MAX_DIMS - len(sizes)
        sizes = [1] * pad + sizes
        strides = [0] * pad + strides
        row = dict(numel=numel, kind=kind, addr=addr, flat_off=flat_off, size1=sizes[1], size2=sizes[2],
                   size3=sizes[3], stride0=strides[0], stride1=strides[1], stride2=strides[2], stride3=strides[3])
        for c in _COLUMNS:
            self.cols[c].append(row[c])
        self.strided |= kind == _STRIDED

    def add_tensor(self, t: torch.Tensor, flat_off: int) -> None:
        sizes, strides = _coalesce(t)
        if not sizes or (len(sizes) == 1 and strides[0] == 1):
            self.add(_CONTIGUOUS, t.data_ptr(), flat_off, t.numel(), [t.numel()], [1])
        else:
            self.add(_STRIDED, t.data_ptr(), flat_off, t.numel(), sizes, strides)

    def launch(self, flat: torch.Tensor, other_like: torch.Tensor, flat_is_dst: bool) -> None:
        numels = self.cols["numel"]
        # Many tiny tensors: a smaller block wastes fewer masked lanes (one compile per power of two).
        block = min(BLOCK_SIZE, max(_MIN_BLOCK, triton.next_power_of_2(max(numels))))
        starts = [0]
        for k in numels:
            starts.append(starts[-1] + triton.cdiv(k, block))
        # Vector hints only when every contiguous segment starts 16-byte aligned on both sides.
        fsize = flat.element_size()
        aligned = flat.data_ptr() % 16 == 0 and all(
            a % 16 == 0 and (o * fsize) % 16 == 0
            for kind, a, o in zip(self.cols["kind"], self.cols["addr"], self.cols["flat_off"])
            if kind == _CONTIGUOUS
        )
        values = starts + [v for c in _COLUMNS for v in self.cols[c]]
        table = int64_table(values, flat.device)  # one small host->device copy, no sync
        steps = max(1, (len(self) - 1).bit_length())  # ceil(log2(T)) halvings of [0, T)
        with _device_guard(flat.device):
            _flat_segments_kernel[(starts[-1],)](
                table, len(self), steps, flat, other_like, FLAT_IS_DST=flat_is_dst, STRIDED=self.strided,
                ALIGNED=aligned, BLOCK=block, num_warps=_NUM_WARPS if block >= 2048 else 4,
            )


def _prepare_flatten(
    tensors: Sequence[torch.Tensor], world_size: int, dtype: torch.dtype | None, out: torch.Tensor | None
) -> tuple[list[torch.Tensor], torch.Tensor, int]:
    """Validate; return (tensors, out (allocated if None), total numel)."""
    tensors = list(tensors)
    for i, t in enumerate(tensors):
        check_float(t, f"tensors[{i}]")
        _check_no_overlap(t, f"tensors[{i}]")
    if dtype is None:
        if out is not None:
            dtype = out.dtype
        elif tensors:
            dtype = tensors[0].dtype
        else:
            raise ValueError("flatten_pad of no tensors needs dtype= or out= to know the buffer's dtype")
    elif out is not None and out.dtype != dtype:
        raise ValueError(f"dtype={dtype} does not match out.dtype={out.dtype}: pass one of them, or make them agree")
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype={dtype} is not supported; flatten_pad writes one of {list(FLOAT_DTYPES)}")
    names = [f"tensors[{i}]" for i in range(len(tensors))]
    if out is not None:
        check_same_device([*tensors, out], [*names, "out"])
    elif tensors:
        check_same_device(tensors, names)
    total = sum(t.numel() for t in tensors)
    padded = padded_numel(total, world_size)
    if out is None:
        out = torch.empty(padded, dtype=dtype, device=tensors[0].device if tensors else "cpu")
    else:
        check_out(out, padded)
        if out.numel() != padded:
            raise ValueError(
                f"out must hold exactly padded_numel({total}, {world_size})={padded} elements, got "
                f"out.numel()={out.numel()}: allocate torch.empty({padded}) or pass out[:{padded}]"
            )
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
        world_size: the buffer length is ``padded_numel(sum of numels, world_size)``.
        dtype: dtype of the buffer (default: ``out.dtype`` if given, else the first tensor's dtype).
        out: contiguous buffer of exactly the padded length, written in place (allocated when None).

    Returns:
        The flat buffer; one launch per source dtype, the zero tail written by the last one.
    """
    with record_function("shardfuse.kernels:flatten_pad"):
        tensors, out, total = _prepare_flatten(tensors, world_size, dtype, out)
        if not use_triton(out, *tensors):
            return flatten_pad_ref(tensors, world_size, out=out)
        groups: dict[torch.dtype, _Segments] = {}
        like: dict[torch.dtype, torch.Tensor] = {}
        keep: list[torch.Tensor] = []  # temporaries must outlive the launch that reads them
        pos = 0
        for t in tensors:
            if t.numel():
                if len(_coalesce(t)[0]) > _MAX_DIMS:
                    # More than 4 dims after coalescing (rare: e.g. permuted 5-D conv weights): the kernel's
                    # table has 4 size/stride slots, so pay one extra copy for this tensor.
                    t = t.contiguous()
                    keep.append(t)
                groups.setdefault(t.dtype, _Segments()).add_tensor(t, pos)
                like.setdefault(t.dtype, t)
                pos += t.numel()
        if out.numel() > total:
            # The padding rides in the last launch as one more segment (no separate fill kernel);
            # padding > 0 implies total > 0, so there is a launch to ride in.
            pad = out.numel() - total
            groups[next(reversed(groups))].add(_ZERO, 0, total, pad, [pad], [1])
        for dt, segs in groups.items():
            segs.launch(out, like[dt], flat_is_dst=True)
        return out


def _prepare_unflatten(flat: torch.Tensor, outs: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], int]:
    outs = list(outs)
    check_float(flat, "flat")
    for i, o in enumerate(outs):
        check_float(o, f"outs[{i}]")
        _check_no_overlap(o, f"outs[{i}]")
    check_same_device([flat, *outs], ["flat", *(f"outs[{i}]" for i in range(len(outs)))])
    total = sum(o.numel() for o in outs)
    check_out(flat, total, "flat")
    return outs, total


def unflatten_into(flat: torch.Tensor, outs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Copy consecutive slices of ``flat`` (from element 0; any padding after them is ignored) into ``outs``.

    Args:
        flat: contiguous float buffer with at least ``sum(o.numel() for o in outs)`` elements.
        outs: float tensors of any shapes, strides (non-overlapping) and dtypes; each gets the next
            ``o.numel()`` elements of ``flat`` in row-major order, cast to ``o.dtype``.

    Returns:
        ``outs`` as a list; one launch per destination dtype.
    """
    with record_function("shardfuse.kernels:unflatten_into"):
        outs, _ = _prepare_unflatten(flat, outs)
        if not use_triton(flat, *outs):
            return unflatten_into_ref(flat, outs)
        groups: dict[torch.dtype, _Segments] = {}
        like: dict[torch.dtype, torch.Tensor] = {}
        fixups: list[tuple[torch.Tensor, torch.Tensor]] = []
        pos = 0
        for o in outs:
            if o.numel():
                target = o
                if len(_coalesce(o)[0]) > _MAX_DIMS:
                    # More than 4 dims after coalescing: write a contiguous temporary, copy it over after.
                    target = torch.empty(o.shape, dtype=o.dtype, device=o.device)
                    fixups.append((o, target))
                groups.setdefault(o.dtype, _Segments()).add_tensor(target, pos)
                like.setdefault(o.dtype, target)
                pos += o.numel()
        for dt, segs in groups.items():
            segs.launch(flat, like[dt], flat_is_dst=False)
        for o, target in fixups:
            o.copy_(target)
        return outs


# --------------------------------------------------------------------------------------------------
# References (plain PyTorch, same signatures and semantics)
# --------------------------------------------------------------------------------------------------


def flatten_pad_ref(
    tensors: Sequence[torch.Tensor],
    world_size: int = 1,
    *,
    dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
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
