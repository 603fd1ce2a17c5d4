"""State dicts, optimizer-state consolidation and summon_full_params in a 2-process gloo group."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardfuse.sharding import FullyShardedDataParallel as FSDP
from tests.sharding._models import batch, build, loss_fn, make_optim, reference_train, wrap_model

WORLD = 2


def _step(model: FSDP, opt: torch.optim.Optimizer, step: int, cfg: dict[str, Any]) -> float:
    rank, ws = dist.get_rank(), dist.get_world_size()
    opt.zero_grad(set_to_none=True)
    ids, target = batch(step, rank, ws)
    loss = loss_fn(model, ids, target, step, cfg)
    loss.backward()
    opt.step()
    return loss.item()


def check_save_load_continuation(cfg: dict[str, Any]) -> bool:
    model = wrap_model(build(cfg), cfg)
    opt = make_optim(model.parameters(), cfg)
    for step in range(3):
        _step(model, opt, step, cfg)
    sd = model.state_dict()
    full_osd = model.gather_full_optim_state_dict(opt, recipient_rank=None)
    # Fresh model with different initial values, then load both state dicts.
    torch.manual_seed(999)
    fresh = wrap_model(type(build(cfg))(**{k: cfg.get(k, False) for k in ("tied", "frozen", "extra")}), cfg)
    before = fresh.state_dict()
    assert any(not torch.equal(before[k], sd[k]) for k in sd), "fresh model should start different"
    result = fresh.load_state_dict(sd)
    assert result.missing_keys == [] and result.unexpected_keys == []
    fresh_opt = make_optim(fresh.parameters(), cfg)
    fresh_opt.load_state_dict(fresh.get_shard_from_optim_state_dict(full_osd))
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, sd[k]), f"{k} differs right after loading"
    # Identical continuation, bit for bit.
    for step in range(3, 5):
        a = _step(model, opt, step, cfg)
        b = _step(fresh, fresh_opt, step, cfg)
        assert a == b, f"step {step}: loss {a} vs {b}"
    sd_a, sd_b = model.state_dict(), fresh.state_dict()
    for k in sd_a:
        assert torch.equal(sd_a[k], sd_b[k]), f"{k} differs after continuing"
    # The full state dict loads into the plain model (original names, no wrapper prefixes).
    plain = build(cfg)
    plain.load_state_dict(sd_a)
    return True


def check_optim_state_matches_reference(cfg: dict[str, Any]) -> bool:
    ws = dist.get_world_size()
    model = wrap_model(build(cfg), cfg)
    opt = make_optim(model.parameters(), cfg)
    for step in range(3):
        _step(model, opt, step, cfg)
    full = model.gather_full_optim_state_dict(opt, recipient_rank=0)
    if dist.get_rank() != 0:
        assert full is None
        return True
    # The unsharded reference's optimizer state, read by parameter name, must match bit for bit.
    ref, _, ref_opt = reference_train(cfg, ws, 3)
    by_name = {n: p for n, p in ref.named_parameters()}
    checked = 0
    for k, name in enumerate(full["param_names"]):
        p = by_name.get(name)
        if p is None or k not in full["state"]:
            continue
        want = ref_opt.state[p]
        for key, v in full["state"][k].items():
            assert torch.equal(v, want[key].cpu()), f"{name}.{key} differs from the reference optimizer state"
            checked += 1
    assert checked > 0
    assert sum(len(g["params"]) for g in full["param_groups"]) == len(full["param_names"])
    return True


@pytest.mark.parametrize(
    "cfg",
    [dict(), dict(optim="sgd", reshard_after_forward=False), dict(tied=True, frozen=True)],
    ids=["adamw-nested", "sgd-noreshard", "tied-frozen"],
)
def test_save_load_identical_continuation(pool, cfg):
    assert pool.run(check_save_load_continuation, cfg) == [True] * WORLD


@pytest.mark.parametrize("cfg", [dict(), dict(optim="sgd")], ids=["adamw", "sgd-momentum"])
def test_gathered_optim_state_equals_reference(pool, cfg):
    assert pool.run(check_optim_state_matches_reference, cfg) == [True] * WORLD


def check_local_state_dict_round_trip() -> bool:
    cfg: dict[str, Any] = {}
    model = wrap_model(build(cfg), cfg)
    opt = make_optim(model.parameters(), cfg)
    _step(model, opt, 0, cfg)
    local = model.local_state_dict()
    full = model.state_dict()
    assert any(k.endswith("flat_param_0") for k in local), list(local)
    for step in range(1, 3):
        _step(model, opt, step, cfg)
    assert any(not torch.equal(v, full[k]) for k, v in model.state_dict().items())
    model.load_local_state_dict(local)
    for k, v in model.state_dict().items():
        assert torch.equal(v, full[k]), k
    bad = dict(local)
    key = next(k for k in bad if k.endswith("flat_param_0"))
    bad[key] = torch.zeros(bad[key].numel() + 1)
    with pytest.raises(RuntimeError, match="local state dicts only load with the same world size"):
        model.load_local_state_dict(bad)
    return True


def test_local_state_dict_round_trip(pool):
    assert pool.run(check_local_state_dict_round_trip) == [True] * WORLD


def check_summon_full_params() -> bool:
    cfg: dict[str, Any] = {}
    model = wrap_model(build(cfg), cfg)
    plain = build(cfg)
    _ = model(batch(0, 0, 2)[0])  # one forward: params gathered/freed once, grads none
    with model.summon_full_params():
        got = dict(model.module.named_parameters())
        # Inside the block the original parameters are visible, full-size, in fp32.
        for name, p in plain.named_parameters():
            wrapped = name.replace("blocks.0.", "blocks.0._fsdp_wrapped_module.").replace(
                "blocks.1.", "blocks.1._fsdp_wrapped_module.")
            assert torch.equal(got[wrapped].detach(), p.detach()), name
        with torch.no_grad():
            model.module.head.weight.add_(1.0)
            model.module.blocks[0].module.fc1.bias.mul_(3.0)
    sd = model.state_dict()
    assert torch.equal(sd["head.weight"], plain.head.weight.detach() + 1.0)
    assert torch.equal(sd["blocks.0.fc1.bias"], plain.blocks[0].fc1.bias.detach() * 3.0)
    # volatile: changes are dropped.
    with model.summon_full_params(volatile=True), torch.no_grad():
        model.module.proj.weight.zero_()
    assert torch.equal(model.state_dict()["proj.weight"], plain.proj.weight.detach())
    # recurse=False: only the root's own parameters are summoned.
    with model.summon_full_params(recurse=False):
        names = {n for n, _ in model.module.named_parameters()}
        assert "head.weight" in names and not any("fc1.weight" in n for n in names), names
    # The next forward uses the written-back values.
    out = model(batch(0, 0, 2)[0])
    plain.head.weight.data.add_(1.0)
    plain.blocks[0].fc1.bias.data.mul_(3.0)
    want = plain(batch(0, 0, 2)[0])
    assert torch.equal(out, want)
    return True


def test_summon_full_params_read_write(pool):
    assert pool.run(check_summon_full_params) == [True] * WORLD


def check_state_dict_options() -> bool:
    rank = dist.get_rank()
    base = build({})
    model = FSDP(build({}), state_dict_on_rank_0_only=True, mixed_precision=True, compute_dtype=torch.bfloat16)
    sd = model.state_dict()
    if rank == 0:
        assert list(sd) == list(base.state_dict())
        # Buffers were cast to bf16 for compute but come back in their original dtype.
        assert model.module.scale.dtype == torch.bfloat16 and sd["scale"].dtype == torch.float32
        for k, v in base.state_dict().items():
            assert torch.equal(sd[k], v), k
    else:
        assert sd == {}
    return True


def test_state_dict_rank0_only_and_buffer_dtype(pool):
    assert pool.run(check_state_dict_options) == [True] * WORLD


def check_apply_initialises_full_params() -> bool:
    model = wrap_model(build({}), {})

    def init(m: torch.nn.Module) -> None:
        if isinstance(m, torch.nn.Linear):
            with torch.no_grad():
                m.weight.fill_(0.25)

    model.apply(init)
    sd = model.state_dict()
    assert torch.equal(sd["blocks.1.fc2.weight"], torch.full_like(sd["blocks.1.fc2.weight"], 0.25))
    assert torch.equal(sd["head.weight"], torch.full_like(sd["head.weight"], 0.25))
    return True


def test_apply_runs_on_full_params(pool):
    assert pool.run(check_apply_initialises_full_params) == [True] * WORLD


def check_last_unit_stays_full() -> list[bool]:
    cfg: dict[str, Any] = {"nested": True, "optim": "sgd"}
    model = wrap_model(build(cfg), cfg)
    opt = make_optim(model.parameters(), cfg)
    _step(model, opt, 0, cfg)  # records the forward order
    units = [u._unit for u in model._units() if u is not model and u._unit.handles]
    ids, target = batch(1, dist.get_rank(), dist.get_world_size())
    with torch.no_grad():
        model(ids)
    after_eval = [h.step.is_full for u in units for h in u.handles]
    loss = loss_fn(model, ids, target, 1, cfg)
    after_train = [h.step.is_full for u in units for h in u.handles]
    loss.backward()
    after_backward = [h.step.is_full for u in units for h in u.handles]
    assert not any(after_eval), f"a forward without grad must reshard every unit: {after_eval}"
    assert not any(after_backward), f"backward must reshard every unit: {after_backward}"
    return after_train


def test_last_unit_of_the_forward_keeps_full_params_for_backward(pool):
    # Backward needs the last unit first: resharding it after forward would only re-gather it, exposed.
    for full in pool.run(check_last_unit_stays_full):
        assert full[-1] and not any(full[:-1]), full
