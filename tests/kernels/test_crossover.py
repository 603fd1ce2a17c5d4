"""The size crossovers of the dispatching entry points (shardfuse.kernels._crossover): below the threshold the
entry point runs the PyTorch sequence, above it the Triton kernel, with bit-identical results either way.

On CPU the kernels run under Triton's interpreter (tests/conftest.py), where the measured GPU rules do not
apply (the kind "cpu" always takes the kernel): each test installs a threshold for this device's kind with
``override`` and spies on the kernel launch and on the PyTorch op. Casts here are exact ones (up-casts and
fp16 from fp32 values that fit), so the two paths are compared bit for bit even under the interpreter.
"""

from __future__ import annotations

import math

import pytest
import torch

from shardfuse.kernels import _cast_multi, _chunk_cat, _concat, _crossover
from shardfuse.kernels._cast_multi import cast_shards, cast_shards_ref
from shardfuse.kernels._chunk_cat import chunk_cat, chunk_cat_ref
from shardfuse.kernels._common import clear_plan_caches
from shardfuse.kernels._concat import concat_microbatches
from shardfuse.kernels._crossover import Crossover, override
from tests._asserts import assert_bits, assert_same
from tests.conftest import kernel_device, poisoned

DEVICE = kernel_device()
KIND = _crossover.gpu_kind(torch.device(DEVICE))


class Spy:
    """Counts calls of a kernel (``kernel[grid](...)``) or of a function, and runs the real thing."""

    def __init__(self, real, when=None):
        self.real, self.calls, self.when = real, 0, when

    def __getitem__(self, grid):
        self.calls += 1
        return self.real[grid]

    def __call__(self, *args, **kwargs):
        self.calls += self.when is None or self.when(kwargs)
        return self.real(*args, **kwargs)


@pytest.fixture
def spies(monkeypatch):
    clear_plan_caches()
    found = {
        "cast_kernel": Spy(_cast_multi._cast_shards_kernel),
        "chunk_cat_kernel": Spy(_chunk_cat._chunk_cat_kernel),
        "concat_kernel": Spy(_concat._concat_kernel),
        "foreach_copy_": Spy(torch._foreach_copy_),
        "_chunk_cat": Spy(torch._chunk_cat),
        "cat": Spy(torch.cat, when=lambda kwargs: "out" in kwargs),  # launch tables are joined with torch.cat
    }
    monkeypatch.setattr(_cast_multi._cast_shards_launch, "kernel", found["cast_kernel"])
    monkeypatch.setattr(_chunk_cat._chunk_cat_launch, "kernel", found["chunk_cat_kernel"])
    monkeypatch.setattr(_concat._concat_launch, "kernel", found["concat_kernel"])
    monkeypatch.setattr(torch, "_foreach_copy_", found["foreach_copy_"])
    monkeypatch.setattr(torch, "_chunk_cat", found["_chunk_cat"])
    monkeypatch.setattr(torch, "cat", found["cat"])
    yield found
    clear_plan_caches()


def fresh(n: int, dtype: torch.dtype) -> torch.Tensor:
    return (torch.randn(n, device=DEVICE) * 8).to(dtype)


def calls(spies: dict[str, Spy]) -> dict[str, int]:
    return {k: s.calls for k, s in spies.items() if s.calls}


# Sizes either side of a threshold of 4000 bytes moved: odd, prime and empty tensors among them.
THRESHOLD = 4000
SMALL = [7, 0, 131, 1]  # bf16 -> fp32: 6 bytes per element, 834 bytes in all
LARGE = [7, 0, 1031, 131]  # 7014 bytes


