"""OffloadOptimizer.trace_host: the host step's timeline has every offloaded unit's events, in order, per step."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardfuse import OffloadOptimizer
from tests.sharding._models import batch, build, loss_fn, wrap_model

WORLD = 2


def _step(model, opt, step: int) -> None:
    ids, target = batch(step, dist.get_rank(), dist.get_world_size())
    loss_fn(model, ids, target, step, {}).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def check_trace(step_in_backward: bool) -> bool:
    model = wrap_model(build({}), {"move_params_to_cpu": True})
    opt = OffloadOptimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), gpu_budget_gib=0,
                           step_in_backward=step_in_backward)
    _step(model, opt, 0)  # the first step makes the plans and the optimizer state
    opt.synchronize()  # its update done: the trace starts with the next step
    trace = opt.trace_host()
    assert trace is not None
    for step in (1, 2):
        _step(model, opt, step)
    opt.synchronize()
    events = list(trace.events)
    hosts = [i for i, plan in enumerate(opt._plans) if plan.host is not None]
    assert hosts and sorted({u for _, _, u in events if u >= 0}) == hosts, events
    assert [k for _, k, u in events if u < 0] == ["step", "step"], events
    lifecycle = ["queued", "task", "grad_ready", "update", "done"] if step_in_backward else \
        ["queued", "task", "update", "done"]
    for unit in hosts:
        mine = [(t, k) for t, k, u in events if u == unit]
        assert [t for t, _ in mine] == sorted(t for t, _ in mine), mine  # recorded as they happened
        assert [k for _, k in mine if k in lifecycle] == lifecycle * 2, mine  # once per step, in order
        waits = [k for _, k in mine if k in ("wait", "waited")]
        assert waits == ["wait", "waited"] * (len(waits) // 2), mine  # every wait is released
    assert opt.trace_host(False) is None
    _step(model, opt, 3)
    opt.synchronize()
    assert len(trace.events) == len(events)  # stopped: nothing more is recorded
    assert all(plan.host is None or plan.host.trace is None for plan in opt._plans)
    opt.close()
    return True


@pytest.mark.parametrize("step_in_backward", [False, True], ids=["after-backward", "step-in-backward"])
def test_trace_records_each_units_update(pool, step_in_backward):
    assert pool.run(check_trace, step_in_backward) == [True] * WORLD
