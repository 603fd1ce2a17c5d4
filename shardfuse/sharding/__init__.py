"""The sharding layer: ``FullyShardedDataParallel`` on flat shards, side streams and shardfuse kernels."""

from typing import TYPE_CHECKING

from shardfuse.sharding._fully_sharded import FullyShardedDataParallel
from shardfuse.sharding._step_in_backward import StepInBackward
from shardfuse.sharding._wrap import (
    ModuleClassWrapPolicy,
    auto_wrap,
    config_auto_wrap_policy,
    default_auto_wrap_policy,
    enable_wrap,
    no_split_modules_policy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
    wrap,
)
from shardfuse.sharding.checkpoint._dcp_layout import UnsafeCheckpointError
from shardfuse.sharding.core._hybrid import ShardingStrategy
from shardfuse.sharding.core._process_hooks import set_process_hooks
from shardfuse.sharding.core._state import TrainingState
from shardfuse.sharding.host._activations import ActivationOffload, offload_activations
from shardfuse.sharding.host._offload_optim import OffloadOptimizer
from shardfuse.sharding.ssd._ssd_config import OffloadConfig

if TYPE_CHECKING:
    from shardfuse.sharding.checkpoint._dcp_load import SafeFileSystemReader, SafeLoadPlanner


def __getattr__(name: str) -> object:
    """The DCP reader and planner, imported on first use (their module loads ``torch.distributed.checkpoint``)."""
    if name in ("SafeFileSystemReader", "SafeLoadPlanner"):
        from shardfuse.sharding.checkpoint import _dcp_load

        return getattr(_dcp_load, name)
    raise AttributeError(f"module 'shardfuse.sharding' has no attribute {name!r}")


__all__ = [
    "ActivationOffload",
    "FullyShardedDataParallel",
    "ModuleClassWrapPolicy",
    "OffloadConfig",
    "OffloadOptimizer",
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "ShardingStrategy",
    "StepInBackward",
    "TrainingState",
    "UnsafeCheckpointError",
    "auto_wrap",
    "config_auto_wrap_policy",
    "default_auto_wrap_policy",
    "enable_wrap",
    "no_split_modules_policy",
    "offload_activations",
    "set_process_hooks",
    "size_based_auto_wrap_policy",
    "transformer_auto_wrap_policy",
    "wrap",
]