@pytest.mark.parametrize("sizes,path", [(SMALL, "torch"), (LARGE, "triton")], ids=["small", "large"])
@pytest.mark.parametrize("form", ["list", "flat"])
def test_cast_shards_picks_the_path_by_size(spies, form, sizes, path):
    family = f"cast_shards_{form}"
    srcs = [fresh(k, torch.bfloat16) for k in sizes]
    total = sum(sizes)

    def outs():
        return poisoned((total,), torch.float32, DEVICE) if form == "flat" else [
            poisoned((k,), torch.float32, DEVICE) for k in sizes
        ]

    with override({family: Crossover(min_bytes=THRESHOLD)}, kind=KIND):
        got = cast_shards(srcs, outs())
        again = cast_shards(srcs, outs())  # the cached plan keeps the decision
    first = calls(spies)
    kernel, op = spies["cast_kernel"].calls, spies["foreach_copy_"].calls
    assert (kernel, op) == ((0, 2) if path == "torch" else (2, 0)), first
    with override({family: "torch" if path == "triton" else "triton"}, kind=KIND):
        other = cast_shards(srcs, outs())  # the other path, forced: same bits
    ref = cast_shards_ref(srcs, outs())
    for result in (got, again, other):
        for a, b in zip(result if form == "list" else [result], ref if form == "list" else [ref]):
            assert_bits(a, b)


def test_cast_shards_flat_torch_path_keeps_offsets_and_gaps(spies):
    srcs = [fresh(k, torch.float32).view(-1, 1) for k in (7, 0, 131, 1)]  # 2-D sources into a flat out
    offsets = [200, 3, 40, 0]
    with override({"cast_shards_flat": "torch"}, kind=KIND):
        out = cast_shards(srcs, poisoned((340,), torch.float16, DEVICE), offsets=offsets)
    assert spies["cast_kernel"].calls == 0 and spies["foreach_copy_"].calls == 1
    ref = cast_shards_ref(srcs, poisoned((340,), torch.float16, DEVICE), offsets=offsets)
    assert_bits(out, ref)  # NaN where nothing was written, in both


def test_cast_shards_list_torch_path_different_shapes(spies):
    srcs = [fresh(12, torch.bfloat16).view(3, 4), fresh(5, torch.bfloat16)]
    with override({"cast_shards_list": "torch"}, kind=KIND):
        outs = cast_shards(srcs, [poisoned((12,), torch.float32, DEVICE), poisoned((5, 1), torch.float32, DEVICE)])
    assert spies["cast_kernel"].calls == 0
    assert_bits(outs[0], srcs[0].float().view(-1))
    assert_bits(outs[1], srcs[1].float().view(5, 1))


def _cc_tensors(rows: int) -> list[torch.Tensor]:
    bf16 = torch.bfloat16
    return [fresh(rows * 3, bf16).view(rows, 3), fresh(2 * rows + 1, bf16), fresh(5, bf16)]


@pytest.mark.parametrize("rows,path", [(5, "torch"), (400, "triton")], ids=["small", "large"])
@pytest.mark.parametrize("factor", [1.0, 4.0])
def test_chunk_cat_picks_the_path_by_size(spies, rows, path, factor):
    tensors = _cc_tensors(rows)
    expected = chunk_cat_ref(tensors, 3, factor=factor)
    with override({"chunk_cat": Crossover(min_bytes=THRESHOLD)}, kind=KIND):
        got = chunk_cat(tensors, 3, factor=factor, out=poisoned(expected.shape, torch.bfloat16, DEVICE))
        again = chunk_cat(tensors, 3, factor=factor)
    kernel, op = spies["chunk_cat_kernel"].calls, spies["_chunk_cat"].calls
    assert (kernel, op) == ((0, 2) if path == "torch" else (2, 0)), calls(spies)
    assert torch.equal(got, expected) and torch.equal(again, expected)


def test_chunk_cat_stays_on_the_kernel_where_pytorch_differs(spies):
    tensors = _cc_tensors(5)
    with override({"chunk_cat": "torch"}, kind=KIND):
        cast = chunk_cat(tensors, 3, dtype=torch.float32)  # a cast: PyTorch would round differently
        odd = chunk_cat(tensors, 3, factor=3.0)  # not a power of two
        with_empty = chunk_cat([*tensors, torch.empty(0, device=DEVICE, dtype=torch.bfloat16)], 3)
    assert spies["chunk_cat_kernel"].calls == 3 and spies["_chunk_cat"].calls == 0
    assert torch.equal(cast, chunk_cat_ref(tensors, 3, dtype=torch.float32))
    assert_same(odd, chunk_cat_ref(tensors, 3, factor=3.0))  # bf16 division: 1 ulp under the interpreter
    assert torch.equal(with_empty, chunk_cat_ref(tensors, 3))


