"""Padding and flattening kernels (``flatten_pad``, ``unflatten_into``) against their references and
``torch.cat`` + ``F.pad`` / ``copy_``.

On CPU the Triton kernels run under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1); on a
GPU the same tests run on CUDA tensors, and the ``gpu``-marked ones add large, >2^31 and launch-count checks.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardfuse.kernels._flatten import (
    _coalesce,
    _is_transposed,
    flatten_pad,
    flatten_pad_ref,
    padded_numel,
    unflatten_into,
    unflatten_into_ref,
)
from tests._asserts import assert_bits, assert_same, max_ulp
from tests.conftest import cuda_kernels, kernel_device, poisoned

DEVICE = kernel_device()
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
WORLD_SIZES = [1, 2, 3, 4, 8]


def assert_positive_zero(t: torch.Tensor) -> None:
    bits = {4: torch.int32, 2: torch.int16}[t.element_size()]
    assert torch.equal(t.view(bits), torch.zeros_like(t.view(bits))), f"padding is not exactly +0: {t}"


def rand(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.randn(*shape, device=DEVICE) * 3).to(dtype)


def tensor_set(name: str) -> list[torch.Tensor]:
    """Inputs for one flatten call: contiguous odd sizes, strided views, or mixed dtypes."""
    if name == "contiguous":
        return [rand(1), rand(7), rand(0), rand(131), rand(4099), rand(3, 5)]
    if name == "strided":
        return [
            rand(7, 5).t(),  # transposed
            rand(40)[1::3],  # sliced with a step
            rand(6, 9)[::2, 1::2],  # 2-D slice with steps
            rand(2, 3, 4, 5).permute(3, 1, 0, 2),  # 4 dims after coalescing
            rand(2, 3, 2, 3, 2).permute(4, 3, 2, 1, 0),  # 5 dims: the .contiguous() fallback
            rand(33, 131).t(),  # > one block, strided
            rand(1, 4, 1, 5)[:, :, :, 1:4],  # size-1 dims dropped when coalescing
        ]
    if name == "mixed":
        return [rand(7, dtype=torch.float16), rand(131, 3).t(), rand(4099, dtype=torch.bfloat16),
                rand(5, 3, dtype=torch.float16).t(), rand(1)]
    raise KeyError(name)


def cat_pad(tensors: list[torch.Tensor], world_size: int, dtype: torch.dtype) -> torch.Tensor:
    """Plain PyTorch: cast each, concatenate, zero-pad to a multiple of world_size."""
    flat = torch.cat([t.reshape(-1).to(dtype) for t in tensors]) if tensors else torch.empty(0, dtype=dtype)
    return F.pad(flat, (0, padded_numel(flat.numel(), world_size) - flat.numel()))


# ------------------------------------------------------------------ padded_numel


@pytest.mark.parametrize(
    "numel, world_size, expected",
    [(0, 1, 0), (0, 8, 0), (1, 1, 1), (1, 8, 8), (7, 3, 9), (8, 8, 8), (9, 8, 16), ((1 << 31) + 1, 2, (1 << 31) + 2)],
    ids=lambda v: str(v),
)
def test_padded_numel(numel, world_size, expected):
    assert padded_numel(numel, world_size) == expected


def test_padded_numel_errors():
    with pytest.raises(ValueError, match=r"needs an integer world_size >= 1, got world_size=0"):
        padded_numel(5, 0)
    with pytest.raises(ValueError, match=r"numel must be >= 0, got numel=-1"):
        padded_numel(-1, 2)


# ------------------------------------------------------------------ flatten_pad


@pytest.mark.parametrize("dst", list(DTYPES), ids=str)
@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=lambda w: f"ws{w}")
@pytest.mark.parametrize("inputs", ["contiguous", "strided", "mixed"], ids=str)
def test_flatten_pad_matches_cat_pad(inputs, world_size, dst):
    dst_dt = DTYPES[dst]
    tensors = tensor_set(inputs)
    total = sum(t.numel() for t in tensors)
    out = poisoned((padded_numel(total, world_size),), dst_dt, DEVICE)
    assert flatten_pad(tensors, world_size, dtype=dst_dt, out=out) is out
    ulp = max_ulp({t.dtype for t in tensors}, dst_dt)
    assert_bits(out, cat_pad(tensors, world_size, dst_dt), ulp)
    assert_bits(out, flatten_pad_ref(tensors, world_size, dtype=dst_dt), ulp)
    assert_positive_zero(out[total:])


@pytest.mark.parametrize("world_size", [1, 3, 8], ids=lambda w: f"ws{w}")
def test_flatten_pad_allocates_in_first_dtype(world_size):
    tensors = [rand(5, 3, dtype=torch.float16).t(), rand(7), rand(2)]
    flat = flatten_pad(tensors, world_size)
    assert flat.dtype == torch.float16 and flat.dim() == 1 and flat.device == tensors[0].device
    assert flat.numel() == padded_numel(24, world_size)
    assert_bits(flat, cat_pad(tensors, world_size, torch.float16))


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # numpy, under the interpreter
@pytest.mark.parametrize("dst", list(DTYPES), ids=str)
def test_flatten_pad_nan_inf_propagate(dst):
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e5, 3e38], device=DEVICE)
    tensors = [rand(4, 3).t(), specials, rand(5, dtype=torch.float16)]
    flat = flatten_pad(tensors, 8, dtype=DTYPES[dst])
    assert flat[12].isnan() and flat[13] == float("inf") and flat[14] == -float("inf")
    assert_bits(flat, cat_pad(tensors, 8, DTYPES[dst]), max_ulp({torch.float32}, DTYPES[dst]))


@pytest.mark.parametrize("world_size", [2, 8], ids=lambda w: f"ws{w}")
def test_flatten_pad_into_slice_keeps_neighbours(world_size):
    tensors = tensor_set("mixed")
    padded = padded_numel(sum(t.numel() for t in tensors), world_size)
    buf = poisoned((padded + 11,), torch.float32, DEVICE)
    out = buf[4 : 4 + padded]
    flatten_pad(tensors, world_size, out=out)  # dtype from out
    assert_bits(out, cat_pad(tensors, world_size, torch.float32))
    assert buf[:4].isnan().all() and buf[4 + padded :].isnan().all(), "guard elements were overwritten"


def test_flatten_pad_200_tiny_tensors():
    sizes = torch.randint(0, 30, (200,)).tolist()
    tensors = [rand(k, dtype=torch.float16) if i % 3 else rand(k, 2).t() for i, k in enumerate(sizes)]
    total = sum(t.numel() for t in tensors)
    out = poisoned((padded_numel(total, 8),), torch.float32, DEVICE)
    flatten_pad(tensors, 8, out=out)
    assert_bits(out, cat_pad(tensors, 8, torch.float32))
    assert_positive_zero(out[total:])


def test_flatten_pad_empty_inputs():
    flat = flatten_pad([], 4, dtype=torch.bfloat16)
    assert flat.numel() == 0 and flat.dtype == torch.bfloat16
    out = poisoned((0,), torch.float32, DEVICE)
    assert flatten_pad([rand(0), rand(0, 3)], 8, out=out) is out


def test_flatten_pad_errors():
    a, b = rand(5), rand(3)
    with pytest.raises(TypeError, match=r"tensors\[1\] has unsupported dtype torch.int64"):
        flatten_pad([a, torch.arange(3, device=DEVICE)])
    with pytest.raises(TypeError, match=r"dtype=torch.int32 is not supported"):
        flatten_pad([a, b], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"tensors\[0\] has overlapping memory .*stride=\(0, 1\).*contiguous\(\)"):
        flatten_pad([rand(1, 4).expand(3, 4), b])
    with pytest.raises(ValueError, match=r"all tensors must be on one device.*tensors\[1\]=meta"):
        flatten_pad([a, torch.empty(3, device="meta")])
    with pytest.raises(ValueError, match=r"all tensors must be on one device.*out=meta"):
        flatten_pad([a, b], out=torch.empty(8, device="meta"))
    with pytest.raises(ValueError, match=r"out is too small: out.numel\(\)=7 < required 9"):
        flatten_pad([a, b], 3, out=torch.empty(7, device=DEVICE))
    with pytest.raises(ValueError, match=r"exactly padded_numel\(8, 3\)=9 elements, got out.numel\(\)=12"):
        flatten_pad([a, b], 3, out=torch.empty(12, device=DEVICE))
    with pytest.raises(ValueError, match=r"out must be contiguous"):
        flatten_pad([a, b], out=torch.empty(16, device=DEVICE)[::2])
    with pytest.raises(ValueError, match=r"dtype=torch.float16 does not match out.dtype=torch.float32"):
        flatten_pad([a, b], dtype=torch.float16, out=torch.empty(8, device=DEVICE))
    with pytest.raises(ValueError, match=r"needs an integer world_size >= 1, got world_size=0"):
        flatten_pad([a, b], 0)
    with pytest.raises(ValueError, match=r"needs dtype= or out="):
        flatten_pad([])


# ------------------------------------------------------------------ unflatten_into


def destinations(dtypes: list[torch.dtype]) -> list[torch.Tensor]:
    """Poisoned outputs of many layouts: contiguous, transposed, stepped, permuted, 5-D fallback, empty."""
    shapes = [
        lambda dt: poisoned((7,), dt, DEVICE),
        lambda dt: poisoned((5, 7), dt, DEVICE).t(),
        lambda dt: poisoned((40,), dt, DEVICE)[1::3],
        lambda dt: poisoned((2, 3, 4, 5), dt, DEVICE).permute(3, 1, 0, 2),
        lambda dt: poisoned((2, 3, 2, 3, 2), dt, DEVICE).permute(4, 3, 2, 1, 0),
        lambda dt: poisoned((0, 3), dt, DEVICE),
        lambda dt: poisoned((4099,), dt, DEVICE),
        lambda dt: poisoned((131, 33), dt, DEVICE).t(),
        lambda dt: poisoned((1,), dt, DEVICE),
    ]
    return [make(dtypes[i % len(dtypes)]) for i, make in enumerate(shapes)]


@pytest.mark.parametrize("out_dtypes", [["fp32"], ["bf16"], ["fp16", "fp32", "bf16"]], ids="+".join)
@pytest.mark.parametrize("src", list(DTYPES), ids=str)
def test_unflatten_into_matches_copy(src, out_dtypes):
    outs = destinations([DTYPES[d] for d in out_dtypes])
    total = sum(o.numel() for o in outs)
    flat = rand(total + 5, dtype=DTYPES[src])  # + padding that must be ignored
    assert all(r is o for r, o in zip(unflatten_into(flat, outs), outs))
    refs = unflatten_into_ref(flat, destinations([DTYPES[d] for d in out_dtypes]))
    pos = 0
    for o, r in zip(outs, refs):
        ulp = max_ulp({flat.dtype}, o.dtype)
        assert_bits(o, flat[pos : pos + o.numel()].view(o.shape).to(o.dtype), ulp)
        assert_bits(o, r, ulp)
        pos += o.numel()


def test_unflatten_into_strided_keeps_neighbours():
    base = poisoned((3, 40), torch.float32, DEVICE)
    out = base[:, 1::3]  # every third column: the others must keep their poison
    flat = rand(out.numel())
    unflatten_into(flat, [out])
    assert_bits(out, flat.view(3, 13))
    mask = torch.ones_like(base, dtype=torch.bool)
    mask[:, 1::3] = False
    assert base[mask].isnan().all(), "elements outside the strided destination were written"


@pytest.mark.parametrize("world_size", [1, 4], ids=lambda w: f"ws{w}")
def test_flatten_unflatten_round_trip(world_size):
    tensors = tensor_set("strided")
    flat = flatten_pad(tensors, world_size)
    outs = [poisoned(t.shape, t.dtype, DEVICE) for t in tensors]
    unflatten_into(flat, outs)
    for t, o in zip(tensors, outs):
        assert_bits(o, t)


def test_unflatten_into_errors():
    flat = rand(8)
    with pytest.raises(TypeError, match=r"flat has unsupported dtype torch.int64"):
        unflatten_into(torch.arange(8, device=DEVICE), [rand(3)])
    with pytest.raises(TypeError, match=r"outs\[1\] has unsupported dtype torch.int32"):
        unflatten_into(flat, [rand(3), torch.empty(2, dtype=torch.int32, device=DEVICE)])
    with pytest.raises(ValueError, match=r"flat is too small: flat.numel\(\)=8 < required 9"):
        unflatten_into(flat, [rand(3, 3)])
    with pytest.raises(ValueError, match=r"outs\[0\] has overlapping memory"):
        unflatten_into(flat, [rand(1, 2).expand(3, 2)])
    with pytest.raises(ValueError, match=r"flat must be contiguous"):
        unflatten_into(rand(16)[::2], [rand(3)])
    with pytest.raises(ValueError, match=r"all tensors must be on one device.*outs\[0\]=meta"):
        unflatten_into(flat, [torch.empty(3, device="meta")])


# ------------------------------------------------------------------ overlapping memory, argument types


def test_flatten_pad_out_overlapping_an_input_raises():
    buf = rand(8200)
    before = buf.clone()
    with pytest.raises(ValueError, match=r"flatten_pad: tensors\[0\] and out overlap in memory .*apart from the"):
        flatten_pad([buf[:8192]], 4, out=buf[4:8196])
    strided = buf.view(82, 100)[:4, 90:]  # elements 90-99, 190-199, 290-299, 390-399 of buf
    with pytest.raises(ValueError, match=r"tensors\[1\] and out overlap"):
        flatten_pad([rand(3, 5).t(), strided], 1, out=buf[150:205])
    with pytest.raises(ValueError, match=r"tensors\[0\] and out overlap"):
        flatten_pad_ref([buf[:8192]], 4, out=buf[4:8196])
    assert torch.equal(buf, before), "an overlapping call wrote before it raised"
    # In the gap between two rows of the strided input: no shared element.
    expected = flatten_pad_ref([strided], 1)
    out = flatten_pad([strided], 1, out=buf[100:140])
    assert_bits(out, expected)


def test_unflatten_into_aliasing_outputs_raise():
    flat = rand(40)
    buf = poisoned((20,), torch.float32, DEVICE)
    with pytest.raises(ValueError, match=r"unflatten_into: outs\[0\] and outs\[1\] overlap in memory .*its own"):
        unflatten_into(flat, [buf[0:10], buf[5:15]])
    x = poisoned((3, 4), torch.float32, DEVICE)
    with pytest.raises(ValueError, match=r"outs\[0\] and outs\[1\] overlap"):
        unflatten_into(flat, [x, x])
    with pytest.raises(ValueError, match=r"outs\[0\] and outs\[1\] overlap"):
        unflatten_into(flat, [x, x.t()])
    with pytest.raises(ValueError, match=r"outs\[0\] and outs\[1\] overlap"):
        unflatten_into_ref(flat, [buf[0:10], buf[5:15]])
    with pytest.raises(ValueError, match=r"flat and outs\[0\] overlap"):
        unflatten_into(flat, [flat[30:40]])
    assert buf.isnan().all() and x.isnan().all(), "an overlapping call wrote before it raised"


def test_unflatten_into_interleaved_column_slices_are_fine():
    # Column slices of one matrix interleave in memory but share no element (e.g. a fused qkv weight).
    w = poisoned((7, 10), torch.float32, DEVICE)
    outs = [w[:, :3], w[:, 3:4], w[:, 4:].t()]
    flat = rand(70)
    unflatten_into(flat, outs)
    expected = unflatten_into_ref(flat, [poisoned(o.shape, o.dtype, DEVICE) for o in outs])
    for o, e in zip(outs, expected):
        assert_bits(o, e)
    assert not w.isnan().any()


@pytest.mark.parametrize("bad", [2.5, 2.0, True, "2", None, 0], ids=repr)
def test_world_size_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match=rf"flatten_pad needs an integer world_size >= 1, got world_size={bad!r}"):
        flatten_pad([rand(5)], bad)
    with pytest.raises(ValueError, match=rf"padded_numel needs an integer world_size >= 1, got world_size={bad!r}"):
        padded_numel(5, bad)


def test_flatten_non_tensor_arguments():
    t = rand(4)
    with pytest.raises(ValueError, match=r"numel must be >= 0, got numel=2.5: pass an int"):
        padded_numel(2.5, 2)
    with pytest.raises(TypeError, match=r"tensors\[1\] is a float, not a torch.Tensor"):
        flatten_pad([t, 3.0])
    with pytest.raises(TypeError, match=r"tensors must be a sequence of tensors, got a Tensor"):
        flatten_pad(t)
    with pytest.raises(TypeError, match=r"out is a int, not a torch.Tensor"):
        flatten_pad([t], out=3)
    with pytest.raises(TypeError, match=r"dtype must be a torch.dtype or None, got 'bf16'"):
        flatten_pad([t], dtype="bf16")
    with pytest.raises(TypeError, match=r"flat is a float, not a torch.Tensor"):
        unflatten_into(3.0, [t])
    with pytest.raises(TypeError, match=r"outs\[1\] is a NoneType"):
        unflatten_into(rand(8), [t, None])


# ------------------------------------------------------------------ transposed matrices (tiled path)

# Views whose unit-stride dim is not the last one, around the 64 x 64 tile's edges and the size below which
# a matrix keeps the flat-order path. Each maker takes (empty-or-rand, dtype) so the same layouts serve as
# sources and as destinations.
TRANSPOSED = {
    "7x13": lambda make, dt: make((7, 13), dt).t(),  # thinner than 16: the flat-order path
    "1x5": lambda make, dt: make((1, 5), dt).t(),  # coalesces to contiguous
    "16x16": lambda make, dt: make((16, 16), dt).t(),  # the smallest tiled matrix
    "33x65": lambda make, dt: make((33, 65), dt).t(),  # 65 x 33: two tiles down, one across
    "64x64": lambda make, dt: make((64, 64), dt).t(),  # exactly one tile
    "67x131": lambda make, dt: make((67, 131), dt).t(),  # primes: ragged tiles on both edges
    "sliced": lambda make, dt: make((70, 50), dt)[5:60, 3:40].t(),  # column stride 50 != 55 rows
    "batched": lambda make, dt: make((3, 40, 17), dt).transpose(1, 2),  # 3 matrices of 17 x 40
    "thin": lambda make, dt: make((130, 9), dt).t(),  # 9 rows: the flat-order path
}


def rand_shape(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return rand(*shape, dtype=dtype)


def poisoned_shape(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return poisoned(shape, dtype, DEVICE)


@pytest.mark.parametrize("name", list(TRANSPOSED), ids=str)
def test_transposed_layouts_take_the_tiled_path(name):
    # Guards the tests below: they must exercise the tile kernel, not only the flat-order path.
    t = TRANSPOSED[name](rand_shape, torch.float32)
    assert _is_transposed(*_coalesce(t)) == (name not in {"7x13", "1x5", "thin"})


@pytest.mark.parametrize("cast", ["fp32->fp32", "fp32->bf16", "bf16->fp32", "fp16->bf16"], ids=str)
@pytest.mark.parametrize("name", list(TRANSPOSED), ids=str)
def test_flatten_pad_transposed_matches_ref(name, cast):
    src, dst = cast.split("->")
    # After an odd-sized tensor, so that the tiles land at an odd flat offset.
    tensors = [rand(5, dtype=DTYPES[src]), TRANSPOSED[name](rand_shape, DTYPES[src])]
    total = sum(t.numel() for t in tensors)
    out = poisoned((padded_numel(total, 8),), DTYPES[dst], DEVICE)
    flatten_pad(tensors, 8, out=out)
    assert_same(out, flatten_pad_ref(tensors, 8, dtype=DTYPES[dst]))
    assert_positive_zero(out[total:])


@pytest.mark.parametrize("dst", list(DTYPES), ids=str)
def test_flatten_pad_mixed_transposed_keeps_neighbours(dst):
    tensors = [
        rand(5, dtype=torch.float16),
        TRANSPOSED["33x65"](rand_shape, torch.float32),
        rand(6, 9)[::2, 1::2],  # strided, not transposed
        TRANSPOSED["7x13"](rand_shape, torch.bfloat16),
        TRANSPOSED["batched"](rand_shape, torch.float32),
        rand(2, 3, 4, 5).permute(3, 1, 0, 2),
        rand(131),
        TRANSPOSED["67x131"](rand_shape, torch.float16),
        TRANSPOSED["sliced"](rand_shape, torch.float32),  # last: a stray tile lane would hit the guard
    ]
    total = sum(t.numel() for t in tensors)
    padded = padded_numel(total, 8)
    buf = poisoned((padded + 4100,), DTYPES[dst], DEVICE)
    out = buf[3 : 3 + padded]
    flatten_pad(tensors, 8, out=out)
    assert_same(out, flatten_pad_ref(tensors, 8, dtype=DTYPES[dst]))
    assert_positive_zero(out[total:])
    assert buf[:3].isnan().all() and buf[3 + padded :].isnan().all(), "guard elements were overwritten"


def transposed_destinations(dtypes: list[torch.dtype]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Poisoned transposed outputs, and the bigger buffers the first and last are windows of (a tile lane
    past an edge would write outside the window)."""
    bases = [poisoned((70, 50), dtypes[0], DEVICE), poisoned((70, 50), dtypes[-1], DEVICE)]
    names = ["batched", "64x64", "7x13", "67x131", "33x65"]
    middle = [TRANSPOSED[n](poisoned_shape, dtypes[i % len(dtypes)]) for i, n in enumerate(names)]
    return [bases[0][5:60, 3:40].t(), *middle, bases[1][:, 1:46].t()], bases


