"""The optimizer's part of a sharded checkpoint (see ``_dcp``): what the optimizer holds of each flat parameter,
its live state or (a fresh optimizer) the state it would create, the check that every rank holds the same, and
the dict entries written on save and turned back into an ``optim.load_state_dict`` argument on load.
"""

from __future__ import annotations

import copy
import json
import zlib
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from shardfuse.sharding.checkpoint._dcp_layout import (
    OPTIM_GROUPS,
    OPTIM_STATE,
    FlatEntry,
    Slot,
    as_dtensor,
    check_dtensor,
    first_difference,
    pack,
    padded_shard,
    unpack,
)
from shardfuse.sharding.core import _collectives as coll
from shardfuse.sharding.core._flat_param import SHARD_MARK_KEY
from shardfuse.sharding.core._runtime import Unit

_PROBE_NUMEL = 3  # stand-in size when learning a fresh optimizer's state layout (not 0 or 1: never ambiguous)

@dataclass
class _SlotPlan:
    """The optimizer state of one slot as it goes into (or comes out of) the checkpoint."""

    has_state: bool
    per_element: dict[str, torch.Tensor]  # name -> tensor of state_len elements (live state or template)
    other: dict[str, Any]  # name -> value (live, or the stand-in's for a template)


def _optim_slots(flats: list[FlatEntry], optim: torch.optim.Optimizer, action: str) -> list[list[Slot]]:
    """The slots of each param group of ``optim``, in the optimizer's order."""
    by_id = {id(s.param): s for f in flats for s in f.slots}
    groups, foreign = [], []
    for gi, g in enumerate(optim.param_groups):
        slots = []
        for pi, p in enumerate(g["params"]):
            s = by_id.get(id(p))
            if s is None:
                foreign.append((gi, pi, tuple(p.shape)))
            else:
                slots.append(s)
        groups.append(slots)
    if foreign:
        hint = " (with use_orig_params=True: the original parameters)" if any(f.orig for f in flats) else ""
        raise ValueError(
            f"{action}: the optimizer holds {len(foreign)} parameters that are not parameters of this "
            f"FullyShardedDataParallel tree ((group, index, shape): {foreign[:6]}): build the optimizer on the "
            f"root's parameters(){hint}"
        )
    return groups


def _is_per_element(v: Any, slot: Slot) -> bool:
    # The parameter's shape: 1-D pieces, or (one rank, use_orig_params) the original shape.
    return isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape == slot.param.shape


def _live_plan(optim: torch.optim.Optimizer, slot: Slot) -> _SlotPlan | None:
    st = optim.state.get(slot.param)
    if not st:
        return None
    # The shard mark names this rank's shard; a sharded checkpoint is of the whole flat parameter.
    st = {k: v for k, v in st.items() if k != SHARD_MARK_KEY}
    per = {k: v for k, v in st.items() if _is_per_element(v, slot)}
    return _SlotPlan(True, per, {k: v for k, v in st.items() if k not in per})


def _stand_in_plans(optim: torch.optim.Optimizer, slots: list[Slot], action: str) -> dict[int, _SlotPlan]:
    """The state ``optim`` would create for each of ``slots`` (by id of the parameter), learned without touching
    it: a copy of the optimizer, with empty state and tiny stand-ins for its parameters, takes one step with zero
    gradients; the per-element state becomes zero buffers of the slot's size."""
    if not slots:
        return {}
    # A wrapper driving the user's optimizer (OffloadOptimizer, StepInBackward) is tied to its model and keeps no
    # state of its own: the copy is of the optimizer it wraps, whose groups and state it shows.
    while isinstance(inner := getattr(optim, "optimizer", None), torch.optim.Optimizer):
        optim = inner
    wanted = {id(s.param): s for s in slots}
    memo: dict[int, Any] = {id(optim.state): defaultdict(dict)}
    stand_ins: dict[int, torch.Tensor] = {}
    for g in optim.param_groups:
        for p in g["params"]:
            q = torch.zeros(_PROBE_NUMEL, dtype=p.dtype, device=p.device)
            if id(p) in wanted:
                q.requires_grad_(True)
                q.grad = torch.zeros_like(q)
            memo[id(p)] = stand_ins[id(p)] = q
    try:
        clone = copy.deepcopy(optim, memo)
        clone.step()
    except Exception as err:  # noqa: BLE001 - not swallowed: any optimizer's failure, re-raised with the fix
        raise RuntimeError(
            f"{action} could not learn which state {type(optim).__name__} keeps for parameters that have none yet "
            f"(it steps a copy of the optimizer on tiny zero-gradient stand-ins, which failed: {err!r}): take one "
            f"optimizer step before calling it"
        ) from err
    plans = {}
    for pid, s in wanted.items():
        st = clone.state.get(stand_ins[pid]) or {}
        per = {k: torch.zeros(s.param.shape, dtype=v.dtype, device=v.device) for k, v in st.items()
               if isinstance(v, torch.Tensor) and tuple(v.shape) == (_PROBE_NUMEL,)}
        other = {k: (v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v))
                 for k, v in st.items() if k not in per}
        plans[pid] = _SlotPlan(False, per, other)
    return plans


