"""OffloadOptimizer (overlapped host optimizer steps) against the non-overlapped path, in a 2-process gloo group.

The reference is the same wrapped model (``move_params_to_cpu=True``) stepped by the plain optimizer: parameters,
losses and optimizer state after several steps must be equal bit for bit in fp32 (the per-shard step of a
per-element optimizer is the same arithmetic), with clipping, accumulation across backward passes, ``no_sync``
micro-steps (with and without ``accumulate_on_gpu``), ``zero_grad(set_to_none=False)`` and SGD with momentum.
"""

from __future__ import annotations

import contextlib
import copy
import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardfuse import OffloadOptimizer
from shardfuse.sharding import FullyShardedDataParallel as FSDP
from shardfuse.sharding.host import _gpu_assist, _host_fused, _host_step
from shardfuse.sharding.host._offload_optim import HOST_TILES_ENV
from shardfuse.sharding.host._placement import make_resident as _make_resident
from tests._asserts import assert_same_training_state
from tests.sharding._models import batch, build, loss_fn, make_optim, wrap_model

WORLD = 2
STEPS = 4


def _train(cfg: dict[str, Any], overlapped: bool) -> tuple[FSDP, Any, list[float]]:
    chunk, tile, real_step_in_chunks = _host_fused.CHUNK_ELEMENTS, _host_fused.TILE_ELEMENTS, _host_step.step_in_chunks
    assist_chunk = _gpu_assist.ASSIST_CHUNK
    chunked: list[bool] = []  # what each host shard's step did: True where it ran in cache-sized chunks

    pools: list[Any] = []  # the TilePool each host shard's chunked step was given

    def spy(*args: Any, **kwargs: Any) -> bool:
        pools.append(kwargs.get("pool"))
        chunked.append(not cfg.get("no_chunk") and real_step_in_chunks(*args, **kwargs))
        return chunked[-1]

    _host_fused.CHUNK_ELEMENTS = cfg.get("host_chunk", chunk)
    _host_fused.TILE_ELEMENTS = cfg.get("host_chunk", tile)  # the tiles split the shards as the chunks do
    _gpu_assist.ASSIST_CHUNK = cfg.get("host_chunk", assist_chunk)  # the GPU's share streams the same chunks
    _host_step.step_in_chunks = spy  # type: ignore[assignment]
    try:
        model, opt, losses = _train_loop(cfg, overlapped)
        if overlapped and hasattr(opt, "synchronize"):
            opt.synchronize()
    finally:
        _host_fused.CHUNK_ELEMENTS, _host_fused.TILE_ELEMENTS = chunk, tile
        _gpu_assist.ASSIST_CHUNK = assist_chunk
        _host_step.step_in_chunks = real_step_in_chunks
    if overlapped:
        # torch's fused Adam/AdamW takes the chunked pass once its state exists (every step after the first of a
        # shard); other optimizers never do.
        # (gpu_update_share=1: every update after the first streams through the device instead)
        host_chunked = bool(cfg.get("fused") and not cfg.get("no_chunk") and cfg.get("gpu_update_share", 0) < 1)
        assert any(chunked) == host_chunked, f"chunked steps: {chunked}"
        # the tile pool (SHARDFUSE_HOST_TILES, on unless "0"): every host shard's step is given the worker's pool
        # (the GPU's share steps a unit on the host only where its path does not apply, on its own thread, no pool)
        if not cfg.get("gpu_update_share"):
            assert all((p is not None) == cfg.get("host_tiles", True) for p in pools), f"pools given: {pools}"
    return model, opt, losses


def _train_loop(cfg: dict[str, Any], overlapped: bool) -> tuple[FSDP, Any, list[float]]:
    rank, ws = dist.get_rank(), dist.get_world_size()
    model = wrap_model(build(cfg), {**cfg, "move_params_to_cpu": True})
    if cfg.get("fused"):
        opt: Any = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    else:
        opt = make_optim(model.parameters(), cfg)
    if overlapped:
        with pytest.MonkeyPatch.context() as env:
            env.setenv(HOST_TILES_ENV, "1" if cfg.get("host_tiles", True) else "0")
            opt = OffloadOptimizer(model, opt, gpu_budget_gib=0,
                                   accumulate_on_gpu=cfg.get("accumulate_on_gpu", False),
                                   step_in_backward=cfg.get("step_in_backward", False),
                                   host_compute_copy=cfg.get("host_compute_copy", False),
                                   clip_in_update=cfg.get("clip_in_update", False),
                                   gpu_update_share=cfg.get("gpu_update_share", 0.0))
        if cfg.get("resident_root"):  # as a GPU budget keeps a unit resident: stepped on the caller's thread
            for h in model._unit.handles:
                _make_resident(h, opt.optimizer, h.flat.device)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5) if cfg.get("scheduler") else None
    micro = cfg.get("no_sync_micro", 1)
    losses = []
    for step in range(STEPS):
        for m in range(micro):
            ctx = model.no_sync() if m < micro - 1 else contextlib.nullcontext()
            with ctx:
                ids, target = batch(step * micro + m, rank, ws)
                loss = loss_fn(model, ids, target, step, cfg)
                loss.backward()
                losses.append(loss.item())
        if cfg.get("clip") and cfg.get("clip_in_update") and not overlapped:
            losses.append(_clip_by_division(model, cfg["clip"]))
        elif cfg.get("clip"):
            losses.append(model.clip_grad_norm_(cfg["clip"]).item())
        if cfg.get("clip_again"):  # a second clip sees the gradients the first one scaled (torch's semantics)
            losses.append(model.clip_grad_norm_(cfg["clip_again"]).item())
        if cfg.get("torch_clip_again"):  # torch's function after the model's, before the step
            losses.append(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["torch_clip_again"]).item())
        if cfg.get("read_clipped"):  # what a user logging the clipped gradients reads before the step
            if isinstance(opt, OffloadOptimizer):
                opt.apply_pending_clip()  # the host shards' scaling waits for their update unless asked for
            local = [p.grad.detach().float().pow(2).sum() for p in model.parameters() if p.grad is not None]
            losses.append(torch.stack(local).sum().item())
        if cfg.get("backward_after_clip"):  # more gradient accumulated onto the clipped one, then the step
            ids, target = batch(100 + step, rank, ws)
            loss = loss_fn(model, ids, target, step, cfg)
            loss.backward()
            losses.append(loss.item())
        if step in cfg.get("skip_step_at", ()):  # e.g. a non-finite norm: the loop drops the gradients, no step
            opt.zero_grad()
            continue
        opt.step()
        if sched is not None:  # changes the lr while the host may still be stepping: the queued steps keep theirs
            sched.step()
        if not cfg.get("keep_grads"):
            opt.zero_grad(set_to_none=cfg.get("set_to_none", True))
    return model, opt, losses


