"""What is planned: the training run (:class:`Workload`) and one way to run it (:class:`Setup`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["OPTIMIZERS", "SETUP_KINDS", "Setup", "Workload", "state_bytes"]

OPTIMIZERS = ("adamw", "sgd")
# plain: one GPU without shardfuse (autocast, a reference line); sharded: FullyShardedDataParallel, everything on
# the GPUs; offload: move_params_to_cpu + OffloadOptimizer; ssd: the same with OffloadConfig(ssd_offload).
SETUP_KINDS = ("plain", "sharded", "offload", "ssd")


def state_bytes(optimizer: str) -> int:
    """Per-parameter optimizer state: AdamW's two fp32 moments, SGD's momentum (OffloadOptimizer's accounting)."""
    return {"adamw": 8, "sgd": 4}[optimizer]


@dataclass(frozen=True)
class Workload:
    """Tokens per GPU per optimizer step, in ``micro_batches`` forward/backward passes of sequences of ``seq``."""

    tokens: int
    seq: int
    micro_batches: int = 1
    optimizer: str = "adamw"
    optimizer_impl: str = "fused"  # "fused" (torch's fused kernel, what the planner's code uses) or "foreach"
    clip: bool = True  # clip by the global norm (OffloadOptimizer cannot then step during backward)

    def __post_init__(self) -> None:
        for name in ("tokens", "seq", "micro_batches"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}: "
                                 + ("tokens per GPU per optimizer step (batch x sequence length)"
                                    if name == "tokens" else "a positive count"))  # fmt: skip
        if self.tokens % self.micro_batches:
            raise ValueError(f"tokens={self.tokens} does not split into micro_batches={self.micro_batches} equal "
                             f"micro-batches: pick tokens divisible by the micro-batch count")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer {self.optimizer!r} is not modelled: choose one of {OPTIMIZERS} "
                             f"(OffloadOptimizer steps Adam/AdamW/SGD)")
        if self.optimizer_impl not in ("fused", "foreach"):
            raise ValueError(f"optimizer_impl must be 'fused' or 'foreach', got {self.optimizer_impl!r}")

    @property
    def micro_tokens(self) -> int:
        return self.tokens // self.micro_batches


@dataclass(frozen=True)
class Setup:
    """One way to run the workload; ``shard`` ranks hold one copy of the model, ``replicas`` copies exist."""

    name: str
    kind: str  # one of SETUP_KINDS
    shard: int = 1
    replicas: int = 1
    checkpointing: bool = False  # activation checkpointing of every block
    resident_params: int = 0  # offload/ssd: parameters kept on the GPU by the budget (whole units, root first)
    gpu_budget_gib: float = 0.0  # offload/ssd: OffloadOptimizer's gpu_budget_gib (0: offload everything)
    step_in_backward: bool = False
    host_compute_copy: bool = False
    reshard_after_forward: bool = True
    accumulate_on_gpu: bool = False
    inter_node: bool = False  # the shard ring crosses nodes (flat sharding over several nodes)
    ranks_per_node: int = 1  # ranks sharing one host (its memory, cores and disk)

    def __post_init__(self) -> None:
        if self.kind not in SETUP_KINDS:
            raise ValueError(f"setup kind {self.kind!r} unknown: one of {SETUP_KINDS}")
        if self.shard < 1 or self.replicas < 1 or self.ranks_per_node < 1:
            raise ValueError(f"shard={self.shard} replicas={self.replicas} ranks_per_node={self.ranks_per_node}: "
                             f"each must be >= 1")
        if not math.isfinite(self.gpu_budget_gib) or self.gpu_budget_gib < 0:
            raise ValueError(f"gpu_budget_gib must be >= 0, got {self.gpu_budget_gib!r}")

    @property
    def offloaded(self) -> bool:
        return self.kind in ("offload", "ssd")

    @property
    def world(self) -> int:
        return self.shard * self.replicas
