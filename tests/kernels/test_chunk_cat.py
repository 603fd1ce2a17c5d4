"""chunk_cat against torch._chunk_cat, its reference and plain PyTorch.

On CPU the Triton kernel runs under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1).
"""

from __future__ import annotations

import pytest
import torch

from shardfuse.kernels import _chunk_cat, _crossover
from shardfuse.kernels._chunk_cat import chunk_cat, chunk_cat_ref
from tests._asserts import assert_same
from tests.conftest import cuda_kernels, kernel_device, poisoned

DEVICE = kernel_device()
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_PAIRS = [(a, b) for a in DTYPES for b in DTYPES]
# 3-D, 1-D, dim0 not divisible by most world sizes, dim0 < world size, a prime length past one block.
MIXED_SHAPES = [(5, 3, 2), (7,), (2, 3), (131,), (1, 4), (4099,)]


def randn(shape, dtype):
    return (torch.randn(shape, device=DEVICE) * 4).to(dtype)


def scaled_chunk_cat(tensors, ws, factor, dtype):
    """Plain PyTorch: torch._chunk_cat, then fp32 true division, then the cast."""
    x = torch._chunk_cat(tensors, 0, ws).float()
    return (x / torch.tensor(factor, device=x.device)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ws", range(1, 9), ids=lambda w: f"ws{w}")
def test_matches_torch_chunk_cat(ws, dtype):
    tensors = [randn(s, DTYPES[dtype]) for s in MIXED_SHAPES]
    expected = torch._chunk_cat(tensors, 0, ws)
    # A pure copy (no factor, no cast): exact even under the interpreter.
    assert torch.equal(chunk_cat(tensors, ws), expected)
    assert torch.equal(chunk_cat_ref(tensors, ws), expected)


@pytest.mark.parametrize("n", [1, 7, 131, 4099], ids=lambda n: f"n{n}")
@pytest.mark.parametrize("ws", range(1, 9), ids=lambda w: f"ws{w}")
def test_single_1d(ws, n):
    t = randn(n, torch.float32)
    out = poisoned((ws, -(-n // ws)), torch.float32, DEVICE)
    assert chunk_cat([t], ws, out=out) is out
    assert torch.equal(out, torch._chunk_cat([t], 0, ws))


@pytest.mark.parametrize("ws", [1, 3, 5, 8], ids=lambda w: f"ws{w}")
@pytest.mark.parametrize("factor", [1.0, 2.0, 3.0, 0.5], ids=lambda f: f"f{f:g}")
@pytest.mark.parametrize("pair", DTYPE_PAIRS, ids=lambda p: f"{p[0]}->{p[1]}")
def test_factor_and_cast(pair, factor, ws):
    src, dst = DTYPES[pair[0]], DTYPES[pair[1]]
    tensors = [randn(s, src) for s in MIXED_SHAPES[:5]]
    row = sum(-(-(s[0]) // ws) * (torch.Size(s).numel() // s[0]) for s in MIXED_SHAPES[:5])
    out = poisoned((ws, row), dst, DEVICE)
    chunk_cat(tensors, ws, factor=factor, out=out)
    assert_same(out, scaled_chunk_cat(tensors, ws, factor, dst))
    assert_same(out, chunk_cat_ref(tensors, ws, factor=factor, dtype=dst))
    # dtype= without out allocates the right thing
    assert_same(chunk_cat(tensors, ws, factor=factor, dtype=dst), out)


def test_padding_exactly_zero_and_every_element_written():
    tensors = [randn((2, 3), torch.float32), randn((5,), torch.float32)]  # ws=4: dim0 < ws and uneven
    out = poisoned((4, 3 + 2), torch.float16, DEVICE)
    chunk_cat(tensors, 4, factor=3.0, out=out)
    assert not out.isnan().any(), "an output element was never written"
    # rows 2, 3 of tensor 0 and row 3 of tensor 1 are padding: +0 bit patterns
    assert torch.equal(out[2:, :3].view(torch.int16), torch.zeros(2, 3, dtype=torch.int16, device=DEVICE))
    assert torch.equal(out[3:, 3:].view(torch.int16), torch.zeros(1, 2, dtype=torch.int16, device=DEVICE))
    assert_same(out, scaled_chunk_cat(tensors, 4, 3.0, torch.float16))


def test_zero_dim_and_empty_tensors():
    # torch._chunk_cat rejects empty tensors and crashes on 0-dim ones; here a 0-dim tensor is shape (1,)
    # and an empty one contributes nothing.
    scalar, a, b = randn((), torch.float32), randn((5,), torch.float32), randn((0, 3), torch.float32)
    empty_rest = randn((3, 0), torch.float32)
    out = chunk_cat([scalar, b, a, empty_rest], 2, factor=2.0)
    expected = scaled_chunk_cat([scalar.reshape(1), a], 2, 2.0, torch.float32)
    assert torch.equal(out, expected)
    assert torch.equal(chunk_cat_ref([scalar, b, a, empty_rest], 2, factor=2.0), expected)
    assert torch.equal(chunk_cat([b, a], 2), torch._chunk_cat([a], 0, 2))  # empty first tensor
    assert chunk_cat([b], 3).shape == (3, 0)


def test_non_contiguous_inputs():
    t = randn((6, 7), torch.bfloat16).t()  # (7, 6), not contiguous
    u = randn((9, 4), torch.bfloat16)[:, ::2]
    assert not t.is_contiguous() and not u.is_contiguous()
    assert torch.equal(chunk_cat([t, u], 3), torch._chunk_cat([t, u], 0, 3))


def test_nan_inf_propagate():
    t = randn((11, 3), torch.float32)
    t[0, 0], t[5, 1], t[10, 2] = float("nan"), float("inf"), float("-inf")
    out = chunk_cat([t], 4, factor=3.0, dtype=torch.float16)
    assert_same(out, scaled_chunk_cat([t], 4, 3.0, torch.float16))
    assert out.isnan().sum() == 1 and out.isinf().sum() == 2


def test_out_slice_view_guards_untouched():
    tensors = [randn((7, 2), torch.float32), randn((3,), torch.float32)]
    ws, row = 3, 3 * 2 + 1
    buf = torch.full((ws * row + 10,), -77.0, device=DEVICE)
    out = buf[5 : 5 + ws * row].view(ws, row)  # contiguous but unaligned
    out.fill_(float("nan"))
    chunk_cat(tensors, ws, factor=2.0, out=out)
    assert_same(out, scaled_chunk_cat(tensors, ws, 2.0, torch.float32))
    assert (buf[:5] == -77.0).all() and (buf[5 + ws * row :] == -77.0).all(), "guard elements were overwritten"


def test_errors():
    t = randn((4, 2), torch.float32)
    with pytest.raises(TypeError, match="sequence of tensors.*wrap it in a list"):
        chunk_cat(t, 2)
    with pytest.raises(ValueError, match="empty list"):
        chunk_cat([], 2)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="world_size >= 1"):
            chunk_cat([t], bad)
    for bad in (0.0, -2.0, float("inf")):
        with pytest.raises(ValueError, match="finite number > 0"):
            chunk_cat([t], 2, factor=bad)
    with pytest.raises(TypeError, match=r"tensors\[1\] is a float"):
        chunk_cat([t, 1.0], 2)
    with pytest.raises(TypeError, match=r"tensors\[0\] has unsupported dtype torch.int64"):
        chunk_cat([torch.arange(4, device=DEVICE)], 2)
    with pytest.raises(TypeError, match="one dtype"):
        chunk_cat([t, t.half()], 2)
    with pytest.raises(TypeError, match="dtype=torch.float16 but out.dtype=torch.float32"):
        chunk_cat([t], 2, dtype=torch.float16, out=torch.empty(2, 4, device=DEVICE))
    with pytest.raises(TypeError, match="output dtype torch.int32"):
        chunk_cat([t], 2, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"shape \(2, 5\), expected \(world_size, row_numel\)=\(2, 4\)"):
        chunk_cat([t], 2, out=torch.empty(2, 5, device=DEVICE))
    with pytest.raises(ValueError, match="out must be contiguous"):
        chunk_cat([t], 2, out=torch.empty(4, 2, device=DEVICE).t())
    with pytest.raises(ValueError, match="one device"):
        chunk_cat([t], 2, out=torch.empty(2, 4, device="meta"))


# ------------------------------------------------------------------ overlapping memory, argument types


def test_out_overlapping_an_input_raises():
    buf = randn(64, torch.float32)
    before = buf.clone()
    with pytest.raises(ValueError, match=r"chunk_cat: tensors\[0\] and out overlap in memory .*apart from the inputs"):
        chunk_cat([buf[:16].view(4, 4)], 2, out=buf[8:24].view(2, 8))
    with pytest.raises(ValueError, match=r"tensors\[1\] and out overlap"):
        chunk_cat_ref([randn(3, torch.float32), buf[30:33]], 3, out=buf[32:38].view(3, 2))
    assert torch.equal(buf, before), "an overlapping call wrote before it raised"


def test_argument_types():
    t = randn((4, 2), torch.float32)
    for bad in (2.5, "2", None):
        with pytest.raises(ValueError, match=rf"chunk_cat needs an integer world_size >= 1, got world_size={bad!r}"):
            chunk_cat([t], bad)
    for bad in (True, "2", None, float("nan")):
        with pytest.raises(ValueError, match=r"the divide factor must be a finite number > 0, got factor="):
            chunk_cat([t], 2, factor=bad)
    with pytest.raises(TypeError, match=r"out is a int, not a torch.Tensor"):
        chunk_cat([t], 2, out=3)
    with pytest.raises(TypeError, match=r"dtype must be a torch.dtype or None, got 'bf16'"):
        chunk_cat([t], 2, dtype="bf16")


# ------------------------------------------------------------------ PyTorch past the crossover


@pytest.fixture
def torch_path(monkeypatch):
    """Every call that may take torch._chunk_cat does (and the kernel may not run there)."""
    monkeypatch.setattr(_chunk_cat, "TORCH_MIN_TENSORS", 2)
    monkeypatch.setattr(_chunk_cat, "TORCH_MAX_OUT_BYTES_PER_TENSOR", 1 << 62)
    calls = []
    real = torch._chunk_cat

    def spy(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_chunk_cat", spy)
    return calls


@pytest.mark.parametrize("ws", [1, 3, 8], ids=lambda w: f"ws{w}")
@pytest.mark.parametrize("factor", [1.0, 4.0, 0.5], ids=lambda f: f"f{f:g}")
@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_branch_matches_reference(torch_path, dtype, factor, ws):
    tensors = [randn(s, DTYPES[dtype]) for s in MIXED_SHAPES] + [randn((6, 5), DTYPES[dtype]).t()]  # one strided
    expected = chunk_cat_ref(tensors, ws, factor=factor)
    out = poisoned(expected.shape, expected.dtype, DEVICE)
    assert chunk_cat(tensors, ws, factor=factor, out=out) is out
    assert torch.equal(out, expected)  # exact: PyTorch's copy, then a multiply by an exact power of two
    assert torch.equal(chunk_cat(tensors, ws, factor=factor), expected)
    assert len(torch_path) == 2


def test_torch_branch_only_where_the_bits_are_the_same(torch_path):
    tensors = [randn(s, torch.bfloat16) for s in MIXED_SHAPES]
    assert_same(chunk_cat(tensors, 4, factor=3.0), chunk_cat_ref(tensors, 4, factor=3.0))  # not a power of two
    assert_same(chunk_cat(tensors, 4, dtype=torch.float32), chunk_cat_ref(tensors, 4, dtype=torch.float32))  # a cast
    assert torch_path == []
    # PyTorch rejects empty and 0-dim tensors: the kernel path takes them, with the same result.
    odd = [randn((0, 3), torch.float32), randn((), torch.float32), randn(5, torch.float32)]
    assert torch.equal(chunk_cat(odd, 2, factor=2.0), chunk_cat_ref(odd, 2, factor=2.0))


def test_torch_branch_keeps_clear_errors(torch_path):
    t = randn((4, 2), torch.float32)
    out = poisoned((2, 5), torch.float32, DEVICE)
    with pytest.raises(ValueError, match=r"shape \(2, 5\), expected \(world_size, row_numel\)=\(2, 8\)"):
        chunk_cat([t, t], 2, out=out)
    assert out.shape == (2, 5) and out.isnan().all(), "the wrong-shaped out was resized or written"
    with pytest.raises(TypeError, match=r"tensors\[1\] is a float"):
        chunk_cat([t, 1.0], 2)
    with pytest.raises(TypeError, match="one dtype"):
        chunk_cat([t, t.half()], 2)
    with pytest.raises(ValueError, match="out must be contiguous"):
        chunk_cat([t, t], 2, out=torch.empty(8, 2, device=DEVICE).t())


def test_torch_branch_sizes_a_buffer_of_its_own(monkeypatch, torch_path):
    """The branch runs PyTorch's out= variant (the functional call costs a pass more over the tensors) into an empty
    buffer of its own: never the caller's out, never a resize warning for a wrong-shaped out."""
    import warnings

    seen = []
    spy = torch._chunk_cat
    monkeypatch.setattr(torch, "_chunk_cat", lambda *a, **k: seen.append(k.get("out")) or spy(*a, **k))
    tensors = [randn(s, torch.float32) for s in MIXED_SHAPES]
    expected = chunk_cat_ref(tensors, 4, factor=2.0)
    out = poisoned(expected.shape, expected.dtype, DEVICE)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert chunk_cat(tensors, 4, factor=2.0, out=out) is out and torch.equal(out, expected)
        wrong = poisoned((4, expected.shape[1] + 3), torch.float32, DEVICE)
        with pytest.raises(ValueError, match="expected \\(world_size, row_numel\\)"):
            chunk_cat(tensors, 4, factor=2.0, out=wrong)
    assert len(seen) == 2 and all(isinstance(b, torch.Tensor) and b is not out and b is not wrong for b in seen)
    assert wrong.isnan().all()


def test_use_torch_chunk_cat_decision(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    n = _chunk_cat.TORCH_MIN_TENSORS
    per_tensor = _chunk_cat.TORCH_MAX_OUT_BYTES_PER_TENSOR
    t = torch.zeros(8, dtype=torch.bfloat16)
    small = torch.empty(n * per_tensor // 2 - 2, dtype=torch.bfloat16)  # just under the bytes per tensor
    big = torch.empty(n * per_tensor // 2, dtype=torch.bfloat16)
    decide = _chunk_cat.use_torch_chunk_cat
    assert decide([t] * n, 4.0, None, None) and decide([t] * n, 4.0, torch.bfloat16, small)
    assert not decide([t] * (n - 1), 4.0, None, None)  # too few tensors
    assert not decide([t] * n, 4.0, None, big)  # enough bytes per tensor: the kernel is faster
    assert not decide([t] * n, 3.0, None, None)  # division by 3 is not a multiplication
    assert not decide([t] * n, 4.0, torch.float32, None)  # a cast
    assert not decide([t] * n, "x", None, None)  # a bad factor: the validating path names it
    assert not decide([t.int()] * n, 4.0, None, None)
    # Enough bytes per tensor, but the device's measured crossover sends the call to PyTorch at 2 x out's bytes
    # (an upper bound of what it moves): PyTorch, without the plan's per-tensor work.
    big_bytes = big.numel() * big.element_size()
    with _crossover.override({"chunk_cat": _crossover.Crossover(min_bytes=2 * big_bytes + 1)}, kind="cpu"):
        assert decide([t] * n, 4.0, None, big)
    with _crossover.override({"chunk_cat": _crossover.Crossover(min_bytes=2 * big_bytes)}, kind="cpu"):
        assert not decide([t] * n, 4.0, None, big)  # the kernel at the bound: judged on the true size later
    with _crossover.override({"chunk_cat": "torch"}, kind="cpu"):
        assert decide([t] * n, 4.0, None, big) and not decide([t] * (n - 1), 4.0, None, big)
        assert not decide([t] * n, 3.0, None, big)  # still only where PyTorch computes the same bits
        # no division: the branch's buffer would cost a copy more than the plan's torch._chunk_cat(out=)
        assert not decide([t] * n, 1.0, None, big) and decide([t] * n, 1.0, None, small)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not decide([t] * n, 4.0, None, None)  # CPU tensors without the interpreter: the reference


# ------------------------------------------------------------------ GPU: large, exact, one launch


@pytest.mark.gpu
@pytest.mark.parametrize("ws", [2, 3, 8], ids=lambda w: f"ws{w}")
@pytest.mark.parametrize("pair", DTYPE_PAIRS, ids=lambda p: f"{p[0]}->{p[1]}")
def test_gpu_exact_one_launch(pair, ws, triton_path):
    src, dst = DTYPES[pair[0]], DTYPES[pair[1]]
    shapes = [(4096, 1024), (4099, 3), (1000,), (7, 5, 3), (1,), (2048,)]  # aligned and unaligned layouts
    tensors = [torch.randn(s, device="cuda").mul_(1000).to(src) for s in shapes]
    out = chunk_cat(tensors, ws, factor=3.0, dtype=dst)
    torch.testing.assert_close(out, chunk_cat_ref(tensors, ws, factor=3.0, dtype=dst), rtol=0, atol=0)
    if src == dst:
        assert torch.equal(chunk_cat(tensors, ws), torch._chunk_cat(tensors, 0, ws))
    assert len(cuda_kernels(lambda: chunk_cat(tensors, ws, factor=3.0, out=out))) == 1


@pytest.mark.gpu
def test_gpu_thousands_of_tensors_one_launch(triton_path):
    gen = torch.Generator().manual_seed(0)
    dims = torch.randint(1, 64, (3000, 2), generator=gen).tolist()
    tensors = [torch.randn(d, device="cuda") for d in dims] + [torch.randn(1 << 20, device="cuda")]
    out = chunk_cat(tensors, 8, factor=2.0, dtype=torch.bfloat16)
    torch.testing.assert_close(out, chunk_cat_ref(tensors, 8, factor=2.0, dtype=torch.bfloat16), rtol=0, atol=0)
    assert len(cuda_kernels(lambda: chunk_cat(tensors, 8, factor=2.0, out=out))) == 1


@pytest.mark.gpu
def test_gpu_past_the_crossover_is_torch_and_bit_exact():
    num = 2 * _chunk_cat.TORCH_MIN_TENSORS
    tensors = [torch.randn(7 + i % 5, 33, device="cuda").to(torch.bfloat16) for i in range(num)]
    expected = chunk_cat_ref(tensors, 8, factor=4.0)
    out = poisoned(expected.shape, torch.bfloat16, "cuda")
    assert _chunk_cat.use_torch_chunk_cat(tensors, 4.0, None, out)
    names = cuda_kernels(lambda: chunk_cat(tensors, 8, factor=4.0, out=out))
    assert not any("_chunk_cat_kernel" in n for n in names), names
    assert torch.equal(out, expected)


@pytest.mark.gpu
def test_gpu_many_big_tensors_below_the_size_crossover_skip_the_plan():
    """Many tensors of enough bytes each, where the GPU's rule says PyTorch: no kernel and no plan, exact."""
    num = _chunk_cat.TORCH_MIN_TENSORS
    rows = _chunk_cat.TORCH_MAX_OUT_BYTES_PER_TENSOR // (2 * 256) + 8  # bf16 rows of 256: past the per-tensor bytes
    tensors = [torch.randn(rows + i % 3, 256, device="cuda").to(torch.bfloat16) for i in range(num)]
    expected = chunk_cat_ref(tensors, 8, factor=4.0)
    out = poisoned(expected.shape, torch.bfloat16, "cuda")
    with _crossover.override({"chunk_cat": "torch"}):
        assert _chunk_cat.use_torch_chunk_cat(tensors, 4.0, None, out)
        names = cuda_kernels(lambda: chunk_cat(tensors, 8, factor=4.0, out=out))
    assert not any("_chunk_cat_kernel" in n for n in names), names
    assert torch.equal(out, expected)
    with _crossover.override({"chunk_cat": "triton"}):
        assert not _chunk_cat.use_torch_chunk_cat(tensors, 4.0, None, out)
