"""Shared plumbing for the kernel families: dispatch, validation and pointer tables.

Every public kernel validates with these helpers so that the error messages read the same everywhere:
they name the offending value and the fix.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

# Dtypes the kernels read and write. Integer and complex tensors are rejected with a clear error.
FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)

# Elements per program for the streaming kernels: 16-byte vectors for every dtype, several in flight.
BLOCK_SIZE = 4096


def interpreting() -> bool:
    """True when Triton's CPU interpreter is asked for (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(*tensors: torch.Tensor) -> bool:
    """Pick the Triton path: always on CUDA tensors, on CPU tensors only under the interpreter."""
    if all(t.is_cuda for t in tensors):
        return True
    return interpreting() and all(t.device.type == "cpu" for t in tensors)


def check_float(t: torch.Tensor, name: str) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{name} has unsupported dtype {t.dtype}; shardfuse kernels take {list(FLOAT_DTYPES)}: "
            f"cast it first (e.g. {name}.float())"
        )


def check_same_device(tensors: Sequence[torch.Tensor], names: Sequence[str]) -> torch.device:
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        where = ", ".join(f"{n}={t.device}" for n, t in zip(names, tensors))
        raise ValueError(f"all tensors must be on one device, got {where}: move them with .to(device) first")
    return tensors[0].device


def check_out(out: torch.Tensor, numel: int, name: str = "out") -> None:
    """``out`` must be contiguous and hold at least ``numel`` elements."""
    check_float(out, name)
    if not out.is_contiguous():
        raise ValueError(
            f"{name} must be contiguous (got shape={tuple(out.shape)} stride={out.stride()}): "
            f"pass a contiguous buffer or {name}.contiguous()"
        )
    if out.numel() < numel:
        raise ValueError(f"{name} is too small: {name}.numel()={out.numel()} < required {numel}")


def pointer_table(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """An int64 tensor of data pointers on ``device``, for multi-tensor kernels.

    Built in pinned memory and copied without a host sync on CUDA, so one launch can address any number
    of tensors.
    """
    return int64_table([t.data_ptr() for t in tensors], device)


def int64_table(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """A small int64 metadata table on ``device``, copied from pinned memory without a host sync."""
    host = torch.tensor(list(values), dtype=torch.int64)
    if device.type != "cuda":
        return host
    # Pinned memory lets the copy run asynchronously; the caching host allocator keeps the pinned block
    # alive until the copy on the current stream has finished.
    return host.pin_memory().to(device, non_blocking=True)
