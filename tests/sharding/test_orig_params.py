"""Original parameters as views of the flat shard (``use_orig_params=True``, FairScale's ``flatten_parameters=False``),
against unsharded training of the same model (2 gloo ranks)."""

from __future__ import annotations

import copy
import shutil
import tempfile
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from shardfuse import FullyShardedDataParallel as FSDP
from shardfuse.sharding.core._registry import handle_of
from tests.sharding._models import batch, build

WORLD = 2
TOL = dict(rtol=2e-5, atol=2e-6)


def _wrap(net: nn.Module, **kw: Any) -> FSDP:
    for i in range(len(net.blocks)):
        net.blocks[i] = FSDP(net.blocks[i], **kw)
    return FSDP(net, **kw)


def _groups(named: list[tuple[str, nn.Parameter]]) -> list[dict[str, Any]]:
    """No weight decay on norms and biases, a lower learning rate for the embedding."""
    decay = [p for n, p in named if p.requires_grad and n.endswith("weight") and "norm" not in n and "embed" not in n]
    embed = [p for n, p in named if p.requires_grad and "embed" in n]
    rest = [p for n, p in named if p.requires_grad and not any(p is q for q in decay + embed)]
    return [
        {"params": decay, "weight_decay": 0.1},
        {"params": rest, "weight_decay": 0.0},
        {"params": embed, "weight_decay": 0.0, "lr": 3e-3},
    ]


def _loss(model: nn.Module, step: int, rank: int, ws: int) -> torch.Tensor:
    ids, target = batch(step, rank, ws)
    return (model(ids) - target).pow(2).mean()


def _reference_step(ref: nn.Module, opt: torch.optim.Optimizer, step: int, ws: int, accumulate: int) -> None:
    """The unsharded model sees every rank's batch; gradients averaged over ranks, as the sharded path does."""
    for _ in range(accumulate):
        for r in range(ws):
            (_loss(ref, step, r, ws) / ws).backward()


def check_orig_params(flag: str) -> bool:
    rank, ws = dist.get_rank(), dist.get_world_size()
    kw = {"use_orig_params": True} if flag == "use_orig_params" else {"flatten_parameters": False}
    ref = build({})
    model = _wrap(copy.deepcopy(ref), **kw)
    names = [n for n, _ in model.named_parameters()]
    assert names == [n for n, _ in ref.named_parameters()], names
    # Freeze one original parameter after wrapping, in both.
    dict(model.named_parameters())["blocks.1.fc2.bias"].requires_grad_(False)
    dict(ref.named_parameters())["blocks.1.fc2.bias"].requires_grad_(False)
    opt = torch.optim.AdamW(_groups(list(model.named_parameters())), lr=1e-2)
    ref_opt = torch.optim.AdamW(_groups(list(ref.named_parameters())), lr=1e-2)
    frozen_before = model.state_dict()["blocks.1.fc2.bias"].clone()
    for step in range(4):
        accumulate = 2 if step == 2 else 1  # one step accumulates two backwards (no zero_grad between)
        opt.zero_grad(set_to_none=step % 2 == 0)
        ref_opt.zero_grad(set_to_none=step % 2 == 0)
        for _ in range(accumulate):
            _loss(model, step, rank, ws).backward()
        _reference_step(ref, ref_opt, step, ws, accumulate)
        if step == 3:
            norm = model.clip_grad_norm_(0.05)
            want = torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.grad is not None], 0.05)
            torch.testing.assert_close(norm, want, **TOL)
        opt.step()
        ref_opt.step()
    sd = model.state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(sd[k], v, **TOL, msg=k)
    assert torch.equal(sd["blocks.1.fc2.bias"], frozen_before), "a frozen original parameter changed"
    # The optimizer's parameters are this rank's pieces: together the ranks hold every element once.
    total = torch.tensor(sum(p.numel() for p in model.parameters()))
    dist.all_reduce(total)
    assert total.item() == sum(p.numel() for p in ref.parameters())
    with model.summon_full_params():
        full = dict(model.named_parameters())
        assert full["head.weight"].shape == ref.head.weight.shape
    assert names == [n for n, _ in model.named_parameters()], "the views are registered again after summoning"
    # Local state dicts keep the flat shards, and load back.
    local = model.local_state_dict()
    assert "flat_param_0" in local and "blocks.0.flat_param_0" in local, sorted(local)
    model.load_local_state_dict(local)
    with pytest.raises(NotImplementedError, match="use_orig_params=True .* sharded state dict"):
        model.gather_full_optim_state_dict(opt)
    return True


@pytest.mark.parametrize("flag", ["use_orig_params", "flatten_parameters=False"])
def test_orig_params_match_unsharded_training(pool, flag):
    assert pool.run(check_orig_params, flag) == [True] * WORLD


class _TwoPath(nn.Module):
    """``b`` is a nested unit; ``skip_b`` leaves it unused in a step."""

    def __init__(self, **kw: Any) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = FSDP(nn.Linear(16, 16), **kw) if kw else nn.Linear(16, 16)
        self.c = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, skip_b: bool = False) -> torch.Tensor:
        h = torch.relu(self.a(x))
        return self.c(h if skip_b else torch.relu(self.b(h)))


