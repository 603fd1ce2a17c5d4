"""The launch-plan caches of the multi-tensor launchers (``shardfuse.kernels._common.PlanCache``).

A repeat call with the same tensors must reuse its plan (no new metadata table) and still compute from the
tensors' current contents; a call whose tensors merely share addresses with a cached call's, but differ in
size, dtype, shape or strides, must not get the stale plan; the caches stay bounded and keep no tensors
alive. On CPU the kernels run under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1).
"""

from __future__ import annotations

import gc
import importlib
import threading
import time
import weakref

import pytest
import torch

from shardfuse.kernels import _common
from shardfuse.kernels._common import clear_plan_caches, interpreting
from shardfuse.kernels._grad_divide import pre_divide_pad_ref
from tests.conftest import kernel_device, poisoned

DEVICE = kernel_device()
# By module path: shardfuse.kernels._chunk_cat the attribute is the function, not the module.
# The multi-tensor forms are the ones with plans: cast_shards and the list form of pre_divide_pad.
MODULES = {m: importlib.import_module(f"shardfuse.kernels._{m}") for m in ("cast_multi", "chunk_cat", "concat",
                                                                          "flatten", "grad_divide_multi")}
cast, chunk_cat, concat, flatten, grad_divide = MODULES.values()


@pytest.fixture(autouse=True)
def _empty_caches():
    clear_plan_caches()
    yield
    clear_plan_caches()


