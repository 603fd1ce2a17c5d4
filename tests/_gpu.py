"""Running the CPU suite's checks on CUDA: one way to point a test module's models and batches at this rank's GPU."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import torch


@contextlib.contextmanager
def on_device(*modules: ModuleType, models: bool = True, device: torch.device | None = None) -> Iterator[None]:
    """While open, the ``batch`` (and with ``models`` the ``build``) function of each of ``modules`` returns its
    tensors (its model) on ``device`` (default: this rank's current CUDA device); restored on exit."""
    dev = device if device is not None else torch.device("cuda", torch.cuda.current_device())
    saved: list[tuple[ModuleType, str, Any]] = []
    for mod in modules:
        orig_batch = mod.batch
        saved.append((mod, "batch", orig_batch))
        mod.batch = lambda *a, _f=orig_batch, **k: tuple(t.to(dev) for t in _f(*a, **k))
        if models:
            orig_build = mod.build
            saved.append((mod, "build", orig_build))
            mod.build = lambda c, _f=orig_build: _f(c).to(dev)
    try:
        yield
    finally:
        for mod, name, fn in reversed(saved):
            setattr(mod, name, fn)
