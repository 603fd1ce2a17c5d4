"""The gradient reduce-scatter's own process group (``process_group_reduce_scatter``), 2 gloo ranks on CPU.

Under NCCL every collective of one process group runs on one stream, in issue order: a unit's gradient
reduce-scatter queues in front of the next all-gather. FairScale's default gives the reduce-scatters a separate
group of the same ranks for that (``ProcessGroupName.reduce_scatter``); shardfuse's default (None) keeps the
process group (no second communicator), ``"reduce_scatter"`` asks for the separate group (made by the root at its
first forward, one for all its units), ``"default"`` names the process group, and ``SHARDFUSE_REDUCE_SCATTER_GROUP``
chooses for a process. Checked: the groups made (one, shared), every reduce-scatter going to it, the same losses
and gradients as with one group, pickling, the names.
"""

from __future__ import annotations

import enum
import pickle
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardfuse import FullyShardedDataParallel as FSDP
from shardfuse.sharding.core import _collectives as coll

WORLD = 2


class ProcessGroupName(str, enum.Enum):  # FairScale's, as its users import it
    default = "default"
    reduce_scatter = "reduce_scatter"


def _model(rs: Any) -> FSDP:
    torch.manual_seed(3)
    net = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 7), nn.Tanh(), nn.Linear(7, 3))
    net[0] = FSDP(net[0], process_group_reduce_scatter=rs)
    net[2] = FSDP(net[2], process_group_reduce_scatter=rs)
    return FSDP(net, process_group_reduce_scatter=rs)


def _train(rs: Any) -> dict[str, Any]:
    """Two SGD steps on fresh data; the groups every reduce-scatter used, the losses, the sharded gradients."""
    rank = dist.get_rank()
    used: list[Any] = []
    real = coll.reduce_scatter_into

    def spy(out: torch.Tensor, inp: torch.Tensor, group: Any, world: int) -> None:
        used.append(group)
        real(out, inp, group, world)

    model = _model(rs)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads = [], []
    coll.reduce_scatter_into = spy
    try:
        for step in range(2):
            g = torch.Generator().manual_seed(50 + 10 * step + rank)
            x, y = torch.randn(6, 5, generator=g), torch.randn(6, 3, generator=g)
            loss = (model(x) - y).pow(2).mean()
            loss.backward()
            grads += [p.grad.clone() for p in model.parameters()]
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    finally:
        coll.reduce_scatter_into = real
    fsdps = [m for m in model.modules() if isinstance(m, FSDP)]
    return {"model": model, "used": used, "losses": losses, "grads": grads,
            "rs_groups": [m.process_group_reduce_scatter for m in fsdps], "groups": [m.process_group for m in fsdps]}


def check_separate_group() -> bool:
    base = _train("default")
    assert all(g is dist.group.WORLD for g in base["rs_groups"]) and all(g is dist.group.WORLD for g in base["used"])
    for name in ("reduce_scatter", ProcessGroupName.reduce_scatter):
        got = _train(name)
        (made,) = {id(g) for g in got["rs_groups"]}  # one group, shared by every unit
        group = got["rs_groups"][0]
        assert group is not dist.group.WORLD and coll.world_size(group) == WORLD and coll.rank(group) == dist.get_rank()
        assert got["used"] and all(g is group for g in got["used"]), "a reduce-scatter left the separate group"
        assert all(g is dist.group.WORLD for g in got["groups"])  # the gathers keep the process group
        assert got["losses"] == base["losses"]
        assert all(torch.equal(a, b) for a, b in zip(got["grads"], base["grads"]))
    # None: the process group itself.
    auto = _train(None)
    assert all(g is dist.group.WORLD for g in auto["rs_groups"] + auto["used"])
    default = _train(ProcessGroupName.default)
    assert all(g is dist.group.WORLD for g in default["rs_groups"] + default["used"])
    return True


def test_separate_reduce_scatter_group(pool):
    assert all(pool.run(check_separate_group))


def check_pickled() -> bool:
    """After unpickling, setting ``process_group`` is enough where the reduce-scatter group was not given (it
    follows, and the root makes a separate one again); a given one must be set again, as before."""
    for rs, follows in (("reduce_scatter", True), (None, True), (dist.new_group(), False)):
        model = _train(rs)["model"]
        fresh = pickle.loads(pickle.dumps(model))
        for m in fresh.modules():
            if isinstance(m, FSDP):
                m.process_group = dist.group.WORLD
        x = torch.randn(2, 5)
        if follows:
            fresh(x)
            rs_groups = {id(m.process_group_reduce_scatter) for m in fresh.modules() if isinstance(m, FSDP)}
            assert len(rs_groups) == 1
        else:
            with pytest.raises(RuntimeError, match="process_group_reduce_scatter"):
                fresh(x)
    return True


def test_pickled_model_gets_its_reduce_scatter_group_back(pool):
    assert all(pool.run(check_pickled))


def test_unknown_name_is_refused_with_the_choices() -> None:
    class Solo:
        def rank(self) -> int:
            return 0

        def size(self) -> int:
            return 1

    with pytest.raises(ValueError, match="'reduce_scatter' .* or 'default'"):
        FSDP(nn.Linear(2, 2), process_group=Solo(), process_group_reduce_scatter="reducescatter")
    m = FSDP(nn.Linear(2, 2), process_group=Solo(), process_group_reduce_scatter=ProcessGroupName.reduce_scatter)
    m(torch.randn(1, 2)).sum().backward()  # one rank: nothing to separate, nothing made
    assert m.process_group_reduce_scatter is m.process_group


def test_environment_chooses_where_the_argument_is_none(monkeypatch) -> None:
    class Solo:
        def rank(self) -> int:
            return 0

        def size(self) -> int:
            return 1

    from shardfuse.sharding.core._groups import ReduceScatterGroup

    monkeypatch.setenv("SHARDFUSE_REDUCE_SCATTER_GROUP", "reduce_scatter")
    assert FSDP(nn.Linear(2, 2), process_group=Solo())._unit.groups.reduce_scatter_source == ReduceScatterGroup.SEPARATE
    given = FSDP(nn.Linear(2, 2), process_group=Solo(), process_group_reduce_scatter="default")
    assert given._unit.groups.reduce_scatter_source == ReduceScatterGroup.SAME  # the argument wins
    monkeypatch.setenv("SHARDFUSE_REDUCE_SCATTER_GROUP", "separate")
    with pytest.raises(ValueError, match="SHARDFUSE_REDUCE_SCATTER_GROUP='separate': pass 'reduce_scatter'"):
        FSDP(nn.Linear(2, 2), process_group=Solo())
    monkeypatch.delenv("SHARDFUSE_REDUCE_SCATTER_GROUP")
    assert FSDP(nn.Linear(2, 2), process_group=Solo())._unit.groups.reduce_scatter_source == ReduceScatterGroup.SAME
