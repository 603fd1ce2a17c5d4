"""In-place updates torch does not count, made visible.

shardfuse tells whether a tensor changed since it last copied it by the tensor's version counter
(``tensor._version``, bumped by every in-place op): the SSD tier writes back only what changed, ``OffloadModel``
refreshes a slice's low-precision host copy (and drops the GPU copy it carries into the next forward) only when its
parameters changed, and the sharding runtime refuses a parameter changed between forward and backward. torch's fused
optimizer kernels (``Adam``/``AdamW``/``SGD``/``Adagrad`` with ``fused=True``) write parameters and optimizer state
in place without bumping their counters, so without this module their updates would look like no change at all.

:func:`fused_step_post_hook` bumps the counters of what a fused optimizer step wrote (every parameter of its
``fused=True`` groups and their tensor state); :func:`install` registers it once per process as a global optimizer
step post-hook (always: it is a correctness fix, not a convenience, so ``set_process_hooks(False)`` leaves it);
code that calls the fused kernels itself calls :func:`mark_updated`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.autograd.graph import increment_version
from torch.optim.optimizer import register_optimizer_step_post_hook

_hook: Any = None


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


_COUNTED_ATTR = "_shardfuse_fused_step_counted"  # on an optimizer: this step's fused writes are counted already


def count_fused_step(optimizer: torch.optim.Optimizer) -> None:
    """Count the fused writes of the step ``optimizer`` just took, now: for an optimizer step post-hook of the
    optimizer's own (those run before the global ones) that reads the version counters. The global hook then leaves
    this step alone (each write counted once)."""
    if not optimizer.__dict__.get(_COUNTED_ATTR):
        mark_updated(fused_updates(optimizer))
        optimizer.__dict__[_COUNTED_ATTR] = True


def fused_step_post_hook(optimizer: torch.optim.Optimizer, args: Any = None, kwargs: Any = None) -> None:
    """Global optimizer step post-hook: count the in-place writes of a fused step (see the module), unless
    :func:`count_fused_step` did already."""
    if not optimizer.__dict__.pop(_COUNTED_ATTR, False):
        mark_updated(fused_updates(optimizer))


def install() -> None:
    """Register :func:`fused_step_post_hook` once per process (wrapping a model and building an OffloadModel
    call this)."""
    global _hook
    if _hook is None:
        _hook = register_optimizer_step_post_hook(fused_step_post_hook)
