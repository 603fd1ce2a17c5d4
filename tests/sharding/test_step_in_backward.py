"""StepInBackward (each unit stepped as its gradient is reduced, the gradient freed then) against stepping the plain
optimizer after backward, in a 2-process gloo group: parameters, losses and optimizer state equal bit for bit after
several steps (nested units, original parameters, mixed precision, checkpointing, a unit unused in some steps, tied
weights, no_sync accumulation, SGD, fused AdamW, an LR scheduler); no unit's sharded gradient outlives its update;
and every misuse raises, naming the fix."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardfuse import StepInBackward
from shardfuse.sharding import FullyShardedDataParallel as FSDP
from tests._asserts import assert_same_training_state
from tests.sharding import _models
from tests.sharding._models import batch, loss_fn, make_optim, wrap_model

WORLD = 2
STEPS = 4


def _handles(model: FSDP) -> list[Any]:
    seen: dict[int, Any] = {}
    for m in model.modules():
        if isinstance(m, FSDP):
            for h in m._unit.handles:
                seen.setdefault(id(h), h)
    return list(seen.values())


def _wrap(net: Any, cfg: dict[str, Any]) -> FSDP:
    if not cfg.get("use_orig_params"):
        return wrap_model(net, cfg)
    kw = {**_models.fsdp_kwargs(cfg), "use_orig_params": True}
    for i in range(len(net.blocks)):
        net.blocks[i] = FSDP(net.blocks[i], **kw)
    return FSDP(net, **kw)


def train(cfg: dict[str, Any], in_backward: bool, steps: int = STEPS) -> tuple[FSDP, Any, list[float], list[int]]:
    """``steps`` steps of the test model; with ``in_backward`` the optimizer is a StepInBackward. Also returns, for
    every update it ran in backward, how many sharded gradients existed at that moment (the unit's own included)."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    model = _wrap(_models.build(cfg), cfg)
    if cfg.get("fused"):
        opt: Any = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    elif cfg.get("groups"):  # two groups of their own settings; with "subset" the root unit's shard in none
        blocks = [p for b in model.blocks for p in b.parameters()]
        rest = [] if cfg.get("subset") else [p for p in model.parameters() if all(p is not q for q in blocks)]
        opt = torch.optim.AdamW([{"params": blocks, "lr": 3e-2, "weight_decay": 0.0},
                                 *([{"params": rest}] if rest else [])], lr=1e-2, weight_decay=0.1)
    else:
        opt = make_optim(model.parameters(), cfg)
    live: list[int] = []
    if in_backward:
        opt = StepInBackward(model, opt)
        handles, on_grad = _handles(model), opt._on_grad

        def counting(handle: Any) -> bool:
            live.append(sum(h.flat.grad is not None for h in handles))
            return on_grad(handle)

        opt._on_grad = counting  # type: ignore[method-assign]
        for h in handles:  # the consumer holds the bound method weakly: point it at the counting one
            h.grad_consumer = lambda handle, _c=counting: _c(handle)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5) if cfg.get("scheduler") else None
    micro = cfg.get("no_sync_micro", 1)
    losses = []
    for step in range(steps):
        for m in range(micro):
            with model.no_sync() if m < micro - 1 else contextlib.nullcontext():
                ids, target = batch(step * micro + m, rank, ws)
                loss = loss_fn(model, ids, target, step, cfg)
                loss.backward()
                losses.append(loss.item())
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad(set_to_none=cfg.get("set_to_none", True))
    return model, opt, losses, live


def check_same_as_plain(cfg: dict[str, Any]) -> bool:
    model, opt, losses, live = train(cfg, in_backward=True)
    ref, ref_opt, ref_losses, _ = train(cfg, in_backward=False)
    assert losses == ref_losses, f"losses differ: {losses} vs {ref_losses}"
    assert_same_training_state(model, ref, opt, ref_opt)
    # Every trained unit the optimizer holds was stepped in backward, each with no other unit's sharded gradient
    # alive beside its own (a unit the optimizer does not hold keeps its gradient, as without StepInBackward).
    held = {id(h) for h in _handles(model) if h.requires_grad} - ({id(model._unit.handles[0])} if cfg.get("subset")
                                                                   else set())
    assert len(live) >= STEPS * (len(held) - (1 if cfg.get("extra") else 0)), live
    assert live and max(live) == 1 + bool(cfg.get("subset")), f"sharded gradients alive at an update: {live}"
    assert all((p.grad is None) == (id(h) in held) for h in _handles(model) for p in [h.flat] if h.requires_grad)
    return True


