"""Ranks that disagree, and bad input at wrap or load time: clear errors, never a silent mix (2 gloo ranks)."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardfuse import FullyShardedDataParallel as FSDP

WORLD = 2


def _net() -> nn.Sequential:
    return nn.Sequential(nn.Linear(6, 11), nn.Tanh(), nn.Sequential(nn.Linear(11, 5), nn.Tanh()), nn.Linear(5, 3))


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _rank0_build(net: nn.Module) -> dict:
    both: list = [None, None]
    dist.all_gather_object(both, {k: v.clone() for k, v in net.state_dict().items()})
    return both[0]


def check_different_seeds_get_rank0_values() -> bool:
    torch.manual_seed(100 + dist.get_rank())  # a per-rank seed: the classic mistake
    net = _net()
    want = _rank0_build(net)
    assert dist.get_rank() == 0 or any(not torch.equal(v, want[k]) for k, v in net.state_dict().items())
    ref = _net()
    ref.load_state_dict(want)
    records = _Records()
    logging.getLogger("shardfuse").addHandler(records)
    try:
        model = FSDP(net)
    finally:
        logging.getLogger("shardfuse").removeHandler(records)
    # Not a mix of both inits: rank 0's model on every rank, with a warning (rank 0 logs it) naming the unit.
    for k, v in model.state_dict().items():
        assert torch.equal(v, want[k]), k
    warned = [m for m in records.messages if "different initial values" in m]
    if dist.get_rank() == 0:
        assert len(warned) == 1 and "FullyShardedDataParallel(Sequential)" in warned[0], records.messages
        assert "sync_module_states=True" in warned[0]
    else:
        assert warned == []
    torch.manual_seed(1)
    x = torch.randn(4, 6)
    torch.testing.assert_close(model(x), ref(x), rtol=0, atol=0)
    # Ranks that agree pay one tiny all-gather per unit and hear nothing.
    torch.manual_seed(7)
    records.messages.clear()
    logging.getLogger("shardfuse").addHandler(records)
    try:
        FSDP(_net())
    finally:
        logging.getLogger("shardfuse").removeHandler(records)
    assert records.messages == []
    return True


def check_sync_module_states() -> bool:
    torch.manual_seed(100 + dist.get_rank())
    net = _net()
    net.register_buffer("scale", torch.rand(3))
    ref = copy.deepcopy(net)
    both: list = [None, None]
    dist.all_gather_object(both, ref.state_dict())
    ref.load_state_dict(both[0])  # what rank 0 built
    model = FSDP(net, sync_module_states=True)
    for k, v in model.state_dict().items():
        assert torch.equal(v, both[0][k]), k
    torch.manual_seed(1)
    x = torch.randn(4, 6)
    out = model(x) * model.module.scale
    out.sum().backward()
    want = ref(x) * ref.scale
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    return True


def check_ranks_wrap_differently() -> bool:
    torch.manual_seed(3)
    net = _net()
    # Only rank 0 makes the inner block a unit of its own: its inner unit meets rank 1's outer unit in the
    # wrap-time check, and both ranks stop there with the sizes of what they wrapped.
    with pytest.raises(RuntimeError, match=r"ranks wrapped the model differently: FullyShardedDataParallel\((Linear|"
                                           r"Sequential)\) has 2 parameters and buffers of 60 elements on rank 0 "
                                           r"but 6 of 155 on rank 1"):
        if dist.get_rank() == 0:
            net[2] = FSDP(net[2])
        FSDP(net)
    return True


def check_wrap_errors() -> bool:
    torch.manual_seed(3)
    seq = _net()
    FSDP(seq)
    with pytest.raises(ValueError, match="already belong to an outer FullyShardedDataParallel unit.*inner modules"):
        FSDP(seq[2])
    with pytest.raises(TypeError, match="gradient_predivide_factor must be a number, got '2'"):
        FSDP(_net(), gradient_predivide_factor="2")
    return True


def check_load_state_dict_inputs() -> bool:
    torch.manual_seed(5)
    ref = _net()
    model = FSDP(copy.deepcopy(ref))
    sd = ref.state_dict()
    bad = dict(sd)
    bad["0.bias"] = sd["0.bias"].tolist()
    with pytest.raises(TypeError, match=r"state_dict\['0.bias'\] is a list, not a tensor"):
        model.load_state_dict(bad)
    # Integer values load like nn.Module.load_state_dict loads them: cast to the parameter's dtype.
    ints = {k: (v * 10).round().long() for k, v in sd.items()}
    ref.load_state_dict(ints)
    model.load_state_dict(ints)
    for k, v in model.state_dict().items():
        assert torch.equal(v, ref.state_dict()[k]), k
    return True


@pytest.mark.parametrize(
    "check",
    [check_different_seeds_get_rank0_values, check_sync_module_states, check_ranks_wrap_differently, check_wrap_errors,
     check_load_state_dict_inputs],
    ids=lambda f: f.__name__.removeprefix("check_"),
)
def test_rank_safety(pool, check):
    assert pool.run(check) == [True] * WORLD
