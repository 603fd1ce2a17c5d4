"""The host tier's one door to a store below host memory (the SSD tier), which the host tier never imports.

A backing store keeps host shards (``HostShard`` subclasses) in a slower tier between uses. It implements
:class:`BackingStore` and registers itself with :func:`register` when it first attaches a shard (``ssd._ssd``'s
``attach``, at wrap time); the functions below ask every registered store, so with none registered (no shard
was ever attached to one) each is a no-op. Registration happens on the main thread at wrap time; the host
tier's calls come from the main thread too (``OffloadOptimizer``, the state-dict and checkpoint paths).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

from shardfuse.sharding.core._flat_param import FlatParamHandle
from shardfuse.sharding.host._host_shard import HostShard


class BackingStore(Protocol):
    """What the host tier asks of a store that keeps host shards below host memory."""

    def host_of(self, h: FlatParamHandle) -> HostShard | None:
        """Attach: the host shard the store attached to ``h`` (``OffloadOptimizer`` keeps it), or None."""
        ...

    def release(self, h: FlatParamHandle) -> HostShard | None:
        """Write back: what ``h.host`` becomes when an ``OffloadOptimizer`` lets go (the store's host shard, its
        write-backs done and reset for a plain optimizer), or None when the store holds no shard of ``h``."""
        ...

    def leave(self, h: FlatParamHandle) -> None:
        """Before ``h``'s shard is made resident on the GPU: read it in for good (the store lets it go)."""

    def page_in(self, units: Iterable[Any]) -> None:
        """Page in: before a state-dict, summon or checkpoint path reads or writes the shards of ``units``."""

    def page_in_optimizer_state(self, optimizer: torch.optim.Optimizer) -> None:
        """Page in: ``optimizer``'s state of the store's shards, before its ``state_dict()`` reads it."""

    def tiers_below(self, unit: Any) -> list[Any]:
        """The store's parts that hold shards of ``unit``'s tree (opaque to the host tier), taken when an
        ``OffloadOptimizer`` is made, for :meth:`main_waits` when it closes (the model may be gone by then)."""
        ...

    def main_waits(self, tiers: list[Any]) -> AbstractContextManager[None]:
        """Wait: the caller waits for the host worker (closing it), so no update waits for room in ``tiers``."""
        ...


# The store implementations (stateless adapters, e.g. the SSD tier's module-level functions), not live stores: each
# store's state is owned by the model whose shards it keeps.
_STORES: list[BackingStore] = []


def register(store: BackingStore) -> None:
    """A store that attached a host shard (once per store)."""
    if store not in _STORES:
        _STORES.append(store)


def host_of(h: FlatParamHandle) -> HostShard | None:
    return next((host for s in _STORES if (host := s.host_of(h)) is not None), None)


def release(h: FlatParamHandle) -> HostShard | None:
    return next((host for s in _STORES if (host := s.release(h)) is not None), None)


def leave(h: FlatParamHandle) -> None:
    for s in _STORES:
        s.leave(h)


def page_in(units: Iterable[Any]) -> None:
    units = list(units)
    for s in _STORES:
        s.page_in(units)


def page_in_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    for s in _STORES:
        s.page_in_optimizer_state(optimizer)


def below(unit: Any) -> list[tuple[BackingStore, list[Any]]]:
    """Each registered store with its parts below ``unit`` (what :func:`main_waits` takes)."""
    return [(s, s.tiers_below(unit)) for s in _STORES]


@contextlib.contextmanager
def main_waits(held: list[tuple[BackingStore, list[Any]]]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for s, tiers in held:
            stack.enter_context(s.main_waits(tiers))
        yield
