"""Wrap-time set-up besides flattening: storage for meta-built modules, guards, and the first rank's values.

- modules built on the meta device get real storage and their initial values (:func:`materialize_meta`);
- ``reset_parameters()`` of flattened modules fails loudly unless ``allow_reset_parameters``;
- ``sync_module_states`` broadcasts the first rank's parameters and buffers; without it, ranks are checked to
  agree (one tiny all-gather per unit) and, if they do not, get the first rank's values with a warning.

The process-wide hooks installed at the first wrap live in ``_process_hooks.py``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from shardfuse._logging import warn_once
from shardfuse.sharding.core import _collectives as coll
from shardfuse.sharding.core._groups import Groups, check_sync_module_states
from shardfuse.sharding.core._registry import FLATTENED_MARK, handle_of, iter_own_modules

logger = logging.getLogger(__name__)


def _forbidden_reset(module: nn.Module, *args: Any, **kwargs: Any) -> None:
    raise RuntimeError(
        f"reset_parameters() of {type(module).__name__} was called after FullyShardedDataParallel flattened its "
        f"parameters: pass allow_reset_parameters=True and call it inside summon_full_params()"
    )


def guard_reset_parameters(module: nn.Module) -> None:
    """Make ``reset_parameters`` of owned submodules fail loudly (``allow_reset_parameters=False``)."""
    for _, m in iter_own_modules(module):
        if callable(getattr(type(m), "reset_parameters", None)):
            m.__dict__["reset_parameters"] = functools.partial(_forbidden_reset, m)


def _own_states(module: nn.Module) -> list[torch.Tensor]:
    """The unit's own parameters and buffers, each once; not those a sibling unit flattened (borrowed: a view's
    values differ by rank, and the lender made them agree already)."""
    found: dict[int, torch.Tensor] = {}
    for _, m in iter_own_modules(module):
        for t in (*m._parameters.values(), *m._buffers.values()):
            if t is not None and getattr(t, FLATTENED_MARK, None) is None and handle_of(t) is None:
                found.setdefault(id(t), t)
    return list(found.values())


def _shard_then_replicas(groups: Groups) -> list[Groups]:
    """The shard group, then (hybrid sharding) the replicate group: after both, every rank of the job holds
    global rank 0's values."""
    if not groups.hybrid:
        return [groups]
    rg = groups.replicate_group
    return [groups, Groups(rg, rg, groups.replicate_rank, groups.replicate_size)]


def agree_on_initial_values(module: nn.Module, groups: Groups, name: str) -> None:
    """:func:`_agree` over the shard group, then across replicas."""
    for g in _shard_then_replicas(groups):
        _agree(module, g, name)


def broadcast_own_states(module: nn.Module, groups: Groups) -> None:
    """:func:`_broadcast` over the shard group, then across replicas (``sync_module_states``)."""
    for g in _shard_then_replicas(groups):
        _broadcast(module, g)


@torch.no_grad()
def _agree(module: nn.Module, groups: Groups, name: str) -> None:
    """Make every rank of the unit's group start from the same parameters and buffers.

    Each rank keeps only its slice of what it built, so ranks built with different seeds would otherwise train a
    mix of both inits. One all-gather of a fingerprint per unit (count, size, sum and sum of squares) finds that;
    the first rank's values are then broadcast, as ``sync_module_states=True`` and DistributedDataParallel do,
    with a warning. Ranks whose unit differs in shape get an error naming it (a broadcast would not line up).
    """
    world = groups.world_size
    if world == 1 or not coll.is_process_group(groups.process_group):
        return
    states = _own_states(module)
    if any(t.device.type == "meta" for t in states):
        return  # nothing to compare yet: param_init_fn / reset_parameters decide later
    dev = groups.device
    stats = [float(len(states)), float(sum(t.numel() for t in states)), 0.0, 0.0]
    for t in states:
        wide = t.detach().double()
        stats[2] += wide.sum().item()
        stats[3] += wide.square().sum().item()
    mine = torch.tensor(stats, dtype=torch.float64, device=dev)
    everyone = torch.empty(world * 4, dtype=torch.float64, device=dev)
    coll.all_gather_into(everyone, mine, groups.process_group, world)
    rows = everyone.view(world, 4).tolist()
    for rank, row in enumerate(rows[1:], start=1):
        if row[:2] != rows[0][:2]:
            raise RuntimeError(
                f"ranks wrapped the model differently: {name} has {int(rows[0][0])} parameters and buffers of "
                f"{int(rows[0][1])} elements on rank 0 but {int(row[0])} of {int(row[1])} on rank {rank}: build "
                f"and wrap the same model on every rank"
            )
    differ = [r for r, row in enumerate(rows) if row != rows[0]]
    if differ:
        warn_once(
            logger,
            f"ranks built {name} with different initial values (rank 0 differs from rank {differ[0]}): every rank "
            f"now starts from rank 0's parameters and buffers, as with sync_module_states=True (each rank keeps "
            f"only its shard, so keeping them would train a mix of the ranks' inits); seed every rank identically "
            f"or load the same checkpoint on each, or pass sync_module_states=True to broadcast without this check",
        )
        _broadcast(module, groups)


