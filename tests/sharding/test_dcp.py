"""Sharded checkpoints through ``torch.distributed.checkpoint`` (``sharded_state_dict`` / ``load_sharded_state_dict``).

A nested model with odd sizes (a unit of 2 elements, so 3 and 4 ranks hold empty pieces), a 0-dim parameter, a
frozen flat parameter, a buffer and extra state trains 3 steps on 2 gloo ranks with three param groups (own learning
rates, one of them frozen) and saves; a fresh model and a fresh optimizer (no step, wrong learning rates) load the
checkpoint at 1, 2, 3 and 4 ranks and train 2 more steps. Losses and parameters equal the uninterrupted unsharded
run bit for bit where the gradient sum has the same order (1 and 2 ranks), and to fp32 rounding at 3 and 4 ranks,
where gloo's reduce-scatter sums in another order than the reference (``TOL``). Then the errors, and what
``torch.distributed.checkpoint.state_dict`` does with a shardfuse model.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor, Shard

from shardfuse import SafeLoadPlanner
from shardfuse.sharding import FullyShardedDataParallel as FSDP
from tests.dist_pool import DistPool
from tests.sharding._models import divide_factors
from tests.sharding.test_optim_state import D_IN, D_OUT, DIM, Block, make_opt  # the same shapes and optimizers

WORLD = 2
LR_BLOCKS, LR_FROZEN = 0.03, 0.5
SAVE_STEPS, MORE_STEPS = 3, 2
TOL = (1e-5, 1e-6)  # 3 and 4 ranks: gloo sums the gradients in another order than the reference
DSD_ERROR = "cannot save or load the optimizer state of a FullyShardedDataParallel model"


class Net(nn.Module):
    """Root unit: ``inp``, the 0-dim ``gain``, ``head`` (one flat parameter) and the frozen ``frozen`` (another);
    nested units: the two blocks and ``tiny`` (2 elements); a buffer and extra state."""

    def __init__(self, with_tiny: bool = True) -> None:
        super().__init__()
        self.inp = nn.Linear(D_IN, DIM)
        self.gain = nn.Parameter(torch.tensor(1.5))
        self.blocks = nn.ModuleList([Block(), Block()])
        self.tiny = nn.Linear(1, 1) if with_tiny else None
        self.frozen = nn.Linear(DIM, DIM).requires_grad_(False)
        self.head = nn.Linear(DIM, D_OUT)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, DIM))
        self.tag = {"version": 3}

    def get_extra_state(self) -> Any:
        return dict(self.tag)

    def set_extra_state(self, state: Any) -> None:
        self.tag = dict(state)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x) * self.gain * self.scale
        for b in self.blocks:
            h = b(h)
        if self.tiny is not None:
            h = h + self.tiny(h[..., :1])
        return self.head(torch.tanh(self.frozen(h)))


def build(seed: int = 1234, **kw: Any) -> Net:
    torch.manual_seed(seed)
    return Net(**kw)


def wrap(model: Net, nested: bool = True, **kw: Any) -> FSDP:
    if nested:
        for i in range(len(model.blocks)):
            model.blocks[i] = FSDP(model.blocks[i], **kw)
        if model.tiny is not None:
            model.tiny = FSDP(model.tiny, **kw)
    return FSDP(model, **kw)


def param_groups(model: nn.Module) -> list[dict[str, Any]]:
    """Blocks (own lr), the other trainable parameters, the frozen ones (own lr): the same split for the wrapper
    (flat parameters) and the unwrapped model (original parameters)."""
    named = list(model.named_parameters())
    return [
        {"params": [p for n, p in named if "blocks." in n], "lr": LR_BLOCKS},
        {"params": [p for n, p in named if "blocks." not in n and p.requires_grad]},
        {"params": [p for n, p in named if not p.requires_grad], "lr": LR_FROZEN},
    ]


def batch(step: int, rank: int, ws: int, per_rank: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(700 + step)
    x = torch.randn(per_rank * ws, D_IN, generator=g)
    y = torch.randn(per_rank * ws, D_OUT, generator=g)
    sl = slice(rank * per_rank, (rank + 1) * per_rank)
    return x[sl], y[sl]


def sharded_step(model: FSDP, opt: torch.optim.Optimizer, step: int) -> float:
    opt.zero_grad(set_to_none=True)
    x, y = batch(step, model.rank, model.world_size)
    if dist.get_backend() == "nccl":
        x, y = x.cuda(), y.cuda()
    loss = (model(x) - y).pow(2).mean()
    loss.backward()
    opt.step()
    return loss.item()


def ref_step(model: nn.Module, opt: torch.optim.Optimizer, step: int, ws: int) -> list[float]:
    """One unsharded step over ``ws`` ranks' batches, gradients combined as the sharded path does (g / pre summed
    in rank order, then / post)."""
    pre, post = divide_factors(ws, {})
    params = [p for p in model.parameters() if p.requires_grad]
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
            g = p.grad / pre if pre != 1 else p.grad.clone()
            total[i] = g if total[i] is None else total[i] + g
    for p, t in zip(params, total):
        p.grad = t / post if post != 1 else t
    opt.step()
    return losses


def assert_close(name: str, got: torch.Tensor, want: torch.Tensor, tol: tuple[float, float] | None) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, f"{name}: {got.shape}/{got.dtype} vs {want.shape}"
    if tol is None:
        assert torch.equal(got, want), f"{name}: max |diff| = {(got - want).abs().max().item():.3e}"
    else:
        torch.testing.assert_close(got, want, rtol=tol[0], atol=tol[1], msg=name)


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Two full state dicts hold the same keys and values (tensors bit for bit, extra state equal)."""
    return list(a) == list(b) and all(
        torch.equal(v, b[k]) if isinstance(v, torch.Tensor) else v == b[k] for k, v in a.items())