def _clip_by_division(model: FSDP, max_norm: float) -> float:
    """The plain path's reference for ``clip_in_update``: the same global norm and coefficient as
    ``OffloadOptimizer.clip_grad_norm_``, each gradient then divided by ``fp32(1 / coef)`` (``Tensor.div_``)."""
    total = model.clip_grad_norm_(float("inf"))  # the norm; a coefficient clamped to 1 leaves the gradients as they are
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    inverse = torch.reciprocal(coef.to("cpu", torch.float32))
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.grad.div_(inverse.to(p.grad.device))
    return total.item()


def check_same_as_plain(cfg: dict[str, Any]) -> bool:
    model, opt, losses = _train(cfg, overlapped=True)
    ref, ref_opt, ref_losses = _train(cfg, overlapped=False)
    stats = opt.host_stats()
    busy = stats["host_busy_s"] + stats.get("gpu_update_busy_s", 0.0)  # the host's worker, the GPU share's
    assert busy > 0 and stats["wait_s"] >= 0 and stats["host_threads"] >= 1, stats
    assert 0 < stats["update_s"] <= busy, stats  # updating is part of the workers' busy time
    assert stats["placements_left"] == 0, stats  # a CPU compute device: no GPU budget to place units by
    if cfg.get("gpu_update_share"):
        _check_gpu_share_ran(cfg, stats)
    assert losses == ref_losses, f"losses (and clip norms) differ: {losses} vs {ref_losses}"
    assert_same_training_state(model, ref, opt, ref_opt)  # state_dict finishes the step in flight first
    for p, q in zip(model.parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None)
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad), "gradients left after the last step differ"
    opt.close()
    return True


def _check_gpu_share_ran(cfg: dict[str, Any], stats: dict[str, float]) -> None:
    """The GPU share steps units only where clipping scales the update (a clip that fires: the test clips at 0.05,
    1e6 never fires), from the second step (the first makes the state on the host)."""
    fires = cfg.get("clip", float("inf")) < 1.0 and not cfg.get("step_in_backward")
    if fires and cfg.get("fused"):
        assert stats["gpu_update_units"] > 0 and stats["gpu_update_elements"] > 0, stats
    elif not fires:
        assert stats["gpu_update_units"] == 0, stats


def check_close_to_plain(cfg: dict[str, Any], tol: tuple[float, float]) -> bool:
    """As :func:`check_same_as_plain` within ``tol`` (rtol, atol): for clipping on a GPU, where each unit's norm is
    taken on the device by the overlapped path and on the host by the plain one."""
    model, opt, losses = _train(cfg, overlapped=True)
    ref, _, ref_losses = _train(cfg, overlapped=False)
    if cfg.get("gpu_update_share"):  # the device's share ran where clipping scaled the update, its state pinned
        _check_gpu_share_ran(cfg, opt.host_stats())
        if cfg["gpu_update_share"] == 1.0 and torch.cuda.is_available():
            moments = [t for s in opt.optimizer.state.values() for k, t in s.items() if k.startswith("exp_avg")]
            assert moments and all(t.is_pinned() for t in moments), "the GPU share's moments are not page-locked"
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=tol[0], atol=tol[1])
    sd, ref_sd = model.state_dict(), ref.state_dict()
    for k in ref_sd:
        torch.testing.assert_close(sd[k], ref_sd[k], rtol=tol[0], atol=tol[1], msg=k)
    opt.close()
    return True


