"""Model slices of an ``OffloadModel``: partitioning, the master flat buffer, the low-precision shadow."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import nn


def partition(param_counts: Sequence[int], num_slices: int) -> list[tuple[int, int]]:
    """Cut ``len(param_counts)`` layers into ``num_slices`` contiguous, non-empty ranges of balanced weight.

    Cut ``j`` goes where the running parameter count is nearest ``j / num_slices`` of the total; ties go
    to the later cut, which keeps parameter-free layers (activations) with the layer before them. A model
    without parameters is cut by layer count.
    """
    n = len(param_counts)
    if not 1 <= num_slices <= n:
        raise ValueError(
            f"num_slices={num_slices} must be between 1 and the number of layers ({n}): every slice needs at "
            "least one layer"
        )
    weights = list(param_counts) if sum(param_counts) > 0 else [1] * n
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    total = prefix[-1]
    cuts = [0]
    for j in range(1, num_slices):
        target = total * j / num_slices
        lo, hi = cuts[-1] + 1, n - (num_slices - j)
        cuts.append(min(range(lo, hi + 1), key=lambda c: (abs(prefix[c] - target), -c)))
    cuts.append(n)
    return [(cuts[i], cuts[i + 1]) for i in range(num_slices)]


class Chain(nn.Module):
    """Layers of one slice under their original names; the first layer takes all positional arguments.

    Later layers follow ``nn.Sequential``: each receives the previous layer's output as one argument.
    """

    def __init__(self, layers: Sequence[tuple[str, nn.Module]]) -> None:
        super().__init__()
        for name, layer in layers:
            self.add_module(name, layer)

    def forward(self, *args: Any) -> Any:
        """Run the layers in order."""
        # every position, as nn.Sequential runs them (children() would skip a layer's second appearance)
        mods = iter(cast(list[nn.Module], list(self._modules.values())))
        x = next(mods)(*args)
        for m in mods:
            x = m(x)
        return x


# Each parameter starts on a 64-byte boundary of the flat buffer (16 fp32 elements). Matrix libraries pick
# their code path by pointer alignment: a weight at an unaligned offset runs a different (slower, and
# differently rounded) kernel on the CPU than the same weight in its own tensor, and cuBLAS wants 16 bytes.
_ALIGN_ELEMS = 16


def _align(numel: int) -> int:
    return -(-numel // _ALIGN_ELEMS) * _ALIGN_ELEMS


class Slice:
    """One slice: its layers, and its parameters as views into one flat master buffer on the host.

    The master buffer is pinned when the compute device is CUDA, so a whole slice crosses the bus in one
    asynchronous copy. The parameters keep their identity (``param.data`` is re-pointed into the buffer),
    so an optimizer built before wrapping still steps them.
    """

    def __init__(self, index: int, start: int, layers: Sequence[tuple[str, nn.Module]], pin: bool) -> None:
        self.index = index
        self.start = start
        self.stop = start + len(layers)
        self.chain = Chain(layers)
        named = list(self.chain.named_parameters())
        self.names = [n for n, _ in named]
        self.params: list[nn.Parameter] = [p for _, p in named]
        self.shapes = [p.shape for p in self.params]
        self.offsets: list[int] = []
        off = 0
        for p in self.params:
            self.offsets.append(off)
            off = _align(off + p.numel())
        self.numel = off
        self.trainable = any(p.requires_grad for p in self.params)
        dtype = self.params[0].dtype if self.params else torch.float32
        # zeros: the alignment gaps between parameters are copied along with the slice and must be defined
        self.flat = torch.zeros(self.numel, dtype=dtype, pin_memory=pin)
        with torch.no_grad():
            for p, o in zip(self.params, self.offsets):
                self.flat[o : o + p.numel()].copy_(p.detach().reshape(-1))
                p.data = self.flat[o : o + p.numel()].view(p.shape)
        self.shadow: torch.Tensor | None = None
        self.shadow_event: Any = None  # CUDA event: the last device->host copy into ``shadow`` has landed
        self._shadow_stamp: tuple[int, int] | None = None

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of ``flat`` shaped like the parameters (in parameter order)."""
        return [flat.narrow(0, o, s.numel()).view(s) for o, s in zip(self.offsets, self.shapes)]

    def stamp(self) -> tuple[int, int]:
        """Changes whenever a parameter or the master buffer is written in place (optimizer step, load)."""
        return (sum(p._version for p in self.params), self.flat._version)

    def make_shadow(self, dtype: torch.dtype, pin: bool) -> None:
        """Allocate the host copy in the compute dtype (what crosses the bus in a low-precision forward)."""
        self.shadow = torch.empty(self.numel, dtype=dtype, pin_memory=pin)
        self._shadow_stamp = None

    def lp_shadow(self) -> torch.Tensor:
        """The host copy in the compute dtype (only a low-precision OffloadModel has one)."""
        if self.shadow is None:
            raise RuntimeError(
                f"shardfuse.offload internal error: slice {self.index} has no compute-dtype shadow, which only "
                "exists with a compute_dtype other than the parameters' dtype; please report this"
            )
        return self.shadow

    def shadow_fresh(self) -> bool:
        """True when the low-precision shadow matches the master parameters."""
        return self._shadow_stamp is not None and self._shadow_stamp == self.stamp()

    def mark_shadow_fresh(self) -> None:
        """Record that the shadow now matches the master (call right after issuing the copy into it)."""
        self._shadow_stamp = self.stamp()
