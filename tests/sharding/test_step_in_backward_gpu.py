"""StepInBackward on CUDA with NCCL, one GPU per rank (skipped without 2 GPUs): the updates run on the post-backward
stream beside backward's compute and equal stepping the plain optimizer after backward bit for bit (fp32 and bf16
mixed precision, fused AdamW, original parameters, no_sync); backward leaves no sharded gradient (the plain one leaves
the model's); a captured step (capture_step) with it trains as the eager one does."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardfuse import StepInBackward
from shardfuse.sharding import FullyShardedDataParallel as FSDP
from tests._gpu import on_device
from tests.sharding import _models
from tests.sharding import test_step_in_backward as cpu
from tests.test_capture import batches, build, make_step, train

pytestmark = pytest.mark.multigpu

WORLD = 2


def check_same_as_plain_gpu(cfg: dict[str, Any]) -> bool:
    with on_device(_models), on_device(cpu, models=False):
        return cpu.check_same_as_plain(cfg)


@pytest.mark.parametrize("name", ["adamw", "adamw-fused", "orig-params", "mixed-bf16", "no-sync", "unused-unit-tied"])
def test_step_in_backward_equals_plain_gpu(pool, name):
    cfg = dict(cpu.CASES[name])
    if name == "mixed-bf16":
        cfg["fused"] = True  # the bench's setting: bf16 compute, fp32 shards, torch's fused CUDA AdamW
    assert pool.run(check_same_as_plain_gpu, cfg) == [True] * WORLD


DIM, LAYERS = 1024, 8


def _after_backward(in_backward: bool) -> tuple[int, int, int]:
    """Bytes allocated over what was before, at the end of the third backward of 8 wrapped 1024 x 1024 layers
    (fp32 shards, bf16 compute, fused AdamW); that step's peak; the bytes of the model's sharded gradients."""
    dev = torch.device("cuda", torch.cuda.current_device())
    gc.collect()  # an earlier call's model (reference cycles) must not count here
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.manual_seed(0)
    kw: dict[str, Any] = dict(mixed_precision=True, compute_dtype=torch.bfloat16)
    layers = [FSDP(nn.Sequential(nn.Linear(DIM, DIM), nn.GELU()).to(dev), **kw) for _ in range(LAYERS)]
    model = FSDP(nn.Sequential(*layers), **kw)
    opt: Any = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    if in_backward:
        opt = StepInBackward(model, opt)
    x = torch.randn(64, DIM, device=dev)
    held = peak = 0
    for _ in range(3):  # the last step's: optimizer state made, allocator warm
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        model(x).float().pow(2).mean().backward()
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - base
        opt.step()
        opt.zero_grad()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    grads = sum(p.numel() * 4 for p in model.parameters())
    return held, peak, grads


def check_backward_leaves_no_gradient() -> dict[str, int]:
    plain, plain_peak, grads = _after_backward(False)
    stepped, stepped_peak, _ = _after_backward(True)
    # The plain backward leaves every sharded gradient (fp32); stepping in backward freed each after its update.
    assert plain - stepped >= grads * 0.9, (plain, stepped, grads)
    assert stepped_peak < plain_peak, (stepped_peak, plain_peak)  # the plain step's peak: gradients and the update
    return {"plain_peak": plain_peak, "stepped_peak": stepped_peak, "grads": grads}


def test_step_in_backward_frees_the_gradients_gpu(pool):
    out = pool.run(check_backward_leaves_no_gradient)
    print("peaks (bytes) over the step, plain and in backward:", out)


def check_captured_equals_eager(steps: int = 12) -> bool:
    """capture_step of a step driven by a StepInBackward (capturable AdamW, no clipping) against eager steps."""
    dev = torch.device("cuda", torch.cuda.current_device())
    data = batches(steps + 1, 1, dev, seed=100 + dist.get_rank())
    results = []
    for captured in (False, True):
        model = build(7, dev)
        opt = StepInBackward(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1,
                                                      capturable=True))
        losses, _ = train(make_step(model, opt, 1, clip=None), data, captured)
        results.append((losses, {k: v.cpu() for k, v in model.state_dict().items()}))
    (eager_losses, eager_sd), (graph_losses, graph_sd) = results
    assert torch.equal(graph_losses, eager_losses), (graph_losses, eager_losses)
    for k, v in eager_sd.items():
        assert torch.equal(graph_sd[k], v), k
    return True


def test_step_in_backward_captured_gpu(pool):
    assert pool.run(check_captured_equals_eager) == [True] * WORLD
