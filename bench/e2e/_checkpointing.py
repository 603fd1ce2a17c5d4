"""Activation checkpointing of the decoder layers for ``bench.e2e``'s variants (``+ac``, ``+acK``, ``+acop``): the
configurations FSDP2 may need to fit, so that its best one that fits is measured, not assumed.

- every layer (``+ac``): each layer's forward recomputed in backward;
- one layer in K (``+acK``): torchtitan's selective layer checkpointing (its ``ac_freq``): the K-th, 2K-th, ...
  layer counting from 1, the others keep what they save;
- op-level selective checkpointing of every layer (``+acop``), torchtitan's ``selective_ac_option = "op"`` rule:
  the outputs of attention and of every other matrix product (the 1st, 3rd, ... of each forward, counting
  ``mm`` and float8's ``_scaled_mm`` alike) and of ``max`` (float8's amax) are kept, the rest is recomputed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

_MATMULS = (torch.ops.aten.mm.default, torch.ops.aten._scaled_mm.default)


@functools.cache
def _kept_ops() -> frozenset[Any]:
    """Ops whose outputs the op-level rule keeps (beyond every other matrix product); the attention kernels this
    build has. Looked up once: a policy is made for every checkpointed call."""
    names = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "max")
    return frozenset(getattr(torch.ops.aten, n).default for n in names if hasattr(torch.ops.aten, n))


def op_policy() -> Callable[..., Any]:
    """A fresh policy for ``torch.utils.checkpoint.create_selective_checkpoint_contexts``: one per checkpointed
    call, since it counts the matrix products of that forward (and, apart, of its recomputation)."""
    from torch.utils.checkpoint import CheckpointPolicy

    kept = _kept_ops()
    counts = {False: 0, True: 0}  # matrix products seen, by ctx.is_recompute

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        if func in _MATMULS:
            counts[ctx.is_recompute] += 1
            keep = counts[ctx.is_recompute] % 2 == 1
        else:
            keep = func in kept
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _op_context() -> Any:
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(op_policy())


def checkpoint_layers(layers: nn.ModuleList, every: int, ops: bool) -> tuple[bool, str]:
    """Wrap the chosen layers of ``layers`` in ``checkpoint_wrapper`` in place: every layer (``every == 1``), one
    in ``every``, or every layer under the op-level rule (``ops``). Returns whether every layer is now a
    ``CheckpointWrapper`` (the unit class of wrappers that pick units by class) and what was done, in words."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    if ops:
        for i, layer in enumerate(layers):
            layers[i] = checkpoint_wrapper(layer, context_fn=_op_context)
        return True, ("every decoder layer, op-level selective (attention, max and every other matrix product "
                      "kept)")
    chosen = [i for i in range(len(layers)) if (i + 1) % every == 0]
    for i in chosen:
        layers[i] = checkpoint_wrapper(layers[i])
    if every == 1:
        return True, "every decoder layer"
    return False, f"one decoder layer in {every} ({len(chosen)} of {len(layers)})"
