"""Test-suite setup shared by every test module.

Without a GPU the kernels are exercised through Triton's interpreter, which must be switched on before
``triton`` is first imported, so this happens here, at collection time.

The worker-pool fixtures live here too: ``pool`` (the module's ``WORLD`` ranks, default 2) and ``pool4``
(4 ranks), each started once per test module and reused by all its tests (see ``tests/dist_pool.py``).
The repository root is on ``sys.path`` through ``pythonpath`` in pyproject.toml, so ``tests.*``,
``bench.*`` and ``examples.*`` import the same way however pytest is started.
"""

from __future__ import annotations

import gc
import os
import zlib

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from tests.dist_pool import DEFAULT_TIMEOUT_S, DistPool  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
NUM_GPUS = torch.cuda.device_count() if HAS_CUDA else 0


def pytest_collection_finish(session):
    # What is alive once the tests are collected (imported modules, test functions, pytest's items) lives to the
    # end of the run: freeze it out of the cyclic collector, so the gc.collect() calls of the lifetime tests and
    # Python's own full collections scan only what the tests make (in the whole suite a collection otherwise
    # walks every object torch, transformers and 3,000 collected tests left: ~5 s more per lifetime test).
    gc.collect()
    gc.freeze()


def pytest_unconfigure(config):
    gc.unfreeze()  # the interpreter's shutdown collects them as usual (nanobind reports leaks otherwise)


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


@pytest.fixture(scope="module")
def pool(request: pytest.FixtureRequest):
    """One worker pool per test module, reused by all its tests.

    ``WORLD`` ranks (a global of the test module, default 2) in one gloo group; a module marked ``multigpu``
    gets an NCCL group instead, one GPU per rank (its tests are skipped without 2 GPUs, so the pool is never
    started there). A module that needs another shape of pool defines its own ``pool`` fixture.
    """
    world = getattr(request.module, "WORLD", 2)
    if request.node.get_closest_marker("multigpu") is not None:
        with DistPool(world_size=world, backend="nccl", timeout_s=300) as p:
            yield p
    else:
        with DistPool(world_size=world) as p:
            yield p


@pytest.fixture(scope="module")
def pool4():
    """A 4-rank gloo pool per test module (for the checks worth a 4-process group)."""
    with DistPool(world_size=4, timeout_s=DEFAULT_TIMEOUT_S) as p:
        yield p


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
