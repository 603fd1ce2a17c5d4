"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP), model and optimizer, at any world size.

Each rank's flat shard, without its padding, is exactly the ``Shard(0)`` piece (``torch.chunk`` rule) of a 1-D
tensor of the flat parameter's ``numel`` elements: rank ``r`` holds elements ``[r * S, min((r + 1) * S, numel))``
with ``S = ceil(numel / world_size)``, which is empty on the last ranks when ``numel`` is small. So every flat
parameter, and every per-element optimizer state of it (``exp_avg``, ``momentum_buffer``...), is presented to
DCP as a ``DTensor`` of global shape ``(numel,)`` on a 1-D mesh of the unit's process group whose local tensor is
a view of this rank's piece (no copy). DCP writes each piece with its global offset and, when loading into the
layout of another world size, reads the overlapping ranges: resharding needs nothing else, as long as the
wrapping (which parameters form each flat parameter) is the same, which the metadata checks.

The dict :func:`sharded_state_dict` returns (flat keys, ready for ``dcp.save`` / ``dcp.load``; ``<flat>`` is
``<unit path>.flat_param_<i>``, the names ``local_state_dict()`` uses, e.g. ``flat_param_0``,
``blocks.0.flat_param_0``):

- ``model.<flat>``: the flat parameter, ``DTensor`` ``(numel,)``, ``Shard(0)``, in the shard dtype;
- ``model.<buffer name>``: each persistent buffer in its original dtype, a plain (replicated) tensor, and
  ``model.<module path>._extra_state`` for modules with extra state;
- with an optimizer:
  - ``optim.state.<flat>.<name>``: per-element state, a ``DTensor`` shaped like the flat parameter;
  - ``optim.state.<slot>.<name>``: any other state (``step``...): a plain tensor (replicated: the same on every
    rank, which is checked), or another value packed as bytes. ``<slot>`` is what the optimizer holds: the flat
    parameter (``<flat>``), or with ``use_orig_params=True`` the original parameter (its name), whose per-element
    state goes to its range of ``optim.state.<flat>.<name>``;
  - ``optim.param_groups``: bytes (``torch.save``) of the optimizer's groups: the hyper-parameters and, under
    ``params``, the slot names;
- ``shardfuse.meta``: a JSON string: the format, each flat parameter's original names and shapes, the buffers,
  and per slot whether it has optimizer state and which (``per_element`` / ``other``) names.

Non-tensor values are packed (a JSON string, bytes) because DCP flattens nested dicts and lists into keys, which
would make the keys depend on the content. A fresh optimizer (no step yet) gets its state laid out without a
dummy step: a throw-away copy of it steps tiny zero-gradient stand-ins to learn the names, dtypes and devices,
and the state is created as zero buffers shaped like the shard. Parameters that have no state when saving
(never stepped, or no gradient yet) are saved as such placeholders with ``state: false`` and load without
state, as in the uninterrupted run.
"""

from __future__ import annotations

import copy
import io
import json
import zlib
from collections import OrderedDict, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from shardfuse.sharding import _collectives as coll
from shardfuse.sharding._flat_param import SHARD_MARK_KEY, FlatParamHandle
from shardfuse.sharding._runtime import Unit
from shardfuse.sharding._tree import Entry, buffer_value, check_idle, clean_key, unit_of, units_below, walk_entries

META_KEY = "shardfuse.meta"
MODEL = "model."
OPTIM_STATE = "optim.state."
OPTIM_GROUPS = "optim.param_groups"
_FORMAT = 1
_KIND = "shardfuse.sharded_state_dict"
_PROBE_NUMEL = 3  # stand-in size when learning a fresh optimizer's state layout (not 0 or 1: never ambiguous)
# DTensor attribute: the padded, shard-long tensor whose first elements are the DTensor's local piece.
_PADDED_ATTR = "_shardfuse_padded"
RECIPE = (
    "save with dcp.save(model.sharded_state_dict(optim)), and load with state = model.sharded_state_dict(optim); "
    "dcp.load(state); model.load_sharded_state_dict(state, optim) (see docs/api.md)"
)

# id(dict returned by sharded_state_dict) -> the meta string put in it. dcp.load replaces the string by the
# checkpoint's (a new object), so finding the same object again means the dict was never filled.
_TEMPLATES: OrderedDict[int, str] = OrderedDict()
_TEMPLATES_KEPT = 64
# (id(process group), device type) -> (group, its 1-D mesh).
_MESHES: dict[tuple[int, str], tuple[Any, DeviceMesh]] = {}


# --------------------------------------------------------------------------------------------------
# the tree: flat parameters and what the optimizer holds of them
# --------------------------------------------------------------------------------------------------


@dataclass
class FlatEntry:
    """One flat parameter of the tree under its checkpoint key."""

    key: str  # "<unit path>.flat_param_<i>"
    unit: Unit
    handle: FlatParamHandle
    names: list[str]  # full clean names of its original parameters, flat order
    slots: list[_Slot] = field(default_factory=list)

    @property
    def valid(self) -> int:
        """How many elements of this rank's shard hold data (the rest is padding)."""
        h = self.handle
        return max(0, min(h.numel - h.rank * h.shard_numel, h.shard_numel))

    @property
    def orig(self) -> bool:
        return self.handle.orig_views is not None


