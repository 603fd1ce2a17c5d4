"""Every change shardfuse makes to process-wide state is installed here, and nowhere else; docs/process-wide.md lists
them (why each exists, how to turn it off) and tests/sharding/test_process_hooks.py checks each on and off.

Optimizers are built after the model is wrapped, so a wrapper cannot attach hooks to them: what must act on the
user's optimizers, or on ``torch.nn.utils.clip_grad_norm_`` as third-party training loops call it, is process-wide.
What can be attached to the optimizer it serves is attached there instead (``OffloadOptimizer``'s own per-shard
optimizers carry their version hook, see ``shardfuse.sharding.host._host_step``).

Switchable (:data:`SWITCHABLE`), installed at the first wrap unless turned off:

1. ``torch.nn.utils.clip_grad_norm_`` (and ``torch.nn.utils.clip_grad.clip_grad_norm_``) is replaced by
   :func:`clip_grad_norm_`: over sharded parameters it computes the norm of the whole gradients across ranks
   (one all-reduce), so code that clips with torch's function (Hugging Face's Trainer, accelerate) clips by
   the global norm; over other parameters it is torch's own function, unchanged;
2. a global optimizer step pre-hook refuses an optimizer holding parameters from before wrapping, and optimizer
   state that cannot be this rank's;
3. a global optimizer step post-hook writes the key :data:`SHARD_MARK_KEY` (``(rank, world_size)``) into the
   state of every sharded parameter of every optimizer, which the pre-hook checks after a load.

Turn them off with the environment variable ``SHARDFUSE_PROCESS_HOOKS=0`` (read at each wrap) or with
``shardfuse.set_process_hooks(False)`` (also removes hooks already installed). Without them
``torch.nn.utils.clip_grad_norm_`` clips by each rank's local norm (use ``model.clip_grad_norm_()``), and
optimizers over stale parameters or with another rank's state step silently.

Required (:data:`REQUIRED`), installed by the feature that needs them and left alone by the switch (removing them
would make training silently wrong): :func:`require_fused_versions` (every wrap, ``OffloadModel``): a global
post-hook that bumps the version counters of what a ``fused=True`` step wrote (``shardfuse._versions``);
:func:`require_step_hooks` (the SSD tier, at the first SSD-offloaded wrap): one global optimizer step pre-hook,
``_ssd._dispatch``, which at an optimizer's first step finds the SSD-backed parameters it holds (parameter -> handle
-> shard -> its model's tier; no registry) and gives that optimizer its own step pre- and post-hooks (page-in,
write-behind; after its own fused-versions hook) and state-dict pre-hook.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from shardfuse import _versions
from shardfuse.sharding.core._grad_reduce import global_grad_norm
from shardfuse.sharding.core._registry import FLATTENED_MARK, SHARD_MARK_ATTR, SHARD_MARK_KEY, handle_of

logger = logging.getLogger(__name__)

__all__ = ["ENV_VAR", "REQUIRED", "SWITCHABLE", "clip_grad_norm_", "install", "installed", "installed_required",
           "require_fused_versions", "require_step_hooks", "set_process_hooks"]

# What this module installs, by name (docs/process-wide.md has one row for each; tests check the names match).
SWITCHABLE = ("clip_grad_norm_", "optimizer_step_guard", "shard_marks")
REQUIRED = ("fused_versions", "ssd_step_hooks")

# "0" turns the process-wide hooks off (read at every wrap, unless set_process_hooks() decided).
ENV_VAR = "SHARDFUSE_PROCESS_HOOKS"
_enabled: bool | None = None  # set_process_hooks(); None: follow ENV_VAR
_requested = False  # a unit was wrapped: the hooks are wanted when enabled

# What the hooks know of each optimizer lives on that optimizer (no module-level table): two attributes, each
# stamped with the generation of the hooks that wrote it. Installing or removing the hooks starts a new generation,
# so what an earlier installation saw is checked again.
_generation = 0
# (generation, how many parameters it held when they were last checked against FLATTENED_MARK)
CHECKED_ATTR = "_shardfuse_params_checked"
# (generation, how many parameters had state when its shard marks were last checked and written, or None: a
# load_state_dict since, so the loaded state is checked at the next step; its load_state_dict post-hook's handle)
MARKS_ATTR = "_shardfuse_marks_seen"
_optimizer_guard: Any = None
# Checks run on an optimizer's sharded parameters once its loaded state is first seen (the pre-hook below): the
# checkpoint layer hands in its resume guard at wrap time (``install(load_check=...)``), so the core imports none.
LoadCheck = Callable[[torch.optim.Optimizer, list[torch.Tensor]], None]
_load_checks: list[LoadCheck] = []


def _refuse_flattened_params(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Global optimizer step pre-hook: an optimizer over the parameters as they were before wrapping would
    step tensors nothing reads any more (their values moved into the flat shards), silently."""
    _check_shard_marks(optimizer)
    count = sum(len(g["params"]) for g in optimizer.param_groups)
    if optimizer.__dict__.get(CHECKED_ATTR) == (_generation, count):
        return
    for gi, group in enumerate(optimizer.param_groups):
        for pi, p in enumerate(group["params"]):
            if getattr(p, FLATTENED_MARK, None) is not None:
                raise RuntimeError(
                    f"{type(optimizer).__name__} holds a parameter (group {gi}, index {pi}, shape {tuple(p.shape)}) "
                    f"that FullyShardedDataParallel flattened into its shards when it wrapped the model: stepping it "
                    f"changes nothing the model uses; build the optimizer after wrapping, on model.parameters()"
                )
    optimizer.__dict__[CHECKED_ATTR] = (_generation, count)


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
    if _marks_seen(optimizer) == len(state):
        return
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
    if sharded and _load_checks:
        params = [p for g in optimizer.param_groups for p in g["params"]
                  if getattr(p, SHARD_MARK_ATTR, None) is not None and p.requires_grad]
        for check in _load_checks:
            check(optimizer, params)