def reference(optim: str, schedule: list[int]) -> tuple[Net, list[list[float]]]:
    model = build()
    opt = make_opt(param_groups(model), optim)
    return model, [ref_step(model, opt, s, ws) for s, ws in enumerate(schedule)]


# --------------------------------------------------------------------------------------------------
# pools of 1 and 3 ranks (2: ``pool``, 4: ``pool4`` from conftest)
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pool1():
    with DistPool(world_size=1) as p:
        yield p


@pytest.fixture(scope="module")
def pool3():
    with DistPool(world_size=3) as p:
        yield p


def pool_of(request: pytest.FixtureRequest, world: int) -> DistPool:
    return request.getfixturevalue({1: "pool1", 2: "pool", 3: "pool3", 4: "pool4"}[world])


# --------------------------------------------------------------------------------------------------
# 1. save at 2 ranks, resume at 1, 2, 3 and 4 with a fresh model and a fresh optimizer
# --------------------------------------------------------------------------------------------------


def check_save(path: str, optim: str) -> list[float]:
    model = wrap(build())
    opt = make_opt(param_groups(model), optim)
    losses = [sharded_step(model, opt, s) for s in range(SAVE_STEPS)]
    sd = model.sharded_state_dict(opt)
    assert isinstance(sd["model.flat_param_0"], DTensor) and sd["model.flat_param_0"].shape == (103,)
    assert isinstance(sd["model.tiny.flat_param_0"], DTensor) and sd["model.tiny.flat_param_0"].shape == (2,)
    # No copies: the local pieces are views of the shards and of the live optimizer state.
    assert sd["model.flat_param_0"].to_local().data_ptr() == model.flat_param_0.data_ptr()
    per_element = "exp_avg" if optim == "adamw" else "momentum_buffer"
    assert sd[f"optim.state.flat_param_0.{per_element}"].to_local().data_ptr() == \
        opt.state[model.flat_param_0][per_element].data_ptr()
    assert not any(k.startswith("optim.state.flat_param_1.") for k in sd), "the frozen flat parameter has no state"
    dcp.save(sd, checkpoint_id=path)
    return losses


def check_resume(path: str, optim: str) -> dict[str, Any]:
    """A fresh model and optimizer (no step, wrong learning rates) load the checkpoint and train on."""
    model = wrap(build(seed=99))
    opt = make_opt(param_groups(model), optim, lr=1.0)
    sd = model.sharded_state_dict(opt)
    assert len(opt.state) == 0, "laying out a fresh optimizer's state must not step it"
    dcp.load(sd, checkpoint_id=path)
    model.load_sharded_state_dict(sd, opt)
    assert [g["lr"] for g in opt.param_groups] == [LR_BLOCKS, opt.defaults["lr"], LR_FROZEN]
    assert model.module.tag == {"version": 3}
    for h in (h for m in model._units() for h in m._unit.handles):
        st = opt.state.get(h.flat)
        if not h.flat.requires_grad:
            assert not st, "the frozen flat parameter had no state and must get none"
            continue
        valid = max(0, min(h.numel - h.rank * h.shard_numel, h.shard_numel))
        assert st and set(st) == ({"step", "exp_avg", "exp_avg_sq"} if optim == "adamw" else {"momentum_buffer"})
        for k, v in st.items():
            if k == "step":  # a 0-dim tensor, as torch keeps it
                assert torch.is_tensor(v) and v.dim() == 0 and v.item() == SAVE_STEPS, f"step {v}"
            else:  # per-element: shaped like the shard, on its device, zero padding
                assert v.shape == h.flat.shape and v.device == h.flat.device, (k, v.shape, h.flat.shape)
                assert torch.all(v[valid:] == 0), f"padding of {k} is not zero"
    losses = [sharded_step(model, opt, s) for s in range(SAVE_STEPS, SAVE_STEPS + MORE_STEPS)]
    return {"losses": losses, "model": model.state_dict()}


_SAVED: dict[str, tuple[str, list[float]]] = {}


