"""Fixtures of the kernel tests (the suite-wide ones live in tests/conftest.py)."""

from __future__ import annotations

import pytest

from shardfuse.kernels import _crossover


@pytest.fixture
def triton_path():
    """The Triton kernel of every dispatching entry point whatever the GPU's measured size crossover says: for
    the tests that count the kernel's launches on inputs small enough to go to PyTorch otherwise."""
    with _crossover.override(dict.fromkeys(_crossover.FAMILIES, "triton")):
        yield
