"""Plans found by address, then checked by a layout guard (``_common.guarded_key``, ``_common.layout_guard``).

The dispatching entry points (``cast_shards`` flat and list, ``chunk_cat``, ``concat_microbatches``) key their
plans by the tensors' addresses alone and keep in the plan a guard that checks every tensor's type, shape,
strides, dtype and device on a hit: PyTorch's C++ ``TensorGuards`` where it has one, the same fields read in
Python otherwise. Every test runs with both. A shortcut that trusts an address too far must fail here: a tensor
at a cached address with another shape, strides or dtype (``p.data = other`` included), an ``out`` of the wrong
shape (which must raise, not be resized as ``torch._chunk_cat(out=)`` and ``torch.cat(out=)`` would), an ``out``
that moved onto the inputs, one more or one fewer tensor. Results equal the reference bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from shardfuse.kernels import _common, _crossover
from shardfuse.kernels._cast_multi import cast_shards, cast_shards_ref
from shardfuse.kernels._chunk_cat import chunk_cat, chunk_cat_ref
from shardfuse.kernels._concat import concat_microbatches
from tests._asserts import assert_bits
from tests.conftest import kernel_device, poisoned

DEVICE = kernel_device()
KIND = _crossover.gpu_kind(torch.device(DEVICE))


@pytest.fixture(params=["torch", "triton"])
def path(request, guard):
    """Both paths of every family: the plans of each are found the same way."""
    with _crossover.override(dict.fromkeys(_crossover.FAMILIES, request.param), kind=KIND):
        yield request.param


def fresh(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    # Values exact in bf16 and fp16 too, so every cast compares bit for bit.
    return (torch.randint(-64, 64, (n,), device=DEVICE) / 4).to(dtype)


# ------------------------------------------------------------------ the guard itself


def test_guard_tells_every_field_apart(guard):
    pool = fresh(64)
    square = pool[:16].view(4, 4)
    check = _common.layout_guard([square, pool[16:24]])
    native = type(getattr(check, "__self__", None)).__name__ == "TensorGuards"
    assert native == (guard == "native"), "the guard under test is not the one asked for"
    assert check(square, pool[16:24])
    assert check(pool[:16].view(4, 4), fresh(8))  # other tensors of the same layouts: the key tells addresses
    others = [
        pool[:12].view(4, 3),  # the same dims, another size: a guard that skipped sizes would pass this
        square.t(),  # the same address, shape and dtype, other strides
        pool[:32].view(4, 8)[:, :4],  # the same shape, other strides
        pool[:16],  # another number of dims
        pool[:16].view(torch.int32).view(4, 4),  # another dtype of the same width
        torch.nn.Parameter(square.clone()),  # another Python type
        torch.empty(4, 4, device="meta"),  # another device
    ]
    for other in others:
        assert not check(other, pool[16:24]), other
    assert not check(square, pool[16:25])


def test_guard_falls_back_to_python_fields(monkeypatch):
    t = fresh(6).view(2, 3)
    check = _common.layout_guard([t], native=False)
    assert check(t) and not check(t.t()) and not check(fresh(6).view(3, 2))
    assert isinstance(check.__self__, _common._FieldGuard)

    class Unchecked:  # a TensorGuards that leaves sizes unchecked, as a None size would
        def __init__(self, *tensors, **kwargs):
            self.check = lambda *ts: len(ts) == len(tensors)

    monkeypatch.setattr(_common, "_TensorGuards", Unchecked)
    _common._native_guards_work.cache_clear()
    try:
        assert not _common._native_guards_work()
        assert isinstance(_common.layout_guard([t]).__self__, _common._FieldGuard)
    finally:
        _common._native_guards_work.cache_clear()


def test_guarded_key_holds_stream_overrides_parts_and_every_address():
    a, b = fresh(4), fresh(5)
    key = _common.guarded_key([a, b], 3, None)
    assert key == (0, _crossover.token(), (3, None), (a.data_ptr(), b.data_ptr()))
    assert _common.guarded_key([a, b[1:]], 3, None) != key
    assert _common.guarded_key([b, a], 3, None) != key
    for malformed in ([], [a, 2.0], [3]):
        assert _common.guarded_key(malformed) is None  # no key: the validating path says what is wrong
    with _crossover.override({"concat": "torch"}):
        assert _common.guarded_key([a, b], 3, None)[1] != key[1]  # a plan built under a forced path is cached apart
    assert _common.guarded_key([a, b], 3, None) == key


def test_unhashable_arguments_get_the_validating_error(guard):
    tensors = [fresh(8).view(4, 2)]
    chunk_cat(tensors, 2)  # a plan in the cache: the next key is compared with it, then hashed
    with pytest.raises(ValueError, match=r"chunk_cat needs an integer world_size >= 1, got world_size=\[2\]"):
        chunk_cat(tensors, [2])


# ------------------------------------------------------------------ same addresses, other layouts


def test_cast_shards_at_cached_addresses(path):
    pool = fresh(96)
    out_pool = poisoned((96,), torch.bfloat16, DEVICE)
    srcs = [pool[:12], pool[32:52]]
    cases = [
        ([pool[:12], pool[32:52]], out_pool[:32]),
        ([pool[:12].view(3, 4), pool[32:52]], out_pool[:32]),  # a source reshaped in place
        ([pool[:12].view(torch.int16)[:12].view(torch.bfloat16), pool[32:52]], out_pool[:32]),  # another dtype
        ([pool[:12], pool[32:52]], out_pool[:32].view(4, 8)),  # out reshaped in place
        ([pool[:12], pool[32:52]], out_pool.view(torch.float16)[:32]),  # out of another dtype
        ([pool[:12], pool[32:52]], [out_pool[:12], out_pool[40:60]]),  # the list form at the same addresses
        ([pool[:12], pool[32:52]], [out_pool[:12].view(3, 4), out_pool[40:60].view(torch.float16)]),
    ]
    for _ in range(2):  # every case after every other: each finds the plan of the one before at its addresses
        for srcs, out in cases:
            expected = cast_shards_ref(srcs, _poisoned_like(out))
            _fill_nan(out)
            cast_shards(srcs, out)
            for got, want in zip(_as_list(out), _as_list(expected), strict=True):
                assert_bits(got, want)
    cast_shards([pool[:16].view(4, 4)], [out_pool[:16]])
    with pytest.raises(ValueError, match=r"srcs\[0\] must be contiguous"):
        cast_shards([pool[:16].view(4, 4).t()], [out_pool[:16]])
    with pytest.raises(ValueError, match=r"out is too small: out.numel\(\)=31 < required 32"):
        cast_shards(srcs, out_pool[:31])


def test_cast_shards_parameter_data_swapped(path):
    # p.data = other: the same Python object over another storage, or over its own at another layout.
    base = fresh(20)
    p = torch.nn.Parameter(base, requires_grad=False)
    out = poisoned((20,), torch.bfloat16, DEVICE)
    for data in (fresh(20), base.view(4, 5), base.view(torch.int16)[:20].view(torch.bfloat16), base, fresh(20)):
        p.data = data
        cast_shards([p], [out])
        assert_bits(out, data.reshape(-1).bfloat16())
    p.data = fresh(21)
    with pytest.raises(ValueError, match=r"out\[0\] is too small: out\[0\].numel\(\)=20 < required 21"):
        cast_shards([p], [out])
    p.data = fresh(20).to(torch.int32)
    with pytest.raises(TypeError, match=r"srcs\[0\]"):
        cast_shards([p], [out])


def test_cast_shards_overlap_after_a_cached_call(path):
    pool = fresh(64)
    srcs = [pool[:8], pool[8:16]]
    outs = [poisoned((8,), torch.bfloat16, DEVICE) for _ in range(2)]
    cast_shards(srcs, outs)
    before = pool.clone()
    # One source moved, the other kept: a key of the first tensor alone would find the plan above.
    with pytest.raises(ValueError, match=r"srcs\[1\] and out\[0\] overlap"):
        cast_shards([pool[:8], pool[8:16]], [pool.view(torch.bfloat16)[16:24], outs[1]])
    cast_shards(srcs, pool[32:48])
    with pytest.raises(ValueError, match=r"overlap"):
        cast_shards(srcs, pool[4:20])  # a flat out moved onto the sources
    assert torch.equal(pool[:32], before[:32])


# ------------------------------------------------------------------ chunk_cat and concat: out of the wrong shape


def test_chunk_cat_out_of_the_wrong_shape_raises_untouched(path):
    tensors = [fresh(15).view(5, 3), fresh(11)]
    out_pool = poisoned((64,), torch.float32, DEVICE)
    out = out_pool[:30].view(3, 10)
    assert_bits(chunk_cat(tensors, 3, factor=2.0, out=out), chunk_cat_ref(tensors, 3, factor=2.0))
    for wrong in (out_pool[:33].view(3, 11), out_pool[:27].view(3, 9), out_pool[:30].view(10, 3),
                  out_pool[:30].view(3, 10).view(torch.int32).view(torch.float32)[:, :9]):
        before, shape = out_pool.clone(), wrong.shape
        with pytest.raises(ValueError, match=r"chunk_cat out"):
            chunk_cat(tensors, 3, factor=2.0, out=wrong)
        assert wrong.shape == shape, "out was resized"
        assert torch.equal(out_pool.view(torch.int32), before.view(torch.int32)), "out was written"
    # One more tensor, one fewer: the key's addresses fix the count.
    with pytest.raises(ValueError, match=r"chunk_cat out has shape \(3, 10\)"):
        chunk_cat([*tensors, fresh(3)], 3, factor=2.0, out=out)
    assert_bits(chunk_cat(tensors[:1], 3, factor=2.0), chunk_cat_ref(tensors[:1], 3, factor=2.0))
    # The same addresses, inputs reshaped: another row length, another out.
    reshaped = [tensors[0].view(3, 5), tensors[1]]
    got = chunk_cat(reshaped, 3, factor=2.0, out=out_pool[:27].view(3, 9))
    assert_bits(got, chunk_cat_ref(reshaped, 3, factor=2.0))


def test_chunk_cat_out_moved_onto_an_input(path):
    buf = fresh(64)
    parts = [buf[:8].view(4, 2), buf[8:16].view(4, 2)]
    chunk_cat(parts, 2, out=poisoned((2, 8), torch.float32, DEVICE))
    before = buf.clone()
    with pytest.raises(ValueError, match=r"chunk_cat: tensors\[1\] and out overlap"):
        chunk_cat(parts, 2, out=buf[10:26].view(2, 8))
    assert torch.equal(buf, before)


def test_concat_out_of_the_wrong_shape_raises_untouched(path):
    parts = [fresh(12).view(3, 4), fresh(8).view(2, 4)]
    out_pool = poisoned((64,), torch.float32, DEVICE)
    assert_bits(concat_microbatches(parts, out=out_pool[:20].view(5, 4)), torch.cat(parts))
    for wrong in (out_pool[:24].view(6, 4), out_pool[:16].view(4, 4), out_pool[:20].view(4, 5),
                  out_pool[:20].view(20)):
        before, shape = out_pool.clone(), wrong.shape
        with pytest.raises(ValueError, match=r"concat_microbatches out has shape"):
            concat_microbatches(parts, out=wrong)
        assert wrong.shape == shape, "out was resized"
        assert torch.equal(out_pool.view(torch.int32), before.view(torch.int32)), "out was written"
    with pytest.raises(TypeError, match=r"out has dtype torch.float16"):
        concat_microbatches(parts, out=out_pool.view(torch.float16)[:20].view(5, 4))
    buf = fresh(64)
    moved = [buf[:12].view(3, 4), buf[12:20].view(2, 4)]
    concat_microbatches(moved, out=out_pool[:20].view(5, 4))
    before = buf.clone()
    with pytest.raises(ValueError, match=r"concat_microbatches: tensors\[1\] and out overlap"):
        concat_microbatches(moved, out=buf[16:36].view(5, 4))  # an out that moved onto the inputs
    assert torch.equal(buf, before)


def test_concat_parts_reshaped_at_the_same_addresses(path):
    x = fresh(48)
    for parts in ([x[:20].view(5, 4), x[20:].view(7, 4)], [x[:20].view(10, 2), x[20:].view(14, 2)],
                  [x[:20].view(5, 4), x[20:].view(7, 4)]):
        assert_bits(concat_microbatches(parts), torch.cat(parts))
        got = concat_microbatches(parts, out=poisoned((sum(p.shape[0] for p in parts), parts[0].shape[1]),
                                                      torch.float32, DEVICE))
        assert_bits(got, torch.cat(parts))


def test_strided_input_with_other_strides_into_out(guard):
    # The PyTorch path caches plans for non-contiguous inputs: a plan keyed by address, shape, dtype and contiguity
    # alone (as before the guard) served the second call below and let it read an input that overlaps out.
    buf = fresh(64)
    before = buf.clone()
    with _crossover.override(dict.fromkeys(_crossover.FAMILIES, "torch"), kind=KIND):
        out = buf[32:40].view(2, 4)
        chunk_cat([buf[:16].view(4, 4)[:, :2]], 2, out=out)
        with pytest.raises(ValueError, match=r"chunk_cat: tensors\[0\] and out overlap"):
            chunk_cat([buf.as_strided((4, 2), (11, 1), 0)], 2, out=out)  # elements 33, 34 are in out
        out = buf[40:48].view(4, 2)
        concat_microbatches([buf[:16].view(4, 4)[:, :2]], out=out)
        with pytest.raises(ValueError, match=r"concat_microbatches: tensors\[0\] and out overlap"):
            concat_microbatches([buf.as_strided((4, 2), (13, 1), 0)], out=out)  # elements 39, 40
    assert torch.equal(buf[:32], before[:32])


def test_requires_grad_toggled_between_calls(path):
    # A guard also checks requires_grad: a change is a miss, not a wrong answer.
    srcs = [fresh(9), fresh(4)]
    out = poisoned((13,), torch.bfloat16, DEVICE)
    for flag in (False, True, False):
        srcs[0].requires_grad_(flag)
        with torch.no_grad():
            cast_shards(srcs, out)
        assert_bits(out, torch.cat([s.detach() for s in srcs]).bfloat16())


# ------------------------------------------------------------------ several layouts at one set of addresses


def test_layouts_at_the_same_addresses_keep_a_plan_each(path, monkeypatch):
    # What the caching allocator does between layers: other shapes at the same addresses, call after call.
    cache = _concat_module()._PLANS
    stored = []
    original = cache.put
    monkeypatch.setattr(cache, "put", lambda key, plan: (stored.append(plan), original(key, plan)))
    x = fresh(60)
    layouts = [[x[:24].view(6, 4), x[24:].view(9, 4)], [x[:24].view(12, 2), x[24:].view(18, 2)],
               [x[:24].view(3, 8), x[24:48].view(3, 8)], [x[:24].view(24, 1), x[24:].view(36, 1)]]
    for _ in range(3):
        for parts in layouts:
            assert_bits(concat_microbatches(parts), torch.cat(parts))
    assert len(stored) == 4, "each layout's plan is built once"
    assert len(cache) == 1  # one set of addresses: one key
    fifth = [x[:24].view(2, 12), x[24:48].view(2, 12)]
    for parts in (fifth, layouts[0], layouts[1]):  # past `layouts` plans per key, the oldest goes
        assert_bits(concat_microbatches(parts), torch.cat(parts))
    assert len(stored) == 7
    for parts in (fifth, *layouts):
        assert_bits(concat_microbatches(parts), torch.cat(parts))
    assert len(stored) == 9  # the fifth hits; layouts[2] and layouts[3] had been dropped in turn


# ------------------------------------------------------------------ helpers


def _concat_module():
    import importlib

    return importlib.import_module("shardfuse.kernels._concat")  # the attribute of the package is the function


def _as_list(x):
    return x if isinstance(x, list) else [x]


def _poisoned_like(out):
    if isinstance(out, list):
        return [poisoned(o.shape, o.dtype, DEVICE) for o in out]
    return poisoned(out.shape, out.dtype, DEVICE)


def _fill_nan(out) -> None:
    for o in _as_list(out):
        o.fill_(float("nan"))