def _marks_seen(optimizer: torch.optim.Optimizer) -> int | None:
    """How many parameters had state when this generation of the hooks last checked and wrote its marks."""
    seen = optimizer.__dict__.get(MARKS_ATTR)
    return seen[1] if seen is not None and seen[0] == _generation else None


def _set_marks_seen(optimizer: torch.optim.Optimizer, count: int | None) -> None:
    """Record ``count`` (None: check again), hooking the optimizer's ``load_state_dict`` the first time."""
    seen = optimizer.__dict__.get(MARKS_ATTR)
    hook = seen[2] if seen is not None else optimizer.register_load_state_dict_post_hook(_forget_marks)
    optimizer.__dict__[MARKS_ATTR] = (_generation, count, hook)


def _forget_marks(optimizer: torch.optim.Optimizer) -> None:
    """The optimizer's load_state_dict post-hook: the loaded state is checked at the next step."""
    _set_marks_seen(optimizer, None)


def _describe_mark(mark: Any) -> str:
    if isinstance(mark, tuple) and len(mark) == 2:
        return f"rank {mark[0]} of {mark[1]}"
    return repr(mark)


def mark_optimizer_state(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Global optimizer step post-hook: the state of every sharded parameter carries the mark of its shard
    (``(rank, world_size)``), so state loaded onto the wrong rank is caught by :func:`_check_shard_marks`."""
    state = optimizer.state
    if _marks_seen(optimizer) == len(state):
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            mark = getattr(p, SHARD_MARK_ATTR, None)
            if mark is not None:
                st = state.get(p)
                if st and not isinstance(st.get(SHARD_MARK_KEY), tuple):
                    st[SHARD_MARK_KEY] = mark
    _set_marks_seen(optimizer, len(state))


_torch_clip_grad_norm: Any = None


def _sharded_handle(p: torch.Tensor) -> Any | None:
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
    for p in params:
        owner = handle_of(p)
        if owner is not None and owner.host is not None and owner.host.on_grad_sent is not None:
            raise RuntimeError(
                "torch.nn.utils.clip_grad_norm_ over a model whose OffloadOptimizer has step_in_backward=True or "
                "speculative_clip=True: each unit's update started as its gradient landed, before the global norm "
                "was known, so scaling the gradients now would change nothing (or race the update); with "
                "speculative_clip call model.clip_grad_norm_(max_norm) instead (it decides whether the updates "
                "stand), with step_in_backward use step_in_backward=False to clip"
            )
    for p in params:  # a model.clip_grad_norm_ before this one may have left its scaling to the host updates
        owner = handle_of(p)
        if owner is not None and owner.host is not None:
            owner.host.settle_grad()
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
    total = global_grad_norm(sharded, replicated, float(norm_type), h.groups.device, h.group, h.world_size)
    if error_if_nonfinite and bool(torch.logical_or(total.isnan(), total.isinf())):
        raise RuntimeError(
            f"The total norm of order {float(norm_type)} for gradients from `parameters` is non-finite, so it "
            f"cannot be clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
            f"`error_if_nonfinite=False`"
        )
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach)
    return total


def _enabled_now() -> bool:
    return _enabled if _enabled is not None else os.environ.get(ENV_VAR, "1") != "0"


def install(load_check: LoadCheck | None = None) -> None:
    """Called at every wrap: install the hooks once per process, unless they are turned off. ``load_check`` (the
    checkpoint layer's resume guard) runs in the step pre-hook on an optimizer's sharded parameters once its
    loaded state is first seen; each distinct check is kept once."""
    global _requested
    _requested = True
    if load_check is not None and load_check not in _load_checks:
        _load_checks.append(load_check)
    if _enabled_now():
        _install()


def installed() -> bool:
    """Whether the process-wide hooks are in place now."""
    return _optimizer_guard is not None


def set_process_hooks(enabled: bool) -> None:
    """Turn shardfuse's process-wide hooks (see this module) on or off for this process.

    ``False`` restores ``torch.nn.utils.clip_grad_norm_`` and removes the optimizer step hooks now, and wrapping
    installs nothing afterwards (whatever ``SHARDFUSE_PROCESS_HOOKS`` says); ``True`` installs them again if a
    model was wrapped already, else at the first wrap.
    """
    global _enabled
    if not isinstance(enabled, bool):
        raise TypeError(f"set_process_hooks takes True or False, got {enabled!r}")
    _enabled = enabled
    if not enabled:
        _uninstall()
    elif _requested:
        _install()


def _install() -> None:
    global _torch_clip_grad_norm, _optimizer_guard, _generation
    if _torch_clip_grad_norm is None:
        # Looked up at call time, as Hugging Face's Trainer and accelerate do.
        _torch_clip_grad_norm = torch.nn.utils.clip_grad.clip_grad_norm_
        torch.nn.utils.clip_grad_norm_ = clip_grad_norm_
        torch.nn.utils.clip_grad.clip_grad_norm_ = clip_grad_norm_
    if _optimizer_guard is None:
        _generation += 1  # what optimizers carry from an earlier installation is stale
        _optimizer_guard = (register_optimizer_step_pre_hook(_refuse_flattened_params),
                            register_optimizer_step_post_hook(mark_optimizer_state))
        logger.debug("shardfuse installed its process-wide hooks (%s=0 turns them off)", ENV_VAR)


def _uninstall() -> None:
    global _torch_clip_grad_norm, _optimizer_guard, _generation
    if _torch_clip_grad_norm is not None:
        # Give torch's function back only where it is still ours (someone may have patched it since).
        for owner in (torch.nn.utils, torch.nn.utils.clip_grad):
            if getattr(owner, "clip_grad_norm_", None) is clip_grad_norm_:
                setattr(owner, "clip_grad_norm_", _torch_clip_grad_norm)  # noqa: B010 (a module torch types)
        _torch_clip_grad_norm = None
    if _optimizer_guard is not None:
        for handle in _optimizer_guard:
            handle.remove()
        _optimizer_guard = None
    _generation += 1


# ------------------------------------------------------------------------------------------------------
# required: installed by the feature that needs them, not subject to the switch
# ------------------------------------------------------------------------------------------------------

_required: dict[str, Any] = {}  # name (REQUIRED) -> the torch hook handles


def require_fused_versions() -> None:
    """Once per process (every wrap, ``OffloadModel``): a global optimizer step post-hook that bumps the version
    counters of what a ``fused=True`` step wrote (``shardfuse._versions``). torch's fused kernels write in place
    without counting it, and shardfuse reads the counters to know what changed: a gathered full parameter is
    reused while its shard's version holds, the SSD tier writes back what changed, ``OffloadModel`` refreshes a
    slice's host copy when its version moved. Without it a fused optimizer's updates go unseen (stale values,
    silently), so the switch leaves it. Optimizers that carry :func:`shardfuse._versions.hook_optimizer`'s own
    hook (``OffloadOptimizer``'s per-shard optimizers) are skipped."""
    if "fused_versions" not in _required:
        _required["fused_versions"] = (register_optimizer_step_post_hook(_versions.global_fused_step_post_hook),)


def require_step_hooks(name: str, pre: Any, post: Any = None) -> None:
    """Once per process and ``name`` (one of :data:`REQUIRED`): a global optimizer step pre-hook (and post-hook,
    if given) a feature cannot work without (the SSD tier's pre-hook gives each optimizer over SSD-backed
    parameters hooks of its own at its first step: optimizers are built after wrapping, so it cannot hook them at
    wrap time). Registered after the fused-versions hook, so a fused step's writes are counted before ``post``
    reads the counters (global post-hooks run in the order they were registered)."""
    if name not in REQUIRED or name == "fused_versions":
        raise ValueError(f"require_step_hooks: unknown hook name {name!r}; add it to REQUIRED (and to "
                         f"docs/process-wide.md) first, or use require_fused_versions()")
    require_fused_versions()
    if name not in _required:
        _required[name] = (register_optimizer_step_pre_hook(pre),
                           *((register_optimizer_step_post_hook(post),) if post is not None else ()))


def installed_required() -> tuple[str, ...]:
    """The names of the required hooks in place now."""
    return tuple(n for n in REQUIRED if n in _required)
