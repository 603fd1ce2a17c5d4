"""torchao's ``convert_to_float8_training`` for a model that shardfuse will wrap.

torchao swaps ``nn.Linear`` modules for ``Float8Linear`` (same parameter names, same state dict): their forward
casts the input, the weight and the output gradient to float8 with a tensorwise dynamic scale and multiplies
with ``torch._scaled_mm``. shardfuse then flattens, shards and gathers those weights like any other parameter;
the matmuls run in float8, the all-gather in the compute dtype.

Two things differ from calling torchao directly:

- ``enable_fsdp_float8_all_gather=True`` is refused. It wraps each weight in torchao's
  ``WeightWithDynamicFloat8CastTensor``, whose ``fsdp_pre_all_gather``/``fsdp_post_all_gather`` hooks only
  PyTorch's FSDP2 calls; shardfuse would flatten the weights into plain tensors and silently all-gather them in
  the compute dtype (docs/design.md, "Float8 all-gather", is the plan for shardfuse's own).
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

    ``config``: a ``torchao.float8.Float8LinearConfig`` (default: tensorwise dynamic scaling); its
    ``enable_fsdp_float8_all_gather`` must be False. ``module_filter_fn(module, fqn)``: which layers to convert
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
    if getattr(config, "enable_fsdp_float8_all_gather", False):
        raise ValueError(
            "enable_fsdp_float8_all_gather=True asks for torchao's float8 all-gather, which only PyTorch's FSDP2 "
            "runs: under shardfuse the weights would be all-gathered in the compute dtype anyway. Pass "
            "Float8LinearConfig(enable_fsdp_float8_all_gather=False) (the matmuls still run in float8)"
        )
    if module_filter_fn is None:
        module_filter_fn = _default_filter
    return torchao_float8.convert_to_float8_training(module, config=config, module_filter_fn=module_filter_fn)


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
