"""Gradient pre-/post-division kernels (the public forms, and the trusted launches the sharding runtime calls)
against their references and plain PyTorch.

On CPU the Triton kernels run under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from shardfuse.kernels._grad_divide import (
    check_post_divide,
    check_pre_divide_pad,
    gradient_divide_factors,
    post_divide,
    post_divide_ref,
    post_divide_unchecked,
    pre_divide_pad_ref,
    pre_divide_pad_unchecked,
)
from shardfuse.kernels._grad_divide_multi import pre_divide_pad
from tests._asserts import assert_same
from tests.conftest import cuda_kernels, kernel_device, poisoned

DEVICE = kernel_device()
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_PAIRS = [(a, b) for a in DTYPES for b in DTYPES]
FACTORS = [1.0, 2.0, 3.0, 0.5]
SIZES = [0, 1, 7, 131, 4099]


def assert_positive_zero(t: torch.Tensor) -> None:
    bits = {4: torch.int32, 2: torch.int16}[t.element_size()]
    assert torch.equal(t.view(bits), torch.zeros_like(t.view(bits))), "padding is not exactly +0"


def randn(n, dtype, scale=4.0):
    return (torch.randn(n, device=DEVICE) * scale).to(dtype)


def true_div(x: torch.Tensor, f: float) -> torch.Tensor:
    # Plain PyTorch: fp32 true division (a device tensor, so CUDA does not use the reciprocal shortcut).
    return x.float() / torch.tensor(f, device=x.device)


# ------------------------------------------------------------------ gradient_divide_factors


def _fairscale_rule(ws: int) -> float:
    f = 1
    while ws % f == 0 and ws / f > f:
        f *= 2
    return float(f)


@pytest.mark.parametrize("world_size", range(1, 65), ids=lambda w: f"ws{w}")
def test_gradient_divide_factors(world_size):
    pre, post = gradient_divide_factors(world_size)
    assert pre == _fairscale_rule(world_size)
    assert pre * post == world_size
    assert pre >= 1 and int(pre) & (int(pre) - 1) == 0, f"{pre=} is not a power of two"


@pytest.mark.parametrize(
    "world_size,expected",
    [(1, (1, 1)), (2, (2, 1)), (3, (2, 1.5)), (4, (2, 2)), (6, (4, 1.5)), (8, (4, 2)), (16, (4, 4)), (32, (8, 4))],
    ids=lambda v: str(v),
)
def test_gradient_divide_factors_values(world_size, expected):
    assert gradient_divide_factors(world_size) == expected


@pytest.mark.parametrize("bad", [0, -2, 2.0, 2.5, True, "4", None], ids=repr)
def test_gradient_divide_factors_rejects(bad):
    with pytest.raises(ValueError, match=r"world_size >= 1, got world_size=.*must be a positive int"):
        gradient_divide_factors(bad)


def test_gradient_divide_factors_numpy_int():
    assert gradient_divide_factors(np.int64(8)) == (4.0, 2.0)


# ------------------------------------------------------------------ pre_divide_pad


@pytest.mark.parametrize("n", SIZES, ids=lambda n: f"n{n}")
@pytest.mark.parametrize("factor", FACTORS, ids=lambda f: f"f{f:g}")
@pytest.mark.parametrize("pair", DTYPE_PAIRS, ids=lambda p: f"{p[0]}->{p[1]}")
def test_pre_divide_pad_single(pair, factor, n):
    gd, od = DTYPES[pair[0]], DTYPES[pair[1]]
    pad = (-n) % 8 + 3  # always some padding to zero
    g = randn(n, gd)
    out = poisoned((n + pad,), od, DEVICE)
    assert pre_divide_pad(g, out, factor) is out
    expected = F.pad(true_div(g, factor).to(od), (0, pad))
    assert_same(out, expected)
    assert_same(out, pre_divide_pad_ref(g, poisoned((n + pad,), od, DEVICE), factor))
    assert_positive_zero(out[n:])


@pytest.mark.parametrize("num", [1, 3], ids=lambda k: f"{k}grads")
def test_pre_divide_pad_no_padding_and_2d_out(num):
    grads = [randn(6, torch.float32) for _ in range(num)]
    out = poisoned((num * 2, 3), torch.bfloat16, DEVICE)  # exactly n elements, 2-D
    pre_divide_pad(grads, out, 2.0)
    assert_same(out.view(-1), true_div(torch.cat(grads), 2.0).to(torch.bfloat16))


@pytest.mark.parametrize("num", [1, 3], ids=lambda k: f"{k}grads")
def test_pre_divide_pad_slice_out_guards_untouched(num):
    grads = [randn(s, torch.float16) for s in [37, 5, 11][:num]]
    n = sum(g.numel() for g in grads)
    buf = torch.full((n + 20,), -77.0, device=DEVICE)
    out = buf[3 : n + 10]  # unaligned view, 7 elements of padding
    out.fill_(float("nan"))
    pre_divide_pad(grads, out, 3.0)
    assert_same(out, F.pad(true_div(torch.cat(grads), 3.0), (0, 7)))
    assert (buf[:3] == -77.0).all() and (buf[n + 10 :] == -77.0).all(), "guard elements were overwritten"


@pytest.mark.parametrize("num", [1, 2], ids=lambda k: f"{k}grads")
@pytest.mark.parametrize("od", ["fp32", "fp16"])
def test_pre_divide_pad_nan_inf_propagate(od, num):
    g = randn(300, torch.float32)
    g[[0, 17, 299]] = torch.tensor([float("nan"), float("inf"), float("-inf")], device=DEVICE)
    grads = [g] if num == 1 else [g[:100], g[100:]]
    out = poisoned((304,), DTYPES[od], DEVICE)
    pre_divide_pad(grads, out, 3.0)
    assert out[0].isnan() and out[17] == float("inf") and out[299] == float("-inf")
    assert_same(out, F.pad(true_div(g, 3.0).to(DTYPES[od]), (0, 4)))


def test_pre_divide_pad_errors():
    g = randn(10, torch.float32)
    out = torch.empty(12, device=DEVICE)
    with pytest.raises(ValueError, match="empty list"):
        pre_divide_pad([], out, 2.0)
    with pytest.raises(TypeError, match=r"grads\[1\] is a list"):
        pre_divide_pad([g, [1.0]], out, 2.0)
    with pytest.raises(ValueError, match=r"not contiguous.*\.contiguous\(\)"):
        pre_divide_pad([randn(12, torch.float32).view(3, 4).t()], torch.empty(12, device=DEVICE), 2.0)
    with pytest.raises(TypeError, match="one dtype"):
        pre_divide_pad([g[:2], g[2:4].half()], out, 2.0)
    with pytest.raises(TypeError, match="unsupported dtype torch.int64"):
        pre_divide_pad(torch.arange(4, device=DEVICE), out, 2.0)
    with pytest.raises(TypeError, match="out has unsupported dtype"):
        pre_divide_pad(g, torch.empty(12, dtype=torch.int32, device=DEVICE), 2.0)
    with pytest.raises(ValueError, match=r"out is too small: out.numel\(\)=9 < required 10"):
        pre_divide_pad(g, torch.empty(9, device=DEVICE), 2.0)
    with pytest.raises(ValueError, match="out must be contiguous"):
        pre_divide_pad(g, torch.empty(24, device=DEVICE)[::2], 2.0)
    with pytest.raises(ValueError, match="one device"):
        pre_divide_pad(g, torch.empty(12, device="meta"), 2.0)
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="finite number > 0"):
            pre_divide_pad(g, out, bad)


# ------------------------------------------------------------------ post_divide


@pytest.mark.parametrize("n", SIZES, ids=lambda n: f"n{n}")
@pytest.mark.parametrize("accumulate", [False, True], ids=["write", "accumulate"])
@pytest.mark.parametrize("factor", FACTORS, ids=lambda f: f"f{f:g}")
@pytest.mark.parametrize("pair", DTYPE_PAIRS, ids=lambda p: f"{p[0]}->{p[1]}")
def test_post_divide(pair, factor, accumulate, n):
    sd, od = DTYPES[pair[0]], DTYPES[pair[1]]
    big = randn(n + 9, sd)
    src = big[5 : 5 + n]  # a slice of a larger reduce-scatter output
    if accumulate:
        existing = randn(n, od, scale=1.0)  # random, not zero: the sum must really happen
        out = existing.clone()
        expected = (existing.float() + true_div(src, factor)).to(od)
    else:
        out = poisoned((n,), od, DEVICE)
        expected = true_div(src, factor).to(od)
        existing = out
    ref_out = existing.clone()
    assert post_divide(src, out, factor, accumulate=accumulate) is out
    assert_same(out, expected)
    assert_same(out, post_divide_ref(src, ref_out, factor, accumulate=accumulate))


@pytest.mark.parametrize("accumulate", [False, True], ids=["write", "accumulate"])
def test_post_divide_in_place_and_2d(accumulate):
    src = randn(6 * 7, torch.float32).view(6, 7)
    expected = true_div(src, 3.0) + (src.float() if accumulate else 0)
    post_divide(src, src, 3.0, accumulate=accumulate)
    assert_same(src, expected)


def test_post_divide_slice_out_guards_untouched():
    src = randn(131, torch.bfloat16)
    buf = torch.full((140,), -77.0, device=DEVICE)
    existing = randn(131, torch.float32)
    buf[4:135] = existing
    post_divide(src, buf[4:135], 2.0, accumulate=True)
    assert_same(buf[4:135], existing + true_div(src, 2.0))
    assert (buf[:4] == -77.0).all() and (buf[135:] == -77.0).all(), "guard elements were overwritten"


@pytest.mark.parametrize("accumulate", [False, True], ids=["write", "accumulate"])
def test_post_divide_nan_inf_propagate(accumulate):
    src = randn(50, torch.float16)
    src[[1, 2, 3]] = torch.tensor([float("nan"), float("inf"), float("-inf")], dtype=torch.float16, device=DEVICE)
    out = randn(50, torch.float32)
    expected = true_div(src, 3.0) + (out if accumulate else 0)
    post_divide(src, out, 3.0, accumulate=accumulate)
    assert out[1].isnan() and out[2] == float("inf") and out[3] == float("-inf")
    assert_same(out, expected)


def test_post_divide_errors():
    src = randn(10, torch.float32)
    with pytest.raises(ValueError, match=r"same size.*src.numel\(\)=10 out.numel\(\)=12"):
        post_divide(src, torch.empty(12, device=DEVICE), 2.0)
    with pytest.raises(ValueError, match=r"out is too small"):
        post_divide(src, torch.empty(8, device=DEVICE), 2.0)
    with pytest.raises(ValueError, match=r"src is not contiguous.*\.contiguous\(\)"):
        post_divide(randn(20, torch.float32)[::2], torch.empty(10, device=DEVICE), 2.0)
    with pytest.raises(ValueError, match="out must be contiguous"):
        post_divide(src, torch.empty(20, device=DEVICE)[::2], 2.0)
    with pytest.raises(TypeError, match="src has unsupported dtype"):
        post_divide(torch.arange(10, device=DEVICE), torch.empty(10, device=DEVICE), 2.0)
    with pytest.raises(TypeError, match="out has unsupported dtype"):
        post_divide(src, torch.empty(10, dtype=torch.int32, device=DEVICE), 2.0)
    with pytest.raises(ValueError, match="one device"):
        post_divide(src, torch.empty(10, device="meta"), 2.0)
    buf = randn(15, torch.float32)
    with pytest.raises(ValueError, match="overlap"):
        post_divide(buf[:10], buf[5:15], 2.0)
    for bad in (0.0, -3.0, float("nan")):
        with pytest.raises(ValueError, match="finite number > 0"):
            post_divide(src, torch.empty(10, device=DEVICE), bad)


# ------------------------------------------------------------------ overlapping memory, argument types


def test_pre_divide_pad_out_overlapping_grads_raises():
    buf = randn(64, torch.float32)
    before = buf.clone()
    with pytest.raises(ValueError, match=r"pre_divide_pad: grads\[0\] and out\[0:20\] overlap in memory .*in place"):
        pre_divide_pad(buf[2:22], buf[:24], 2.0)  # shifted by two elements
    with pytest.raises(ValueError, match=r"grads\[1\] and out\[14:\] overlap"):  # a gradient in the padding
        pre_divide_pad([buf[40:50], buf[18:22]], buf[:24], 2.0)
    with pytest.raises(ValueError, match=r"grads\[0\] and out\[0:10\] overlap"):
        pre_divide_pad_ref([buf[30:40]], buf[30:40].view(torch.int16)[:12].view(torch.bfloat16), 2.0)
    assert torch.equal(buf, before), "an overlapping call wrote before it raised"


@pytest.mark.parametrize("num", [1, 2], ids=lambda k: f"{k}grads")
def test_pre_divide_pad_in_place(num):
    # Each gradient exactly its own slice of out: scaled in place, padding zeroed.
    buf = randn(131 * num + 5, torch.float32)
    grads = [buf[131 * i : 131 * (i + 1)] for i in range(num)]
    expected = pre_divide_pad_ref([g.clone() for g in grads], poisoned((buf.numel(),), torch.float32, DEVICE), 4.0)
    pre_divide_pad(grads if num > 1 else grads[0], buf, 4.0)
    assert_same(buf, expected)


def test_post_divide_overlap_names_the_fix():
    buf = randn(15, torch.float32)
    with pytest.raises(ValueError, match=r"post_divide: src and out overlap in memory .*src is out, is fine"):
        post_divide(buf[:10], buf[5:15], 2.0)
    with pytest.raises(ValueError, match=r"post_divide: src and out overlap"):
        post_divide_ref(buf[:10], buf[5:15], 2.0)


def test_grad_divide_argument_types():
    g = randn(10, torch.float32)
    out = torch.empty(12, device=DEVICE)
    for bad in (True, "2", None, float("nan")):
        with pytest.raises(ValueError, match=r"the divide factor must be a finite number > 0, got factor="):
            pre_divide_pad(g, out, bad)
        with pytest.raises(ValueError, match=r"the divide factor must be a finite number > 0, got factor="):
            post_divide(g, out[:10], bad)
    with pytest.raises(TypeError, match=r"grads must be a sequence of tensors, got a float"):
        pre_divide_pad(3.0, out, 2.0)
    with pytest.raises(TypeError, match=r"out is a int, not a torch.Tensor"):
        pre_divide_pad(g, 3, 2.0)
    with pytest.raises(TypeError, match=r"src is a list, not a torch.Tensor"):
        post_divide([g], out[:10], 2.0)
    with pytest.raises(TypeError, match=r"out is a NoneType, not a torch.Tensor"):
        post_divide(g, None, 2.0)


# ------------------------------------------------------------------ GPU: large, exact, one launch


@pytest.mark.gpu
@pytest.mark.parametrize("pair", DTYPE_PAIRS, ids=lambda p: f"{p[0]}->{p[1]}")
def test_gpu_pre_divide_pad_exact_one_launch(pair):
    gd, od = DTYPES[pair[0]], DTYPES[pair[1]]
    n = (1 << 24) + 3
    g = torch.randn(n, device="cuda").mul_(1000).to(gd)
    out = poisoned((n + 5,), od, "cuda")
    pre_divide_pad(g, out, 3.0)
    torch.testing.assert_close(out, pre_divide_pad_ref(g, torch.empty_like(out), 3.0), rtol=0, atol=0)
    assert len(cuda_kernels(lambda: pre_divide_pad(g, out, 3.0))) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("accumulate", [False, True], ids=["write", "accumulate"])
@pytest.mark.parametrize("pair", DTYPE_PAIRS, ids=lambda p: f"{p[0]}->{p[1]}")
def test_gpu_post_divide_exact_one_launch(pair, accumulate):
    sd, od = DTYPES[pair[0]], DTYPES[pair[1]]
    n = (1 << 24) + 7
    src = torch.randn(n + 3, device="cuda").mul_(1000).to(sd)[3:]
    base = torch.randn(n, device="cuda").to(od)
    out, ref = base.clone(), base.clone()
    post_divide(src, out, 3.0, accumulate=accumulate)
    post_divide_ref(src, ref, 3.0, accumulate=accumulate)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    assert len(cuda_kernels(lambda: post_divide(src, out, 3.0, accumulate=accumulate))) == 1


# ------------------------------------------------------------------ power-of-two factors: multiply, still exact

# 2**126: the reciprocal 2**-126 is the smallest normal fp32 (multiply); 2**127: subnormal reciprocal (divide)
EDGE_FACTORS = [2.0, 0.125, 2.0**20, 2.0**126, 2.0**127, 2.0**-126, 3.0]


def test_scale_args_picks_multiply_only_where_exact():
    from shardfuse.kernels._common import scale_args

    assert scale_args(1.0) == (1.0, False, False)
    assert scale_args(8.0) == (0.125, True, True)
    assert scale_args(0.5) == (2.0, True, True)
    assert scale_args(2.0**126) == (2.0**-126, True, True)
    assert scale_args(3.0) == (3.0, True, False)
    assert scale_args(2.0**127) == (2.0**127, True, False)
    assert scale_args(0.1) == (0.1, True, False)


def edge_values(device: str, n: int) -> torch.Tensor:
    """Zeros of both signs, subnormals, the normal boundary, the largest values, Inf, NaN, then random data
    spread over many exponents (so results land in the subnormal range and overflow too)."""
    specials = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1e-40, -3e-39, 1.1754944e-38, -1.1754944e-38, 3.4e38,
                             -3.4e38, float("inf"), float("-inf"), float("nan"), 1.0, -1.5, 3.0], device=device)
    exps = torch.randint(-140, 128, (n,), device=device).float()
    rand = torch.randn(n, device=device) * torch.exp2(exps)
    return torch.cat([specials, rand])


def _check_divide_edges_exact(device: str, n: int, factor: float) -> None:
    from shardfuse.kernels._chunk_cat import chunk_cat, chunk_cat_ref

    x = edge_values(device, n)
    out = poisoned((x.numel() + 5,), torch.float32, device)
    pre_divide_pad(x, out, factor)
    assert_same(out[: x.numel()], true_div(x, factor))
    parts = [x[:7], x[7:]]
    out2 = poisoned((x.numel() + 5,), torch.float32, device)
    pre_divide_pad(parts, out2, factor)
    assert_same(out2, out)
    for accumulate in (False, True):
        base = edge_values(device, n)[: x.numel()]
        got, ref = base.clone(), base.clone()
        post_divide(x, got, factor, accumulate=accumulate)
        post_divide_ref(x, ref, factor, accumulate=accumulate)
        assert_same(got, ref)
    rows = [x[: 6 * 5].view(6, 5), x[30:]]
    assert_same(chunk_cat(rows, 2, factor=factor), chunk_cat_ref(rows, 2, factor=factor))


@pytest.mark.parametrize("factor", EDGE_FACTORS, ids=lambda f: f"f{f:g}")
def test_divide_edge_values_exact(factor):
    _check_divide_edges_exact(DEVICE, 301, factor)


@pytest.mark.gpu
@pytest.mark.parametrize("factor", EDGE_FACTORS, ids=lambda f: f"f{f:g}")
def test_gpu_divide_edge_values_exact(factor):
    _check_divide_edges_exact("cuda", (1 << 20) + 3, factor)


# ------------------------------------------------------------------ the trusted launches


@pytest.mark.parametrize("n", SIZES, ids=lambda n: f"n{n}")
@pytest.mark.parametrize("factor", [1.0, 3.0, 0.5], ids=lambda f: f"f{f:g}")
@pytest.mark.parametrize("pair", [("bf16", "fp32"), ("fp32", "fp32"), ("fp16", "bf16")], ids="->".join)
def test_unchecked_reduce_path_matches_reference(pair, factor, n):
    # The runtime's sequence: pre-divide one flat gradient into a padded buffer, then post-divide a slice of it
    # into the sharded gradient, writing then accumulating; checked once, launched unchecked.
    gd, rd = DTYPES[pair[0]], DTYPES[pair[1]]
    pad = (-n) % 4 + 3
    grad = randn(n, gd)
    rs_in = poisoned((n + pad,), rd, DEVICE)
    check_pre_divide_pad(grad, rs_in, factor)
    assert pre_divide_pad_unchecked(grad, rs_in, factor) is rs_in
    assert_same(rs_in, pre_divide_pad_ref(grad, poisoned((n + pad,), rd, DEVICE), factor))
    assert_positive_zero(rs_in[n:])
    shard = rs_in[: (n + pad) // 2]
    dest = poisoned(shard.shape, torch.float32, DEVICE)
    check_post_divide(shard, dest, factor)
    post_divide_unchecked(shard, dest, factor)
    assert_same(dest, post_divide_ref(shard, poisoned(shard.shape, torch.float32, DEVICE), factor))
    before = dest.clone()
    post_divide_unchecked(shard, dest, factor, accumulate=True)
    assert_same(dest, post_divide_ref(shard, before, factor, accumulate=True))


def test_checks_are_the_public_forms_checks():
    g = randn(10, torch.float32)
    with pytest.raises(ValueError, match=r"out.numel\(\)=9 < required 10"):
        check_pre_divide_pad(g, torch.empty(9, device=DEVICE), 2.0)
    with pytest.raises(ValueError, match="divide factor must be a finite number > 0"):
        check_pre_divide_pad(g, torch.empty(12, device=DEVICE), float("inf"))
    with pytest.raises(ValueError, match="same size"):
        check_post_divide(g, torch.empty(11, device=DEVICE), 2.0)
    with pytest.raises(ValueError, match="not contiguous"):
        check_post_divide(randn(20, torch.float32)[::2], torch.empty(10, device=DEVICE), 2.0)
    assert check_pre_divide_pad(g, torch.empty(12, device=DEVICE), 2) == ([g], 10, 2.0)

