"""Pickling a wrapped model (FairScale's feature): before or after training, flat or ``use_orig_params``, the copy
comes back without its process groups (the user sets them again on every instance), with the same state dict, and
trains exactly like the original; what cannot be pickled is refused loudly. Also ``.half()`` after wrapping
(2 gloo ranks)."""

from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardfuse import FullyShardedDataParallel as FSDP
from shardfuse.sharding.core._registry import handle_of
from tests.sharding._models import batch, build

WORLD = 2
MODES = ["flat", "use_orig_params"]
FROZEN = "blocks.1.fc2.bias"


def _wrap(mode: str, net: nn.Module | None = None, **kw: Any) -> FSDP:
    """The test model with both blocks as nested units, then the whole model."""
    if mode == "use_orig_params":
        kw["use_orig_params"] = True
    net = build({}) if net is None else net
    for i in range(len(net.blocks)):
        net.blocks[i] = FSDP(net.blocks[i], **kw)
    return FSDP(net, **kw)


def _set_groups(model: FSDP) -> None:
    """What a FairScale user does after unpickling: the process groups again, on every instance."""
    for m in model.modules():
        if isinstance(m, FSDP):
            m.process_group = dist.group.WORLD
            m.process_group_reduce_scatter = dist.group.WORLD


def _train(model: nn.Module, steps: range) -> list[float]:
    """Steps with a fresh AdamW; each step's loss and its global gradient norm (torch's clip_grad_norm_, which
    finds the shards through each parameter's link to its handle)."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    out = []
    for step in steps:
        opt.zero_grad(set_to_none=True)
        ids, target = batch(step, rank, ws)
        loss = (model(ids).float() - target).pow(2).mean()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e3)
        opt.step()
        out += [loss.item(), norm.item()]
    return out


def _assert_same(sd: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(sd) == list(want), (list(sd), list(want))
    for k, v in want.items():
        assert sd[k].dtype == v.dtype and torch.equal(sd[k], v), k


def _assert_views_of_shards(model: FSDP) -> None:
    """use_orig_params: every registered parameter is a view of its unit's shard (trained and gathered)."""
    seen = 0
    for p in model.parameters():
        h = handle_of(p)
        assert h is not None and any(v is p for v in h.orig_views)
        assert p.untyped_storage().data_ptr() == h.flat.untyped_storage().data_ptr()
        seen += 1
    assert seen == len(list(build({}).parameters()))


def check_pickle_after_training(mode: str, mixed: bool) -> bool:
    kw = dict(mixed_precision=True, compute_dtype=torch.bfloat16) if mixed else {}
    model = _wrap(mode, **kw)
    if mode == "use_orig_params":
        dict(model.named_parameters())[FROZEN].requires_grad_(False)
    _train(model, range(2))
    before = model.state_dict()
    assert len(before) == len(build({}).state_dict())
    assert before["scale"].dtype == torch.float32  # the buffer's own dtype, not the compute dtype
    twin = pickle.loads(pickle.dumps(model))
    with pytest.raises(RuntimeError, match="pickled, which drops its process groups"):
        twin.state_dict()
    _set_groups(twin)
    _assert_same(twin.state_dict(), before)
    _assert_same(model.state_dict(), before)  # pickling left the original as it was
    assert [n for n, _ in twin.named_parameters()] == [n for n, _ in model.named_parameters()]
    if mode == "use_orig_params":
        _assert_views_of_shards(twin)
        frozen = [n for n, p in twin.named_parameters() if not p.requires_grad]
        assert frozen == [FROZEN], frozen
    # Both go on with a fresh optimizer (optimizer state is keyed by parameter objects).
    a = _train(model, range(2, 4))
    b = _train(twin, range(2, 4))
    assert a == b, (a, b)
    after = model.state_dict()
    _assert_same(twin.state_dict(), after)
    assert not torch.equal(after["blocks.0.fc1.weight"], before["blocks.0.fc1.weight"])
    if mode == "use_orig_params":
        assert torch.equal(after[FROZEN], before[FROZEN])
    # A copy of the copy, pickled after it trained, still matches; so does a deepcopy (the same protocol).
    again = pickle.loads(pickle.dumps(twin))
    _set_groups(again)
    _assert_same(again.state_dict(), after)
    deep = copy.deepcopy(model)
    _set_groups(deep)
    _assert_same(deep.state_dict(), after)
    if mode == "use_orig_params":
        _assert_views_of_shards(deep)
    assert _train(deep, range(4, 5)) == _train(model, range(4, 5))
    return True


@pytest.mark.parametrize("mixed", [False, True], ids=["fp32", "bf16-mixed"])
@pytest.mark.parametrize("mode", MODES)
def test_pickle_after_training(pool, mode, mixed):
    assert pool.run(check_pickle_after_training, mode, mixed) == [True] * WORLD


