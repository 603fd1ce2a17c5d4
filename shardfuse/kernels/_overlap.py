"""Memory-overlap checks for kernel arguments: which of the tensors a kernel reads and writes share memory.

A kernel that writes one tensor while reading (or writing) another that shares its memory computes a result
that depends on the order its programs run in; PyTorch raises for the same situations (``copy_``,
``torch.cat``). The checks look only at addresses and layouts, which are in the launch-plan keys, so a
launcher runs them once per plan, not once per call.

Elements are located exactly for every layout that a slice, transpose or permutation of a dense tensor
has ("nested" strides: each larger than everything inside it); interleaved views of one tensor, such as
the column slices ``w[:, :k]`` and ``w[:, k:]``, are therefore told apart. Tensors of other layouts, or of
different element sizes, count as overlapping when their byte ranges meet.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch

_MAX_RUNS = 1 << 16  # strided-vs-strided: contiguous runs walked one by one before giving a conservative answer


def byte_span(t: torch.Tensor) -> tuple[int, int]:
    """[first byte, one past the last byte) of ``t``'s elements; (0, 0) when empty."""
    if t.numel() == 0:
        return 0, 0
    if t.is_contiguous():
        start = t.data_ptr()
        return start, start + t.nbytes
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    start = t.data_ptr()
    return start, start + (last + 1) * t.element_size()


def _nested_dims(t: torch.Tensor) -> list[tuple[int, int]] | None:
    """(size, stride) in elements by decreasing stride, size-1 dims dropped; None unless every stride is
    larger than the largest offset of the dims inside it (then offsets decompose uniquely into indices)."""
    dims = sorted(((s, st) for s, st in zip(t.shape, t.stride()) if s != 1), key=lambda d: -d[1])
    extent = 0
    for size, stride in reversed(dims):
        if stride <= extent:
            return None
        extent += (size - 1) * stride
    return dims


def _first_at_or_after(x: int, dims: Sequence[tuple[int, int]]) -> int | None:
    """The smallest element offset >= ``x`` of a nested layout (offsets from its first element), or None."""
    if x <= 0:
        return 0
    if not dims:
        return None
    (size, stride), inner = dims[0], dims[1:]
    q = x // stride
    if q >= size:
        return None
    rest = _first_at_or_after(x - q * stride, inner)
    if rest is not None:
        return q * stride + rest
    return (q + 1) * stride if q + 1 < size else None  # every element with a smaller outer index is below x


def _hits(dims: Sequence[tuple[int, int]], lo: int, hi: int) -> bool:
    """Whether a nested layout has an element offset in [lo, hi)."""
    first = _first_at_or_after(lo, dims)
    return first is not None and first < hi


def _runs(dims: Sequence[tuple[int, int]]) -> tuple[int, list[tuple[int, int]]]:
    """(run length, outer dims): a nested layout as contiguous runs of its unit-stride innermost dim."""
    if dims and dims[-1][1] == 1:
        return dims[-1][0], list(dims[:-1])
    return 1, list(dims)


def overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` share memory (exactly for nested layouts, by byte ranges otherwise)."""
    a0, a1 = byte_span(a)
    b0, b1 = byte_span(b)
    if a0 == a1 or b0 == b1 or a0 >= b1 or b0 >= a1 or a.device != b.device:
        return False
    size = a.element_size()
    da, db = _nested_dims(a), _nested_dims(b)
    if size != b.element_size() or (b0 - a0) % size or da is None or db is None:
        return True
    off = (b0 - a0) // size  # b's first element, counted in elements from a's first
    if b1 - b0 == b.numel() * size:  # b is dense: its elements fill its whole range
        return _hits(da, off, off + b.numel())
    if a1 - a0 == a.numel() * size:
        return _hits(db, -off, -off + a.numel())
    # Both have gaps (e.g. interleaved column slices): walk the contiguous runs of the one with fewer.
    (run_a, outer_a), (run_b, outer_b) = _runs(da), _runs(db)
    if a.numel() // run_a > b.numel() // run_b:
        da, db, off, run_a, outer_a = db, da, -off, run_b, outer_b
    if math.prod(s for s, _ in outer_a) > _MAX_RUNS:
        return True
    for index in itertools.product(*(range(s) for s, _ in outer_a)):
        start = sum(i * st for i, (_, st) in zip(index, outer_a)) - off
        if _hits(db, start, start + run_a):
            return True
    return False


def meets(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the byte ranges of ``a`` and ``b`` meet: the cheap test before :func:`check_no_overlap`."""
    a0, a1 = byte_span(a)
    b0, b1 = byte_span(b)
    return a0 < b1 and b0 < a1


def same_elements(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Both name exactly the same contiguous elements of one dtype: a lane-by-lane kernel reading one and
    writing the other is in place, which is safe."""
    return (
        a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.numel() == b.numel()
        and a.is_contiguous() and b.is_contiguous() and a.device == b.device
    )


def check_no_overlap(
    caller: str,
    reads: Sequence[tuple[str, torch.Tensor]],
    writes: Sequence[tuple[str, torch.Tensor]],
    fix: str,
    *,
    in_place: bool = False,
) -> None:
    """Raise a ValueError naming two tensors when a written tensor shares memory with another written one or
    with a read one. With ``in_place``, ``reads[i]`` may be exactly ``writes[i]`` (:func:`same_elements`).

    Sorted by first byte, each tensor is compared only with those whose byte range it starts inside of.
    """
    items = [(*byte_span(t), 1, i, name, t) for i, (name, t) in enumerate(writes)]
    items += [(*byte_span(t), 0, i, name, t) for i, (name, t) in enumerate(reads)]
    items = sorted((it for it in items if it[0] != it[1]), key=lambda it: it[0])
    active: list[tuple] = []
    for item in items:
        start, _, wrote, index, name, t = item
        active = [a for a in active if a[1] > start]
        for other in active:
            if not (wrote or other[2]):
                continue  # two reads
            if in_place and wrote != other[2] and index == other[3] and same_elements(t, other[5]):
                continue
            if overlap(t, other[5]):
                _raise(caller, other, item, fix, in_place)
        active.append(item)


def _raise(caller: str, first: tuple, second: tuple, fix: str, in_place: bool) -> None:
    # A source before its destination; two destinations in address order.
    (a0, a1, _, _, a, _), (b0, b1, _, _, b, _) = sorted((first, second), key=lambda it: (it[2], it[0]))
    # Where a source may be its own destination (in place), say that the same tensor would have been fine.
    same_is_fine = in_place and first[2] != second[2]
    how = "overlap in memory without being the same tensor" if same_is_fine else "overlap in memory"
    raise ValueError(
        f"{caller}: {a} and {b} {how} ({a} bytes [{a0:#x}, {a1:#x}), {b} bytes [{b0:#x}, {b1:#x})), "
        f"so the result would depend on the order the kernel runs in: {fix}"
    )
