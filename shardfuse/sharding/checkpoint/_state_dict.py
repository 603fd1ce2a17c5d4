"""Full and local state dicts of a tree of units.

Full state dicts use the original parameter names, with no wrapper prefixes, so they load into the
unwrapped model and back; parameters are gathered in their shard dtype (fp32) one unit at a time; floating
buffers are returned in their original dtype.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from shardfuse.sharding.core import _data_path as dp
from shardfuse.sharding.core._flat_param import FlatParamHandle
from shardfuse.sharding.core._runtime import Unit
from shardfuse.sharding.core._state import TrainingState
from shardfuse.sharding.core._tree import (
    buffer_value,
    check_idle,
    clean_key,
    entry_buffer,
    entry_unit,
    lent_handles,
    require_unit,
    unit_of,
    units_below,
    walk_entries,
)


def _idle_units(root: nn.Module, action: str) -> list[Unit]:
    units = units_below(require_unit(root))
    check_idle(units, action)
    return units


def _state_dict_device(unit: Unit) -> torch.device:
    """Where state-dict tensors go: the host with ``move_params_to_cpu`` (as in FairScale), else
    ``state_dict_device`` if given, else the compute device."""
    cfg = unit.config
    if cfg.offload.move_params_to_cpu:
        return torch.device("cpu")
    device = cfg.state_dict.state_dict_device
    return device if device is not None else unit.compute_device


@torch.no_grad()
def full_state_dict(root: nn.Module) -> OrderedDict[str, Any]:
    """The full state dict of ``root``'s tree (see module docstring); collective: every rank must call.

    Inside ``summon_full_params()`` the summoned units' values are read (and copied) from the module
    attributes, so in-block changes show; the other units are gathered.
    """
    units = units_below(require_unit(root))
    work = _handles_read(units)
    summoned = {id(u) for u, _, _ in work if u.training_state == TrainingState.SUMMON_FULL_PARAMS}
    check_idle([u for u in _units_of(units, work) if id(u) not in summoned], "state_dict()")
    cfg = units[0].config
    device = _state_dict_device(units[0])
    materialize = not cfg.state_dict.state_dict_on_rank_0_only or units[0].rank == 0
    values: dict[tuple[int, int], list[torch.Tensor]] = {}
    for u, hi, h in work:
        if id(u) in summoned:
            if materialize:
                values[(id(u), hi)] = [s.module._parameters[s.attr].detach().to(device, copy=True)
                                       for s in _first_slots(h)]
            continue
        full = h.gather_full_precision(u.compute_device)
        if materialize:
            outs = [torch.empty(s, dtype=h.dtype, device=full.device) for s in h.shapes]
            dp.unflatten_into(full, outs)
            values[(id(u), hi)] = [o.to(device) for o in outs]
        del full
    sd: OrderedDict[str, Any] = OrderedDict()
    if not materialize:
        return sd
    for e in walk_entries(root):
        if e.kind == "param":
            sd[e.key] = values[(id(e.unit), e.handle)][e.index]
        elif e.kind == "buffer":
            sd[e.key] = buffer_value(e).to(device, copy=True)
        else:
            sd[e.key] = e.module.get_extra_state()
    return sd


def _handles_read(units: list[Unit]) -> list[tuple[Unit, int, FlatParamHandle]]:
    """``(unit, handle index, handle)`` of every handle whose parameters ``units``' entries name: their own,
    then those borrowed from siblings outside them."""
    return [(u, hi, h) for u in units for hi, h in enumerate(u.handles)] + lent_handles(units)


def _units_of(units: list[Unit], work: list[tuple[Unit, int, FlatParamHandle]]) -> list[Unit]:
    """``units`` and the siblings outside them that lend them parameters."""
    return list({id(u): u for u in [*units, *(w[0] for w in work)]}.values())


def _first_slots(h: Any) -> list[Any]:
    """The first registration of each unique parameter of a handle, in unique-index order."""
    first: dict[int, Any] = {}
    for s in h.slots:
        first.setdefault(s.index, s)
    return [first[i] for i in range(len(h.shapes))]


@torch.no_grad()
def load_full_state_dict(root: nn.Module, state_dict: Mapping[str, Any], strict: bool) -> tuple[list[str], list[str]]:
    """Load a full state dict into the shards and buffers of ``root``'s tree; returns (missing, unexpected)."""
    units = units_below(require_unit(root))
    work = _handles_read(units)
    check_idle(_units_of(units, work), "load_state_dict()")
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
        if e.kind != "extra" and not isinstance(value, torch.Tensor):
            raise TypeError(
                f"state_dict[{e.key!r}] is a {type(value).__name__}, not a tensor: a full state dict maps each "
                f"parameter and buffer name to a tensor (e.g. from model.state_dict() of the unwrapped model)"
            )
        if e.kind == "param":
            shape = entry_unit(e).handles[e.handle].shapes[e.index]
            if tuple(value.shape) != tuple(shape):
                raise RuntimeError(
                    f"size mismatch for {e.key}: the state dict has shape {tuple(value.shape)}, the model "
                    f"{tuple(shape)}"
                )
            provided.setdefault((id(e.unit), e.handle, e.index), (e.key, value))
        elif e.kind == "buffer":
            buf = entry_buffer(e)
            if tuple(value.shape) != tuple(buf.shape):
                raise RuntimeError(
                    f"size mismatch for {e.key}: the state dict has shape {tuple(value.shape)}, the model "
                    f"{tuple(buf.shape)}"
                )
            buf.copy_(value)
        else:
            e.module.set_extra_state(value)
    for u, hi, h in work:
        have = [provided.get((id(u), hi, i)) for i in range(len(h.shapes))]
        device = u.compute_device
        given = [x[1] for x in have if x is not None]
        if len(given) == len(have):
            # Cast like nn.Module.load_state_dict's copy_ does (an int64 tensor loads into a float parameter).
            full = dp.flatten_pad([t.to(device, h.dtype) for t in given], h.world_size, dtype=h.dtype)
        else:
            # Partial load (strict=False, or a nested unit naming some of a sibling's parameters): start from the
            # current values. Collective, like the full case is not: every rank must provide the same keys.
            full = h.gather_full_precision(device)
            views = h.split_full(full)
            for i, x in enumerate(have):
                if x is not None:
                    views[i].copy_(x[1])
        h.reshard()
        h.flat.detach().copy_(h.shard_of(full))  # bumps the version: gathered copies are refreshed
    return missing, unexpected


