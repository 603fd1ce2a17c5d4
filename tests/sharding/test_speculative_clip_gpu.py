"""``OffloadOptimizer(speculative_clip=True)`` on a GPU (one rank, NCCL): the CPU suite's checks with the model and
batches on the device (per-unit norms taken on the GPU, pinned spare buffers, bf16 compute), bit for bit against
the non-speculative clipped path; the originals untouched until the commit; a GPU budget (speculation starts once
the units are placed)."""

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
BIG, TINY = 1e6, 1e-3


@pytest.fixture(scope="module")
def pool():
    with DistPool(world_size=WORLD, backend="nccl", timeout_s=300) as p:
        yield p


@contextlib.contextmanager
def _on_gpu() -> Iterator[None]:
    import tests.sharding.test_speculative_clip as t

    with on_device(t):
        yield


def check_same_as_clipped_gpu(cfg: dict[str, Any]) -> dict[str, float]:
    from tests.sharding.test_speculative_clip import check_same_as_clipped

    with _on_gpu():
        return check_same_as_clipped(cfg)


BF16 = dict(mixed_precision=True, compute_dtype=torch.bfloat16)
CASES: dict[str, dict[str, Any]] = {
    "fp32-fused-commit": dict(norms=[BIG] * 5, host_chunk=4096),
    "fp32-fused-redo": dict(norms=[TINY] * 5, host_chunk=4096),
    "fp32-fused-mixed": dict(norms=[BIG, TINY, None, BIG, TINY]),
    "bf16-fused-mixed": dict(norms=[BIG, TINY, BIG, BIG, TINY], host_chunk=4096, **BF16),
    "bf16-host-compute-copy-mixed": dict(norms=[TINY, BIG, BIG, None, TINY], host_compute_copy=True, **BF16),
    "bf16-orig-params-frozen-mixed": dict(norms=[BIG, BIG, TINY, BIG], orig=True, freeze=("fc1.weight", "proj"),
                                          host_chunk=4096, **BF16),
    "bf16-no-sync-accumulate-on-gpu": dict(norms=[BIG, TINY, BIG, BIG], no_sync_micro=2, accumulate_on_gpu=True,
                                           **BF16),
    "fp32-nonfinite": dict(norms=[BIG, BIG, BIG, BIG], inf_at=(2,)),
    "sgd-mixed": dict(norms=[BIG, TINY, BIG, BIG], optim="sgd"),
    "adam-amsgrad-mixed": dict(norms=[TINY, BIG, BIG, TINY], optim="adam"),
    # a budget too small for any unit: placement at the first two steps, speculation from the third
    "tiny-gpu-budget": dict(norms=[BIG, TINY, BIG, BIG, TINY, BIG], gpu_budget=1e-6),
}


@pytest.mark.parametrize("cfg", list(CASES.values()), ids=list(CASES))
def test_bit_identical_to_the_clipped_path_gpu(pool, cfg):
    stats = pool.run(check_same_as_clipped_gpu, cfg)
    for s in stats:
        assert s["spec_units_committed"] + s["spec_units_redone"] + s["spec_units_late"] > 0, s
        assert s["spec_spare_bytes"] > 0, s


def check_originals_untouched_gpu(optim: str) -> bool:
    from tests.sharding.test_speculative_clip import check_originals_untouched_until_commit

    with _on_gpu():
        return check_originals_untouched_until_commit(optim)


@pytest.mark.parametrize("optim", ["adamw-fused", "sgd"])
def test_originals_untouched_until_commit_gpu(pool, optim):
    assert pool.run(check_originals_untouched_gpu, optim) == [True] * WORLD
