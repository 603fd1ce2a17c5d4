"""The lifecycle of a host shard's overlapped update (``_host_shard.UpdateState``): the legal moves, refusals that
name the shard and both states, the path a real step takes on the worker thread, and failures anywhere on the
worker reaching the caller (in-process, over a duck-typed process group of one rank)."""

from __future__ import annotations

import itertools
import threading

import pytest
import torch
from torch import nn

from shardfuse import FullyShardedDataParallel as FSDP
from shardfuse import OffloadOptimizer
from shardfuse.sharding.host import _host_shard
from shardfuse.sharding.host._host_shard import TRANSITIONS, HostShard, IllegalTransition, UpdateLifecycle, UpdateState

S = UpdateState


class _Group:
    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 1


def _model() -> FSDP:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 9), nn.Tanh(), nn.Linear(9, 3))
    net[0] = FSDP(net[0], process_group=_Group(), move_params_to_cpu=True)
    return FSDP(net, process_group=_Group(), move_params_to_cpu=True)


def test_every_move_is_legal_or_refused_by_name() -> None:
    life = UpdateLifecycle("unit7.flat_param_0")
    for came, to in itertools.product(S, S):
        life.state = came
        life.settled.set()
        if to in TRANSITIONS[came]:
            life.move(to)
            assert life.state is to and life.settled.is_set() == (to not in _host_shard.IN_FLIGHT)
        else:
            with pytest.raises(IllegalTransition) as info:
                life.move(to)
            msg = str(info.value)
            assert "unit7.flat_param_0" in msg and f"{came.name} -> {to.name}" in msg, msg
            assert life.state is came, "a refused move changes nothing"


def test_every_state_is_reachable_and_leads_back_to_queued() -> None:
    seen, todo = {S.IDLE}, [S.IDLE]
    while todo:
        for nxt in TRANSITIONS[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    assert seen == set(S)
    assert all(S.QUEUED in TRANSITIONS[s] or s in _host_shard.IN_FLIGHT or s is S.FAILED for s in S)


def test_failed_error_is_taken_once() -> None:
    host = HostShard(torch.zeros(4), torch.float32, pin=False, name="shard-a")
    host.queue()
    with pytest.raises(IllegalTransition, match="shard-a: update state QUEUED -> QUEUED"):
        host.queue()  # queued twice
    host.life.move(S.FAILED, ValueError("boom"))
    with pytest.raises(RuntimeError, match=r"shard failed \(shard-a\): boom"):
        host.wait_ready()
    assert host.life.state is S.IDLE and not host.in_flight
    host.wait_ready()  # raised once only


def test_a_step_walks_the_states_on_the_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    moves: list[tuple[str, UpdateState, str]] = []
    real_move = UpdateLifecycle.move

    def spy(self: UpdateLifecycle, to: UpdateState, error: BaseException | None = None) -> None:
        moves.append((self.name, to, threading.current_thread().name))
        real_move(self, to, error)

    monkeypatch.setattr(UpdateLifecycle, "move", spy)
    model = _model()
    opt = OffloadOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    for _ in range(2):
        model(torch.randn(4, 5)).sum().backward()
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    names = {name for name, _, _ in moves}
    assert len(names) == 2, names
    for name in names:
        mine = [(to, thread) for n, to, thread in moves if n == name]
        assert [to for to, _ in mine] == [S.QUEUED, S.GRAD_COPYING, S.UPDATING, S.DONE] * 2, mine
        assert all((thread == "shardfuse-host-step") == (to is not S.QUEUED) for to, thread in mine), mine
    opt.close()


def test_a_failure_before_the_update_reaches_the_caller(monkeypatch: pytest.MonkeyPatch) -> None:
    """A wait for copies (or the SSD tier's room) that raises on the worker fails that shard's update: the next
    gather raises it, rather than the worker thread dying and the gather waiting forever."""
    model = _model()
    opt = OffloadOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1))

    def broken(self: HostShard, in_backward: bool) -> None:
        raise OSError("no room")

    monkeypatch.setattr(HostShard, "before_step", broken)
    model(torch.randn(4, 5)).sum().backward()
    opt.step()
    hosts = [h.host for u in (model._unit, model._fsdp_wrapped_module[0]._unit) for h in u.handles]
    assert all(isinstance(h, HostShard) and h.life.settled.wait(timeout=30) for h in hosts), "update never ended"
    assert all(h.life.state is S.FAILED for h in hosts)
    with pytest.raises(RuntimeError, match=r"shard failed \(FullyShardedDataParallel\(\w+\)\.flat_param_0\): no room"):
        model(torch.randn(4, 5))
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match=r"\): no room"):  # the other shard's error, raised once too
        opt.synchronize()
    opt.synchronize()
    opt.close()
