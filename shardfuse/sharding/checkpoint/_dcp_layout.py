"""The layout of a sharded checkpoint (see ``_dcp``): the flat parameters of the tree under their checkpoint keys,
the slots the optimizer may hold, each rank's piece of a flat range as a ``DTensor`` ``Shard(0)`` view, packed
non-tensor values, and the keys and constants the save, load and optimizer modules share.
"""

from __future__ import annotations

import io
import pickle
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:  # imported where used: torch.distributed.tensor costs ~0.6 s, and `import shardfuse` stays light
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

from shardfuse.sharding.core import _collectives as coll
from shardfuse.sharding.core._flat_param import FlatParamHandle
from shardfuse.sharding.core._runtime import Unit
from shardfuse.sharding.core._tree import Entry, check_idle, clean_key, require_unit, unit_of, units_below, walk_entries

META_KEY = "shardfuse.meta"
MODEL = "model."
OPTIM_STATE = "optim.state."
OPTIM_GROUPS = "optim.param_groups"
FORMAT = 1
KIND = "shardfuse.sharded_state_dict"
# DTensor attribute: the padded, shard-long tensor whose first elements are the DTensor's local piece.
_PADDED_ATTR = "_shardfuse_padded"
RECIPE = (
    "save with dcp.save(model.sharded_state_dict(optim)), and load with state = model.sharded_state_dict(optim); "
    "dcp.load(state); model.load_sharded_state_dict(state, optim) (see docs/api.md)"
)

@dataclass
class FlatEntry:
    """One flat parameter of the tree under its checkpoint key."""

    key: str  # "<unit path>.flat_param_<i>"
    unit: Unit
    handle: FlatParamHandle
    names: list[str]  # full clean names of its original parameters, flat order
    slots: list[Slot] = field(default_factory=list)

    @property
    def valid(self) -> int:
        """How many elements of this rank's shard hold data (the rest is padding)."""
        h = self.handle
        return max(0, min(h.numel - h.rank * h.shard_numel, h.shard_numel))

    @property
    def orig(self) -> bool:
        return self.handle.orig_views is not None


@dataclass
class Slot:
    """A parameter the optimizer may hold: the flat parameter, or (use_orig_params) one original parameter,
    covering ``length`` elements of this rank's shard from ``offset``; its per-element state has ``state_len``."""

    name: str
    param: nn.Parameter
    flat: FlatEntry
    offset: int
    length: int
    state_len: int


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
            views = h.orig_views
            if views is not None:  # f.orig
                f.slots = [Slot(name, v, f, a, n, n) for name, v, (a, n) in zip(f.names, views, h.view_ranges)]
            else:
                f.slots = [Slot(key, h.flat, f, 0, f.valid, h.shard_numel)]
            out.append(f)
    return out


def root_unit(root: nn.Module, action: str) -> Unit:
    unit = require_unit(root)
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


def is_dtensor(value: Any) -> bool:
    """``isinstance(value, DTensor)`` without importing ``torch.distributed.tensor``: no DTensor exists before it
    is loaded."""
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(value, mod.DTensor)


def _mesh(unit: Unit, device_type: str) -> DeviceMesh:
    """The 1-D mesh of the unit's shard group, kept on its groups (made once per device type)."""
    from torch.distributed.device_mesh import DeviceMesh

    groups = unit.groups
    meshes = groups.dcp_meshes if groups.dcp_meshes is not None else {}
    if device_type not in meshes:
        meshes[device_type] = DeviceMesh.from_group(groups.process_group, device_type)
        groups.dcp_meshes = meshes
    return meshes[device_type]


def as_dtensor(padded: torch.Tensor, f: FlatEntry) -> DTensor:
    """``padded`` (this rank's shard-long tensor) as the DTensor of the whole flat range; its local tensor is a
    view of the first ``valid`` elements (a DCP load writes straight into ``padded``)."""
    from torch.distributed.tensor import DTensor, Shard

    local = padded.narrow(0, 0, f.valid)
    dt = DTensor.from_local(local, _mesh(f.unit, local.device.type), [Shard(0)], run_check=False,
                            shape=torch.Size([f.handle.numel]), stride=(1,))
    setattr(dt, _PADDED_ATTR, padded)
    return dt


def check_dtensor(value: Any, f: FlatEntry, key: str, action: str) -> DTensor:
    ok = (is_dtensor(value) and tuple(value.shape) == (f.handle.numel,)
          and tuple(value.to_local().shape) == (f.valid,))
    if not ok:
        got = (f"a DTensor of shape {tuple(value.shape)} with a local piece of {tuple(value.to_local().shape)}"
               if is_dtensor(value) else type(value).__name__)
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


def pack(value: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


class UnsafeCheckpointError(ValueError):
    """A checkpoint entry holds a pickled object that only code can rebuild; loading it could run that code."""


# The opt-in named in the refusal (every public load entry point takes it).
TRUST_HINT = ("trust_checkpoint=True (e.g. model.load_sharded_state_dict(state, optim, trust_checkpoint=True)), "
              "which unpickles it with weights_only=False and so runs whatever code it carries")


def refusal(what: str, err: BaseException, hint: str = TRUST_HINT) -> UnsafeCheckpointError:
    """The error for an entry ``what`` that torch's weights-only unpickler refused with ``err``."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    why = next((ln for ln in lines if "GLOBAL" in ln or "Unsupported" in ln), lines[-1] if lines else repr(err))
    return UnsafeCheckpointError(
        f"checkpoint entry {what!r} holds a pickled object that is not plain data (tensors, numbers, strings, None, "
        f"lists, tuples, dicts) and would run code when loaded ({why}); nothing of it was run. Load it only from a "
        f"checkpoint you trust (you wrote it, or its source is trusted), with {hint}; see "
        f"docs/troubleshooting.md, 'Loading checkpoints you did not write'"
    )


def unpack(data: Any, what: str, trust: bool = False) -> Any:
    """A value :func:`pack` stored, read with torch's weights-only unpickler (plain data and tensors: no code can
    run); an object only full pickle can rebuild is refused (:func:`refusal`) unless ``trust``."""
    if not isinstance(data, bytes):
        raise ValueError(
            f"{what} holds a {type(data).__name__}, not the bytes sharded_state_dict() put there: pass the dict "
            f"sharded_state_dict() made, filled by torch.distributed.checkpoint.load"
        )
    if trust:  # the caller's explicit opt-in (trust_checkpoint=True): full pickle, code and all
        return torch.load(io.BytesIO(data), weights_only=False)
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except pickle.UnpicklingError as err:
        raise refusal(what, err) from None


def first_difference(a: list[Any], b: list[Any]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def meta_flats(flats: list[FlatEntry]) -> dict[str, Any]:
    return {f.key: {"names": list(f.names), "shapes": [list(s) for s in f.handle.shapes], "numel": f.handle.numel,
                    "use_orig_params": f.orig} for f in flats}


def model_entries(root: nn.Module) -> list[Entry]:
    return [e for e in walk_entries(root) if e.kind != "param"]
