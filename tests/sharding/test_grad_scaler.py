"""fp16 loss scaling over sharded gradients: the skip decision must be the same on every rank.

Each rank holds only its shard of every gradient, so an overflow shows on one rank only. torch's
``ShardedGradScaler`` (``torch.distributed.fsdp.sharded_grad_scaler``; FairScale's works the same way) all-reduces
the "found inf" flag, so every rank skips the step and lowers the scale together, with and without
``OffloadOptimizer``. The plain ``torch.amp.GradScaler`` decides per rank: one rank skips the step while the other
takes it, and their scales part (what docs/api.md warns of).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from shardfuse import OffloadOptimizer
from tests.sharding._models import batch, build, loss_fn, wrap_model

WORLD = 2
FP16 = dict(mixed_precision=True, compute_dtype=torch.float16)


def check_overflow_on_one_rank(scaler_kind: str, offload: bool) -> tuple[bool, float, list[float]]:
    """Three steps with an overflow in rank 0's shard at the second: (did rank step at the overflow, the scale
    after it, the losses)."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    model = wrap_model(build(FP16), {**FP16, "move_params_to_cpu": offload})
    opt: Any = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if offload:
        opt = OffloadOptimizer(model, opt, gpu_budget_gib=0)
    kind = ShardedGradScaler if scaler_kind == "sharded" else torch.amp.GradScaler
    scaler = kind("cpu", init_scale=2.0**8)
    losses, stepped = [], False
    for step in range(3):
        ids, target = batch(step, rank, ws)
        loss = loss_fn(model, ids, target, step, FP16)
        losses.append(loss.item())
        scaler.scale(loss).backward()
        if step == 1 and rank == 0:
            grad = next(p.grad for p in model.parameters() if p.grad is not None)
            grad.view(-1)[0] = float("inf")
        scaler.unscale_(opt)
        model.clip_grad_norm_(1.0)
        before = [p.detach().clone() for p in model.parameters()]
        scaler.step(opt)
        scaler.update()
        if offload:
            opt.synchronize()
        if step == 1:
            stepped = any(not torch.equal(a, p.detach()) for a, p in zip(before, model.parameters()))
            scale = scaler.get_scale()
        opt.zero_grad()
    if offload:
        opt.close()
    return stepped, scale, losses


@pytest.mark.parametrize("offload", [False, True], ids=["resident", "offload-optimizer"])
def test_sharded_grad_scaler_skips_on_every_rank(pool, offload):
    out = pool.run(check_overflow_on_one_rank, "sharded", offload)
    assert [stepped for stepped, _, _ in out] == [False] * WORLD, "a rank stepped over an overflow"
    assert [scale for _, scale, _ in out] == [2.0**7] * WORLD, "the scale must halve on every rank"
    assert all(torch.isfinite(torch.tensor(losses)).all() for _, _, losses in out)


def test_plain_grad_scaler_decides_per_rank(pool):
    """Why docs/api.md asks for a sharded scaler: the plain one lets the ranks part."""
    (stepped0, scale0, _), (stepped1, scale1, _) = pool.run(check_overflow_on_one_rank, "torch", False)
    assert (stepped0, stepped1) == (False, True) and (scale0, scale1) == (2.0**7, 2.0**8)