CASES = {
    "adamw": dict(),
    "adamw-flat-root": dict(nested=False),
    "adamw-fused": dict(fused=True),
    "sgd-momentum": dict(optim="sgd"),
    "orig-params": dict(use_orig_params=True),
    "mixed-bf16": dict(mixed_precision=True, compute_dtype=torch.bfloat16),
    "checkpointed": dict(ckpt=True),
    "unused-unit-tied": dict(extra=True, tied=True),
    "frozen": dict(frozen=True),
    "no-sync": dict(no_sync_micro=3),
    "scheduler": dict(scheduler=True),
    "zero-to-zeros": dict(set_to_none=False),
    "no-reshard": dict(reshard_after_forward=False),
    "param-groups": dict(groups=True),
    "optimizer-over-some-units": dict(groups=True, subset=True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_step_in_backward_equals_plain(pool, name):
    assert pool.run(check_same_as_plain, CASES[name]) == [True] * WORLD


def _one_backward(model: FSDP, step: int = 0) -> None:
    ids, target = batch(step, dist.get_rank(), dist.get_world_size())
    loss_fn(model, ids, target, step, {}).backward()


def check_misuse_raises() -> bool:
    model = wrap_model(_models.build({}), {})
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt = StepInBackward(model, inner)
    _one_backward(model)
    with pytest.raises(RuntimeError, match="clip_grad_norm_ with StepInBackward.*train without clipping"):
        model.clip_grad_norm_(1.0)
    with pytest.raises(RuntimeError, match=r"AdamW.step\(\) called on the optimizer a StepInBackward drives"):
        inner.step()
    with pytest.raises(RuntimeError, match=r"already stepped .* call step\(\) after every synced backward"):
        _one_backward(model, 1)  # no step() in between
    with pytest.raises(ValueError, match="takes no closure"):
        opt.step(lambda: 0.0)
    with pytest.raises(TypeError, match="per-element optimizers .* got RMSprop"):
        StepInBackward(model, torch.optim.RMSprop(model.parameters()))
    with pytest.raises(ValueError, match="not the nested"):
        StepInBackward(model.blocks[0], torch.optim.AdamW(model.blocks[0].parameters()))
    with pytest.raises(TypeError, match="root FullyShardedDataParallel model, got Linear"):
        StepInBackward(torch.nn.Linear(2, 2), inner)
    offloaded = wrap_model(_models.build({}), {"move_params_to_cpu": True})
    with pytest.raises(ValueError, match=r"OffloadOptimizer\(model, optimizer, step_in_backward=True\)"):
        StepInBackward(offloaded, torch.optim.AdamW(offloaded.parameters()))
    return True


def check_grad_scaler_refused() -> bool:
    model = wrap_model(_models.build({}), {})
    opt = StepInBackward(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    scaler = torch.amp.GradScaler("cpu")
    ids, target = batch(0, dist.get_rank(), dist.get_world_size())
    scaler.scale(loss_fn(model, ids, target, 0, {})).backward()
    with pytest.raises(RuntimeError, match="GradScaler .* train in bf16"):
        scaler.step(opt)
    return True


def check_close_hands_back() -> bool:
    """After close() gradients stay after backward and the user's optimizer steps them, as without it; a second
    StepInBackward on the same model replaces the first."""
    model = wrap_model(_models.build({}), {})
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = StepInBackward(model, inner)
    opt = StepInBackward(model, inner)  # replaces ``first``: its refusal of inner.step() is gone with it
    _one_backward(model)
    assert all(p.grad is None for p in model.parameters())
    opt.step()
    opt.close()
    _one_backward(model, 1)
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    before = [p.detach().clone() for p in model.parameters()]
    inner.step()
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    del first
    again = StepInBackward(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    model.double()  # moving or casting the model closes it: the gradients stay after backward again
    assert all(h.grad_consumer is None for h in _handles(model)) and again is not None
    return True


def check_load_state_dict_is_followed() -> bool:
    """A state dict loaded into the StepInBackward (a resume) is what the next backward's updates continue from:
    the same parameters as the plain optimizer loading it."""
    out = []
    for in_backward in (True, False):
        model = wrap_model(_models.build({}), {})
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
        opt: Any = StepInBackward(model, inner) if in_backward else inner
        for step in range(2):
            _one_backward(model, step)
            opt.step()
            opt.zero_grad()
        saved = opt.state_dict()
        for state in saved["state"].values():  # a resume that changed the moments: visible only if followed
            state["exp_avg"].mul_(-3.0)
        opt.load_state_dict(saved)
        _one_backward(model, 2)
        opt.step()
        out.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*out))
    return True


@pytest.mark.parametrize("check", [check_misuse_raises, check_grad_scaler_refused, check_close_hands_back,
                                   check_load_state_dict_is_followed])
def test_step_in_backward_contract(pool, check):
    assert pool.run(check) == [True] * WORLD


def check_checkpoints(path: str) -> bool:
    """A DCP checkpoint of a StepInBackward run (model and optimizer through ``sharded_state_dict(opt)``) loads into a
    fresh model and a fresh StepInBackward, and the next step equals the original's; the full optimizer state
    consolidates (``gather_full_optim_state_dict``) as for the plain optimizer."""
    import torch.distributed.checkpoint as dcp

    def make() -> tuple[FSDP, StepInBackward]:
        model = wrap_model(_models.build({}), {})
        return model, StepInBackward(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))

    model, opt = make()
    for step in range(2):
        _one_backward(model, step)
        opt.step()
        opt.zero_grad()
    dcp.save(model.sharded_state_dict(opt), checkpoint_id=path)
    full = model.gather_full_optim_state_dict(opt)
    plain = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    plain.load_state_dict(opt.state_dict())  # the same state, through the plain optimizer
    want = model.gather_full_optim_state_dict(plain)
    if dist.get_rank() == 0:
        assert full is not None and want is not None
        assert full["param_groups"] == want["param_groups"]
        for i, st in want["state"].items():
            assert all(torch.equal(full["state"][i][k], v) for k, v in st.items() if isinstance(v, torch.Tensor))
    fresh, fresh_opt = make()
    state = fresh.sharded_state_dict(fresh_opt)
    dcp.load(state, checkpoint_id=path)
    fresh.load_sharded_state_dict(state, fresh_opt)
    for m, o in ((model, opt), (fresh, fresh_opt)):
        _one_backward(m, 2)
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    return True


def test_step_in_backward_checkpoints(pool, tmp_path):
    assert pool.run(check_checkpoints, str(tmp_path / "ckpt")) == [True] * WORLD


def check_fresh_wrappers_give_a_sharded_state_dict() -> bool:
    """A fresh StepInBackward or OffloadOptimizer (no step yet: the state's layout is learned by stepping a copy of
    the optimizer they wrap) gives the sharded state dict to load a checkpoint into, with the optimizer's entries."""
    from shardfuse import OffloadOptimizer

    resident = wrap_model(_models.build({}), {})
    offloaded = wrap_model(_models.build({}), {"move_params_to_cpu": True})
    for model, opt in ((resident, StepInBackward(resident, torch.optim.AdamW(resident.parameters()))),
                       (offloaded, OffloadOptimizer(offloaded, torch.optim.AdamW(offloaded.parameters()),
                                                    gpu_budget_gib=0))):
        keys = list(model.sharded_state_dict(opt))
        assert any(k.endswith(".exp_avg") for k in keys) and "optim.param_groups" in keys, keys
    return True


def test_fresh_wrappers_give_a_sharded_state_dict(pool):
    assert pool.run(check_fresh_wrappers_give_a_sharded_state_dict) == [True] * WORLD
