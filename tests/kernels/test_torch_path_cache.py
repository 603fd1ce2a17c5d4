"""The cached plans of the dispatching entry points' PyTorch path (below the size crossover, ``_crossover``).

A repeat call that takes the PyTorch path reuses its launch plan: the flat ``cast_shards`` keeps the split
sizes that cut ``out`` into the destinations, the list form keys sources and destinations together, and
``chunk_cat`` re-checks only the factor. Such a plan must serve only calls whose tensors have the addresses,
sizes, dtypes and layouts it was built for: tensors that reuse the addresses with other sizes, dtypes, offsets
or strides get a plan of their own (or the error the validating path gives), and results equal the reference
bit for bit. The plans hold no tensors. On CPU the plans serve tensors under Triton's interpreter
(tests/conftest.py sets TRITON_INTERPRET=1); each test forces the PyTorch path for this device's kind.
"""

from __future__ import annotations

import gc
import random
import weakref

import pytest
import torch

from bench.kernels import dispatch_overhead
from shardfuse.kernels import _cast_multi, _chunk_cat, _common, _concat, _crossover
from shardfuse.kernels._cast_multi import _flat_pieces, cast_shards, cast_shards_ref
from shardfuse.kernels._chunk_cat import chunk_cat, chunk_cat_ref
from shardfuse.kernels._concat import concat_microbatches
from tests._asserts import assert_bits, assert_same
from tests.conftest import kernel_device, poisoned

DEVICE = kernel_device()
KIND = _crossover.gpu_kind(torch.device(DEVICE))


@pytest.fixture
def torch_path():
    _common.clear_plan_caches()
    with _crossover.override(dict.fromkeys(_crossover.FAMILIES, "torch"), kind=KIND):
        yield
    _common.clear_plan_caches()


@pytest.fixture
def builds(monkeypatch):
    """Plans built by the flat and list cast_shards, chunk_cat and concat (each plan built is counted)."""
    count = [0]
    for module in (_cast_multi, _chunk_cat, _concat):
        original = module._PLANS.put

        def counting(key, plan, original=original):
            count[0] += key is not None
            original(key, plan)

        monkeypatch.setattr(module._PLANS, "put", counting)
    return count