CASES = {
    "adamw": dict(),
    "adamw-fused": dict(fused=True),
    # The chunked host pass (scale, fused update, compute copy per chunk): chunks of 4096 elements split the
    # shards of the test model, with clipping, accumulation and step_in_backward.
    "adamw-fused-chunked-clip": dict(fused=True, host_chunk=4096, clip=0.05),
    "adamw-fused-chunked-no-sync": dict(fused=True, host_chunk=4096, no_sync_micro=3, clip=0.05),
    "adamw-fused-chunked-step-in-backward": dict(fused=True, host_chunk=4096, step_in_backward=True,
                                                 scheduler=True),
    "adamw-fused-chunked-zero-not-none": dict(fused=True, host_chunk=4096, set_to_none=False, clip=0.05),
    "sgd-momentum": dict(optim="sgd"),
    "clip": dict(clip=0.05),
    "clip-sgd": dict(clip=0.05, optim="sgd"),
    "keep-grads": dict(keep_grads=True, optim="sgd"),
    "zero-not-none": dict(set_to_none=False),
    "no-sync": dict(no_sync_micro=3, clip=0.05),
    "no-sync-accumulate-on-gpu": dict(no_sync_micro=3, accumulate_on_gpu=True, clip=0.05),
    "root-only": dict(nested=False, clip=0.05),
    "no-reshard": dict(reshard_after_forward=False),
    "unused-unit": dict(extra=True, clip=0.05),
    "tied": dict(tied=True),
    "checkpoint": dict(ckpt=True),
    "scheduler-clip": dict(scheduler=True, clip=0.05),
    "clip-twice": dict(clip=0.05, clip_again=0.02),
    "clip-then-read-gradients": dict(clip=0.05, read_clipped=True),
    "clip-twice-then-read-fused": dict(fused=True, clip=0.05, clip_again=0.02, read_clipped=True),
    "clip-then-skip-the-step": dict(clip=0.05, skip_step_at=(1,)),
    "clip-then-skip-the-step-fused": dict(fused=True, host_chunk=4096, clip=0.05, skip_step_at=(0, 2)),
    "clip-then-backward-again": dict(clip=0.05, backward_after_clip=True),
    "clip-then-backward-again-fused": dict(fused=True, host_chunk=4096, clip=0.05, backward_after_clip=True),
    "clip-then-torch-clip": dict(clip=0.05, torch_clip_again=0.02),
    "clip-keep-grads": dict(clip=0.05, keep_grads=True, optim="sgd"),
    "clip-keep-grads-fused": dict(fused=True, host_chunk=4096, clip=0.05, keep_grads=True),
    "resident-root-clip": dict(resident_root=True, clip=0.05),
    # clip_in_update: each host shard's gradient divided by 1 / coef (in the fused kernel once its state exists;
    # in a pass of its own for the first step and other optimizers), as the plain reference does by hand.
    "clip-in-update-fused": dict(fused=True, clip=0.05, clip_in_update=True),
    "clip-in-update-fused-chunked": dict(fused=True, host_chunk=4096, clip=0.05, clip_in_update=True),
    "clip-in-update-read-fused": dict(fused=True, clip=0.05, read_clipped=True, clip_in_update=True),
    "clip-in-update-sgd": dict(clip=0.05, optim="sgd", clip_in_update=True),
    "clip-in-update-no-sync": dict(fused=True, no_sync_micro=3, clip=0.05, clip_in_update=True),
    # A clip that does not fire (the norm under max_norm): the host updates skip the scaling (x * 1 is x).
    "clip-not-firing-fused-chunked": dict(fused=True, host_chunk=4096, clip=1e6),
    "clip-not-firing-sgd": dict(clip=1e6, optim="sgd"),
    "clip-in-update-not-firing-fused": dict(fused=True, clip=1e6, clip_in_update=True),
    # The scaled chunks run as tiles on the worker's pool by default; SHARDFUSE_HOST_TILES=0: over torch's threads.
    "no-tiles-fused-chunked-clip": dict(fused=True, host_chunk=4096, clip=0.05, host_tiles=False),
    "no-tiles-fused-clip-compute-copy": dict(fused=True, host_chunk=4096, clip=0.05, host_compute_copy=True,
                                             host_tiles=False),
    "tiles-fused-clip-compute-copy": dict(fused=True, host_chunk=4096, clip=0.05, host_compute_copy=True),
    "no-tiles-fused-step-in-backward": dict(fused=True, host_chunk=4096, step_in_backward=True, host_tiles=False),
    # gpu_update_share: the last units' updates stream through the compute device (here the CPU, whose fused kernel
    # is the host's: the same bits), chunk by chunk through reused buffers, beside the host worker's.
    "gpu-share-half-fused-chunked-clip": dict(fused=True, host_chunk=4096, clip=0.05, gpu_update_share=0.5),
    "gpu-share-all-fused-clip-compute-copy": dict(fused=True, host_chunk=4096, clip=0.05, host_compute_copy=True,
                                                  gpu_update_share=1.0),
    "gpu-share-half-step-in-backward": dict(fused=True, host_chunk=4096, step_in_backward=True, scheduler=True,
                                            gpu_update_share=0.5),
    "gpu-share-half-clip-in-update": dict(fused=True, clip=0.05, clip_in_update=True, gpu_update_share=0.5),
    "gpu-share-half-sgd-clip": dict(optim="sgd", clip=0.05, gpu_update_share=0.5),
    "gpu-share-half-clip-not-firing": dict(fused=True, clip=1e6, gpu_update_share=0.5),
    "gpu-share-half-scheduler-no-sync-tied": dict(fused=True, host_chunk=4096, clip=0.05, scheduler=True,
                                                  no_sync_micro=2, tied=True, gpu_update_share=0.5),
    "step-in-backward": dict(step_in_backward=True, scheduler=True),
    "step-in-backward-no-sync": dict(step_in_backward=True, no_sync_micro=2, accumulate_on_gpu=True),
    "step-in-backward-unused-unit": dict(step_in_backward=True, extra=True, optim="sgd"),
}


@pytest.mark.parametrize("cfg", list(CASES.values()), ids=list(CASES))
def test_bit_exact_against_plain_offload(pool, cfg):
    assert pool.run(check_same_as_plain, cfg) == [True] * WORLD


def check_mixed_precision(cfg: dict[str, Any]) -> bool:
    """bf16 compute: the compute-dtype host copy is cast by torch on the host, the plain path by the shard cast
    kernel (which the Triton interpreter does not round to nearest-even): equal within bf16 rounding."""
    model, _, losses = _train({**cfg, "mixed_precision": True, "compute_dtype": torch.bfloat16}, overlapped=True)
    ref, _, ref_losses = _train({**cfg, "mixed_precision": True, "compute_dtype": torch.bfloat16},
                                overlapped=False)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=2e-2, atol=2e-2)
    sd, ref_sd = model.state_dict(), ref.state_dict()
    for k in ref_sd:
        torch.testing.assert_close(sd[k], ref_sd[k], rtol=2e-2, atol=2e-2, msg=k)
    assert model.module.head.weight.dtype == torch.float32  # resharded: the placeholder has the shard dtype
    return True


@pytest.mark.parametrize("cfg", [dict(optim="sgd", clip=0.05), dict(host_compute_copy=True, clip=0.05, optim="sgd")],
                         ids=["device-cast", "host-compute-copy"])
def test_mixed_precision_close(pool, cfg):
    assert pool.run(check_mixed_precision, cfg) == [True] * WORLD


