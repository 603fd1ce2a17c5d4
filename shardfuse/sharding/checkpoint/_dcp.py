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

This module saves and loads; ``_dcp_layout`` holds the flat parameters' keys and pieces shared with torch's
state-dict API (``_dcp_guard``), ``_dcp_optim`` the optimizer's part.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from shardfuse.sharding.checkpoint._dcp_layout import (
    FORMAT,
    KIND,
    META_KEY,
    MODEL,
    OPTIM_GROUPS,
    RECIPE,
    FlatEntry,
    as_dtensor,
    check_dtensor,
    first_difference,
    flat_entries,
    meta_flats,
    model_entries,
    pack,
    root_unit,
    unpack,
)
from shardfuse.sharding.checkpoint._dcp_optim import load_optim, save_optim
from shardfuse.sharding.core._tree import Entry, buffer_value, entry_buffer, units_below


class _MetaEntry(str):
    """The ``shardfuse.meta`` entry of a dict :func:`sharded_state_dict` made: the JSON string, which DCP also
    treats as a ``Stateful`` (it has ``state_dict`` / ``load_state_dict``). ``dcp.save`` writes the string;
    ``dcp.load`` hands the checkpoint's string to ``load_state_dict()`` after reading (``loaded``) and leaves this
    object in the dict. A checkpoint of another wrapping is told apart inside ``dcp.load`` by ``SafeLoadPlanner``
    (``_dcp_load``), which reads this string and the checkpoint's metadata before planning the reads."""

    loaded: str | None

    def state_dict(self) -> str:
        return str(self)

    def load_state_dict(self, value: Any) -> None:
        self.loaded = value if isinstance(value, str) else None


# --------------------------------------------------------------------------------------------------
# save
# --------------------------------------------------------------------------------------------------


@torch.no_grad()
def sharded_state_dict(root: nn.Module, optim: torch.optim.Optimizer | None) -> dict[str, Any]:
    """See ``FullyShardedDataParallel.sharded_state_dict`` and the module docstring."""
    action = "sharded_state_dict()"
    unit = root_unit(root, action)
    flats = flat_entries(root)
    sd: dict[str, Any] = {}
    for f in flats:
        sd[MODEL + f.key] = as_dtensor(f.handle.flat.detach(), f)
    buffers, extras = [], []
    for e in model_entries(root):
        key = MODEL + e.key
        if key in sd:
            raise ValueError(f"{action}: {e.key!r} names both a flat parameter and a buffer: rename the buffer")
        if e.kind == "buffer":
            sd[key] = buffer_value(e)
            buffers.append(e.key)
        else:
            sd[key] = pack(e.module.get_extra_state())
            extras.append(e.key)
    meta: dict[str, Any] = {"kind": KIND, "format": FORMAT, "world_size": unit.world_size,
                            "flat_params": meta_flats(flats), "buffers": buffers, "extra_state": extras, "optim": None}
    if optim is not None:
        meta["optim"] = save_optim(sd, unit, flats, optim, action)
    entry = _MetaEntry(json.dumps(meta, sort_keys=True))
    entry.loaded = None
    sd[META_KEY] = entry
    return sd


# --------------------------------------------------------------------------------------------------
# load
# --------------------------------------------------------------------------------------------------


def _read_meta(state: Any, action: str) -> dict[str, Any]:
    text = state.get(META_KEY) if isinstance(state, Mapping) else None
    if isinstance(text, _MetaEntry):
        if text.loaded is None:
            raise ValueError(
                f"{action}: this dict was not filled by torch.distributed.checkpoint.load (it still holds what "
                f"sharded_state_dict() put in it): call dcp.load(state, checkpoint_id=...) in between; {RECIPE}"
            )
        text = text.loaded
    meta = None
    if isinstance(text, str):
        try:
            meta = json.loads(text)
        except ValueError:
            meta = None
    if not isinstance(meta, dict) or meta.get("kind") != KIND:
        got = f"a dict without {META_KEY!r}" if isinstance(state, Mapping) else f"a {type(state).__name__}"
        raise ValueError(
            f"{action} needs the dict that sharded_state_dict() made, filled by torch.distributed.checkpoint.load "
            f"(got {got}): {RECIPE}"
        )
    if meta.get("format") != FORMAT:
        raise ValueError(
            f"{action}: the checkpoint has format {meta.get('format')!r}, this version of shardfuse reads format "
            f"{FORMAT}: load it with the version that saved it"
        )
    return meta


def _check_layout(meta: dict[str, Any], flats: list[FlatEntry], entries: list[Entry], action: str) -> None:
    """The checkpoint must come from the same wrapping: the same flat parameters made of the same parameters."""
    saved, ours = meta.get("flat_params") or {}, meta_flats(flats)
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
            i = first_difference(a, b)
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


@torch.no_grad()
def load_sharded_state_dict(root: nn.Module, state: Mapping[str, Any], optim: torch.optim.Optimizer | None,
                            trust_checkpoint: bool = False) -> None:
    """See ``FullyShardedDataParallel.load_sharded_state_dict`` and the module docstring. Packed entries load as
    plain data only (no code runs); objects only full pickle rebuilds need ``trust_checkpoint``."""
    action = "load_sharded_state_dict()"
    unit = root_unit(root, action)
    meta = _read_meta(state, action)
    flats = flat_entries(root)
    entries = model_entries(root)
    _check_layout(meta, flats, entries, action)
    pieces = [check_dtensor(state.get(MODEL + f.key), f, MODEL + f.key, action).to_local() for f in flats]
    values = []
    for e in entries:
        key = MODEL + e.key
        v = state.get(key)
        if e.kind == "buffer":
            buf = entry_buffer(e)
            if not isinstance(v, torch.Tensor) or v.shape != buf.shape:
                got = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
                raise ValueError(
                    f"{action}: state[{key!r}] is {got}, not a tensor of the buffer's shape {tuple(buf.shape)}: pass "
                    f"the dict this model's sharded_state_dict() made"
                )
        else:
            v = unpack(v, key, trust_checkpoint)
        values.append(v)
    if optim is None and OPTIM_GROUPS in state:
        raise ValueError(
            f"{action}: the dict holds optimizer state (it was made by sharded_state_dict(optim)): pass the "
            f"optimizer too, load_sharded_state_dict(state, optim), or make the dict without it"
        )
    osd = load_optim(state, meta, flats, optim, action, trust_checkpoint) if optim is not None else None
    # Every check passed: write. dcp.load wrote into this model's own shards and buffers already when the dict
    # came from its sharded_state_dict(); a copy is needed only for a dict made elsewhere (another model).
    for f, piece in zip(flats, pieces):
        dst = f.handle.flat.detach().narrow(0, 0, f.valid)
        if f.valid and piece.data_ptr() != dst.data_ptr():
            dst.copy_(piece)
    for e, v in zip(entries, values):
        if e.kind == "buffer":
            buf = entry_buffer(e)
            if v.data_ptr() != buf.data_ptr() or v.dtype != buf.dtype:
                buf.copy_(v)
        else:
            e.module.set_extra_state(v)
    for u in units_below(unit):
        u.reshard()  # gathered copies of the old values are dropped; the next forward gathers the loaded ones
    if optim is not None and osd is not None:  # osd is made only with an optimizer
        optim.load_state_dict(osd)
