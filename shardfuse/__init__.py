"""shardfuse: fully sharded data parallelism and layer-wise CPU offload for PyTorch on fused Triton kernels.

The public API; everything else in the package is private. Kernels live in ``shardfuse.kernels``.
"""

from shardfuse import kernels
from shardfuse._capture import CapturedStep, capture_step
from shardfuse._graph_guard import CaptureError
from shardfuse.offload import OffloadModel, checkpoint_wrapper, disable_checkpointing
from shardfuse.sharding import (
    FullyShardedDataParallel,
    ModuleClassWrapPolicy,
    OffloadConfig,
    OffloadOptimizer,
    SafeFileSystemReader,
    SafeLoadPlanner,
    ShardingStrategy,
    TrainingState,
    UnsafeCheckpointError,
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


def __getattr__(name: str) -> object:
    """``shardfuse.plan``: the planner, imported on first use (``import shardfuse`` stays as fast as before). Not in
    ``__all__`` until docs/api.md documents it (tests/test_docs.py holds every name of ``__all__`` to that)."""
    if name == "plan":
        import importlib

        return importlib.import_module("shardfuse.plan")  # a callable module: shardfuse.plan(...) plans
    raise AttributeError(f"module 'shardfuse' has no attribute {name!r}")


__all__ = [
    "CaptureError",
    "CapturedStep",
    "FullyShardedDataParallel",
    "ModuleClassWrapPolicy",
    "OffloadConfig",
    "OffloadModel",
    "OffloadOptimizer",
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "ShardingStrategy",
    "TrainingState",
    "UnsafeCheckpointError",
    "auto_wrap",
    "capture_step",
    "checkpoint_wrapper",
    "config_auto_wrap_policy",
    "default_auto_wrap_policy",
    "disable_checkpointing",
    "enable_wrap",
    "kernels",
    "no_split_modules_policy",
    "set_process_hooks",
    "size_based_auto_wrap_policy",
    "transformer_auto_wrap_policy",
    "wrap",
]