@dataclass
class _Slot:
    """A parameter the optimizer may hold: the flat parameter, or (use_orig_params) one original parameter,
    covering ``length`` elements of this rank's shard from ``offset``; its per-element state has ``state_len``."""

    name: str
    param: nn.Parameter
    flat: FlatEntry
    offset: int
    length: int
    state_len: int


@dataclass
class _SlotPlan:
    """The optimizer state of one slot as it goes into (or comes out of) the checkpoint."""

    has_state: bool
    per_element: dict[str, torch.Tensor]  # name -> tensor of state_len elements (live state or template)
    other: dict[str, Any]  # name -> value (live, or the stand-in's for a template)


def flat_entries(root: nn.Module) -> list[FlatEntry]:
    """Every flat parameter of the tree (units in module order), with its slots."""
    out = []
    for path, m in root.named_modules():
        u = unit_of(m)
        if u is None or u.released:
            continue
        prefix = clean_key(path)
        for hi, h in enumerate(u.handles):
            key = f"{prefix}.flat_param_{hi}" if prefix else f"flat_param_{hi}"
            f = FlatEntry(key, u, h, [f"{prefix}.{n}" if prefix else n for n in h.names])
            if f.orig:
                f.slots = [_Slot(name, v, f, a, n, n)
                           for name, v, (a, n) in zip(f.names, h.orig_views, h.view_ranges)]
            else:
                f.slots = [_Slot(key, h.flat, f, 0, f.valid, h.shard_numel)]
            out.append(f)
    return out


def _root_unit(root: nn.Module, action: str) -> Unit:
    unit = unit_of(root)
    if not unit.is_root:
        raise RuntimeError(
            f"{action} must be called on the root FullyShardedDataParallel, not on the nested {unit.name}: call it "
            f"on the outermost wrapper, on every rank"
        )
    units = units_below(unit)
    check_idle(units, action)
    ranks = _group_ranks(unit, action)
    for u in units[1:]:
        if u.released:
            continue
        if u.groups.process_group is not unit.groups.process_group and _group_ranks(u, action) != ranks:
            raise NotImplementedError(
                f"{action} needs every unit to shard over the root's process group (ranks {ranks}), but {u.name} "
                f"shards over ranks {_group_ranks(u, action)} (e.g. a mixture-of-experts expert in its own group): "
                f"checkpoint such a model with local_state_dict() per rank, or gather_full_optim_state_dict()"
            )
    return unit


