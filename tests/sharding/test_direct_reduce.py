"""The reduce-scatter written straight into the sharded gradient (``_grad_reduce.direct_predivide``): where the
post-divide would only copy, the post-divide pass and its scratch buffer are skipped, and the gradients are the
same bits as the path that runs them. Checked against that path (the same model, data and ranks with the direct
path switched off), at 2 ranks (FairScale's factors 2 and 1) and 4 ranks (2 and 2, folded into one pre-divide by
4), with a post-divide pass counter; accumulation, a compute-dtype reduce and a non-power-of-two factor keep the
post-divide."""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.sharding._models import batch, build, loss_fn, wrap_model

WORLD = 2
FP32_REDUCE = dict(mixed_precision=True, compute_dtype=torch.bfloat16, fp32_reduce_scatter=True)


def _module(suffix: str) -> ModuleType:
    mods = [m for name, m in sys.modules.items() if name.startswith("shardfuse.sharding") and name.endswith(suffix)]
    assert len(mods) == 1, f"expected one shardfuse module ending {suffix}, found {[m.__name__ for m in mods]}"
    return mods[0]


def _grads(cfg: dict[str, Any], direct: bool, backwards: int, factor: float | None) -> tuple[list, int]:
    """Sharded gradients after ``backwards`` backward passes (no zero_grad between them) and the number of
    post-divide passes they took, with the direct path on or off."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    reduce_mod, dp = _module("_grad_reduce"), _module("_data_path")
    real_direct, real_post = reduce_mod.direct_predivide, dp.post_divide
    posts = []

    def counting_post(*args: Any, **kwargs: Any) -> Any:
        posts.append(1)
        return real_post(*args, **kwargs)

    try:
        dp.post_divide = counting_post
        if not direct:
            reduce_mod.direct_predivide = lambda *a, **k: None
        torch.manual_seed(1234)
        wrap_cfg = dict(cfg) if factor is None else {**cfg, "gradient_predivide_factor": factor}
        model = wrap_model(build(cfg), wrap_cfg)
        for step in range(backwards):
            ids, target = batch(step, rank, ws)
            loss_fn(model, ids, target, step, cfg).backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    finally:
        dp.post_divide, reduce_mod.direct_predivide = real_post, real_direct
    return grads, len(posts)


def check_direct_equals_post_divide(cfg: dict[str, Any], backwards: int, factor: float | None) -> dict[str, Any]:
    direct, direct_posts = _grads(cfg, True, backwards, factor)
    ref, ref_posts = _grads(cfg, False, backwards, factor)
    assert ref and len(direct) == len(ref), "no sharded gradient to compare"
    return {
        "bit_equal": all(torch.equal(a, b) for a, b in zip(direct, ref)),
        "nonzero": all(bool(g.abs().sum() > 0) for g in ref),
        "direct_posts": direct_posts,
        "ref_posts": ref_posts,
    }


def _run(pool: Any, cfg: dict[str, Any], backwards: int = 1, factor: float | None = None) -> list[dict[str, Any]]:
    results = pool.run(check_direct_equals_post_divide, cfg, backwards, factor)
    for r in results:
        assert r["bit_equal"], f"the direct reduce-scatter changed the gradients: {r}"
        assert r["nonzero"], f"a sharded gradient is all zeros: the comparison proves nothing ({r})"
        assert r["ref_posts"] > 0, f"the reference path ran no post-divide: {r}"
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_fresh_fp32_reduce_skips_the_post_divide(request, world):
    # 2 ranks: factors (2, 1); 4 ranks: (2, 2), folded into a pre-divide by 4 (powers of two, fp32 sums).
    pool = request.getfixturevalue("pool" if world == 2 else "pool4")
    for r in _run(pool, FP32_REDUCE):
        assert r["direct_posts"] == 0, f"{world} ranks: the post-divide still ran {r['direct_posts']} times: {r}"


def test_accumulation_keeps_the_post_divide(pool):
    # The second backward adds into the existing gradient: only the post-divide pass can accumulate.
    for r in _run(pool, FP32_REDUCE, backwards=2):
        assert 0 < r["direct_posts"] < r["ref_posts"], f"expected post-divides in the second backward only: {r}"


def test_compute_dtype_reduce_keeps_the_post_divide(pool):
    # bf16 reduce into fp32 shards: the post-divide casts, it is not a copy.
    cfg = dict(mixed_precision=True, compute_dtype=torch.bfloat16, fp32_reduce_scatter=False)
    for r in _run(pool, cfg):
        assert r["direct_posts"] == r["ref_posts"], f"a casting post-divide was skipped: {r}"


def test_factor_not_a_power_of_two_keeps_the_post_divide(pool4):
    # gradient_predivide_factor=3 at 4 ranks: post-divide by 4/3, which cannot move into the pre-divide exactly.
    for r in _run(pool4, FP32_REDUCE, factor=3.0):
        assert r["direct_posts"] == r["ref_posts"], f"a post-divide by 4/3 was folded: {r}"


def test_user_factor_equal_to_world_size_goes_direct(pool):
    # gradient_predivide_factor=world size: post-divide 1, the reduce-scatter writes the gradient directly.
    for r in _run(pool, FP32_REDUCE, factor=float(WORLD)):
        assert r["direct_posts"] == 0, f"post-divide by 1 still ran: {r}"


def test_shard_on_the_host_keeps_the_post_divide():
    # move_params_to_cpu without an OffloadOptimizer: the reduce-scatter writes a device temporary that the
    # post-divide step copies to the host; written "directly", flat.grad was never set (FairScale's GradScaler
    # tests saw no gradient on a rank). Only the shard's own flat.grad may take the direct write.
    from types import SimpleNamespace

    from shardfuse.sharding.core._grad_reduce import direct_predivide

    flat = torch.zeros(8)
    handle = SimpleNamespace(host=None, world_size=2, flat=flat)
    cfg = SimpleNamespace(groups=SimpleNamespace(hybrid=False), reduce_dtype=torch.float32, predivide=2.0,
                          postdivide=1.0)
    device_temporary = torch.empty(4)
    assert direct_predivide(handle, cfg, device_temporary, accumulate=False) is None  # type: ignore[arg-type]
    flat.grad = torch.empty_like(flat)
    assert direct_predivide(handle, cfg, flat.grad, accumulate=False) == 2.0  # type: ignore[arg-type]