@pytest.fixture(scope="module")
def saved(pool, tmp_path_factory) -> Any:
    def get(optim: str) -> tuple[str, list[float]]:
        if optim not in _SAVED:
            path = str(tmp_path_factory.mktemp(f"ckpt-{optim}"))
            _SAVED[optim] = (path, pool.run(check_save, path, optim)[0])
        return _SAVED[optim]

    yield get
    _SAVED.clear()


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("optim", ["adamw", "sgd"])
def test_save_at_2_resume_at_any_world_size(request, saved, optim, world):
    path, saved_losses = saved(optim)
    out = pool_of(request, world).run(check_resume, path, optim)
    ref, ref_losses = reference(optim, [WORLD] * SAVE_STEPS + [world] * MORE_STEPS)
    tol = None if world in (1, WORLD) else TOL
    assert saved_losses == [ref_losses[s][0] for s in range(SAVE_STEPS)]
    for rank, res in enumerate(out):
        want = torch.tensor([ref_losses[s][rank] for s in range(SAVE_STEPS, SAVE_STEPS + MORE_STEPS)])
        assert_close(f"rank {rank} losses", torch.tensor(res["losses"]), want, tol)
    for k, v in ref.state_dict().items():
        if k == "_extra_state":
            assert out[0]["model"][k] == v
        else:
            assert_close(k, out[0]["model"][k], v, tol)


class Holder(nn.Module):
    def __init__(self, numel: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.arange(1, numel + 1, dtype=torch.float32))


def check_dtensor_layout(numels: list[int]) -> bool:
    """Each rank's piece of the shard (padding dropped) is DTensor's Shard(0) piece of the flat range, also for
    sizes that leave the last ranks empty: the full tensor comes back in order, and the local piece is a view."""
    ws = dist.get_world_size()
    for n in numels:
        model = FSDP(Holder(n))
        h = model._unit.handles[0]
        dt = model.sharded_state_dict()["model.flat_param_0"]
        valid = max(0, min(n - h.rank * h.shard_numel, h.shard_numel))
        assert dt.shape == (n,) and dt.to_local().shape == (valid,), (n, ws, dt.to_local().shape)
        assert valid == 0 or dt.to_local().data_ptr() == model.flat_param_0.data_ptr()
        assert torch.equal(dt.full_tensor(), torch.arange(1, n + 1, dtype=torch.float32)), (n, ws)
    return True


def test_pieces_are_dtensor_shard0_pieces(pool3, pool4):
    numels = [1, 2, 3, 4, 5, 6, 7, 9, 13]  # 4 ranks: 5 -> (2, 2, 1, 0), 4 -> (1, 1, 1, 1); 3 ranks: 4 -> (2, 2, 0)
    assert pool3.run(check_dtensor_layout, numels) == [True] * 3
    assert pool4.run(check_dtensor_layout, numels) == [True] * 4


# --------------------------------------------------------------------------------------------------
# 2. use_orig_params: the optimizer holds the original parameters (groups per parameter)
# --------------------------------------------------------------------------------------------------


def orig_groups(model: nn.Module) -> list[dict[str, Any]]:
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [
        {"params": [p for n, p in named if n.endswith("weight")], "weight_decay": 0.1},
        {"params": [p for n, p in named if not n.endswith("weight")], "weight_decay": 0.0, "lr": 3e-3},
    ]


def check_orig_params(path: str, save: bool) -> dict[str, Any]:
    model = wrap(build(seed=1234 if save else 5), use_orig_params=True)
    opt = torch.optim.AdamW(orig_groups(model), lr=1e-2)
    if save:
        for s in range(SAVE_STEPS):
            sharded_step(model, opt, s)
        dcp.save(model.sharded_state_dict(opt), checkpoint_id=path)
        return {}
    sd = model.sharded_state_dict(opt)
    dcp.load(sd, checkpoint_id=path)
    model.load_sharded_state_dict(sd, opt)
    losses = [sharded_step(model, opt, s) for s in range(SAVE_STEPS, SAVE_STEPS + MORE_STEPS)]
    return {"losses": losses, "model": model.state_dict()}


def test_use_orig_params_resumes_at_4_ranks(pool, pool4, tmp_path):
    pool.run(check_orig_params, str(tmp_path), True)
    out = pool4.run(check_orig_params, str(tmp_path), False)
    ref = build()
    opt = torch.optim.AdamW(orig_groups(ref), lr=1e-2)
    ref_losses = [ref_step(ref, opt, s, ws) for s, ws in enumerate([WORLD] * SAVE_STEPS + [4] * MORE_STEPS)]
    for rank, res in enumerate(out):
        want = torch.tensor([ref_losses[s][rank] for s in range(SAVE_STEPS, SAVE_STEPS + MORE_STEPS)])
        assert_close(f"rank {rank} losses", torch.tensor(res["losses"]), want, TOL)
    for k, v in ref.state_dict().items():
        if k != "_extra_state":
            assert_close(k, out[0]["model"][k], v, TOL)


# --------------------------------------------------------------------------------------------------
# 3. a fresh optimizer saved before any step: parameters without state load without state
# --------------------------------------------------------------------------------------------------