def _group_ranks(unit: Unit, action: str) -> list[int]:
    group = unit.groups.process_group
    if not coll.is_process_group(group):
        raise ValueError(
            f"{action} needs {unit.name} to shard over a torch.distributed process group, got "
            f"{type(group).__name__}: torch.distributed.checkpoint addresses the shards through the group's ranks"
        )
    return list(dist.get_process_group_ranks(group))


def _mesh(unit: Unit, device_type: str) -> DeviceMesh:
    group = unit.groups.process_group
    key = (id(group), device_type)
    hit = _MESHES.get(key)
    if hit is None or hit[0] is not group:
        hit = (group, DeviceMesh.from_group(group, device_type))
        _MESHES[key] = hit
    return hit[1]


def as_dtensor(padded: torch.Tensor, f: FlatEntry) -> DTensor:
    """``padded`` (this rank's shard-long tensor) as the DTensor of the whole flat range; its local tensor is a
    view of the first ``valid`` elements (a DCP load writes straight into ``padded``)."""
    local = padded.narrow(0, 0, f.valid)
    dt = DTensor.from_local(local, _mesh(f.unit, local.device.type), [Shard(0)], run_check=False,
                            shape=torch.Size([f.handle.numel]), stride=(1,))
    setattr(dt, _PADDED_ATTR, padded)
    return dt


