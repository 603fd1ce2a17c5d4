"""OffloadOptimizer on a GPU (one rank, NCCL): the overlapped path against the plain offload path, bit for bit in
fp32 and in bf16 (on the GPU the shard cast kernel rounds to nearest-even like the host copy), with
``accumulate_on_gpu`` and under ``step_in_backward``; with clipping to fp32 rounding (the overlapped path takes
each unit's norm on the GPU, the plain one on the host); partial offload under a budget against full offload (the
resident shards are stepped by the GPU's AdamW, the others by the host's: equal to fp32 rounding), and
``gpu_update_share`` (the last units streamed through the GPU's AdamW: to fp32 rounding, their moments pinned)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests._gpu import on_device
from tests.dist_pool import DistPool

pytestmark = pytest.mark.gpu

WORLD = 1


@pytest.fixture(scope="module")
def pool():
    with DistPool(world_size=WORLD, backend="nccl", timeout_s=300) as p:
        yield p


@contextlib.contextmanager
def _on_gpu() -> Iterator[None]:
    """The CPU test's models and batches on this rank's GPU (wrapped with move_params_to_cpu=True there)."""
    import tests.sharding.test_offload_optim as t

    with on_device(t):
        yield


def check_same_as_plain_gpu(cfg: dict[str, Any]) -> bool:
    from tests.sharding.test_offload_optim import check_same_as_plain

    with _on_gpu():
        return check_same_as_plain(cfg)


def check_close_to_plain_gpu(cfg: dict[str, Any]) -> bool:
    from tests.sharding.test_offload_optim import check_close_to_plain

    with _on_gpu():
        return check_close_to_plain(cfg, tol=(1e-5, 1e-6))


CASES = {
    "fp32-fused": dict(fused=True),
    "bf16-fused": dict(fused=True, mixed_precision=True, compute_dtype=torch.bfloat16),
    "bf16-no-sync-accumulate-on-gpu": dict(no_sync_micro=3, accumulate_on_gpu=True,
                                           mixed_precision=True, compute_dtype=torch.bfloat16),
    "sgd-keep-grads": dict(optim="sgd", keep_grads=True),
    # step() returns before the updates queued in backward end (after the first two steps): the next forward's
    # gathers and host-to-device copies run beside them
    "fp32-fused-step-in-backward": dict(fused=True, step_in_backward=True),
    "bf16-fused-step-in-backward": dict(fused=True, step_in_backward=True, mixed_precision=True,
                                        compute_dtype=torch.bfloat16),
}
CLIP_CASES = {
    "fp32-fused-clip": dict(fused=True, clip=0.05),
    "bf16-fused-clip-no-sync": dict(fused=True, clip=0.05, no_sync_micro=2, mixed_precision=True,
                                    compute_dtype=torch.bfloat16),
}

# gpu_update_share: the last units' updates stream through the GPU (torch's fused CUDA AdamW): equal to the host's
# to fp32 rounding, as for resident units; chunks of 4096 elements cycle the device buffers within each unit.
GPU_SHARE_CASES = {
    "fp32-fused-clip-gpu-share-half": dict(fused=True, clip=0.05, host_chunk=4096, gpu_update_share=0.5),
    "bf16-fused-clip-compute-copy-gpu-share-all": dict(fused=True, clip=0.05, host_compute_copy=True,
                                                       mixed_precision=True, compute_dtype=torch.bfloat16,
                                                       gpu_update_share=1.0),
    "bf16-fused-step-in-backward-gpu-share-half": dict(fused=True, step_in_backward=True, mixed_precision=True,
                                                       compute_dtype=torch.bfloat16, gpu_update_share=0.5),
    "fp32-fused-clip-in-update-gpu-share-half": dict(fused=True, clip=0.05, clip_in_update=True,
                                                     gpu_update_share=0.5),
}


@pytest.mark.parametrize("cfg", list(CLIP_CASES.values()) + list(GPU_SHARE_CASES.values()),
                         ids=list(CLIP_CASES) + list(GPU_SHARE_CASES))
def test_clip_close_to_plain_offload_gpu(pool, cfg):
    assert pool.run(check_close_to_plain_gpu, cfg) == [True] * WORLD


@pytest.mark.parametrize("cfg", list(CASES.values()), ids=list(CASES))
def test_bit_exact_against_plain_offload_gpu(pool, cfg):
    assert pool.run(check_same_as_plain_gpu, cfg) == [True] * WORLD


def check_budget_matches_full_offload() -> bool:
    import torch.distributed as dist

    from shardfuse import OffloadOptimizer
    from tests.sharding._models import batch, build, loss_fn, wrap_model

    dev = torch.device("cuda", torch.cuda.current_device())
    results = []
    for budget in (0, 1000.0):
        model = wrap_model(build({}).to(dev), {"move_params_to_cpu": True})
        opt = OffloadOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                               gpu_budget_gib=budget)
        left = [opt.host_stats()["placements_left"]]  # what benchmarks warm up through (bench.offload.big_child)
        for step in range(4):
            ids, target = (x.to(dev) for x in batch(step, dist.get_rank(), 1))
            loss_fn(model, ids, target, step, {}).backward()
            model.clip_grad_norm_(0.05)
            opt.step()
            opt.zero_grad()
            left.append(opt.host_stats()["placements_left"])
        # gpu_budget_gib=0 places nothing; a budget places at the first two steps (all fit at the first here)
        assert left == ([0.0] * 5 if budget == 0 else [2.0, 1.0, 0.0, 0.0, 0.0]), (budget, left)
        devices = sorted({p.device.type for p in model.parameters()})
        want = ["cpu"] if budget == 0 else ["cuda"]
        assert devices == want, f"gpu_budget_gib={budget}: shards on {devices}, expected {want}"
        results.append({k: v.float().cpu() for k, v in model.state_dict().items()})
        opt.close()
    for k in results[0]:
        diff = (results[1][k] - results[0][k]).abs().max().item()
        assert diff <= 1e-5 * (1 + results[0][k].abs().max().item()), f"{k}: resident vs offloaded differ by {diff}"
    return True


def test_budget_keeps_units_resident_with_the_same_results(pool):
    assert pool.run(check_budget_matches_full_offload) == [True] * WORLD