def check_fresh_optimizer_round_trip(path: str) -> bool:
    a = wrap(build())
    opt_a = make_opt(param_groups(a), "adamw")
    dcp.save(a.sharded_state_dict(opt_a), checkpoint_id=path)
    assert len(opt_a.state) == 0
    b = wrap(build(seed=3))
    opt_b = make_opt(param_groups(b), "adamw", lr=1.0)
    sd = b.sharded_state_dict(opt_b)
    dcp.load(sd, checkpoint_id=path)
    b.load_sharded_state_dict(sd, opt_b)
    assert len(opt_b.state) == 0, "parameters saved without state must load without state"
    for s in range(2):
        assert sharded_step(a, opt_a, s) == sharded_step(b, opt_b, s)
    assert same(a.state_dict(), b.state_dict())
    return True


def test_fresh_optimizer_without_state_round_trips(pool, tmp_path):
    assert pool.run(check_fresh_optimizer_round_trip, str(tmp_path)) == [True] * WORLD


def check_loaded_into_copies(path: str, orig: bool) -> bool:
    """``dcp.load`` into copies of the dict's pieces (``DTensor.clone()``, e.g. the dict moved to another device
    and back): the padded shards are rebuilt from the copies' local pieces, which hold the loaded values."""
    a = wrap(build(), use_orig_params=orig)
    opt_a = make_opt(param_groups(a), "adamw")
    sharded_step(a, opt_a, 0)
    dcp.save(a.sharded_state_dict(opt_a), checkpoint_id=path)
    b = wrap(build(seed=3), use_orig_params=orig)
    opt_b = make_opt(param_groups(b), "adamw", lr=1.0)
    sharded_step(b, opt_b, 5)  # state of its own, to be replaced
    state = torch.utils._pytree.tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v),
                                         b.sharded_state_dict(opt_b))
    dcp.load(state, checkpoint_id=path)
    b.load_sharded_state_dict(state, opt_b)
    assert same(a.state_dict(), b.state_dict()), "the loaded values did not reach the model"
    for s in range(1, 3):
        assert sharded_step(a, opt_a, s) == sharded_step(b, opt_b, s)
    assert same(a.state_dict(), b.state_dict())
    return True


@pytest.mark.parametrize("orig", [False, True], ids=["flat", "orig-params"])
def test_load_into_copies_of_the_pieces(pool, tmp_path, orig):
    assert pool.run(check_loaded_into_copies, str(tmp_path), orig) == [True] * WORLD


# --------------------------------------------------------------------------------------------------
# 4. errors
# --------------------------------------------------------------------------------------------------


class Renamed(Net):
    """The same flat parameters (keys and sizes) made of other parameters: ``inp`` is called ``first``."""

    def __init__(self) -> None:
        super().__init__()
        self.first = self.inp
        del self.inp

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - never run
        raise NotImplementedError


