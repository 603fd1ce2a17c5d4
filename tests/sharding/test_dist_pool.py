"""The worker pool itself: results by rank, worker errors re-raised with the rank, timeouts, environment (also
as changed after the session's forkserver started); and one 4-rank parity run (cheap enough to share the pool's
start-up)."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from tests.dist_pool import DistPool, WorkerError


def rank_info(x: int) -> tuple[int, int, int, str | None]:
    t = torch.full((1,), float(dist.get_rank() + x))
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), int(t.item()), os.environ.get("TRITON_INTERPRET")


def fail_on_rank(bad: int) -> int:
    if dist.get_rank() == bad:
        raise ValueError(f"boom on {bad}")
    return dist.get_rank()


def environment(names: tuple[str, ...]) -> dict[str, str | None]:
    return {n: os.environ.get(n) for n in names}


def sleep_forever() -> None:
    time.sleep(3600)


def test_results_by_rank_and_environment(pool4):
    out = pool4.run(rank_info, 10)
    assert [o[:3] for o in out] == [(r, 4, 0 + 1 + 2 + 3 + 40) for r in range(4)]
    # Workers inherit TRITON_INTERPRET from the test process (set by tests/conftest.py without CUDA).
    assert {o[3] for o in out} == {os.environ.get("TRITON_INTERPRET")}


def test_worker_error_names_the_rank(pool4):
    with pytest.raises(WorkerError, match=r"fail_on_rank failed on ranks \[2\]:[\s\S]*rank 2[\s\S]*boom on 2"):
        pool4.run(fail_on_rank, 2)
    assert pool4.run(fail_on_rank, 99) == [0, 1, 2, 3]  # the pool survives a failed check


def test_workers_get_the_environment_at_pool_start(pool4, monkeypatch):
    # The gloo workers fork from a server started once per session (pool4 started it, if nothing before did):
    # a variable set or removed in the test process since then still reaches a new pool's workers as it is now.
    monkeypatch.setenv("SHARDFUSE_POOL_PROBE", "set after the server started")
    monkeypatch.delenv("HOME", raising=False)
    with DistPool(world_size=1) as p:
        (got,) = p.run(environment, ("SHARDFUSE_POOL_PROBE", "HOME", "TRITON_INTERPRET"))
    assert got == environment(("SHARDFUSE_POOL_PROBE", "HOME", "TRITON_INTERPRET"))
    assert got["SHARDFUSE_POOL_PROBE"] == "set after the server started" and got["HOME"] is None


def test_timeout_fails_instead_of_hanging():
    with DistPool(world_size=1) as p, pytest.raises(TimeoutError, match=r"ranks \[0\] gave no answer"):
        p.run(sleep_forever, timeout_s=2)


def test_four_rank_parity(pool4):
    # 4 ranks: gloo may sum the 4 contributions in a different order than rank order, so fp32 results
    # agree to rounding (1e-6 relative), not bits; the 2-rank tests are bit-exact.
    from tests.sharding.test_fsdp_parity import check_parity

    assert pool4.run(check_parity, dict(nested=True), (1e-5, 1e-6)) == [True] * 4