def fresh(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    # Values exact in bf16 and fp16 too, so every cast compares bit for bit.
    return (torch.randint(-64, 64, (n,), device=DEVICE) / 4).to(dtype)


def refill(*tensors: torch.Tensor) -> None:
    for t in tensors:
        t.copy_(fresh(t.numel(), t.dtype).view(t.shape))


def check_flat(srcs, out, offsets=None) -> None:
    """cast_shards into a flat ``out`` equals the reference into a poisoned copy of it (gaps stay NaN)."""
    expected = cast_shards_ref(srcs, poisoned(out.shape, out.dtype, DEVICE), offsets=offsets)
    out.fill_(float("nan"))
    cast_shards(srcs, out, offsets=offsets)
    assert_bits(out, expected)


# ------------------------------------------------------------------ flat cast_shards: the split sizes


def test_flat_pieces_cut_out_the_destinations():
    rng = random.Random(0)
    for _ in range(500):
        numels = [rng.choice([0, 0, 1, 2, 5, 9]) for _ in range(rng.randint(0, 7))]
        order = rng.sample(range(len(numels)), len(numels))
        offsets, pos = [0] * len(numels), 0
        for i in order:  # disjoint ranges in a random order, gaps between some
            if numels[i]:
                pos += rng.choice([0, 0, 1, 3])
                offsets[i], pos = pos, pos + numels[i]
        for i in range(len(numels)):
            if not numels[i]:
                offsets[i] = rng.randint(0, pos)  # an empty destination anywhere, inside others' ranges too
        total = pos + rng.choice([0, 2])
        sizes, pick = _flat_pieces(offsets, numels, total)
        flat = torch.arange(total)
        pieces = flat.split_with_sizes(sizes)
        got = pieces[: len(numels)] if pick is None else [pieces[j] for j in pick]
        assert [p.data_ptr() for p in got if p.numel()] == [flat[o:].data_ptr() for o, k in zip(offsets, numels) if k]
        for piece, o, k in zip(got, offsets, numels, strict=True):
            assert torch.equal(piece, flat[o : o + k]), (offsets, numels, total, sizes, pick)
    assert _flat_pieces([0, 3, 3], [3, 0, 4], 7) == ((3, 0, 4), None)  # back to back: no extra piece


def test_flat_hits_read_new_contents(torch_path, builds):
    srcs = [fresh(k) for k in (7, 0, 131, 1)]
    out = poisoned((139 + 5,), torch.bfloat16, DEVICE)
    for _ in range(3):
        refill(*srcs)
        check_flat(srcs, out)
    assert builds[0] == 1


def test_flat_same_addresses_other_sizes_dtypes_offsets_shapes(torch_path, builds):
    # Views of two pools: every call below reuses the addresses of the one before with something else.
    pool = fresh(512)
    out_pool = poisoned((256,), torch.bfloat16, DEVICE)
    a, b = pool[:7], pool[64:195]
    check_flat([a, b], out_pool[:138])
    check_flat([pool[:5], pool[64:197]], out_pool[:138])  # same addresses, other numels, same total
    check_flat([a, b], out_pool[:200])  # out at the same address, longer: a tail nobody writes
    check_flat([a, b], out_pool.view(torch.float16)[:138])  # out at the same address, another dtype
    check_flat([a, b], out_pool[:144].view(12, 12))  # 2-D out at the same address
    check_flat([a, b], out_pool[:200], offsets=[150, 2])  # offsets: gaps, order reversed
    check_flat([a, b], out_pool[:200], offsets=[0, 60])
    check_flat([pool[:8], b], out_pool[:200])
    check_flat([pool[:8].view(2, 4), b], out_pool[:200])  # 2-D: the same address, numel and dtype
    check_flat([pool[:7].view(torch.int16)[:7].view(torch.bfloat16), b], out_pool[:138])  # another source dtype
    check_flat([a, pool[64:64], b], out_pool[:138], offsets=[0, 100, 7])  # an empty one inside another's range
    assert builds[0] == 11
    with pytest.raises(ValueError, match=r"out must be contiguous"):
        cast_shards([a, b], out_pool[:144].view(12, 12).t())  # the cached 2-D out's address and shape
    with pytest.raises(ValueError, match=r"destination ranges overlap"):
        cast_shards([a, b], out_pool[:200], offsets=[0, 6])  # the cached [0, 60] does not serve it


def test_flat_reallocated_tensors(torch_path):
    # Freed and allocated again: the allocator may hand out the same addresses with other sizes.
    for sizes in ([7, 300, 5], [300, 7, 5], [7, 300, 5], [4, 4, 4, 4], [7, 300, 5]):
        srcs = [fresh(k) for k in sizes]
        out = poisoned((sum(sizes) + 3,), torch.float16, DEVICE)
        check_flat(srcs, out)
        del srcs, out
        gc.collect()


# ------------------------------------------------------------------ list cast_shards: one key for both lists


def test_list_key_keeps_sources_and_destinations_apart(torch_path, builds):
    a, b = fresh(5), fresh(6)
    c, d = poisoned((5,), torch.bfloat16, DEVICE), poisoned((6,), torch.bfloat16, DEVICE)
    for _ in range(2):
        refill(a, b)
        cast_shards([a, b], [c, d])
        assert_bits(c, a.bfloat16())
        assert_bits(d, b.bfloat16())
    assert builds[0] == 1
    # The same four tensors, cut elsewhere: the joined key is the same, the count of sources is not.
    with pytest.raises(ValueError, match=r"len\(out\)=1 != len\(srcs\)=3"):
        cast_shards([a, b, c], [d])
    with pytest.raises(ValueError, match=r"len\(out\)=3 != len\(srcs\)=1"):
        cast_shards([a], [b, c, d])
    e = poisoned((5,), torch.float16, DEVICE)
    cast_shards([c, b], [e, d])  # a destination used as a source: other addresses in each place
    assert_bits(e, c.half())


def test_list_same_addresses_other_shapes(torch_path):
    pool, out_pool = fresh(64), poisoned((64,), torch.float32, DEVICE)
    for shapes in ([(12,), (20,)], [(3, 4), (20,)], [(12,), (4, 5)], [(10,), (22,)]):
        srcs, pos = [], 0
        for shape in shapes:
            n = shape[0] * (shape[1] if len(shape) > 1 else 1)
            srcs.append(pool[pos : pos + n].view(shape))
            pos += n
        outs = [out_pool[32 : 32 + s.numel()] for s in srcs[:1]] + [out_pool[: srcs[1].numel()]]
        out_pool.fill_(float("nan"))
        cast_shards(srcs, outs)
        for s, o in zip(srcs, outs):
            assert_bits(o, s.reshape(-1))
    square = pool[:16].view(4, 4)
    cast_shards([square], [out_pool[:16]])
    with pytest.raises(ValueError, match=r"srcs\[0\] must be contiguous"):
        cast_shards([square.t()], [out_pool[:16]])  # the same address, shape and dtype; other strides


# ------------------------------------------------------------------ chunk_cat: the factor checked on every hit


def test_chunk_cat_torch_plan_with_each_factor(torch_path, monkeypatch):
    calls = {"op": 0, "kernel": 0}
    real_op, real_kernel = torch._chunk_cat, _chunk_cat._chunk_cat_kernel

    def op(*args, **kwargs):
        calls["op"] += 1
        return real_op(*args, **kwargs)

    class Kernel:
        def __getitem__(self, grid):
            calls["kernel"] += 1
            return real_kernel[grid]

    monkeypatch.setattr(torch, "_chunk_cat", op)
    monkeypatch.setattr(_chunk_cat._chunk_cat_launch, "kernel", Kernel())
    tensors = [fresh(15, torch.bfloat16).view(5, 3), fresh(11, torch.bfloat16)]
    out = poisoned((3, 10), torch.bfloat16, DEVICE)
    for factor in (1.0, 2.0, 0.5):  # 1 or a power of two: PyTorch's op, from one plan
        refill(*tensors)
        assert_bits(chunk_cat(tensors, 3, factor=factor, out=out), chunk_cat_ref(tensors, 3, factor=factor))
    assert calls == {"op": 3, "kernel": 0}
    refill(*tensors)
    got = chunk_cat(tensors, 3, factor=3.0, out=out)  # not a multiply: the kernel
    assert calls == {"op": 3, "kernel": 1}
    assert_same(got, chunk_cat_ref(tensors, 3, factor=3.0))  # 1 bf16 ulp under the interpreter
    for factor in (4.0, 1.0):
        refill(*tensors)
        assert_bits(chunk_cat(tensors, 3, factor=factor, out=out), chunk_cat_ref(tensors, 3, factor=factor))
    with pytest.raises(ValueError, match="finite number > 0"):
        chunk_cat(tensors, 3, factor=0.0, out=out)


def test_chunk_cat_same_addresses_other_layouts(torch_path):
    pool = fresh(64, torch.bfloat16)
    first = [pool[:15].view(5, 3), pool[16:27]]
    assert_bits(chunk_cat(first, 3), chunk_cat_ref(first, 3))
    square = pool[32:48].view(4, 4)
    # At the PyTorch plan's addresses: an empty or a 0-dim tensor (PyTorch rejects them: the kernel runs), another
    # shape; then a square tensor and its transpose (the same address, shape and dtype, other strides).
    others = ([pool[:0], pool[16:27]], [pool[0], pool[16:27]], [pool[:15].view(3, 5), pool[16:27]], [square],
              [square.t()])
    for tensors in others:
        assert_bits(chunk_cat(tensors, 3), chunk_cat_ref(tensors, 3))


# ------------------------------------------------------------------ concat, and no tensor kept alive


def test_concat_torch_plan_same_addresses_other_shape(torch_path):
    x = fresh(48, torch.bfloat16)
    for parts in ([x[:20].view(5, 4), x[20:].view(7, 4)], [x[:20].view(10, 2), x[20:].view(14, 2)]):
        for _ in range(2):
            refill(*parts)
            got = concat_microbatches(parts, out=poisoned((sum(p.shape[0] for p in parts), parts[0].shape[1]),
                                                          torch.bfloat16, DEVICE))
            assert_bits(got, torch.cat(parts))


def test_torch_path_plans_keep_no_tensor_alive(torch_path):
    srcs = [fresh(9), fresh(4)]
    out, outs = poisoned((13,), torch.bfloat16, DEVICE), [poisoned((9,), torch.bfloat16, DEVICE)]
    grads = [fresh(12, torch.bfloat16).view(4, 3)]
    cast_shards(srcs, out)
    cast_shards(srcs[:1], outs)
    chunk_cat(grads, 2, factor=2.0)
    concat_microbatches(grads)
    refs = [weakref.ref(t) for t in (*srcs, out, *outs, *grads)]
    del srcs, out, outs, grads
    gc.collect()
    assert all(r() is None for r in refs), "a cached plan keeps a tensor alive"


# ------------------------------------------------------------------ the host-overhead benchmark compares like with like


def test_benchmark_pairs_compute_the_same(torch_path):
    for pair in dispatch_overhead.pairs(numel=40, device=DEVICE):
        pair.bare()
        expected = [t.clone() for t in _as_list(pair.result())]
        for t in _as_list(pair.result()):
            t.fill_(float("nan"))
        pair.call()
        for got, want in zip(_as_list(pair.result()), expected, strict=True):
            assert_bits(got, want)


def _as_list(x):
    return x if isinstance(x, list) else [x]
