"""What shardfuse writes on torch objects: marks and links to the flat-parameter handles.

Marks are attributes set on modules and parameters at wrap time. A parameter's link to the flat-parameter handle
that holds it is an attribute too (:class:`HandleRef`, weak, so it keeps no model alive): no module-level table.
They live apart from the storage (``_flat_param.py``) so set-up, guards and the process-wide hooks read them
without importing it.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
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

# On a sharded parameter (flat, or an original-parameter view): the HandleRef to the handle whose shard it is.
HANDLE_LINK = "_shardfuse_handle_link"
# On an original parameter a unit flattened: the HandleRef to that handle, with the parameter's unique index there
# (a later unit whose modules register it too borrows it from that handle).
FLATTENED_LINK = "_shardfuse_flattened_link"


class HandleRef:
    """A parameter's link to its ``FlatParamHandle``, kept as an attribute on the parameter itself.

    Both ends are weak: the link keeps neither the handle (so not the model) nor the tensor alive. It holds for
    the tensor it was made for only: a shallow copy of that tensor shares the attribute but is another object, so
    :func:`handle_of` finds nothing for it; a deep copy gets a dead link. It pickles as an empty ``set``, a type
    ``torch.load(weights_only=True)`` accepts, so a saved parameter or state dict loads without running code (the
    loaded tensor has no handle; an unpickled handle links its shards again, ``FlatParamHandle.__setstate__``).
    """

    __slots__ = ("_owner", "_handle", "index")

    def __init__(self, owner: torch.Tensor | None, handle: Any, index: int = -1) -> None:
        self._owner = None if owner is None else weakref.ref(owner)
        self._handle = None if handle is None else weakref.ref(handle)
        self.index = index

    def handle_for(self, t: torch.Tensor) -> Any | None:
        """The handle, if this link was made for ``t`` and the handle is alive; else None."""
        if self._owner is None or self._handle is None or self._owner() is not t:
            return None
        return self._handle()

    def __reduce__(self) -> tuple[type, tuple]:
        return set, ()

    def __copy__(self) -> HandleRef:
        return self  # the owner check already refuses the copied tensor

    def __deepcopy__(self, memo: dict) -> HandleRef:
        return HandleRef(None, None, self.index)

    def __repr__(self) -> str:
        alive = self._handle is not None and self._handle() is not None
        return f"HandleRef(index={self.index}, {'alive' if alive else 'dead'})"


def _link(t: torch.Tensor, attr: str) -> HandleRef | None:
    ref = t.__dict__.get(attr) if hasattr(t, "__dict__") else None
    return ref if isinstance(ref, HandleRef) else None


def register_handle(p: torch.Tensor, handle: Any) -> None:
    """Link ``p`` (a flat parameter or an original-parameter view) to ``handle``, whose shard it is."""
    p.__dict__[HANDLE_LINK] = HandleRef(p, handle)


def handle_of(p: torch.Tensor) -> Any | None:
    """The handle whose shard ``p`` is (a flat parameter, or an original parameter's view), or None."""
    ref = _link(p, HANDLE_LINK)
    return None if ref is None else ref.handle_for(p)


def register_flattened(p: torch.Tensor, handle: Any, index: int) -> None:
    """Link original parameter ``p`` to ``handle``, as its unique parameter ``index``."""
    p.__dict__[FLATTENED_LINK] = HandleRef(p, handle, index)


def flattened_into(p: torch.Tensor) -> tuple[Any, int] | None:
    """``(handle, unique index)`` of a parameter some unit already flattened: an original parameter, or its
    ``use_orig_params`` view; None for any other tensor."""
    ref = _link(p, FLATTENED_LINK)
    if ref is not None:
        h = ref.handle_for(p)
        if h is not None:
            return h, ref.index
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
