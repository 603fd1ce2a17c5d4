"""Fixtures shared by the offload tests."""

from __future__ import annotations

import weakref

import pytest
import torch

from shardfuse.offload import _engine
from shardfuse.offload import _model as offload_model


@pytest.fixture
def poisoned_slots(monkeypatch):
    """Device buffers of the engine start as NaN: a parameter or gradient it forgets to write shows up at once."""
    monkeypatch.setattr(
        _engine.SlotPool,
        "_alloc",
        lambda self: torch.full((self.numel,), float("nan"), dtype=self.dtype, device=self.device),
    )


@pytest.fixture
def park_everything(monkeypatch) -> list[weakref.ref]:
    """Run ``offload_activations`` on the CPU as on CUDA: every saved activation parked, as a copy.

    Returns the list of weak references to the originals handed to the stash.
    """
    parked: list[weakref.ref] = []

    def stash(self, t):
        parked.append(weakref.ref(t))
        return t.detach().clone()

    monkeypatch.setattr(offload_model, "MIN_OFFLOAD_BYTES", 0)
    monkeypatch.setattr(_engine.Engine, "stash", stash)
    return parked