def check_chunked_compute_copy(cfg: dict[str, Any]) -> bool:
    """bf16 compute with the host compute copy: the chunked pass (the copy written chunk by chunk behind the
    update) equals the optimizer's own step followed by a whole-shard copy, bit for bit."""
    base = {**cfg, "mixed_precision": True, "compute_dtype": torch.bfloat16, "host_compute_copy": True,
            "fused": True}
    model, _, losses = _train({**base, "host_chunk": 4096}, overlapped=True)
    ref, _, ref_losses = _train({**base, "no_chunk": True}, overlapped=True)
    assert losses == ref_losses, f"{losses} vs {ref_losses}"
    sd, ref_sd = model.state_dict(), ref.state_dict()
    for k in ref_sd:
        assert torch.equal(sd[k], ref_sd[k]), k
    return True


@pytest.mark.parametrize("cfg", [dict(clip=0.05), dict(step_in_backward=True), dict(no_sync_micro=2, clip=0.05)],
                         ids=["clip", "step-in-backward", "no-sync"])
def test_chunked_compute_copy_equals_whole_copy(pool, cfg):
    assert pool.run(check_chunked_compute_copy, cfg) == [True] * WORLD


def check_step_in_backward_waits_for_the_budget() -> bool:
    """Where a budget may place units (faked on the CPU), the first backward queues no update (every unit's host
    optimizer state would exist before the placement); later backward passes do; values equal the plain path."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    cfg: dict[str, Any] = {}
    model = wrap_model(build(cfg), {"move_params_to_cpu": True})
    ref = wrap_model(build(cfg), {"move_params_to_cpu": True})  # build() is seeded: the same initial values
    opt = OffloadOptimizer(model, make_optim(model.parameters(), cfg), gpu_budget_gib=0, step_in_backward=True)
    opt._budget_applies = lambda: True  # type: ignore[method-assign]  # as on a GPU with a budget
    ref_opt = make_optim(ref.parameters(), cfg)
    hosts = [h.host for u in _units(model) for h in u.handles if h.host is not None]
    for step in range(3):
        ids, target = batch(step, rank, ws)
        for m, o in ((model, opt), (ref, ref_opt)):
            loss_fn(m, ids, target, step, cfg).backward()
            if m is model:
                queued = len(opt._stepped_in_backward)  # the units whose update this backward queued
                assert queued == (len(hosts) if step else 0), f"step {step}: {queued} updates queued in backward"
            o.step()
            o.zero_grad()
    sd, ref_sd = model.state_dict(), ref.state_dict()
    for k in ref_sd:
        assert torch.equal(sd[k], ref_sd[k]), k
    opt.close()
    return True


def _units(model: FSDP) -> list[Any]:
    from shardfuse.sharding.core._tree import units_below

    return list(units_below(model._unit))


def test_step_in_backward_waits_for_the_budget_placement(pool):
    assert pool.run(check_step_in_backward_waits_for_the_budget) == [True] * WORLD


def check_second_placement(step_in_backward: bool) -> bool:
    """The budget places units at the first step() and adds the next ones in forward order at the second (by the
    peak measured with the first placement; faked here: the CPU stands in for the GPU); values equal the plain
    path bit for bit, so no unit moved after its host update in backward is stepped twice."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    cfg: dict[str, Any] = {}
    model = wrap_model(build(cfg), {"move_params_to_cpu": True})
    ref = wrap_model(build(cfg), {"move_params_to_cpu": True})
    handles = [h for u in _units(model) for h in u.handles]
    budget = 1 << 30
    opt = OffloadOptimizer(model, make_optim(model.parameters(), cfg), gpu_budget_gib=1.0,
                           step_in_backward=step_in_backward)
    opt._budget_applies = lambda: True  # type: ignore[method-assign]  # as on a GPU
    ref_opt = make_optim(ref.parameters(), cfg)
    peaks: list[int] = []  # what max_memory_allocated reports at each placement: room for one unit each time
    real = torch.cuda.max_memory_allocated
    torch.cuda.max_memory_allocated = lambda *a, **k: peaks.pop(0)  # type: ignore[assignment]
    try:
        for step in range(4):
            ids, target = batch(step, rank, ws)
            for m, o in ((model, opt), (ref, ref_opt)):
                loss_fn(m, ids, target, step, cfg).backward()
                if m is model and step < 2:
                    order = [h for h in opt._handles_in_order() if h.host is not None]
                    peaks.append(budget - order[0].flat.numel() * 16 - 1)  # room for the next unit alone
                o.step()
                o.zero_grad()
            resident = [h for h in handles if h.host is None]
            assert len(resident) == min(step + 1, 2), f"step {step}: {len(resident)} resident"
    finally:
        torch.cuda.max_memory_allocated = real  # type: ignore[assignment]
    assert resident == opt._handles_in_order()[:2], "the resident units are the first two of the forward order"
    sd, ref_sd = model.state_dict(), ref.state_dict()
    for k in ref_sd:
        assert torch.equal(sd[k], ref_sd[k]), k
    opt.close()
    return True


@pytest.mark.parametrize("step_in_backward", [False, True], ids=["after-backward", "in-backward"])
def test_second_placement_adds_the_next_units(pool, step_in_backward):
    assert pool.run(check_second_placement, step_in_backward) == [True] * WORLD


