"""Wrap time: a unit's own parameters become flat shards, one :class:`FlatParamHandle` per (dtype,
requires_grad, float8) group; parameters a sibling unit flattened first are borrowed instead. Float8 weights (those
a registered marker claims, ``_fp8_gather.py``) get flat parameters of their own, so the other groups keep their
padding, optimizer state and state dicts."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from shardfuse.sharding.core._config import ShardingConfig, check_param_dtype
from shardfuse.sharding.core._devices import param_device, shard_device
from shardfuse.sharding.core._flat_param import BorrowedSlot, FlatParamHandle, ParamSlot, ParamTable
from shardfuse.sharding.core._fp8_gather import marker_of
from shardfuse.sharding.core._groups import Groups
from shardfuse.sharding.core._registry import (
    FLATTENED_MARK,
    OWNED_MARK,
    UNIT_ATTR,
    flattened_into,
    handle_of,
    iter_own_modules,
    register_flattened,
)


@dataclass
class _Found:
    """A unit's own parameter registrations, in module order."""

    unique: dict[int, nn.Parameter] = field(default_factory=dict)
    regs: list[tuple[str, nn.Module, str, nn.Parameter]] = field(default_factory=list)  # (prefix, module, attr, p)
    borrowed: list[BorrowedSlot] = field(default_factory=list)
    order: dict[int, list[str]] = field(default_factory=dict)  # id(module) -> its parameter names, in order


def flatten_own_params(
    module: nn.Module, config: ShardingConfig, groups: Groups
) -> tuple[list[FlatParamHandle], ParamTable, list[BorrowedSlot]]:
    """Flatten ``module``'s own parameters (not those of nested units) per (dtype, requires_grad, float8) group.

    The original ``nn.Parameter`` objects leave their modules' ``_parameters`` (marked with ``FLATTENED_MARK``);
    the returned handles own the shards (kept where :func:`~shardfuse.sharding.core._devices.shard_device` says).
    Groups come in order of first appearance. A parameter a sibling unit already flattened (shared across
    units) is not flattened again but borrowed: its registrations come back as :class:`BorrowedSlot`, in the
    table as handle index ``-1 - k`` for the ``k``-th of them.
    """
    found = _find_params(module)
    if found.borrowed:
        _refuse_nested_lenders(module, found.borrowed)
    placed = param_device(type(module).__name__, {f"{pre}{n}": p.device for pre, _, n, p in found.regs})
    where = shard_device(config, groups, placed)
    markers: dict[int, object] = {}  # id(p) -> the float8 marker of its first registration
    for _, m, n, p in found.regs:
        if id(p) not in markers:
            markers[id(p)] = marker_of(m, n, p)
    by_group: dict[tuple[torch.dtype, bool, bool], list[nn.Parameter]] = {}
    for p in found.unique.values():
        by_group.setdefault((p.dtype, p.requires_grad, markers[id(p)] is not None), []).append(p)
    handles: list[FlatParamHandle] = []
    table: ParamTable = {}
    for hi, params in enumerate(by_group.values()):
        index = {id(p): i for i, p in enumerate(params)}
        slots = [ParamSlot(m, n, f"{pre}{n}", index[id(p)]) for pre, m, n, p in found.regs if id(p) in index]
        handle = FlatParamHandle(params, slots, groups=groups, shard_device=where,
                                 pin=config.offload.move_params_to_cpu)
        if markers[id(params[0])] is not None:
            handle.use_float8(markers[id(params[0])])
        handles.append(handle)
        for s in slots:
            table.setdefault(id(s.module), []).append((s.attr, hi, s.index))
        for p in params:
            register_flattened(p, handle, index[id(p)])
    for k, b in enumerate(found.borrowed):
        table.setdefault(id(b.module), []).append((b.attr, -1 - k, b.index))
    # Keep each module's original parameter order for state dicts.
    for mid, names in found.order.items():
        rank_of = {n: i for i, n in enumerate(names)}
        table[mid].sort(key=lambda e: rank_of[e[0]])
    _take_params(module, found)
    return handles, table, found.borrowed


def _find_params(module: nn.Module) -> _Found:
    found = _Found()
    for prefix, m in iter_own_modules(module):
        for name, p in m._parameters.items():
            if p is None:
                continue
            if getattr(p, FLATTENED_MARK, None) is not None or handle_of(p) is not None:
                lent = flattened_into(p)
                if lent is None:
                    raise ValueError(
                        f"parameter {prefix}{name} was flattened by a FullyShardedDataParallel unit that no longer "
                        f"exists (or is a unit's flat parameter): its values are stale; register a live parameter"
                    )
                found.borrowed.append(BorrowedSlot(m, name, f"{prefix}{name}", *lent))
            else:
                check_param_dtype(f"{prefix}{name}", p.dtype)
                found.unique.setdefault(id(p), p)
                found.regs.append((prefix, m, name, p))
            found.order.setdefault(id(m), []).append(name)
    return found


def _take_params(module: nn.Module, found: _Found) -> None:
    """The original parameters leave their modules (the handles own them now); borrowed ones follow the lender."""
    for _, m, name, p in found.regs:
        m._parameters.pop(name, None)
        setattr(p, FLATTENED_MARK, True)
    for b in found.borrowed:
        b.module._parameters.pop(b.attr, None)
        b.handle.lend(ParamSlot(b.module, b.attr, b.fqn, b.index))
    for _, m in iter_own_modules(module):
        object.__setattr__(m, OWNED_MARK, True)


def _refuse_nested_lenders(module: nn.Module, borrowed: list[BorrowedSlot]) -> None:
    """Only siblings share: a unit nested inside this one reshards the parameter after its own forward, in the
    middle of this unit's forward, which still reads it."""
    nested = {id(h) for m in module.modules() if UNIT_ATTR in m.__dict__ for h in m.__dict__[UNIT_ATTR].handles}
    for b in borrowed:
        if id(b.handle) in nested:
            raise ValueError(
                f"parameter {b.fqn} is shared with a module already wrapped by another FullyShardedDataParallel "
                f"unit nested inside this {type(module).__name__}: parameters are shared only between sibling units "
                f"(neither inside the other); wrap the modules that share it in the same unit, or wrap each of them "
                f"as a sibling unit under a common root"
            )
