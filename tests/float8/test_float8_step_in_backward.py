"""StepInBackward with shardfuse's float8 all-gather (docs/recipes.md, "Train with float8 matmuls"), 2 gloo ranks
on CPU: each unit's shard is updated during backward, so the next forward's scale refresh must find every changed
float8 shard; losses and parameters equal stepping AdamW after backward, bit for bit, in fp32 and under bf16 mixed
precision, with the float8 gather and the compute-dtype one."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("torchao.float8", reason="float8 training needs torchao")

from shardfuse import StepInBackward  # noqa: E402
from tests.float8.test_float8_all_gather import build  # noqa: E402
from tests.float8.test_float8_training import batch, loss_of, wrap  # noqa: E402

WORLD = 2
STEPS = 4


def _train(in_backward: bool, gather: bool, kw: dict[str, Any]) -> tuple[list[float], dict[str, torch.Tensor]]:
    rank = dist.get_rank()
    model = wrap(build(gather), **kw)
    opt: Any = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    if in_backward:
        opt = StepInBackward(model, opt)
    losses = []
    for step in range(STEPS):
        loss = loss_of(model, *batch(step, rank, "cpu"))
        loss.backward()
        if in_backward:
            assert all(p.grad is None for p in model.parameters())  # every unit was updated in backward
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


def check_same_as_plain(gather: bool, kw: dict[str, Any]) -> bool:
    losses, params = _train(True, gather, kw)
    ref_losses, ref_params = _train(False, gather, kw)
    assert losses == ref_losses, (losses, ref_losses)
    assert params.keys() == ref_params.keys()
    for k, v in ref_params.items():
        assert torch.equal(params[k], v), k
    return True


@pytest.mark.parametrize("gather", [True, False], ids=["float8-gather", "compute-dtype-gather"])
@pytest.mark.parametrize("kw", [{}, {"mixed_precision": True, "compute_dtype": torch.bfloat16}], ids=["fp32", "bf16"])
def test_step_in_backward_with_float8(pool, gather, kw):
    assert pool.run(check_same_as_plain, gather, kw) == [True] * WORLD