def check_errors(path: str) -> bool:
    model = wrap(build())
    opt = make_opt(param_groups(model), "adamw")
    sharded_step(model, opt, 0)
    with pytest.raises(RuntimeError, match="must be called on the root FullyShardedDataParallel"):
        model.blocks[0].sharded_state_dict()
    with pytest.raises(RuntimeError, match="must be called on the root FullyShardedDataParallel"):
        model.blocks[0].load_sharded_state_dict({})
    with pytest.raises(ValueError, match="needs the dict that sharded_state_dict.. made"):
        model.load_sharded_state_dict(model.state_dict())
    with pytest.raises(ValueError, match="needs the dict that sharded_state_dict.. made"):
        model.load_sharded_state_dict([1, 2])
    sd = model.sharded_state_dict(opt)
    with pytest.raises(ValueError, match="was not filled by torch.distributed.checkpoint.load"):
        model.load_sharded_state_dict(sd, opt)
    dcp.save(sd, checkpoint_id=path)
    sd = model.sharded_state_dict(opt)
    dcp.load(sd, checkpoint_id=path)
    with pytest.raises(ValueError, match="holds optimizer state .* pass the optimizer too"):
        model.load_sharded_state_dict(sd)
    model.load_sharded_state_dict(sd, opt)  # the same dict, with the optimizer: fine
    # A dict made without the optimizer cannot load it.
    sd = model.sharded_state_dict()
    dcp.load(sd, checkpoint_id=path)
    with pytest.raises(ValueError, match="made by sharded_state_dict.. without an optimizer"):
        model.load_sharded_state_dict(sd, opt)
    model.load_sharded_state_dict(sd)  # the model alone: fine
    # Other param groups.
    one_group = make_opt([{"params": list(model.parameters())}], "adamw")
    sd = model.sharded_state_dict(one_group)
    dcp.load(sd, checkpoint_id=path)
    with pytest.raises(ValueError, match="param groups hold other parameters than the saved ones"):
        model.load_sharded_state_dict(sd, one_group)
    # Another wrapping: refused inside dcp.load by SafeLoadPlanner, before torch's bare "Size mismatch", naming the
    # flat parameters, the saved and expected sizes, and the fix, on every rank.
    other = wrap(build(), nested=False)
    numel = other.sharded_state_dict()["model.flat_param_0"].shape[0]
    with pytest.raises(CheckpointException) as failed:
        dcp.load(other.sharded_state_dict(), checkpoint_id=path, planner=SafeLoadPlanner())
    errors = [exc for exc, _ in failed.value.failures.values()]
    want = (r"saved from another wrapping of the model: flat parameters of other sizes "
            rf"\['model.flat_param_0: \d+ elements in the checkpoint, {numel} here \(gain, inp"
            r".*only in this model \[\].*only in the checkpoint \['model.blocks.0.flat"
            r".*wrap the model the same way as when it was saved")
    assert len(errors) == WORLD and all(isinstance(e, ValueError) and re.search(want, str(e)) for e in errors), errors
    # torch's default planner knows nothing of shardfuse: its own error (the size mismatch), no load.
    with pytest.raises(CheckpointException, match="model.flat_param_0"):
        dcp.load(other.sharded_state_dict(), checkpoint_id=path)
    with pytest.raises(ValueError, match="not filled by torch.distributed.checkpoint.load"):
        other.load_sharded_state_dict(other.sharded_state_dict())
    # The same keys and sizes, other parameters: the metadata check.
    renamed = wrap(Renamed())
    sd = renamed.sharded_state_dict()
    dcp.load(sd, checkpoint_id=path)
    with pytest.raises(ValueError, match=r"flat_param_0 was saved from other parameters than this model's: .*'inp"):
        renamed.load_sharded_state_dict(sd)
    # A unit the checkpoint has and this model lacks (torch.distributed.checkpoint ignores extra keys).
    no_tiny = wrap(build(with_tiny=False))
    sd = no_tiny.sharded_state_dict()
    dcp.load(sd, checkpoint_id=path)
    with pytest.raises(ValueError, match=r"another wrapping: flat parameters only in the checkpoint \['tiny.flat"):
        no_tiny.load_sharded_state_dict(sd)
    # Ranks holding different optimizer state: one clear error on every rank.
    fresh = wrap(build())
    opt = make_opt(param_groups(fresh), "sgd")
    if dist.get_rank() == 0:
        for p in fresh.parameters():
            p.grad = torch.ones_like(p) if p.requires_grad else None
        opt.step()
    with pytest.raises(RuntimeError, match="the ranks hold different optimizer state"):
        fresh.sharded_state_dict(opt)
    return True


def test_errors(pool, tmp_path):
    assert pool.run(check_errors, str(tmp_path)) == [True] * WORLD


# --------------------------------------------------------------------------------------------------
# 5. torch.distributed.checkpoint.state_dict: the model works, the optimizer is refused
# --------------------------------------------------------------------------------------------------


def check_raw_optimizer_state_dict_refused(path: str) -> bool:
    """The path users try first, dcp of ``opt.state_dict()``: DCP keeps one rank's copy of its keys (the same on
    every rank) and loads them back under string keys that name no parameter. The next step refuses, on every
    rank, before it uses the state."""
    model = wrap(build())
    opt = make_opt(param_groups(model), "adamw")
    for s in range(2):
        sharded_step(model, opt, s)
    marks = {opt.state[h.flat]["shardfuse_shard"] for m in model._units() for h in m._unit.handles
             if h.flat.requires_grad}
    assert marks == {(model.rank, WORLD)}, marks
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=path)
    model = wrap(build(seed=99))
    opt = make_opt(param_groups(model), "adamw")
    sharded_step(model, opt, 0)  # the "dummy step" users take so that the state exists to load into
    sd = {"model": model.state_dict(), "optim": opt.state_dict()}
    dcp.load(sd, checkpoint_id=path)
    model.load_state_dict(sd["model"])
    opt.load_state_dict(sd["optim"])
    with pytest.raises(RuntimeError, match=r"AdamW holds optimizer state under keys \['0', '1', '2', '3'\] that "
                                           r"name no parameter.*sharded_state_dict\(optim\)"):
        opt.step()
    return True


def test_raw_optimizer_state_dict_through_dcp_is_refused(pool, tmp_path):
    assert pool.run(check_raw_optimizer_state_dict_refused, str(tmp_path)) == [True] * WORLD