def _pack(value: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _unpack(data: Any, what: str) -> Any:
    if not isinstance(data, bytes):
        raise ValueError(
            f"{what} holds a {type(data).__name__}, not the bytes sharded_state_dict() put there: pass the dict "
            f"sharded_state_dict() made, filled by torch.distributed.checkpoint.load"
        )
    return torch.load(io.BytesIO(data), weights_only=False)


# --------------------------------------------------------------------------------------------------
# the optimizer's state, live or laid out for a fresh optimizer
# --------------------------------------------------------------------------------------------------


def _optim_slots(flats: list[FlatEntry], optim: torch.optim.Optimizer, action: str) -> list[list[_Slot]]:
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


def _is_per_element(v: Any, slot: _Slot) -> bool:
    # The parameter's shape: 1-D pieces, or (one rank, use_orig_params) the original shape.
    return isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape == slot.param.shape


def _live_plan(optim: torch.optim.Optimizer, slot: _Slot) -> _SlotPlan | None:
    st = optim.state.get(slot.param)
    if not st:
        return None
    # The shard mark names this rank's shard; a sharded checkpoint is of the whole flat parameter.
    st = {k: v for k, v in st.items() if k != SHARD_MARK_KEY}
    per = {k: v for k, v in st.items() if _is_per_element(v, slot)}
    return _SlotPlan(True, per, {k: v for k, v in st.items() if k not in per})


def _stand_in_plans(optim: torch.optim.Optimizer, slots: list[_Slot], action: str) -> dict[int, _SlotPlan]:
    """The state ``optim`` would create for each of ``slots`` (by id of the parameter), learned without touching
    it: a copy of the optimizer, with empty state and tiny stand-ins for its parameters, takes one step with zero
    gradients; the per-element state becomes zero buffers of the slot's size."""
    if not slots:
        return {}
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


def _plans(optim: torch.optim.Optimizer, groups: list[list[_Slot]], action: str) -> dict[str, _SlotPlan]:
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


def _check_same_on_all_ranks(unit: Unit, order: list[_Slot], plans: dict[str, _SlotPlan], action: str) -> None:
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


# --------------------------------------------------------------------------------------------------
# save
# --------------------------------------------------------------------------------------------------


def _meta_flats(flats: list[FlatEntry]) -> dict[str, Any]:
    return {f.key: {"names": list(f.names), "shapes": [list(s) for s in f.handle.shapes], "numel": f.handle.numel,
                    "use_orig_params": f.orig} for f in flats}


def _model_entries(root: nn.Module) -> list[Entry]:
    return [e for e in walk_entries(root) if e.kind != "param"]


@torch.no_grad()
def sharded_state_dict(root: nn.Module, optim: torch.optim.Optimizer | None) -> dict[str, Any]:
    """See ``FullyShardedDataParallel.sharded_state_dict`` and the module docstring."""
    action = "sharded_state_dict()"
    unit = _root_unit(root, action)
    flats = flat_entries(root)
    sd: dict[str, Any] = {}
    for f in flats:
        sd[MODEL + f.key] = as_dtensor(f.handle.flat.detach(), f)
    buffers, extras = [], []
    for e in _model_entries(root):
        key = MODEL + e.key
        if key in sd:
            raise ValueError(f"{action}: {e.key!r} names both a flat parameter and a buffer: rename the buffer")
        if e.kind == "buffer":
            sd[key] = buffer_value(e)
            buffers.append(e.key)
        else:
            sd[key] = _pack(e.module.get_extra_state())
            extras.append(e.key)
    meta: dict[str, Any] = {"kind": _KIND, "format": _FORMAT, "world_size": unit.world_size,
                            "flat_params": _meta_flats(flats), "buffers": buffers, "extra_state": extras, "optim": None}
    if optim is not None:
        meta["optim"] = _save_optim(sd, unit, flats, optim, action)
    text = json.dumps(meta, sort_keys=True)
    sd[META_KEY] = text
    _TEMPLATES[id(sd)] = text
    _TEMPLATES.move_to_end(id(sd))
    while len(_TEMPLATES) > _TEMPLATES_KEPT:
        _TEMPLATES.popitem(last=False)
    return sd


def _save_optim(sd: dict[str, Any], unit: Unit, flats: list[FlatEntry], optim: torch.optim.Optimizer,
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
                    v = plans[s.name].per_element.get(k)
                    if v is not None and s.length:
                        padded.narrow(0, s.offset, s.length).copy_(v.detach().reshape(-1))
            sd[f"{OPTIM_STATE}{f.key}.{k}"] = as_dtensor(padded, f)
    for s in order:
        for k, v in plans[s.name].other.items():
            sd[f"{OPTIM_STATE}{s.name}.{k}"] = v.detach() if isinstance(v, torch.Tensor) else _pack(v)
    saved_groups = []
    for g, slots in zip(optim.param_groups, groups):
        hyper = {k: copy.deepcopy(v) for k, v in g.items() if k not in ("params", "param_names")}
        saved_groups.append({**hyper, "params": [s.name for s in slots]})
    sd[OPTIM_GROUPS] = _pack(saved_groups)
    return {
        "class": type(optim).__name__,
        "slots": {s.name: {"flat": s.flat.key, "state": plans[s.name].has_state,
                           "per_element": sorted(map(str, plans[s.name].per_element)),
                           "other": sorted(map(str, plans[s.name].other))} for s in order},
    }


# --------------------------------------------------------------------------------------------------
# load
# --------------------------------------------------------------------------------------------------


def _read_meta(state: Any, action: str) -> dict[str, Any]:
    text = state.get(META_KEY) if isinstance(state, Mapping) else None
    meta = None
    if isinstance(text, str):
        try:
            meta = json.loads(text)
        except ValueError:
            meta = None
    if not isinstance(meta, dict) or meta.get("kind") != _KIND:
        got = f"a dict without {META_KEY!r}" if isinstance(state, Mapping) else f"a {type(state).__name__}"
        raise ValueError(
            f"{action} needs the dict that sharded_state_dict() made, filled by torch.distributed.checkpoint.load "
            f"(got {got}): {RECIPE}"
        )
    if meta.get("format") != _FORMAT:
        raise ValueError(
            f"{action}: the checkpoint has format {meta.get('format')!r}, this version of shardfuse reads format "
            f"{_FORMAT}: load it with the version that saved it"
        )
    if _TEMPLATES.get(id(state)) is text:
        raise ValueError(
            f"{action}: this dict was not filled by torch.distributed.checkpoint.load (it still holds what "
            f"sharded_state_dict() put in it): call dcp.load(state, checkpoint_id=...) in between; {RECIPE}"
        )
    return meta


def _first_difference(a: list[Any], b: list[Any]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _check_layout(meta: dict[str, Any], flats: list[FlatEntry], entries: list[Entry], action: str) -> None:
    """The checkpoint must come from the same wrapping: the same flat parameters made of the same parameters."""
    saved, ours = meta.get("flat_params") or {}, _meta_flats(flats)
    only_saved, only_here = [k for k in saved if k not in ours], [k for k in ours if k not in saved]
    if only_saved or only_here:
        raise ValueError(
            f"{action}: the checkpoint was saved from another wrapping: flat parameters only in the checkpoint "
            f"{only_saved[:6]}, only in this model {only_here[:6]}: wrap the model the same way as when it was saved "
            f"(the same modules in the same FullyShardedDataParallel units, the same dtypes and requires_grad)"
        )
    for key, here in ours.items():
        was = saved[key]
        a = list(zip(was.get("names", []), was.get("shapes", [])))
        b = list(zip(here["names"], here["shapes"]))
        if a != b:
            i = _first_difference(a, b)
            raise ValueError(
                f"{action}: {key} was saved from other parameters than this model's: (name, shape) "
                f"{a[i] if i < len(a) else None} in the checkpoint vs {b[i] if i < len(b) else None} here, of "
                f"{len(a)} vs {len(b)}: wrap the model the same way as when it was saved (the same modules in the same "
                f"FullyShardedDataParallel units, the same dtypes and requires_grad)"
            )
    for kind, what in (("buffer", "buffers"), ("extra", "extra_state")):
        here = [e.key for e in entries if e.kind == kind]
        was = list(meta.get(what) or [])
        if sorted(was) != sorted(here):
            raise ValueError(
                f"{action}: the checkpoint's {what} {sorted(set(was) - set(here))[:6]} are not in this model, and "
                f"{sorted(set(here) - set(was))[:6]} are not in the checkpoint: load it into the model it was saved "
                f"from"
            )


def check_dtensor(value: Any, f: FlatEntry, key: str, action: str) -> DTensor:
    ok = (isinstance(value, DTensor) and tuple(value.shape) == (f.handle.numel,)
          and tuple(value.to_local().shape) == (f.valid,))
    if not ok:
        got = (f"a DTensor of shape {tuple(value.shape)} with a local piece of {tuple(value.to_local().shape)}"
               if isinstance(value, DTensor) else type(value).__name__)
        raise ValueError(
            f"{action}: state[{key!r}] is {got}, not the DTensor of shape ({f.handle.numel},) with a local piece of "
            f"({f.valid},) that sharded_state_dict() makes here: pass the dict this model's sharded_state_dict() made"
        )
    return value


def padded_shard(value: DTensor, f: FlatEntry) -> torch.Tensor:
    """This rank's shard-long tensor behind a DTensor made by :func:`as_dtensor` (a DCP load wrote into it), or
    a zero-padded copy of the local piece."""
    local = value.to_local()
    padded = getattr(value, _PADDED_ATTR, None)
    n = f.handle.shard_numel
    if (isinstance(padded, torch.Tensor) and tuple(padded.shape) == (n,) and padded.dtype == local.dtype
            and (f.valid == 0 or padded.narrow(0, 0, f.valid).data_ptr() == local.data_ptr())):
        return padded
    out = local.new_zeros(n)
    out.narrow(0, 0, f.valid).copy_(local)
    return out


def _load_optim(state: Mapping[str, Any], meta: dict[str, Any], flats: list[FlatEntry], optim: torch.optim.Optimizer,
                action: str) -> dict[str, Any]:
    """The ``optim.load_state_dict`` argument rebuilt from a filled dict; raises before anything is modified."""
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
    groups = _optim_slots(flats, optim, action)
    saved_groups = _unpack(state[OPTIM_GROUPS], OPTIM_GROUPS)
    saved_sets = [sorted(g.get("params", [])) for g in saved_groups]
    here_sets = [sorted(s.name for s in g) for g in groups]
    if saved_sets != here_sets:
        i = _first_difference(saved_sets, here_sets)
        raise ValueError(
            f"{action}: the optimizer's param groups hold other parameters than the saved ones ({len(saved_sets)} "
            f"groups saved, {len(here_sets)} here; group {i}: {saved_sets[i][:4] if i < len(saved_sets) else None} "
            f"saved vs {here_sets[i][:4] if i < len(here_sets) else None} here): build the optimizer with the same "
            f"param groups as when the checkpoint was saved"
        )
    order = [s for g in groups for s in g]
    index = {s.name: i for i, s in enumerate(order)}
    slots_meta = saved.get("slots") or {}
    osd_state: dict[int, dict[str, Any]] = {}
    for s in order:
        info = slots_meta.get(s.name) or {}
        if not info.get("state"):
            continue
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
                entry[k] = v if isinstance(v, torch.Tensor) else _unpack(v, key)
        osd_state[index[s.name]] = entry
    osd_groups = []
    for sg, g in zip(saved_groups, groups):
        # "params" first: a group loaded without state from here is no sign of a dropped checkpoint (_resume_guard)
        osd_groups.append({"params": [index[s.name] for s in g], **{k: v for k, v in sg.items() if k != "params"}})
    return {"state": osd_state, "param_groups": osd_groups}


@torch.no_grad()
def load_sharded_state_dict(root: nn.Module, state: Mapping[str, Any], optim: torch.optim.Optimizer | None) -> None:
    """See ``FullyShardedDataParallel.load_sharded_state_dict`` and the module docstring."""
    action = "load_sharded_state_dict()"
    unit = _root_unit(root, action)
    meta = _read_meta(state, action)
    flats = flat_entries(root)
    entries = _model_entries(root)
    _check_layout(meta, flats, entries, action)
    pieces = [check_dtensor(state.get(MODEL + f.key), f, MODEL + f.key, action).to_local() for f in flats]
    values = []
    for e in entries:
        key = MODEL + e.key
        v = state.get(key)
        if e.kind == "buffer":
            buf = e.module._buffers[e.attr]
            if not isinstance(v, torch.Tensor) or v.shape != buf.shape:
                got = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
                raise ValueError(
                    f"{action}: state[{key!r}] is {got}, not a tensor of the buffer's shape {tuple(buf.shape)}: pass "
                    f"the dict this model's sharded_state_dict() made"
                )
        else:
            v = _unpack(v, key)
        values.append(v)
    if optim is None and OPTIM_GROUPS in state:
        raise ValueError(
            f"{action}: the dict holds optimizer state (it was made by sharded_state_dict(optim)): pass the "
            f"optimizer too, load_sharded_state_dict(state, optim), or make the dict without it"
        )
    osd = _load_optim(state, meta, flats, optim, action) if optim is not None else None
    # Every check passed: write. dcp.load wrote into this model's own shards and buffers already when the dict
    # came from its sharded_state_dict(); a copy is needed only for a dict made elsewhere (another model).
    for f, piece in zip(flats, pieces):
        dst = f.handle.flat.detach().narrow(0, 0, f.valid)
        if f.valid and piece.data_ptr() != dst.data_ptr():
            dst.copy_(piece)
    for e, v in zip(entries, values):
        if e.kind == "buffer":
            buf = e.module._buffers[e.attr]
            if v.data_ptr() != buf.data_ptr() or v.dtype != buf.dtype:
                buf.copy_(v)
        else:
            e.module.set_extra_state(v)
    for u in units_below(unit):
        u.reshard()  # gathered copies of the old values are dropped; the next forward gathers the loaded ones
    if osd is not None:
        optim.load_state_dict(osd)
