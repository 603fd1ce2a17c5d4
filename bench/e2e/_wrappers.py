"""How ``bench.e2e.run`` wraps the model for each implementation (``--impls``), and which ones can run here.

Split off ``bench.e2e.run``, which re-exports every public name here (``from bench.e2e.run import WRAPPERS``).
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable

import torch
from torch import nn

from bench.e2e._model_specs import ModelSpec

# ``shardfuse-ref``: another version of shardfuse, importable under this package name (bench/e2e/make_ref.sh
# builds one from a commit), measured side by side with the working tree's.
REF_PACKAGE = os.environ.get("SHARDFUSE_REF", "shardfuse_ref")
# One GPU without sharding (rank 0 alone, fp32 weights under bf16 autocast), and the steps capture_step replays.
ONE_GPU_IMPLS = ("baseline", "baseline-graph")
CAPTURED_IMPLS = ("shardfuse-graph", "baseline-graph")


def unavailable_reason(impl: str) -> str | None:
    """Why ``impl`` cannot run in this environment (the same answer on every rank), or None."""
    try:
        if impl in ("shardfuse", "shardfuse-graph", "baseline-graph"):
            import shardfuse  # noqa: F401
        elif impl == "shardfuse-ref":
            importlib.import_module(REF_PACKAGE)
        elif impl == "fairscale":
            import fairscale.nn.data_parallel  # noqa: F401
        elif impl in ("fsdp2", "fsdp2-compile"):
            from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError as exc:
        return f"not importable: {exc}"
    return None


def split_edges(model: nn.Module, spec: ModelSpec) -> list[tuple[nn.Module, str]]:
    """The input embedding and output head to wrap as units of their own (``+split``; none without it), the head
    last (the wrappers keep it gathered from forward to backward). They must not share a parameter (tied
    embeddings): one parameter cannot live in two units."""
    if not spec.split_edges:
        return []
    edges = spec.edges(model)
    if not edges:
        raise ValueError(f"+split: the {spec.kind} model names no input embedding and output head (ModelSpec.edges)")
    seen: dict[int, str] = {}
    for parent, attr in edges:
        for name, p in getattr(parent, attr).named_parameters():
            if id(p) in seen:
                raise ValueError(f"+split: {attr}.{name} is tied to {seen[id(p)]} (one parameter in two units): "
                                 f"run without +split, or untie the weights")
            seen[id(p)] = f"{attr}.{name}"
    return edges


def _wrap_with(package: str, model: nn.Module, spec: ModelSpec) -> nn.Module:
    """Each decoder layer (and with ``+split`` the input embedding and the output head), then the root, in
    ``package``'s FSDP (bf16 compute, fp32 reduce-scatter), through the public wrapping API that every shardfuse
    version exports."""
    sf = importlib.import_module(package)
    kwargs = dict(mixed_precision=True, compute_dtype=torch.bfloat16, fp32_reduce_scatter=True)
    with sf.enable_wrap(wrapper_cls=sf.FullyShardedDataParallel, **kwargs):
        if spec.keep_gathered:
            layers = spec.layers(model)
            first_kept = len(layers) - spec.keep_gathered
            for i, layer in enumerate(layers):  # +keepN: the last N layers not resharded after forward
                layers[i] = sf.wrap(layer, **({"reshard_after_forward": False} if i >= first_kept else {}))
        else:
            model = sf.auto_wrap(model, auto_wrap_policy=sf.ModuleClassWrapPolicy({spec.layer_cls}))
        edges = split_edges(model, spec)
        for i, (parent, attr) in enumerate(edges):
            # The head runs last in forward and first in backward: kept gathered between them (torchtitan's
            # reshard_after_forward=False for it), as the root it belonged to.
            last = i == len(edges) - 1
            setattr(parent, attr, sf.wrap(getattr(parent, attr), **({"reshard_after_forward": False} if last else {})))
        return sf.wrap(model)


def wrap_shardfuse(model: nn.Module, spec: ModelSpec, device: torch.device) -> nn.Module:
    """This working tree's shardfuse."""
    return _wrap_with("shardfuse", model, spec)


def wrap_shardfuse_ref(model: nn.Module, spec: ModelSpec, device: torch.device) -> nn.Module:
    """The reference version of shardfuse (``SHARDFUSE_REF``)."""
    return _wrap_with(REF_PACKAGE, model, spec)


def wrap_fsdp2(model: nn.Module, spec: ModelSpec, device: torch.device) -> nn.Module:
    """``fully_shard`` on each decoder layer (and with ``+split`` the input embedding and the output head, as
    torchtitan does), then on the root."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    layers = spec.layers(model)
    for i, layer in enumerate(layers):  # +keepN: the last N layers not resharded after forward
        fully_shard(layer, mp_policy=mp, reshard_after_forward=i < len(layers) - spec.keep_gathered)
    edges = split_edges(model, spec)
    for i, (parent, attr) in enumerate(edges):
        fully_shard(getattr(parent, attr), mp_policy=mp, reshard_after_forward=i < len(edges) - 1)
    fully_shard(model, mp_policy=mp)
    return model


def wrap_fsdp2_compile(model: nn.Module, spec: ModelSpec, device: torch.device) -> nn.Module:
    """``torch.compile`` on each decoder layer, then ``fully_shard`` on each layer and the root (torchtitan's
    order: the compiled layer is what FSDP2 shards, its hooks stay outside the compiled code)."""
    for layer in spec.layers(model):
        layer.compile()
    return wrap_fsdp2(model, spec, device)


def wrap_fsdp1(model: nn.Module, spec: ModelSpec, device: torch.device) -> nn.Module:
    """FSDP1 with a transformer auto-wrap policy on the decoder layer class."""
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16)
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={spec.layer_cls})
    return FullyShardedDataParallel(
        model, auto_wrap_policy=policy, mixed_precision=mp, device_id=device, use_orig_params=False
    )


def wrap_fairscale(model: nn.Module, spec: ModelSpec, device: torch.device) -> nn.Module:
    """FairScale 0.4's FSDP on each decoder layer, then the root, with the flags shardfuse gets."""
    from fairscale.nn.data_parallel import FullyShardedDataParallel

    kwargs = dict(mixed_precision=True, compute_dtype=torch.bfloat16, fp32_reduce_scatter=True)
    layers = spec.layers(model)
    for i, layer in enumerate(layers):
        layers[i] = FullyShardedDataParallel(layer, **kwargs)
    return FullyShardedDataParallel(model, **kwargs)


WRAPPERS: dict[str, Callable[[nn.Module, ModelSpec, torch.device], nn.Module]] = {
    "shardfuse": wrap_shardfuse,
    "shardfuse-graph": wrap_shardfuse,
    "shardfuse-ref": wrap_shardfuse_ref,
    "fsdp2": wrap_fsdp2,
    "fsdp2-compile": wrap_fsdp2_compile,
    "fsdp1": wrap_fsdp1,
    "fairscale": wrap_fairscale,
    "baseline": lambda model, spec, device: model,
    "baseline-graph": lambda model, spec, device: model,  # the one-GPU step, captured by capture_step
}
