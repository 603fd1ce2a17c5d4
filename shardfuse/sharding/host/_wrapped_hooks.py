"""The hooks an ``OffloadOptimizer`` puts on the optimizer it wraps (the user's, which the user may still hold), and
``WrapsOptimizer``: the user's optimizer's groups, state and defaults seen through a wrapper.

While the ``OffloadOptimizer`` drives it, that optimizer's own ``step()`` would update the host shards on the
caller's thread, beside the worker's updates and without the deferred clip coefficient: it is refused, naming the
call to make instead. Its ``state_dict()`` and ``load_state_dict()`` first finish the updates in flight (their
state is what those updates write), and a load makes the per-shard optimizers share the new state. Each hook holds
the ``OffloadOptimizer`` weakly and does nothing once it is gone; ``close()`` removes them.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch.utils.hooks import RemovableHandle


class Driver(Protocol):
    """What the hooks ask of the ``OffloadOptimizer`` (typed here so this module needs no import of it)."""

    def synchronize(self) -> None: ...

    def state_read(self) -> None: ...

    def state_loaded(self) -> None: ...


def refusing_step(driver: object, why: str) -> Callable[[torch.optim.Optimizer, Any, Any], None]:
    """A step pre-hook that refuses the wrapped optimizer's own ``step()`` while ``driver`` (held weakly) lives:
    ``"<class>.step() called on the optimizer <why>"``."""
    ref = weakref.ref(driver)

    def refuse_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if ref() is not None:
            raise RuntimeError(f"{type(opt).__name__}.step() called on the optimizer {why}")

    return refuse_step


def attach(driver: Driver, optimizer: torch.optim.Optimizer) -> list[RemovableHandle]:
    """Hook ``optimizer`` for ``driver``; returns the handles to remove at ``close()``."""
    ref = weakref.ref(driver)
    refuse_step = refusing_step(
        driver, "an OffloadOptimizer wraps: it would update the host shards beside the OffloadOptimizer's own updates "
                "(and without a deferred clip): call step() on the OffloadOptimizer (also what GradScaler.step and LR "
                "schedulers should be given), or close() it first to step this optimizer by itself")

    def before_read(opt: torch.optim.Optimizer) -> None:
        if (d := ref()) is not None:
            d.state_read()

    def before_load(opt: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        if (d := ref()) is not None:
            d.synchronize()

    def after_load(opt: torch.optim.Optimizer) -> None:
        if (d := ref()) is not None:
            d.state_loaded()

    return [optimizer.register_step_pre_hook(refuse_step), optimizer.register_state_dict_pre_hook(before_read),
            optimizer.register_load_state_dict_pre_hook(before_load),
            optimizer.register_load_state_dict_post_hook(after_load)]


class WrapsOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` over the user's optimizer ``self.optimizer`` (``OffloadOptimizer``,
    ``StepInBackward``): ``param_groups``, ``state`` and ``defaults`` are that optimizer's, so LR schedulers and state
    dicts see one set of groups. Subclasses do not call ``Optimizer.__init__``; :meth:`_init_hook_dicts` makes the
    hook tables it would have."""

    optimizer: torch.optim.Optimizer

    def _init_hook_dicts(self) -> None:
        for name in ("step_pre", "step_post", "state_dict_pre", "state_dict_post", "load_state_dict_pre",
                     "load_state_dict_post"):
            setattr(self, f"_optimizer_{name}_hooks", OrderedDict())

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value
