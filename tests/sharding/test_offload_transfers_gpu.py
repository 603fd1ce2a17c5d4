"""What crosses PCIe under OffloadOptimizer, on a GPU (one rank, NCCL): the CPU suite's checks
(``test_offload_transfers.py``) with the models and batches on the device, where the gradient copies are
asynchronous (the host worker widens each compute-dtype gradient as its copy's event completes, racing the end of
backward) and where ``keep_params_gib=None`` measures the room on the device.

Run: ``python -m pytest -q tests/sharding/test_offload_transfers_gpu.py``.
"""

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
    import tests.sharding.test_offload_transfers as t

    with on_device(t):
        yield


def check_lowp_gpu(cfg: dict[str, Any], expect: str) -> bool:
    from tests.sharding.test_offload_transfers import check_lowp

    with _on_gpu():
        return check_lowp(cfg, expect)


def check_keep_gpu(cfg: dict[str, Any], keep_gib: float | None, kept: list[str], chosen_at: int) -> bool:
    from tests.sharding.test_offload_transfers import check_keep

    with _on_gpu():
        return check_keep(cfg, keep_gib, kept, chosen_at)


BF16 = dict(mixed_precision=True, compute_dtype=torch.bfloat16)
LOWP = {
    "bf16-fused-clip": (dict(BF16, fused=True, clip=0.05), "lowp"),
    "bf16-fused-clip-fp32-reduce": (dict(BF16, fused=True, clip=0.05, fp32_reduce_scatter=True), "lowp"),
    "bf16-fused-step-in-backward": (dict(BF16, fused=True, step_in_backward=True), "lowp"),
    "bf16-no-sync-accumulate-on-gpu-clip": (dict(BF16, fused=True, no_sync_micro=3, accumulate_on_gpu=True,
                                                 clip=0.05), "lowp"),
    "fp16-sgd": (dict(mixed_precision=True, compute_dtype=torch.float16, optim="sgd"), "lowp"),
    "bf16-keep-grads": (dict(BF16, optim="sgd", keep_grads=True), "first"),
    "bf16-predivide-2": (dict(BF16, gradient_predivide_factor=2.0, fused=True), "fp32"),
    "fp32": (dict(fused=True, clip=0.05), "fp32"),
}


@pytest.mark.parametrize("cfg,expect", list(LOWP.values()), ids=list(LOWP))
def test_gradients_cross_in_the_compute_dtype_where_exact_gpu(pool, cfg, expect):
    assert pool.run(check_lowp_gpu, cfg, expect) == [True] * WORLD


KEEP_CFG = dict(BF16, disable_reshard_on_root=False, fused=True, clip=0.05)
KEEP = {
    "all": (KEEP_CFG, 1.0, ["unit0", "unit1"], 1),
    # gpu_budget_gib=0: the placements are final at the first step(), the room is measured at the second
    "automatic": (KEEP_CFG, None, ["unit0", "unit1"], 2),
    "step-in-backward": (dict(KEEP_CFG, clip=None, step_in_backward=True), 1.0, ["unit0", "unit1"], 1),
}


@pytest.mark.parametrize("cfg,keep_gib,kept,chosen_at", list(KEEP.values()), ids=list(KEEP))
def test_keep_params_between_forward_and_backward_gpu(pool, cfg, keep_gib, kept, chosen_at):
    assert pool.run(check_keep_gpu, cfg, keep_gib, kept, chosen_at) == [True] * WORLD