def test_chunk_cat_cached_torch_plan_with_another_factor(spies):
    tensors = _cc_tensors(5)
    with override({"chunk_cat": "torch"}, kind=KIND):
        chunk_cat(tensors, 3, factor=2.0)
        got = chunk_cat(tensors, 3, factor=3.0)  # same tensors, a factor PyTorch cannot scale exactly
    assert spies["chunk_cat_kernel"].calls == 1
    assert_same(got, chunk_cat_ref(tensors, 3, factor=3.0))


@pytest.mark.parametrize("rows,path", [(9, "torch"), (301, "triton")], ids=["small", "large"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_concat_picks_the_path_by_size(spies, rows, path, dtype):
    x = fresh(rows * 5, dtype).view(rows, 5)
    parts = list(x.chunk(3))
    with override({"concat": Crossover(min_bytes=THRESHOLD)}, kind=KIND):
        got = concat_microbatches(parts, out=poisoned(x.shape, dtype, DEVICE))
        again = concat_microbatches(parts)
    kernel, op = spies["concat_kernel"].calls, spies["cat"].calls
    assert (kernel, op) == ((0, 2) if path == "torch" else (2, 0)), calls(spies)
    assert torch.equal(got.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       x.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
    assert torch.equal(again, x)


# ------------------------------------------------------------------ the rules themselves


def test_rule_shapes():
    rule = Crossover(min_bytes=100, max_tensors=4, many_tensors=1000, big_tensor_bytes=50)
    assert not rule.triton(2, 99) and rule.triton(2, 100)  # by size
    assert not rule.triton(4, 199) and rule.triton(4, 200)  # from 4 tensors on: 50 bytes each
    assert rule.triton(1000, 1)  # many tensors: at any size
    assert Crossover().triton(10**6, 0) and not _crossover.NEVER.triton(10**6, 10**15)


def test_merge_is_the_most_cautious():
    a = Crossover(min_bytes=10, max_tensors=17, many_tensors=100, big_tensor_bytes=9)
    b = Crossover(min_bytes=20, max_tensors=math.inf, many_tensors=200, big_tensor_bytes=5)
    m = _crossover.merge([a, b])
    assert m == Crossover(min_bytes=20, max_tensors=17, many_tensors=200, big_tensor_bytes=9)
    for num in (1, 16, 17, 150, 250):
        for nbytes in (0, 15, 25, 9 * num, 10**6):
            assert m.triton(num, nbytes) <= (a.triton(num, nbytes) and b.triton(num, nbytes))
    # concat: an unknown GPU takes torch.cat wherever one measured kind does (the larger of the two size thresholds)
    rule = _crossover.FALLBACK["concat"]
    largest = max(k["concat"].min_bytes for k in _crossover.MEASURED.values())
    assert rule.min_bytes == largest and not rule.triton(4, int(min(largest, 1 << 62)) - 1)
    assert rule.triton(4, int(largest)) if largest < math.inf else rule == _crossover.NEVER


def test_gpu_kind_from_the_device_name(monkeypatch):
    names = {0: "NVIDIA H100 80GB HBM3", 1: "NVIDIA H200", 2: "NVIDIA A100-SXM4-80GB"}
    monkeypatch.setattr(torch.cuda, "get_device_name", names.__getitem__)
    _crossover._cuda_kind.cache_clear()
    try:
        kinds = [_crossover.gpu_kind(torch.device("cuda", i)) for i in range(3)]
        assert kinds == ["h100", "h200", "other"]
        assert _crossover.crossover("concat", torch.device("cuda", 0)) == _crossover.MEASURED["h100"]["concat"]
        assert _crossover.crossover("cast_shards_flat", torch.device("cuda", 1)) == (
            _crossover.MEASURED["h200"]["cast_shards_flat"])
        # chunk_cat is measured on no kind: the kernel on every GPU, unless overridden
        for i in range(3):
            assert _crossover.crossover("chunk_cat", torch.device("cuda", i)) == _crossover.ALWAYS
        assert _crossover.crossover("concat", torch.device("cuda", 2)) == _crossover.FALLBACK["concat"]
        with override({"concat": "triton"}, kind="other"):
            assert _crossover.crossover("concat", torch.device("cuda", 2)) == _crossover.ALWAYS
            assert _crossover.crossover("concat", torch.device("cuda", 1)) == _crossover.MEASURED["h200"]["concat"]
        assert _crossover.crossover("concat", torch.device("cuda", 2)) == _crossover.FALLBACK["concat"]
    finally:
        _crossover._cuda_kind.cache_clear()
    assert _crossover.crossover("concat", torch.device("cpu")) == _crossover.ALWAYS


def test_override_errors():
    with pytest.raises(ValueError, match="unknown kernel family 'cast'"):
        _crossover.set_crossover("cast", "torch")
    with pytest.raises(ValueError, match=r"rule='fast': pass a Crossover, 'triton', 'torch' or None"):
        _crossover.set_crossover("concat", "fast")
    with pytest.raises(TypeError, match="rule must be a Crossover"):
        _crossover.set_crossover("concat", 3)  # type: ignore[arg-type]


def test_env_forces_a_path(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: "NVIDIA H100 80GB HBM3")
    _crossover._cuda_kind.cache_clear()
    try:
        monkeypatch.setattr(_crossover, "_ENV", "torch")
        assert _crossover.crossover("cast_shards_flat", torch.device("cuda", 0)) == _crossover.NEVER
        monkeypatch.setattr(_crossover, "_ENV", "triton")
        assert _crossover.crossover("concat", torch.device("cuda", 0)) == _crossover.ALWAYS
        with override({"concat": "torch"}):  # an explicit override beats the environment
            assert _crossover.crossover("concat", torch.device("cuda", 0)) == _crossover.NEVER
    finally:
        _crossover._cuda_kind.cache_clear()


def test_env_with_a_bad_mode_fails_at_import():
    import os
    import subprocess
    import sys

    env = {**os.environ, "SHARDFUSE_KERNEL_DISPATCH": "fast"}
    out = subprocess.run([sys.executable, "-c", "import shardfuse.kernels"], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode != 0 and "SHARDFUSE_KERNEL_DISPATCH='fast' is not a dispatch mode" in out.stderr


# ------------------------------------------------------------------ GPU: the measured rules of this GPU


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [64, 1 << 16], ids=["small", "64Ki-rows"])
def test_gpu_concat_follows_this_gpus_rule(rows):
    from tests.conftest import cuda_kernels

    x = torch.randn(rows, 1024, device="cuda")
    parts = [p.clone() for p in x.chunk(4)]
    out = poisoned(x.shape, x.dtype, "cuda")
    rule = _crossover.crossover("concat", out.device)
    names = cuda_kernels(lambda: concat_microbatches(parts, out=out))
    assert any("_concat_kernel" in n for n in names) == rule.triton(4, 2 * out.numel() * 4), names
    assert torch.equal(out, x)


@pytest.mark.gpu
@pytest.mark.parametrize("num,per", [(8, 1024), (8, 1 << 19), (20, 1 << 16)], ids=["tiny", "large", "count"])
def test_gpu_cast_shards_list_follows_this_gpus_rule(num, per):
    from tests.conftest import cuda_kernels

    srcs = [torch.randn(per + i, device="cuda") for i in range(num)]
    outs = [poisoned((s.numel(),), torch.bfloat16, "cuda") for s in srcs]
    nbytes = sum(s.numel() for s in srcs) * 6
    rule = _crossover.crossover("cast_shards_list", srcs[0].device)
    names = cuda_kernels(lambda: cast_shards(srcs, outs))
    assert any("_cast_shards_kernel" in n for n in names) == rule.triton(num, nbytes), names
    for s, o in zip(srcs, outs):
        assert_bits(o, s.to(torch.bfloat16))
