"""torch's ``torch.distributed.checkpoint.state_dict`` API (``get_state_dict``/``set_state_dict``) on a shardfuse model.

torch asks every module of the model for ``_fqn_modifiers()``; the wrapper answers through
:func:`torch_dsd_fqn_modifiers`, which looks at torch's frames on the call stack to see what is being done (a
heuristic tied to torch's internals, which the tests pin down). The model state dict needs nothing: it is full and
keyed by the original names, replicated values DCP saves once. For the optimizer, which holds this rank's shard of
each flat parameter under a name that is the same on every rank, it hooks the optimizer: inside torch's call,
``optimizer.state_dict()`` presents each per-element state of a flat parameter as a ``DTensor`` (``Shard(0)``) of
the whole flat range, so DCP writes each rank's piece once and reshards to any world size; ``load_state_dict``
turns such DTensors back into this rank's padded shard. What cannot be presented that way is refused.
"""

from __future__ import annotations

import sys
import weakref
from itertools import chain
from types import FrameType
from typing import Any

import torch
from torch import nn

from shardfuse.sharding.checkpoint._dcp_layout import (
    RECIPE,
    FlatEntry,
    as_dtensor,
    check_dtensor,
    flat_entries,
    is_dtensor,
    padded_shard,
)
from shardfuse.sharding.core._flat_param import SHARD_MARK_KEY
from shardfuse.sharding.core._tree import require_unit, units_below

_TORCH_DSD = "torch.distributed.checkpoint.state_dict"
_DSD_MESSAGE = "cannot save or load the optimizer state of a FullyShardedDataParallel model"


def _non_empty(v: Any) -> bool:
    return isinstance(v, torch.optim.Optimizer) or (isinstance(v, (tuple, list)) and len(v) > 0)


def _torch_dsd_call() -> tuple[bool, bool, Any, list[torch.optim.Optimizer], Any] | None:
    """``(an optimizer is involved, state is being loaded, its StateDictOptions, the optimizers, the model)`` of
    the call into ``torch.distributed.checkpoint.state_dict`` that is running, or None when none is on the
    stack."""
    frame: FrameType | None = sys._getframe(1)
    found = optim = setting = False
    options = model = None
    optimizers: list[torch.optim.Optimizer] = []
    depth = 0
    while frame is not None and depth < 256:
        if frame.f_globals.get("__name__") == _TORCH_DSD:
            found = True
            name = frame.f_code.co_name
            local = frame.f_locals
            optim = optim or "optim" in name or any(_non_empty(local.get(k)) for k in ("optimizers", "optims"))
            setting = setting or name.startswith(("set_", "_load_"))
            if options is None and hasattr(local.get("options"), "full_state_dict"):
                options = local["options"]
            if model is None and isinstance(local.get("model"), nn.Module):
                model = local["model"]
            for k in ("optimizers", "optims", "optimizer", "optim"):
                v = local.get(k)
                for o in (v if isinstance(v, (tuple, list)) else (v,)):
                    if isinstance(o, torch.optim.Optimizer) and all(o is not x for x in optimizers):
                        optimizers.append(o)
        frame = frame.f_back
        depth += 1
    return (optim, setting, options, optimizers, model) if found else None


# On each hooked optimizer (its owner, so nothing module-level keeps it): a weak reference to the model whose flat
# parameters it holds, for the hooks below (installed once per optimizer).
_MODEL_ATTR = "_shardfuse_dsd_model"


def _flats_by_param(optimizer: torch.optim.Optimizer) -> dict[int, FlatEntry]:
    ref = getattr(optimizer, _MODEL_ATTR, None)
    model = ref() if ref is not None else None
    return {} if model is None else {id(f.handle.flat): f for f in flat_entries(model)}