def check_raw_optimizer_state_dict_into_fresh_optimizer_refused(path: str) -> bool:
    """The same save, loaded into a fresh model and a fresh optimizer that never stepped: DCP reads only the keys
    of the fresh optimizer's empty state dict, so the saved state is dropped and ``load_state_dict`` takes the
    param groups alone. The first step refuses on every rank, before creating any state; so does the optimizer
    object handed to DCP. A fresh optimizer that loaded nothing, and shardfuse's loaders, step as before."""
    model = wrap(build())
    opt = make_opt(param_groups(model), "adamw")
    for s in range(2):
        sharded_step(model, opt, s)
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=f"{path}/plain")
    dcp.save({"optim": opt}, checkpoint_id=f"{path}/object")
    fresh = wrap(build(seed=99))
    fresh_opt = make_opt(param_groups(fresh), "adamw")
    sd = {"model": fresh.state_dict(), "optim": fresh_opt.state_dict()}
    dcp.load(sd, checkpoint_id=f"{path}/plain")
    fresh.load_state_dict(sd["model"])
    assert same(fresh.state_dict(), model.state_dict())  # the model resumes
    fresh_opt.load_state_dict(sd["optim"])
    refused = r"AdamW was loaded with load_state_dict\(\) from a state dict that holds no state .*sharded_state_dict"
    with pytest.raises(RuntimeError, match=refused):
        sharded_step(fresh, fresh_opt, 2)
    assert len(fresh_opt.state) == 0, "refused before the step created state"
    other = make_opt(param_groups(fresh), "adamw")
    dcp.load({"optim": other}, checkpoint_id=f"{path}/object")
    with pytest.raises(RuntimeError, match=refused):
        sharded_step(fresh, other, 2)
    # Not refused: a fresh optimizer that loaded nothing, and one that loaded a stepped optimizer's state (the
    # never-stepped optimizer of a sharded checkpoint: test_fresh_optimizer_without_state_round_trips).
    sharded_step(fresh, make_opt(param_groups(fresh), "adamw"), 2)
    resumed = make_opt(param_groups(fresh), "adamw")
    resumed.load_state_dict(copy.deepcopy(opt.state_dict()))
    sharded_step(fresh, resumed, 3)
    return True


def test_raw_optimizer_state_dict_into_fresh_optimizer_is_refused(pool, tmp_path):
    assert pool.run(check_raw_optimizer_state_dict_into_fresh_optimizer_refused, str(tmp_path)) == [True] * WORLD


def check_optimizer_object_through_dcp_refused(path: str) -> bool:
    """The optimizer object itself handed to DCP (a Stateful: DCP calls its state_dict / load_state_dict)."""
    model = wrap(build())
    opt = make_opt(param_groups(model), "sgd")
    sharded_step(model, opt, 0)
    dcp.save({"optim": opt}, checkpoint_id=path)
    sharded_step(model, opt, 1)
    dcp.load({"optim": opt}, checkpoint_id=path)
    with pytest.raises(RuntimeError, match=r"SGD holds optimizer state under keys .* that name no parameter"):
        opt.step()
    return True


def test_optimizer_object_through_dcp_is_refused(pool, tmp_path):
    assert pool.run(check_optimizer_object_through_dcp_refused, str(tmp_path)) == [True] * WORLD


def check_other_ranks_optimizer_state_refused(path: str) -> bool:
    """Every rank loads rank 0's per-rank file (or any state of another rank's shards): refused at the next step
    on the other ranks; rank 0's own file resumes."""
    model = wrap(build())
    opt = make_opt(param_groups(model), "adamw")
    sharded_step(model, opt, 0)
    if model.rank == 0:
        torch.save(opt.state_dict(), f"{path}/optim-rank0.pt")
    dist.barrier()
    opt.load_state_dict(torch.load(f"{path}/optim-rank0.pt", weights_only=True))
    if model.rank == 0:
        opt.step()
        return True
    with pytest.raises(RuntimeError, match=r"AdamW holds the optimizer state of rank 0 of 2, but this rank trains "
                                           r"the shard of rank 1 of 2 \(group 0, parameter 0\).*another rank's copy"):
        opt.step()
    return True


def test_other_ranks_optimizer_state_is_refused(pool, tmp_path):
    assert pool.run(check_other_ranks_optimizer_state_refused, str(tmp_path)) == [True] * WORLD


def check_per_rank_torch_save_round_trip(path: str) -> bool:
    """Per-rank files of ``opt.state_dict()`` (torch.save, torch.load with weights_only) resume exactly."""
    model = wrap(build())
    opt = make_opt(param_groups(model), "adamw")
    for s in range(2):
        sharded_step(model, opt, s)
    f = f"{path}/optim-rank{model.rank}.pt"
    torch.save(opt.state_dict(), f)
    ref = copy.deepcopy(opt.state_dict())
    want = sharded_step(model, opt, 2)
    opt.load_state_dict(torch.load(f, weights_only=True))
    model2 = wrap(build())
    opt2 = make_opt(param_groups(model2), "adamw")
    for s in range(2):
        sharded_step(model2, opt2, s)
    opt2.load_state_dict(torch.load(f, weights_only=True))
    for k, v in opt2.state_dict()["state"].items():
        for name, t in v.items():
            assert (torch.equal(t, ref["state"][k][name]) if torch.is_tensor(t) else t == ref["state"][k][name])
    assert sharded_step(model2, opt2, 2) == want
    return True


def test_per_rank_torch_save_round_trip(pool, tmp_path):
    assert pool.run(check_per_rank_torch_save_round_trip, str(tmp_path)) == [True] * WORLD


