"""Which offloaded units keep their gathered compute-dtype parameters on the GPU from forward to backward
(``OffloadOptimizer(keep_params_gib=...)``).

With ``reshard_after_forward`` an offloaded unit's shard crosses host->device twice per step: for its forward and
again for its backward. A unit marked here (``HostShard.keep_for_backward``) keeps the full buffer its forward
gathered until its backward has used it (``Unit.reshard_unless_kept``), so backward gathers nothing: the values
are the same tensor, bit for bit. It costs the unit's full buffer (compute dtype) on the GPU from its forward to
its backward, at the activation peak.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from shardfuse.sharding.host._host_shard import HostShard
from shardfuse.sharding.host._placement import usable_device_bytes

logger = logging.getLogger(__name__)

GIB = 1 << 30


def keep_room(device: torch.device, gpu_budget_gib: float | None) -> float:
    """``keep_params_gib=None``: the bytes left at the peak of the steps so far, under ``gpu_budget_gib`` where one
    other than 0 is given (less ``max_memory_allocated``), else under ``usable_device_bytes`` (less
    ``max_memory_reserved``, as the budget's own default); 0 off CUDA."""
    if device.type != "cuda":
        return 0.0
    if gpu_budget_gib:
        room = gpu_budget_gib * GIB - torch.cuda.max_memory_allocated(device)
    else:
        room = usable_device_bytes(device) - torch.cuda.max_memory_reserved(device)
    logger.info("OffloadOptimizer: %.2f GiB to keep gathered parameters from forward to backward", room / GIB)
    return max(0.0, room)


def choose_kept(rs: Any, room: float) -> list[HostShard]:
    """Mark the host shards of the root state ``rs`` (a ``RootState``) that keep their gathered parameters from
    forward to backward, and return them: from the end of the recorded forward order (the first units of
    backward), the longest run whose full buffers fit ``room`` bytes. The last unit of the forward order and units
    with ``reshard_after_forward=False`` keep theirs anyway (the runtime does): they are neither marked nor
    counted. Before the order is recorded nothing changes."""
    if rs is None or not rs.order_recorded or not rs.fwd_order:
        return []
    seen: set[int] = set()
    kept: list[HostShard] = []
    used = 0.0
    fits = True
    for unit in reversed(rs.fwd_order):
        free = unit is rs.fwd_order[-1] or not unit.reshard_after_forward
        for h in unit.gather_handles:
            host = h.host
            if id(h) in seen or type(host) is not HostShard:  # not the SSD tier's (it keeps file pages instead)
                continue
            seen.add(id(h))
            if free:
                host.keep_for_backward = False
                continue
            fits = fits and used + h.nbytes <= room
            host.keep_for_backward = fits
            if fits:
                used += h.nbytes
                kept.append(host)
    return kept
