"""capture_step with real CUDA graphs and NCCL, one GPU per rank (skipped without 2 GPUs): captured and
eager training equal bit for bit over 20 steps, and each case that cannot be captured is a clear error."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardfuse import CaptureError, capture_step
from tests.test_capture import batches, build, check_captured_equals_eager, check_contract_errors, make_step

pytestmark = pytest.mark.multigpu

WORLD = 2


def _gpu() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def check_gpu_parity(cfg: dict[str, Any], micro: int) -> dict:
    return check_captured_equals_eager(_gpu(), cfg, micro, steps=20)


def check_host_sync_refused() -> bool:
    dev = _gpu()
    model = build(3, dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=True)
    step = make_step(model, opt)

    def syncing_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if x.abs().sum().item() < 0:  # data-dependent host control flow: a synchronisation
            return x
        return step(x, y)

    x, y = batches(1, 1, dev, seed=4)[0]
    with pytest.raises(CaptureError, match=r"could not capture the step.*\.item\(\)"):
        capture_step(syncing_step, x, y, warmup=2)
    # The process and the model survive the refused capture: a captured step still works afterwards.
    run = capture_step(step, x, y, warmup=1)
    run(x, y)
    torch.cuda.synchronize()
    return True


def check_uncapturable_optimizer_refused() -> bool:
    dev = _gpu()
    model = build(3, dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # capturable=False
    x, y = batches(1, 1, dev, seed=4)[0]
    with pytest.raises(CaptureError, match=r"could not capture the step.*capturable"):
        capture_step(make_step(model, opt), x, y, warmup=1)
    return True


def check_offload_refused_gpu() -> bool:
    dev = _gpu()
    model = build(3, dev, move_params_to_cpu=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = batches(1, 1, dev, seed=5)[0]
    with pytest.raises(CaptureError, match=r"move_params_to_cpu=True.*train it eagerly"):
        capture_step(make_step(model, opt), x, y)
    return True


def check_contract_errors_gpu() -> bool:
    return check_contract_errors(_gpu())


@pytest.mark.parametrize("micro", [1, 2], ids=["step", "accumulate2"])
@pytest.mark.parametrize("cfg", [{}, {"reshard_after_forward": False}, {"mixed_precision": True}],
                         ids=["reshard", "keep", "mixed"])
def test_captured_equals_eager_gpu(pool, cfg, micro):
    out = pool.run(check_gpu_parity, cfg, micro)
    for mem in out:
        assert mem["eager_peak"] > 0 and mem["captured_peak"] > 0 and mem["graph_pool"] >= 0
        print(f"captured peak {mem['captured_peak'] / 2**20:.1f} MiB vs eager {mem['eager_peak'] / 2**20:.1f} MiB, "
              f"graph pool {mem['graph_pool'] / 2**20:.1f} MiB")


@pytest.mark.parametrize(
    "check",
    [check_contract_errors_gpu, check_host_sync_refused, check_uncapturable_optimizer_refused,
     check_offload_refused_gpu],
    ids=lambda f: f.__name__.removeprefix("check_"),
)
def test_capture_errors_gpu(pool, check):
    assert pool.run(check) == [True] * WORLD


def test_no_host_sync_in_replay(pool):
    """Replays queue work without waiting for it: a long queue of steps returns before the GPU finishes."""
    assert pool.run(check_no_host_sync) == [True] * WORLD


def check_no_host_sync() -> bool:
    dev = _gpu()
    model = build(3, dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=True)
    x, y = batches(1, 1, dev, seed=6)[0]
    run = capture_step(make_step(model, opt), x, y, warmup=2)
    run(x, y)
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda._sleep(200_000_000)  # keep the GPU busy (~0.1 s): replays must queue behind it, not wait
    for _ in range(5):
        run(x, y)
    queued = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert queued, "capture_step's replay waited for the GPU on the host"
    assert torch.isfinite(run(x, y)).all()
    return True