def check_torch_state_dict_api(path: str) -> bool:
    model = wrap(build())
    opt = make_opt(param_groups(model), "adamw")
    sharded_step(model, opt, 0)
    # Outside torch's API the optimizer's state dict is the plain one (per-rank shards, FairScale's format).
    assert not any(isinstance(v, DTensor) for st in opt.state_dict()["state"].values() for v in st.values())
    fresh = wrap(build())
    fresh_opt = make_opt(param_groups(fresh), "adamw")
    for options in (StateDictOptions(full_state_dict=True), StateDictOptions(cpu_offload=True)):
        with pytest.raises(RuntimeError, match=rf"StateDictOptions\((full_state_dict|cpu_offload)=True\) {DSD_ERROR}"):
            get_state_dict(fresh, fresh_opt, options=options)
    assert len(fresh_opt.state) == 0, "refused before torch's dummy optimizer step"
    assert all(p.grad is None for p in fresh.parameters())
    orig = wrap(build(), use_orig_params=True)
    with pytest.raises(RuntimeError, match=rf"{DSD_ERROR} wrapped with use_orig_params=True.*sharded_state_dict"):
        get_optimizer_state_dict(orig, make_opt(param_groups(orig), "adamw"))
    msd = model.state_dict()
    with pytest.raises(RuntimeError, match="ignore_frozen_params=True. is not supported"):
        get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=True))
    with pytest.raises(RuntimeError, match="full_state_dict=True. is not supported"):
        set_model_state_dict(fresh, msd, options=StateDictOptions(full_state_dict=True))
    # The model alone: full tensors under the original names, which DCP saves once.
    got = get_model_state_dict(model)
    assert same(got, msd)
    set_model_state_dict(fresh, got)
    assert same(fresh.state_dict(), msd)
    dcp.save({"model": got}, checkpoint_id=path)
    return True


def check_dsd_save(path: str, optim: str, flatten: bool) -> list[float]:
    """torch's get_state_dict: the optimizer's per-element state of each flat parameter is a DTensor of its
    whole flat range (a view of the live state), so DCP writes each rank's piece once."""
    model = wrap(build())
    opt = make_opt(param_groups(model), optim)
    losses = [sharded_step(model, opt, s) for s in range(SAVE_STEPS)]
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=flatten))
    per_element = "exp_avg" if optim == "adamw" else "momentum_buffer"
    values = list(osd.values()) if flatten else [v for st in osd["state"].values() for v in st.values()]
    dt = [v for v in values if isinstance(v, DTensor)]
    assert dt and all(v.placements == (Shard(0),) for v in dt), [type(v).__name__ for v in values]
    keys = list(osd) if flatten else [k for st in osd["state"].values() for k in st]
    assert not any("shardfuse_shard" in k for k in keys), "the shard marks stay out of torch's dict"
    live = opt.state[model.flat_param_0][per_element]
    assert any(v.to_local().numel() and v.to_local().data_ptr() == live.data_ptr() for v in dt), "not a view"
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    return losses


def check_dsd_resume(path: str, optim: str, flatten: bool) -> dict[str, Any]:
    """A fresh model and optimizer (no step, wrong learning rates) through get_state_dict, dcp.load and
    set_state_dict, at any world size."""
    model = wrap(build(seed=99))
    opt = make_opt(param_groups(model), optim, lr=1.0)
    options = StateDictOptions(flatten_optimizer_state_dict=flatten)
    msd, osd = get_state_dict(model, opt, options=options)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"], options=options)
    assert [g["lr"] for g in opt.param_groups] == [LR_BLOCKS, opt.defaults["lr"], LR_FROZEN]
    assert not any(isinstance(v, DTensor) for st in opt.state.values() for v in st.values())
    losses = [sharded_step(model, opt, s) for s in range(SAVE_STEPS, SAVE_STEPS + MORE_STEPS)]
    return {"losses": losses, "model": model.state_dict()}


@pytest.mark.parametrize(("optim", "flatten", "world"),
                         [("adamw", False, 1), ("adamw", False, 2), ("sgd", False, 3), ("adamw", True, 4)])
def test_torch_get_set_state_dict_reshards(request, pool, tmp_path, optim, flatten, world):
    saved_losses = pool.run(check_dsd_save, str(tmp_path), optim, flatten)[0]
    out = pool_of(request, world).run(check_dsd_resume, str(tmp_path), optim, flatten)
    ref, ref_losses = reference(optim, [WORLD] * SAVE_STEPS + [world] * MORE_STEPS)
    tol = None if world in (1, WORLD) else TOL
    assert saved_losses == [ref_losses[s][0] for s in range(SAVE_STEPS)]
    for rank, res in enumerate(out):
        want = torch.tensor([ref_losses[s][rank] for s in range(SAVE_STEPS, SAVE_STEPS + MORE_STEPS)])
        assert_close(f"rank {rank} losses", torch.tensor(res["losses"]), want, tol)
    for k, v in ref.state_dict().items():
        if k == "_extra_state":
            assert out[0]["model"][k] == v
        else:
            assert_close(k, out[0]["model"][k], v, tol)


def check_torch_model_state_dict_load(path: str, want: dict[str, torch.Tensor]) -> bool:
    model = wrap(build(seed=8))
    sd = {"model": get_model_state_dict(model)}
    dcp.load(sd, checkpoint_id=path)
    set_model_state_dict(model, sd["model"])
    assert same(model.state_dict(), want)
    return True