def _train_held(steps: int, hold_at: int | None) -> tuple[FSDP, list[bool]]:
    """step_in_backward over ``steps`` steps; at step ``hold_at`` the host updates wait for a gate that opens only
    after ``step()`` has been called (from a thread, so a step() that waits for them cannot hang the test).
    Returns the model and, per held step, whether step() returned with updates still held."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    model = wrap_model(build({}), {"move_params_to_cpu": True})
    opt: Any = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    if hold_at is not None:
        opt = OffloadOptimizer(model, opt, gpu_budget_gib=0, step_in_backward=True)
    real, gate, returned = _host_step.step_host_shard, threading.Event(), []

    def held(*args: Any, **kwargs: Any) -> None:
        gate.wait(timeout=60)
        real(*args, **kwargs)

    try:
        for step in range(steps):
            if step == hold_at:
                _host_step.step_host_shard = held  # type: ignore[assignment]
            ids, target = batch(step, rank, ws)
            loss_fn(model, ids, target, step, {}).backward()
            stepper = threading.Thread(target=opt.step)
            stepper.start()
            stepper.join(timeout=10)
            if step == hold_at:
                returned.append(not stepper.is_alive())
                gate.set()
                stepper.join()
            opt.zero_grad(set_to_none=True)
        if hold_at is not None:
            opt.synchronize()
    finally:
        _host_step.step_host_shard = real
        gate.set()
    return model, returned


def check_step_in_backward_overlaps_the_next_forward() -> bool:
    """step() returns while the updates its backward queued still run (the next forward's gathers wait for each
    unit's own); the parameters are those of the plain path."""
    model, returned = _train_held(4, hold_at=2)
    ref, _ = _train_held(4, hold_at=None)
    assert returned == [True], "step() waited for the updates queued in its own backward"
    sd, ref_sd = model.state_dict(), ref.state_dict()
    for k in ref_sd:
        assert torch.equal(sd[k], ref_sd[k]), f"{k}: max |diff| {(sd[k] - ref_sd[k]).abs().max().item():.3e}"
    return True


def test_step_in_backward_overlaps_the_next_forward(pool):
    assert pool.run(check_step_in_backward_overlaps_the_next_forward) == [True] * WORLD


def check_gpu_share_beside_a_held_host_update() -> bool:
    """The GPU share's units finish while the host worker is held inside an update (holding the step lock through
    it, as it does): the share takes a lock of its own, so the two run side by side."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    model = wrap_model(build({}), {"move_params_to_cpu": True})
    opt = OffloadOptimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True), gpu_budget_gib=0,
                           gpu_update_share=0.5)
    real, gate = _host_step.step_host_shard, threading.Event()

    def held(*args: Any, **kwargs: Any) -> None:
        gate.wait(timeout=60)
        real(*args, **kwargs)

    try:
        for step in range(2):  # the first step makes the state; the second streams the share's units
            ids, target = batch(step, rank, ws)
            loss_fn(model, ids, target, step, {}).backward()
            model.clip_grad_norm_(0.05)  # fires: the share runs where clipping scales the update
            if step == 1:
                _host_step.step_host_shard = held  # type: ignore[assignment]
            opt.step()
            if step == 0:  # the state is made by the host worker alone: the share's thread never made any
                opt.synchronize()
                assert opt.host_stats()["gpu_update_busy_s"] == 0.0, opt.host_stats()
        assert opt._assist is not None
        share = [plan.host for plan in opt._plans if plan.host is not None and id(plan.host) in opt._assist.chosen]
        deadline = time.monotonic() + 30
        while any(h.in_flight for h in share) and time.monotonic() < deadline:
            time.sleep(0.01)
        finished = [not h.in_flight for h in share]
    finally:
        gate.set()
        _host_step.step_host_shard = real
    opt.synchronize()
    units = opt.host_stats()["gpu_update_units"]  # step 1's share, streamed (step 0 made the state on the host)
    opt.close()
    assert share and units > 0 and all(finished), f"the GPU share behind the held host update: {finished}, {units}"
    return True


def test_gpu_share_beside_a_held_host_update(pool):
    assert pool.run(check_gpu_share_beside_a_held_host_update) == [True] * WORLD


def check_step_in_backward_misuse() -> bool:
    rank, ws = dist.get_rank(), dist.get_world_size()
    model = wrap_model(build({}), {"move_params_to_cpu": True})
    opt = OffloadOptimizer(model, make_optim(model.parameters(), {}), gpu_budget_gib=0, step_in_backward=True)
    ids, target = batch(0, rank, ws)
    loss_fn(model, ids, target, 0, {}).backward()
    with pytest.raises(RuntimeError, match="global norm"):
        model.clip_grad_norm_(1.0)
    with pytest.raises(RuntimeError, match="step_in_backward=True"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the process-wide function refuses too
    opt.zero_grad()
    with pytest.raises(RuntimeError, match="step\\(\\) after every synced backward"):
        loss_fn(model, ids, target, 0, {}).backward()  # a second update before step()
    opt.close()
    model = wrap_model(build({}), {"move_params_to_cpu": True})
    opt = OffloadOptimizer(model, make_optim(model.parameters(), {}), gpu_budget_gib=0, step_in_backward=True)
    loss_fn(model, ids, target, 0, {}).backward()
    opt.step()
    with pytest.raises(RuntimeError, match="zero_grad\\(set_to_none=True\\)"):
        loss_fn(model, ids, target, 0, {}).backward()  # gradients kept: they would be stepped twice
    opt.close()
    return True


def test_step_in_backward_refuses_what_it_cannot_do(pool):
    assert pool.run(check_step_in_backward_misuse) == [True] * WORLD


def check_consistent_reads_after_step() -> bool:
    """Right after step(), with updates in flight (slowed down on the host), state dicts and summon see the updated
    values: overlapped after step(), and under step_in_backward once the placements are done (step() then
    returns without waiting for the updates its backward queued)."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    real = _host_step.step_host_shard

    def slow(*args: Any, **kwargs: Any) -> None:
        time.sleep(0.05)  # still running when the reads below start
        real(*args, **kwargs)

    outs = []
    for mode in ("overlapped", "step_in_backward", "plain"):
        model = wrap_model(build({}), {"move_params_to_cpu": True})
        opt = inner = make_optim(model.parameters(), {})
        if mode != "plain":
            opt = OffloadOptimizer(model, opt, gpu_budget_gib=0, step_in_backward=mode == "step_in_backward")
        try:
            for step in range(3):
                if step == 2:
                    _host_step.step_host_shard = slow  # type: ignore[assignment]
                ids, target = batch(step, rank, ws)
                loss_fn(model, ids, target, step, {}).backward()
                opt.step()
                if step < 2:
                    opt.zero_grad(set_to_none=True)
            inner_osd = copy.deepcopy(inner.state_dict())  # first: the wrapped optimizer's own state_dict() waits too
            with model.summon_full_params():
                summoned = {n: p.detach().clone() for n, p in model.named_parameters()}
            outs.append((model.state_dict(), summoned, opt.state_dict(), inner_osd))
        finally:
            _host_step.step_host_shard = real
    *got, (ref_sd, ref_summ, ref_osd, _) = outs
    for sd, summ, osd, inner_osd in got:
        assert all(torch.equal(sd[k], ref_sd[k]) for k in ref_sd)
        assert all(torch.equal(summ[k], ref_summ[k]) for k in ref_summ)
        for o in (osd, inner_osd):
            assert all(torch.equal(o["state"][i]["exp_avg"], ref_osd["state"][i]["exp_avg"]) for i in ref_osd["state"])
    return True


def check_module_zero_grad_after_step(set_to_none: bool) -> bool:
    """``model.zero_grad()`` (nn.Module's, not the optimizer's: Hugging Face's Trainer calls it) right after
    step(), while the updates still wait (slowed down on the host): the updates step the gradients of their own
    backward, as the plain optimizer did; zeroing in place instead is refused at the next wait, not stepped."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    real = _host_step._reclaim_grads

    def slow(*args: Any, **kwargs: Any) -> Any:
        time.sleep(0.05)  # every update starts after model.zero_grad() ran
        return real(*args, **kwargs)

    sds = []
    for overlapped in (True, False):
        model = wrap_model(build({}), {"move_params_to_cpu": True})
        opt = make_optim(model.parameters(), {})
        if overlapped:
            opt = OffloadOptimizer(model, opt, gpu_budget_gib=0)
            _host_step._reclaim_grads = slow  # type: ignore[assignment]
        refused = pytest.raises(RuntimeError, match=r"changed after OffloadOptimizer.step\(\) queued")
        try:
            with refused if overlapped and not set_to_none else contextlib.nullcontext():
                for step in range(3):  # in place: the next forward's gather waits for the update, and raises
                    ids, target = batch(step, rank, ws)
                    loss_fn(model, ids, target, step, {}).backward()
                    opt.step()
                    model.zero_grad(set_to_none=set_to_none)
                if overlapped:
                    opt.synchronize()
            if overlapped and not set_to_none:
                return True
            if overlapped:
                assert all(p.grad is None for p in model.parameters()), "the gradients dropped came back"
        finally:
            _host_step._reclaim_grads = real
        sds.append(model.state_dict())
    assert all(torch.equal(sds[0][k], sds[1][k]) for k in sds[1])
    return True


@pytest.mark.parametrize("set_to_none", [True, False], ids=["set-to-none", "in-place"])
def test_module_zero_grad_after_step(pool, set_to_none):
    assert pool.run(check_module_zero_grad_after_step, set_to_none) == [True] * WORLD


def test_reads_after_step_see_the_update(pool):
    assert pool.run(check_consistent_reads_after_step) == [True] * WORLD


def _saved_run() -> tuple[dict[str, Any], dict[str, Any]]:
    """The model and optimizer state dicts after a default OffloadOptimizer run (closed)."""
    model, opt, _ = _train({}, overlapped=True)
    saved = model.state_dict(), opt.state_dict()
    opt.close()
    return saved


def check_load_state_dict_resumes() -> bool:
    """A resumed OffloadOptimizer (state loaded into a fresh optimizer) continues exactly as the plain one."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    saved_model, saved_opt = _saved_run()
    results = []
    for overlapped in (True, False):
        fresh = wrap_model(build({}), {"move_params_to_cpu": True})
        fresh.load_state_dict(saved_model)
        o = make_optim(fresh.parameters(), {})
        if overlapped:
            o = OffloadOptimizer(fresh, o, gpu_budget_gib=0)
        o.load_state_dict(copy.deepcopy(saved_opt))  # torch's load shares the tensors: no run may see another's
        for step in range(2):
            ids, target = batch(10 + step, rank, ws)
            loss_fn(fresh, ids, target, step, {}).backward()
            fresh.clip_grad_norm_(0.05)
            o.step()
            o.zero_grad()
        results.append(fresh.state_dict())
    assert all(torch.equal(results[0][k], results[1][k]) for k in results[1])
    return True


def check_the_wrapped_optimizer_used_directly() -> bool:
    """The optimizer an OffloadOptimizer wraps, used directly: loading a state dict into it after the
    OffloadOptimizer stepped reaches the next steps (as with the plain optimizer); its own step() is refused while
    wrapped, and steps again after close()."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    saved_model, saved_opt = _saved_run()
    results = []
    for overlapped in (True, False):
        fresh = wrap_model(build({}), {"move_params_to_cpu": True})
        inner = make_optim(fresh.parameters(), {})
        o = OffloadOptimizer(fresh, inner, gpu_budget_gib=0) if overlapped else inner
        for step in range(4):
            if step == 1:  # after a step: the per-shard optimizers share the state the load replaces
                fresh.load_state_dict(saved_model)
                inner.load_state_dict(copy.deepcopy(saved_opt))
            ids, target = batch(10 + step, rank, ws)
            loss_fn(fresh, ids, target, step, {}).backward()
            if step == 3 and overlapped:
                with pytest.raises(RuntimeError, match=r"call step\(\) on the OffloadOptimizer"):
                    inner.step()
                o.close()  # the last step by the wrapped optimizer itself, as in the plain run
            inner.step() if step == 3 else o.step()
            inner.zero_grad()
        results.append((fresh.state_dict(), inner.state_dict()["state"]))
    (sd, state), (ref_sd, ref_state) = results
    assert all(torch.equal(sd[k], ref_sd[k]) for k in ref_sd)
    assert all(torch.equal(state[i]["exp_avg_sq"], ref_state[i]["exp_avg_sq"]) for i in ref_state)
    return True


def test_the_wrapped_optimizer_used_directly(pool):
    assert pool.run(check_the_wrapped_optimizer_used_directly) == [True] * WORLD


def test_load_state_dict_resumes(pool):
    assert pool.run(check_load_state_dict_resumes) == [True] * WORLD


def check_worker_error_surfaces() -> bool:
    rank, ws = dist.get_rank(), dist.get_world_size()
    model = wrap_model(build({}), {"move_params_to_cpu": True})
    opt = OffloadOptimizer(model, make_optim(model.parameters(), {}), gpu_budget_gib=0)
    ids, target = batch(0, rank, ws)
    loss_fn(model, ids, target, 0, {}).backward()
    opt.param_groups[0]["lr"] = "not a number"  # the host step raises on the worker thread
    opt.step()
    with pytest.raises(RuntimeError, match="overlapped optimizer step"):
        model(ids)
    return True


def test_worker_error_is_raised_at_the_next_forward(pool):
    assert pool.run(check_worker_error_surfaces) == [True] * WORLD


def check_gpu_share_error_surfaces(where: str) -> bool:
    """An error in the GPU share's update (queueing it, or its wait outside the lock) is raised at the next forward
    that needs the unit, as a host update's is; the other units and the optimizer stay usable."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    model = wrap_model(build({}), {"move_params_to_cpu": True})
    opt = OffloadOptimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True), gpu_budget_gib=0,
                           gpu_update_share=1.0)
    ids, target = batch(0, rank, ws)
    for step in range(2):  # the first step makes the state on the host; the second goes through the device path
        loss_fn(model, ids, target, step, {}).backward()
        model.clip_grad_norm_(0.05)
        if step == 1:
            name = "call_fused_adam" if where == "queue" else "mark_updated"
            broken = pytest.MonkeyPatch()
            broken.setattr(_gpu_assist, name, lambda *a, **k: (_ for _ in ()).throw(RuntimeError("device broke")))
        opt.step()
        opt.zero_grad()
    try:
        with pytest.raises(RuntimeError, match="overlapped optimizer step.*device broke"):
            model(ids)
    finally:
        broken.undo()
    for _ in range(len(opt._plans)):  # every failed unit raises once (at its next wait): then close() succeeds
        try:
            opt.close()
            break
        except RuntimeError as err:
            assert "device broke" in str(err), err
    else:
        opt.close()
    return True


