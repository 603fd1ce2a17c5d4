"""The views' gradients pre-divided straight into the reduce-scatter input (``_fused_grads.py``), without their
concatenation: every reduce-scatter input is the same bytes as on the path through ``torch.split_with_sizes``
(``FlatParamHandle.fuse_grads = False``), and so is every sharded gradient, on fresh random data with odd sizes
(padding at 2 and 4 ranks). Covered: fp32, bf16 compute with fp32 and bf16 reduce-scatter, tied, frozen and unused
parameters, two forwards of a unit in one backward, activation checkpointing, ``no_sync`` accumulation, hybrid
sharding; and that the fused path runs (its launches counted, no ``aten::cat`` in backward)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from shardfuse.sharding.core import _collectives as coll
from shardfuse.sharding.core import _data_path as dp
from shardfuse.sharding.core._flat_param import FlatParamHandle
from shardfuse.sharding.core._fused_grads import Unflatten, add_contribution, materialize
from shardfuse.sharding.core._step_state import HandleStep
from tests.sharding._models import batch, build, loss_fn, wrap_model

WORLD = 2
BF16 = dict(mixed_precision=True, compute_dtype=torch.bfloat16)


def _model(cfg: dict[str, Any], device: torch.device) -> nn.Module:
    net = build(cfg)
    if cfg.get("unused"):  # a parameter of a unit that runs but gets no gradient: zeros in the reduce input
        net.blocks[0].unused = nn.Linear(3, 5)
    kw = {k: v for k, v in cfg.items() if k in ("mixed_precision", "compute_dtype", "fp32_reduce_scatter")}
    if cfg.get("mesh"):
        kw["device_mesh"] = init_device_mesh("cpu", cfg["mesh"], mesh_dim_names=("replicate", "shard"))
    return wrap_model(net.to(device), {**cfg, **kw})


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(-1).view(torch.uint8).clone()


def _gradient_cats(prof: Any) -> int:
    """``aten::cat`` calls in backward but those building a launch table inside the kernel's own range."""
    def in_kernel(e: Any) -> bool:
        while e is not None:
            if e.name == "shardfuse.kernels:pre_divide_pad":
                return True
            e = e.cpu_parent
        return False

    return sum(1 for e in prof.events() if e.name == "aten::cat" and not in_kernel(e))


