"""FairScale 0.4.13's public API and behaviour on the wrapper, each against an unsharded reference (2 gloo ranks).

Every check here mirrors a difference FairScale's own test suite found (``../shared/peer``): metadata and offline
consolidation, pickling, duck-typed process groups, weights frozen after wrapping, state dicts inside
``summon_full_params()``, pure fp16 and the root's input cast under mixed precision.
"""

from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardfuse import FullyShardedDataParallel as FSDP
from shardfuse import TrainingState, default_auto_wrap_policy
from tests.sharding._models import batch, build, loss_fn, make_optim, wrap_model

WORLD = 2
NESTED: dict[str, Any] = {"nested": True, "optim": "sgd"}


class _DuckGroup:
    """Anything with rank()/size() (FairScale's DummyProcessGroup): enough to cut the shards."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: range, cfg: dict[str, Any]) -> list[float]:
    rank, ws = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in steps:
        opt.zero_grad(set_to_none=True)
        ids, target = batch(step, rank, ws)
        loss = loss_fn(model, ids, target, step, cfg)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def check_assert_state() -> bool:
    model = wrap_model(build(NESTED), NESTED)
    model.assert_state(TrainingState.IDLE)
    model.assert_state([TrainingState.FORWARD, TrainingState.IDLE])
    with pytest.raises(ValueError, match="expected .* to be in states \\['BACKWARD_PRE'\\] but current state is IDLE"):
        model.assert_state(TrainingState.BACKWARD_PRE)
    with model.summon_full_params():
        model.assert_state(TrainingState.SUMMON_FULL_PARAMS)
    return True


def check_metadata_consolidation() -> bool:
    cfg = {**NESTED, "tied": True, "frozen": True}
    model = wrap_model(build(cfg), cfg)
    _train(model, make_optim(model.parameters(), cfg), range(2), cfg)
    full = model.state_dict()
    local = {k: v.cpu() for k, v in model.local_state_dict().items()}
    assert not any("_fsdp_wrapped_module" in k for k in local), sorted(local)
    both: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(both, (local, model.local_metadata_dict()))
    weights, metas = zip(*both)
    merged = FSDP.consolidate_shard_weights(list(weights), list(metas))
    assert set(merged) == set(full), (sorted(set(merged) ^ set(full)))
    for k, v in full.items():
        assert torch.equal(merged[k], v), k
    # It loads into a fresh wrapper (and the plain model) like the full state dict does.
    fresh = wrap_model(build(cfg), cfg)
    fresh.load_state_dict(merged)
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, full[k]), k
    with pytest.raises(ValueError, match="one metadata dict per shard"):
        FSDP.consolidate_shard_weights(list(weights), list(metas)[:1])
    # The local state dict still round-trips on the same wrapping.
    fresh.load_local_state_dict(model.local_state_dict())
    return True


def check_pickle_round_trip() -> bool:
    cfg = NESTED
    torch.manual_seed(3)
    model = wrap_model(build(cfg), cfg)
    twin = pickle.loads(pickle.dumps(model))
    with pytest.raises(RuntimeError, match="pickled, which drops its process groups"):
        twin(batch(0, dist.get_rank(), dist.get_world_size())[0])
    for m in twin.modules():
        if isinstance(m, FSDP):
            m.process_group = dist.group.WORLD
            m.process_group_reduce_scatter = dist.new_group()
    a = _train(model, make_optim(model.parameters(), cfg), range(3), cfg)
    b = _train(twin, make_optim(twin.parameters(), cfg), range(3), cfg)
    assert a == b, (a, b)
    with pytest.raises(ValueError, match="must keep rank"):
        model.process_group = _DuckGroup(dist.get_rank(), dist.get_world_size() + 1)
    return True


def check_duck_typed_group() -> bool:
    rank, ws = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(5)
    base = nn.Sequential(nn.Linear(7, 11), nn.Tanh(), nn.Linear(11, 3))
    real = FSDP(copy.deepcopy(base))
    duck = FSDP(copy.deepcopy(base), process_group=_DuckGroup(rank, ws))
    assert duck.world_size == ws and duck.rank == rank
    for a, b in zip(real.parameters(), duck.parameters()):
        assert torch.equal(a, b), "a duck-typed group must cut the same shards"
    duck.process_group = dist.group.WORLD
    x = torch.randn(5, 7)
    assert torch.equal(real(x), duck(x))
    return True


def check_freeze_after_wrap() -> bool:
    torch.manual_seed(7)
    ref = nn.Sequential(nn.Linear(5, 9), nn.Tanh(), nn.Linear(9, 4))
    model = FSDP(copy.deepcopy(ref))
    for p in model.parameters():
        p.requires_grad_(False)
    before = copy.deepcopy(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x = torch.randn(6, 5, requires_grad=True)
    model(x).sum().backward()
    opt.step()
    after = model.state_dict()
    for k in before:
        assert torch.equal(before[k], after[k]), f"{k} changed although frozen"
    assert all(p.grad is None for p in model.parameters())
    assert x.grad is not None, "inputs still get gradients through frozen weights"
    # Unfreezing trains again, like the unsharded model.
    for p in model.parameters():
        p.requires_grad_(True)
    for p in ref.parameters():
        p.requires_grad_(True)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    y = torch.randn(6, 5)
    model(y).sum().backward()
    opt.step()
    ref(y).sum().backward()
    ref_opt.step()
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, ref.state_dict()[k], rtol=1e-6, atol=1e-6)
    return True


def check_state_dict_inside_summon() -> bool:
    model = wrap_model(build(NESTED), NESTED)
    outside = model.state_dict()
    with model.summon_full_params():
        inside = model.state_dict()
        names = [n for n, _ in model.named_parameters()]
        assert not any("_fsdp_wrapped_module" in n for n in names), names
        assert set(names) <= set(outside), sorted(set(names) - set(outside))
        with torch.no_grad():
            model.module.head.bias.add_(1.0)
        changed = model.state_dict()
    assert list(inside) == list(outside)
    for k, v in outside.items():
        assert torch.equal(inside[k], v), k
    torch.testing.assert_close(changed["head.bias"], outside["head.bias"] + 1.0, rtol=0, atol=0)
    # The change was written back on exit.
    torch.testing.assert_close(model.state_dict()["head.bias"], outside["head.bias"] + 1.0, rtol=0, atol=0)
    return True


def check_pure_fp16() -> bool:
    torch.manual_seed(11)
    ref = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3)).half()
    model = FSDP(copy.deepcopy(ref), compute_dtype=torch.float16)
    assert all(p.dtype == torch.float16 for p in model.parameters())
    x = torch.randn(4, 6, dtype=torch.float16)
    out = model(x)
    assert out.dtype == torch.float16
    assert torch.equal(out, ref(x))
    assert all(v.dtype == torch.float16 for v in model.state_dict().values())
    return True


def check_rewrap_after_training() -> bool:
    cfg = NESTED
    inner = build(cfg)
    model = wrap_model(inner, cfg)
    _train(model, make_optim(model.parameters(), cfg), range(2), cfg)
    ids, _ = batch(5, dist.get_rank(), dist.get_world_size())
    with torch.no_grad():
        want = model(ids)
    trained = model.state_dict()
    again = FSDP(inner)  # FairScale allows wrapping the trained module again, e.g. for inference
    with torch.no_grad():
        assert torch.equal(again(ids), want)
    for k, v in again.state_dict().items():
        assert torch.equal(v, trained[k]), k
    with pytest.raises(RuntimeError, match="gave its parameters to a newer FullyShardedDataParallel"):
        model(ids)
    _train(again, make_optim(again.parameters(), cfg), range(2, 3), cfg)  # and it trains
    return True


class _SeesDtype(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.seen: list[torch.dtype] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.dtype)
        return x


def check_mixed_precision_input_cast() -> list[torch.dtype]:
    seen = []
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        inner = _SeesDtype()
        model = FSDP(inner, mixed_precision=True, compute_dtype=dtype)
        with torch.no_grad():
            model(torch.randn(2, 4))
        seen.append(inner.seen[-1])
    return seen


@pytest.mark.parametrize(
    "check",
    [check_assert_state, check_metadata_consolidation, check_pickle_round_trip, check_duck_typed_group,
     check_freeze_after_wrap, check_state_dict_inside_summon, check_pure_fp16, check_rewrap_after_training],
    ids=lambda f: f.__name__.removeprefix("check_"),
)
def test_fairscale_behaviour(pool, check):
    assert pool.run(check) == [True] * WORLD


def test_mixed_precision_casts_root_inputs_like_fairscale(pool):
    # FairScale casts fp32 inputs to fp16 under mixed precision whatever the compute dtype; bf16 compute
    # gets bf16 (where FairScale would feed fp16 into bf16 weights).
    assert pool.run(check_mixed_precision_input_cast) == [[torch.float16, torch.bfloat16, torch.float16]] * WORLD


def test_default_policy_publishes_its_sets():
    leaf = default_auto_wrap_policy.FORCE_LEAF_MODULES
    assert nn.MultiheadAttention in leaf and isinstance(leaf, set)
    assert {nn.ModuleList, nn.ModuleDict} <= default_auto_wrap_policy.EXCLUDE_WRAP_MODULES
    # A custom set through FairScale's idiom: Linear children are never visited, so never wrapped.
    seq = nn.Sequential(nn.Linear(100, 100), nn.Linear(100, 100))
    with_leaf = dict(force_leaf_modules=leaf.union({nn.Sequential}))
    assert not default_auto_wrap_policy(seq, recurse=True, unwrapped_params=20200, min_num_params=1, **with_leaf)
    assert default_auto_wrap_policy(seq, recurse=True, unwrapped_params=20200, min_num_params=1)
