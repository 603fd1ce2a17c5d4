"""``checkpoint_wrapper``: activation checkpointing of one module, optionally keeping its input on the host.

Equivalent of FairScale's ``fairscale.nn.checkpoint.checkpoint_wrapper``, built on the same offload
checkpoint Function as ``OffloadModel``: the forward runs without autograd and keeps only the module's
inputs (in pinned host memory with ``offload_to_cpu=True``); backward restores them, replays the forward
with the CPU and CUDA RNG state (and autocast state) of the original forward, and backpropagates.

Composes with ``shardfuse.FullyShardedDataParallel`` as ``FSDP(checkpoint_wrapper(block))``: the FSDP
unit's pre-backward hook gathers the full parameters before backward reaches the recompute, and the
recompute calls the module's forward, which uses them.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from shardfuse.offload._function import BlockCall, Packed, apply_block

logger = logging.getLogger(__name__)

_ATTR = "_shardfuse_checkpoint"


class _CheckpointCall(BlockCall):
    profile_prefix = "shardfuse.checkpoint"

    def run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:  # type: ignore[override]
        assert self.fn is not None
        return self.fn(*args, **kwargs)


class _CheckpointedForward:
    """Replaces ``module.forward``; holds the module weakly (no reference cycle through the instance)."""

    def __init__(self, module: nn.Module, inner: Callable[..., Any] | None, offload_to_cpu: bool) -> None:
        self._module = weakref.ref(module)
        self._inner = inner  # an instance-level forward that was already there, else the class's
        self.offload_to_cpu = offload_to_cpu

    def _forward_fn(self) -> Callable[..., Any]:
        module = self._module()
        if module is None:
            raise RuntimeError("checkpoint_wrapper: the wrapped module no longer exists")
        if self._inner is not None:
            return self._inner
        return lambda *a, **k: type(module).forward(module, *a, **k)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        fn = self._forward_fn()
        if not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        packed = Packed((args, kwargs))
        module = self._module()
        assert module is not None
        if not any(t.requires_grad for t in packed.tensors) and not any(
            p.requires_grad for p in module.parameters()
        ):
            return fn(*args, **kwargs)  # nothing to differentiate: no graph, nothing to recompute
        rng_device = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            rng_device = torch.device("cuda", torch.cuda.current_device())
        call = _CheckpointCall(fn, packed, recompute=True, offload_inputs=self.offload_to_cpu, rng_device=rng_device)
        return apply_block(call, packed.tensors)


def checkpoint_wrapper(module: nn.Module, offload_to_cpu: bool = False) -> nn.Module:
    """Checkpoint ``module``'s activations: recompute its forward in backward instead of keeping them.

    Args:
        module: the module to checkpoint; it is modified in place (its ``forward`` is replaced), so its
            parameter and state-dict names do not change, and it is returned for convenience.
        offload_to_cpu: keep the module's input activations in pinned host memory until backward.

    The forward under ``torch.no_grad()`` (or with nothing requiring grad) runs plainly. Backward through a
    checkpointed module must be ``loss.backward()``; ``torch.autograd.grad`` raises a clear error.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"checkpoint_wrapper takes an nn.Module, got {type(module).__name__}")
    if getattr(module, _ATTR, None) is not None:
        raise ValueError(
            f"{type(module).__name__} is already wrapped by checkpoint_wrapper: wrap each module only once"
        )
    inner = module.__dict__.get("forward")
    module.forward = _CheckpointedForward(module, inner, bool(offload_to_cpu))  # type: ignore[method-assign]
    setattr(module, _ATTR, bool(offload_to_cpu))
    return module
