"""DirectLauncher: repeat launches go straight to the compiled kernel's launcher, with the kernel the JIT would pick.

The CPU part drives the launcher with a stand-in kernel (the binder, compiled kernels and launcher Triton builds on a
GPU); the GPU part checks, against the PyTorch references, that direct launches compute the same bits across
calls that change the specialisation (constexprs, pointer alignment, dtypes) and that they are taken.
"""

from __future__ import annotations

import pytest
import torch
from triton import knobs

from shardfuse.kernels import _cast as _cast_module
from shardfuse.kernels import _launch, cast_shard, chunk_cat, chunk_cat_ref
from shardfuse.kernels._launch import DirectLauncher
from tests.conftest import poisoned

# ------------------------------------------------------------------ a stand-in Triton kernel


class FakeCompiled:
    """What the JIT returns: a launcher (``run``), a function handle and packed metadata."""

    def __init__(self, tag, function="fn"):
        self.tag, self.function, self.packed_metadata, self.launches = tag, function, ("meta", tag), []

    def run(self, *args):
        self.launches.append(args)


class FakeKernel:
    """A JITFunction's surface: ``device_caches[device][4]`` is the binder, ``kernel[grid](...)`` the JIT launch.

    The specialisation is each argument's type and, for ints, whether it is a multiple of 16 (as Triton's); the
    signature is ``(a, b, C: constexpr)`` with ``b`` defaulting to 7."""

    def __init__(self, function="fn"):
        self.jit_launches, self.compiled, self.function = [], {}, function
        self.device_caches = {0: (None, None, None, None, self.binder), 1: (None, None, None, None, self.binder)}

    @staticmethod
    def binder(a, b=7, *, C, **options):
        spec = [(type(a).__name__, a % 16 == 0 if isinstance(a, int) else None),
                (type(b).__name__, b % 16 == 0 if isinstance(b, int) else None), ("constexpr", C)]
        return {"a": a, "b": b, "C": C}, spec, options

    def __getitem__(self, grid):
        def jit(*args, **kwargs):
            _, spec, options = self.binder(*args, **kwargs)
            self.jit_launches.append((grid, args, kwargs))
            key = (tuple(spec), tuple(options.items()))
            return self.compiled.setdefault(key, FakeCompiled(len(self.compiled), self.function))
        return jit


@pytest.fixture
def fake_cuda(monkeypatch):
    """Device 0 current, raw stream 1000 + device; direct launches enabled, no launch hooks."""
    device = {"index": 0}
    monkeypatch.setattr(_launch, "_current_device", lambda: device["index"])
    monkeypatch.setattr(_launch, "_raw_stream", lambda d: 1000 + d)
    monkeypatch.setattr(_launch, "ENABLED", True)
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", None)
    monkeypatch.setattr(knobs.runtime, "launch_exit_hook", None)
    return device


def test_repeat_launch_goes_to_the_compiled_launcher(fake_cuda):
    kernel = FakeKernel()
    launcher = DirectLauncher(kernel)
    launcher[(5,)](3, C=4, num_warps=8)  # compiles: the JIT path
    assert len(kernel.jit_launches) == 1 and launcher.direct_launches == 0
    launcher[(5,)](19, C=4, num_warps=8)  # same specialisation (19 is no multiple of 16, as 3): direct
    assert len(kernel.jit_launches) == 1 and launcher.direct_launches == 1
    compiled = next(iter(kernel.compiled.values()))
    # grid padded to three dimensions, the current device's stream, every argument in signature order
    # (the default of b and the constexpr included), no launch metadata or hooks.
    assert compiled.launches == [(5, 1, 1, 1000, "fn", ("meta", 0), None, None, None, 19, 7, 4)]


def test_another_specialisation_takes_the_jit_path_first(fake_cuda):
    kernel = FakeKernel()
    launcher = DirectLauncher(kernel)
    calls = [((3,), {"C": 4}), ((32,), {"C": 4}), ((3,), {"C": 5}), ((3, 2.5), {"C": 4}),
             ((3,), {"C": 4, "num_warps": 4})]
    for args, kwargs in calls:
        launcher[(2, 3)](*args, **kwargs)
    assert len(kernel.jit_launches) == len(calls) and launcher.direct_launches == 0  # all different
    for args, kwargs in calls:
        launcher[(2, 3)](*args, **kwargs)
    assert len(kernel.jit_launches) == len(calls) and launcher.direct_launches == len(calls)
    launched = {c.tag: [a[:3] for a in c.launches] for c in kernel.compiled.values()}
    assert sorted(launched) == list(range(len(calls))) and all(v == [(2, 3, 1)] for v in launched.values())


def test_each_device_has_its_own_compiled_kernels(fake_cuda):
    kernel = FakeKernel()
    launcher = DirectLauncher(kernel)
    launcher[(1,)](3, C=4)
    fake_cuda["index"] = 1
    launcher[(1,)](3, C=4)  # device 1 has not launched it: the JIT path (which loads it there)
    assert len(kernel.jit_launches) == 2 and launcher.direct_launches == 0
    launcher[(1,)](3, C=4)
    compiled = next(iter(kernel.compiled.values()))
    assert launcher.direct_launches == 1 and compiled.launches[-1][3] == 1001  # device 1's stream


