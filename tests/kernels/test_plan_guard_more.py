"""Plans found by address and checked by a layout guard, for the launchers that are not dispatching entry points:
``flatten_pad``, ``unflatten_into``, ``fp8_amax``, ``cast_fp8_shards`` and the list form of ``pre_divide_pad``.

As in tests/kernels/test_dispatch_guard.py (the dispatching entry points), every test runs with PyTorch's C++
``TensorGuards`` and with the Python fields. For each launcher: a repeat call builds nothing and computes from the
tensors' current contents; tensors at cached addresses with another shape, strides or dtype (views of one pool,
``p.data`` swapped) get the reference's result, or the error a first call raises; an ``out`` of the wrong layout at
a cached address raises and stays untouched. Results equal the reference bit for bit (values exact in every dtype).
"""

from __future__ import annotations

import importlib

import pytest
import torch

from shardfuse.kernels import _common
from shardfuse.kernels._grad_divide import pre_divide_pad_ref
from tests._asserts import assert_bits
from tests.conftest import kernel_device, poisoned

DEVICE = kernel_device()
# By module path: the package's attributes of these names are the functions.
flatten, fp8, grad_divide = (importlib.import_module(f"shardfuse.kernels._{m}")
                             for m in ("flatten", "fp8", "grad_divide_multi"))


def spy(monkeypatch, module, name: str) -> list[int]:
    """Counts the calls of the plan builder ``module.name``: a hit calls none."""
    count = [0]
    original = getattr(module, name)

    def counting(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counting)
    return count


