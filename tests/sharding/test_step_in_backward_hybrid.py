"""StepInBackward under hybrid sharding (a 2x2 mesh, 4 gloo ranks) against stepping AdamW after backward, bit for
bit: plain steps, ``no_sync`` micro-steps, and ``set_requires_all_reduce(False)`` micro-steps whose held shard sums
the last one all-reduces, with a unit that runs only in the first micro-step (its held sum is flushed at the end of
backward, ``_grad_reduce.flush_unsynced``, and stepped there)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from shardfuse import FullyShardedDataParallel as FSDP
from shardfuse import StepInBackward
from shardfuse.sharding.core import _runtime
from tests.sharding import _models
from tests.sharding._models import batch, loss_fn

STEPS, MICRO = 3, 2


def _train(accumulate: str, in_backward: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    rank, ws = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    net = _models.build({"extra": True})
    for i in range(len(net.blocks)):
        net.blocks[i] = FSDP(net.blocks[i], device_mesh=mesh)
    net.extra = FSDP(net.extra, device_mesh=mesh)
    model = FSDP(net, device_mesh=mesh)
    opt: Any = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    if in_backward:
        opt = StepInBackward(model, opt)
    micro = 1 if accumulate == "none" else MICRO
    losses = []
    for step in range(STEPS):
        for m in range(micro):
            last = m == micro - 1
            if accumulate == "all_reduce":
                model.set_requires_all_reduce(last)
            ids, target = batch(step * micro + m, rank, ws)
            # the extra block runs in even micro-steps only: under all_reduce its sum is held, then flushed
            cfg = {"extra": True}
            if accumulate == "no_sync" and not last:
                with model.no_sync():
                    loss = loss_fn(model, ids, target, step * micro + m, cfg)
                    loss.backward()
            else:
                loss = loss_fn(model, ids, target, step * micro + m, cfg)
                loss.backward()
            losses.append(loss.item())
        if in_backward:
            assert all(p.grad is None for p in model.parameters() if p.requires_grad)
        opt.step()
        opt.zero_grad()
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


def check_same_as_plain(accumulate: str) -> bool:
    flushed: list[bool] = []  # per flush of a held sum: whether a StepInBackward took the gradient there
    real = _runtime.flush_unsynced

    def spy(handle: Any, *args: Any) -> None:
        held = handle.unsynced_grad is not None
        real(handle, *args)
        if held:
            flushed.append(handle.grad_consumer is not None and handle.flat.grad is None)

    _runtime.flush_unsynced = spy  # type: ignore[assignment]
    try:
        losses, params = _train(accumulate, True)
    finally:
        _runtime.flush_unsynced = real  # type: ignore[assignment]
    assert any(flushed) == (accumulate == "all_reduce"), flushed
    ref_losses, ref_params = _train(accumulate, False)
    assert losses == ref_losses, (losses, ref_losses)
    for k, v in ref_params.items():
        assert torch.equal(params[k], v), k
    return True


@pytest.mark.parametrize("accumulate", ["none", "no_sync", "all_reduce"])
def test_step_in_backward_under_hybrid_sharding(pool4, accumulate):
    assert pool4.run(check_same_as_plain, accumulate) == [True] * 4
