"""The shard cast kernel (``cast_shard``, and ``cast_shard_unchecked``, the trusted launch the sharding runtime
calls) against the reference and ``Tensor.to``.

On CPU the Triton kernels run under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1); on a
GPU the same tests run on CUDA tensors, and the ``gpu``-marked ones add large, >2^31 and launch-count checks.
"""

from __future__ import annotations

import pytest
import torch

from shardfuse.kernels._cast import cast_shard, cast_shard_ref, cast_shard_unchecked, check_cast_shard
from tests._asserts import assert_bits, max_ulp
from tests.conftest import cuda_kernels, kernel_device, poisoned

DEVICE = kernel_device()
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PAIRS = [(a, b) for a in DTYPES for b in DTYPES]
SIZES = [0, 1, 7, 131, 4099]  # 4099 > one 4096-element block


def pair_id(pair: tuple[str, str]) -> str:
    return f"{pair[0]}->{pair[1]}"


def fresh(n: int, dtype: torch.dtype, device: str = DEVICE) -> torch.Tensor:
    """Random values over many binades (exercises rounding), drawn in fp32 and stored as ``dtype``."""
    x = torch.randn(n, device=device) * torch.exp2(torch.randint(-12, 12, (n,), device=device).float())
    return x.to(dtype)



# ------------------------------------------------------------------ cast_shard


@pytest.mark.parametrize("n", SIZES, ids=lambda n: f"n{n}")
@pytest.mark.parametrize("pair", PAIRS, ids=pair_id)
def test_cast_shard_matches_to(pair, n):
    src_dt, dst_dt = DTYPES[pair[0]], DTYPES[pair[1]]
    src = fresh(n, src_dt)
    out = poisoned((n,), dst_dt, DEVICE)
    assert cast_shard(src, out) is out
    ulp = max_ulp(src_dt, dst_dt)
    assert_bits(out, src.to(dst_dt), ulp)
    assert_bits(out, cast_shard_ref(src, poisoned((n,), dst_dt, DEVICE)), ulp)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # numpy, under the interpreter
@pytest.mark.parametrize("pair", PAIRS, ids=pair_id)
def test_cast_shard_nan_inf_propagate(pair):
    src_dt, dst_dt = DTYPES[pair[0]], DTYPES[pair[1]]
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1e5, -7e4, 1e-8, 3e38])
    src = torch.cat([specials, torch.randn(57)]).to(src_dt).to(DEVICE)
    out = cast_shard(src, dtype=dst_dt)
    assert out.isnan()[0] and out[1] == float("inf") and out[2] == -float("inf")
    assert_bits(out, src.to(dst_dt), max_ulp(src_dt, dst_dt))


@pytest.mark.parametrize("dst", list(DTYPES), ids=str)
def test_cast_shard_allocates_with_src_shape(dst):
    src = fresh(3 * 43, torch.float32).view(3, 43)
    out = cast_shard(src, dtype=DTYPES[dst])
    assert out.shape == (3, 43) and out.dtype == DTYPES[dst] and out.device == src.device
    assert_bits(out, src.to(DTYPES[dst]), max_ulp(torch.float32, DTYPES[dst]))
    copy = cast_shard(src)  # no out, no dtype: a plain copy in src's dtype
    assert copy.dtype == torch.float32 and copy.data_ptr() != src.data_ptr()
    assert_bits(copy, src)


@pytest.mark.parametrize("n", [1, 131, 4099], ids=lambda n: f"n{n}")
@pytest.mark.parametrize("pair", [("fp32", "bf16"), ("fp32", "fp16"), ("bf16", "fp32")], ids=pair_id)
def test_cast_shard_into_slice_keeps_neighbours(pair, n):
    # out is this rank's part of a bigger all-gather buffer: only its elements may change.
    src_dt, dst_dt = DTYPES[pair[0]], DTYPES[pair[1]]
    buf = poisoned((n + 13,), dst_dt, DEVICE)
    out = buf[5 : 5 + n]
    src = fresh(n, src_dt).view(1, n)  # src of another shape: out only needs the numel
    cast_shard(src, out)
    assert_bits(out, src.view(-1).to(dst_dt), max_ulp(src_dt, dst_dt))
    assert buf[:5].isnan().all() and buf[5 + n :].isnan().all(), "guard elements were overwritten"


