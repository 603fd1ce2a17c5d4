"""The SSD offload tier on a GPU (one rank, NCCL): training with shards (and AdamW state) on disk equals the
in-memory ``move_params_to_cpu=True`` path bit for bit, in fp32 and bf16 compute, with ``OffloadOptimizer`` and with
a plain optimizer; the shards' memory is pinned (torch's caching host allocator) while resident and given back
between uses; a 256 MiB shard round-trips through its file."""

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
def _batches_on_gpu() -> Iterator[None]:
    import tests.sharding.test_ssd_offload as t

    with on_device(t, models=False):
        yield


def check_gpu(path: str, cfg: dict[str, Any]) -> bool:
    import tests.sharding.test_ssd_offload as t
    from shardfuse.sharding.ssd._ssd import ssd_host

    with _batches_on_gpu():
        assert t.check_same_as_plain(path, cfg)
        model, opt, _ = t._train(path, cfg, steps=2)
        model.state_dict()  # pages every shard in
        for h in t._flat_handles(model):
            assert ssd_host(h) is not None and h.flat.is_pinned(), "a resident SSD shard is not pinned"
        if hasattr(opt, "close"):
            opt.close()
    return True


CASES = {
    "fp32-offload-optimizer-state": dict(overlapped=True, state=True),
    "bf16-offload-optimizer-state": dict(overlapped=True, state=True, mixed_precision=True,
                                         compute_dtype=torch.bfloat16),
    "bf16-plain-optimizer": dict(mixed_precision=True, compute_dtype=torch.bfloat16),
    "bf16-no-sync": dict(overlapped=True, state=True, micro=3, no_sync=True, mixed_precision=True,
                         compute_dtype=torch.bfloat16),
    # torch's fused CPU AdamW, as the offload benchmark steps it (its writes bump no version counter)
    "bf16-fused-offload-optimizer-state": dict(overlapped=True, state=True, fused=True, mixed_precision=True,
                                               compute_dtype=torch.bfloat16),
}


@pytest.mark.parametrize("cfg", list(CASES.values()), ids=list(CASES))
def test_ssd_training_equals_in_memory_on_gpu(pool, tmp_path, cfg):
    assert pool.run(check_gpu, str(tmp_path), cfg) == [True] * WORLD


def test_large_pinned_shard_round_trips(tmp_path):
    from shardfuse.sharding.ssd import _ssd_store

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    store = _ssd_store.SsdStore(str(tmp_path), threads=4, chunk_mb=64, rank=0)
    t = torch.empty(64 << 20, dtype=torch.float32, pin_memory=True).normal_()
    f = store.new_file("big")
    f.write(t).wait()
    ref = t.clone()
    t.untyped_storage().resize_(0)
    t.untyped_storage().resize_(ref.numel() * 4)
    assert t.is_pinned()
    f.read(t).wait()
    assert torch.equal(t, ref)
