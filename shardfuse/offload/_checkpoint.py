"""``checkpoint_wrapper``: activation checkpointing of one module, optionally keeping its input on the host.

Equivalent of FairScale's ``fairscale.nn.checkpoint.checkpoint_wrapper``, built on the same offload
checkpoint Function as ``OffloadModel``: the forward runs without autograd and keeps only the module's
inputs (in pinned host memory with ``offload_to_cpu=True``); backward restores them, replays the forward
with the CPU and CUDA RNG state (and autocast state) of the original forward, and backpropagates.

Composes with ``shardfuse.FullyShardedDataParallel`` as ``FSDP(checkpoint_wrapper(block))``: the FSDP
unit's pre-backward hook gathers the full parameters before backward reaches the recompute, and the
recompute calls the module's forward, which uses them.

FairScale fidelity: the recompute leaves norm layers' running statistics alone (the forward updated them
once, as the plain module does); :func:`disable_checkpointing`, and FairScale's own
``fairscale.nn.checkpoint.checkpoint_activations.disable_checkpointing`` when FairScale is loaded, turn the
wrapper into the plain forward; a module whose parameters are not registered ``nn.Parameter``s (views set as
plain attributes, as FairScale's ``FlattenParamsWrapper`` and shardfuse's FSDP do) is still checkpointed.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from shardfuse.offload._function import BlockCall, apply_block
from shardfuse.offload._microbatch import Packed

_ATTR = "_shardfuse_checkpoint"
_FAIRSCALE_CHECKPOINT = "fairscale.nn.checkpoint.checkpoint_activations"


class _CheckpointingState(threading.local):
    disabled = False


_state = _CheckpointingState()


@contextlib.contextmanager
def disable_checkpointing() -> Iterator[None]:
    """Inside this context (in this thread) ``checkpoint_wrapper`` modules run their plain forward.

    The same as FairScale's ``disable_checkpointing``, which shardfuse's wrapper honours too. It does not
    change ``OffloadModel(checkpoint_activation=True)``.
    """
    before = _state.disabled
    _state.disabled = True
    try:
        yield
    finally:
        _state.disabled = before


def _checkpointing_disabled() -> bool:
    if _state.disabled:
        return True
    # FairScale keeps its flag in a thread-local of that module; look only if FairScale is already imported
    fairscale = sys.modules.get(_FAIRSCALE_CHECKPOINT)
    flags = getattr(fairscale, "thread_local", None)
    return bool(getattr(flags, "is_checkpointing_disabled", False))


def _needs_graph(module: nn.Module, inputs: Sequence[torch.Tensor]) -> bool:
    """Whether the plain forward would record a graph: an input, parameter or tensor attribute requires grad."""
    if any(t.requires_grad for t in inputs):
        return True
    for m in module.modules():
        for p in m._parameters.values():
            if p is not None and p.requires_grad:
                return True
        # parameters replaced by views set as plain attributes (FlattenParamsWrapper, FSDP's flat parameters)
        for v in m.__dict__.values():
            if isinstance(v, torch.Tensor) and v.requires_grad:
                return True
    return False


class _CheckpointCall(BlockCall):
    profile_prefix = "shardfuse.checkpoint"

    def __init__(self, fn: Callable[..., Any], args: Packed, **kwargs: Any) -> None:
        super().__init__(args, **kwargs)
        self.fn = fn

    def describe(self) -> str:
        module = self.stats_module
        return f"checkpoint_wrapper({type(module).__name__})"

    def run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return self.fn(*args, **kwargs)


class _CheckpointedForward:
    """Replaces ``module.forward``; holds the module weakly (no reference cycle through the instance)."""

    def __init__(self, module: nn.Module, inner: Callable[..., Any] | None, offload_to_cpu: bool) -> None:
        self._module = weakref.ref(module)
        self._inner = inner  # an instance-level forward that was already there, else the class's
        self.offload_to_cpu = offload_to_cpu

    def _forward_fn(self) -> tuple[nn.Module, Callable[..., Any]]:
        module = self._module()
        if module is None:
            raise RuntimeError(
                "checkpoint_wrapper: the wrapped module no longer exists, but its forward was called through a "
                "reference that outlived it; call the module itself (keep a reference to it)"
            )
        if self._inner is not None:
            return module, self._inner
        return module, lambda *a, **k: type(module).forward(module, *a, **k)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module, fn = self._forward_fn()
        if not torch.is_grad_enabled() or _checkpointing_disabled():
            return fn(*args, **kwargs)
        packed = Packed((args, kwargs))
        if not _needs_graph(module, packed.tensors):
            return fn(*args, **kwargs)  # nothing to differentiate: no graph, nothing to recompute
        rng_device = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            rng_device = torch.device("cuda", torch.cuda.current_device())
        call = _CheckpointCall(
            fn, packed, recompute=True, offload_inputs=self.offload_to_cpu, rng_device=rng_device, stats_module=module
        )
        return apply_block(call, packed.tensors)


def checkpoint_wrapper(module: nn.Module, offload_to_cpu: bool = False) -> nn.Module:
    """Checkpoint ``module``'s activations: recompute its forward in backward instead of keeping them.

    Args:
        module: the module to checkpoint; it is modified in place (its ``forward`` is replaced), so its
            parameter and state-dict names do not change, and it is returned for convenience.
        offload_to_cpu: keep the module's input activations in pinned host memory until backward.

    The forward under ``torch.no_grad()``, inside :func:`disable_checkpointing` (or FairScale's), or with
    nothing requiring grad runs plainly. The recompute does not update norm layers' running statistics a
    second time. Backward through a checkpointed module must be ``loss.backward()`` (twice with
    ``retain_graph=True``, as with ``torch.utils.checkpoint``); ``torch.autograd.grad`` raises a clear error.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"checkpoint_wrapper takes an nn.Module, got {type(module).__name__}")
    if getattr(module, _ATTR, None) is not None:
        raise ValueError(
            f"{type(module).__name__} is already wrapped by checkpoint_wrapper: wrap each module only once"
        )
    inner = module.__dict__.get("forward")
    module.forward = _CheckpointedForward(module, inner, bool(offload_to_cpu))
    setattr(module, _ATTR, bool(offload_to_cpu))
    return module
