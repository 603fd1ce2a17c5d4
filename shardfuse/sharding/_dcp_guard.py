"""Refusing the ``torch.distributed.checkpoint.state_dict`` calls that would checkpoint a shardfuse optimizer wrongly.

torch's ``get_state_dict``/``set_state_dict`` ask every module of the model for ``_fqn_modifiers()``; the wrapper
answers through :func:`torch_dsd_fqn_modifiers`, which looks at torch's frames on the call stack to see whether an
optimizer is involved (a heuristic tied to torch's internals, which the tests pin down).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from shardfuse.sharding._dcp import RECIPE
from shardfuse.sharding._tree import unit_of, units_below

_TORCH_DSD = "torch.distributed.checkpoint.state_dict"
_DSD_MESSAGE = "cannot save or load the optimizer state of a FullyShardedDataParallel model"


def _non_empty(v: Any) -> bool:
    return isinstance(v, torch.optim.Optimizer) or (isinstance(v, (tuple, list)) and len(v) > 0)


def _torch_dsd_call() -> tuple[bool, bool, Any] | None:
    """``(an optimizer is involved, state is being loaded, its StateDictOptions)`` of the call into
    ``torch.distributed.checkpoint.state_dict`` that is running, or None when none is on the stack."""
    frame = sys._getframe(1)
    found = optim = setting = False
    options = None
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
        frame = frame.f_back
        depth += 1
    return (optim, setting, options) if found else None


def torch_dsd_fqn_modifiers(wrapper: nn.Module) -> dict[str, str]:
    """The wrapper's answer to ``torch.distributed.checkpoint.state_dict``, which asks every module of the model
    for ``_fqn_modifiers()`` (and nothing else does): the wrapped module's modifiers (none by default), after
    refusing the uses that would save or load wrong values.

    The model state dict works through it (``state_dict()`` is full and keyed by the original names, replicated
    values DCP saves once). The optimizer's does not: the optimizer holds this rank's shards under flat-parameter
    names that are the same on every rank, so DCP would keep one rank's shards and every rank would resume from
    them. That is refused before the optimizer is touched (no dummy step), as are two options that fail
    obscurely on a sharded model.
    """
    call = _torch_dsd_call()
    if call is not None:
        optim, setting, options = call
        if optim:
            raise RuntimeError(
                f"torch.distributed.checkpoint.state_dict {_DSD_MESSAGE}: the optimizer holds this rank's shard of "
                f"each flat parameter under a name that is the same on every rank, so torch.distributed.checkpoint "
                f"would keep one rank's values and every rank would resume from them; {RECIPE} "
                f"(get_model_state_dict and set_model_state_dict, without an optimizer, work)"
            )
        units = units_below(unit_of(wrapper))
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
    inner = getattr(unit_of(wrapper).module, "_fqn_modifiers", None)
    return dict(inner()) if callable(inner) else {}
