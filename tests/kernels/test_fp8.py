"""The float8 shard cast (shardfuse.kernels._fp8): per-tensor amax, torchao's tensorwise scale and the saturated
float8_e4m3fn cast into a flat buffer, against the plain-PyTorch references and against torchao itself.

On CPU the kernels run under Triton's interpreter (tests/conftest.py); the float8 rounding is written out on the
bit pattern, so the bytes must equal the reference's there too. Tests against torchao skip without it
(``pip install torchao==0.18.0``); the reference tests do not need it.
"""

from __future__ import annotations

import pytest
import torch

from shardfuse.kernels import _fp8
from shardfuse.kernels._common import clear_plan_caches
from shardfuse.kernels._fp8 import (
    FP8_DTYPE,
    amax_to_scale,
    cast_fp8_shards,
    cast_fp8_shards_ref,
    fp8_amax,
    fp8_amax_ref,
)
from tests._asserts import assert_bits
from tests.conftest import kernel_device

DEVICE = kernel_device()
SIZES = [0, 1, 2, 7, 131, 4099, 8192, 65537]  # empty, one, primes, one block, past several blocks
SRC_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def fresh(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values over many binades (subnormal float8 results, saturation and ties among them)."""
    x = torch.randn(n, device=DEVICE) * torch.exp2(torch.randint(-24, 16, (n,), device=DEVICE).float())
    return x.to(dtype)


def poisoned_fp8(n: int) -> torch.Tensor:
    """A float8 buffer full of NaN (0x7f), so any byte the kernel forgets to write shows."""
    return torch.full((n,), 0x7F, dtype=torch.uint8, device=DEVICE).view(FP8_DTYPE)


def fp8_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


@pytest.mark.parametrize("src", list(SRC_DTYPES))
def test_cast_matches_reference_bytes(src):
    srcs = [fresh(k, SRC_DTYPES[src]) for k in SIZES]
    srcs[4][3], srcs[4][9] = float("nan"), -float("nan")
    srcs[5][:4] = torch.tensor([0.0, -0.0, float("inf"), -float("inf")])
    scales = torch.rand(len(srcs), device=DEVICE) * 4096 + 1e-3  # scales that push some values past 448
    total = sum(SIZES)
    out = cast_fp8_shards(srcs, scales, poisoned_fp8(total))
    ref = cast_fp8_shards_ref(srcs, scales, poisoned_fp8(total))
    assert torch.equal(fp8_bytes(out), fp8_bytes(ref))
    # Saturation kept ±inf at ±448, NaN stayed NaN (its sign after `* scale` is the hardware's; the bytes above
    # already equal the reference's).
    start = sum(SIZES[:5])
    assert fp8_bytes(out)[start : start + 4].tolist() == [0x00, 0x80, 0x7E, 0xFE]
    nan_at = sum(SIZES[:4])
    assert fp8_bytes(out)[nan_at + 3] & 0x7F == 0x7F and fp8_bytes(out)[nan_at + 9] & 0x7F == 0x7F


def test_cast_every_fp32_bit_pattern_class():
    # Random 32-bit patterns (normals, subnormals, NaNs of both signs), and exact ties between float8 values.
    bits = torch.randint(-(2**31), 2**31 - 1, (1 << 16,), dtype=torch.int32, device=DEVICE)
    x = bits.view(torch.float32)
    ties = torch.arange(-4096, 4096, device=DEVICE, dtype=torch.float32) / 1024  # 2**-10 steps: ties at 2**-9
    srcs = [x, ties, ties * 37]
    scales = torch.tensor([1.0, 1.0, 1.0], device=DEVICE)
    total = sum(s.numel() for s in srcs)
    out = cast_fp8_shards(srcs, scales, poisoned_fp8(total))
    assert torch.equal(fp8_bytes(out), fp8_bytes(cast_fp8_shards_ref(srcs, scales, poisoned_fp8(total))))
    # Against PyTorch's own cast without the scale's multiply: the same bytes wherever the input is a number; a
    # NaN stays a NaN (its sign may not survive the multiply on a GPU, which canonicalises NaNs).
    flat = torch.cat(srcs)
    expected = flat.clamp(-448, 448).to(FP8_DTYPE)
    number = ~flat.isnan()
    assert torch.equal(fp8_bytes(out)[number], fp8_bytes(expected)[number])
    assert bool(((fp8_bytes(out)[~number] & 0x7F) == 0x7F).all()) and int((~number).sum()) > 0


def test_cast_with_offsets_leaves_gaps_and_takes_uint8():
    srcs = [fresh(k) for k in (7, 0, 4099, 1, 131)]
    offsets = [100, 3, 4300, 0, 8500]
    scales = amax_to_scale(fp8_amax(srcs))
    out = torch.full((8700,), 0x7F, dtype=torch.uint8, device=DEVICE)  # uint8 view of an all-gather buffer
    cast_fp8_shards(srcs, scales, out, offsets=offsets)
    written = torch.zeros(8700, dtype=torch.bool, device=DEVICE)
    for s, o in zip(srcs, offsets):
        written[o : o + s.numel()] = True
    assert (out[~written] == 0x7F).all(), "bytes outside the destination ranges were written"
    ref = cast_fp8_shards_ref(srcs, scales, poisoned_fp8(8700), offsets=offsets)
    assert torch.equal(out, fp8_bytes(ref))


def test_cast_plan_is_reused_and_reads_new_values():
    clear_plan_caches()
    srcs = [fresh(k) for k in (5, 4099)]
    out = poisoned_fp8(4104)
    scales = torch.tensor([3.0, 0.5], device=DEVICE)
    cast_fp8_shards(srcs, scales, out)
    assert len(_fp8._CAST_PLANS) == 1
    for s in srcs:
        s.copy_(fresh(s.numel()))
    scales.copy_(torch.tensor([0.25, 7.0]))
    cast_fp8_shards(srcs, scales, out)
    assert len(_fp8._CAST_PLANS) == 1
    assert torch.equal(fp8_bytes(out), fp8_bytes(cast_fp8_shards_ref(srcs, scales, poisoned_fp8(4104))))


def test_cast_plan_table_kept_when_out_and_scales_move(monkeypatch):
    # A gather buffer freed and allocated again every step comes back elsewhere: the table (the sources' addresses
    # and offsets) is reused, no new one built; an out that moved onto a source is still refused.
    from shardfuse.kernels import _common

    clear_plan_caches()
    built = []
    real = _common.block_table
    monkeypatch.setattr(_common, "block_table", lambda *a, **k: built.append(1) or real(*a, **k))
    srcs = [fresh(k) for k in (7, 4099, 130)]
    offsets = [0, 16, 4120]
    for _ in range(4):
        out, scales = poisoned_fp8(4300), torch.rand(3, device=DEVICE) * 4 + 0.25
        cast_fp8_shards(srcs, scales, out, offsets=offsets)
        want = cast_fp8_shards_ref(srcs, scales, poisoned_fp8(4300), offsets=offsets)
        assert torch.equal(fp8_bytes(out), fp8_bytes(want))
    assert len(built) == 1, f"{len(built)} tables built for the same sources"
    buf = torch.zeros(8192, device=DEVICE)
    srcs = [buf[:7], buf[16:4115]]
    cast_fp8_shards(srcs, torch.ones(2, device=DEVICE), poisoned_fp8(4200), offsets=[0, 16])
    with pytest.raises(ValueError, match="overlap"):
        cast_fp8_shards(srcs, torch.ones(2, device=DEVICE), buf.view(torch.uint8)[100:4300].view(FP8_DTYPE),
                        offsets=[0, 16])


@pytest.mark.parametrize("src", list(SRC_DTYPES))
def test_amax_matches_reference(src):
    srcs = [fresh(k, SRC_DTYPES[src]) for k in SIZES]
    srcs[3][1] = -float("nan")
    srcs[6][:] = -srcs[6].abs()  # all negative: amax is |min|
    out = torch.full((len(srcs),), float("nan"), device=DEVICE)
    assert fp8_amax(srcs, out) is out
    ref = fp8_amax_ref(srcs)
    assert_bits(out, ref)
    assert out[0] == 0 and out[3].isnan() and out[6] == srcs[6].float().abs().max()
    assert_bits(fp8_amax(srcs), ref)  # the cached plan, a fresh out


def test_amax_to_scale_is_torchaos_formula():
    amax = torch.cat([fresh(1000).abs(), torch.tensor([0.0, 1e-13, 1e-12, 448.0, 3e38], device=DEVICE)])
    got = amax_to_scale(amax)
    for a, s in zip(amax.tolist(), got.tolist()):
        # float64 division, then one rounding to float32 (the value torch.tensor(..., float32) takes)
        assert s == torch.tensor(448.0 / max(a, 1e-12), dtype=torch.float32).item()


def test_errors():
    x = fresh(8)
    out = poisoned_fp8(8)
    with pytest.raises(ValueError, match=r"scales must be a contiguous float32 tensor of len\(srcs\)=1"):
        cast_fp8_shards([x], torch.ones(2, device=DEVICE), out)
    with pytest.raises(ValueError, match=r"out must be a contiguous torch.float8_e4m3fn \(or uint8\) buffer"):
        cast_fp8_shards([x], torch.ones(1, device=DEVICE), torch.empty(8, device=DEVICE))
    with pytest.raises(ValueError, match=r"out is too small: out.numel\(\)=8 < required 12"):
        cast_fp8_shards([x], torch.ones(1, device=DEVICE), out, offsets=[4])
    with pytest.raises(ValueError, match="destination ranges overlap"):
        cast_fp8_shards([x, x], torch.ones(2, device=DEVICE), poisoned_fp8(20), offsets=[0, 4])
    with pytest.raises(ValueError, match=r"srcs\[0\] must be contiguous"):
        fp8_amax([torch.randn(4, 4, device=DEVICE).t()])
    with pytest.raises(ValueError, match="fp8_amax out must be a contiguous float32 tensor of 1 elements"):
        fp8_amax([x], torch.empty(2, device=DEVICE))


# ------------------------------------------------------------------ against torchao itself


def _torchao_utils():
    return pytest.importorskip("torchao.float8.float8_utils", reason="torchao is not installed")


@pytest.mark.parametrize("src", list(SRC_DTYPES))
def test_same_bytes_as_torchao(src):
    utils = _torchao_utils()
    training = pytest.importorskip("torchao.float8.float8_training_tensor")
    srcs = [fresh(k, SRC_DTYPES[src]) for k in SIZES if k]
    scales = amax_to_scale(fp8_amax(srcs))
    total = sum(s.numel() for s in srcs)
    out = cast_fp8_shards(srcs, scales, poisoned_fp8(total))
    pos = 0
    for i, s in enumerate(srcs):
        scale = utils.tensor_to_scale(s, FP8_DTYPE)
        assert torch.equal(scale.view(torch.int32), scales[i].view(torch.int32)), (i, scale, scales[i])
        fp8 = training.hp_tensor_and_scale_to_float8(s, scale, FP8_DTYPE)
        assert torch.equal(fp8_bytes(out[pos : pos + s.numel()]), fp8_bytes(fp8._data.reshape(-1)))
        pos += s.numel()


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1 << 24, (1 << 24) + 3])
def test_gpu_large_exact_and_one_launch(n):
    from tests.conftest import cuda_kernels

    sizes = [n // 16 + i for i in range(16)]
    srcs = [fresh(k) for k in sizes]
    amax = fp8_amax(srcs)
    assert_bits(amax, fp8_amax_ref(srcs))
    scales = amax_to_scale(amax)
    out = poisoned_fp8(sum(sizes))
    cast_fp8_shards(srcs, scales, out)
    assert torch.equal(fp8_bytes(out), fp8_bytes(cast_fp8_shards_ref(srcs, scales, poisoned_fp8(sum(sizes)))))
    names = cuda_kernels(lambda: cast_fp8_shards(srcs, scales, out))
    assert len(names) == 1 and "_cast_fp8_kernel" in names[0], names
