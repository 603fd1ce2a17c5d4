"""The GPU budget of ``OffloadOptimizer``: which units stay resident on the GPU, and moving one there.

``choose_resident`` picks units from the start of the forward order while their parameters, gradients and
optimizer state fit the budget; ``make_resident`` moves a host shard, its gradient and its state to the device,
where the user's optimizer steps it from then on.
"""

from __future__ import annotations

import torch

from shardfuse.sharding.core._devices import compute_device
from shardfuse.sharding.core._flat_param import FlatParamHandle
from shardfuse.sharding.core._runtime import Unit
from shardfuse.sharding.host import _backing

# Of what the process may allocate on the GPU, the share the default budget takes (allocator slack left).
GPU_USABLE = 0.92


def budget_applies(root: Unit, gpu_budget_gib: float | None) -> bool:
    """Whether the first step() may keep units resident: a CUDA compute device and a budget other than 0. The
    compute device is settled at the first forward (lazy init): before it, the one it will be."""
    device = root.compute_device if root.root_state is not None else compute_device(root.config, None, None)
    return device.type == "cuda" and gpu_budget_gib != 0


def usable_device_bytes(device: torch.device) -> float:
    """What the default budget (``gpu_budget_gib=None``) may fill on ``device``: ``GPU_USABLE`` of the device's
    memory, under the cap ``torch.cuda.set_per_process_memory_fraction`` set for this process (a GPU shared with
    other processes), so the default never plans for memory the allocator would refuse."""
    total = torch.cuda.get_device_properties(device).total_memory
    get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # torch >= 2.8
    fraction = get_fraction(device) if get_fraction is not None else 1.0
    return GPU_USABLE * total * min(1.0, fraction)


def state_bytes_per_element(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of per-element optimizer state per fp32 parameter element (for the residency budget)."""
    group = optimizer.param_groups[0]
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return 12 if group.get("amsgrad") else 8
    return 4 if group.get("momentum", 0) else 0


def choose_resident(sizes: list[int], budget_bytes: float, bytes_per_element: int) -> int:
    """How many handles, counted from the START of the forward order, stay resident on the GPU within
    ``budget_bytes``. The first units run first in the next forward: kept resident (stepped on the GPU at once),
    their forward runs while the host still updates the later, offloaded ones, which are also the first whose
    gradients land in backward (the host has the most time for them)."""
    used = 0.0
    count = 0
    for numel in sizes:
        cost = numel * bytes_per_element
        if used + cost > budget_bytes:
            break
        used += cost
        count += 1
    return count


def make_resident(handle: FlatParamHandle, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Move a host shard, its gradient and its optimizer state to ``device``; it is stepped there from now on."""
    _backing.leave(handle)  # ssd: read in for good (its files go)
    flat = handle.flat
    flat.data = flat.data.to(device)
    if flat.grad is not None:
        flat.grad = flat.grad.to(device)
    state = optimizer.state.get(flat)
    if state:
        for k, v in list(state.items()):
            if isinstance(v, torch.Tensor) and (v.dim() or any(g.get("fused") or g.get("capturable")
                                                               for g in optimizer.param_groups)):
                state[k] = v.to(device)
    handle.host = None