def test_an_empty_hook_chain_is_no_hook(fake_cuda, monkeypatch):
    """Triton 3.6 keeps its launch hooks in chains, present and empty unless a profiler adds one."""
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", knobs.HookChain())
    monkeypatch.setattr(knobs.runtime, "launch_exit_hook", knobs.HookChain(reversed=True))
    launcher = DirectLauncher(FakeKernel())
    for _ in range(3):
        launcher[(1,)](3, C=4)
    assert launcher.direct_launches == 2


@pytest.mark.parametrize("why", ["enter hook", "exit hook", "hook chain", "pre-run hook", "disabled", "interpreter",
                                 "binder fails", "no handle"])
def test_jit_path_where_the_direct_one_may_not_serve(fake_cuda, monkeypatch, why):
    kernel = FakeKernel(function=None if why == "no handle" else "fn")
    if why == "enter hook":
        monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda *a: None)
    elif why == "exit hook":
        monkeypatch.setattr(knobs.runtime, "launch_exit_hook", lambda *a: None)
    elif why == "hook chain":
        chain = knobs.HookChain()
        chain.add(lambda *a: None)
        monkeypatch.setattr(knobs.runtime, "launch_enter_hook", chain)
    elif why == "pre-run hook":  # JITFunction.add_pre_run_hook: the JIT calls them before every launch
        kernel.pre_run_hooks = [lambda *a, **k: None]
    elif why == "disabled":
        monkeypatch.setattr(_launch, "ENABLED", False)
    elif why == "interpreter":
        del kernel.device_caches
    elif why == "binder fails":
        kernel.device_caches = {0: (None, None, None, None, None)}
    launcher = DirectLauncher(kernel)
    for _ in range(3):
        launcher[(1,)](3, C=4)
    assert len(kernel.jit_launches) == 3 and launcher.direct_launches == 0
    assert all(not c.launches for c in kernel.compiled.values())


def test_cache_is_bounded(fake_cuda, monkeypatch):
    monkeypatch.setattr(_launch, "_MAX_ENTRIES", 4)
    launcher = DirectLauncher(FakeKernel())
    for c in range(10):
        launcher[(1,)](3, C=c)
    assert len(launcher._compiled) <= 4


def test_env_value_must_be_0_or_1(monkeypatch):
    import importlib

    monkeypatch.setenv("SHARDFUSE_DIRECT_LAUNCH", "yes")
    with pytest.raises(ValueError, match="SHARDFUSE_DIRECT_LAUNCH='yes'.*set it to 1"):
        importlib.reload(_launch)
    monkeypatch.setenv("SHARDFUSE_DIRECT_LAUNCH", "0")
    assert importlib.reload(_launch).ENABLED is False
    monkeypatch.delenv("SHARDFUSE_DIRECT_LAUNCH")
    assert importlib.reload(_launch).ENABLED is True


# ------------------------------------------------------------------ GPU only


@pytest.mark.gpu
def test_gpu_direct_launches_compute_the_jit_path_bits(triton_path):
    """chunk_cat across calls that change its specialisation: factor (DIVIDE/MULTIPLY constexprs), an out off the
    16-byte boundary (ALIGNED and the pointer's alignment), another dtype; every call against the reference."""
    from shardfuse.kernels import _chunk_cat as module

    launcher = module._chunk_cat_launch
    tensors = [torch.randn(37, 64, device="cuda"), torch.randn(5, device="cuda"), torch.randn(130, 3, device="cuda")]
    storage = torch.empty(4 * 8 * 200 + 1, device="cuda")
    before = launcher.direct_launches
    for factor in (4.0, 3.0, 4.0, 1.0, 3.0):
        for offset in (0, 1, 0):  # float32 at offset 1: 4 bytes off the 16-byte boundary
            expected = chunk_cat_ref(tensors, 8, factor=factor)
            out = storage[offset: offset + expected.numel()].view(expected.shape)
            out.fill_(float("nan"))
            chunk_cat(tensors, 8, factor=factor, out=out)
            torch.testing.assert_close(out, expected, rtol=0, atol=0, equal_nan=False)
        halves = [t.half() for t in tensors]
        torch.testing.assert_close(chunk_cat(halves, 8, factor=factor), chunk_cat_ref(halves, 8, factor=factor),
                                   rtol=0, atol=0)
    assert launcher.direct_launches > before  # the repeats went direct


@pytest.mark.gpu
def test_gpu_cast_shard_direct_and_jit_agree(monkeypatch):
    launcher = _cast_module._cast_shard_launch
    for direct in (True, False, True):
        monkeypatch.setattr(_launch, "ENABLED", direct)
        before = launcher.direct_launches
        for n, dtype in ((4099, torch.bfloat16), (1, torch.float16), (4099, torch.bfloat16), (8192, torch.float16)):
            src = torch.randn(n, device="cuda")
            out = poisoned((n,), dtype, "cuda")
            cast_shard(src, out)
            torch.testing.assert_close(out, src.to(dtype), rtol=0, atol=0)
        assert (launcher.direct_launches > before) == direct