def check_full_state_dict() -> dict[str, torch.Tensor]:
    model = wrap(build())
    opt = make_opt(param_groups(model), "adamw")
    sharded_step(model, opt, 0)
    return model.state_dict()


def test_torch_state_dict_api(pool, pool3, tmp_path):
    assert pool.run(check_torch_state_dict_api, str(tmp_path)) == [True] * WORLD
    want = pool.run(check_full_state_dict)[0]
    assert pool3.run(check_torch_model_state_dict_load, str(tmp_path), want) == [True] * 3


def test_wrapper_answers_fqn_modifiers_outside_torch(pool):
    """Outside torch.distributed.checkpoint.state_dict, _fqn_modifiers is a plain (empty) answer."""
    assert pool.run(_fqn_modifiers_plain) == [{}] * WORLD


def _fqn_modifiers_plain() -> dict[str, str]:
    return wrap(build())._fqn_modifiers()


# --------------------------------------------------------------------------------------------------
# GPU (NCCL): shards on the GPU or on the host (move_params_to_cpu), 2 GPUs to 1
# --------------------------------------------------------------------------------------------------


def _gpu_model(seed: int, move_params_to_cpu: bool) -> FSDP:
    m = build(seed)
    return wrap(m if move_params_to_cpu else m.cuda(), move_params_to_cpu=move_params_to_cpu)


def _gpu_opt(model: FSDP, move_params_to_cpu: bool, **override: Any) -> torch.optim.Optimizer:
    # fused AdamW keeps step on the GPU: the fresh layout must put it there too
    groups = [{**g, **override} for g in param_groups(model)]
    return torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1, fused=not move_params_to_cpu)


def check_gpu_save_and_resume(path: str, move_params_to_cpu: bool) -> dict[str, Any]:
    a = _gpu_model(1234, move_params_to_cpu)
    opt_a = _gpu_opt(a, move_params_to_cpu)
    for s in range(SAVE_STEPS):
        sharded_step(a, opt_a, s)
    sd = a.sharded_state_dict(opt_a)
    assert sd["model.flat_param_0"].device_mesh.device_type == ("cpu" if move_params_to_cpu else "cuda")
    dcp.save(sd, checkpoint_id=path)
    saved = a.state_dict()
    c = _gpu_model(7, move_params_to_cpu)
    opt_c = _gpu_opt(c, move_params_to_cpu, lr=1.0)
    sd = c.sharded_state_dict(opt_c)
    assert len(opt_c.state) == 0
    dcp.load(sd, checkpoint_id=path)
    c.load_sharded_state_dict(sd, opt_c)
    (want,) = {p.device for p in c.parameters()}
    for st in opt_c.state.values():  # fused: step lives on the GPU, as the optimizer itself keeps it
        assert st["exp_avg"].device == want and (move_params_to_cpu or st["step"].device == want)
    for s in range(SAVE_STEPS, SAVE_STEPS + MORE_STEPS):
        la, lc = sharded_step(a, opt_a, s), sharded_step(c, opt_c, s)
        assert la == lc, f"step {s}: {la} vs {lc}"
    assert same(a.state_dict(), c.state_dict())
    if not move_params_to_cpu:  # torch's API: the per-element optimizer state as DTensors of the GPU shards
        _, osd = get_state_dict(c, opt_c)
        per = [v for st in osd["state"].values() for k, v in st.items() if k in ("exp_avg", "exp_avg_sq")]
        assert per and all(isinstance(v, DTensor) and v.device_mesh.device_type == "cuda" for v in per), per
    return {k: (v.cpu() if torch.is_tensor(v) else v) for k, v in saved.items()}


def check_gpu_load_at_1(path: str, move_params_to_cpu: bool, want: dict[str, Any]) -> bool:
    model = _gpu_model(7, move_params_to_cpu)
    opt = _gpu_opt(model, move_params_to_cpu)
    sd = model.sharded_state_dict(opt)
    dcp.load(sd, checkpoint_id=path)
    model.load_sharded_state_dict(sd, opt)
    got = {k: (v.cpu() if torch.is_tensor(v) else v) for k, v in model.state_dict().items()}
    assert same(got, want)
    assert all(st["step"].item() == SAVE_STEPS for st in opt.state.values())
    sharded_step(model, opt, SAVE_STEPS)
    return True


@pytest.mark.multigpu
def test_gpu_nccl_save_at_2_resume_at_2_and_1(tmp_path):
    saved = {}
    with DistPool(world_size=2, backend="nccl", timeout_s=300) as p:
        for move in (False, True):
            saved[move] = p.run(check_gpu_save_and_resume, str(tmp_path / f"move{move}"), move)[0]
    with DistPool(world_size=1, backend="nccl", timeout_s=300) as p:
        for move in (False, True):
            assert p.run(check_gpu_load_at_1, str(tmp_path / f"move{move}"), move, saved[move]) == [True]
