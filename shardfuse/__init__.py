"""shardfuse: fully sharded data parallelism and layer-wise CPU offload for PyTorch on fused Triton kernels.

The public API; everything else in the package is private. Kernels live in ``shardfuse.kernels``.
"""

from shardfuse import kernels
from shardfuse._capture import CapturedStep, capture_step
from shardfuse._graph_guard import CaptureError
from shardfuse.bucketing import PaddedBatch, bucket_length, pad_to_bucket
from shardfuse.offload import OffloadModel, checkpoint_wrapper, disable_checkpointing
from shardfuse.sharding import (
    FullyShardedDataParallel,
    ModuleClassWrapPolicy,
    OffloadConfig,
    OffloadOptimizer,
    ShardingStrategy,
    TrainingState,
    auto_wrap,
    config_auto_wrap_policy,
    default_auto_wrap_policy,
    enable_wrap,
    no_split_modules_policy,
    set_process_hooks,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
    wrap,
)

__version__ = "0.1.0"

__all__ = [
    "CaptureError",
    "CapturedStep",
    "FullyShardedDataParallel",
    "ModuleClassWrapPolicy",
    "OffloadConfig",
    "OffloadModel",
    "OffloadOptimizer",
    "PaddedBatch",
    "ShardingStrategy",
    "TrainingState",
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
    "pad_to_bucket",
    "set_process_hooks",
    "size_based_auto_wrap_policy",
    "transformer_auto_wrap_policy",
    "wrap",
]
