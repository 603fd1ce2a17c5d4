"""A randomized stress test of the host tier: many steps of ``OffloadOptimizer`` with random delays injected into the
gradient copies, the worker's waits, the updates and the gathers (a seeded RNG, shared by the threads), checked bit
for bit against the plain, non-overlapped path (the same wrapped model stepped by the user's optimizer), and for no
thread left behind once the optimizer is closed.

In-process over a duck-typed process group of one rank (no worker pool), on the CPU. Not covered here: the GPU
budget (placement runs only on CUDA; tests/sharding/test_offload_optim_gpu.py).
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from typing import Any

import pytest
import torch
from torch import nn

from shardfuse import FullyShardedDataParallel as FSDP
from shardfuse import OffloadConfig, OffloadOptimizer
from shardfuse.sharding.host import _host_fused, _host_step, _speculative
from shardfuse.sharding.host._host_shard import HostShard

STEPS = 40
MAX_DELAY_S = 0.002


class _Group:
    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 1


CONFIGS = {
    "adamw-fused-clip": dict(opt="adamw", clip=0.5),
    "sgd-momentum-no_sync": dict(opt="sgd", micro=3),
    "adam-step_in_backward": dict(opt="adam", step_in_backward=True),
    "adamw-orig-params-accumulate": dict(opt="adamw", orig=True, micro=2, accumulate_on_gpu=True, clip=1.0),
    "adamw-ssd": dict(opt="adamw", ssd=True, clip=0.7),
    # speculative_clip: updates speculated in backward, committed or redone at step() (the max norm cycles: the
    # clip fires in some steps and not in others), with and without use_orig_params
    "adamw-fused-speculative-clip": dict(opt="adamw", speculative=True, clip=(0.01, 1e6, 1e6)),
    "sgd-speculative-clip-orig-params": dict(opt="sgd", speculative=True, orig=True, clip=(1e6, 0.01)),
}


def _model(cfg: dict[str, Any], ssd_dir: str | None) -> FSDP:
    torch.manual_seed(0)
    sizes = [7, 33, 19, 41, 5]  # odd sizes: flat shards of unrelated lengths
    blocks = [nn.Sequential(nn.Linear(a, b), nn.Tanh()) for a, b in zip(sizes, sizes[1:])]
    kw: dict[str, Any] = {"process_group": _Group(), "use_orig_params": bool(cfg.get("orig"))}
    if ssd_dir is not None:
        kw["offload_config"] = OffloadConfig(offload_type="ssd_offload", dir=ssd_dir, read_ahead=1)
    else:
        kw["move_params_to_cpu"] = True
    for i in range(len(blocks)):
        blocks[i] = FSDP(blocks[i], **kw)
    return FSDP(nn.Sequential(*blocks, nn.Linear(sizes[-1], 3)), **kw)


def _optimizer(cfg: dict[str, Any], params: Any) -> torch.optim.Optimizer:
    if cfg["opt"] == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-3)
    if cfg["opt"] == "adam":
        return torch.optim.Adam(params, lr=3e-3, amsgrad=True)
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1, fused=True)


def _train(cfg: dict[str, Any], overlapped: bool, ssd_dir: str | None) -> tuple[list[float], dict[str, Any]]:
    model = _model(cfg, ssd_dir)
    opt: Any = _optimizer(cfg, model.parameters())
    if overlapped:
        opt = OffloadOptimizer(model, opt, gpu_budget_gib=0, step_in_backward=bool(cfg.get("step_in_backward")),
                               accumulate_on_gpu=bool(cfg.get("accumulate_on_gpu")), host_threads=1,
                               speculative_clip=bool(cfg.get("speculative")))
    sched = torch.optim.lr_scheduler.StepLR(opt, 5, gamma=0.7)
    gen = torch.Generator().manual_seed(7)
    losses: list[float] = []
    micro = cfg.get("micro", 1)
    for step in range(STEPS):
        for m in range(micro):
            with model.no_sync() if m < micro - 1 else contextlib.nullcontext():
                x, y = torch.randn(4, 7, generator=gen), torch.randn(4, 3, generator=gen)
                loss = (model(x) - y).square().mean()
                loss.backward()
                losses.append(loss.item())
        if cfg.get("clip"):
            clip = cfg["clip"] if not isinstance(cfg["clip"], tuple) else cfg["clip"][step % len(cfg["clip"])]
            losses.append(model.clip_grad_norm_(clip).item())
        opt.step()
        sched.step()  # changes the lr while updates may still be queued: they keep theirs
        opt.zero_grad()
    state = {k: v.clone() for k, v in model.state_dict().items()}  # finishes the updates in flight
    if overlapped and cfg.get("speculative"):
        stats = opt.host_stats()  # the clip fired in some steps and not in others: both paths ran
        assert stats["spec_units_committed"] > 0 and stats["spec_units_redone"] > 0, stats
    if overlapped:
        opt.close()
    return losses, state


def _with_delays(monkeypatch: pytest.MonkeyPatch, rng: random.Random) -> None:
    """Random sleeps before and after the gradient copy, the worker's wait, the update and the gather."""
    lock = threading.Lock()

    def pause() -> None:
        with lock:
            delay = rng.random() * MAX_DELAY_S if rng.random() < 0.5 else 0.0
        time.sleep(delay)

    def delayed(fn: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            pause()
            try:
                return fn(*args, **kwargs)
            finally:
                pause()
        return run

    monkeypatch.setattr(HostShard, "send_grad", delayed(HostShard.send_grad))
    monkeypatch.setattr(HostShard, "before_step", delayed(HostShard.before_step))
    monkeypatch.setattr(HostShard, "source_for_gather", delayed(HostShard.source_for_gather))
    monkeypatch.setattr(_host_step, "step_host_shard", delayed(_host_step.step_host_shard))
    monkeypatch.setattr(_speculative, "speculate", delayed(_speculative.speculate))
    monkeypatch.setattr(_speculative, "commit", delayed(_speculative.commit))


@pytest.fixture
def one_intra_op_thread():
    """Tiny ops on a shared 2-core machine: torch's intra-op threads would spin against each other (and the worker
    sets the process-wide count to host_threads=1 anyway)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("name", list(CONFIGS), ids=list(CONFIGS))
def test_overlapped_under_random_delays_equals_plain(name, monkeypatch, tmp_path, one_intra_op_thread):
    cfg = CONFIGS[name]
    monkeypatch.setattr(_host_fused, "CHUNK_ELEMENTS", _host_fused.ALIGN)  # several chunks where shards allow
    monkeypatch.setattr(_speculative, "SPEC_CHUNK_ELEMENTS", _host_fused.ALIGN)  # the speculation's own chunks too
    ssd = str(tmp_path) if cfg.get("ssd") else None
    want_losses, want = _train(cfg, overlapped=False, ssd_dir=ssd)
    before = set(threading.enumerate())
    _with_delays(monkeypatch, random.Random(sum(map(ord, name))))
    got_losses, got = _train(cfg, overlapped=True, ssd_dir=ssd)
    assert got_losses == want_losses, next(
        f"step value {i} differs: {a!r} vs {b!r}" for i, (a, b) in enumerate(zip(got_losses, want_losses)) if a != b)
    for k in want:
        assert torch.equal(got[k], want[k]), f"{k}: max |diff| {(got[k] - want[k]).abs().max().item():.3e}"
    left = [t for t in threading.enumerate() if t not in before and t.name.startswith("shardfuse-host")]
    assert not left, f"threads left behind after close(): {left}"
