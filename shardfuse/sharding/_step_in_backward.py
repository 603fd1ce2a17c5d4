"""``StepInBackward``: the user's optimizer over a model whose shards stay on the GPU, stepped unit by unit during
backward, each unit as soon as its gradient is reduced, on the post-backward stream; the sharded gradient is freed
right after. The gradients of the whole model never exist at once: at 7B on 2 GPUs that is 12.5 GiB of fp32 shard
gradients at the end of backward, where the peak is once the activations no longer make it (checkpointed or
offloaded).

The reduction path calls the handle's ``grad_consumer`` (``_grad_reduce._consume``) with the gradient written; it
runs on autograd's thread while the main thread waits in ``backward()``, so no lock guards this object's state.
The updates are those of stepping the optimizer after backward (per-element optimizers: each unit's shard is stepped
by an optimizer of the user's class over that shard alone, sharing the user's state and settings, as
``OffloadOptimizer`` steps its GPU-resident units).
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from shardfuse.sharding.core._flat_param import FlatParamHandle
from shardfuse.sharding.core._registry import handle_of
from shardfuse.sharding.core._runtime import Unit
from shardfuse.sharding.core._tree import units_below
from shardfuse.sharding.host._engine import engine_of
from shardfuse.sharding.host._host_step import (
    PER_ELEMENT_OPTIMIZERS,
    ShardPlan,
    apply_zero_grad,
    make_sub_optimizers,
    settings_of,
    step_plan,
)
from shardfuse.sharding.host._wrapped_hooks import WrapsOptimizer, refusing_step


class StepInBackward(WrapsOptimizer):
    """Step ``optimizer`` during backward, one unit at a time, as each unit's gradient is reduced; free that gradient
    at once. The peak of a step then holds no model-wide sharded gradient (4 bytes a parameter over the ranks in
    fp32), at the cost of clipping by the global norm (the norm needs every gradient before any update).

    The loop stays ``loss.backward(); opt.step(); opt.zero_grad()``: ``step()`` steps what backward did not (the
    parameters outside every shard, a unit whose gradient was not reduced in this backward) and must come after
    every synced backward (accumulate with ``no_sync()``: its micro-steps reduce nothing, the last one steps). After
    backward the stepped units' ``.grad`` is None. LR schedulers take this object (its ``param_groups`` are the
    user's optimizer's): a change made after ``step()`` applies to the next backward's updates.

    Args:
        model: the root ``FullyShardedDataParallel``, its shards on the GPU (``move_params_to_cpu=True`` models
            take ``OffloadOptimizer(step_in_backward=True)``).
        optimizer: a ``torch.optim.Adam``/``AdamW``/``SGD`` over ``model.parameters()`` (``fused=True`` is the
            fastest; ``capturable`` as the user sets it). Its own ``step()`` is refused while this object drives
            it (it would step the units again); ``close()`` hands it back.

    Not with ``clip_grad_norm_`` (raises) or fp16 loss scaling (``GradScaler.step`` raises: the updates ran on
    scaled gradients before the scaler could check them); bf16 and fp32 need no scaler.
    """

    _step_supports_amp_scaling = True  # GradScaler then calls step() itself, which refuses it (see step)

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.root = _check_model(model)
        _check_optimizer(optimizer)
        old = engine_of(self.root)
        if old is not None:  # only a StepInBackward can be attached to a model with resident shards
            old.close()
        # Not Optimizer.__init__: param_groups, state and defaults are the user's optimizer's (properties below).
        self.optimizer = optimizer
        self.model = model
        self._plans: dict[int, ShardPlan] = {}  # id(handle) -> its plan; 0: the parameters that are no shard
        self._signature: tuple = ()
        self._stepped: set[int] = set()  # id(handle) of the units stepped in this backward
        self._init_hook_dicts()
        self._hooks: list[RemovableHandle] = [optimizer.register_step_pre_hook(refusing_step(
            self, "a StepInBackward drives: its units were stepped during backward already; call step() on the "
                  "StepInBackward (also what LR schedulers should be given), or close() it first to step this "
                  "optimizer by itself"))]
        self._consumer = functools.partial(_consume_weakly, weakref.WeakMethod(self._on_grad))
        self._refresh_plans()  # hands the consumer to the handles the optimizer holds
        self.root.host_engine = weakref.ref(self)

    # ------------------------------------------------------------------------------------------ the user's optimizer

    def __repr__(self) -> str:
        return f"StepInBackward({self.optimizer!r})"

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)
        self._signature = ()  # a new state dict: the per-unit optimizers share it from the next update

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)
        self._signature = ()

    # ------------------------------------------------------------------------------------------ the step

    def _handles(self) -> list[FlatParamHandle]:
        seen: dict[int, FlatParamHandle] = {}
        for u in units_below(self.root):
            for h in u.handles:
                seen.setdefault(id(h), h)
        return list(seen.values())

    def _refresh_plans(self) -> None:
        signature = (id(self.optimizer.state), tuple(tuple(map(id, g["params"])) for g in self.param_groups))
        if signature == self._signature:
            return
        by_handle: dict[int, dict[int, list[torch.Tensor]]] = {}
        handles: dict[int, FlatParamHandle | None] = {0: None}
        for gi, group in enumerate(self.param_groups):
            for p in group["params"]:
                h = handle_of(p)
                key = id(h) if h is not None else 0
                handles[key] = h
                by_handle.setdefault(key, {}).setdefault(gi, []).append(p)
        plans = {key: ShardPlan(handles[key], sorted(groups.items())) for key, groups in by_handle.items()}
        for plan in plans.values():
            make_sub_optimizers(self.optimizer, plan)
        self._plans, self._signature = plans, signature
        for h in self._handles():  # only the shards it holds: the reduction makes their gradients on its stream
            if id(h) in plans:
                h.grad_consumer = self._consumer
            elif h.grad_consumer is self._consumer:
                h.grad_consumer = None

    @torch.no_grad()
    def _on_grad(self, handle: FlatParamHandle) -> bool:
        """The reduction wrote ``handle.flat.grad`` (on the post-backward stream, current now): step the unit with it
        and drop it. False where the optimizer does not hold the shard (its gradient stays)."""
        if not self._stepped:  # once a backward (its groups and state cannot change within one)
            self._refresh_plans()
        plan = self._plans.get(id(handle))
        if plan is None:
            return False
        if id(handle) in self._stepped:
            raise RuntimeError(
                f"StepInBackward already stepped {handle.names[0]} in an earlier backward: call step() after every "
                f"synced backward (accumulate micro-batches under no_sync()), or step the plain optimizer"
            )
        self._stepped.add(id(handle))
        handle.grads_to_views()  # use_orig_params: the optimizer holds the views
        step_plan(plan, settings_of(self.optimizer, plan), None)
        apply_zero_grad(plan, True)
        handle.flat.grad = None
        return True

    @torch.no_grad()
    def step(self, closure: Any = None, **kwargs: Any) -> None:  # type: ignore[override]
        """Step what backward did not: the parameters that are no shard, and units not reduced in this backward."""
        if closure is not None:
            raise ValueError("StepInBackward.step() takes no closure: compute the loss and backward before step()")
        if "grad_scale" in self.__dict__ or "found_inf" in self.__dict__ or "grad_scaler" in kwargs:
            raise RuntimeError(
                "StepInBackward with a GradScaler (fp16 loss scaling): each unit was updated during backward with "
                "its scaled gradient, before the scaler could unscale it or check it for inf/nan; train in bf16 "
                "(no scaler needed), or step the plain optimizer after backward"
            )
        self._refresh_plans()
        for key, plan in self._plans.items():
            if key not in self._stepped:
                step_plan(plan, settings_of(self.optimizer, plan), None)
        self._stepped.clear()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def synchronize(self) -> None:
        """Nothing runs after backward: its updates ran on the post-backward stream, which the end of backward made
        the compute stream wait for."""

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        raise RuntimeError(
            "clip_grad_norm_ with StepInBackward: each unit is updated as its gradient is reduced, before the global "
            "norm is known, and its gradient is gone after backward; train without clipping, or step the plain "
            "optimizer after backward to clip"
        )

    def close(self) -> None:
        """Stop stepping in backward: the model's gradients stay after backward again and the user's optimizer
        steps them (also done when the model is moved or cast)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        for h in self._handles():
            if h.grad_consumer is self._consumer:
                h.grad_consumer = None
        if engine_of(self.root) is self:
            self.root.host_engine = None


