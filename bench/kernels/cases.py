"""What a kernel benchmark case is. Each kernel family's ``bench_<family>.py`` returns a list of these.

A case is one kernel at one size: the shardfuse call, the PyTorch sequence(s) it replaces, and the bytes
the fewest-pass version must move (each input read once, each output written once), from which GB/s and
the share of the GPU's copy bandwidth are computed by ``bench/kernels/run.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
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


# Baseline labels of a forced path of a dispatching entry point (not a PyTorch sequence it replaces): the kernel
# whatever the crossover says, and the PyTorch sequence as the entry point runs it.
TRITON_PATH = "triton path"
TORCH_PATH = "torch path"
FORCED_PATHS = (TRITON_PATH, TORCH_PATH)


class ForcedPath:
    """``fn`` with the size crossover of ``families`` forced to ``mode`` ("triton" or "torch") and the count thresholds
    ``(module, name, value)`` set: one path of a dispatching entry point, whatever it would pick.

    Calling it forces the path around that one call (correct anywhere). A timer takes ``with path.forcing():``
    around its whole timing of ``path.fn`` instead (``bench.kernels.run.interleaved_ms``): entering the overrides
    costs host time of its own (some 5-15 us on a slow host), which a per-call forcing would add to every timed call
    of a host-bound case, and only to the forced path's, not to the entry point's or PyTorch's."""

    def __init__(self, mode: str, families: Sequence[str], fn: Callable[[], object],
                 counts: Sequence[tuple[ModuleType, str, Any]] = ()) -> None:
        self.mode, self.families, self.fn, self.counts = mode, tuple(families), fn, tuple(counts)

    @contextlib.contextmanager
    def forcing(self) -> Iterator[None]:
        saved = [(module, name, getattr(module, name)) for module, name, _ in self.counts]
        try:
            for module, name, value in self.counts:
                setattr(module, name, value)
            with _crossover.override(dict.fromkeys(self.families, self.mode)):
                yield
        finally:
            for module, name, value in saved:
                setattr(module, name, value)

    def __call__(self) -> object:
        with self.forcing():
            return self.fn()


def forced_path(
    mode: str, families: Sequence[str], fn: Callable[[], object], *counts: tuple[ModuleType, str, Any]
) -> ForcedPath:
    """:class:`ForcedPath` of ``fn`` (``counts``: the count thresholds to set, ``(module, name, value)``)."""
    return ForcedPath(mode, families, fn, counts)
