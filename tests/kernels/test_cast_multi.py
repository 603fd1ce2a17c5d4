"""The multi-tensor shard cast (``cast_shards``, shardfuse.kernels._cast_multi) against its reference and
``Tensor.to``, the dispatch to ``torch._foreach_copy_`` past the crossover included.

On CPU the Triton kernels run under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1); on a
GPU the same tests run on CUDA tensors, and the ``gpu``-marked ones add launch-count checks.
"""

from __future__ import annotations

import pytest
import torch

from shardfuse.kernels import _cast_multi, _crossover
from shardfuse.kernels._cast_multi import cast_shards, cast_shards_ref, use_foreach
from shardfuse.kernels._common import clear_plan_caches, interpreting
from tests._asserts import assert_bits, max_ulp
from tests.conftest import cuda_kernels, kernel_device, poisoned
from tests.kernels.test_cast import DTYPES, fresh, pair_id

DEVICE = kernel_device()


def tiny_sources(count: int, dtypes: list[torch.dtype], max_numel: int = 40) -> list[torch.Tensor]:
    sizes = torch.randint(0, max_numel, (count,)).tolist()
    sizes[0], sizes[-1] = 0, max_numel + 3  # an empty one and one spanning an odd tail
    return [fresh(k, dtypes[i % len(dtypes)]) for i, k in enumerate(sizes)]


@pytest.mark.parametrize("dst", list(DTYPES), ids=str)
def test_cast_shards_flat_200_tiny_mixed(dst):
    dst_dt = DTYPES[dst]
    srcs = tiny_sources(200, list(DTYPES.values()))
    total = sum(s.numel() for s in srcs)
    buf = poisoned((total + 8,), dst_dt, DEVICE)
    out = buf[3 : 3 + total]
    assert cast_shards(srcs, out) is out
    expected = torch.cat([s.to(dst_dt) for s in srcs])
    ulp = 1 if interpreting() and dst_dt == torch.bfloat16 else 0
    assert_bits(out, expected, ulp)
    assert_bits(out, cast_shards_ref(srcs, poisoned((total,), dst_dt, DEVICE)), ulp)
    assert buf[:3].isnan().all() and buf[3 + total :].isnan().all(), "guard elements were overwritten"


def test_cast_shards_flat_with_offsets_leaves_gaps():
    srcs = [fresh(k, torch.float32) for k in (7, 0, 4099, 1, 131)]
    offsets = [100, 3, 4300, 0, 8500]  # out of order, with gaps
    out = poisoned((8700,), torch.float16, DEVICE)
    cast_shards(srcs, out, offsets=offsets)
    written = torch.zeros(8700, dtype=torch.bool, device=DEVICE)
    for s, o in zip(srcs, offsets):
        assert_bits(out[o : o + s.numel()], s.half())
        written[o : o + s.numel()] = True
    assert out[~written].isnan().all(), "elements outside the destination ranges were written"
    ref = cast_shards_ref(srcs, poisoned((8700,), torch.float16, DEVICE), offsets=offsets)
    assert_bits(out, ref)


def test_cast_shards_list_mixed_dtypes():
    pairs = [(a, b) for a in DTYPES.values() for b in DTYPES.values()] * 3
    sizes = [0, 1, 7, 131, 4099, 5, 64, 257, 3]
    srcs = [fresh(sizes[i % len(sizes)], a).view(-1, 1) for i, (a, _) in enumerate(pairs)]
    outs = [poisoned((s.numel(),), b, DEVICE) for s, (_, b) in zip(srcs, pairs)]
    result = cast_shards(srcs, outs)
    assert isinstance(result, list) and all(r is o for r, o in zip(result, outs))
    refs = cast_shards_ref(srcs, [poisoned((s.numel(),), b, DEVICE) for s, (_, b) in zip(srcs, pairs)])
    for s, o, r, (a, b) in zip(srcs, outs, refs, pairs):
        assert_bits(o, s.view(-1).to(b), max_ulp(a, b))
        assert_bits(o, r, max_ulp(a, b))


