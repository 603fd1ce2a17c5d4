"""What shardfuse writes on torch objects, and the per-process registries keyed by them.

Marks are attributes set on modules and parameters at wrap time; the registries map a parameter's ``id`` to
the flat-parameter handle that holds it (weakly, so neither keeps a model alive). They live apart from the
storage (``_flat_param.py``) so set-up, guards and the process-wide hooks read them without importing it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

# The instance attribute that makes a module (the public wrapper) a unit: it holds the unit's runtime state.
# Flattening stops at such modules; their own parameters belong to their unit.
UNIT_ATTR = "_shardfuse_unit"
# Set on every module whose parameters a unit flattened: wrapping it (or a part of it) again is an error.
OWNED_MARK = "_shardfuse_owned_by"
# Set on a wrapped module to the unit that flattened its parameters, which a second wrapper takes back.
WRAPPED_MARK = "_shardfuse_wrapped"
# Marks original parameters once they were flattened: a later unit borrows them instead of flattening them again.
FLATTENED_MARK = "_shardfuse_flattened_into"
# On sharded parameters (flat, or original views): (rank, world_size), the shard this rank's optimizer state is of.
SHARD_MARK_ATTR = "_shardfuse_shard"
# The key under which an optimizer's per-parameter state carries that mark (see _process_hooks).
SHARD_MARK_KEY = "shardfuse_shard"

# id(sharded parameter) -> (the parameter, its FlatParamHandle), both weakly. Not an attribute: parameters must
# stay picklable; not a WeakKeyDictionary: it compares tensors with ==.
_HANDLES: dict[int, tuple[weakref.ref[torch.Tensor], weakref.ref[Any]]] = {}
# id(original parameter) -> (it, the handle it was flattened into, its unique index there), all weakly (as
# _HANDLES): a later unit whose modules register it too borrows it from that handle.
_FLATTENED: dict[int, tuple[weakref.ref[torch.Tensor], weakref.ref[Any], int]] = {}


def _forget(table: dict[int, Any], key: int) -> Callable[[Any], None]:
    """A weakref callback: drop ``table[key]`` once its tensor is gone."""
    return lambda _: table.pop(key, None)


def register_handle(p: torch.Tensor, handle: Any) -> None:
    """Enter ``p`` (a flat parameter or an original-parameter view) as a shard of ``handle``."""
    key = id(p)
    _HANDLES[key] = (weakref.ref(p, _forget(_HANDLES, key)), weakref.ref(handle))


def handle_of(p: torch.Tensor) -> Any | None:
    """The handle whose shard ``p`` is (a flat parameter, or an original parameter's view), or None."""
    entry = _HANDLES.get(id(p))
    return entry[1]() if entry is not None and entry[0]() is p else None


def register_flattened(p: torch.Tensor, handle: Any, index: int) -> None:
    """Enter original parameter ``p`` as unique parameter ``index`` of ``handle``."""
    key = id(p)
    _FLATTENED[key] = (weakref.ref(p, _forget(_FLATTENED, key)), weakref.ref(handle), index)


def flattened_into(p: torch.Tensor) -> tuple[Any, int] | None:
    """``(handle, unique index)`` of a parameter some unit already flattened: an original parameter, or its
    ``use_orig_params`` view; None for any other tensor."""
    entry = _FLATTENED.get(id(p))
    if entry is not None and entry[0]() is p:
        h = entry[1]()
        return None if h is None else (h, entry[2])
    h = handle_of(p)
    if h is not None and h.orig_views is not None:
        for i, v in enumerate(h.orig_views):
            if v is p:
                return h, i
    return None


def iter_own_modules(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """``(prefix, submodule)`` pairs of ``module``'s tree, not descending into nested units (wrappers)."""
    yield prefix, module
    for name, child in module._modules.items():
        if child is None or UNIT_ATTR in child.__dict__:
            continue
        yield from iter_own_modules(child, f"{prefix}{name}.")
