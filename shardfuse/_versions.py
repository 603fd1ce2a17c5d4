"""In-place updates torch does not count, made visible.

shardfuse tells whether a tensor changed since it last copied it by the tensor's version counter
(``tensor._version``, bumped by every in-place op): the SSD tier writes back only what changed, ``OffloadModel``
refreshes a slice's low-precision host copy (and drops the GPU copy it carries into the next forward) only when its
parameters changed, and the sharding runtime refuses a parameter changed between forward and backward. torch's fused
optimizer kernels (``Adam``/``AdamW``/``SGD``/``Adagrad`` with ``fused=True``) write parameters and optimizer state
in place without bumping their counters, so without this module their updates would look like no change at all.

:func:`fused_step_post_hook` bumps the counters of what a fused optimizer step wrote (every parameter of its
``fused=True`` groups and their tensor state). Where shardfuse builds the optimizer itself it attaches the hook to
it (:func:`hook_optimizer`); the user's optimizers, built after wrapping, get it from one global post-hook that
``shardfuse.sharding.core._process_hooks.require_fused_versions`` installs (the one place for process-wide hooks; it
skips hooked optimizers). Code that calls the fused kernels itself calls :func:`mark_updated`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.autograd.graph import increment_version

# Attribute set on an optimizer that carries fused_step_post_hook itself (hook_optimizer): the global hook skips it.
HOOKED_ATTR = "_shardfuse_counts_fused_writes"


def mark_updated(tensors: Iterable[torch.Tensor]) -> None:
    """Bump the version counter of each tensor (written in place by a kernel that did not)."""
    tensors = list(tensors)
    if not tensors:
        return
    try:
        increment_version(tensors)  # one call for the list
    except TypeError:  # a torch whose increment_version takes one tensor
        for t in tensors:
            increment_version(t)


def fused_updates(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """What a step of ``optimizer`` wrote without counting it: the parameters of its ``fused=True`` groups and
    their tensor state (``step`` scalars are counted: torch bumps them with an ordinary op)."""
    out: list[torch.Tensor] = []
    for group in optimizer.param_groups:
        if not group.get("fused"):
            continue
        for p in group["params"]:
            out.append(p)
            state = optimizer.state.get(p)
            if state:
                out += [v for k, v in state.items() if isinstance(v, torch.Tensor) and k != "step"]
    return out


def fused_step_post_hook(optimizer: torch.optim.Optimizer, args: Any = None, kwargs: Any = None) -> None:
    """Optimizer step post-hook: count the in-place writes of a fused step (see the module)."""
    mark_updated(fused_updates(optimizer))


def global_fused_step_post_hook(optimizer: torch.optim.Optimizer, args: Any = None, kwargs: Any = None) -> None:
    """The process-wide form of :func:`fused_step_post_hook`: optimizers with their own (:func:`hook_optimizer`)
    are left to it."""
    if not getattr(optimizer, HOOKED_ATTR, False):
        mark_updated(fused_updates(optimizer))


def hook_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Attach :func:`fused_step_post_hook` to ``optimizer`` alone (an optimizer shardfuse builds itself), so its
    fused writes are counted without any process-wide hook."""
    if not getattr(optimizer, HOOKED_ATTR, False):
        optimizer.register_step_post_hook(fused_step_post_hook)
        setattr(optimizer, HOOKED_ATTR, True)