def check_grads_after_zero_grad(zero: str) -> bool:
    """After a reduced step and ``zero_grad``, a no_sync micro-batch plus a synced one give the gradient of both
    batches, not that plus the previous step's (FairScale's test_transformer_no_flat_params caught this); a unit
    unused after ``zero_grad`` has no gradient, not the stale one."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = _TwoPath()
    model = FSDP(_TwoPath(use_orig_params=True), use_orig_params=True)
    model.load_state_dict(ref.state_dict())
    x = [torch.randn(5, 8, generator=torch.Generator().manual_seed(100 + i)) for i in range(2 * ws)]
    mine = x[2 * rank : 2 * rank + 2]

    def clear() -> None:
        if zero == "model":
            model.zero_grad()
        else:
            for p in model.parameters():
                p.grad = None

    model(torch.cat(mine)).sum().backward()  # a step's gradients, reduced into the shards
    clear()
    with model.no_sync():
        model(mine[0]).sum().backward()
    model(mine[1]).sum().backward()
    ref(torch.cat(x)).sum().backward()
    # This rank's pieces against the unsharded gradient averaged over ranks.
    full = {n: p.grad / ws for n, p in ref.named_parameters()}
    for n, p in model.named_parameters():
        assert p.grad is not None, n
        torch.testing.assert_close(p.grad, _my_piece(p, full[n]), **TOL, msg=n)
    clear()
    model(mine[0], skip_b=True).sum().backward()
    for n, p in model.named_parameters():
        if n.startswith("b."):
            assert p.grad is None, f"{n}: an unused unit's parameter got a stale gradient"
        else:
            assert p.grad is not None, n
    return True


def _my_piece(view: nn.Parameter, full: torch.Tensor) -> torch.Tensor:
    """This rank's piece of an original parameter's full tensor, as its sharded view holds it."""
    h = handle_of(view)
    i = next(i for i, v in enumerate(h.orig_views) if v is view)
    a, n = h.view_ranges[i]
    if n == 0:  # the rank holds none of it
        return full.reshape(-1)[:0]
    return full.reshape(-1).narrow(0, h.rank * h.shard_numel + a - sum(h.numels[:i]), n)


@pytest.mark.parametrize("zero", ["model", "set_none"])
def test_no_sync_after_zero_grad_is_not_stale(pool, zero):
    assert pool.run(check_grads_after_zero_grad, zero) == [True] * WORLD


def check_one_rank_keeps_shapes() -> bool:
    """With a one-rank group nothing is split, so the original parameters keep their shapes, as FairScale leaves
    unsharded parameters (its test_pre_backward_hook checks them); training, gradients and the sharded
    optimizer state work on them as on 1-D pieces."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    solo = [dist.new_group([r]) for r in range(ws)][rank]
    torch.manual_seed(0)
    ref = _TwoPath()
    model = FSDP(_TwoPath(process_group=solo, use_orig_params=True), process_group=solo, use_orig_params=True)
    model.load_state_dict(ref.state_dict())
    shapes = {n: p.shape for n, p in model.named_parameters()}
    assert shapes == {n: p.shape for n, p in ref.named_parameters()}, shapes
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(7))
    for step in range(3):
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad(set_to_none=step % 2 == 0)
            m(x, skip_b=step == 1).pow(2).mean().backward()
        for n, p in model.named_parameters():
            want = dict(ref.named_parameters())[n].grad
            assert (p.grad is None) == (want is None), n
            if want is not None:
                assert p.grad.shape == p.shape, n
                torch.testing.assert_close(p.grad, want, **TOL, msg=n)
        opt.step()
        ref_opt.step()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(model.state_dict()[k], v, **TOL, msg=k)
    # The sharded checkpoint layout reads and writes state of the parameters' shape.
    path = tempfile.mkdtemp(prefix=f"one-rank-{rank}-")  # each rank's group saves on its own
    dcp.save(model.sharded_state_dict(opt), checkpoint_id=path, process_group=solo)
    fresh = FSDP(_TwoPath(process_group=solo, use_orig_params=True), process_group=solo, use_orig_params=True)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    sd = fresh.sharded_state_dict(fresh_opt)
    dcp.load(sd, checkpoint_id=path, process_group=solo)
    fresh.load_sharded_state_dict(sd, fresh_opt)  # a fresh optimizer: the state comes from the checkpoint
    shutil.rmtree(path)
    for p, q in zip(model.parameters(), fresh.parameters()):
        st, fst = opt.state[p], fresh_opt.state[q]
        assert fst["exp_avg"].shape == p.shape
        torch.testing.assert_close(fst["exp_avg"], st["exp_avg"], rtol=0, atol=0)
        torch.testing.assert_close(fst["exp_avg_sq"], st["exp_avg_sq"], rtol=0, atol=0)
    return True


def test_one_rank_group_keeps_parameter_shapes(pool):
    assert pool.run(check_one_rank_keeps_shapes) == [True] * WORLD