def test_cast_shard_cpu_reference_path(monkeypatch):
    # Without the interpreter a CPU tensor takes the PyTorch reference path; results must agree.
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    src = fresh(131, torch.float32, "cpu")
    out = cast_shard(src, poisoned((131,), torch.float16))
    assert_bits(out, src.half())


def test_cast_shard_errors():
    src = fresh(8, torch.float32)
    with pytest.raises(TypeError, match=r"src has unsupported dtype torch.int64"):
        cast_shard(torch.arange(8, device=DEVICE))
    with pytest.raises(TypeError, match=r"out has unsupported dtype torch.int32"):
        cast_shard(src, torch.empty(8, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match=r"all tensors must be on one device.*out=meta"):
        cast_shard(src, torch.empty(8, dtype=torch.bfloat16, device="meta"))
    with pytest.raises(ValueError, match=r"out is too small: out.numel\(\)=7 < required 8"):
        cast_shard(src, torch.empty(7, device=DEVICE))
    with pytest.raises(ValueError, match=r"exactly src.numel\(\) elements: out.numel\(\)=9 src.numel\(\)=8"):
        cast_shard(src, torch.empty(9, device=DEVICE))
    with pytest.raises(ValueError, match=r"out must be contiguous"):
        cast_shard(src, torch.empty(16, device=DEVICE)[::2])
    with pytest.raises(ValueError, match=r"src must be contiguous"):
        cast_shard(fresh(16, torch.float32)[::2])
    with pytest.raises(ValueError, match=r"dtype=torch.float16 does not match out.dtype=torch.bfloat16"):
        cast_shard(src, torch.empty(8, dtype=torch.bfloat16, device=DEVICE), dtype=torch.float16)


def test_cast_shard_overlapping_src_and_out_raises():
    buf = fresh(10010, torch.float32)
    before = buf.clone()
    with pytest.raises(ValueError, match=r"cast_shard: src and out overlap in memory .*same tensor as src and out"):
        cast_shard(buf[:10000], buf[5:10005])
    with pytest.raises(ValueError, match=r"cast_shard: src and out overlap"):  # other dtype from the same byte
        cast_shard(buf[:100], buf[:100].view(torch.bfloat16)[:100])
    with pytest.raises(ValueError, match=r"cast_shard: src and out overlap"):
        cast_shard_ref(buf[:10000], buf[5:10005])
    assert torch.equal(buf, before), "an overlapping call wrote before it raised"


@pytest.mark.parametrize("n", [1, 131, 4099], ids=lambda n: f"n{n}")
def test_cast_shard_in_place_is_allowed(n):
    # The same elements as source and destination: each lane reads then writes its own element.
    buf = fresh(n + 8, torch.float32)
    expected = buf.clone()
    cast_shard(buf[3 : 3 + n], buf[3 : 3 + n])
    assert cast_shard(buf, buf) is buf
    assert_bits(buf, expected)


def test_cast_shard_non_tensor_arguments():
    t = fresh(4, torch.float32)
    with pytest.raises(TypeError, match=r"src is a float, not a torch.Tensor"):
        cast_shard(3.0)
    with pytest.raises(TypeError, match=r"out is a int, not a torch.Tensor"):
        cast_shard(t, 3)
    with pytest.raises(TypeError, match=r"dtype must be a torch.dtype or None, got 'bf16'"):
        cast_shard(t, dtype="bf16")


@pytest.mark.gpu
@pytest.mark.parametrize("pair", PAIRS, ids=pair_id)
def test_gpu_cast_shard_bit_exact_large(pair):
    src_dt, dst_dt = DTYPES[pair[0]], DTYPES[pair[1]]
    n = (1 << 25) + 3
    src = fresh(n, src_dt, "cuda")
    src[:: 1 << 20] = float("nan")
    src[7 :: 1 << 21] = float("inf")
    out = cast_shard(src, poisoned((n,), dst_dt, "cuda"))
    assert_bits(out, src.to(dst_dt))


@pytest.mark.gpu
def test_gpu_cast_shard_past_2_pow_31():
    n = (1 << 31) + 5
    need = 2 * n * 2 + (n + (1 << 30))  # in + out (fp16) + room for the comparison
    if torch.cuda.mem_get_info()[0] < need:
        pytest.skip(f"needs {need / 2**30:.1f} GiB of free GPU memory")
    src = torch.randn(n, dtype=torch.float16, device="cuda")
    out = torch.full((n,), float("nan"), dtype=torch.float16, device="cuda")
    cast_shard(src, out)
    assert torch.equal(out[-4099:], src[-4099:]), "the tail past 2^31 was not copied"
    assert torch.equal(out, src)


@pytest.mark.gpu
def test_gpu_cast_shard_one_launch():
    src = fresh((1 << 20) + 1, torch.float32, "cuda")
    out = torch.empty(src.numel(), dtype=torch.bfloat16, device="cuda")
    names = cuda_kernels(lambda: cast_shard(src, out))
    assert len(names) == 1 and "_cast_shard_kernel" in names[0], names


# ------------------------------------------------------------------ the trusted launch


@pytest.mark.parametrize("n", SIZES, ids=lambda n: f"n{n}")
@pytest.mark.parametrize("pair", PAIRS, ids=pair_id)
def test_cast_shard_unchecked_matches_to(pair, n):
    src_dt, dst_dt = DTYPES[pair[0]], DTYPES[pair[1]]
    src = fresh(n, src_dt)
    out = poisoned((n,), dst_dt, DEVICE)
    assert cast_shard_unchecked(src, out) is out
    assert_bits(out, src.to(dst_dt), max_ulp(src_dt, dst_dt))
    assert_bits(out, cast_shard(src, poisoned((n,), dst_dt, DEVICE)))  # the public form: the same bits


@pytest.mark.parametrize("n", [1, 131, 4099], ids=lambda n: f"n{n}")
def test_cast_shard_unchecked_into_a_gather_slice(n):
    # What the runtime does: this rank's slice of the padded full buffer, the neighbours left alone.
    world_size, rank = 3, 1
    full = poisoned((world_size * n + 2,), torch.bfloat16, DEVICE)
    shard = fresh(n, torch.float32)
    local = full.narrow(0, rank * n, n)
    check_cast_shard(shard, local)  # once, where the buffers are made
    for _ in range(2):  # then every gather, unchecked
        shard.copy_(fresh(n, torch.float32))
        cast_shard_unchecked(shard, local)
        assert_bits(local, shard.to(torch.bfloat16), max_ulp(torch.float32, torch.bfloat16))
    assert full[: rank * n].isnan().all() and full[(rank + 1) * n :].isnan().all(), "neighbours overwritten"


def test_check_cast_shard_is_the_public_forms_check():
    src = fresh(8, torch.float32)
    with pytest.raises(ValueError, match=r"out.numel\(\)=9 src.numel\(\)=8"):
        check_cast_shard(src, torch.empty(9, device=DEVICE))
    with pytest.raises(ValueError, match="must be contiguous"):
        check_cast_shard(fresh(16, torch.float32)[::2], torch.empty(8, device=DEVICE))
    with pytest.raises(TypeError, match="unsupported dtype torch.int32"):
        check_cast_shard(src, torch.empty(8, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="overlap"):
        check_cast_shard(src[:4], src[2:6])
