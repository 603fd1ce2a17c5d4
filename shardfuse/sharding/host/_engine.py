"""How the wrapper and the state paths reach a model's ``OffloadOptimizer``: through the root unit the user holds.

The root wrapper's state keeps a weak reference to its engine (``Unit.host_engine``), set by the engine itself;
nothing else (no registry) can find it. These functions are what ``FullyShardedDataParallel`` calls before its
shards are read, written or moved.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from shardfuse.sharding.core._root import lazy_init
from shardfuse.sharding.core._runtime import Unit
from shardfuse.sharding.core._tree import units_below
from shardfuse.sharding.host import _backing


class HostEngine(Protocol):
    """What the wrapper asks of the engine it finds (``OffloadOptimizer``; typed here so this module needs no
    import of it)."""

    def synchronize(self) -> None: ...

    def close(self) -> None: ...

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor: ...


def engine_of(unit: Unit) -> HostEngine | None:
    """The OffloadOptimizer attached to the tree of ``unit`` (None when there is none): the top unit, the state of
    the root wrapper the user holds, keeps a weak reference to it (``Unit.host_engine``)."""
    top = unit
    while top.parent is not None:
        top = top.parent
    engine = top.host_engine() if top.host_engine is not None else None
    return engine  # only an OffloadOptimizer sets Unit.host_engine


def finish_host_steps(unit: Unit) -> None:
    """Wait for the optimizer steps in flight on the tree of ``unit`` (before its shards are read or written)."""
    engine = engine_of(unit)
    if engine is not None:
        engine.synchronize()
    _backing.page_in(units_below(unit))  # ssd: shards on disk are read in for the caller


def settle(unit: Unit) -> None:
    """Before a state-dict, summon or checkpoint path reads or writes the shards: finish the optimizer steps in
    flight, then lazy init."""
    finish_host_steps(unit)
    lazy_init(unit)


def detach_host_engine(unit: Unit) -> None:
    """The shards move or change dtype (``.to()``, ``.half()``): the OffloadOptimizer's host buffers belong to the
    old placement, so it finishes and lets go (stepping it later steps the shards as a plain optimizer)."""
    engine = engine_of(unit)
    if engine is not None:
        engine.close()


def unit_of_root(model: nn.Module) -> Unit:
    unit = getattr(model, "_unit", None)
    if not isinstance(unit, Unit):
        raise TypeError(f"OffloadOptimizer needs the root FullyShardedDataParallel model, got {type(model).__name__}")
    return unit


