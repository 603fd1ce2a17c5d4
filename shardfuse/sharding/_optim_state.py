"""Consolidate optimizer state of sharded flat parameters into per-original-parameter state, and back.

The full (consolidated) optimizer state dict has one entry per original parameter, numbered in the order
of the units (module order), their flat groups and the parameters inside each group; ``param_names`` gives
each index's original name. Per-element state tensors (same shape as the shard: ``exp_avg``,
``momentum_buffer``...) are all-gathered and cut back into parameter shapes; everything else (``step``,
scalars) is copied to each parameter of the flat group.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from shardfuse.sharding import _collectives as coll
from shardfuse.sharding import _data_path as dp
from shardfuse.sharding._flat_param import FlatParamHandle
from shardfuse.sharding._runtime import Unit
from shardfuse.sharding._tree import check_idle, param_names, unit_of, units_below

_META_KEY = "shardfuse"


def _flat_layout(root: nn.Module) -> list[tuple[Unit, FlatParamHandle, list[int], list[str]]]:
    """(unit, handle, original indices, original names) for every flat parameter of the tree, in order."""
    names = param_names(root)
    layout = []
    k = 0
    for u in units_below(unit_of(root)):
        for hi, h in enumerate(u.handles):
            n = len(h.shapes)
            layout.append((u, h, list(range(k, k + n)), [names[(id(u), hi, i)] for i in range(n)]))
            k += n
    return layout


def _optim_index(optim: torch.optim.Optimizer) -> dict[int, int]:
    """id(parameter) -> index used by ``optim.state_dict()``."""
    out: dict[int, int] = {}
    for g in optim.param_groups:
        for p in g["params"]:
            out.setdefault(id(p), len(out))
    return out


def _is_sharded_state(v: Any, h: FlatParamHandle) -> bool:
    return isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == h.shard_numel and h.shard_numel > 0


@torch.no_grad()
def gather_full_optim_state_dict(
    root: nn.Module, optim: torch.optim.Optimizer, recipient_rank: int | None
) -> dict[str, Any] | None:
    """See ``FullyShardedDataParallel.gather_full_optim_state_dict``."""
    unit = unit_of(root)
    check_idle(units_below(unit), "gather_full_optim_state_dict()")
    if not unit.is_root:
        raise RuntimeError("gather_full_optim_state_dict() must be called on the root FullyShardedDataParallel")
    layout = _flat_layout(root)
    index = _optim_index(optim)
    ours = {id(h.flat) for _, h, _, _ in layout}
    foreign = [i for pid, i in index.items() if pid not in ours]
    if foreign:
        raise ValueError(
            f"the optimizer holds {len(foreign)} parameters that are not flat parameters of this "
            f"FullyShardedDataParallel tree (indices {foreign[:8]}): build the optimizer on the root's parameters()"
        )
    osd = optim.state_dict()
    me = unit.rank
    receive = recipient_rank is None or me == recipient_rank
    state: dict[int, dict[str, Any]] = {}
    flat_to_orig: dict[int, list[int]] = {}
    for u, h, orig, _ in layout:
        oi = index.get(id(h.flat))
        if oi is None:
            continue
        flat_to_orig[oi] = orig
        st = osd["state"].get(oi, {})
        per_param: list[dict[str, Any]] = [{} for _ in orig]
        for key in sorted(st):
            v = st[key]
            if _is_sharded_state(v, h) and not u.no_broadcast_optim_state:
                full = h.gather_full_precision(u.compute_device, source=v.detach())
                if receive:
                    outs = [torch.empty(s, dtype=v.dtype, device=full.device) for s in h.shapes]
                    dp.unflatten(full, outs)
                    for d, o in zip(per_param, outs):
                        d[key] = o.cpu()
            elif _is_sharded_state(v, h):
                # Unsharded unit (world size 1): the local state is the full state.
                outs = [torch.empty(s, dtype=v.dtype, device=v.device) for s in h.shapes]
                dp.unflatten(v, outs)
                for d, o in zip(per_param, outs):
                    d[key] = o.cpu()
            else:
                for d in per_param:
                    d[key] = v.detach().clone().cpu() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
        if receive:
            for k, d in zip(orig, per_param):
                if d:
                    state[k] = d
    coll.barrier(unit.groups.process_group, unit.world_size)
    if not receive:
        return None
    groups = []
    for g in osd["param_groups"]:
        g2 = {k: copy.deepcopy(v) for k, v in g.items() if k != "params"}
        g2["params"] = [k for oi in g["params"] for k in flat_to_orig.get(oi, [])]
        groups.append(g2)
    return {
        "state": state,
        "param_groups": groups,
        "param_names": [n for _, _, _, names in layout for n in names],
        _META_KEY: {"flat_to_orig": flat_to_orig, "world_size": unit.world_size},
    }


@torch.no_grad()
def get_shard_from_optim_state_dict(root: nn.Module, full_osd: dict[str, Any]) -> dict[str, Any]:
    """See ``FullyShardedDataParallel.get_shard_from_optim_state_dict``."""
    if not isinstance(full_osd, dict) or _META_KEY not in full_osd:
        raise ValueError(
            "get_shard_from_optim_state_dict() needs a dict made by gather_full_optim_state_dict() "
            f"(missing the '{_META_KEY}' entry)"
        )
    layout = _flat_layout(root)
    flat_to_orig = {int(k): v for k, v in full_osd[_META_KEY]["flat_to_orig"].items()}
    by_orig = {tuple(orig): h for _, h, orig, _ in layout}
    full_state = full_osd["state"]
    state: dict[int, dict[str, Any]] = {}
    for oi, orig in flat_to_orig.items():
        h = by_orig.get(tuple(orig))
        if h is None:
            raise ValueError(
                f"optimizer entry {oi} covers original parameters {orig[:4]}... which do not form a flat group of "
                f"this model: load it into the same wrapping it was saved from"
            )
        entries = [full_state.get(k) for k in orig]
        if all(e is None for e in entries):
            continue
        if any(e is None for e in entries):
            raise ValueError(f"optimizer state is missing for some parameters of flat group {oi}: {orig}")
        out: dict[str, Any] = {}
        for key, first in entries[0].items():
            vals = [e[key] for e in entries]
            per_elem = isinstance(first, torch.Tensor) and all(
                isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(s) and v.dim() > 0
                for v, s in zip(vals, h.shapes)
            )
            if per_elem:
                device = h.flat.device
                full = dp.flatten_padded([v.to(device) for v in vals], h.world_size, first.dtype)
                out[key] = h.shard_of(full).clone()
            else:
                out[key] = first.clone() if isinstance(first, torch.Tensor) else copy.deepcopy(first)
        state[oi] = out
    orig_to_flat = {k: oi for oi, orig in flat_to_orig.items() for k in orig}
    groups = []
    for g in full_osd["param_groups"]:
        g2 = {k: copy.deepcopy(v) for k, v in g.items() if k != "params"}
        seen: list[int] = []
        for k in g["params"]:
            oi = orig_to_flat[k]
            if oi not in seen:
                seen.append(oi)
        g2["params"] = seen
        groups.append(g2)
    return {"state": state, "param_groups": groups}
