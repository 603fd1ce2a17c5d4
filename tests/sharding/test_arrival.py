"""A rank that never arrives at a collective entry point: the ranks that did raise, naming the call, within the
timeout (``SHARDFUSE_COLLECTIVE_TIMEOUT_S``) instead of hanging until the process group's timeout (2 gloo ranks).
Afterwards the group still works and the same call, made on every rank, returns the right values."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardfuse import FullyShardedDataParallel as FSDP
from shardfuse.sharding.core._arrival import ENV_TIMEOUT, arrive, collective_timeout_s

WORLD = 2
TIMEOUT_S = 3


def _net() -> nn.Sequential:
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 3))


def _model() -> FSDP:
    net = _net()
    net[2] = FSDP(net[2])
    model = FSDP(net)
    model(torch.randn(2, 7)).sum().backward()  # lazy init done, as after training
    return model


def _state_dict(model: FSDP) -> Any:
    return model.state_dict()


def _summon(model: FSDP) -> Any:
    with model.summon_full_params():
        return [p.detach().clone() for p in model.parameters()]


CALLS: dict[str, Callable[[FSDP], Any]] = {"state_dict": _state_dict, "summon_full_params": _summon}


def check_missing_rank(call: str, other: str | None) -> float:
    """Rank 0 makes ``call``; rank 1 makes ``other`` instead (or nothing) and goes on to a barrier."""
    os.environ[ENV_TIMEOUT] = str(TIMEOUT_S)
    try:
        model = _model()
        mine = call if dist.get_rank() == 0 else other
        elapsed = 0.0
        if mine is not None:
            start = time.monotonic()
            want = (rf"^{mine}\(\) was called on rank {dist.get_rank()}, but only 1 of the 2 ranks of its process "
                    rf"group called it within {TIMEOUT_S} s.*every rank must call it.*{ENV_TIMEOUT}")
            with pytest.raises(RuntimeError, match=want):
                CALLS[mine](model)
            elapsed = time.monotonic() - start
        dist.barrier()  # the group still works
        # Made on every rank, the calls go through again, with the right values.
        want = _net().state_dict()
        got = model.state_dict()
        assert list(got) == list(want) and all(torch.equal(got[k], v) for k, v in want.items())
        full = _summon(model)
        assert all(torch.equal(a, b) for a, b in zip(full, want.values()))
        return elapsed
    finally:
        del os.environ[ENV_TIMEOUT]


@pytest.mark.parametrize(("call", "other"), [("state_dict", None), ("summon_full_params", None),
                                             ("state_dict", "summon_full_params")])
def test_rank_that_never_arrives_raises(pool, call, other):
    elapsed = pool.run(check_missing_rank, call, other)
    assert TIMEOUT_S * 0.9 <= elapsed[0] < TIMEOUT_S + 20, elapsed
    if other is not None:
        assert TIMEOUT_S * 0.9 <= elapsed[1] < TIMEOUT_S + 20, elapsed


def check_cost(n: int) -> float:
    """Mean seconds of one arrival check on the normal path (every rank arrives)."""
    unit = _model()._unit
    dist.barrier()
    start = time.perf_counter()
    for _ in range(n):
        arrive(unit, "cost()")
    return (time.perf_counter() - start) / n


def test_cost_on_the_normal_path(pool):
    """Two store round trips per call: well under a millisecond on one host (printed for the record)."""
    costs = pool.run(check_cost, 300)
    print(f"arrival check: {[f'{c * 1e6:.0f} us' for c in costs]} per call")
    assert max(costs) < 5e-3, costs


def test_timeout_setting(monkeypatch):
    monkeypatch.delenv(ENV_TIMEOUT, raising=False)
    assert collective_timeout_s() == 120.0
    monkeypatch.setenv(ENV_TIMEOUT, "2.5")
    assert collective_timeout_s() == 2.5
    for bad in ("0", "-1", "soon"):
        monkeypatch.setenv(ENV_TIMEOUT, bad)
        with pytest.raises(ValueError, match=rf"{ENV_TIMEOUT}='{bad}' must be a number of seconds > 0"):
            collective_timeout_s()