@pytest.mark.parametrize("where", ["queue", "wait"])
def test_gpu_share_error_is_raised_at_the_next_forward(pool, where):
    assert pool.run(check_gpu_share_error_surfaces, where) == [True] * WORLD


def check_bad_arguments() -> bool:
    plain = wrap_model(build({}), {})
    with pytest.raises(ValueError, match="move_params_to_cpu=True"):
        OffloadOptimizer(plain, make_optim(plain.parameters(), {}))
    model = wrap_model(build({}), {"move_params_to_cpu": True})
    with pytest.raises(TypeError, match="Adagrad"):
        OffloadOptimizer(model, torch.optim.Adagrad(model.parameters()))
    with pytest.raises(ValueError, match="gpu_budget_gib"):
        OffloadOptimizer(model, make_optim(model.parameters(), {}), gpu_budget_gib=-1)
    with pytest.raises(ValueError, match="nested"):
        OffloadOptimizer(model.module.blocks[0], make_optim(model.parameters(), {}))
    for bad in (0, -2, 1.5):
        with pytest.raises(ValueError, match=rf"host_threads.*{bad}"):
            OffloadOptimizer(model, make_optim(model.parameters(), {}), host_threads=bad)  # type: ignore[arg-type]
    for bad in (-0.1, 1.5, float("nan"), True):
        with pytest.raises(ValueError, match=rf"gpu_update_share.*{bad}"):
            OffloadOptimizer(model, make_optim(model.parameters(), {}), gpu_update_share=bad)
    with pytest.raises(ValueError, match="speculative_clip"):
        OffloadOptimizer(model, make_optim(model.parameters(), {}), gpu_update_share=0.5, speculative_clip=True)
    with pytest.raises(ValueError, match="closure"):
        OffloadOptimizer(model, make_optim(model.parameters(), {})).step(lambda: 0.0)
    return True


