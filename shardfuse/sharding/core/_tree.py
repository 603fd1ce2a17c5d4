"""Walking a tree of units: which modules are units, and the state-dict order of their entries.

State dicts, optimizer-state consolidation and ``summon_full_params`` need the tree, but not the public
wrapper: a module is a unit when it carries a :class:`Unit` under ``UNIT_ATTR``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from shardfuse._streams import wait_stream
from shardfuse.sharding.core._flat_param import FlatParamHandle
from shardfuse.sharding.core._registry import UNIT_ATTR
from shardfuse.sharding.core._runtime import Unit
from shardfuse.sharding.core._state import TrainingState, check_state

# The name of the wrapped module inside each public wrapper: a path segment state dicts leave out.
WRAPPED_SEGMENT = "_fsdp_wrapped_module"


def clean_key(name: str) -> str:
    """``name`` without the wrappers' own path segments (FairScale's clean path)."""
    return ".".join(part for part in name.split(".") if part != WRAPPED_SEGMENT)


def unit_of(module: nn.Module) -> Unit | None:
    """The unit ``module`` is the wrapper of, or None."""
    return module.__dict__.get(UNIT_ATTR)


def require_unit(module: nn.Module) -> Unit:
    """The unit ``module`` is the wrapper of; ``module`` must be a ``FullyShardedDataParallel`` wrapper."""
    unit = unit_of(module)
    if unit is None:
        raise TypeError(f"{type(module).__name__} is not a FullyShardedDataParallel wrapper (it has no unit)")
    return unit


def units_in(module: nn.Module) -> list[Unit]:
    """Every unit in ``module``'s tree (itself included), in module order."""
    return [u for u in map(unit_of, module.modules()) if u is not None]


def units_below(unit: Unit) -> list[Unit]:
    """``unit`` and every unit nested in its module, in module order (``unit`` first)."""
    return [unit, *units_in(unit.module)]


def lent_handles(units: list[Unit]) -> list[tuple[Unit, int, FlatParamHandle]]:
    """``(lender, handle index, handle)`` of each handle that ``units`` borrow from units not among them (a
    nested unit's state dict names parameters a sibling outside it holds), once each."""
    inside = {id(u) for u in units}
    out: dict[int, tuple[Unit, int, FlatParamHandle]] = {}
    for u in units:
        for b in u.borrowed:
            if id(b.lender) not in inside:
                out.setdefault(id(b.handle), (b.lender, b.lender_hi, b.handle))
    return list(out.values())


def check_idle(units: list[Unit], action: str) -> None:
    """Raise unless every unit is idle; then make the compute stream wait for pending gradient reductions."""
    for u in units:
        check_state(u.training_state, (TrainingState.IDLE,), action, u.name,
                    "call it outside forward, backward and summon_full_params()")
    root = units[0].root_state if units else None
    if root is not None:
        wait_stream(root.streams.current(), root.streams.post_backward)


@dataclass(frozen=True)
class Entry:
    """One state-dict entry: ``kind`` is "param", "buffer" or "extra"; ``key`` has no wrapper segments.

    For "param", ``unit``/``handle``/``index`` locate the value in the unit's flat parameters; for "buffer",
    ``attr`` is the buffer's name in ``module``.
    """

    kind: str
    key: str
    module: nn.Module
    unit: Unit | None = None
    handle: int = -1
    index: int = -1
    attr: str = ""


def walk_entries(module: nn.Module, prefix: str = "", owner: Unit | None = None) -> Iterator[Entry]:
    """Entries in ``nn.Module.state_dict`` order with the wrappers' own segments removed."""
    unit = unit_of(module)
    if unit is not None:
        owner = unit
        module = unit.module
    if owner is not None:
        for attr, hi, idx in owner.param_table.get(id(module), ()):
            if hi < 0:  # borrowed from a sibling: the value lives in the lender's handle
                b = owner.borrowed[-1 - hi]
                yield Entry("param", prefix + attr, module, b.lender, b.lender_hi, idx)
            else:
                yield Entry("param", prefix + attr, module, owner, hi, idx)
    for name, buf in module._buffers.items():
        if buf is not None and name not in module._non_persistent_buffers_set:
            yield Entry("buffer", prefix + name, module, owner, attr=name)
    if type(module).get_extra_state is not nn.Module.get_extra_state:
        yield Entry("extra", prefix + "_extra_state", module, owner)
    for name, child in module._modules.items():
        if child is not None:
            yield from walk_entries(child, f"{prefix}{name}.", owner)


def entry_buffer(entry: Entry) -> torch.Tensor:
    """The buffer a "buffer" entry names, as it is now."""
    b = entry.module._buffers[entry.attr]
    if b is None:  # walk_entries yields only buffers that are set
        raise RuntimeError(f"buffer {entry.key} was set to None after the state-dict walk found it")
    return b


def entry_unit(entry: Entry) -> Unit:
    """The unit holding a "param" entry's value (walk_entries gives every one its owner)."""
    if entry.unit is None:
        raise RuntimeError(f"state-dict entry {entry.key} ({entry.kind}) belongs to no unit")
    return entry.unit


def buffer_value(entry: Entry) -> torch.Tensor:
    """A buffer in the dtype it had before wrapping (``buffer_dtype`` casts it for compute)."""
    b = entry_buffer(entry)
    u = entry.unit
    dtype = u.buffer_dtypes.get((id(entry.module), entry.attr), b.dtype) if u is not None else b.dtype
    return b.detach().to(dtype) if b.dtype != dtype else b.detach()


def param_names(root: nn.Module) -> dict[tuple[int, int, int], str]:
    """(id(unit), handle index, unique index) -> the original name (first registration) of every parameter."""
    names: dict[tuple[int, int, int], str] = {}
    for e in walk_entries(root):
        if e.kind == "param":
            names.setdefault((id(e.unit), e.handle, e.index), e.key)
    return names
