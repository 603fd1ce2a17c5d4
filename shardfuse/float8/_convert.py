"""torchao's ``convert_to_float8_training`` for a model that shardfuse will wrap.

torchao swaps ``nn.Linear`` modules for ``Float8Linear`` (same parameter names, same state dict): their forward
casts the input, the weight and the output gradient to float8 with a tensorwise dynamic scale and multiplies
with ``torch._scaled_mm``. shardfuse then flattens, shards and gathers those weights like any other parameter;
the matmuls run in float8, the all-gather in the compute dtype.

Two things differ from calling torchao directly:

- ``enable_fsdp_float8_all_gather=True`` turns on shardfuse's own float8 all-gather (docs/design.md, "Float8
  all-gather"): the weights stay plain parameters (torchao's ``WeightWithDynamicFloat8CastTensor``, whose hooks
  only FSDP2 calls, is taken off), and a marker registered here gives them flat parameters of their own, gathered
  as float8 bytes with torchao's tensorwise dynamic scale. Shards on the host (``OffloadOptimizer``,
  ``move_params_to_cpu``) are gathered in the compute dtype instead.
- By default only the layers ``torch._scaled_mm`` can run are converted (:func:`float8_compatible`: both
  dimensions multiples of 16); the others stay ``nn.Linear`` and are logged.

Call it on the unwrapped model, before wrapping (``FullyShardedDataParallel`` or ``auto_wrap``).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from typing import Any

from torch import nn

from shardfuse.float8._gather import TorchaoFloat8Weights, gathers_in_float8
from shardfuse.kernels._fp8 import FP8_DTYPE
from shardfuse.sharding.core._fp8_gather import register_marker

logger = logging.getLogger(__name__)

__all__ = ["convert_to_float8_training", "float8_compatible"]

_ALIGN = 16  # torch._scaled_mm needs both dimensions of the weight to be multiples of 16


def float8_compatible(module: nn.Module, fqn: str = "") -> bool:
    """Whether ``module`` is an ``nn.Linear`` whose weight ``torch._scaled_mm`` can take (both dims % 16 == 0)."""
    return isinstance(module, nn.Linear) and module.in_features % _ALIGN == 0 and module.out_features % _ALIGN == 0


def convert_to_float8_training(
    module: nn.Module,
    *,
    config: Any | None = None,
    module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
) -> nn.Module:
    """Swap ``module``'s ``nn.Linear`` layers for torchao's ``Float8Linear`` (in place; returns ``module``).

    ``config``: a ``torchao.float8.Float8LinearConfig`` (default: tensorwise dynamic scaling); with
    ``enable_fsdp_float8_all_gather=True`` shardfuse gathers the converted weights in float8 (e4m3 only).
    ``module_filter_fn(module, fqn)``: which layers to convert
    (default: :func:`float8_compatible`, logging the linear layers it leaves alone). Raises ``ImportError``
    when torchao is not installed and ``ValueError`` for a config shardfuse cannot honour.
    """
    if isinstance(module, _fsdp_type()):
        raise ValueError(
            f"convert_to_float8_training got a wrapped {type(module).__name__}: convert the model before "
            f"wrapping it (Float8Linear must be in place when shardfuse flattens the parameters)"
        )
    try:
        # By name: torchao is the optional extra `shardfuse[float8]`, not a dependency of the library.
        torchao_float8 = importlib.import_module("torchao.float8")
    except ImportError as e:
        raise ImportError(f"float8 training needs torchao ({e}): pip install 'shardfuse[float8]'") from e
    config = torchao_float8.Float8LinearConfig() if config is None else config
    float8_gather = bool(getattr(config, "enable_fsdp_float8_all_gather", False))
    if float8_gather:
        _check_gather_dtype(config)
    if module_filter_fn is None:
        module_filter_fn = _default_filter
    module = torchao_float8.convert_to_float8_training(module, config=config, module_filter_fn=module_filter_fn)
    if float8_gather:
        _plain_weights(module)
        register_marker(TorchaoFloat8Weights)
    return module


def _check_gather_dtype(config: Any) -> None:
    dtype = config.cast_config_weight.target_dtype
    if dtype != FP8_DTYPE:
        raise ValueError(
            f"enable_fsdp_float8_all_gather=True with weight dtype {dtype}: shardfuse's float8 all-gather casts "
            f"to {FP8_DTYPE} only; use the default cast_config_weight, or enable_fsdp_float8_all_gather=False"
        )


def _plain_weights(module: nn.Module) -> None:
    """Take torchao's FSDP2 wrapper (``WeightWithDynamicFloat8CastTensor``) off each float8 weight: shardfuse
    flattens plain parameters, and its own gather does the float8 cast."""
    for m in module.modules():
        if gathers_in_float8(m):
            w: Any = m.weight
            inner = getattr(w, "_tensor", None)
            if inner is not None:
                m.weight = nn.Parameter(inner.detach(), requires_grad=bool(w.requires_grad))


def _default_filter(module: nn.Module, fqn: str) -> bool:
    if not isinstance(module, nn.Linear):
        return False
    ok = float8_compatible(module)
    if not ok:
        logger.info("float8: %s (%d -> %d) stays nn.Linear: torch._scaled_mm needs dimensions that are multiples "
                    "of 16", fqn, module.in_features, module.out_features)
    return ok


def _fsdp_type() -> type:
    from shardfuse.sharding import FullyShardedDataParallel

    return FullyShardedDataParallel
