"""Full and local state dicts of a tree of units.

Full state dicts use the original parameter names, with no wrapper prefixes, so they load into the
unwrapped model and back; parameters are gathered in their shard dtype (fp32) one unit at a time; floating
buffers are returned in their original dtype.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
from torch import nn

from shardfuse.sharding import _data_path as dp
from shardfuse.sharding._runtime import Unit
from shardfuse.sharding._tree import buffer_value, check_idle, unit_of, units_below, walk_entries


def _idle_units(root: nn.Module, action: str) -> list[Unit]:
    units = units_below(unit_of(root))
    check_idle(units, action)
    return units


@torch.no_grad()
def full_state_dict(root: nn.Module) -> OrderedDict[str, Any]:
    """The full state dict of ``root``'s tree (see module docstring); collective: every rank must call."""
    units = _idle_units(root, "state_dict()")
    cfg = units[0].config
    materialize = not cfg.state_dict_on_rank_0_only or units[0].rank == 0
    values: dict[tuple[int, int], list[torch.Tensor]] = {}
    for u in units:
        for hi, h in enumerate(u.handles):
            full = h.gather_full_precision(u.compute_device)
            if materialize:
                outs = [torch.empty(s, dtype=h.dtype, device=full.device) for s in h.shapes]
                dp.unflatten(full, outs)
                device = cfg.state_dict_device or h.flat.device
                values[(id(u), hi)] = [o.to(device) for o in outs]
            del full
    sd: OrderedDict[str, Any] = OrderedDict()
    if not materialize:
        return sd
    for e in walk_entries(root):
        if e.kind == "param":
            sd[e.key] = values[(id(e.unit), e.handle)][e.index]
        elif e.kind == "buffer":
            t = buffer_value(e)
            sd[e.key] = t.to(cfg.state_dict_device) if cfg.state_dict_device is not None else t
        else:
            sd[e.key] = e.module.get_extra_state()
    return sd


@torch.no_grad()
def load_full_state_dict(root: nn.Module, state_dict: dict[str, Any], strict: bool) -> tuple[list[str], list[str]]:
    """Load a full state dict into the shards and buffers of ``root``'s tree; returns (missing, unexpected)."""
    units = _idle_units(root, "load_state_dict()")
    entries = list(walk_entries(root))
    expected = {e.key for e in entries}
    missing = [e.key for e in entries if e.key not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    if strict and (missing or unexpected):
        raise RuntimeError(
            f"Error(s) in loading state_dict for FullyShardedDataParallel: missing keys {missing[:20]} "
            f"(of {len(missing)}), unexpected keys {unexpected[:20]} (of {len(unexpected)}): pass a full "
            f"state dict with the original parameter names, or strict=False"
        )
    # Provided tensor per (unit, handle, unique index): the first key naming it.
    provided: dict[tuple[int, int, int], tuple[str, torch.Tensor]] = {}
    for e in entries:
        if e.key not in state_dict:
            continue
        value = state_dict[e.key]
        if e.kind == "param":
            shape = e.unit.handles[e.handle].shapes[e.index]
            if tuple(value.shape) != tuple(shape):
                raise RuntimeError(
                    f"size mismatch for {e.key}: the state dict has shape {tuple(value.shape)}, the model "
                    f"{tuple(shape)}"
                )
            provided.setdefault((id(e.unit), e.handle, e.index), (e.key, value))
        elif e.kind == "buffer":
            buf = e.module._buffers[e.attr]
            if tuple(value.shape) != tuple(buf.shape):
                raise RuntimeError(
                    f"size mismatch for {e.key}: the state dict has shape {tuple(value.shape)}, the model "
                    f"{tuple(buf.shape)}"
                )
            buf.copy_(value)
        else:
            e.module.set_extra_state(value)
    for u in units:
        for hi, h in enumerate(u.handles):
            have = [provided.get((id(u), hi, i)) for i in range(len(h.shapes))]
            device = u.compute_device
            if all(x is not None for x in have):
                full = dp.flatten_padded([x[1].to(device) for x in have], h.world_size, h.dtype)
            else:
                # Partial load (strict=False): start from the current values. Collective, like the full case
                # is not: every rank must provide the same keys.
                full = h.gather_full_precision(device)
                views = h.split_full(full)
                for i, x in enumerate(have):
                    if x is not None:
                        views[i].copy_(x[1])
            h.reshard()
            h.flat.detach().copy_(h.shard_of(full))  # bumps the version: gathered copies are refreshed
    return missing, unexpected


@torch.no_grad()
def local_state_dict(root: nn.Module) -> OrderedDict[str, Any]:
    """This rank's flat shards and the buffers, under the wrapper-inclusive names of ``named_parameters()``."""
    _idle_units(root, "local_state_dict()")
    sd: OrderedDict[str, Any] = OrderedDict()
    for name, p in root.named_parameters():
        sd[name] = p.detach().clone()
    for name, b in root.named_buffers():
        sd[name] = b.detach().clone()
    return sd


@torch.no_grad()
def load_local_state_dict(
    root: nn.Module, state_dict: dict[str, Any], strict: bool
) -> tuple[list[str], list[str]]:
    """Load a :func:`local_state_dict`; shapes must match (same world size and wrapping)."""
    units = _idle_units(root, "load_local_state_dict()")
    params = dict(root.named_parameters())
    buffers = dict(root.named_buffers())
    missing = [k for k in (*params, *buffers) if k not in state_dict]
    unexpected = [k for k in state_dict if k not in params and k not in buffers]
    if strict and (missing or unexpected):
        raise RuntimeError(
            f"Error(s) in loading local_state_dict: missing keys {missing[:20]}, unexpected keys "
            f"{unexpected[:20]}: it must come from local_state_dict() of the same wrapping on the same rank"
        )
    for k, v in state_dict.items():
        target = params.get(k, buffers.get(k))
        if target is None:
            continue
        if tuple(v.shape) != tuple(target.shape):
            raise RuntimeError(
                f"size mismatch for {k}: saved shard has shape {tuple(v.shape)} but this rank's has "
                f"{tuple(target.shape)}: local state dicts only load with the same world size and wrapping"
            )
        target.detach().copy_(v)
    for u in units:
        u.reshard()
    return missing, unexpected
