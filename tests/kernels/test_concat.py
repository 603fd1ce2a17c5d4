"""concat_microbatches / split_microbatches against torch.cat, torch.split and the reference.

On CPU the Triton kernel runs under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1).
The kernel copies raw bits, so every comparison here is exact.
"""

from __future__ import annotations

import pytest
import torch

from shardfuse.kernels import _concat as concat_module
from shardfuse.kernels._concat import concat_microbatches, concat_microbatches_ref, split_microbatches
from tests.conftest import cuda_kernels, kernel_device, poisoned

DEVICE = kernel_device()
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit pattern, so NaN payloads and -0 compare too."""
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def randn(shape, dtype):
    return (torch.randn(shape, device=DEVICE) * 4).to(dtype)


@pytest.mark.parametrize("trailing", [(), (3,), (5, 3)], ids=["1d", "2d", "3d"])
@pytest.mark.parametrize("dim0", [1, 7, 131], ids=lambda d: f"rows{d}")
@pytest.mark.parametrize("num", range(1, 9), ids=lambda k: f"mb{k}")
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_torch_cat(dtype, num, dim0, trailing):
    x = randn((dim0, *trailing), DTYPES[dtype])
    parts = list(x.chunk(num))  # uneven sizes, as torch.chunk gives (fewer parts when dim0 < num)
    out = poisoned(x.shape, x.dtype, DEVICE)
    assert concat_microbatches(parts, out=out) is out
    assert torch.equal(bits(out), bits(torch.cat(parts)))
    assert torch.equal(bits(concat_microbatches(parts)), bits(x))
    assert torch.equal(concat_microbatches_ref(parts), x)


@pytest.mark.parametrize("sizes", [[0, 4099, 1], [7, 0, 0, 131], [4096, 8, 4096, 8], [0]], ids=str)
def test_uneven_and_empty_microbatches(sizes):
    x = randn((sum(sizes), 2), torch.float16)
    parts = list(x.split(sizes))
    assert torch.equal(concat_microbatches(parts), torch.cat(parts))


@pytest.mark.parametrize("dtype", [torch.int64, torch.uint8, torch.bool, torch.float64], ids=str)
def test_other_dtypes_copied_bit_exact(dtype):
    x = (torch.randn(37, 3, device=DEVICE) * 100).to(dtype)
    parts = list(x.split([10, 20, 7]))
    assert torch.equal(concat_microbatches(parts), torch.cat(parts))


def test_nan_payloads_and_negative_zero_preserved():
    x = randn((40,), torch.float32)
    raw = bits(x)
    raw[3] = 0x7FC00123  # a NaN with a payload
    raw[4] = -(2**31)  # -0.0
    x[5] = float("inf")
    parts = list(x.split([6, 30, 4]))
    assert torch.equal(bits(concat_microbatches(parts)), bits(x))


def test_non_contiguous_inputs():
    a = randn((4, 6), torch.bfloat16)
    b = randn((6, 5), torch.bfloat16).t()  # (5, 6) non-contiguous
    c = randn((3, 12), torch.bfloat16)[:, ::2]  # (3, 6) non-contiguous
    assert not b.is_contiguous() and not c.is_contiguous()
    out = poisoned((12, 6), torch.bfloat16, DEVICE)
    concat_microbatches([a, b, c], out=out)
    assert torch.equal(out, torch.cat([a, b, c]))


def test_out_slice_view_guards_untouched():
    parts = [randn((s, 3), torch.float32) for s in (2, 5, 1)]
    buf = torch.full((8 * 3 + 10,), -77.0, device=DEVICE)
    out = buf[3 : 3 + 24].view(8, 3)  # contiguous but unaligned
    out.fill_(float("nan"))
    concat_microbatches(parts, out=out)
    assert torch.equal(out, torch.cat(parts))
    assert (buf[:3] == -77.0).all() and (buf[27:] == -77.0).all(), "guard elements were overwritten"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.uint8], ids=str)
@pytest.mark.parametrize("case", ["word", "odd-size", "odd-out"])
def test_narrow_dtypes_copied_as_words_where_possible(dtype, case):
    # 1- and 2-byte tensors go through the kernel as 4-byte words when every size and address allows; an odd
    # size, or an out that starts off a word boundary, falls back to element copies. All must be exact.
    k = 4 // torch.empty(0, dtype=dtype).element_size()
    sizes = [3 * k, 5 * k, 1 * k, 7 * k] if case != "odd-size" else [3 * k, 5 * k + 1, k, 7 * k]
    make = (lambda n: torch.randint(0, 256, (n,), dtype=dtype, device=DEVICE)) if dtype == torch.uint8 else (
        lambda n: randn((n,), dtype))
    parts = [make(n) for n in sizes]
    total = sum(sizes)
    if case == "odd-out":
        backing = poisoned((total + 1,), dtype, DEVICE) if dtype != torch.uint8 else torch.full(
            (total + 1,), 255, dtype=dtype, device=DEVICE)
        out = backing[1:]  # one element in: off the 4-byte boundary
    else:
        out = poisoned((total,), dtype, DEVICE) if dtype != torch.uint8 else torch.full(
            (total,), 255, dtype=dtype, device=DEVICE)
    concat_microbatches(parts, out=out)
    assert torch.equal(bits(out), bits(torch.cat(parts)))
    plan = concat_module._build_plan(parts, tuple(out.shape), out.device)
    assert plan.bits == (torch.int32 if case != "odd-size" else concat_module._BITS_DTYPE[out.element_size()])


@pytest.mark.parametrize("num", range(1, 9), ids=lambda k: f"mb{k}")
def test_split_roundtrip(num):
    x = randn((23, 4), torch.float32)
    sizes = [p.shape[0] for p in x.chunk(num)]
    views = split_microbatches(x, sizes)
    assert [v.shape[0] for v in views] == sizes
    assert all(v.data_ptr() == x[sum(sizes[:i]) :].data_ptr() for i, v in enumerate(views)), "not views"
    assert torch.equal(concat_microbatches(views), x)
    assert split_microbatches(x, [0, 23, 0])[1].shape == (23, 4)


def test_concat_errors():
    a = randn((3, 4), torch.float32)
    with pytest.raises(TypeError, match="sequence of tensors.*wrap it in a list"):
        concat_microbatches(a)
    with pytest.raises(ValueError, match="empty list"):
        concat_microbatches([])
    with pytest.raises(TypeError, match=r"tensors\[1\] is a int"):
        concat_microbatches([a, 3])
    with pytest.raises(ValueError, match=r"tensors\[0\] is 0-dimensional.*reshape\(1\)"):
        concat_microbatches([torch.tensor(1.0, device=DEVICE)])
    with pytest.raises(ValueError, match=r"one trailing shape.*tensors\[1\].shape=\(2, 5\)"):
        concat_microbatches([a, randn((2, 5), torch.float32)])
    with pytest.raises(TypeError, match=r"one dtype.*tensors\[1\] is torch.float16"):
        concat_microbatches([a, a.half()])
    with pytest.raises(ValueError, match="one device"):
        concat_microbatches([a, torch.empty(1, 4, device="meta")])
    with pytest.raises(ValueError, match=r"out has shape \(6, 4\), expected \(3, 4\)"):
        concat_microbatches([a], out=torch.empty(6, 4, device=DEVICE))
    with pytest.raises(TypeError, match="out has dtype torch.float16"):
        concat_microbatches([a], out=torch.empty(3, 4, dtype=torch.float16, device=DEVICE))
    with pytest.raises(ValueError, match="out must be contiguous"):
        concat_microbatches([a], out=torch.empty(4, 3, device=DEVICE).t())


def test_split_errors():
    x = randn((5, 2), torch.float32)
    with pytest.raises(ValueError, match=r"sum to 4 but buffer.shape\[0\]=5"):
        split_microbatches(x, [1, 3])
    with pytest.raises(ValueError, match=r"non-negative ints, got sizes\[1\]=-1"):
        split_microbatches(x, [6, -1])
    with pytest.raises(ValueError, match=r"non-negative ints, got sizes\[0\]=2.5"):
        split_microbatches(x, [2.5, 2.5])
    with pytest.raises(ValueError, match="0-dim"):
        split_microbatches(torch.tensor(1.0), [1])


def test_out_holding_its_inputs_raises():
    buf = randn((8, 4), torch.float32)
    before = buf.clone()
    with pytest.raises(ValueError, match=r"concat_microbatches: tensors\[1\] and out overlap in memory .*apart from"):
        concat_microbatches([randn((2, 4), torch.float32), buf[5:7]], out=buf[4:8])
    with pytest.raises(ValueError, match=r"tensors\[0\] and out overlap"):
        concat_microbatches([buf[0:2], buf[2:3]], out=buf[0:3])  # even an input at its own slot
    with pytest.raises(ValueError, match=r"tensors\[0\] and out overlap"):
        concat_microbatches_ref([buf[0:2], buf[2:3]], out=buf[1:4])
    assert torch.equal(buf, before), "an overlapping call wrote before it raised"


def test_argument_types():
    a = randn((3, 4), torch.float32)
    with pytest.raises(TypeError, match=r"out is a int, not a torch.Tensor"):
        concat_microbatches([a], out=3)
    with pytest.raises(TypeError, match=r"buffer is a float, not a torch.Tensor"):
        split_microbatches(3.0, [1])
    with pytest.raises(ValueError, match=r"sizes must be a list of non-negative ints, got sizes=3"):
        split_microbatches(a, 3)


# ------------------------------------------------------------------ GPU: large, exact, one launch


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [8192, 8191], ids=lambda r: f"rows{r}")
def test_gpu_exact_one_launch(rows, dtype, triton_path):
    x = torch.randn(rows, 2048, device="cuda").to(DTYPES[dtype])
    parts = list(x.chunk(4))
    out = poisoned(x.shape, x.dtype, "cuda")
    concat_microbatches(parts, out=out)
    assert torch.equal(bits(out), bits(x))
    assert len(cuda_kernels(lambda: concat_microbatches(parts, out=out))) == 1


@pytest.mark.gpu
def test_gpu_thousands_of_tensors_one_launch(triton_path):
    gen = torch.Generator().manual_seed(0)
    sizes = torch.randint(0, 40, (4000,), generator=gen).tolist()
    parts = [torch.randn(s, 129, device="cuda") for s in sizes]
    out = torch.empty(sum(sizes), 129, device="cuda")
    concat_microbatches(parts, out=out)
    assert torch.equal(out, torch.cat(parts))
    assert len(cuda_kernels(lambda: concat_microbatches(parts, out=out))) == 1
