"""Optimizer-state consolidation (``gather_full_optim_state_dict``) and resharding
(``get_shard_from_optim_state_dict``) in 1-, 2- and 4-rank gloo groups.

Each check trains a wrapped model, consolidates its optimizer state, loads it somewhere (a fresh sharded
optimizer at the same or another world size, or a plain ``torch.optim`` optimizer of the unwrapped model) and
compares the next steps with an uninterrupted run: bit for bit where the gradient sum has the same order (1 and
2 ranks), to fp32 rounding where gloo's 4-rank reduce-scatter sums in another order than the reference. The
FairScale checks re-type what FairScale 0.4.13's ``tests/nn/data_parallel/test_fsdp_optimizer_utils.py``
asserts, for CPU/gloo.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardfuse.sharding import FullyShardedDataParallel as FSDP
from shardfuse.sharding.core._flat_param import SHARD_MARK_KEY
from tests.sharding._models import divide_factors

WORLD = 2
D_IN, DIM, HID, D_OUT = 5, 11, 13, 3
LR_BLOCKS = 0.03  # the blocks' group gets its own learning rate
TOL_4 = (1e-5, 1e-6)  # 4 ranks: gloo sums the gradients in another order than the reference

_SOLO: dict[int, Any] = {}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(DIM, HID)
        self.fc2 = nn.Linear(HID, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


class ScalarNet(nn.Module):
    """A 0-dim parameter (``gain``) beside ``nn.Linear`` layers in the root unit, and two blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D_IN, DIM)
        self.gain = nn.Parameter(torch.tensor(1.5))
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(DIM, D_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x) * self.gain
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def build(seed: int = 1234) -> ScalarNet:
    torch.manual_seed(seed)
    return ScalarNet()


def solo_group() -> Any:
    """A process group holding only this rank (every rank creates all of them, in the same order)."""
    if not _SOLO:
        for r in range(dist.get_world_size()):
            _SOLO[r] = dist.new_group([r])
    return _SOLO[dist.get_rank()]


def wrap(model: ScalarNet, nested: bool = True, group: Any = None, **kw: Any) -> FSDP:
    if nested:
        for i in range(len(model.blocks)):
            model.blocks[i] = FSDP(model.blocks[i], process_group=group, **kw)
    return FSDP(model, process_group=group, **kw)


def param_groups(model: nn.Module, multi: bool) -> list[dict[str, Any]]:
    """Blocks first (own lr), then the rest; the same split for the wrapper (flat parameters) and the unwrapped
    model (original parameters in module order)."""
    named = list(model.named_parameters())
    if not multi:
        return [{"params": [p for _, p in named]}]
    return [
        {"params": [p for n, p in named if "blocks." in n], "lr": LR_BLOCKS},
        {"params": [p for n, p in named if "blocks." not in n]},
    ]


def make_opt(groups: list[dict[str, Any]], name: str, **override: Any) -> torch.optim.Optimizer:
    groups = [{**g, **override} for g in groups]
    if name == "sgd":
        return torch.optim.SGD(groups, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1)