@torch.no_grad()
def _broadcast(module: nn.Module, groups: Groups) -> None:
    """Copy the first rank's values of the unit's own parameters and buffers to every rank (one broadcast per
    dtype and device)."""
    check_sync_module_states(groups)
    tensors: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in _own_states(module):
        tensors.setdefault((t.dtype, t.device), []).append(t)
    on_gpu = groups.device.type == "cuda"
    for unique in tensors.values():
        flat = torch.cat([t.detach().reshape(-1) for t in unique])
        if on_gpu and flat.device.type == "cpu":  # NCCL moves CUDA tensors only
            flat = flat.cuda()
        coll.broadcast_(flat, groups.process_group, groups.world_size)
        for t, v in zip(unique, flat.split([t.numel() for t in unique])):
            t.detach().copy_(v.view_as(t))


def materialize_meta(
    module: nn.Module, device: torch.device, param_init_fn: Callable[[nn.Module], None] | None
) -> None:
    """Give ``module``'s own modules on the meta device real storage on ``device`` and their initial values.

    Called by each unit before it flattens, inner units first, so a model built under ``torch.device("meta")``
    never exists whole: only one unit's parameters are full at a time, then each rank keeps its shard. Each own
    module with meta tensors (nested units are already done and are never passed) goes to ``param_init_fn``
    (FSDP1's argument, e.g. ``m.to_empty(device=..., recurse=False)`` then a model's own init of ``m``), or by
    default is ``to_empty``-ed and its ``reset_parameters()`` runs. Parameters tied across modules stay tied.
    """
    own = [(prefix, m) for prefix, m in iter_own_modules(module)]
    if not any(_has_meta(m) for _, m in own):
        return
    first: dict[int, nn.Parameter] = {}  # id of a meta parameter -> what it became
    for prefix, m in own:
        if not _has_meta(m):
            continue
        tied = {name: first[id(p)] for name, p in m._parameters.items() if p is not None and id(p) in first}
        olds = {name: p for name, p in m._parameters.items() if p is not None and p.is_meta}
        if param_init_fn is not None:
            param_init_fn(m)
        else:
            m.to_empty(device=device, recurse=False)
            reset = getattr(m, "reset_parameters", None)
            if callable(reset):
                reset()
            elif olds.keys() - tied.keys():
                raise ValueError(
                    f"{prefix.rstrip('.') or '<the module itself>'} ({type(m).__name__}) is on the meta device and "
                    f"has no reset_parameters() to initialise {sorted(olds.keys() - tied.keys())}: pass "
                    f"param_init_fn=... (called with each such module) or build it on a real device"
                )
        for name, p in olds.items():
            now = m._parameters.get(name)
            if now is not None:
                first.setdefault(id(p), now)
        for name, p in tied.items():
            m._parameters[name] = p
    left = sorted(f"{prefix}{name}" for prefix, m in own for name, t in (*m._parameters.items(), *m._buffers.items())
                  if t is not None and t.is_meta)
    if left:
        raise ValueError(
            f"{type(module).__name__} still has tensors on the meta device after initialisation ({left[:8]}): "
            f"param_init_fn must give every parameter and buffer of the module it gets real storage (e.g. "
            f"module.to_empty(device=..., recurse=False) then initialise them)"
        )


def _has_meta(m: nn.Module) -> bool:
    return any(t is not None and t.is_meta for t in (*m._parameters.values(), *m._buffers.values()))
