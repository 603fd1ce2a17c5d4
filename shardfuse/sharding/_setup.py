"""Wrap-time set-up besides flattening: guards against silent misuse and the first rank's values on every rank.

- ``reset_parameters()`` of flattened modules fails loudly unless ``allow_reset_parameters``;
- an optimizer holding parameters from before wrapping fails at ``step()`` (one global step pre-hook), and so
  does optimizer state that cannot be this rank's (each sharded parameter's state carries its shard's mark);
- ``torch.nn.utils.clip_grad_norm_`` over sharded parameters computes the global norm (installed once);
- ``sync_module_states`` broadcasts the first rank's parameters and buffers; without it, ranks are checked to
  agree (one tiny all-gather per unit) and, if they do not, get the first rank's values with a warning;
- modules built on the meta device get their storage on :func:`init_device`.
"""

from __future__ import annotations

import functools
import logging
import weakref
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from shardfuse._logging import warn_once
from shardfuse.sharding import _collectives as coll
from shardfuse.sharding._config import Groups, ShardingConfig
from shardfuse.sharding._flat_param import (
    FLATTENED_MARK,
    SHARD_MARK_ATTR,
    SHARD_MARK_KEY,
    FlatParamHandle,
    handle_of,
    iter_own_modules,
)
from shardfuse.sharding._grad_reduce import global_grad_norm
from shardfuse.sharding._resume_guard import refuse_fresh_state_after_load

logger = logging.getLogger(__name__)


def _forbidden_reset(module: nn.Module, *args: Any, **kwargs: Any) -> None:
    raise RuntimeError(
        f"reset_parameters() of {type(module).__name__} was called after FullyShardedDataParallel flattened its "
        f"parameters: pass allow_reset_parameters=True and call it inside summon_full_params()"
    )


_checked_optimizers: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = weakref.WeakKeyDictionary()
# Per optimizer: how many parameters had state when its shard marks were last checked and written; forgotten
# by a load_state_dict (a post-hook), so the loaded state is checked at the next step.
_marks_seen: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = weakref.WeakKeyDictionary()
_load_hooked: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
_optimizer_guard: Any = None


def _refuse_flattened_params(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Global optimizer step pre-hook: an optimizer over the parameters as they were before wrapping would
    step tensors nothing reads any more (their values moved into the flat shards), silently."""
    _check_shard_marks(optimizer)
    count = sum(len(g["params"]) for g in optimizer.param_groups)
    if _checked_optimizers.get(optimizer) == count:
        return
    for gi, group in enumerate(optimizer.param_groups):
        for pi, p in enumerate(group["params"]):
            if getattr(p, FLATTENED_MARK, None) is not None:
                raise RuntimeError(
                    f"{type(optimizer).__name__} holds a parameter (group {gi}, index {pi}, shape {tuple(p.shape)}) "
                    f"that FullyShardedDataParallel flattened into its shards when it wrapped the model: stepping it "
                    f"changes nothing the model uses; build the optimizer after wrapping, on model.parameters()"
                )
    _checked_optimizers[optimizer] = count


def _check_shard_marks(optimizer: torch.optim.Optimizer) -> None:
    """Global optimizer step pre-hook, once per loaded ``state``: refuse optimizer state of sharded parameters
    that cannot be this rank's.

    A plain ``optimizer.state_dict()`` has the same keys on every rank, so ``torch.distributed.checkpoint`` keeps
    one rank's copy, and loads it back under string keys that name no parameter (the values go nowhere; every
    parameter keeps the state it had). Per-rank files loaded on the wrong rank give another rank's shards. Both
    would resume silently wrong: entries that name no parameter, and the marks :func:`mark_optimizer_state`
    writes coming back as another rank's, are refused before the step uses the state.
    """
    state = optimizer.state
    if _marks_seen.get(optimizer) == len(state):
        return
    if optimizer not in _load_hooked:
        optimizer.register_load_state_dict_post_hook(_forget_marks)
        _load_hooked.add(optimizer)
    sharded = False
    for gi, group in enumerate(optimizer.param_groups):
        for pi, p in enumerate(group["params"]):
            want = getattr(p, SHARD_MARK_ATTR, None)
            sharded = sharded or want is not None
            st = state.get(p) if want is not None else None
            got = st.get(SHARD_MARK_KEY, want) if st else want
            if isinstance(got, tuple) and got != want:
                raise RuntimeError(
                    f"{type(optimizer).__name__} holds the optimizer state of {_describe_mark(got)}, but this rank "
                    f"trains the shard of {_describe_mark(want)} (group {gi}, parameter {pi}): the state was loaded "
                    f"from another rank's copy. "
                    f"torch.distributed.checkpoint keeps one copy of optimizer.state_dict() (the same keys on every "
                    f"rank); checkpoint a FullyShardedDataParallel model's optimizer with "
                    f"model.sharded_state_dict(optim) / model.load_sharded_state_dict(state, optim), per rank with "
                    f"torch.save(optim.state_dict()), or with gather_full_optim_state_dict()"
                )
    stray = [k for k in state if not isinstance(k, torch.Tensor)] if sharded else []
    if stray:
        raise RuntimeError(
            f"{type(optimizer).__name__} holds optimizer state under keys {stray[:4]} that name no parameter, so "
            f"the loaded values went nowhere and every parameter kept the state it had before loading: "
            f"torch.distributed.checkpoint returns optimizer.state_dict()'s integer keys as strings (and keeps one "
            f"rank's copy of each, while every rank holds other shards); checkpoint a FullyShardedDataParallel "
            f"model's optimizer with model.sharded_state_dict(optim) / model.load_sharded_state_dict(state, optim)"
        )
    if sharded:
        refuse_fresh_state_after_load(optimizer, [p for g in optimizer.param_groups for p in g["params"]
                                                  if getattr(p, SHARD_MARK_ATTR, None) is not None and p.requires_grad])


def _forget_marks(optimizer: torch.optim.Optimizer) -> None:
    _marks_seen.pop(optimizer, None)


def _describe_mark(mark: Any) -> str:
    if isinstance(mark, tuple) and len(mark) == 2:
        return f"rank {mark[0]} of {mark[1]}"
    return repr(mark)


def mark_optimizer_state(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Global optimizer step post-hook: the state of every sharded parameter carries the mark of its shard
    (``(rank, world_size)``), so state loaded onto the wrong rank is caught by :func:`_check_shard_marks`."""
    state = optimizer.state
    if _marks_seen.get(optimizer) == len(state):
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            mark = getattr(p, SHARD_MARK_ATTR, None)
            if mark is not None:
                st = state.get(p)
                if st and not isinstance(st.get(SHARD_MARK_KEY), tuple):
                    st[SHARD_MARK_KEY] = mark
    _marks_seen[optimizer] = len(state)