def _local_targets(root: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's flat shards (``<unit path>.flat_param_<i>``, whether or not the original parameters are
    exposed) and the buffers, keyed without wrapper segments."""
    targets: dict[str, torch.Tensor] = {}
    for path, m in root.named_modules():
        u = unit_of(m)
        if u is not None:
            prefix = clean_key(path)
            for i, h in enumerate(u.handles):
                targets[f"{prefix}.flat_param_{i}" if prefix else f"flat_param_{i}"] = h.flat
    for name, b in root.named_buffers():
        targets[clean_key(name)] = b
    return targets


@torch.no_grad()
def local_state_dict(root: nn.Module) -> OrderedDict[str, Any]:
    """This rank's flat shards and the buffers, keyed by their names without wrapper segments."""
    _idle_units(root, "local_state_dict()")
    return OrderedDict((k, t.detach().clone()) for k, t in _local_targets(root).items())


@torch.no_grad()
def load_local_state_dict(
    root: nn.Module, state_dict: dict[str, Any], strict: bool
) -> tuple[list[str], list[str]]:
    """Load a :func:`local_state_dict`; shapes must match (same world size and wrapping)."""
    units = _idle_units(root, "load_local_state_dict()")
    targets = _local_targets(root)
    missing = [k for k in targets if k not in state_dict]
    unexpected = [k for k in state_dict if k not in targets]
    if strict and (missing or unexpected):
        raise RuntimeError(
            f"Error(s) in loading local_state_dict: missing keys {missing[:20]}, unexpected keys "
            f"{unexpected[:20]}: it must come from local_state_dict() of the same wrapping on the same rank"
        )
    for k, v in state_dict.items():
        target = targets.get(k)
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


