"""The fused gradient pre-divide (``_fused_grads.py``) on CUDA with NCCL, one GPU per rank (skipped without 2
GPUs): the reduce-scatter inputs and sharded gradients are the bytes of the concatenating path
(``FlatParamHandle.fuse_grads = False``), in eager steps through the multi-tensor launch, and a captured step
(per-gradient launches inside the graph) trains to the same bits as the eager concatenating path."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardfuse.sharding.core._flat_param import FlatParamHandle
from tests.sharding.test_fused_grads import BF16, check
from tests.test_capture import batches, build, make_step, train

pytestmark = pytest.mark.multigpu

WORLD = 2


@pytest.mark.parametrize("cfg", [{}, {**BF16, "fp32_reduce_scatter": True}, {**BF16, "fp32_reduce_scatter": False},
                                 {"unused": True, "tied": True}, {"no_sync_micro": 2, **BF16}],
                         ids=["fp32", "bf16_fp32_rs", "bf16_rs", "unused_tied", "no_sync"])
def test_fused_equals_concatenating_gpu(pool, cfg):
    check(pool, cfg, fused="no_sync_micro" not in cfg, device="cuda")


def check_captured_fused_equals_eager_old(cfg: dict[str, Any], micro: int, steps: int = 8) -> bool:
    """Captured steps on the fused path against eager steps on the concatenating path: losses and parameters."""
    dev = torch.device("cuda", torch.cuda.current_device())
    data = batches(steps + 1, micro, dev, seed=100 + dist.get_rank())
    out = []
    default = FlatParamHandle.fuse_grads
    try:
        for fused in (False, True):
            FlatParamHandle.fuse_grads = fused
            model = build(7, dev, **cfg)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, capturable=True)
            losses, _ = train(make_step(model, opt, micro), data, captured=fused)
            out.append((losses, {k: v.cpu() for k, v in model.state_dict().items()}))
    finally:
        FlatParamHandle.fuse_grads = default
    (old_losses, old_sd), (new_losses, new_sd) = out
    assert torch.equal(new_losses, old_losses), (new_losses, old_losses)
    for k, v in old_sd.items():
        assert torch.equal(new_sd[k], v), k
    return True


@pytest.mark.parametrize("micro", [1, 2], ids=["step", "accumulate2"])
@pytest.mark.parametrize("cfg", [{}, {"mixed_precision": True}], ids=["fp32", "mixed"])
def test_captured_fused_equals_eager_concatenating_gpu(pool, cfg, micro):
    assert all(pool.run(check_captured_fused_equals_eager_old, cfg, micro))
