"""What a kernel benchmark case is. Each kernel family's ``bench_<family>.py`` returns a list of these.

A case is one kernel at one size: the shardfuse call, the PyTorch sequence(s) it replaces, and the bytes
the fewest-pass version must move (each input read once, each output written once), from which GB/s and
the share of the GPU's copy bandwidth are computed by ``bench/kernels/run.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from shardfuse.kernels import _crossover


@dataclass
class KernelCase:
    family: str  # "shard_cast", "flatten_pad", "pre_divide", "post_divide", "chunk_cat", "concat", ...
    name: str  # readable id, e.g. "fp32->bf16 n=67108864"
    numel: int  # elements processed (output elements)
    bytes_moved: int  # minimum bytes read + written
    shardfuse: Callable[[], object]  # runs the shardfuse kernel once (buffers preallocated)
    baselines: dict[str, Callable[[], object]] = field(default_factory=dict)  # PyTorch sequences replaced
    num_tensors: int = 1  # for multi-tensor forms


def forced(module: ModuleType, name: str, value: Any, fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` run with ``module.name`` set to ``value`` (a dispatch threshold): times the path the library
    did not pick, for the crossover cases."""

    def run() -> object:
        old = getattr(module, name)
        setattr(module, name, value)
        try:
            return fn()
        finally:
            setattr(module, name, old)

    return run


# Baseline labels of a forced path of a dispatching entry point (not a PyTorch sequence it replaces): the kernel
# whatever the crossover says, and the PyTorch sequence as the entry point runs it.
TRITON_PATH = "triton path"
TORCH_PATH = "torch path"
FORCED_PATHS = (TRITON_PATH, TORCH_PATH)


def forced_path(
    mode: str, families: Sequence[str], fn: Callable[[], object], *counts: tuple[ModuleType, str, Any]
) -> Callable[[], object]:
    """``fn`` with the size crossover of ``families`` forced to ``mode`` ("triton" or "torch") and the count
    thresholds ``(module, name, value)`` set: one path of a dispatching entry point, whatever it would pick."""

    def run() -> object:
        with _crossover.override(dict.fromkeys(families, mode)):
            return fn()

    for module, name, value in counts:
        run = forced(module, name, value, run)
    return run