def test_bad_arguments(pool):
    assert pool.run(check_bad_arguments) == [True] * WORLD


def check_freed_when_dropped() -> bool:
    """Dropping the model and its OffloadOptimizer frees both (and the host buffers and worker thread)."""
    import gc
    import threading
    import weakref

    rank, ws = dist.get_rank(), dist.get_world_size()
    threads = threading.active_count()
    model = wrap_model(build({}), {"move_params_to_cpu": True})
    opt = OffloadOptimizer(model, make_optim(model.parameters(), {}), gpu_budget_gib=0)
    ids, target = batch(0, rank, ws)
    loss_fn(model, ids, target, 0, {}).backward()
    opt.step()
    refs = [weakref.ref(model), weakref.ref(opt), weakref.ref(model._unit.handles[0].host.grad_buf)]
    del model, opt
    gc.collect()
    assert all(r() is None for r in refs), [r() is None for r in refs]
    deadline = threading.Event()
    for _ in range(50):  # the worker thread ends once its finalizer ran
        if threading.active_count() <= threads:
            break
        deadline.wait(0.1)
    assert threading.active_count() <= threads, "the host-step worker thread outlived its optimizer"
    return True


def test_dropping_the_model_and_optimizer_frees_them(pool):
    assert pool.run(check_freed_when_dropped) == [True] * WORLD


def test_choose_resident_counts_from_the_start():
    from shardfuse.sharding.host._placement import choose_resident

    sizes = [10, 20, 30, 40]  # forward order: the first units stay resident
    assert choose_resident(sizes, budget_bytes=0, bytes_per_element=16) == 0
    assert choose_resident(sizes, budget_bytes=9 * 16, bytes_per_element=16) == 0
    assert choose_resident(sizes, budget_bytes=10 * 16, bytes_per_element=16) == 1
    assert choose_resident(sizes, budget_bytes=30 * 16, bytes_per_element=16) == 2
    assert choose_resident(sizes, budget_bytes=59 * 16, bytes_per_element=16) == 2
    assert choose_resident(sizes, budget_bytes=1e18, bytes_per_element=16) == 4