_torch_clip_grad_norm: Any = None


def _sharded_handle(p: torch.Tensor) -> FlatParamHandle | None:
    h = handle_of(p)
    return h if h is not None and h.world_size > 1 else None


def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: bool | None = None) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_``, aware of shardfuse's sharded parameters.

    Over parameters that include shards (flat parameters, or original parameters under ``use_orig_params``),
    the norm is that of the whole gradients across ranks (one all-reduce over their process group; every rank
    must call it, as with ``model.clip_grad_norm_``), so every rank clips by the same coefficient; other
    parameters' gradients count once. Without shards it is torch's own function, unchanged.
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    handles = [_sharded_handle(p) for p in params]
    groups = {id(h.group): h for h in handles if h is not None}
    if not groups:
        return _torch_clip_grad_norm(params, max_norm, norm_type, error_if_nonfinite, foreach)
    if len(groups) > 1:
        raise RuntimeError(
            f"torch.nn.utils.clip_grad_norm_ got shards of FullyShardedDataParallel units in {len(groups)} "
            f"different process groups: their global norms need one all-reduce per group; clip each group's "
            f"parameters separately, or call model.clip_grad_norm_() on the root"
        )
    h = next(iter(groups.values()))
    sharded = [p.grad for p, hp in zip(params, handles) if hp is not None and p.grad is not None]
    replicated = [p.grad for p, hp in zip(params, handles) if hp is None and p.grad is not None]
    if coll.is_cuda_group(h.group) and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    total = global_grad_norm(sharded, replicated, float(norm_type), device, h.group, h.world_size)
    if error_if_nonfinite and bool(torch.logical_or(total.isnan(), total.isinf())):
        raise RuntimeError(
            f"The total norm of order {float(norm_type)} for gradients from `parameters` is non-finite, so it "
            f"cannot be clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
            f"`error_if_nonfinite=False`"
        )
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach)
    return total


def install_clip_grad_norm() -> None:
    """Make ``torch.nn.utils.clip_grad_norm_`` (looked up at call time, as Hugging Face's Trainer and
    accelerate do) give the global norm over sharded parameters (:func:`clip_grad_norm_`)."""
    global _torch_clip_grad_norm
    if _torch_clip_grad_norm is None:
        _torch_clip_grad_norm = torch.nn.utils.clip_grad.clip_grad_norm_
        torch.nn.utils.clip_grad_norm_ = clip_grad_norm_
        torch.nn.utils.clip_grad.clip_grad_norm_ = clip_grad_norm_


def install_optimizer_guard() -> None:
    global _optimizer_guard
    if _optimizer_guard is None:
        _optimizer_guard = (register_optimizer_step_pre_hook(_refuse_flattened_params),
                            register_optimizer_step_post_hook(mark_optimizer_state))