def check_pickle_before_use(mode: str) -> bool:
    model = _wrap(mode)
    twin = pickle.loads(pickle.dumps(model))
    _set_groups(twin)
    _assert_same(twin.state_dict(), model.state_dict())
    if mode == "use_orig_params":
        _assert_views_of_shards(twin)
    assert _train(model, range(3)) == _train(twin, range(3))
    _assert_same(twin.state_dict(), model.state_dict())
    # The original-parameter views pickle as placeholders, not as one more copy of the whole shard each.
    assert len(pickle.dumps(_wrap(mode))) < 1.2 * len(pickle.dumps(_wrap("flat")))
    return True


@pytest.mark.parametrize("mode", MODES)
def test_pickle_before_use(pool, mode):
    assert pool.run(check_pickle_before_use, mode) == [True] * WORLD


class _Siblings(nn.Module):
    """Two sibling units sharing one weight: the first flattens it, the second borrows it."""

    def __init__(self, **kw: Any) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(5, 5), nn.Linear(5, 5)
        self.b.weight = self.a.weight
        self.a, self.b = FSDP(self.a, **kw), FSDP(self.b, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def check_shared_siblings(mode: str) -> bool:
    kw = {"use_orig_params": True} if mode == "use_orig_params" else {}
    torch.manual_seed(0)
    model = FSDP(_Siblings(**kw), **kw)
    x = torch.rand(3, 5, generator=torch.Generator().manual_seed(dist.get_rank()))

    def train(m: nn.Module) -> list[float]:
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        out = []
        for _ in range(2):
            loss = m(x).pow(2).sum()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            out.append(loss.item())
        return out

    train(model)
    before = model.state_dict()
    assert set(before) == {"a.weight", "a.bias", "b.weight", "b.bias"}
    twin = pickle.loads(pickle.dumps(model))
    _set_groups(twin)
    _assert_same(twin.state_dict(), before)
    if mode == "use_orig_params":
        assert twin.module.b.module.weight is twin.module.a.module.weight  # still one shared view
    assert train(model) == train(twin)
    _assert_same(twin.state_dict(), model.state_dict())
    return True


@pytest.mark.parametrize("mode", MODES)
def test_pickle_shared_siblings(pool, mode):
    assert pool.run(check_shared_siblings, mode) == [True] * WORLD


def check_refusals() -> bool:
    rank, ws = dist.get_rank(), dist.get_world_size()
    ids, target = batch(0, rank, ws)
    model = _wrap("flat")
    # Not in the middle of summon_full_params (nor forward/backward).
    with model.summon_full_params(), pytest.raises(RuntimeError, match="pickling"):
        pickle.dumps(model)
    # Not with gradients accumulated under no_sync: they would be lost.
    with model.no_sync():
        (model(ids) - target).pow(2).mean().backward()
    with pytest.raises(RuntimeError, match="accumulated under no_sync"):
        pickle.dumps(model)
    (model(ids) - target).pow(2).mean().backward()  # the synced backward reduces them
    pickle.dumps(model)
    # use_orig_params: a module registering something else than the shard's view is refused at first use.
    twin = pickle.loads(pickle.dumps(_wrap("use_orig_params")))
    _set_groups(twin)
    fc1 = twin.module.blocks[0].module.fc1
    fc1._parameters["weight"] = nn.Parameter(fc1._parameters["weight"].detach().clone())
    with pytest.raises(RuntimeError, match="parameter fc1.weight of .* is not the view of the sharded parameter"):
        twin(ids)
    return True


def test_refusals(pool):
    assert pool.run(check_refusals) == [True] * WORLD


def check_half_after_wrapping(mode: str) -> bool:
    rank, ws = dist.get_rank(), dist.get_world_size()
    ref = build({}).half()
    model = _wrap(mode).half()
    assert all(p.dtype == torch.float16 for p in model.parameters())
    ids, target = batch(0, rank, ws)
    out = model(ids)
    assert out.dtype == torch.float16
    assert torch.equal(out, ref(ids))
    out.float().sub(target).pow(2).mean().backward()
    assert all(p.grad is None or p.grad.dtype == torch.float16 for p in model.parameters())
    sd = model.state_dict()
    _assert_same(sd, ref.state_dict())
    # After training in fp32 too: the next forward computes in fp16.
    model = _wrap(mode)
    _train(model, range(1))
    want = {k: v.half() for k, v in model.state_dict().items()}
    model.half()
    _assert_same(model.state_dict(), want)
    assert model(ids).dtype == torch.float16
    twin = build({}).half()
    twin.load_state_dict(want)
    assert torch.equal(model(ids), twin(ids))
    return True


@pytest.mark.parametrize("mode", MODES)
def test_half_after_wrapping(pool, mode):
    assert pool.run(check_half_after_wrapping, mode) == [True] * WORLD
