"""Fixtures of the kernel tests (the suite-wide ones live in tests/conftest.py)."""

from __future__ import annotations

import pytest

from shardfuse.kernels import _common, _crossover


@pytest.fixture
def triton_path():
    """The Triton kernel of every dispatching entry point whatever the GPU's measured size crossover says: for
    the tests that count the kernel's launches on inputs small enough to go to PyTorch otherwise."""
    with _crossover.override(dict.fromkeys(_crossover.FAMILIES, "triton")):
        yield


@pytest.fixture(params=["native", "python"])
def guard(request, monkeypatch):
    """Each test with PyTorch's TensorGuards and with the Python fields (as on a PyTorch without it)."""
    if request.param == "python":
        monkeypatch.setattr(_common, "_native_guards_work", lambda: False)
    elif not _common._native_guards_work():
        pytest.skip("this PyTorch has no torch._C._dynamo.guards.TensorGuards that tells layouts apart")
    _common.clear_plan_caches()
    yield request.param
    _common.clear_plan_caches()