def _params_by_key(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> dict[Any, torch.Tensor]:
    """The parameter each key of a state dict's ``param_groups`` stands for (by position, as torch maps them)."""
    keys = chain.from_iterable(g["params"] for g in groups)
    return dict(zip(keys, chain.from_iterable(g["params"] for g in optimizer.param_groups)))


def _state_dict_as_dtensors(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any] | None:
    """``state_dict`` post-hook: inside torch's state-dict API, each per-element state of a flat parameter
    becomes the DTensor of its whole flat range (a view of the live state), and the shard marks are left out."""
    if _torch_dsd_call() is None:
        return None
    flats = _flats_by_param(optimizer)
    params = _params_by_key(optimizer, state_dict["param_groups"])
    state = {}
    for key, st in state_dict["state"].items():
        f = flats.get(id(params.get(key)))
        if f is None:
            state[key] = st
            continue
        n = f.handle.shard_numel
        state[key] = {k: (as_dtensor(v.detach(), f) if isinstance(v, torch.Tensor) and v.dim() == 1
                          and v.shape[0] == n and f.handle.world_size > 1 else v)
                      for k, v in st.items() if k != SHARD_MARK_KEY}
    return {**state_dict, "state": state}


def _load_dtensors_as_shards(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any] | None:
    """``load_state_dict`` pre-hook: DTensors made by :func:`_state_dict_as_dtensors` (and filled by a DCP load)
    become this rank's padded shard again."""
    st_all = state_dict.get("state", {})
    if not any(is_dtensor(v) for st in st_all.values() if isinstance(st, dict) for v in st.values()):
        return None
    flats = _flats_by_param(optimizer)
    params = _params_by_key(optimizer, state_dict["param_groups"])
    state = {}
    for key, st in st_all.items():
        f = flats.get(id(params.get(key)))
        new = {}
        for k, v in st.items():
            if k == SHARD_MARK_KEY:
                continue  # torch's dict carries none of its own (an unflattened one may hold a stand-in)
            if is_dtensor(v):
                if f is None:
                    raise ValueError(
                        f"load_state_dict: optimizer state {k!r} of entry {key!r} is a DTensor, but that entry's "
                        f"parameter is not a flat parameter of a FullyShardedDataParallel model this optimizer was "
                        f"checkpointed with: load the dict torch's get_optimizer_state_dict made for this model"
                    )
                v = padded_shard(check_dtensor(v, f, f"state[{key!r}][{k!r}]", "load_state_dict"), f)
            new[k] = v
        state[key] = new
    return {**state_dict, "state": state}


def _hook_optimizers(optimizers: list[torch.optim.Optimizer], model: nn.Module) -> None:
    for o in optimizers:
        if getattr(o, _MODEL_ATTR, None) is None:
            o.register_state_dict_post_hook(_state_dict_as_dtensors)
            o.register_load_state_dict_pre_hook(_load_dtensors_as_shards)
        setattr(o, _MODEL_ATTR, weakref.ref(model))


def _refuse_optimizer_cases(units: list[Any], options: Any) -> None:
    """What torch's state-dict API cannot do with a shardfuse optimizer, refused before the optimizer is touched."""
    if any(h.orig_views is not None for u in units for h in u.handles):
        raise RuntimeError(
            f"torch.distributed.checkpoint.state_dict {_DSD_MESSAGE} wrapped with use_orig_params=True: each "
            f"original parameter's state is an uneven piece of its shard, which torch's API cannot present; {RECIPE}"
        )
    if any(u.world_size == 1 and u.groups.process_group is not units[0].groups.process_group for u in units):
        raise RuntimeError(
            f"torch.distributed.checkpoint.state_dict {_DSD_MESSAGE} with units in groups of their own (e.g. "
            f"mixture-of-experts experts): their state differs per rank under the same names, and DCP would keep one "
            f"rank's; {RECIPE}"
        )
    for flag in ("full_state_dict", "cpu_offload"):
        if getattr(options, flag, False):
            raise RuntimeError(
                f"torch.distributed.checkpoint.state_dict with StateDictOptions({flag}=True) {_DSD_MESSAGE}: use "
                f"the default options (sharded DTensor state, which DCP reshards), or gather_full_optim_state_dict()"
                f" for a full optimizer state dict"
            )


def torch_dsd_fqn_modifiers(wrapper: nn.Module) -> dict[str, str]:
    """The wrapper's answer to ``torch.distributed.checkpoint.state_dict``, which asks every module of the model
    for ``_fqn_modifiers()`` (and nothing else does): the wrapped module's modifiers (none by default), after
    hooking the optimizers of the call (see the module docstring) and refusing, before the optimizer is touched
    (no dummy step), the uses that would save or load wrong values or fail obscurely on a sharded model.
    """
    call = _torch_dsd_call()
    if call is not None:
        optim, setting, options, optimizers, model = call
        units = units_below(require_unit(wrapper))
        if optim:
            _refuse_optimizer_cases(units, options)
            _hook_optimizers(optimizers, model if model is not None else wrapper)
        if getattr(options, "ignore_frozen_params", False) and any(
                h.orig_views is None and not h.flat.requires_grad for u in units for h in u.handles):
            raise RuntimeError(
                "StateDictOptions(ignore_frozen_params=True) is not supported for a FullyShardedDataParallel model "
                "with frozen flat parameters (torch looks them up under their flat names): leave the option off and "
                "drop the frozen names from the returned dict, or wrap with use_orig_params=True"
            )
        if setting and getattr(options, "full_state_dict", False) and not getattr(options, "broadcast_from_rank0",
                                                                                   False):
            raise RuntimeError(
                "set_model_state_dict / set_state_dict with StateDictOptions(full_state_dict=True) is not supported "
                "for a FullyShardedDataParallel model: its load_state_dict() already takes the full state dict on "
                "every rank; leave full_state_dict off (or add broadcast_from_rank0=True)"
            )
    inner = getattr(require_unit(wrapper).module, "_fqn_modifiers", None)
    return dict(inner()) if callable(inner) else {}