def test_cast_shards_empty():
    out = poisoned((4,), torch.bfloat16, DEVICE)
    assert cast_shards([], out) is out and out.isnan().all()
    assert cast_shards([], []) == []
    srcs = [torch.empty(0, device=DEVICE)] * 3
    assert cast_shards(srcs, poisoned((0,), torch.bfloat16, DEVICE)).numel() == 0


def test_cast_shards_errors():
    srcs = [fresh(5, torch.float32), fresh(3, torch.float32)]
    out = torch.empty(8, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(TypeError, match=r"srcs\[1\] has unsupported dtype torch.int64"):
        cast_shards([srcs[0], torch.arange(3, device=DEVICE)], out)
    with pytest.raises(ValueError, match=r"srcs\[1\] must be contiguous"):
        cast_shards([srcs[0], fresh(6, torch.float32)[::2]], out)
    with pytest.raises(ValueError, match=r"all tensors must be on one device.*out=meta"):
        cast_shards(srcs, torch.empty(8, device="meta"))
    with pytest.raises(ValueError, match=r"out is too small: out.numel\(\)=7 < required 8"):
        cast_shards(srcs, out[:7])
    with pytest.raises(ValueError, match=r"out is too small: out.numel\(\)=8 < required 13"):
        cast_shards(srcs, out, offsets=[0, 10])
    with pytest.raises(ValueError, match=r"len\(offsets\)=1 != len\(srcs\)=2"):
        cast_shards(srcs, out, offsets=[0])
    with pytest.raises(ValueError, match=r"offsets must be >= 0, got \[-1\]"):
        cast_shards(srcs, out, offsets=[-1, 4])
    with pytest.raises(ValueError, match=r"destination ranges overlap: srcs\[0\] ends at 5 but srcs\[1\] starts at 4"):
        cast_shards(srcs, out, offsets=[0, 4])
    with pytest.raises(ValueError, match=r"out must be contiguous"):
        cast_shards(srcs, torch.empty(16, device=DEVICE)[::2])
    with pytest.raises(ValueError, match=r"offsets only apply when out is one flat tensor"):
        cast_shards(srcs, [torch.empty(5, device=DEVICE), torch.empty(3, device=DEVICE)], offsets=[0, 5])
    with pytest.raises(ValueError, match=r"len\(out\)=1 != len\(srcs\)=2"):
        cast_shards(srcs, [torch.empty(5, device=DEVICE)])
    with pytest.raises(ValueError, match=r"out\[1\].numel\(\)=4 != srcs\[1\].numel\(\)=3"):
        cast_shards(srcs, [torch.empty(5, device=DEVICE), torch.empty(4, device=DEVICE)])
    with pytest.raises(TypeError, match=r"out\[0\] has unsupported dtype torch.int64"):
        cast_shards(srcs, [torch.empty(5, dtype=torch.int64, device=DEVICE), torch.empty(3, device=DEVICE)])
    with pytest.raises(ValueError, match=r"all tensors must be on one device.*out\[1\]=meta"):
        cast_shards(srcs, [torch.empty(5, device=DEVICE), torch.empty(3, device="meta")])


def test_cast_shards_list_overlapping_destinations_raise():
    srcs = [fresh(10, torch.float32), fresh(10, torch.float32)]
    buf = poisoned((20,), torch.bfloat16, DEVICE)
    with pytest.raises(ValueError, match=r"cast_shards: out\[0\] and out\[1\] overlap in memory .*destination of its"):
        cast_shards(srcs, [buf[0:10], buf[5:15]])
    with pytest.raises(ValueError, match=r"out\[0\] and out\[1\] overlap"):
        cast_shards_ref(srcs, [buf[0:10], buf[5:15]])
    with pytest.raises(ValueError, match=r"out\[0\] and out\[1\] overlap"):
        cast_shards(srcs, [buf[0:10], buf[0:10]])  # the same destination twice
    assert buf.isnan().all(), "an overlapping call wrote before it raised"


def test_cast_shards_destination_over_another_source_raises():
    buf = fresh(30, torch.float32)
    before = buf.clone()
    with pytest.raises(ValueError, match=r"srcs\[1\] and out\[0\] overlap"):
        cast_shards([buf[:10], buf[10:20]], [buf[12:22], buf[20:30]])
    flat = fresh(40, torch.float32)
    with pytest.raises(ValueError, match=r"srcs\[0\] and out\[20:30\] overlap"):
        cast_shards([flat[25:35], fresh(10, torch.float32), fresh(10, torch.float32)], flat[:30])
    assert torch.equal(buf, before)


def test_cast_shards_in_place_entries_are_allowed():
    buf = fresh(30, torch.float32)
    expected = buf.clone()
    cast_shards([buf[:10], buf[10:30]], [buf[:10], buf[10:30]])
    cast_shards([buf[:10], buf[10:30]], buf)  # back to back: each source is its own destination
    assert_bits(buf, expected)


def _no_kernel(*args, **kwargs):
    raise AssertionError("this path should not have run")


class _NoLaunch:
    """Stands in for a Triton kernel that must not be launched."""

    def __getitem__(self, grid):
        return _no_kernel


def test_use_foreach_decision(monkeypatch):
    srcs = [torch.zeros(1)] * _cast_multi.FOREACH_MIN_TENSORS
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # a CPU tensor stands for a CUDA one under the interpreter
    assert use_foreach(srcs) and use_foreach(srcs[:-1])  # 31 small tensors too: the sampled-size rule
    big = torch.zeros(_cast_multi.FOREACH_SMALL_MAX_NUMEL + 1)
    few = _cast_multi.FOREACH_SMALL_MIN_TENSORS
    assert use_foreach(srcs[:few]) and not use_foreach(srcs[: few - 1])
    assert not use_foreach([big, *srcs[: few - 1]]) and not use_foreach([*srcs[: few - 1], big])  # first or last big
    assert use_foreach([srcs[0], *[big] * (few - 2), srcs[0]])  # only the ends are sampled: same bits, its speed
    assert use_foreach([big, *srcs[:-1]])  # from FOREACH_MIN_TENSORS only large ends matter
    large = torch.zeros(_cast_multi.FOREACH_LARGE_MIN_NUMEL)
    ends = [large, *srcs[2:], large]
    assert len(ends) == len(srcs) and not use_foreach(ends)  # large ends: the kernel, where the rule takes it
    assert use_foreach([large, *srcs[1:]]) and use_foreach([*srcs[1:], large])  # one large end is not enough
    with _crossover.override({"cast_shards_list": "torch"}):
        assert use_foreach(ends)  # the rule sends such a call to PyTorch: _foreach_copy_ itself, not the plan's
    # the rule sees the call's bytes as if every tensor were the first: len x numel x (source + destination size)
    seen = []
    monkeypatch.setattr(_crossover.Crossover, "triton", lambda self, num, nbytes: seen.append((num, nbytes)) or True)
    halves = [torch.zeros(1, dtype=torch.float16)]
    assert not use_foreach(ends, halves) and not use_foreach(ends)
    n, k = len(ends), _cast_multi.FOREACH_LARGE_MIN_NUMEL
    assert seen[:2] == [(n, n * k * (4 + 2)), (n, n * k * (4 + 4))]
    assert not use_foreach([*srcs[: few - 1], 3.0])  # a non-tensor at the end: the validating path names it
    assert not use_foreach([3.0] * len(srcs))  # not tensors: the validating path names them
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not use_foreach(srcs)  # CPU tensors without the interpreter: the reference path


@pytest.mark.parametrize("dst", list(DTYPES), ids=str)
def test_cast_shards_foreach_branch_matches_reference(monkeypatch, dst):
    monkeypatch.setattr(_cast_multi, "FOREACH_MIN_TENSORS", 3)
    monkeypatch.setattr(_cast_multi._cast_shards_launch, "kernel", _NoLaunch())
    dst_dt = DTYPES[dst]
    srcs = [fresh(k, list(DTYPES.values())[i % 3]) for i, k in enumerate([7, 0, 131, 4099, 1, 64])]
    outs = [poisoned((s.numel(),), dst_dt, DEVICE) for s in srcs]
    result = cast_shards(srcs, outs)
    assert isinstance(result, list) and all(r is o for r, o in zip(result, outs))
    refs = cast_shards_ref(srcs, [poisoned((s.numel(),), dst_dt, DEVICE) for s in srcs])
    for o, r in zip(outs, refs):
        assert_bits(o, r)  # PyTorch's own copy: exact against the reference even under the interpreter


def test_cast_shards_below_the_crossover_runs_the_kernel(monkeypatch, triton_path):
    monkeypatch.setattr(torch, "_foreach_copy_", _no_kernel)
    srcs = [fresh(k, torch.float32) for k in (5, 17, 3)]
    outs = [poisoned((k,), torch.float16, DEVICE) for k in (5, 17, 3)]
    assert len(srcs) < _cast_multi.FOREACH_MIN_TENSORS
    cast_shards(srcs, outs)
    for s, o in zip(srcs, outs):
        assert_bits(o, s.half())


def test_cast_shards_foreach_branch_keeps_clear_errors(monkeypatch):
    monkeypatch.setattr(_cast_multi, "FOREACH_MIN_TENSORS", 2)
    t = fresh(4, torch.float32)
    with pytest.raises(TypeError, match=r"srcs\[1\] is a float, not a torch.Tensor"):
        cast_shards([t, 3.0], [torch.empty(4, device=DEVICE), torch.empty(4, device=DEVICE)])
    with pytest.raises(ValueError, match=r"out\[1\].numel\(\)=5 != srcs\[1\].numel\(\)=4"):
        cast_shards([t, t], [torch.empty(4, device=DEVICE), torch.empty(5, device=DEVICE)])
    # Same numels in shapes PyTorch will not broadcast: the kernel path takes them, with the same result.
    outs = [poisoned((4,), torch.bfloat16, DEVICE), poisoned((2, 2), torch.bfloat16, DEVICE)]
    cast_shards([t.view(4, 1), t], outs)
    ulp = max_ulp(torch.float32, torch.bfloat16)
    assert_bits(outs[0], t.to(torch.bfloat16), ulp)
    assert_bits(outs[1].view(-1), t.to(torch.bfloat16), ulp)


def test_cast_shards_many_tensors_with_large_ends_take_the_kernel(monkeypatch):
    """From FOREACH_MIN_TENSORS tensors, large first and last sources take the kernel (where the rule does): same
    bits as the reference, no _foreach_copy_; a 1-element source PyTorch would broadcast is refused there."""
    monkeypatch.setattr(_cast_multi, "FOREACH_MIN_TENSORS", 3)
    monkeypatch.setattr(_cast_multi, "FOREACH_LARGE_MIN_NUMEL", 64)
    monkeypatch.setattr(torch, "_foreach_copy_", _no_kernel)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    clear_plan_caches()
    sizes = [64, 5, 300, 1, 97]
    srcs = [fresh(k, torch.float32) for k in sizes]
    outs = [poisoned((k,), torch.bfloat16, DEVICE) for k in sizes]
    assert cast_shards(srcs, outs) is outs
    for s, o in zip(srcs, outs):
        assert_bits(o, s.to(torch.bfloat16), max_ulp(torch.float32, torch.bfloat16))
    with pytest.raises(ValueError, match=r"out\[1\].numel\(\)=5 != srcs\[1\].numel\(\)=1"):
        cast_shards([srcs[0], fresh(1, torch.float32), srcs[4]], [outs[0], outs[1], outs[4]])


def test_cast_shards_non_tensor_entries():
    t = fresh(4, torch.float32)
    out = torch.empty(8, device=DEVICE)
    with pytest.raises(TypeError, match=r"srcs\[1\] is a float, not a torch.Tensor: pass tensors only"):
        cast_shards([t, 3.0], out)
    with pytest.raises(TypeError, match=r"srcs\[1\] is a float"):
        cast_shards([t, 3.0], [out[:4], out[4:]])
    with pytest.raises(TypeError, match=r"out\[1\] is a NoneType"):
        cast_shards([t, t], [out[:4], None])
    with pytest.raises(TypeError, match=r"out must be a tensor or a list of tensors, got a NoneType"):
        cast_shards([t], None)
    with pytest.raises(TypeError, match=r"srcs must be a sequence of tensors, got a Tensor"):
        cast_shards(t, out)
    with pytest.raises(TypeError, match=r"offsets must be ints .*\[0, 4.5\]"):
        cast_shards([t, t], out, offsets=[0, 4.5])


@pytest.mark.gpu
def test_gpu_cast_shards_5000_tensors_one_launch(monkeypatch, triton_path):
    monkeypatch.setattr(_cast_multi, "FOREACH_MIN_TENSORS", 1 << 62)  # the kernel path, whatever the count
    monkeypatch.setattr(_cast_multi, "FOREACH_SMALL_MIN_TENSORS", 1 << 62)
    clear_plan_caches()
    sizes = torch.randint(0, 3000, (5000,)).tolist()
    srcs = [fresh(k, torch.float32, "cuda") for k in sizes]
    total = sum(sizes)
    out = poisoned((total,), torch.bfloat16, "cuda")
    names = cuda_kernels(lambda: cast_shards(srcs, out))
    assert len(names) == 1 and "_cast_shards_kernel" in names[0], names
    assert_bits(out, torch.cat(srcs).to(torch.bfloat16))
    outs = [poisoned((k,), torch.float16, "cuda") for k in sizes]
    names = cuda_kernels(lambda: cast_shards(srcs, outs))
    assert len(names) == 1 and "_cast_shards_kernel" in names[0], names
    for s, o in zip(srcs, outs):
        assert_bits(o, s.half())


@pytest.mark.gpu
@pytest.mark.parametrize("pair", [("fp32", "bf16"), ("fp32", "fp16"), ("bf16", "fp32")], ids=pair_id)
def test_gpu_cast_shards_past_the_crossover_is_foreach_and_bit_exact(pair):
    src_dt, dst_dt = DTYPES[pair[0]], DTYPES[pair[1]]
    sizes = torch.randint(1, 3000, (2 * _cast_multi.FOREACH_MIN_TENSORS,)).tolist()
    srcs = [fresh(k, src_dt, "cuda") for k in sizes]
    outs = [poisoned((k,), dst_dt, "cuda") for k in sizes]
    names = cuda_kernels(lambda: cast_shards(srcs, outs))
    assert names and not any("_cast_shards_kernel" in n for n in names), names
    for s, o in zip(srcs, outs):
        assert_bits(o, s.to(dst_dt))


@pytest.mark.parametrize("count", [3, _cast_multi.FOREACH_MIN_TENSORS], ids=["plan", "foreach"])
def test_list_out_is_returned_as_given(count):
    """A list ``out`` comes back as the same list (no copy of it per call); any other iterable as a new list."""
    srcs = [fresh(5 + i, torch.float32) for i in range(count)]
    outs = [poisoned((5 + i,), torch.bfloat16, DEVICE) for i in range(count)]
    assert cast_shards(srcs, outs) is outs
    assert cast_shards(srcs, outs) is outs  # a repeat call too (a cached plan, where one is)
    again = cast_shards(srcs, tuple(outs))
    assert type(again) is list and again == outs
    for s, o in zip(srcs, outs):
        assert_bits(o, s.to(torch.bfloat16), 1 if interpreting() else 0)