def test_default_budget_respects_the_process_memory_fraction(monkeypatch):
    """The default budget plans within ``set_per_process_memory_fraction``'s cap (a GPU shared between processes):
    planning for the whole device would place units the allocator then refuses."""
    from types import SimpleNamespace

    from shardfuse.plan._planner import GPU_USABLE as PLANNER_USABLE
    from shardfuse.sharding.host import _host_keep, _placement

    total = 80 * (1 << 30) + 12345
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=total))
    fraction = {"value": 0.375}
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device: fraction["value"],
                        raising=False)
    device = torch.device("cuda", 0)
    assert _placement.usable_device_bytes(device) == pytest.approx(_placement.GPU_USABLE * total * 0.375)
    fraction["value"] = 1.0
    assert _placement.usable_device_bytes(device) == pytest.approx(_placement.GPU_USABLE * total)
    monkeypatch.delattr(torch.cuda, "get_per_process_memory_fraction")  # an older torch: the whole device
    assert _placement.usable_device_bytes(device) == pytest.approx(_placement.GPU_USABLE * total)
    # keep_params_gib=None's room is the same cap less what the allocator reserved
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device: 0.5, raising=False)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device: 1 << 30)
    assert _host_keep.keep_room(device, None) == pytest.approx(_placement.GPU_USABLE * total * 0.5 - (1 << 30))
    assert PLANNER_USABLE == _placement.GPU_USABLE  # the planner predicts the budget the optimizer takes


def test_step_worker_runs_the_smallest_key_first_and_rekeys():
    import threading

    from shardfuse.sharding.host._host_step import StepWorker

    worker = StepWorker(threads=None)
    gate, order = threading.Event(), []
    worker.submit(gate.wait, key=-1)  # holds the worker while the others queue
    for name, key in [("c", 3), ("a", 1), ("b", 2), ("a2", 1)]:
        worker.submit(lambda n=name: order.append(n), key=key, tag=name)
    worker.rekey(lambda tag: {"c": 0}.get(tag))  # c first now; the others keep their keys
    gate.set()
    worker.close()
    assert order == ["c", "a", "a2", "b"]
    assert worker.busy_s > 0


def check_clip_in_update_differs_from_multiplying() -> bool:
    """``clip_in_update`` changes the values (by a rounding) against the default multiply, so the bit-exact cases
    above can tell the two apart; where the kernel's ``grad_scale`` probe fails, the separate division pass gives
    the kernel's values bit for bit."""
    cfg = dict(fused=True, clip=0.05, clip_in_update=True)
    model, opt, _ = _train(cfg, overlapped=True)
    multiplied, _, _ = _train({**cfg, "clip_in_update": False}, overlapped=True)
    sd, multiplied_sd = model.state_dict(), multiplied.state_dict()
    assert any(not torch.equal(sd[k], multiplied_sd[k]) for k in sd), "clip_in_update gave the multiply's values"
    real = _host_fused.kernel_divides_by_grad_scale
    _host_fused.kernel_divides_by_grad_scale = lambda: False  # type: ignore[assignment]  # the fallback pass
    try:
        fallback, _, _ = _train(cfg, overlapped=True)
    finally:
        _host_fused.kernel_divides_by_grad_scale = real  # type: ignore[assignment]
    for k, v in fallback.state_dict().items():
        assert torch.equal(v, sd[k]), f"{k}: the separate division differs from the kernel's grad_scale"
    opt.close()
    return True


def test_clip_in_update_differs_from_multiplying(pool):
    assert pool.run(check_clip_in_update_differs_from_multiplying) == [True] * WORLD


def test_clip_in_update_refusals():
    with pytest.raises(ValueError, match="step_in_backward=True cannot clip"):
        _settings(clip_in_update=True, step_in_backward=True)
    with pytest.raises(TypeError, match="clip_in_update must be True or False, got 'yes'"):
        _settings(clip_in_update="yes")


def _settings(**kw: Any) -> None:
    from shardfuse.sharding.host._offload_settings import check_settings

    base = dict(step_in_backward=False, speculative_clip=False, speculative_clip_gib=None, speculative_backoff=3,
                keep_params_gib=0.0, host_threads=None, clip_in_update=False)
    check_settings(**{**base, **kw})


def check_unfired_clip_skips_the_scale() -> bool:
    """Where the clip does not fire, each host update gets no coefficient (no scaling pass); where it fires, it
    gets one (so the first half can fail)."""
    real = _host_step.step_in_chunks
    for max_norm, fires in ((1e6, False), (0.05, True)):
        for divide in (False, True):
            coefs: list[torch.Tensor | None] = []

            def spy(groups: Any, coef: torch.Tensor | None, *args: Any, seen: list = coefs, **kwargs: Any) -> bool:
                seen.append(coef)
                return real(groups, coef, *args, **kwargs)

            _host_step.step_in_chunks = spy  # type: ignore[assignment]
            try:
                _, opt, _ = _train_loop(dict(fused=True, clip=max_norm, clip_in_update=divide), overlapped=True)
                opt.synchronize()
            finally:
                _host_step.step_in_chunks = real  # type: ignore[assignment]
            assert coefs, "no host update ran"
            scaled = [c is not None for c in coefs]
            assert all(scaled) if fires else not any(scaled), (max_norm, divide, coefs)
            opt.close()
    return True


def test_unfired_clip_skips_the_scale(pool):
    assert pool.run(check_unfired_clip_skips_the_scale) == [True] * WORLD


def test_budget_applies_before_the_first_forward():
    """The compute device is settled at the first forward: before it, ``placements_left`` (what benchmarks warm up
    through) must count the placements the budget will make on the GPU the model will compute on, not read the
    not-yet-settled device (the GPU test of 68076f8 found 0 there)."""
    from types import SimpleNamespace

    from shardfuse.sharding.host._placement import budget_applies

    config = SimpleNamespace(offload=SimpleNamespace(move_params_to_cpu=True), compute_device=torch.device("cuda", 0))
    unsettled = SimpleNamespace(root_state=None, config=config, compute_device=torch.device("cpu"))
    assert budget_applies(unsettled, 40.0) and budget_applies(unsettled, None)
    assert not budget_applies(unsettled, 0)
    settled_on_cpu = SimpleNamespace(root_state=object(), config=config, compute_device=torch.device("cpu"))
    assert not budget_applies(settled_on_cpu, 40.0)
