"""The float8 all-gather marker torchao's ``Float8Linear`` weights get (``sharding/core/_fp8_gather.py``).

:func:`~shardfuse.float8.convert_to_float8_training` registers :class:`TorchaoFloat8Weights` when the config asks
for ``enable_fsdp_float8_all_gather``. At wrap time it claims the weight of every ``Float8Linear`` whose config
asks for it; the gather then sends each such weight as float8 bytes with torchao's tensorwise dynamic scale, and
the layer computes with a ``Float8TrainingTensor`` over them (torchao's matmul casts an already-float8 weight no
more, as under FSDP2's float8 all-gather).
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

import torch
from torch import nn

__all__ = ["TorchaoFloat8Weights", "gathers_in_float8"]


def gathers_in_float8(module: nn.Module) -> bool:
    """``module`` is a torchao ``Float8Linear`` whose config asks for the float8 all-gather."""
    # By name, as _convert imports torchao: an optional dependency (and untyped).
    float8_linear: Any = importlib.import_module("torchao.float8.float8_linear")
    return isinstance(module, float8_linear.Float8Linear) and bool(module.config.enable_fsdp_float8_all_gather)


class TorchaoFloat8Weights:
    """The marker: the methods the sharding core calls, all static (nothing live is registered)."""

    @staticmethod
    def marks(module: nn.Module, name: str, param: nn.Parameter) -> bool:
        return name == "weight" and gathers_in_float8(module)

    @staticmethod
    def amax_to_scale(amax: torch.Tensor, modules: list[Any]) -> torch.Tensor:
        """torchao's ``amax_to_scale`` of each weight's amax, with its layer's weight dtype and rounding."""
        utils: Any = importlib.import_module("torchao.float8.float8_utils")
        settings = [(m.config.cast_config_weight.target_dtype, m.config.round_scales_to_power_of_2) for m in modules]
        if len(set(settings)) == 1:  # the usual case: one config for every layer, one call on the whole vector
            return utils.amax_to_scale(amax, *settings[0])
        return torch.stack([utils.amax_to_scale(a, *s) for a, s in zip(amax.unbind(), settings)])

    @staticmethod
    def weight(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, module: Any) -> torch.Tensor:
        t = _training_tensor_module()
        return t.Float8TrainingTensor(data, scale, dtype, module.linear_mm_config,
                                      gemm_input_role=t.GemmInputRole.WEIGHT)


@functools.cache
def _training_tensor_module() -> Any:
    """torchao's ``float8_training_tensor``, looked up once: ``weight`` runs for every float8 weight at every gather
    (``importlib.import_module`` cost ~3 us a call there, a fifth of the weight's host time)."""
    return importlib.import_module("torchao.float8.float8_training_tensor")
