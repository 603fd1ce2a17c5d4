"""Models built on the meta device: each unit materialises and initialises only its own parameters before it
shards them, so the model never exists whole (2 gloo ranks)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardfuse import FullyShardedDataParallel as FSDP
from tests.sharding._models import Net, batch, build

WORLD = 2


def _wrap(net: nn.Module, **kw) -> FSDP:
    for i in range(len(net.blocks)):
        net.blocks[i] = FSDP(net.blocks[i], **kw)
    return FSDP(net, **kw)


class _Peak:
    """The largest number of parameter elements on a real device at any wrap, seen from reset_parameters."""

    def __init__(self, model: nn.Module) -> None:
        self.model, self.most = model, 0

    def sample(self) -> None:
        real = sum(p.numel() for p in self.model.parameters() if not p.is_meta)
        self.most = max(self.most, real)


def check_meta_init() -> bool:
    rank, ws = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(7)  # every rank initialises the same values (checked at the first forward)
    with torch.device("meta"):
        net = Net(tied=True)
    full_numel = sum(p.numel() for p in net.parameters())
    peak = _Peak(net)
    orig_reset = nn.Linear.reset_parameters

    def counting_reset(self: nn.Linear) -> None:
        orig_reset(self)
        peak.sample()

    nn.Linear.reset_parameters = counting_reset
    try:
        model = _wrap(net)
    finally:
        nn.Linear.reset_parameters = orig_reset
    assert 0 < peak.most < full_numel, (peak.most, full_numel)
    sd = model.state_dict()
    assert not any(v.is_meta for v in sd.values())
    assert sd["head.weight"].data_ptr() != 0 and torch.equal(sd["head.weight"], sd["embed.weight"]), "tie kept"
    ids, target = batch(0, rank, ws)
    model(ids)  # the first forward's rank check passes: same values everywhere
    # A full state dict loads into the meta-built model, and training continues like the reference.
    ref = build({"tied": True})
    model.load_state_dict(ref.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(2):
        ids, target = batch(step, rank, ws)
        opt.zero_grad()
        (model(ids) - target).pow(2).mean().backward()
        opt.step()
        ref_opt.zero_grad()
        for r in range(ws):
            i, t = batch(step, r, ws)
            ((ref(i) - t).pow(2).mean() / ws).backward()
        ref_opt.step()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(model.state_dict()[k], v, rtol=1e-5, atol=1e-6, msg=k)
    return True


def check_param_init_fn() -> bool:
    with torch.device("meta"):
        net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    seen = []

    def init(module: nn.Module) -> None:
        seen.append(type(module).__name__)
        module.to_empty(device="cpu", recurse=False)
        for p in module.parameters(recurse=False):
            nn.init.constant_(p, 0.25)

    model = FSDP(net, param_init_fn=init)
    assert seen == ["Linear", "Linear"], seen  # each module of the unit that was on the meta device
    assert all(torch.all(v == 0.25) for v in model.state_dict().values())
    return True


class _NoReset(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(3))


def check_meta_errors() -> bool:
    with torch.device("meta"):
        bad = nn.Sequential(nn.Linear(2, 3), _NoReset())
    with pytest.raises(ValueError, match=r"1 \(_NoReset\) is on the meta device and has no reset_parameters\(\)"):
        FSDP(copy.deepcopy(bad))
    with torch.device("meta"):
        lazy = nn.Linear(2, 3)
    with pytest.raises(ValueError, match="still has tensors on the meta device after initialisation"):
        FSDP(lazy, param_init_fn=lambda m: None)
    return True


@pytest.mark.parametrize("check", [check_meta_init, check_param_init_fn, check_meta_errors],
                         ids=lambda f: f.__name__.removeprefix("check_"))
def test_meta_device_init(pool, check):
    assert pool.run(check) == [True] * WORLD
