"""shardfuse's float8 all-gather under hybrid sharding (a 2x2 mesh at 4 gloo ranks) and with the SSD tier (2
ranks), against the same model gathered in the compute dtype (``enable_fsdp_float8_all_gather=False``).

Hybrid sharding gathers float8 bytes over the shard group; each weight's amax is the MAX over that group (the
replicas hold the same shards), in one all-reduce per step. The SSD tier keeps the shards on the host between
uses: like ``OffloadOptimizer``'s host shards, they are gathered in the compute dtype and the layers cast them.
In fp32 both gathers give the layers the same float8 weights, so losses and parameters are bit-equal.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("torchao.float8", reason="float8 training needs torchao")

from shardfuse import OffloadConfig  # noqa: E402
from tests.float8.test_float8_all_gather import (  # noqa: E402
    assert_same_float8,
    build,
    float8_handles,
    float8_layers,
    spy_weights,
    torchao_cast,
)
from tests.float8.test_float8_training import batch, loss_of, wrap  # noqa: E402

WORLD = 4


def train(gather: bool, steps: int, **kw: Any) -> tuple[Any, list[float], set[str]]:
    """The model converted with (``gather``) or without the float8 all-gather, wrapped with ``kw``, trained
    ``steps`` AdamW steps with clipping; returns it, its losses and the types of weight its float8 layers saw."""
    rank = dist.get_rank()
    model = wrap(build(gather), **kw)
    kinds: set[str] = set()
    for m in float8_layers(model).values():
        m.register_forward_pre_hook(lambda mod, args: kinds.add(type(mod.weight).__name__))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        loss = loss_of(model, *batch(step, rank, "cpu"))
        loss.backward()
        model.clip_grad_norm_(100.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return model, losses, kinds


def check_hybrid_mesh() -> bool:
    """2 replicas x 2 shards: float8 bytes gathered over the shard group, the amax all-reduce over the shard group
    once per step, bytes and scales equal torchao's cast, losses and parameters equal the compute-dtype gather."""
    from torch.distributed.device_mesh import init_device_mesh

    from shardfuse.sharding.core import _collectives as coll

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    maxes: list[int] = []
    reduce = coll.all_reduce_

    def spy_reduce(t: torch.Tensor, group: object, world: int, op: str = "sum") -> torch.Tensor:
        if op == "max":
            maxes.append(dist.get_world_size(group))
        return reduce(t, group, world, op)

    coll.all_reduce_ = spy_reduce
    try:
        ours, losses, kinds = train(True, 3, device_mesh=mesh)
        assert kinds == {"Float8TrainingTensor"}, kinds
        assert maxes == [2] * 3, maxes  # one per step, over a shard group of 2
        assert all(h.world_size == 2 and h.fp8 is not None for h in float8_handles(ours))
    finally:
        coll.all_reduce_ = reduce
    plain, want, _ = train(False, 3, device_mesh=mesh)
    assert losses == want, (losses, want)
    sd, want_sd = ours.state_dict(), plain.state_dict()
    assert all(torch.equal(sd[k], want_sd[k]) for k in want_sd)
    seen = spy_weights(ours)
    with ours.summon_full_params():
        cast = torchao_cast(ours)
    ours(batch(5, dist.get_rank(), "cpu")[0])
    assert_same_float8(seen, cast)
    return True


def test_hybrid_2x2_mesh_equals_compute_dtype_gather(pool):
    assert all(pool.run(check_hybrid_mesh))


def check_ssd_tier(path: str) -> bool:
    """SSD-tier shards (host-side between uses) take the compute-dtype gather: the layers get plain weights and
    train exactly as the model converted without the float8 all-gather. Two ranks of the pool's four."""
    group = dist.new_group([0, 1])
    if dist.get_rank() > 1:
        return True
    results = []
    for gather in (True, False):
        folder = os.path.join(path, f"gather{int(gather)}")
        os.makedirs(folder, exist_ok=True)
        offload = OffloadConfig(offload_type="ssd_offload", dir=folder)
        # compute_device: on the CPU on a CUDA host too (the SSD tier would compute on the current GPU).
        model, losses, kinds = train(gather, 2, offload_config=offload, process_group=group,
                                     compute_device=torch.device("cpu"))
        assert kinds == {"Tensor"}, kinds
        results.append((losses, model.state_dict()))
    (losses, sd), (want, want_sd) = results
    assert losses == want and all(torch.equal(sd[k], want_sd[k]) for k in want_sd)
    return True


def test_ssd_tier_takes_the_compute_dtype_gather(pool, tmp_path):
    assert all(pool.run(check_ssd_tier, str(tmp_path)))