@pytest.mark.parametrize("out_dtypes", [["fp32"], ["bf16", "fp16", "fp32"]], ids="+".join)
@pytest.mark.parametrize("src", ["fp32", "bf16"], ids=str)
def test_unflatten_into_transposed_keeps_neighbours(src, out_dtypes):
    dtypes = [DTYPES[d] for d in out_dtypes]
    outs, bases = transposed_destinations(dtypes)
    flat = rand(sum(o.numel() for o in outs) + 7, dtype=DTYPES[src])  # + padding that must be ignored
    unflatten_into(flat, outs)
    for o, r in zip(outs, unflatten_into_ref(flat, transposed_destinations(dtypes)[0])):
        assert_same(o, r)
    for base, window in zip(bases, [(slice(5, 60), slice(3, 40)), (slice(None), slice(1, 46))]):
        outside = torch.ones(base.shape, dtype=torch.bool, device=DEVICE)
        outside[window] = False
        assert base[outside].isnan().all(), "elements outside the transposed window were written"


# ------------------------------------------------------------------ GPU only


def big_params(total: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """~16 parameters of about ``total`` elements: 2-D weights (some transposed), 1-D biases, odd sizes."""
    out = []
    per = total // 16
    for i in range(16):
        if i % 4 == 3:
            out.append(rand(per // 64 + i, dtype=dtype))
        else:
            cols = 1021
            w = rand(per // cols + i, cols, dtype=dtype)
            out.append(w.t() if i % 4 == 1 else w)
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("dst", list(DTYPES), ids=str)
def test_gpu_flatten_pad_bit_exact_large(dst):
    tensors = big_params((1 << 25) + 3)
    total = sum(t.numel() for t in tensors)
    out = poisoned((padded_numel(total, 8),), DTYPES[dst], "cuda")
    flatten_pad(tensors, 8, out=out)
    assert_bits(out, cat_pad(tensors, 8, DTYPES[dst]))
    assert_positive_zero(out[total:])
    outs = [poisoned(t.shape, t.dtype, "cuda") for t in tensors]
    unflatten_into(out, outs)
    for t, o in zip(tensors, outs):
        assert_bits(o, t.to(DTYPES[dst]).float())


@pytest.mark.gpu
def test_gpu_flatten_pad_one_launch_with_padding():
    # big_params' total happens to be a multiple of 8: an odd-sized bias leaves a padding tail.
    tensors = big_params(1 << 20) + [rand(5)]
    total = sum(t.numel() for t in tensors)
    out = poisoned((padded_numel(total, 8),), torch.bfloat16, "cuda")
    assert out.numel() > total, "the case must have a padding tail"
    names = cuda_kernels(lambda: flatten_pad(tensors, 8, out=out))
    assert len(names) == 1 and "_flat_segments_kernel" in names[0], names
    assert_bits(out, cat_pad(tensors, 8, torch.bfloat16))  # the tail was zeroed by that one launch
    assert_positive_zero(out[total:])
    # Two source dtypes: one launch each, the padding inside the last one.
    mixed = tensors[:8] + [t.half() for t in tensors[8:]]
    names = cuda_kernels(lambda: flatten_pad(mixed, 8, out=out))
    assert len(names) == 2 and all("_flat_segments_kernel" in n for n in names), names
    outs = [torch.empty_like(t) for t in tensors]
    names = cuda_kernels(lambda: unflatten_into(out, outs))
    assert len(names) == 1 and "_flat_segments_kernel" in names[0], names


@pytest.mark.gpu
def test_gpu_flatten_pad_5000_tensors_one_launch():
    sizes = torch.randint(0, 3000, (5000,)).tolist()
    tensors = [rand(k) if i % 2 else rand(k, 2).t() for i, k in enumerate(sizes)]
    total = sum(t.numel() for t in tensors)
    out = poisoned((padded_numel(total, 8),), torch.bfloat16, "cuda")
    names = cuda_kernels(lambda: flatten_pad(tensors, 8, out=out))
    assert len(names) == 1 and "_flat_segments_kernel" in names[0], names
    assert_bits(out, cat_pad(tensors, 8, torch.bfloat16))


@pytest.mark.gpu
def test_gpu_flatten_pad_transposed_past_2_pow_31():
    # One transposed fp16 matrix of more than 2^31 elements: every tile offset must be int64.
    rows, cols = (1 << 16) + 1, (1 << 15) + 3
    need = 4 * rows * cols * 2 + (1 << 30)  # input, flat buffer, a contiguous copy, an unflatten target
    if torch.cuda.mem_get_info()[0] < need:
        pytest.skip(f"needs {need / 2**30:.1f} GiB of free GPU memory")
    w = torch.randn(rows, cols, dtype=torch.float16, device="cuda")
    flat = flatten_pad([w.t()], 8)
    assert flat.numel() == padded_numel(rows * cols, 8) > 1 << 31
    assert torch.equal(flat[: rows * cols], w.t().contiguous().view(-1)), "the flat buffer differs"
    assert_positive_zero(flat[rows * cols :])
    back = torch.empty(rows, cols, dtype=torch.float16, device="cuda")
    unflatten_into(flat, [back.t()])  # the same transposed layout as the source
    assert torch.equal(back, w)


@pytest.mark.gpu
def test_gpu_flatten_pad_past_2_pow_31():
    n = (1 << 30) + 3
    need = 4 * n * 2 + (1 << 31)  # two fp16 inputs + the fp16 output + room for the comparisons
    if torch.cuda.mem_get_info()[0] < need:
        pytest.skip(f"needs {need / 2**30:.1f} GiB of free GPU memory")
    a = torch.randn(n, dtype=torch.float16, device="cuda")
    b = torch.randn(n, dtype=torch.float16, device="cuda")
    flat = flatten_pad([a, b], 8)
    assert flat.numel() == padded_numel(2 * n, 8) > 1 << 31
    assert torch.equal(flat[n:2 * n], b), "the second tensor, past 2^31 bytes/elements, differs"
    assert torch.equal(flat[:n], a)
    assert_positive_zero(flat[2 * n:])


def test_table_columns_match_the_kernel():
    # The kernel reads the table by position: block starts, then the columns of _COLUMNS in order, then the
    # owner of every program. A column added or moved on the host side must move in the kernel too.
    import inspect

    from shardfuse.kernels import _flatten

    src = inspect.getsource(_flatten._flat_segments_kernel.fn)
    assert f"table + {1 + len(_flatten._COLUMNS)} * num_segs + pid" in src, "owner column offset"
    expected = ["n = tl.load(col)", "kind = tl.load(col + num_segs)"]
    expected += [f"col + {c} * num_segs" for c in range(2, len(_flatten._COLUMNS))]
    assert _flatten._COLUMNS[:4] == ("numel", "kind", "addr", "flat_off")
    for c, text in enumerate(expected):
        assert text in src, f"column {c} ({_flatten._COLUMNS[c]}) is not read where the host writes it"
