"""``torch.nn.utils.clip_grad_norm_`` over a shardfuse model's parameters (what Hugging Face's Trainer and
accelerate call) gives the global norm and clips like the unsharded model (2 gloo ranks)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardfuse import FullyShardedDataParallel as FSDP

WORLD = 2


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 13), nn.Tanh(), nn.Linear(13, 7), nn.Tanh(), nn.Linear(7, 3))


def _wrap(net: nn.Module, orig: bool) -> FSDP:
    net[2] = FSDP(net[2], use_orig_params=orig)
    return FSDP(net, use_orig_params=orig)


def check_clip(orig: bool, norm_type: float) -> bool:
    torch.manual_seed(0)
    ref = _net()
    model = _wrap(copy.deepcopy(ref), orig)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4 * WORLD, 5, generator=g)
    mine = x[dist.get_rank() * 4:(dist.get_rank() + 1) * 4]
    (50 * model(mine)).square().mean().backward()
    (50 * ref(x)).square().mean().backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5, norm_type)
    got = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5, norm_type)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert want > 0.5  # it clipped
    # After clipping, the global norm of the shards is max_norm, as the unsharded model's is.
    with torch.no_grad():
        local = [p.grad for p in model.parameters() if p.grad is not None and p.grad.numel()]
        got_norm = torch.nn.utils.get_total_norm(local, norm_type) if local else torch.zeros(())
        total = torch.tensor([got_norm.item() ** (1 if norm_type == float("inf") else norm_type)])
        dist.all_reduce(total, op=dist.ReduceOp.MAX if norm_type == float("inf") else dist.ReduceOp.SUM)
        after = total.item() if norm_type == float("inf") else total.item() ** (1 / norm_type)
    assert after == pytest.approx(0.5, rel=1e-4), after
    assert torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()], norm_type).item() == \
        pytest.approx(0.5, rel=1e-4)
    # The same as the wrapper's own method.
    model.zero_grad()
    (50 * model(mine)).square().mean().backward()
    torch.testing.assert_close(model.clip_grad_norm_(1e9, norm_type), want, rtol=1e-5, atol=1e-6)
    return True


def check_replicated_and_errors() -> bool:
    torch.manual_seed(0)
    model = _wrap(_net(), orig=False)
    extra = nn.Parameter(torch.ones(3))  # not sharded: the same on every rank, counted once
    model(torch.randn(2, 5)).sum().backward()
    extra.grad = torch.full((3,), 2.0)
    sharded_sq = torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1e9) ** 2
    total = torch.nn.utils.clip_grad_norm_([*model.parameters(), extra], 1e9)
    torch.testing.assert_close(total ** 2, sharded_sq + 12.0, rtol=1e-5, atol=1e-5)
    # The inf norm: the largest over the shards of every rank and the replicated gradient, here the latter.
    sharded_max = torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1e9, norm_type=float("inf"))
    extra.grad = torch.full((3,), 2.0 * sharded_max.item() + 1.0)
    total = torch.nn.utils.clip_grad_norm_([*model.parameters(), extra], 1e9, norm_type=float("inf"))
    assert total.item() == extra.grad[0].item(), (total, sharded_max)
    extra.grad = torch.full((3,), 0.5 * sharded_max.item())  # and here the shards' (of one rank or another)
    assert torch.nn.utils.clip_grad_norm_([*model.parameters(), extra], 1e9, norm_type=float("inf")) == sharded_max
    for p in model.parameters():
        if p.grad is not None:
            p.grad.fill_(float("nan"))
    with pytest.raises(RuntimeError, match="is non-finite, so it cannot be clipped"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
    other = FSDP(nn.Linear(3, 3), process_group=dist.new_group())
    other(torch.randn(2, 3)).sum().backward()
    model.zero_grad()
    model(torch.randn(2, 5)).sum().backward()
    with pytest.raises(RuntimeError, match="in 2 different process groups"):
        torch.nn.utils.clip_grad_norm_([*model.parameters(), *other.parameters()], 1.0)
    # Plain tensors: torch's own function, unchanged.
    plain = nn.Parameter(torch.ones(4))
    plain.grad = torch.full((4,), 3.0)
    assert torch.nn.utils.clip_grad_norm_([plain], 1.0).item() == pytest.approx(6.0)
    return True


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")], ids=["l2", "l1", "inf"])
@pytest.mark.parametrize("orig", [False, True], ids=["flat", "orig_params"])
def test_torch_clip_grad_norm_is_global(pool, orig, norm_type):
    assert pool.run(check_clip, orig, norm_type) == [True] * WORLD


def test_replicated_parameters_and_errors(pool):
    assert pool.run(check_replicated_and_errors) == [True] * WORLD
