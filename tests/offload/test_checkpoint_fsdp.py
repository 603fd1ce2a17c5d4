"""checkpoint_wrapper composed with shardfuse's FullyShardedDataParallel, in a 2-process gloo group.

Both orders: ``FSDP(checkpoint_wrapper(block))`` (FairScale's recommended one: the recompute runs inside the
unit, after its pre-backward hook gathered the full parameters) and ``checkpoint_wrapper(FSDP(block))`` (the
recompute goes through the unit's forward, which gathers them). The blocks have no dropout and the recompute
repeats the same fp32 ops, so losses and parameters equal the unsharded reference exactly (the reference
combines per-rank gradients the way the sharded path does, see ``tests/sharding/_models.py``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardfuse.offload import checkpoint_wrapper
from tests.sharding import _models as M

WORLD = 2
STEPS = 3


def check_checkpointed_fsdp(cfg: dict[str, Any], offload_to_cpu: bool, fsdp_outside: bool) -> int:
    rank, ws = dist.get_rank(), dist.get_world_size()
    calls = [0]
    block_forward = M.Block.forward

    def counting_forward(self, x):
        calls[0] += 1
        return block_forward(self, x)

    M.Block.forward = counting_forward
    try:
        model = M.build(cfg)
        if fsdp_outside:  # FSDP(checkpoint_wrapper(block)), FairScale's recommended order
            for i in range(len(model.blocks)):
                checkpoint_wrapper(model.blocks[i], offload_to_cpu=offload_to_cpu)
            model = M.wrap_model(model, cfg)
        else:  # checkpoint_wrapper(FSDP(block)): the recompute goes through the unit's forward
            model = M.wrap_model(model, cfg)
            for i in range(len(model.module.blocks)):
                checkpoint_wrapper(model.module.blocks[i], offload_to_cpu=offload_to_cpu)
        opt = M.make_optim(model.parameters(), cfg)
        losses = []
        for step in range(STEPS):
            opt.zero_grad(set_to_none=True)
            ids, target = M.batch(step, rank, ws)
            loss = M.loss_fn(model, ids, target, step, cfg)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        recompute_calls = calls[0]
    finally:
        M.Block.forward = block_forward
    ref, ref_losses = M.reference_train(cfg, ws, STEPS)[:2]
    for step in range(STEPS):
        assert losses[step] == ref_losses[step][rank], f"step {step}: {losses[step]} vs {ref_losses[step][rank]}"
    sd, ref_sd = model.state_dict(), ref.state_dict()
    assert list(sd) == list(ref_sd)
    for k, v in ref_sd.items():
        assert torch.equal(sd[k], v), f"{k}: max diff {(sd[k] - v).abs().max()}"
    return recompute_calls


@pytest.mark.parametrize("fsdp_outside", [True, False], ids=["fsdp-of-ckpt", "ckpt-of-fsdp"])
@pytest.mark.parametrize("offload_to_cpu", [False, True], ids=["on-device", "offload-to-cpu"])
@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "keep-full"])
def test_checkpoint_wrapper_with_fsdp(pool, offload_to_cpu, reshard, fsdp_outside):
    cfg = {"optim": "sgd", "reshard_after_forward": reshard}
    calls = pool.run(check_checkpointed_fsdp, cfg, offload_to_cpu, fsdp_outside)
    # 2 blocks x STEPS forwards, each run twice (forward + recompute in backward)
    assert calls == [2 * STEPS * 2] * WORLD
