"""Memory-overlap checks (``shardfuse.kernels._overlap``) against a brute-force byte-by-byte answer."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from shardfuse.kernels._overlap import byte_span, check_no_overlap, overlap, same_elements


def brute_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Every byte of every element of ``a``, then a look-up for each byte of ``b``."""

    def byte_set(t: torch.Tensor) -> set[int]:
        size = t.element_size()
        out: set[int] = set()
        for idx in itertools.product(*(range(s) for s in t.shape)):
            start = t.data_ptr() + sum(i * st for i, st in zip(idx, t.stride())) * size
            out.update(range(start, start + size))
        return out

    return bool(byte_set(a) & byte_set(b))


def random_view(base: torch.Tensor, rng: random.Random) -> torch.Tensor:
    """Slices, column slices, transposes and permutations of dense blocks of ``base``."""
    kind = rng.randrange(3)
    if kind == 0:
        start, n, step = rng.randrange(200), rng.randrange(50), rng.choice([1, 1, 2, 3])
        return base[start : start + n * step : step]
    if kind == 1:
        rows, cols = rng.randrange(1, 9), rng.randrange(1, 20)
        m = base[rng.randrange(50) :][: rows * cols].view(rows, cols)
        c0 = rng.randrange(cols)
        v = m[rng.randrange(rows) :, c0 : rng.randrange(c0, cols + 1)]
        return v.t() if rng.random() < 0.3 else v
    a, b, c = rng.randrange(1, 5), rng.randrange(1, 5), rng.randrange(1, 6)
    m = base[rng.randrange(30) :][: a * b * c].view(a, b, c).permute(*rng.sample(range(3), 3))
    return m[rng.randrange(m.shape[0]) :, :, rng.randrange(m.shape[2]) :]


def test_overlap_matches_brute_force_on_random_views():
    rng = random.Random(1234)
    base = torch.zeros(2048)
    for _ in range(1500):
        a, b = random_view(base, rng), random_view(base, rng)
        assert overlap(a, b) == brute_overlap(a, b), (a.shape, a.stride(), a.storage_offset(),
                                                      b.shape, b.stride(), b.storage_offset())


def test_overlap_cases():
    w = torch.zeros(6, 8)
    assert not overlap(w[:, :4], w[:, 4:])  # interleaved column slices of one matrix: disjoint
    assert overlap(w[:, :5], w[:, 4:])
    assert not overlap(w[::2], w[1::2])
    assert overlap(w, w.t())
    assert not overlap(w[:0], w)  # empty
    assert overlap(w.view(-1)[:9].view(torch.int16), w.view(-1)[4:8])  # other element size: by bytes
    buf = torch.zeros(32)
    assert not overlap(buf[:16], buf[16:])
    assert overlap(buf[:16], buf[15:])
    assert byte_span(buf[:0]) == (0, 0)
    assert byte_span(buf[4:8]) == (buf.data_ptr() + 16, buf.data_ptr() + 32)


def test_same_elements():
    buf = torch.zeros(16)
    assert same_elements(buf[2:6], buf[2:6])
    assert not same_elements(buf[2:6], buf[2:7])
    assert not same_elements(buf[:8], buf[:16].view(torch.int16)[:8])
    assert not same_elements(buf[::2], buf[::2])  # not contiguous


def test_check_no_overlap_names_both_tensors_and_the_fix():
    buf = torch.zeros(32)
    with pytest.raises(ValueError, match=r"^f: a and b overlap in memory \(a bytes \[0x.*\), b bytes .*: do X$"):
        check_no_overlap("f", [], [("a", buf[0:10]), ("b", buf[5:15])], "do X")
    with pytest.raises(ValueError, match=r"f: r and w overlap in memory"):
        check_no_overlap("f", [("r", buf[0:10])], [("w", buf[8:20])], "do X")
    check_no_overlap("f", [("r0", buf[0:10]), ("r1", buf[5:15])], [("w", buf[20:30])], "fix")  # reads may overlap
    # In place: reads[i] may be exactly writes[i], nothing else.
    check_no_overlap("f", [("r0", buf[0:10]), ("r1", buf[10:20])], [("w0", buf[0:10]), ("w1", buf[10:20])], "fix",
                     in_place=True)
    with pytest.raises(ValueError, match=r"r0 and w1 overlap"):
        check_no_overlap("f", [("r0", buf[10:20])], [("w0", buf[0:10]), ("w1", buf[10:20])], "fix", in_place=True)
    with pytest.raises(ValueError, match="overlap"):
        check_no_overlap("f", [("r", buf[0:10])], [("w", buf[0:10])], "fix")  # in place not allowed here
    with pytest.raises(ValueError, match="overlap"):  # same start, other dtype: not the same elements
        check_no_overlap("f", [("r", buf[0:8])], [("w", buf[0:8].view(torch.int16))], "fix", in_place=True)
