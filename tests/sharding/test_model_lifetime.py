"""A wrapped model is freed once its last user lets go of it: nothing the wrapper installs (autograd hooks on the
full buffers, optimizer hooks, capture_step) keeps it alive (2 gloo ranks)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from shardfuse import FullyShardedDataParallel as FSDP
from shardfuse import capture_step

WORLD = 2


def _train(mode: str) -> tuple[weakref.ref, weakref.ref, weakref.ref]:
    net = nn.Sequential(FSDP(nn.Linear(8, 8)), nn.ReLU(), FSDP(nn.Linear(8, 2)))
    model = FSDP(net, use_orig_params=mode == "orig")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(x: torch.Tensor) -> torch.Tensor:
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    x = torch.randn(3, 8)
    if mode == "capture":
        capture_step(step, x, warmup=2)(x)
    else:
        step(x)
        step(x)
    model.state_dict()
    with model.summon_full_params():
        pass
    return weakref.ref(net), weakref.ref(model), weakref.ref(opt)


def check_freed(mode: str) -> list[bool]:
    refs = _train(mode)
    gc.collect()
    return [r() is None for r in refs]


@pytest.mark.parametrize("mode", ["train", "orig", "capture"])
def test_model_is_freed_after_training(pool, mode):
    assert pool.run(check_freed, mode) == [[True, True, True]] * WORLD