def fresh(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    # Values exact in bf16 and fp16 too, so every cast compares bit for bit (the interpreter truncates bf16).
    return (torch.randint(-64, 64, shape, device=DEVICE) / 4).to(dtype)


def refill(*tensors: torch.Tensor) -> None:
    """New contents, same storage: what the FSDP data path does between two steps."""
    for t in tensors:
        t.copy_(fresh(*t.shape, dtype=t.dtype))


def nan_pool(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return poisoned((n,), dtype, DEVICE)


def assert_untouched(pool: torch.Tensor) -> None:
    assert pool.isnan().all(), "a call that raised wrote its out"


def raises_as_first_call(call, error: type[Exception], match: str) -> None:
    """``call`` raises at a cached address, and raises the same on a first call (empty caches)."""
    with pytest.raises(error, match=match):
        call()
    _common.clear_plan_caches()
    with pytest.raises(error, match=match):
        call()


# ------------------------------------------------------------------ flatten_pad


def test_flatten_pad_hit_reads_new_contents(guard, monkeypatch):
    builds = spy(monkeypatch, flatten, "_plan_flatten")
    # Contiguous, strided (a transpose) and tiled (a wide transpose) segments, two source dtypes.
    tensors = [fresh(5, 3).t(), fresh(7), fresh(2, 2, dtype=torch.float16), fresh(20, 18).t()[1:]]
    out = nan_pool(flatten.padded_numel(15 + 7 + 4 + 340, 8))
    for _ in range(3):
        refill(*tensors)
        out.fill_(float("nan"))
        flatten.flatten_pad(tensors, 8, out=out)
        assert_bits(out, flatten.flatten_pad_ref(tensors, 8, out=nan_pool(out.numel())))
        assert_bits(flatten.flatten_pad(tensors, 8), flatten.flatten_pad_ref(tensors, 8))  # out=None: its own plan
    assert builds[0] == 2, "a repeat call built its plan again"


def test_flatten_pad_at_cached_addresses(guard):
    pool = fresh(96)
    cases = [
        [pool[:12].view(3, 4), pool[32:52]],
        [pool[:12].view(4, 3).t(), pool[32:52]],  # the same address and numel, other shape and strides
        [pool[:16].view(4, 4).t(), pool[32:52]],  # the same shape as its transpose: strides alone differ
        [pool[:16].view(4, 4), pool[32:52]],
        [pool.as_strided((4, 4), (8, 1)), pool[32:52]],  # the same shape, rows apart
        [pool[:10], pool[32:52].view(torch.int16)[:20].view(torch.bfloat16)],  # fewer elements; another dtype
        [pool[:12].view(3, 4), pool[32:52].view(2, 10)[:, :6]],
    ]
    out_pool = nan_pool(64)
    for _ in range(2):  # every case after every other: each finds the plans of the one before at its addresses
        for tensors in cases:
            expected = flatten.flatten_pad_ref(tensors, 4, dtype=torch.float32)
            assert_bits(flatten.flatten_pad(tensors, 4, dtype=torch.float32), expected)
            out_pool.fill_(float("nan"))
            out = out_pool[: expected.numel()]
            assert_bits(flatten.flatten_pad(tensors, 4, out=out), expected)
            assert out_pool[expected.numel():].isnan().all(), "a stale plan wrote past out"


def test_flatten_pad_strided_input_moved_onto_out(guard):
    # The stale-plan hole of strided inputs: the same address and shape with other strides may overlap out.
    buf = fresh(64)
    before = buf.clone()
    out = buf[32:40]
    flatten.flatten_pad([buf.as_strided((4, 2), (4, 1))], 1, out=out)
    raises_as_first_call(lambda: flatten.flatten_pad([buf.as_strided((4, 2), (11, 1))], 1, out=out), ValueError,
                         r"flatten_pad: tensors\[0\] and out overlap")  # elements 33, 34 are in out
    assert torch.equal(buf[:32], before[:32])


def test_flatten_pad_out_of_the_wrong_layout_raises_untouched(guard):
    tensors = [fresh(3, 5), fresh(6)]
    out_pool = nan_pool(64)
    assert_bits(flatten.flatten_pad(tensors, 8, out=out_pool[:24]), flatten.flatten_pad_ref(tensors, 8))
    wrongs = [
        (out_pool[:32], ValueError, r"out must hold exactly padded_numel\(21, 8\)=24 elements"),
        (out_pool[:48][::2], ValueError, r"out must be contiguous"),  # the same address and numel, strided
        (out_pool[:24].view(torch.int32), TypeError, r"dtype=torch.int32 is not supported"),
    ]
    for wrong, error, match in wrongs:
        out_pool.fill_(float("nan"))
        raises_as_first_call(lambda: flatten.flatten_pad(tensors, 8, out=wrong), error, match)  # noqa: B023
        assert_untouched(out_pool)
        flatten.flatten_pad(tensors, 8, out=out_pool[:24])  # the good plan back in front
    out_pool.fill_(float("nan"))
    with pytest.raises(ValueError, match=r"dtype=torch.float32 does not match out.dtype=torch.float16"):
        flatten.flatten_pad(tensors, 8, dtype=torch.float32, out=out_pool.view(torch.float16)[:24])
    assert_untouched(out_pool)
    # The same address and element count in another dtype or shape is a valid out: the reference's bits.
    for other in (out_pool.view(torch.float16)[:24], out_pool[:24].view(4, 6)):
        expected = flatten.flatten_pad_ref(tensors, 8, out=poisoned(other.shape, other.dtype, DEVICE))
        assert_bits(flatten.flatten_pad(tensors, 8, out=other), expected)


# ------------------------------------------------------------------ unflatten_into


def test_unflatten_into_hit_reads_new_contents(guard, monkeypatch):
    builds = spy(monkeypatch, flatten, "_plan_unflatten")
    outs = [nan_pool(15).view(5, 3), nan_pool(15).view(3, 5).t(), nan_pool(4, torch.bfloat16).view(2, 2),
            nan_pool(360).view(18, 20).t()[:, 1:]]
    flat = fresh(15 + 15 + 4 + 340 + 5)
    for _ in range(3):
        refill(flat)
        for o in outs:
            o.fill_(float("nan"))
        flatten.unflatten_into(flat, outs)
        expected = flatten.unflatten_into_ref(flat, [poisoned(o.shape, o.dtype, DEVICE) for o in outs])
        for got, want in zip(outs, expected, strict=True):
            assert_bits(got, want)
    assert builds[0] == 1, "a repeat call built its plan again"


def test_unflatten_into_at_cached_addresses(guard):
    flat = fresh(64)
    out_pool = nan_pool(96)
    cases = [
        (flat, [out_pool[:12].view(3, 4), out_pool[32:52]]),
        (flat, [out_pool[:12].view(4, 3).t(), out_pool[32:52]]),  # other shape and strides at the same address
        (flat, [out_pool[:16].view(4, 4).t(), out_pool[32:52]]),
        (flat, [out_pool[:16].view(4, 4), out_pool[32:52]]),  # the same shape: strides alone differ
        (flat, [out_pool.as_strided((4, 4), (8, 1)), out_pool[32:52]]),
        (flat, [out_pool[:10], out_pool[32:52].view(torch.bfloat16)[:20]]),  # fewer elements; another dtype
        (flat.view(torch.bfloat16)[:64], [out_pool[:12].view(3, 4), out_pool[32:52]]),  # flat of another dtype
        (flat[:32].view(4, 8), [out_pool[:12].view(3, 4), out_pool[32:52]]),  # flat of another shape
    ]
    for _ in range(2):
        for src, outs in cases:
            out_pool.fill_(float("nan"))
            expected = flatten.unflatten_into_ref(src, [poisoned(o.shape, o.dtype, DEVICE) for o in outs])
            flatten.unflatten_into(src, outs)
            for got, want in zip(outs, expected, strict=True):
                assert_bits(got, want)
            assert out_pool[52:].isnan().all(), "a stale plan wrote past the outputs"


def test_unflatten_into_outputs_of_the_wrong_layout_raise_untouched(guard):
    flat = fresh(32)
    out_pool = nan_pool(96)
    flatten.unflatten_into(flat, [out_pool[:12].view(3, 4), out_pool[32:52]])
    wrongs = [
        ([out_pool[:12].view(3, 4), out_pool[32:54]], ValueError, r"flat is too small: .*=32 < required 34"),
        ([out_pool[:12].view(3, 4), out_pool[32:33].expand(20)], ValueError, r"outs\[1\] has overlapping memory"),
        ([out_pool[:12].view(3, 4), out_pool[8:28]], ValueError, r"outs\[0\] and outs\[1\] overlap"),
        ([out_pool[:12].view(3, 4), out_pool[32:52].view(torch.int32)], TypeError, r"outs\[1\] has unsupported dtype"),
    ]
    for outs, error, match in wrongs:
        out_pool.fill_(float("nan"))
        raises_as_first_call(lambda: flatten.unflatten_into(flat, outs), error, match)  # noqa: B023
        assert_untouched(out_pool)
        flatten.unflatten_into(flat, [out_pool[:12].view(3, 4), out_pool[32:52]])  # the good plan back in front
    buf = fresh(64)
    outs = [buf[40:52]]
    flatten.unflatten_into(buf[24:36], outs)
    before = buf.clone()
    # The same addresses, a longer flat that now runs over the output.
    raises_as_first_call(lambda: flatten.unflatten_into(buf[24:56], outs), ValueError,
                         r"unflatten_into: flat and outs\[0\] overlap")
    assert torch.equal(buf, before)


# ------------------------------------------------------------------ fp8_amax and cast_fp8_shards


def test_fp8_hits_read_new_contents(guard, monkeypatch):
    builds = spy(monkeypatch, fp8, "_plan")
    srcs = [fresh(7, dtype=torch.bfloat16), fresh(0, dtype=torch.bfloat16), fresh(4099, dtype=torch.bfloat16),
            fresh(131, dtype=torch.bfloat16)]
    scales = fresh(4).abs() + 1
    offsets = [4300, 0, 10, 4110]
    out = torch.full((4500,), 0x7F, dtype=torch.uint8, device=DEVICE)
    for _ in range(3):
        refill(*srcs, scales)
        scales.abs_().add_(1)
        amax = torch.full((4,), float("nan"), device=DEVICE)
        assert_bits(fp8.fp8_amax(srcs, amax), fp8.fp8_amax_ref(srcs))
        assert_bits(fp8.fp8_amax(srcs), fp8.fp8_amax_ref(srcs))  # a fresh out each call: the same plan
        out.fill_(0x7F)
        fp8.cast_fp8_shards(srcs, scales, out, offsets=offsets)
        expected = fp8.cast_fp8_shards_ref(srcs, scales, torch.full_like(out, 0x7F), offsets=offsets)
        assert torch.equal(out, expected)
    assert builds[0] == 2, "a repeat call built its plan again"


def test_fp8_amax_at_cached_addresses(guard):
    pool = fresh(96)
    pool[40] = 1000.0  # the amax of the longer views only
    cases = [
        [pool[:40], pool[48:60]],
        [pool[:41], pool[48:60]],  # one more element
        [pool[:40].view(5, 8), pool[48:60].view(3, 4)],  # other shapes
        [pool[:40].view(torch.float16), pool[48:60].view(torch.float16)],  # another dtype, twice the elements
        [pool[:40].view(torch.bfloat16)[:40], pool[48:60].view(torch.bfloat16)[:12]],  # another dtype
    ]
    for _ in range(2):
        for srcs in cases:
            assert_bits(fp8.fp8_amax(srcs), fp8.fp8_amax_ref(srcs))
    out_pool = nan_pool(8)
    wrongs = [
        ([pool[:80][::2], pool[48:60]], ValueError, r"fp8_amax: srcs\[0\] must be contiguous"),
        ([pool[:40].view(8, 5).t(), pool[48:60]], ValueError, r"fp8_amax: srcs\[0\] must be contiguous"),
        ([pool[:40], pool[48:60].view(torch.bfloat16)], TypeError, r"fp8_amax needs all srcs in one dtype"),
    ]
    for srcs, error, match in wrongs:
        raises_as_first_call(lambda: fp8.fp8_amax(srcs, out_pool[:2]), error, match)  # noqa: B023
        assert_untouched(out_pool)
    fp8.fp8_amax(cases[0], out_pool[:2])
    out_pool.fill_(float("nan"))
    for wrong in (out_pool[:3], out_pool[:4][::2], out_pool.view(torch.float16)[:2]):
        raises_as_first_call(lambda: fp8.fp8_amax(cases[0], wrong), ValueError,  # noqa: B023
                             r"fp8_amax out must be a contiguous float32 tensor of 2 elements")
        assert_untouched(out_pool)


def test_cast_fp8_shards_at_cached_addresses(guard):
    pool = fresh(96)
    scale_pool = fresh(8).abs() + 1
    out_pool = torch.full((64,), 0x7F, dtype=torch.uint8, device=DEVICE)
    cases = [
        ([pool[:12], pool[32:52]], scale_pool[:2], out_pool[:32]),
        ([pool[:12].view(3, 4), pool[32:52]], scale_pool[:2], out_pool[:32]),  # a source reshaped in place
        ([pool[:12].view(torch.bfloat16)[:12], pool[32:52].view(torch.bfloat16)[:20]], scale_pool[:2],
         out_pool[:32]),  # another dtype
        ([pool[:12], pool[32:50]], scale_pool[:2], out_pool[:32]),  # fewer elements
        ([pool[:12], pool[32:52]], scale_pool[:2].view(1, 2), out_pool[:32].view(fp8.FP8_DTYPE)),
        ([pool[:12], pool[32:52]], scale_pool[:2], out_pool[:32].view(4, 8)),  # out reshaped in place
    ]
    for _ in range(2):
        for srcs, scales, out in cases:
            out_pool.fill_(0x7F)
            expected = fp8.cast_fp8_shards_ref(srcs, scales, torch.full(out.shape, 0x7F, dtype=torch.uint8,
                                                                      device=DEVICE))
            fp8.cast_fp8_shards(srcs, scales, out)
            assert torch.equal(out.view(torch.uint8), expected.view(torch.uint8))
            assert (out_pool[32:] == 0x7F).all(), "a stale plan wrote past out"
    srcs = [pool[:12], pool[32:52]]
    wrongs = [
        (srcs, scale_pool[:2], out_pool[:31], r"cast_fp8_shards out is too small: out.numel\(\)=31 < required 32"),
        (srcs, scale_pool[:2], out_pool[:64][::2], r"out must be a contiguous"),  # the same address, strided
        (srcs, scale_pool[:2], out_pool.view(torch.float16)[:16], r"out must be a contiguous .* got torch.float16"),
        (srcs, scale_pool[:4][::2], out_pool[:32], r"scales must be a contiguous float32 tensor"),
        (srcs, scale_pool[:2].view(torch.int32), out_pool[:32], r"scales must be a contiguous float32 tensor"),
        ([pool[:24][::2], pool[32:52]], scale_pool[:2], out_pool[:32], r"srcs\[0\] must be contiguous"),
    ]
    for srcs, scales, out, match in wrongs:
        out_pool.fill_(0x7F)
        raises_as_first_call(lambda: fp8.cast_fp8_shards(srcs, scales, out), ValueError, match)  # noqa: B023
        assert (out_pool == 0x7F).all(), "a call that raised wrote its out"
    mixed = [pool[:12], pool[32:52].view(torch.bfloat16)[:20]]  # one launch reads every source as one type
    raises_as_first_call(lambda: fp8.cast_fp8_shards(mixed, scale_pool[:2], out_pool[:32]), TypeError,
                         r"cast_fp8_shards needs all srcs in one dtype, got \['torch.bfloat16', 'torch.float32'\]")
    assert (out_pool == 0x7F).all(), "a call that raised wrote its out"


# ------------------------------------------------------------------ pre_divide_pad, list form


def test_pre_divide_pad_list_hit_reads_new_contents(guard, monkeypatch):
    builds = spy(monkeypatch, grad_divide, "_plan_multi")
    grads = [fresh(7), fresh(4099), fresh(0), fresh(3, 5)]
    out = nan_pool(4136, torch.float16)  # not bf16: the interpreter truncates a rounded bf16 quotient
    for factor in (2.0, 3.0, 1.0):  # the factor is the launch's, not the plan's
        refill(*grads)
        out.fill_(float("nan"))
        grad_divide.pre_divide_pad(grads, out, factor)
        assert_bits(out, pre_divide_pad_ref(grads, nan_pool(4136, torch.float16), factor))
    assert builds[0] == 1, "a repeat call built its plan again"


def test_pre_divide_pad_list_at_cached_addresses(guard):
    pool = fresh(96)
    out_pool = nan_pool(64)
    cases = [
        ([pool[:12], pool[32:52]], out_pool[:40]),
        ([pool[:12].view(3, 4), pool[32:52].view(4, 5)], out_pool[:40]),  # other shapes, the same bytes
        ([pool[:10], pool[32:52]], out_pool[:40]),  # fewer elements: more padding
        ([pool[:12].view(torch.bfloat16)[:12], pool[32:52].view(torch.bfloat16)[:20]], out_pool[:40]),
        ([pool[:12], pool[32:52]], out_pool.view(torch.float16)[:40]),  # out of another dtype
        ([pool[:12], pool[32:52]], out_pool[:40].view(5, 8)),  # out reshaped in place
    ]
    for _ in range(2):
        for grads, out in cases:
            out_pool.fill_(float("nan"))
            expected = pre_divide_pad_ref(grads, poisoned(out.shape, out.dtype, DEVICE), 4.0)
            assert_bits(grad_divide.pre_divide_pad(grads, out, 4.0), expected)
            assert out_pool[40:].isnan().all(), "a stale plan wrote past out"
    grads = [pool[:12], pool[32:52]]
    wrongs = [
        (grads, out_pool[:31], ValueError, r"out is too small: out.numel\(\)=31 < required 32"),
        (grads, out_pool[:80][::2], ValueError, r"out must be contiguous"),  # the same address and numel
        (grads, out_pool[:40].view(torch.int32), TypeError, r"out has unsupported dtype torch.int32"),
        ([pool[:24][::2], pool[32:52]], out_pool[:40], ValueError, r"grads\[0\] is not contiguous"),
        ([pool[:12], pool[32:52].view(torch.float16)[:20]], out_pool[:40], TypeError, r"needs all grads in one dtype"),
    ]
    for grads, out, error, match in wrongs:
        out_pool.fill_(float("nan"))
        raises_as_first_call(lambda: grad_divide.pre_divide_pad(grads, out, 4.0), error, match)  # noqa: B023
        assert_untouched(out_pool)


def test_pre_divide_pad_list_parameter_data_swapped(guard):
    # p.data = other: the same Python objects over other storage, or over their own at another layout.
    base = fresh(24)
    grads = [torch.nn.Parameter(base[:8], requires_grad=False), torch.nn.Parameter(base[8:24], requires_grad=False)]
    out = nan_pool(32)
    for data in ((base[:8], base[8:24]), (fresh(8), base[8:24]), (base[:8].view(2, 4), base[8:24].view(4, 4)),
                 (base[:6], base[8:24])):
        grads[0].data, grads[1].data = data
        out.fill_(float("nan"))
        grad_divide.pre_divide_pad(grads, out, 2.0)
        assert_bits(out, pre_divide_pad_ref(list(data), nan_pool(32), 2.0))
    grads[0].data = base[:16][::2]
    raises_as_first_call(lambda: grad_divide.pre_divide_pad(grads, out, 2.0), ValueError,
                         r"grads\[0\] is not contiguous")