def local_metadata_dict(root: nn.Module) -> dict[str, Any]:
    """FairScale's metadata for offline consolidation of :func:`local_state_dict` shards (see the wrapper)."""
    param_metadata = []
    paths = {id(u): clean_key(path) for path, m in root.named_modules() if (u := unit_of(m)) is not None}
    for path, m in root.named_modules():
        u = unit_of(m)
        if u is None:
            continue
        params = {}
        for hi, h in enumerate(u.handles):
            # This rank's shard covers [rank * shard, (rank + 1) * shard) of the padded flat buffer.
            end = (u.rank + 1) * h.shard_numel
            params[f"flat_param_{hi}"] = {
                "names": list(h.names),
                "shapes": [torch.Size(s) for s in h.shapes],
                "numels": list(h.numels),
                "padding": min(max(end - h.numel, 0), h.shard_numel),
            }
        shared = [(clean_key(f"{path}.{first}" if path else first), clean_key(f"{path}.{s.fqn}" if path else s.fqn))
                  for h in u.handles for s, first in ((s, h.names[s.index]) for s in h.slots) if s.fqn != first]
        # Borrowed from a sibling: consolidation copies the lender's value (a lender outside ``root`` has none).
        shared += [(_join(paths[id(b.lender)], b.lender.handles[b.lender_hi].names[b.index]), _join(path, b.fqn))
                   for b in u.borrowed if id(b.lender) in paths]
        param_metadata.append({
            "fsdp_path": clean_key(path),
            "params": params,
            "no_broadcast_optim_state": u.no_broadcast_optim_state,
            "shared_param_info": shared,
        })
    buffer_names = [clean_key(name) for name, _ in root.named_buffers()]
    return {"param_metadata": param_metadata, "buffer_names": buffer_names}


def _join(path: str, name: str) -> str:
    return clean_key(f"{path}.{name}" if path else name)


def consolidate_shard_weights(
    shard_weights: list[dict[str, torch.Tensor]],
    shard_metadata: list[dict[str, Any]],
    with_module_buffers: bool = True,
    strict: bool = True,
) -> dict[str, torch.Tensor]:
    """Full weights from every rank's local state dict and metadata (rank order); no process group needed."""
    if not shard_weights or len(shard_weights) != len(shard_metadata):
        raise ValueError(
            f"consolidate_shard_weights needs one metadata dict per shard and at least one shard, got "
            f"{len(shard_weights)} weight dicts and {len(shard_metadata)} metadata dicts"
        )
    out: dict[str, torch.Tensor] = {}
    shared: list[tuple[str, str]] = []
    for ui, meta in enumerate(shard_metadata[0]["param_metadata"]):
        path = meta["fsdp_path"]
        shared.extend(meta.get("shared_param_info", ()))
        for flat_name, info in meta["params"].items():
            key = f"{path}.{flat_name}" if path else flat_name
            if key not in shard_weights[0] and not strict:
                continue
            pieces = []
            for rank, (weights, rank_meta) in enumerate(zip(shard_weights, shard_metadata)):
                if key not in weights:
                    raise KeyError(f"consolidate_shard_weights: rank {rank}'s weights lack {key!r} (pass strict=False "
                                   f"to skip parameters missing from rank 0)")
                pad = rank_meta["param_metadata"][ui]["params"][flat_name]["padding"]
                shard = weights[key]
                pieces.append(shard[: shard.numel() - pad] if pad else shard)
                if meta["no_broadcast_optim_state"]:
                    break  # an expert's parameters are whole on every rank
            full = torch.cat(pieces)
            if full.numel() != sum(info["numels"]):
                raise ValueError(
                    f"consolidate_shard_weights: {key} rebuilds {full.numel()} elements but the metadata names "
                    f"{sum(info['numels'])}: pass every rank's shard, in rank order"
                )
            for name, piece, shape in zip(info["names"], full.split(info["numels"]), info["shapes"]):
                out[f"{path}.{name}" if path else name] = piece.view(shape)
    for src, dst in shared:
        out[dst] = out[src]
    if with_module_buffers:
        for name in shard_metadata[0]["buffer_names"]:
            if name in shard_weights[0] or strict:
                out[name] = shard_weights[0][name]
    return out
