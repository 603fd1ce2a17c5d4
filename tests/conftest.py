"""Test-suite setup shared by every test module.

Without a GPU the kernels are exercised through Triton's interpreter, which must be switched on before
``triton`` is first imported, so this happens here, at collection time.
"""

from __future__ import annotations

import os
import zlib

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
NUM_GPUS = torch.cuda.device_count() if HAS_CUDA else 0


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_multi = pytest.mark.skip(reason="needs 2 or more CUDA GPUs")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
        if "multigpu" in item.keywords and NUM_GPUS < 2:
            item.add_marker(skip_multi)


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    # A different but reproducible seed per test: fresh random data, never the same tensors everywhere.
    # crc32, not hash(): str hashes are salted per process, so a failure could not be replayed.
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    yield


def poisoned(shape, dtype, device="cpu"):
    """A fresh tensor full of NaN, so any element a kernel forgets to write shows up."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def kernel_device() -> str:
    return "cuda" if HAS_CUDA else "cpu"


def cuda_kernels(fn) -> list[str]:
    """Names of the CUDA kernels one call of ``fn`` runs (after a warm-up call that compiles)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [
        e.name for e in prof.events()
        if e.device_type == DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset"))
    ]


def assert_same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Exact equality (NaN where NaN), except bf16 under the interpreter: 1 ulp.

    Triton's CPU interpreter truncates fp32 -> bf16 instead of rounding to nearest-even, so a bf16 output
    can sit one step of the bit pattern away from PyTorch's there; on the GPU the cast is exact.
    """
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    from shardfuse.kernels._common import interpreting

    if actual.dtype == torch.bfloat16 and interpreting():
        assert torch.equal(actual.isnan(), expected.isnan()), "NaN positions differ"
        a = actual.view(torch.int16).int()
        e = expected.view(torch.int16).int()
        close = ((a - e).abs() <= 1) | (actual == expected) | actual.isnan()
        assert close.all(), f"{(~close).sum()} bf16 elements more than 1 ulp off, e.g. {actual[~close][:4]}"
    else:
        torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)