def guard_reset_parameters(module: nn.Module) -> None:
    """Make ``reset_parameters`` of owned submodules fail loudly (``allow_reset_parameters=False``)."""
    for _, m in iter_own_modules(module):
        if callable(getattr(type(m), "reset_parameters", None)):
            m.__dict__["reset_parameters"] = functools.partial(_forbidden_reset, m)


def init_device(config: ShardingConfig, groups: Groups) -> torch.device:
    """Where a module built on the meta device gets its storage: the compute device (the current GPU under
    NCCL), or the host."""
    if config.compute_device is not None and not config.move_params_to_cpu:
        return config.compute_device
    if coll.is_cuda_group(groups.process_group) and torch.cuda.is_available() and not config.move_params_to_cpu:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _own_states(module: nn.Module) -> list[torch.Tensor]:
    """The unit's own parameters and buffers, each once; not those a sibling unit flattened (borrowed: a view's
    values differ by rank, and the lender made them agree already)."""
    found: dict[int, torch.Tensor] = {}
    for _, m in iter_own_modules(module):
        for t in (*m._parameters.values(), *m._buffers.values()):
            if t is not None and getattr(t, FLATTENED_MARK, None) is None and handle_of(t) is None:
                found.setdefault(id(t), t)
    return list(found.values())


@torch.no_grad()
def agree_on_initial_values(module: nn.Module, groups: Groups, name: str) -> None:
    """Make every rank of the unit's group start from the same parameters and buffers.

    Each rank keeps only its slice of what it built, so ranks built with different seeds would otherwise train a
    mix of both inits. One all-gather of a fingerprint per unit (count, size, sum and sum of squares) finds that;
    the first rank's values are then broadcast, as ``sync_module_states=True`` and DistributedDataParallel do,
    with a warning. Ranks whose unit differs in shape get an error naming it (a broadcast would not line up).
    """
    world = groups.world_size
    if world == 1 or not coll.is_process_group(groups.process_group):
        return
    states = _own_states(module)
    if any(t.device.type == "meta" for t in states):
        return  # nothing to compare yet: param_init_fn / reset_parameters decide later
    dev = torch.device("cuda", torch.cuda.current_device()) if coll.is_cuda_group(groups.process_group) \
        else torch.device("cpu")
    stats = [float(len(states)), float(sum(t.numel() for t in states)), 0.0, 0.0]
    for t in states:
        wide = t.detach().double()
        stats[2] += wide.sum().item()
        stats[3] += wide.square().sum().item()
    mine = torch.tensor(stats, dtype=torch.float64, device=dev)
    everyone = torch.empty(world * 4, dtype=torch.float64, device=dev)
    coll.all_gather_into(everyone, mine, groups.process_group, world)
    rows = everyone.view(world, 4).tolist()
    for rank, row in enumerate(rows[1:], start=1):
        if row[:2] != rows[0][:2]:
            raise RuntimeError(
                f"ranks wrapped the model differently: {name} has {int(rows[0][0])} parameters and buffers of "
                f"{int(rows[0][1])} elements on rank 0 but {int(row[0])} of {int(row[1])} on rank {rank}: build "
                f"and wrap the same model on every rank"
            )
    differ = [r for r, row in enumerate(rows) if row != rows[0]]
    if differ:
        warn_once(
            logger,
            f"ranks built {name} with different initial values (rank 0 differs from rank {differ[0]}): every rank "
            f"now starts from rank 0's parameters and buffers, as with sync_module_states=True (each rank keeps "
            f"only its shard, so keeping them would train a mix of the ranks' inits); seed every rank identically "
            f"or load the same checkpoint on each, or pass sync_module_states=True to broadcast without this check",
        )
        broadcast_own_states(module, groups)


@torch.no_grad()
def broadcast_own_states(module: nn.Module, groups: Groups) -> None:
    """Copy the first rank's values of the unit's own parameters and buffers to every rank (one broadcast per
    dtype and device)."""
    if not coll.is_process_group(groups.process_group):
        raise ValueError(
            "sync_module_states=True needs a torch.distributed process group to broadcast with, got "
            f"{type(groups.process_group).__name__}: pass a real group, or drop sync_module_states"
        )
    tensors: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in _own_states(module):
        tensors.setdefault((t.dtype, t.device), []).append(t)
    on_gpu = coll.is_cuda_group(groups.process_group) and torch.cuda.is_available()
    for unique in tensors.values():
        flat = torch.cat([t.detach().reshape(-1) for t in unique])
        if on_gpu and flat.device.type == "cpu":  # NCCL moves CUDA tensors only
            flat = flat.cuda()
        coll.broadcast_(flat, groups.process_group, groups.world_size)
        for t, v in zip(unique, flat.split([t.numel() for t in unique])):
            t.detach().copy_(v.view_as(t))
