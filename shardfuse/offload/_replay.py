"""Replaying a block's forward in backward exactly: RNG state, autocast state, and norm statistics left alone.

Used by the recompute of ``checkpoint_activation`` / ``checkpoint_wrapper``: the recomputed forward draws the
same random numbers (CPU and CUDA generators restored), casts the same way (autocast re-entered) and does not
update normalisation running statistics a second time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm, _NormBase


class RngState:
    """CPU generator state plus the CUDA generator states of some devices, captured at one moment."""

    __slots__ = ("cpu", "cuda")

    def __init__(self, cpu: torch.Tensor, cuda: dict[int, torch.Tensor]) -> None:
        self.cpu = cpu
        self.cuda = cuda

    @classmethod
    def capture(cls, cuda_devices: Sequence[int]) -> RngState:
        """Snapshot the CPU generator and the CUDA generators of ``cuda_devices``."""
        return cls(torch.get_rng_state(), {d: torch.cuda.get_rng_state(d) for d in cuda_devices})

    def restore(self) -> None:
        """Put the generators back into this state."""
        torch.set_rng_state(self.cpu)
        for dev, state in self.cuda.items():
            torch.cuda.set_rng_state(state, dev)


@contextlib.contextmanager
def rng_replay(state: RngState) -> Iterator[None]:
    """Run a block with the RNG as it was in ``state``, then restore the RNG as it is now.

    The restore keeps the caller's random stream untouched by the recompute, so a checkpointed model draws
    the same random numbers in later steps as the plain model does.
    """
    now = RngState.capture(list(state.cuda))
    state.restore()
    try:
        yield
    finally:
        now.restore()


def _autocast_devices() -> list[str]:
    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


def capture_autocast() -> list[tuple[str, bool, torch.dtype]]:
    """The autocast state of the forward, so that the recompute in backward casts exactly the same way."""
    return [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _autocast_devices()]


@contextlib.contextmanager
def autocast_replay(state: list[tuple[str, bool, torch.dtype]]) -> Iterator[None]:
    """Re-enter the autocast state captured by :func:`capture_autocast`."""
    with contextlib.ExitStack() as stack:
        for dev, enabled, dtype in state:
            stack.enter_context(torch.autocast(dev, dtype=dtype, enabled=enabled))
        yield


_STAT_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")


@contextlib.contextmanager
def running_stats_frozen(module: nn.Module | None) -> Iterator[None]:
    """Keep a recompute from updating the running statistics of ``module``'s norm layers a second time.

    The forward already updated them once, as the plain module does. Batch norm stops tracking for the
    recompute (in training it normalises by the batch statistics either way, so the output is the same);
    other norm layers with running statistics (instance norm) update clones, which are dropped.
    """
    toggled: list[_BatchNorm] = []
    swapped: list[tuple[nn.Module, str, torch.Tensor, torch.Tensor]] = []
    for m in module.modules() if module is not None else ():
        if not (isinstance(m, _NormBase) and m.training and m.track_running_stats):
            continue
        if isinstance(m, _BatchNorm):
            m.track_running_stats = False
            toggled.append(m)
            continue
        for name in _STAT_BUFFERS:
            buf = m._buffers.get(name)
            if buf is not None:
                m._buffers[name] = clone = buf.clone()
                swapped.append((m, name, buf, clone))
    try:
        yield
    finally:
        for bn in toggled:
            bn.track_running_stats = True
        for m, name, buf, clone in swapped:
            if m._buffers.get(name) is clone:  # unless the forward re-assigned it on purpose
                m._buffers[name] = buf


def cuda_devices_of(tensors: Sequence[torch.Tensor], extra: torch.device | None = None) -> list[int]:
    """CUDA device indices whose RNG a block may use: those of its tensors, plus ``extra``."""
    devs = {t.device.index for t in tensors if t.is_cuda}
    if extra is not None and extra.type == "cuda":
        devs.add(extra.index if extra.index is not None else torch.cuda.current_device())
    return sorted(d for d in devs if d is not None)