def batch(step: int, rank: int, ws: int, per_rank: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    x = torch.randn(per_rank * ws, D_IN, generator=g)
    y = torch.randn(per_rank * ws, D_OUT, generator=g)
    sl = slice(rank * per_rank, (rank + 1) * per_rank)
    return x[sl], y[sl]


def sharded_step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> float:
    ws = model.world_size
    opt.zero_grad(set_to_none=True)
    x, y = batch(step, model.rank, ws)
    if torch.cuda.is_available() and dist.get_backend() == "nccl":
        x, y = x.cuda(), y.cuda()
    loss = (model(x) - y).pow(2).mean()
    loss.backward()
    opt.step()
    return loss.item()


def ref_step(model: nn.Module, opt: torch.optim.Optimizer, step: int, ws: int) -> list[float]:
    """One unsharded step over ``ws`` ranks' batches, gradients combined as the sharded path does (g / pre
    summed in rank order, then / post)."""
    pre, post = divide_factors(ws, {})
    params = list(model.parameters())
    total: list[torch.Tensor | None] = [None] * len(params)
    losses = []
    for r in range(ws):
        for p in params:
            p.grad = None
        x, y = batch(step, r, ws)
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        losses.append(loss.item())
        for i, p in enumerate(params):
            if p.grad is not None:
                g = p.grad / pre if pre != 1 else p.grad.clone()
                total[i] = g if total[i] is None else total[i] + g
    for p, t in zip(params, total):
        p.grad = None if t is None else (t / post if post != 1 else t)
    opt.step()
    return losses


def assert_close(name: str, got: torch.Tensor, want: torch.Tensor, tol: tuple[float, float] | None) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, f"{name}: {got.shape}/{got.dtype} vs " \
                                                                 f"{want.shape}/{want.dtype}"
    if tol is None:
        assert torch.equal(got, want), f"{name}: max |diff| = {(got - want).abs().max().item():.3e}"
    else:
        torch.testing.assert_close(got, want, rtol=tol[0], atol=tol[1], msg=name)


def assert_same_obj(a: Any, b: Any, path: str = "") -> None:
    """FairScale's ``objects_are_equal(..., raise_exception=True)``: same types and keys, tensors of the same
    shape, dtype and device with equal values."""
    assert type(a) is type(b), f"{path}: type {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, dict):
        assert set(a) == set(b), f"{path}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
        for k in a:
            assert_same_obj(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_obj(x, y, f"{path}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert (a.shape, a.dtype, a.device) == (b.shape, b.dtype, b.device), \
            f"{path}: {a.shape}/{a.dtype}/{a.device} vs {b.shape}/{b.dtype}/{b.device}"
        assert torch.equal(a, b), f"{path}: values differ"
    else:
        assert a == b, f"{path}: {a!r} vs {b!r}"


def tensors_of(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors_of(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensors_of(v)]
    return []


def numel_except_step(state: dict[int, dict[str, Any]]) -> int:
    return sum(v.numel() for s in state.values() for k, v in s.items() if k != "step" and torch.is_tensor(v))


# --------------------------------------------------------------------------------------------------
# 1. a 0-dim parameter in a flat group
# --------------------------------------------------------------------------------------------------


def check_scalar_param_round_trip(world: int, nested: bool, optim: str) -> bool:
    """Consolidate, reshard into a fresh optimizer, continue: equal to the uninterrupted run, bit for bit."""
    group = solo_group() if world == 1 else None
    a = wrap(build(), nested, group)
    b = wrap(build(), nested, group)
    assert a.world_size == world
    opt_a = make_opt(param_groups(a, nested), optim)
    opt_b = make_opt(param_groups(b, nested), optim)
    for step in range(2):
        sharded_step(a, opt_a, step)
        sharded_step(b, opt_b, step)
    full = b.gather_full_optim_state_dict(opt_b, recipient_rank=None)
    gid = full["param_names"].index("gain")
    for key, v in full["state"][gid].items():
        assert v.dim() == 0, f"state {key!r} of the 0-dim parameter came back with shape {tuple(v.shape)}"
    # The repro of the 0-dim bug: load the round trip into the optimizer and step on.
    opt_b.load_state_dict(b.get_shard_from_optim_state_dict(copy.deepcopy(full)))
    # ... and into a fresh optimizer of a fresh model: no dummy step needed.
    c = wrap(build(seed=7), nested, group)
    c.load_state_dict(b.state_dict())
    opt_c = make_opt(param_groups(c, nested), optim, lr=1.0)  # wrong lr on purpose: the state restores it
    assert len(opt_c.state) == 0
    opt_c.load_state_dict(c.get_shard_from_optim_state_dict(full))
    assert [g["lr"] for g in opt_c.param_groups] == [g["lr"] for g in opt_a.param_groups]
    for step in range(2, 4):
        la, lb, lc = sharded_step(a, opt_a, step), sharded_step(b, opt_b, step), sharded_step(c, opt_c, step)
        assert la == lb == lc, f"step {step}: losses {la} {lb} {lc}"
    sd_a, sd_b, sd_c = a.state_dict(), b.state_dict(), c.state_dict()
    for k in sd_a:
        assert torch.equal(sd_a[k], sd_b[k]) and torch.equal(sd_a[k], sd_c[k]), f"{k} differs after resuming"
    return True


@pytest.mark.parametrize("optim", ["adamw", "sgd"])
@pytest.mark.parametrize("nested", [False, True], ids=["root-only", "nested"])
@pytest.mark.parametrize("world", [1, 2])
def test_scalar_param_round_trip(pool, world, nested, optim):
    assert pool.run(check_scalar_param_round_trip, world, nested, optim) == [True] * WORLD


def test_scalar_param_round_trip_4_ranks(pool4):
    assert pool4.run(check_scalar_param_round_trip, 4, True, "adamw") == [True] * 4


# --------------------------------------------------------------------------------------------------
# 2. resume with a fresh optimizer, several param groups, another world size
# --------------------------------------------------------------------------------------------------

SAVE_STEPS, MORE_STEPS = 3, 2


def check_consolidate(optim: str) -> dict[str, Any] | None:
    """Train at this pool's world size with two param groups; rank 0 returns the model and optimizer state."""
    model = wrap(build())
    opt = make_opt(param_groups(model, True), optim)
    losses = [sharded_step(model, opt, s) for s in range(SAVE_STEPS)]
    sd = model.state_dict()
    full = model.gather_full_optim_state_dict(opt)  # recipient_rank=0
    if dist.get_rank() != 0:
        assert full is None
        return None
    return {"model": sd, "optim": full, "losses": losses}


def check_resume(saved: dict[str, Any], optim: str, world: int) -> dict[str, Any]:
    """A fresh model and a fresh optimizer (no step taken) at ``world`` ranks load the saved state and go on."""
    model = wrap(build(seed=99), group=solo_group() if world == 1 else None)
    assert model.world_size == world
    model.load_state_dict(saved["model"])
    opt = make_opt(param_groups(model, True), optim, lr=1.0)
    assert len(opt.state) == 0
    opt.load_state_dict(model.get_shard_from_optim_state_dict(saved["optim"]))
    assert [g["lr"] for g in opt.param_groups] == [LR_BLOCKS, opt.defaults["lr"]]
    losses = [sharded_step(model, opt, s) for s in range(SAVE_STEPS, SAVE_STEPS + MORE_STEPS)]
    return {"losses": losses, "model": model.state_dict()}


def reference(optim: str, schedule: list[int]) -> tuple[nn.Module, list[list[float]]]:
    model = build()
    opt = make_opt(param_groups(model, True), optim)
    return model, [ref_step(model, opt, s, ws) for s, ws in enumerate(schedule)]


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("optim", ["sgd", "adamw"])
def test_fresh_optimizer_resumes_across_world_sizes(pool, pool4, optim, world):
    saved = pool.run(check_consolidate, optim)[0]
    target = pool4 if world == 4 else pool
    out = target.run(check_resume, saved, optim, world)
    ref, ref_losses = reference(optim, [WORLD] * SAVE_STEPS + [world] * MORE_STEPS)
    tol = TOL_4 if world == 4 else None
    assert saved["losses"] == [ref_losses[s][0] for s in range(SAVE_STEPS)]
    for rank, res in enumerate(out):
        r = 0 if world == 1 else rank  # each solo rank trains on the whole (1-rank) batch
        want = torch.tensor([ref_losses[s][r] for s in range(SAVE_STEPS, SAVE_STEPS + MORE_STEPS)])
        assert_close(f"rank {rank} losses", torch.tensor(res["losses"]), want, tol)
    for k, v in ref.state_dict().items():
        assert_close(k, out[0]["model"][k], v, tol)


# --------------------------------------------------------------------------------------------------
# 3. recipient_rank
# --------------------------------------------------------------------------------------------------


def check_recipient_rank() -> bool:
    rank, ws = dist.get_rank(), dist.get_world_size()
    model = wrap(build())
    opt = make_opt(param_groups(model, True), "sgd")
    sharded_step(model, opt, 0)
    for bad in (ws, -1, 3, 1.0, True):
        with pytest.raises(ValueError, match=rf"recipient_rank={bad!r}.*world_size={ws}.*\[0, {ws - 1}\]"):
            model.gather_full_optim_state_dict(opt, recipient_rank=bad)
    got = model.gather_full_optim_state_dict(opt, recipient_rank=1)
    assert (got is None) == (rank != 1)
    assert model.gather_full_optim_state_dict(opt, recipient_rank=None) is not None
    solo = wrap(build(), group=solo_group())
    opt = make_opt(param_groups(solo, True), "sgd")
    sharded_step(solo, opt, 0)
    with pytest.raises(ValueError, match=r"recipient_rank=3.*world_size=1.*\[0, 0\].*None"):
        solo.gather_full_optim_state_dict(opt, recipient_rank=3)
    assert solo.gather_full_optim_state_dict(opt, recipient_rank=None)["state"]
    assert solo.gather_full_optim_state_dict(opt)["state"]  # default recipient 0: the only rank
    return True


def test_recipient_rank_outside_the_group_raises(pool):
    assert pool.run(check_recipient_rank) == [True] * WORLD


# --------------------------------------------------------------------------------------------------
# 4. FairScale fidelity (test_fsdp_optimizer_utils.py)
# --------------------------------------------------------------------------------------------------


class MixtureOfExperts(nn.Module):
    """FairScale's test model: an expert in its own size-1 group, seeded per rank as FairScale seeds it (the
    wrap-time agreement check runs within a unit's own group, so it leaves a size-1 group alone), the rest
    shared."""

    def __init__(self, wrapped: bool) -> None:
        super().__init__()
        torch.manual_seed(42 + dist.get_rank())
        expert = nn.Linear(23, 12)
        self.expert_names = [f"module.2.{n}" for n, _ in expert.named_parameters()]
        torch.manual_seed(0)
        shared = nn.Linear(12, 23)
        if wrapped:
            expert = FSDP(expert, process_group=solo_group(), process_group_reduce_scatter=solo_group())
            shared = FSDP(shared)
        self.module = nn.Sequential(nn.Linear(8, 12), shared, expert, nn.Linear(12, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


OPTIMS = {
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9),
    "sgd": lambda p: torch.optim.SGD(p, lr=0.01),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "adadelta": lambda p: torch.optim.Adadelta(p),
}


def check_fairscale_consolidate(optim: str) -> bool:
    rank, ws = dist.get_rank(), dist.get_world_size()
    fsdp = FSDP(MixtureOfExperts(wrapped=True))
    plain = MixtureOfExperts(wrapped=False)
    fsdp_optim, optim_plain = OPTIMS[optim](fsdp.parameters()), OPTIMS[optim](plain.parameters())
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    fsdp(x).sum().backward()
    fsdp_optim.step()
    plain(x).sum().backward()
    for n, p in plain.named_parameters():  # what FSDP does for the shared parameters
        if n not in plain.expert_names:
            p.grad.div_(ws)
            dist.all_reduce(p.grad)
    optim_plain.step()
    unwrapped_sd = optim_plain.state_dict()

    units = fsdp._units()
    assert [u.no_broadcast_optim_state for u in units] == [False, False, True], "the expert is the last unit"
    before = copy.deepcopy(fsdp_optim.state_dict())
    sd = fsdp.gather_full_optim_state_dict(fsdp_optim, recipient_rank=0)
    assert_same_obj(fsdp_optim.state_dict(), before, "the optimizer after gathering")  # left untouched
    if rank > 0:
        assert sd is None
        return True
    for k, v in sd["state"].items():
        for name, t in v.items():
            if torch.is_tensor(t):
                assert t.device == torch.device("cpu"), f"got device {t.device} for {k}: {name}. expected CPU"
    expert_li = [id(p) for p in fsdp.parameters()].index(id(units[-1].flat_param_0))
    assert sd["uncollected_local_ids"] == ([expert_li] if sd["state"] else [])
    sd_copy = copy.deepcopy(sd)
    unflat_state = sd_copy["state"]
    shard_sd = fsdp.get_shard_from_optim_state_dict(sd_copy)
    if sd["state"]:  # FairScale: the input is changed in place (so the full state is not held twice)
        assert shard_sd is sd_copy and sd_copy["state"] is not unflat_state
        with pytest.raises(AssertionError):
            assert_same_obj(unflat_state, sd_copy["state"])
    assert all(t.device == torch.device("cpu") for t in tensors_of(shard_sd)), "FairScale returns CPU tensors"
    assert len(sd["state"]) == len(unwrapped_sd["state"])
    assert len(sd["param_groups"][0]["params"]) == len(unwrapped_sd["param_groups"][0]["params"])
    assert numel_except_step(sd["state"]) == numel_except_step(unwrapped_sd["state"])
    original_shard_sd = fsdp_optim.state_dict()
    assert shard_sd.keys() == original_shard_sd.keys()
    assert len(shard_sd["state"]) == len(original_shard_sd["state"])
    assert list(shard_sd["param_groups"][0].values()) == list(original_shard_sd["param_groups"][0].values())
    assert_same_obj(shard_sd, original_shard_sd, "shard_sd")
    # Beyond FairScale: the consolidated state is the unwrapped optimizer's, parameter by parameter (the shared
    # gradients were averaged in another order: fp32 rounding).
    by_name = dict(plain.named_parameters())
    for gid, st in sd["state"].items():
        want = optim_plain.state[by_name[sd["param_names"][gid]]]
        assert set(st) == set(want)
        for key, v in st.items():
            if torch.is_tensor(v):
                torch.testing.assert_close(v, want[key], rtol=1e-5, atol=1e-7, msg=f"{gid}.{key}")
    return True


@pytest.mark.parametrize("optim", list(OPTIMS))
def test_fairscale_consolidate_optimizer(pool, optim):
    assert pool.run(check_fairscale_consolidate, optim) == [True] * WORLD


def test_fairscale_consolidate_optimizer_4_ranks(pool4):
    assert pool4.run(check_fairscale_consolidate, "adam") == [True] * 4


class ModelWithUnusedParams(nn.Module):
    """FairScale's model: ``not_trained`` is its own unit and gets no gradient, so it has no optimizer state:
    frozen with requires_grad_(False) as in FairScale, or trainable but run under no_grad."""

    def __init__(self, wrap_l2: bool, frozen: bool) -> None:
        super().__init__()
        self.l = nn.Linear(4, 4)
        self.not_trained = FSDP(nn.Linear(4, 4).requires_grad_(not frozen))
        self.l2 = FSDP(nn.Linear(4, 4)) if wrap_l2 else nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            y = self.not_trained(x)
        return self.l2(self.l(x)) - y


def check_unused_params(wrap_l2: bool, frozen: bool) -> bool:
    torch.manual_seed(0)
    model = FSDP(ModelWithUnusedParams(wrap_l2, frozen))
    optim = torch.optim.SGD(model.parameters(), momentum=0.9, lr=0.1)
    model(torch.rand(4)).sum().backward()
    optim.step()
    model.zero_grad(set_to_none=True)
    sd = model.gather_full_optim_state_dict(optim)
    if dist.get_rank() != 0:
        assert sd is None
        return True
    names = sd["param_names"]
    assert names == ["l.weight", "l.bias", "not_trained.weight", "not_trained.bias", "l2.weight", "l2.bias"]
    assert sorted(names[g] for g in sd["state"]) == sorted(n for n in names if not n.startswith("not_trained"))
    assert all(set(s) == {"momentum_buffer"} for s in sd["state"].values())
    assert sd["param_groups"][0]["params"] == list(range(6))
    shard_sd = model.get_shard_from_optim_state_dict(sd)
    assert_same_obj(shard_sd, optim.state_dict(), "shard_sd")
    return True


@pytest.mark.parametrize("frozen", [True, False], ids=["frozen", "no-grad"])
@pytest.mark.parametrize("wrap_l2", [True, False])
def test_fairscale_model_with_unused_params(pool, wrap_l2, frozen):
    assert pool.run(check_unused_params, wrap_l2, frozen) == [True] * WORLD


def check_gathered_state_is_detached(world: int) -> bool:
    """CPU copies that share nothing with the live state (a 1-rank group gathers nothing, so it is the case
    where a view could slip through), and the optimizer is not modified (FairScale turns ``step`` into a
    Python number in the live state)."""
    model = wrap(build(), group=solo_group() if world == 1 else None)
    opt = make_opt(param_groups(model, True), "adamw")
    sharded_step(model, opt, 0)
    before = copy.deepcopy(opt.state_dict())
    full = model.gather_full_optim_state_dict(opt, recipient_rank=None)
    assert_same_obj(opt.state_dict(), before, "the optimizer after gathering")
    snapshot = copy.deepcopy(full)
    assert all(t.device == torch.device("cpu") for t in tensors_of(full))
    sharded_step(model, opt, 1)
    assert_same_obj(full, snapshot, "the consolidated dict after another step")
    assert all(torch.is_tensor(s["step"]) and s["step"].dim() == 0 for s in full["state"].values())
    # Every parameter has its own step tensor (a shared one would be incremented once per parameter).
    steps = [s["step"].data_ptr() for s in full["state"].values()]
    assert len(set(steps)) == len(steps)
    # Errors leave the input untouched; success consumes it (FairScale's in-place contract).
    with pytest.raises(ValueError, match="do not form a flat group of this model"):
        wrap(build(), nested=False, group=solo_group() if world == 1 else None).get_shard_from_optim_state_dict(full)
    assert_same_obj(full, snapshot, "the consolidated dict after a failed get_shard_from_optim_state_dict")
    shard = model.get_shard_from_optim_state_dict(full)
    assert shard is full and set(shard) == {"state", "param_groups"}
    assert all(t.device == torch.device("cpu") for t in tensors_of(shard))
    return True


@pytest.mark.parametrize("world", [1, 2])
def test_gathered_state_is_a_cpu_copy(pool, world):
    assert pool.run(check_gathered_state_is_detached, world) == [True] * WORLD


# --------------------------------------------------------------------------------------------------
# 5. the consolidated dict loads into the unwrapped model's optimizer
# --------------------------------------------------------------------------------------------------


def check_load_into_unwrapped(optim: str, multi: bool) -> bool:
    rank, ws = dist.get_rank(), dist.get_world_size()
    model = wrap(build())
    opt = make_opt(param_groups(model, multi), optim)
    for s in range(SAVE_STEPS):
        sharded_step(model, opt, s)
    full = model.gather_full_optim_state_dict(opt, recipient_rank=None)
    plain = build(seed=5)
    plain.load_state_dict(model.state_dict())
    assert full["param_names"] == [n for n, _ in plain.named_parameters()]
    plain_opt = make_opt(param_groups(plain, multi), optim, lr=1.0)
    plain_opt.load_state_dict(copy.deepcopy(full))
    by_name = dict(plain.named_parameters())
    for gid, st in full["state"].items():
        p = by_name[full["param_names"][gid]]
        for key, v in st.items():
            if key != "step":
                assert v.shape == p.shape, f"{full['param_names'][gid]}.{key}: {tuple(v.shape)} vs {tuple(p.shape)}"
    # The consolidated state is the uninterrupted unwrapped run's, and a single group numbers the parameters
    # exactly as the unwrapped optimizer does.
    ref = build()
    ref_opt = make_opt(param_groups(ref, multi), optim)
    for s in range(SAVE_STEPS):
        ref_step(ref, ref_opt, s, ws)
    if not multi:
        assert_same_obj({k: full[k] for k in ("state", "param_groups")}, ref_opt.state_dict(), "consolidated")
    assert_same_obj(plain_opt.state_dict(), ref_opt.state_dict(), "the unwrapped optimizer after loading")
    got = sharded_step(model, opt, SAVE_STEPS)
    want = ref_step(plain, plain_opt, SAVE_STEPS, ws)[rank]
    assert got == want, f"next step: loss {got} vs {want}"
    sd = model.state_dict()
    for n, p in plain.named_parameters():
        assert torch.equal(sd[n], p.detach()), f"{n} differs after the next step"
    return True


@pytest.mark.parametrize("multi", [False, True], ids=["one-group", "two-groups"])
@pytest.mark.parametrize("optim", ["sgd", "adamw"])
def test_consolidated_state_loads_into_unwrapped_optimizer(pool, optim, multi):
    assert pool.run(check_load_into_unwrapped, optim, multi) == [True] * WORLD


# --------------------------------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------------------------------


def check_errors() -> bool:
    model = wrap(build())
    opt = make_opt(param_groups(model, True), "adamw")
    sharded_step(model, opt, 0)
    full = model.gather_full_optim_state_dict(opt, recipient_rank=None)
    with pytest.raises(ValueError, match="needs a dict made by gather_full_optim_state_dict"):
        model.get_shard_from_optim_state_dict({"state": {}, "param_groups": []})
    other = wrap(build(), nested=False)  # the same parameters, another wrapping
    with pytest.raises(ValueError, match="which do not form a flat group of this model: wrap the model the same way"):
        other.get_shard_from_optim_state_dict(full)
    bad = copy.deepcopy(full)
    bad["state"][bad["param_names"].index("head.weight")]["exp_avg"] = torch.zeros(2)
    with pytest.raises(ValueError, match=r"'exp_avg' of head.weight is per-element but has shape \(2,\)"):
        model.get_shard_from_optim_state_dict(bad)
    bad = copy.deepcopy(full)
    del bad["state"][bad["param_names"].index("gain")]
    with pytest.raises(ValueError, match=r"optimizer state is missing for some parameters of flat group \d"):
        model.get_shard_from_optim_state_dict(bad)
    bad = copy.deepcopy(full)
    bad["state"][bad["param_names"].index("head.bias")]["step"] = torch.tensor(99.0)
    with pytest.raises(ValueError, match="'step' is tensor.99.* for head.bias but"):
        model.get_shard_from_optim_state_dict(bad)
    with pytest.raises(ValueError, match="other parameters: 1 saved vs 13 here"):
        model.get_shard_from_optim_state_dict({**full, "param_names": ["x"]})
    # Ranks holding different state: one clear error everywhere instead of mismatched collectives.
    fresh = wrap(build())
    opt = make_opt(param_groups(fresh, True), "sgd")
    if dist.get_rank() == 0:
        for p in fresh.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
    with pytest.raises(RuntimeError, match="the ranks hold different optimizer state"):
        fresh.gather_full_optim_state_dict(opt)
    return True


def test_errors_name_the_value_and_the_fix(pool):
    assert pool.run(check_errors) == [True] * WORLD


# --------------------------------------------------------------------------------------------------
# GPU (NCCL, 2 GPUs): FairScale's memory check
# --------------------------------------------------------------------------------------------------


def check_gpu_memory_and_devices(move_params_to_cpu: bool) -> bool:
    """gather_full_optim_state_dict leaves no CUDA memory allocated (FairScale asserts 0 bytes) and returns CPU
    tensors; get_shard_from_optim_state_dict returns CPU tensors; resuming from them is exact."""
    dev = torch.device("cuda", torch.cuda.current_device())

    def make(seed: int) -> FSDP:
        m = build(seed)
        return wrap(m if move_params_to_cpu else m.to(dev), move_params_to_cpu=move_params_to_cpu)

    a, b = make(1234), make(1234)
    opt_a, opt_b = make_opt(param_groups(a, True), "adamw"), make_opt(param_groups(b, True), "adamw")
    for s in range(2):
        sharded_step(a, opt_a, s)
        sharded_step(b, opt_b, s)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(dev)
    assert before > 0
    full = b.gather_full_optim_state_dict(opt_b, recipient_rank=None)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated(dev) == before, f"{torch.cuda.memory_allocated(dev) - before} bytes left"
    assert all(t.device.type == "cpu" for t in tensors_of(full))
    shard = b.get_shard_from_optim_state_dict(full)
    assert all(t.device.type == "cpu" for t in tensors_of(shard))
    c = make(7)
    c.load_state_dict(b.state_dict())
    opt_c = make_opt(param_groups(c, True), "adamw")
    opt_c.load_state_dict(shard)
    # load_state_dict moves the CPU shards to the flat parameters' device.
    (want,) = {p.device for p in c.parameters()}
    devices = {f"{k}: {v.device}" for s in opt_c.state.values() for k, v in s.items()
               if k != "step" and torch.is_tensor(v)}
    marks = {s.get(SHARD_MARK_KEY) for s in opt_c.state.values()}
    mine = (dist.get_rank(), dist.get_world_size())
    assert mine in marks and marks <= {mine, None}, marks  # the loaded shards carry this rank's mark
    assert devices == {f"{k}: {want}" for k in ("exp_avg", "exp_avg_sq")}, devices
    for s in range(2, 4):
        la, lc = sharded_step(a, opt_a, s), sharded_step(c, opt_c, s)
        assert la == lc, f"step {s}: {la} vs {lc}"
    sd_a, sd_c = a.state_dict(), c.state_dict()
    assert all(torch.equal(sd_a[k], sd_c[k]) for k in sd_a)
    return True


@pytest.mark.multigpu
def test_gpu_gather_frees_device_memory_and_returns_cpu_state():
    from tests.dist_pool import DistPool

    with DistPool(world_size=2, backend="nccl", timeout_s=300) as p:
        for move in (False, True):
            assert p.run(check_gpu_memory_and_devices, move) == [True] * 2


class _BrokenEq:
    """A value whose ``==`` itself fails (a bug in the value's class), unlike a value without a single truth."""

    def __eq__(self, other: object) -> bool:
        raise KeyError("broken __eq__")

    __hash__ = object.__hash__


def test_same_state_value_compares_without_swallowing_errors():
    """The check that the original parameters of one flat parameter share one value of non-per-element state:
    containers item by item, NumPy-like element-wise results through ``all()``, and an error of a value's own
    ``==`` propagates (it used to count as a match)."""
    import numpy as np

    from shardfuse.sharding.checkpoint._optim_state import _same

    t = torch.arange(3.0)
    assert _same([t, 1], [t.clone(), 1]) and not _same([t, 1], [t + 1, 1])
    assert _same({"a": (t, 2)}, {"a": (t.clone(), 2)}) and not _same({"a": (t, 2)}, {"a": (t, 3)})
    assert not _same([1, 2], (1, 2))
    assert _same(np.arange(3), np.arange(3)) and not _same(np.arange(3), np.arange(3) * 2)
    with pytest.raises(KeyError, match="broken __eq__"):
        _same(_BrokenEq(), _BrokenEq())
