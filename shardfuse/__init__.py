"""shardfuse: fully sharded data parallelism and layer-wise CPU offload for PyTorch on fused Triton kernels.

The public API; everything else in the package is private. Kernels live in ``shardfuse.kernels``.
"""

from typing import TYPE_CHECKING

from shardfuse import kernels
from shardfuse._capture import CapturedStep, capture_step
from shardfuse._graph_guard import CaptureError
from shardfuse.bucketing import PaddedBatch, bucket_length, pad_to_bucket
from shardfuse.offload import OffloadModel, checkpoint_wrapper, disable_checkpointing
from shardfuse.sharding import (
    ActivationOffload,
    FullyShardedDataParallel,
    ModuleClassWrapPolicy,
    OffloadConfig,
    OffloadOptimizer,
    ShardingStrategy,
    StepInBackward,
    TrainingState,
    UnsafeCheckpointError,
    auto_wrap,
    config_auto_wrap_policy,
    default_auto_wrap_policy,
    enable_wrap,
    no_split_modules_policy,
    offload_activations,
    set_process_hooks,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
    wrap,
)

if TYPE_CHECKING:
    from shardfuse.sharding.checkpoint._dcp_load import SafeFileSystemReader, SafeLoadPlanner

__version__ = "0.1.0"

# Names whose modules load heavy parts of torch (``torch.distributed.checkpoint``): imported on first use, so
# ``import shardfuse`` stays light (tests/test_import_light.py).
_LAZY = {"SafeFileSystemReader": "shardfuse.sharding.checkpoint._dcp_load",
         "SafeLoadPlanner": "shardfuse.sharding.checkpoint._dcp_load"}


def __getattr__(name: str) -> object:
    """Names imported on first use: ``shardfuse.plan`` (the planner) and the DCP reader and planner that load
    ``torch.distributed.checkpoint``."""
    import importlib

    if name == "plan":
        return importlib.import_module("shardfuse.plan")  # a callable module: shardfuse.plan(...) plans
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'shardfuse' has no attribute {name!r}")


__all__ = [
    "ActivationOffload",
    "CaptureError",
    "CapturedStep",
    "FullyShardedDataParallel",
    "ModuleClassWrapPolicy",
    "OffloadConfig",
    "OffloadModel",
    "OffloadOptimizer",
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "PaddedBatch",
    "ShardingStrategy",
    "StepInBackward",
    "TrainingState",
    "UnsafeCheckpointError",
    "auto_wrap",
    "bucket_length",
    "capture_step",
    "checkpoint_wrapper",
    "config_auto_wrap_policy",
    "default_auto_wrap_policy",
    "disable_checkpointing",
    "enable_wrap",
    "kernels",
    "no_split_modules_policy",
    "offload_activations",
    "plan",
    "pad_to_bucket",
    "set_process_hooks",
    "size_based_auto_wrap_policy",
    "transformer_auto_wrap_policy",
    "wrap",
]
