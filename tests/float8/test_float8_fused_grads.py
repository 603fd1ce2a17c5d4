"""The float8 weights' gradients reach the reduction apart (``_fp8_gather._Float8WeightsFused``), as the
compute-dtype views' do (``_fused_grads.py``): no concatenation into a flat gradient in backward, and every
reduce-scatter input and sharded gradient the same bytes as on the concatenating path
(``FlatParamHandle.fuse_grads = False``), 2 gloo ranks on CPU. Covered: fp32, bf16 compute with fp32 and bf16
reduce-scatter, ``no_sync`` accumulation, two forwards of the model in one backward, activation checkpointing."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("torchao.float8", reason="float8 training needs torchao")

from shardfuse.sharding.core import _collectives as coll  # noqa: E402
from shardfuse.sharding.core import _fp8_gather  # noqa: E402
from shardfuse.sharding.core._flat_param import FlatParamHandle  # noqa: E402
from tests.float8.test_float8_all_gather import build, float8_handles  # noqa: E402
from tests.float8.test_float8_training import batch, loss_of, wrap  # noqa: E402

WORLD = 2
BF16 = {"mixed_precision": True, "compute_dtype": torch.bfloat16}
CASES = {
    "fp32": {},
    "bf16_fp32_reduce": {**BF16, "fp32_reduce_scatter": True},
    "bf16_bf16_reduce": {**BF16, "fp32_reduce_scatter": False},
    "no_sync": {"micro": 2},
    "twice": {"twice": True, **BF16, "fp32_reduce_scatter": True},
    "ckpt": {"ckpt": True, **BF16, "fp32_reduce_scatter": True},
}


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(-1).view(torch.uint8).clone()


def _float8_cats(prof: Any) -> int:
    """``aten::cat`` calls under the concatenating float8 node's backward."""
    def under_float8_node(e: Any) -> bool:
        while e is not None:
            if "_Float8Weights" in e.name and "Fused" not in e.name:
                return True
            e = e.cpu_parent
        return False

    return sum(1 for e in prof.events() if e.name == "aten::cat" and under_float8_node(e))


def _run(cfg: dict[str, Any], fused: bool) -> dict[str, Any]:
    """Every reduce-scatter input and the sharded gradients after each of two steps, the fused path on or off."""
    rank = dist.get_rank()
    inputs: list[torch.Tensor] = []
    real_rs, real_fused = coll.reduce_scatter_into, _fp8_gather._Float8WeightsFused.backward
    fused_nodes = []

    def recording_rs(out: torch.Tensor, inp: torch.Tensor, *a: Any, **k: Any) -> Any:
        inputs.append(_bytes(inp))
        return real_rs(out, inp, *a, **k)

    def counting_fused(ctx: Any, *grads: Any) -> Any:
        fused_nodes.append(len(grads))
        return real_fused(ctx, *grads)

    default, grads, cats = FlatParamHandle.fuse_grads, [], 0
    kw = {k: v for k, v in cfg.items() if k not in ("micro", "twice", "ckpt")}
    try:
        coll.reduce_scatter_into = recording_rs
        _fp8_gather._Float8WeightsFused.backward = staticmethod(counting_fused)  # type: ignore[method-assign]
        FlatParamHandle.fuse_grads = fused
        net = build()
        if cfg.get("ckpt"):  # every block's activations recomputed in backward (the unit wraps the checkpoint)
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

            for i in range(len(net.blocks)):
                net.blocks[i] = checkpoint_wrapper(net.blocks[i])
        model = wrap(net, **kw)
        assert float8_handles(model), "the model has no float8 flat parameter"
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in range(2):
            for m in range(cfg.get("micro", 1)):
                x, y = batch(step * 3 + m, rank, "cpu")
                loss = loss_of(model, x, y)
                if cfg.get("twice"):
                    loss = loss + loss_of(model, *batch(step * 3 + 2, rank, "cpu"))
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                    if m < cfg.get("micro", 1) - 1:
                        with model.no_sync():
                            loss.backward()
                    else:
                        loss.backward()
                cats += _float8_cats(prof)
            grads += [_bytes(p.grad) for p in model.parameters() if p.grad is not None]
            opt.step()
            opt.zero_grad(set_to_none=True)
    finally:
        coll.reduce_scatter_into = real_rs
        _fp8_gather._Float8WeightsFused.backward = real_fused  # type: ignore[method-assign]
        FlatParamHandle.fuse_grads = default
    return {"inputs": inputs, "grads": grads, "fused_nodes": len(fused_nodes), "cats": cats}


def compare(cfg: dict[str, Any]) -> dict[str, Any]:
    new, old = _run(cfg, True), _run(cfg, False)
    return {
        "n": (len(new["inputs"]), len(old["inputs"]), len(new["grads"])),
        "inputs_equal": len(new["inputs"]) == len(old["inputs"])
        and all(torch.equal(a, b) for a, b in zip(new["inputs"], old["inputs"])),
        "grads_equal": len(new["grads"]) == len(old["grads"])
        and all(torch.equal(a, b) for a, b in zip(new["grads"], old["grads"])),
        "fused_nodes": (new["fused_nodes"], old["fused_nodes"]),
        "cats": (new["cats"], old["cats"]),
    }


@pytest.mark.parametrize("name", sorted(CASES))
def test_float8_gradients_reach_the_reduction_apart(pool, name):
    for r in pool.run(compare, CASES[name]):
        assert r["n"][0] > 0 and r["n"][2] > 0, f"nothing was reduced: {r}"
        assert r["inputs_equal"], f"a reduce-scatter input differs from the concatenating path's: {r}"
        assert r["grads_equal"], f"a sharded gradient differs from the concatenating path's: {r}"
        assert r["fused_nodes"][0] > 0 and r["fused_nodes"][1] == 0, f"the float8 node is not the one chosen: {r}"
        assert r["cats"] == (0, r["cats"][1]) and r["cats"][1] > 0, f"the float8 backward still concatenates: {r}"