@pytest.fixture
def builds(monkeypatch):
    """Counts the metadata tables built (one per launch of a plan built from scratch)."""
    original = _common.block_table
    count = [0]

    def counting(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(_common, "block_table", counting)  # every kernel module calls it through _common
    return count


def rand(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    # Values exact in fp16 and bf16 as well, so casts compare exactly even under the interpreter.
    return torch.randint(-64, 64, shape, device=DEVICE).to(dtype) / 4


def refill(*tensors: torch.Tensor) -> None:
    """New contents, same storage: what the FSDP data path does between two steps."""
    for t in tensors:
        t.copy_(rand(*t.shape, dtype=t.dtype))


def poison(*tensors: torch.Tensor) -> None:
    for t in tensors:
        t.fill_(float("nan"))


def expect_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)


# ------------------------------------------------------------------ hits see new contents


def test_cast_shards_flat_hit_reads_new_contents(builds, triton_path):
    srcs = [rand(k) for k in (7, 0, 4099, 131)]
    out = poisoned((4237 + 5,), torch.bfloat16, DEVICE)
    view = out[:4237]
    cast.cast_shards(srcs, view)
    assert builds[0] == 1
    for _ in range(2):
        refill(*srcs)
        poison(out)
        assert cast.cast_shards(srcs, view) is view
        expect_equal(view, torch.cat(srcs).to(torch.bfloat16))
        assert out[4237:].isnan().all(), "the tail past the sources was written"
    assert builds[0] == 1, "a repeat call rebuilt its table"


def test_cast_shards_list_hit_reads_new_contents(builds, triton_path):
    srcs = [rand(k, dtype=dt) for k, dt in ((5, torch.float32), (300, torch.float16), (9, torch.float32))]
    outs = [poisoned((s.numel(),), dt, DEVICE) for s, dt in zip(srcs, (torch.bfloat16, torch.float32, torch.float16))]
    cast.cast_shards(srcs, outs)
    first = builds[0]
    assert first == 3  # three (source, destination) dtype pairs
    refill(*srcs)
    poison(*outs)
    cast.cast_shards(srcs, outs)
    assert builds[0] == first
    for s, o in zip(srcs, outs):
        expect_equal(o, s.to(o.dtype))


def test_flatten_unflatten_hit_reads_new_contents(builds):
    tensors = [rand(5, 3).t(), rand(7), rand(2, 2, dtype=torch.float16)]
    out = poisoned((flatten.padded_numel(26, 4),), torch.float32, DEVICE)
    flatten.flatten_pad(tensors, 4, out=out)
    refill(*tensors)
    poison(out)
    flatten.flatten_pad(tensors, 4, out=out)
    expected = torch.cat([t.reshape(-1).float() for t in tensors])
    expect_equal(out, torch.cat([expected, torch.zeros(2, device=DEVICE)]))
    outs = [poisoned(t.shape, t.dtype, DEVICE) for t in tensors]
    flatten.unflatten_into(out, outs)
    refill(out)
    poison(*outs)
    flatten.unflatten_into(out, outs)
    pos = 0
    for o in outs:
        expect_equal(o, out[pos : pos + o.numel()].view(o.shape).to(o.dtype))
        pos += o.numel()
    assert builds[0] == 4  # two launches (two dtypes) each way, each built once


def test_flatten_pad_hit_allocates_a_fresh_buffer(builds):
    tensors = [rand(3, 3), rand(4)]
    first = flatten.flatten_pad(tensors, 8)
    second = flatten.flatten_pad(tensors, 8)
    assert builds[0] == 1
    assert second.data_ptr() != first.data_ptr() and second.dtype == torch.float32 and second.numel() == 16
    expect_equal(second, first)


def test_concat_chunk_cat_pre_divide_hits_read_new_contents(builds, triton_path):
    parts = [rand(k, 6) for k in (3, 0, 5, 1)]
    cat_out = poisoned((9, 6), torch.float32, DEVICE)
    grads = [rand(k) for k in (5, 4099, 2)]
    pad_out = poisoned((4112,), torch.bfloat16, DEVICE)
    cc_out = poisoned((4, 4 * 6), torch.float16, DEVICE)
    for _ in range(3):
        refill(*parts, *grads)
        poison(cat_out, pad_out, cc_out)
        concat.concat_microbatches(parts, out=cat_out)
        expect_equal(cat_out, torch.cat(parts))
        grad_divide.pre_divide_pad(grads, pad_out, 2.0)
        expected = torch.cat([torch.cat(grads) / 2, torch.zeros(6, device=DEVICE)]).to(torch.bfloat16)
        expect_equal(pad_out, expected)
        chunk_cat.chunk_cat(parts, 4, factor=4.0, out=cc_out)
        expect_equal(cc_out, chunk_cat.chunk_cat_ref(parts, 4, factor=4.0, dtype=torch.float16))
    assert builds[0] == 3, "each launcher should have built its table once"


def _pre_divide_expected(grads: list[torch.Tensor], out: torch.Tensor, factor: float) -> torch.Tensor:
    return pre_divide_pad_ref(grads, torch.empty_like(out), factor)


def test_pre_divide_pad_same_shapes_at_other_addresses_rewrites_the_table(builds, triton_path):
    # The runtime's gradients come back every step with the same shapes at other addresses: one table, its
    # source addresses rewritten; every set kept alive, so a stale address would read another set's values.
    shapes = (5, 4099, 0, 2, 131)
    sets = [[rand(k) for k in shapes] for _ in range(3)]
    outs = [poisoned((4240,), torch.float32, DEVICE) for _ in range(2)]
    for i, (grads, out) in enumerate([(sets[0], outs[0]), (sets[1], outs[0]), (sets[0], outs[1]),
                                      (sets[2], outs[1]), (sets[1], outs[1]), (sets[0], outs[0])]):
        refill(*grads)
        poison(out)
        grad_divide.pre_divide_pad(grads, out, 3.0)
        expect_equal(out, _pre_divide_expected(grads, out, 3.0))
        assert builds[0] == 1, f"call {i}: a table was built again for gradients of the same shapes"
    grad_divide.pre_divide_pad([rand(k) for k in (5, 4098, 0, 2, 131)], outs[0][:4239], 3.0)
    assert builds[0] == 2, "another shape must build a table of its own"


def test_pre_divide_pad_rewrite_without_foreach(builds, triton_path, monkeypatch):
    # Where torch lacks _foreach_add_, each changed entry is rewritten by its own add_: the same results.
    monkeypatch.setattr(grad_divide, "_FOREACH_ADD", False)
    sets = [[rand(k) for k in (9, 300, 1)] for _ in range(2)]
    out = poisoned((320,), torch.float32, DEVICE)
    for grads in (sets[0], sets[1], sets[0]):
        refill(*grads)
        poison(out)
        grad_divide.pre_divide_pad(grads, out, 2.0)
        expect_equal(out, _pre_divide_expected(grads, out, 2.0))
    assert builds[0] == 1


def test_pre_divide_pad_rewrite_misaligned_sources(triton_path):
    # A rewrite to addresses that are not 16-byte aligned must drop the aligned launch (and the next aligned
    # set bring it back): every result against the reference.
    bufs = [rand(4200) for _ in range(3)]
    out = poisoned((4200,), torch.float32, DEVICE)
    for buf, start in [(bufs[0], 0), (bufs[1], 1), (bufs[2], 4), (bufs[0], 3), (bufs[1], 0)]:
        grads = [buf[start:start + 2048], buf[start + 2048:start + 4096]]
        refill(buf)
        poison(out)
        grad_divide.pre_divide_pad(grads, out, 2.0)
        expect_equal(out, _pre_divide_expected(grads, out, 2.0))


def test_pre_divide_pad_threads_rewriting_one_table(triton_path, monkeypatch):
    # Two threads on one stream (the CPU's) share the plan of their shapes, each with gradients of its own: the
    # rewrite and the launch that reads it are one step under the plan's lock. Each launch waits a moment first,
    # so that without that lock the other thread rewrites the table in between; the launches themselves are
    # serialized (Triton's interpreter runs one kernel at a time).
    launching = threading.Lock()
    real = grad_divide._run_multi

    def slow_launch(*args):
        time.sleep(0.002)
        with launching:
            return real(*args)

    monkeypatch.setattr(grad_divide, "_run_multi", slow_launch)
    shapes = (3, 70, 1)
    errors: list[str] = []
    start = threading.Barrier(2)
    grad_divide.pre_divide_pad([rand(k) for k in shapes], poisoned((80,), torch.float32, DEVICE), 1.0)  # the plan

    def worker(seed: int) -> None:
        grads = [rand(k) for k in shapes]
        out = poisoned((80,), torch.float32, DEVICE)
        start.wait()
        try:
            for i in range(12):
                refill(*grads)
                grad_divide.pre_divide_pad(grads, out, float(seed))
                if not torch.equal(out, _pre_divide_expected(grads, out, float(seed))):
                    errors.append(f"thread {seed}, call {i}: another thread's gradients")
        except Exception as e:  # noqa: BLE001 - reported by the assertion below, not lost in the thread
            errors.append(f"thread {seed}: {e!r}")

    threads = [threading.Thread(target=worker, args=(k,)) for k in (2, 4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_factor_is_not_cached():
    grads = [rand(6), rand(3)]
    out = poisoned((9,), torch.float32, DEVICE)
    for factor in (1.0, 2.0, 8.0):
        grad_divide.pre_divide_pad(grads, out, factor)
        expect_equal(out, torch.cat(grads) / factor)
    for factor in (1.0, 4.0):
        out = chunk_cat.chunk_cat(grads, 2, factor=factor)
        expect_equal(out, chunk_cat.chunk_cat_ref(grads, 2, factor=factor))
    with pytest.raises(ValueError, match="finite number > 0"):
        grad_divide.pre_divide_pad(grads, out.view(-1)[:9], 0.0)
    with pytest.raises(ValueError, match="finite number > 0"):
        chunk_cat.chunk_cat(grads, 2, factor=-1.0)


# ------------------------------------------------------------------ no stale plans


def test_cast_shards_same_address_other_numel_or_dtype():
    base = rand(64)
    out = poisoned((64,), torch.float16, DEVICE)
    cast.cast_shards([base[:40]], out[:40])
    poison(out)
    cast.cast_shards([base[:24]], out[:24])  # same addresses, fewer elements
    expect_equal(out[:24], base[:24].half())
    assert out[24:].isnan().all(), "a stale plan wrote the old, longer range"
    halves = base.view(torch.float16)[:64]  # same address, same numel, another dtype
    poison(out)
    cast.cast_shards([halves], out)
    expect_equal(out, halves)
    poison(out)
    cast.cast_shards([base[:24]], [out[:24]])  # list form: same addresses again
    expect_equal(out[:24], base[:24].half())


def test_cast_shards_offsets_are_in_the_key():
    srcs = [rand(3), rand(2)]
    out = poisoned((8,), torch.float32, DEVICE)
    cast.cast_shards(srcs, out, offsets=[0, 3])
    poison(out)
    cast.cast_shards(srcs, out, offsets=[5, 0])
    expect_equal(out[5:], srcs[0])
    expect_equal(out[:2], srcs[1])
    assert out[2:5].isnan().all()


def test_flatten_same_address_other_strides():
    w = rand(5, 5)  # square: the transpose has the same address, shape, numel and dtype
    first = flatten.flatten_pad([w], 1)
    expect_equal(first, w.reshape(-1))
    second = flatten.flatten_pad([w.t()], 1)
    expect_equal(second, w.t().reshape(-1))
    out = poisoned((5, 5), torch.float32, DEVICE)
    flatten.unflatten_into(first, [out])
    poison(out)
    flatten.unflatten_into(first, [out.t()])
    expect_equal(out.t(), first.view(5, 5))


def test_concat_and_chunk_cat_same_address_other_shape():
    x = rand(12, 4)
    expect_equal(concat.concat_microbatches([x[:5], x[5:]]), x)
    flat = x.view(-1)
    expect_equal(concat.concat_microbatches([flat[:20], flat[20:]]), flat)  # same addresses, 1-D
    expect_equal(chunk_cat.chunk_cat([x], 4), chunk_cat.chunk_cat_ref([x], 4))
    y = x.view(4, 12)  # same address and numel: other chunks
    expect_equal(chunk_cat.chunk_cat([y], 4), chunk_cat.chunk_cat_ref([y], 4))
    expect_equal(chunk_cat.chunk_cat([x.t()], 4), chunk_cat.chunk_cat_ref([x.t()], 4))  # strided: a copy


def test_dtype_argument_is_in_the_key():
    tensors = [rand(6, 2), rand(3)]
    for dt in (None, torch.bfloat16, torch.float16, None):
        out = chunk_cat.chunk_cat(tensors, 2, dtype=dt)
        assert out.dtype == (dt or torch.float32)
        expect_equal(out, chunk_cat.chunk_cat_ref(tensors, 2, dtype=dt))
        flat = flatten.flatten_pad(tensors, 4, dtype=dt)
        assert flat.dtype == (dt or torch.float32)
        expect_equal(flat, flatten.flatten_pad_ref(tensors, 4, dtype=dt))


def test_errors_still_raised_after_a_hit():
    srcs = [rand(5), rand(3)]
    out = torch.empty(8, dtype=torch.bfloat16, device=DEVICE)
    cast.cast_shards(srcs, out)
    with pytest.raises(ValueError, match=r"destination ranges overlap"):
        cast.cast_shards(srcs, out, offsets=[0, 4])
    with pytest.raises(ValueError, match=r"srcs\[1\] must be contiguous"):
        cast.cast_shards([srcs[0], rand(6)[::2]], out)
    with pytest.raises(TypeError, match=r"tensors\[1\] is a int"):
        concat.concat_microbatches([srcs[0], 3])
    with pytest.raises(TypeError, match=r"takes a sequence of tensors"):
        concat.concat_microbatches(srcs[0])


def test_overlap_checked_once_per_plan(monkeypatch):
    calls = []
    real = cast.check_no_overlap
    monkeypatch.setattr(cast, "check_no_overlap", lambda *a, **k: calls.append(a) or real(*a, **k))
    srcs = [rand(k) for k in (5, 300, 9)]
    outs = [poisoned((s.numel(),), torch.bfloat16, DEVICE) for s in srcs]
    for _ in range(3):
        cast.cast_shards(srcs, outs)
    assert len(calls) == 1, "a repeat call with the same tensors validated again"


def test_a_plan_does_not_serve_an_out_that_moved_onto_the_inputs():
    # Same inputs, an out of the same shape and dtype at another address: that address is in the key, so
    # the overlap check runs again instead of the cached plan writing over the inputs.
    buf = rand(64)
    before = buf.clone()
    first = poisoned((16,), torch.float32, DEVICE)
    flatten.flatten_pad([buf[:16]], 1, out=first)
    with pytest.raises(ValueError, match=r"flatten_pad: tensors\[0\] and out overlap"):
        flatten.flatten_pad([buf[:16]], 1, out=buf[8:24])
    parts = [buf[:4].view(2, 2), buf[4:8].view(2, 2)]
    concat.concat_microbatches(parts, out=poisoned((4, 2), torch.float32, DEVICE))
    with pytest.raises(ValueError, match=r"concat_microbatches: tensors\[1\] and out overlap"):
        concat.concat_microbatches(parts, out=buf[6:14].view(4, 2))
    chunk_cat.chunk_cat(parts, 2, out=poisoned((2, 4), torch.float32, DEVICE))
    with pytest.raises(ValueError, match=r"chunk_cat: tensors\[0\] and out overlap"):
        chunk_cat.chunk_cat(parts, 2, out=buf[2:10].view(2, 4))
    grads = [buf[:5], buf[5:9]]
    grad_divide.pre_divide_pad(grads, poisoned((10,), torch.float32, DEVICE), 2.0)
    with pytest.raises(ValueError, match=r"pre_divide_pad: grads\[0\] and out\[0:5\] overlap"):
        grad_divide.pre_divide_pad(grads, buf[1:11], 2.0)
    assert torch.equal(buf, before), "a cached plan wrote over its inputs"
    outs = [buf[22:26]]
    flatten.unflatten_into(rand(4), outs)
    before = buf.clone()
    with pytest.raises(ValueError, match=r"unflatten_into: flat and outs\[0\] overlap"):
        flatten.unflatten_into(buf[20:24], outs)  # the same outputs, a flat that moved onto them
    assert torch.equal(buf, before), "a cached plan wrote over its inputs"


# ------------------------------------------------------------------ bounded, holds no tensors


def test_cache_is_bounded_lru(builds, triton_path):
    sources = [rand(k + 1) for k in range(70)]
    outs = [poisoned((k + 1,), torch.float32, DEVICE) for k in range(70)]
    for s, o in zip(sources, outs):
        cast.cast_shards([s], o)
    assert len(cast._PLANS) == cast._PLANS.maxsize == 64
    assert builds[0] == 70
    cast.cast_shards([sources[-1]], outs[-1])  # recent: a hit
    assert builds[0] == 70
    cast.cast_shards([sources[0]], outs[0])  # evicted: rebuilt, and still right
    assert builds[0] == 71
    expect_equal(outs[0], sources[0])


def test_cache_keeps_no_tensor_alive():
    src, out = rand(100), poisoned((100,), torch.bfloat16, DEVICE)
    cast.cast_shards([src], [out])
    flatten.flatten_pad([src], 8)
    concat.concat_microbatches([src, src])
    refs = [weakref.ref(src), weakref.ref(out)]
    del src, out
    gc.collect()
    assert all(r() is None for r in refs), "a cached plan holds a reference to a caller's tensor"


@pytest.mark.skipif(DEVICE != "cpu", reason="the reference path is taken by CPU tensors only")
def test_cached_cpu_plan_not_used_without_interpreter(monkeypatch, builds):
    assert interpreting()
    srcs = [rand(9), rand(4)]
    out = poisoned((13,), torch.float16, DEVICE)
    cast.cast_shards(srcs, out)
    monkeypatch.setattr(cast._cast_shards_launch, "kernel", None)  # any launch now fails
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    poison(out)
    cast.cast_shards(srcs, out)
    expect_equal(out, torch.cat(srcs).half())


# ------------------------------------------------------------------ GPU only


@pytest.mark.gpu
def test_gpu_plan_per_stream(builds, triton_path):
    srcs = [torch.randn(k, device="cuda") for k in (4099, 1, 777)]
    out = poisoned((4877,), torch.bfloat16, "cuda")
    cast.cast_shards(srcs, out)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        poison(out)
        cast.cast_shards(srcs, out)  # a plan of its own: its table is copied on this stream
        cast.cast_shards(srcs, out)
    torch.cuda.current_stream().wait_stream(side)
    assert builds[0] == 2
    expect_equal(out, torch.cat(srcs).to(torch.bfloat16))


@pytest.mark.gpu
def test_gpu_pre_divide_pad_new_addresses_copy_nothing_to_the_device(builds, triton_path):
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    shapes = (4099, 1, 777, 65536)
    out = poisoned((70416,), torch.bfloat16, "cuda")  # 70413 gradient elements, 3 of padding
    grad_divide.pre_divide_pad([torch.randn(k, device="cuda") for k in shapes], out, 2.0)
    grads = [torch.randn(k, device="cuda") for k in shapes]
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        grad_divide.pre_divide_pad(grads, out, 2.0)
        torch.cuda.synchronize()
    copies = [e.name for e in prof.events() if e.device_type == DeviceType.CUDA and "HtoD" in e.name]
    assert not copies, f"a host-to-device copy for gradients at new addresses: {copies}"
    assert builds[0] == 1
    expect_equal(out, pre_divide_pad_ref(grads, torch.empty_like(out), 2.0))
    graph = torch.cuda.CUDAGraph()
    captured = [torch.randn(k, device="cuda") for k in shapes]
    with torch.cuda.graph(graph):
        grad_divide.pre_divide_pad(captured, out, 2.0)  # no key while capturing: a table of its own
    for _ in range(2):
        refill(*captured)
        graph.replay()
        torch.cuda.synchronize()
        expect_equal(out, pre_divide_pad_ref(captured, torch.empty_like(out), 2.0))
    grad_divide.pre_divide_pad(grads, out, 2.0)  # the plan by shape still holds these addresses
    expect_equal(out, pre_divide_pad_ref(grads, torch.empty_like(out), 2.0))


@pytest.mark.gpu
def test_gpu_nothing_cached_during_graph_capture():
    srcs = [torch.randn(k, device="cuda") for k in (300, 5)]
    out = torch.empty(305, device="cuda", dtype=torch.float16)
    cast.cast_shards(srcs, out)  # compile outside the capture
    clear_plan_caches()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cast.cast_shards(srcs, out)
    assert len(cast._PLANS) == 0
    refill(*srcs)
    graph.replay()
    torch.cuda.synchronize()
    expect_equal(out, torch.cat(srcs).half())