def _run(cfg: dict[str, Any], fused: bool, device: torch.device) -> dict[str, Any]:
    """Every reduce-scatter input and the final sharded gradients after two steps (``no_sync_micro`` micro-batches
    each), with the fused path on or off; the fused launches and backward ``aten::cat`` calls counted."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    real_rs, real_pieces = coll.reduce_scatter_into, dp.pre_divide_pad_pieces
    inputs: list[torch.Tensor] = []
    fused_calls: list[int] = []

    def recording_rs(out: torch.Tensor, inp: torch.Tensor, *a: Any, **k: Any) -> Any:
        inputs.append(_bytes(inp))
        return real_rs(out, inp, *a, **k)

    def counting_pieces(*a: Any, **k: Any) -> Any:
        fused_calls.append(1)
        return real_pieces(*a, **k)

    cats = 0
    default = FlatParamHandle.fuse_grads
    try:
        coll.reduce_scatter_into, dp.pre_divide_pad_pieces = recording_rs, counting_pieces
        FlatParamHandle.fuse_grads = fused
        model = _model(cfg, device)
        micro = cfg.get("no_sync_micro", 1)
        for step in range(2):
            for m in range(micro):
                ids, target = (t.to(device) for t in batch(step * micro + m, rank, ws))
                loss = loss_fn(model, ids, target, step, cfg)
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                    if m < micro - 1:
                        with model.no_sync():
                            loss.backward()
                    else:
                        loss.backward()
                cats += _gradient_cats(prof)
        grads = [_bytes(p.grad) for p in model.parameters() if p.grad is not None]
    finally:
        coll.reduce_scatter_into, dp.pre_divide_pad_pieces = real_rs, real_pieces
        FlatParamHandle.fuse_grads = default
    return {"inputs": inputs, "grads": grads, "fused_calls": len(fused_calls), "cats": cats}


def compare(cfg: dict[str, Any], device: str = "cpu") -> dict[str, Any]:
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device(device)
    new, old = _run(cfg, True, dev), _run(cfg, False, dev)
    return {
        "n_inputs": (len(new["inputs"]), len(old["inputs"])),
        "inputs_equal": len(new["inputs"]) == len(old["inputs"])
        and all(torch.equal(a, b) for a, b in zip(new["inputs"], old["inputs"])),
        "grads_equal": len(new["grads"]) == len(old["grads"]) > 0
        and all(torch.equal(a, b) for a, b in zip(new["grads"], old["grads"])),
        "fused_calls": (new["fused_calls"], old["fused_calls"]),
        "cats": (new["cats"], old["cats"]),
    }


def check(pool: Any, cfg: dict[str, Any], fused: bool = True, device: str = "cpu") -> list[dict[str, Any]]:
    results = pool.run(compare, cfg, device)
    for r in results:
        assert r["n_inputs"][0] > 0, f"no reduce-scatter ran: {r}"
        assert r["inputs_equal"], f"a reduce-scatter input differs from the concatenating path's: {r}"
        assert r["grads_equal"], f"a sharded gradient differs from the concatenating path's: {r}"
        assert r["fused_calls"][1] == 0, f"the old path ran the fused launch: {r}"
        if fused:
            assert r["fused_calls"][0] > 0, f"the fused path never ran: {r}"
    return results


CASES = {
    "fp32": {},
    "bf16_fp32_reduce": {**BF16, "fp32_reduce_scatter": True},
    "bf16_bf16_reduce": {**BF16, "fp32_reduce_scatter": False},
    "tied": {"tied": True},
    "frozen": {"frozen": True, **BF16, "fp32_reduce_scatter": True},
    "unused": {"unused": True},
    "ckpt": {"ckpt": True, **BF16, "fp32_reduce_scatter": True},
    "not_nested": {"nested": False},
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_fused_reduce_input_is_the_concatenating_paths(pool, name):
    for r in check(pool, CASES[name]):
        # The only cat left is none: split_with_sizes' backward concatenated once per flat parameter.
        assert r["cats"][0] == 0 and r["cats"][1] > 0, f"backward still concatenates: {r}"


def test_two_forwards_in_one_backward_sum_as_the_engine_does(pool):
    # The second node's gradients make the stash flat (the engine's sum order): the old reduction then runs.
    check(pool, {"multi_forward": True, "unused": True, **BF16, "fp32_reduce_scatter": True}, fused=False)


@pytest.mark.parametrize("reduce32", [True, False])
def test_no_sync_accumulation(pool, reduce32):
    # Micro-batches under no_sync add into full_param.grad piece by piece; the synced one adds onto that sum.
    check(pool, {"no_sync_micro": 3, "unused": True, **BF16, "fp32_reduce_scatter": reduce32}, fused=False)


class _Layout:
    """The parts of a flat parameter handle the unflatten node reads (two parameters and a padding tail)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.shapes = [torch.Size([2, 3]), torch.Size([4])]
        self.numels = [6, 4]
        self.numel, self.padded_numel = 10, 12
        self.split_sizes = [6, 4, 2]
        self.full_param = torch.zeros(12, dtype=dtype, requires_grad=True)
        self.step = HandleStep()

    def made(self, full: torch.Tensor | None) -> torch.Tensor:
        assert full is not None
        return full


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stash_sums_are_the_engines_bits(dtype):
    # Two nodes of one handle in one backward, the first without a gradient for `a`, the second -0.0 for it
    # (-0.0 + 0.0 is +0.0 in the engine's sum of the two concatenations), added onto an existing gradient with
    # -0.0 in it (no_sync, as AccumulateGrad adds): the same bits as the split path.
    gen = torch.Generator().manual_seed(0)
    gb = torch.randn(4, generator=gen).to(dtype)
    neg = torch.full((2, 3), -0.0, dtype=dtype)
    held = torch.randn(12, generator=gen).to(dtype)
    held[:3] = -0.0
    held[10:] = 0.0

    ref = torch.zeros(12, dtype=dtype, requires_grad=True)
    ref.grad = held.clone()
    (_, rb, _), (ra2, _, _) = torch.split_with_sizes(ref, [6, 4, 2]), torch.split_with_sizes(ref, [6, 4, 2])
    ((rb * gb).sum() + (ra2.view(2, 3) * neg).sum()).backward()

    h = _Layout(dtype)
    h.full_param.grad = held.clone()
    token = torch.empty(0, dtype=dtype, requires_grad=True)
    (_, b), (a2, _) = Unflatten.apply(token, [h.full_param], h), Unflatten.apply(token, [h.full_param], h)
    ((b * gb).sum() + (a2 * neg).sum()).backward()
    assert h.full_param.grad is not None and isinstance(h.step.fused, torch.Tensor)  # two nodes: summed flat
    materialize(h, h.full_param, h.step.fused)
    assert torch.equal(_bits(h.full_param.grad), _bits(ref.grad))

    # One node kept apart, materialized fresh: the concatenation split's backward makes (zeros for `a`).
    fresh = add_contribution(h, None, (None, gb))
    h.full_param.grad = None
    materialize(h, h.full_param, fresh)
    cat = torch.cat([torch.zeros(6, dtype=dtype), gb, torch.zeros(2, dtype=dtype)])
    assert torch.equal(_bits(h.full_param.grad), _bits(cat))

    # One node kept apart, added onto a gradient with -0.0 where `a` got none: AccumulateGrad's held + cat.
    h.full_param.grad = held.clone()
    materialize(h, h.full_param, add_contribution(h, None, (None, gb)))
    assert torch.equal(_bits(h.full_param.grad), _bits(held + cat))