def _plans(optim: torch.optim.Optimizer, groups: list[list[Slot]], action: str) -> dict[str, _SlotPlan]:
    """slot name -> its plan: the live state, else (a parameter that trains) the stand-in layout, else nothing."""
    plans: dict[str, _SlotPlan] = {}
    missing = []
    for s in (s for g in groups for s in g):
        plan = _live_plan(optim, s)
        if plan is not None:
            plans[s.name] = plan
        elif s.param.requires_grad:
            missing.append(s)
        else:
            plans[s.name] = _SlotPlan(False, {}, {})
    if missing:  # one stand-in step for all of them
        learned = _stand_in_plans(optim, missing, action)
        for s in missing:
            plans[s.name] = learned[id(s.param)]
    return plans


def _fingerprint(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        t = v.detach()
        if t.numel() <= 64:  # step and other scalars: the values themselves
            return f"{t.dtype}{tuple(t.shape)}{t.cpu().tolist()!r}"
        w = t.double()
        return f"{t.dtype}{tuple(t.shape)}{w.sum().item()!r}/{w.abs().sum().item()!r}/{w.square().sum().item()!r}"
    return repr(v)


def _check_same_on_all_ranks(unit: Unit, order: list[Slot], plans: dict[str, _SlotPlan], action: str) -> None:
    """One small all-reduce: every rank must hold the same optimizer structure and the same non-per-element
    values (DCP saves those once), or the checkpoint would mix ranks' state; the same error on every rank."""
    if unit.world_size == 1 or not order:
        return
    rows = []
    for s in order:
        p = plans[s.name]
        names = json.dumps([sorted(map(str, p.per_element)), sorted(map(str, p.other))])
        values = "|".join(f"{k}={_fingerprint(v)}" for k, v in sorted(p.other.items(), key=lambda kv: str(kv[0])))
        rows.append([int(p.has_state), zlib.crc32(names.encode()), zlib.crc32(values.encode()) if p.has_state else 0])
    t = torch.tensor(rows, dtype=torch.int64, device=unit.compute_device).flatten()
    both = torch.cat([t, -t])
    coll.all_reduce_(both, unit.groups.process_group, unit.world_size, op="max")
    hi, lo = both[: t.numel()].view(-1, 3), -both[t.numel():].view(-1, 3)
    bad = [order[i].name for i in range(len(order)) if not torch.equal(hi[i], lo[i])]
    if bad:
        raise RuntimeError(
            f"{action}: the ranks hold different optimizer state for {bad[:6]} (whether there is state, its names, or "
            f"the values of step and other non-per-element state, which the checkpoint keeps once): every rank "
            f"must step the same parameters the same number of times"
        )


def save_optim(sd: dict[str, Any], unit: Unit, flats: list[FlatEntry], optim: torch.optim.Optimizer,
                action: str) -> dict[str, Any]:
    groups = _optim_slots(flats, optim, action)
    plans = _plans(optim, groups, action)
    order = [s for g in groups for s in g]
    _check_same_on_all_ranks(unit, order, plans, action)
    in_optim = {s.name for s in order}
    for f in flats:
        held = [s for s in f.slots if s.name in in_optim]
        names: dict[str, torch.Tensor] = {}
        for s in held:
            for k, v in plans[s.name].per_element.items():
                names.setdefault(k, v)
        for k, like in names.items():
            only = held[0] if len(held) == 1 else None
            live = plans[only.name].per_element.get(k) if only is not None else None
            if live is not None and not f.orig:
                padded = live.detach()  # the live state (or its template): a view, no copy
            else:
                padded = torch.zeros(f.handle.shard_numel, dtype=like.dtype, device=like.device)
                for s in held:
                    got = plans[s.name].per_element.get(k)
                    if got is not None and s.length:
                        padded.narrow(0, s.offset, s.length).copy_(got.detach().reshape(-1))
            sd[f"{OPTIM_STATE}{f.key}.{k}"] = as_dtensor(padded, f)
    for s in order:
        for k, v in plans[s.name].other.items():
            sd[f"{OPTIM_STATE}{s.name}.{k}"] = v.detach() if isinstance(v, torch.Tensor) else pack(v)
    saved_groups = []
    for g, slots in zip(optim.param_groups, groups):
        hyper = {k: copy.deepcopy(v) for k, v in g.items() if k not in ("params", "param_names")}
        saved_groups.append({**hyper, "params": [s.name for s in slots]})
    sd[OPTIM_GROUPS] = pack(saved_groups)
    return {
        "class": type(optim).__name__,
        "slots": {s.name: {"flat": s.flat.key, "state": plans[s.name].has_state,
                           "per_element": sorted(map(str, plans[s.name].per_element)),
                           "other": sorted(map(str, plans[s.name].other))} for s in order},
    }


def _check_saved_optim(state: Mapping[str, Any], meta: dict[str, Any], flats: list[FlatEntry],
                       action: str) -> dict[str, Any]:
    """The checkpoint's optimizer metadata, after checking that the dict asked for it and the wrapping mode."""
    saved = meta.get("optim")
    if not isinstance(saved, dict):
        raise ValueError(
            f"{action}: the checkpoint holds no optimizer state (it was saved by sharded_state_dict() without an "
            f"optimizer): load the model alone with sharded_state_dict() / load_sharded_state_dict(state)"
        )
    if OPTIM_GROUPS not in state:
        raise ValueError(
            f"{action}: the dict was made by sharded_state_dict() without an optimizer, so "
            f"torch.distributed.checkpoint.load did not read the optimizer state: make it with "
            f"sharded_state_dict(optim)"
        )
    saved_flats = meta.get("flat_params") or {}
    modes = [f for f in flats if bool(saved_flats.get(f.key, {}).get("use_orig_params")) != f.orig]
    if modes:
        raise ValueError(
            f"{action}: the optimizer state of {[f.key for f in modes[:4]]} was saved with "
            f"use_orig_params={not modes[0].orig} and this model has use_orig_params={modes[0].orig}, so the "
            f"optimizer holds other parameters: wrap the model with the setting it was saved with"
        )
    return saved


def _check_saved_groups(saved_groups: list[dict[str, Any]], groups: list[list[Slot]], action: str) -> None:
    saved_sets = [sorted(g.get("params", [])) for g in saved_groups]
    here_sets = [sorted(s.name for s in g) for g in groups]
    if saved_sets != here_sets:
        i = first_difference(saved_sets, here_sets)
        raise ValueError(
            f"{action}: the optimizer's param groups hold other parameters than the saved ones ({len(saved_sets)} "
            f"groups saved, {len(here_sets)} here; group {i}: {saved_sets[i][:4] if i < len(saved_sets) else None} "
            f"saved vs {here_sets[i][:4] if i < len(here_sets) else None} here): build the optimizer with the same "
            f"param groups as when the checkpoint was saved"
        )


def _loaded_slot_state(state: Mapping[str, Any], s: Slot, info: dict[str, Any], action: str,
                       trust: bool) -> dict[str, Any]:
    """One slot's optimizer state, read from the filled dict in the optimizer's own layout."""
    entry: dict[str, Any] = {}
    keys = [(k, f"{OPTIM_STATE}{s.flat.key}.{k}", True) for k in info.get("per_element", [])]
    keys += [(k, f"{OPTIM_STATE}{s.name}.{k}", False) for k in info.get("other", [])]
    for k, key, per_element in keys:
        if key not in state:
            raise ValueError(
                f"{action}: the checkpoint holds optimizer state {k!r} for {s.name}, but the dict has no "
                f"{key!r}: the optimizer had no such state when sharded_state_dict(optim) made the dict (was the "
                f"parameter frozen then?): make the dict with the parameters trainable as when it was saved"
            )
        v = state[key]
        if per_element:
            padded = padded_shard(check_dtensor(v, s.flat, key, action), s.flat)
            entry[k] = (padded if not s.flat.orig
                        else padded.narrow(0, s.offset, s.length).reshape(s.param.shape).clone())
        else:
            entry[k] = v if isinstance(v, torch.Tensor) else unpack(v, key, trust)
    return entry


def load_optim(state: Mapping[str, Any], meta: dict[str, Any], flats: list[FlatEntry], optim: torch.optim.Optimizer,
               action: str, trust: bool = False) -> dict[str, Any]:
    """The ``optim.load_state_dict`` argument rebuilt from a filled dict; raises before anything is modified.
    Packed values load as plain data only, unless ``trust`` (``trust_checkpoint=True``)."""
    saved = _check_saved_optim(state, meta, flats, action)
    groups = _optim_slots(flats, optim, action)
    saved_groups = unpack(state[OPTIM_GROUPS], OPTIM_GROUPS, trust)
    _check_saved_groups(saved_groups, groups, action)
    order = [s for g in groups for s in g]
    index = {s.name: i for i, s in enumerate(order)}
    slots_meta = saved.get("slots") or {}
    osd_state: dict[int, dict[str, Any]] = {}
    for s in order:
        info = slots_meta.get(s.name) or {}
        if info.get("state"):
            osd_state[index[s.name]] = _loaded_slot_state(state, s, info, action, trust)
    osd_groups = []
    for sg, g in zip(saved_groups, groups):
        # "params" first: a group loaded without state from here is no sign of a dropped checkpoint (_resume_guard)
        osd_groups.append({"params": [index[s.name] for s in g], **{k: v for k, v in sg.items() if k != "params"}})
    return {"state": osd_state, "param_groups": osd_groups}
