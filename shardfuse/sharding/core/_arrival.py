"""Collective entry points wait a bounded time for every rank, then say what is wrong (issue #29).

The most common distributed mistake, ``if rank == 0: torch.save(model.state_dict())``, leaves rank 0 in a
collective that the other ranks never join: it hangs with no message until the process group's timeout (30
minutes by default, or never). Before its collectives, each collective entry point (full and sharded state dicts
and their loads, ``summon_full_params``, optimizer consolidation) first checks that every rank of the unit's
process group arrived at the same call, through the process group's key-value store (the default store, which
gloo and NCCL groups both have): each rank adds one to the call's counter, the last one to arrive marks the call
complete, the others wait for that mark (two store round trips per call). A rank that waits longer than the
timeout (``SHARDFUSE_COLLECTIVE_TIMEOUT_S``, default 120 s) takes its arrival back and raises, naming the call,
how many ranks arrived, and the fix. Calls are numbered per process group on each rank (the same sequence on
every rank when the program is right); a call abandoned this way keeps its number, so the ranks that did arrive
may retry once the others catch up. Keys of completed calls are deleted two calls later.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from shardfuse._profiling import profiled
from shardfuse.sharding.core import _collectives as coll
from shardfuse.sharding.core._runtime import Unit

ENV_TIMEOUT = "SHARDFUSE_COLLECTIVE_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 120.0
_PREFIX = "shardfuse/arrive"
# process group name -> (calls completed on this rank, the keys of the last two completed calls)
_CALLS: dict[str, tuple[int, list[str]]] = {}


def collective_timeout_s() -> float:
    """Seconds a collective entry point waits for every rank: ``SHARDFUSE_COLLECTIVE_TIMEOUT_S`` or 120."""
    raw = os.environ.get(ENV_TIMEOUT, "").strip()
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{ENV_TIMEOUT}={raw!r} must be a number of seconds > 0 (default {DEFAULT_TIMEOUT_S:g})")
    return value


def _store() -> Any:
    """The default group's key-value store, or None where torch does not expose it (the check is skipped)."""
    get = getattr(dist.distributed_c10d, "_get_default_store", None)
    try:
        return get() if get is not None else None
    except (RuntimeError, ValueError):
        return None


def arrive(unit: Unit, call: str) -> None:
    """Return once every rank of ``unit``'s process group has reached ``call``; raise after the timeout."""
    group = unit.groups.process_group
    if unit.world_size == 1 or not coll.is_process_group(group) or not dist.is_initialized():
        return
    store = _store()
    if store is None:
        return
    name = group.group_name
    done, recent = _CALLS.get(name, (0, []))
    world = unit.world_size
    key = f"{_PREFIX}/{name}/{done}/{call}"
    if store.add(key, 1) == world:
        store.set(key + "/all", "1")
        for old in recent[:-1]:  # two calls back: every rank has seen it complete (it reached the next one)
            store.delete_key(old)
            store.delete_key(old + "/all")
    else:
        timeout = collective_timeout_s()
        try:
            store.wait([key + "/all"], datetime.timedelta(seconds=timeout))
        except RuntimeError as err:  # the store's timeout (DistStoreError is a RuntimeError)
            arrived = store.add(key, -1) + 1  # this rank leaves: the call keeps its number for a retry
            raise RuntimeError(
                f"{call} was called on rank {dist.get_rank()}, but only {arrived} of the {world} ranks of its process "
                f"group called it within {timeout:g} s (the others never did, or called another collective "
                f"shardfuse function first): {call} is collective, every rank must call it, in the same order, e.g. "
                f"`sd = model.state_dict()` on every rank, then `if rank == 0: torch.save(sd, path)`. A rank that "
                f"is only slower (a long save or evaluation in between) needs a longer wait: set {ENV_TIMEOUT} "
                f"(seconds, now {timeout:g})"
            ) from err
    _CALLS[name] = (done + 1, [*recent[-1:], key])


@contextlib.contextmanager
def collective_call(unit: Unit, call: str) -> Iterator[None]:
    """The profiler range ``shardfuse.sharding:<call>`` around the block, after :func:`arrive`."""
    arrive(unit, f"{call}()")
    with profiled(f"shardfuse.sharding:{call}"):
        yield
