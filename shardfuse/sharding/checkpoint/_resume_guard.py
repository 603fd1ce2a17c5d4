"""Refuse the first step of an optimizer whose loaded state dict dropped the state of its sharded parameters.

``dcp.save({"model": model.state_dict(), "optim": optim.state_dict()})`` saves the model correctly but not the
optimizer: ``optim.state_dict()`` holds this rank's shards under the same keys on every rank, of which
``torch.distributed.checkpoint`` keeps one copy. Loaded into an optimizer that has stepped, the state comes back
under keys that name no parameter (refused by the shard-mark check of ``_setup``). Loaded into a fresh optimizer,
nothing comes back at all: ``dcp.load`` reads only the keys of the dict it is given, and a fresh optimizer's
``state_dict()`` has no state, only its param groups. ``optim.load_state_dict`` then succeeds with the groups
alone, and the next step would train on fresh optimizer state without a word.

What is left to see at that first step: the optimizer holds sharded parameters (world size > 1), none of them
has state, and its param groups were replaced by ``optim.load_state_dict``. torch's ``state_dict()`` packs each
group with ``"params"`` as its last key and ``load_state_dict`` keeps the saved group, while a group built by the
optimizer's constructor or ``add_param_group`` starts with ``"params"``. ``load_sharded_state_dict``, which may
legitimately load groups without state, writes ``"params"`` first, so it passes. The other state dicts this
refuses hold nothing to lose: a per-rank ``optim.state_dict()`` or a consolidated one
(``gather_full_optim_state_dict``, whose groups keep FairScale's key order) taken before the optimizer's first
step; the message says to skip loading them.
"""

from __future__ import annotations

from typing import Any

import torch

PARAMS = "params"


def loaded_from_state_dict(group: dict[str, Any]) -> bool:
    """Whether a param group is the one ``Optimizer.load_state_dict`` put in place of torch's packed group."""
    keys = list(group)
    return len(keys) > 1 and keys[0] != PARAMS and keys[-1] == PARAMS


def refuse_fresh_state_after_load(optimizer: torch.optim.Optimizer, sharded: list[torch.Tensor]) -> None:
    """Raise before a step that would create fresh state for the ``sharded`` parameters of ``optimizer`` right
    after ``load_state_dict`` loaded param groups without their state (see the module docstring)."""
    if not sharded or any(optimizer.state.get(p) for p in sharded):
        return
    if not all(loaded_from_state_dict(g) for g in optimizer.param_groups):
        return
    raise RuntimeError(
        f"{type(optimizer).__name__} was loaded with load_state_dict() from a state dict that holds no state for "
        f"any of its {len(sharded)} sharded parameters, so this first step would train them on fresh optimizer "
        f"state. That is what dcp.load of optimizer.state_dict() gives a fresh optimizer: torch.distributed."
        f"checkpoint reads only the keys the dict it fills asks for (a fresh optimizer's has no state), and "
        f"optimizer.state_dict() holds this rank's shards under the same keys on every rank, of which it keeps "
        f"one. Checkpoint a FullyShardedDataParallel model's optimizer with model.sharded_state_dict(optim) / "
        f"model.load_sharded_state_dict(state, optim) (or torch's get_state_dict / set_state_dict); if the state "
        f"dict was saved before the optimizer's first step (nothing to lose), do not load it"
    )