def _check_model(model: nn.Module) -> Unit:
    unit = getattr(model, "_unit", None)
    if not isinstance(unit, Unit):
        raise TypeError(f"StepInBackward needs the root FullyShardedDataParallel model, got {type(model).__name__}: "
                        f"wrap the model first, then build the optimizer over the wrapper's parameters")
    if unit.parent is not None:
        raise ValueError(f"StepInBackward needs the root (outermost) FullyShardedDataParallel, not the nested "
                         f"{unit.name}: pass the outermost wrapper")
    if unit.config.offload.move_params_to_cpu:
        raise ValueError(f"StepInBackward steps shards on the GPU; {unit.name} keeps them on the host "
                         f"(move_params_to_cpu=True): use OffloadOptimizer(model, optimizer, step_in_backward=True)")
    return unit


def _check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    if not isinstance(optimizer, PER_ELEMENT_OPTIMIZERS) or isinstance(optimizer, StepInBackward):
        raise TypeError(
            f"StepInBackward steps each unit's shard on its own, which equals one step of the whole model only for "
            f"per-element optimizers (torch.optim.Adam, AdamW, SGD); got {type(optimizer).__name__}: use one of "
            f"those, or step {type(optimizer).__name__} itself after backward"
        )


def _consume_weakly(method: weakref.WeakMethod, handle: FlatParamHandle) -> bool:
    """The handle's ``grad_consumer``: holds its StepInBackward weakly (a dropped one steps nothing)."""
    on_grad = method()
    return bool(on_grad(handle)) if on_grad is not None else False