def test_hybrid_sharding(pool4):
    check(pool4, {"mesh": (2, 2), **BF16, "fp32_reduce_scatter": True})


def _handles_fused(model: nn.Module) -> list[bool]:
    from shardfuse.sharding.core._tree import units_below

    return [h.grad_token is not None for u in units_below(model._unit) for h in u.handles]


def check_environment_switch() -> list[list[bool]]:
    """On by default; SHARDFUSE_FUSED_GRADS=0 turns the path off and =1 on for the units initialised after it is
    set, whatever the class attribute says."""
    import os

    seen = []
    default = FlatParamHandle.fuse_grads
    try:
        for attribute, value in ((True, None), (True, "0"), (False, "1"), (False, None)):
            FlatParamHandle.fuse_grads = attribute
            if value is None:
                os.environ.pop("SHARDFUSE_FUSED_GRADS", None)
            else:
                os.environ["SHARDFUSE_FUSED_GRADS"] = value
            try:
                model = _model({}, torch.device("cpu"))
                ids, target = batch(0, dist.get_rank(), dist.get_world_size())
                loss_fn(model, ids, target, 0, {}).backward()  # lazy init, one fused (or not) backward
                seen.append(_handles_fused(model))
            finally:
                os.environ.pop("SHARDFUSE_FUSED_GRADS", None)
    finally:
        FlatParamHandle.fuse_grads = default
    return seen


def test_fused_by_default_and_the_environment_decides_when_set(pool):
    assert FlatParamHandle.fuse_grads is True  # the library's default
    for default, env_off, env_on, attribute_off in pool.run(check_environment_switch):
        assert default and all(default), f"not fused by default: {default}"
        assert env_off and not any(env_off), f"SHARDFUSE_FUSED_GRADS=0 left handles fused: {env_off}"
        assert env_on and all(env_on), f"SHARDFUSE_FUSED_GRADS=1 left handles unfused: {env_on}"
        assert attribute_off and not any(attribute_off), f"fuse_grads=False left handles fused: {attribute_off}"


def test_environment_switch_rejects_other_values(monkeypatch):
    from shardfuse.sharding.core._fused_grads import requested_by_environment

    monkeypatch.setenv("SHARDFUSE_FUSED_GRADS", "yes")
    with pytest.raises(ValueError, match="SHARDFUSE_FUSED_GRADS='yes'"):
        requested_by_environment()


def tables_built_per_step(cfg: dict[str, Any], steps: int = 3) -> list[int]:
    """The launch tables ``pre_divide_pad`` built in each step's backward (a table built is a host-to-device copy
    on the GPU)."""
    from shardfuse.kernels import _common

    rank, ws = dist.get_rank(), dist.get_world_size()
    real = _common.block_table
    built = [0]

    def counting(*a: Any, **k: Any) -> Any:
        built[0] += 1
        return real(*a, **k)

    model = _model(cfg, torch.device("cpu"))
    per_step = []
    _common.clear_plan_caches()  # plans of the same shapes left by earlier tests in this worker
    try:
        _common.block_table = counting
        for step in range(steps):
            ids, target = batch(step, rank, ws)
            built[0] = 0
            loss_fn(model, ids, target, step, cfg).backward()
            per_step.append(built[0])
            for p in model.parameters():
                p.grad = None  # the next backward's gradients are new tensors, at other addresses
    finally:
        _common.block_table = real
    return per_step


@pytest.mark.parametrize("name", ["fp32", "bf16_fp32_reduce"])
def test_gradients_at_new_addresses_build_no_table_after_the_first_step(pool, name):
    # Autograd allocates the gradients anew every step: the plan found by their shapes has its address column
    # rewritten in place (one launch, no host-to-device copy, which on the GPU would queue behind other copies).
    for per_step in pool.run(tables_built_per_step, CASES[name]):
        assert per_step[0] > 0, f"the fused path built no table in the first step: {per_step}"
        assert per_step[1:] == [0] * (len(per_step) - 1), f"tables built again in later steps: {per_step}"
