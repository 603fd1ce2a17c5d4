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



# --------------------------------------------------------------------------------------------------
# the job exits: a torchrun script that trains with a captured step and ends with destroy_process_group()
# --------------------------------------------------------------------------------------------------

EXIT_LIMIT_S = 60.0
_EXIT_SCRIPT = '''
import os
import sys

import torch
import torch.distributed as dist

import shardfuse
from torch.distributed import destroy_process_group  # bound after importing shardfuse, as isort orders it
from tests.test_capture import batches, build, make_step

how = sys.argv[1]
rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(rank)
dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
dev = torch.device("cuda", rank)
model = build(3, dev)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=True, fused=True)
x, y = batches(1, 1, dev, seed=rank)[0]
train_step = shardfuse.capture_step(make_step(model, opt), x, y, warmup=2)
for _ in range(4):
    loss = train_step(x, y)
torch.cuda.synchronize()
if how == "close":
    train_step.close()
    train_step.close()
elif how == "with":
    with shardfuse.capture_step(make_step(model, opt), x, y, warmup=1) as other:
        other(x, y)
elif how == "del":
    del train_step
if how == "imported":
    destroy_process_group()  # the name bound at import: the wrapper closes the open step first
else:
    dist.destroy_process_group()  # train_step (a module global) may still be open: the wrapper closes it
print(f"rank {rank} exited cleanly, loss {loss.item():.4f}", flush=True)
'''


@pytest.mark.gpu
@pytest.mark.parametrize("how", ["open", "imported", "close", "with", "del"])
def test_captured_job_exits_after_destroy_process_group(tmp_path, how):
    """Issue 19 section 7: with NCCL collectives captured in a graph, destroy_process_group() waited forever
    for the graph (NCCL destroys a communicator only after every graph that captured it is destroyed). Every
    way the script may end (the step still open, the function imported by name, close(), a with block, del)
    must let both ranks exit, well within EXIT_LIMIT_S."""
    import os
    import subprocess
    import sys
    import time
    from pathlib import Path

    from tests.dist_pool import free_port

    repo = Path(__file__).resolve().parents[2]
    script = tmp_path / "captured_job.py"
    script.write_text(_EXIT_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")])),
               TORCH_NCCL_ASYNC_ERROR_HANDLING="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           str(script), how]
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=EXIT_LIMIT_S * 2)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"the captured 2-GPU job ({how}) did not exit within {EXIT_LIMIT_S * 2:.0f} s: {err.stdout!r}")
    took = time.monotonic() - start
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    assert proc.stdout.count("exited cleanly") == 2, proc.stdout
    assert took < EXIT_LIMIT_S, f"the job took {took:.1f} s to exit"
