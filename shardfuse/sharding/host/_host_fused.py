"""The host optimizer step of one offloaded shard as one cache-sized pass per chunk: clipping's scale, torch's fused
CPU Adam/AdamW kernel and the compute-dtype copy run chunk by chunk, so the gradient the scale just wrote and the
parameters the update just wrote are still in the CPU's cache when the next operation reads them.

Run separately over a whole shard, each of the three passes streams the shard through host memory (the scale reads
and writes the gradient, 8 B/param; the copy re-reads the parameters, 4 B/param) on top of the update's 28 B/param,
and the host optimizer of an offloaded step is bound by host memory bandwidth. The kernel is the one
``torch.optim.Adam(fused=True)`` calls (per element), so each chunk gets exactly the values a whole-shard step
gives: chunk boundaries fall on multiples of ``ALIGN`` elements, where the kernel's vector loops split work anyway.

With neither a scale nor a copy there is nothing to keep in cache between passes, and each parameter takes one
kernel call: chunking then only adds a parallel region per chunk (on a 16-core H200 host, fused AdamW over 1B pinned
parameters took 275 ms in 2M-element chunks against 245 ms whole, 382 against 340 beside the copies of training;
``bench.offload.host_step``, ``plain`` rows, 2026-11-28).

Where a scale or a copy shares the pass, ``OffloadOptimizer`` runs the chunks as tiles on its worker's
:class:`~shardfuse.sharding.host._host_tiles.TilePool` (each tile's operations on one core, no barrier per chunk):
the clipped update of the 2.9B decoder, the clip firing, took 1326 and 1413 ms a step against 1642 and 1711 in
chunks over torch's threads (16-core H200 host, a40ff1b, two interleaved rounds); ``SHARDFUSE_HOST_TILES=0`` turns
the pool off.

Only torch's own ``Adam``/``AdamW`` with ``fused=True`` and state already made take this path; anything else (the
first step, which makes the state; SGD; other settings) returns ``False`` and the caller steps the optimizer. So does
a torch whose private kernel is gone or moved (``shardfuse._torch_private.fused_adam_kernels``, checked once
against the public ``fused=True`` step).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from shardfuse._torch_private import (
    FusedKernel,
    call_fused_adam,
    foreach_add_,
    foreach_div_,
    fused_adam_kernels,
    kernel_divides_by_grad_scale,
)
from shardfuse._versions import mark_updated
from shardfuse.sharding.host._host_tiles import TilePool

# Elements per chunk: ~2M fp32 elements keep a chunk's parameters, gradient, both moments and the compute copy
# (18 B/element, ~36 MiB) within a server CPU's last-level cache while amortising each operation's dispatch and
# parallel-region start over enough work.
CHUNK_ELEMENTS = 1 << 21
# Elements per tile where a TilePool runs the update. On a 16-core H200 host the update alone was fastest in 2M
# tiles of 512K-2M (bench.offload.host_step --tiles, 68076f8: clipped, beside copies, 386 ms per billion against
# 444 in 2M chunks); in training 8M tiles did better (fewer GIL takes beside the thread launching GPU work: the
# 2.9B decoder's clipped step 1165 against 1212 ms in 2M tiles and 1304 without tiles, a40ff1b).
TILE_ELEMENTS = 1 << 23
ALIGN = 4096  # chunk boundaries: a multiple of every CPU vector width, so results match the unchunked kernel


@dataclass
class _Group:
    """One optimizer group's tensors for the fused kernel, and its settings."""

    params: list[torch.Tensor]
    grads: list[torch.Tensor]
    exp_avgs: list[torch.Tensor]
    exp_avg_sqs: list[torch.Tensor]
    max_exp_avg_sqs: list[torch.Tensor]
    steps: list[torch.Tensor]
    kwargs: dict[str, Any]
    decoupled: bool


def _scalar(value: Any) -> Any:
    """A setting as the fused kernel takes it (torch's own step turns tensor betas into numbers too)."""
    return value.item() if isinstance(value, torch.Tensor) else value


def _group_of(sub: torch.optim.Optimizer, params: list[torch.Tensor], settings: dict[str, Any]) -> _Group | None:
    """The fused kernel's inputs for one (shard, group), or None when this path does not apply."""
    if type(sub) not in (torch.optim.Adam, torch.optim.AdamW):
        return None
    if not settings.get("fused") or settings.get("differentiable") or settings.get("capturable"):
        return None
    if getattr(sub, "grad_scale", None) is not None or getattr(sub, "found_inf", None) is not None:
        return None
    amsgrad = bool(settings.get("amsgrad"))
    names = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if amsgrad else ("exp_avg", "exp_avg_sq")
    group = _Group([], [], [], [], [], [], {}, bool(settings.get("decoupled_weight_decay",
                                                                 isinstance(sub, torch.optim.AdamW))))
    for p in params:
        if p.grad is None:
            continue
        state = sub.state.get(p)
        if not state or "step" not in state or any(n not in state for n in names):
            return None  # the first step makes the state: the optimizer's own step does that
        tensors = [p, p.grad] + [state[n] for n in names]
        if any(t.device.type != "cpu" or not t.is_contiguous() or t.shape != p.shape or t.dtype != p.dtype
               or t.is_complex() for t in tensors):
            return None
        group.params.append(p)
        group.grads.append(p.grad)
        group.exp_avgs.append(state["exp_avg"])
        group.exp_avg_sqs.append(state["exp_avg_sq"])
        if amsgrad:
            group.max_exp_avg_sqs.append(state["max_exp_avg_sq"])
        group.steps.append(state["step"])
    beta1, beta2 = settings["betas"]
    group.kwargs = {"amsgrad": amsgrad, "lr": _lr(settings["lr"]), "beta1": _scalar(beta1),
                    "beta2": _scalar(beta2), "weight_decay": settings["weight_decay"], "eps": settings["eps"],
                    "maximize": bool(settings.get("maximize")), "grad_scale": None, "found_inf": None}
    return group


def _lr(value: Any) -> Any:
    """A CPU tensor learning rate goes to the kernel as a tensor, as in torch's own step; others as a number."""
    return value if isinstance(value, torch.Tensor) and value.device.type == "cpu" else _scalar(value)


def _offset_in(flat: torch.Tensor, t: torch.Tensor) -> int | None:
    """Where the contiguous view ``t`` starts in ``flat`` (elements), or None when it is not a view of it."""
    if t.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr() or t.dtype != flat.dtype:
        return None
    start = int(t.storage_offset()) - int(flat.storage_offset())
    return start if start >= 0 and start + t.numel() <= flat.numel() else None


def _pieces(numel: int, chunk: int) -> list[tuple[int, int]]:
    if numel <= chunk:
        return [(0, numel)]
    return [(a, min(a + chunk, numel)) for a in range(0, numel, chunk)]


def clip_inverse(coef: torch.Tensor) -> torch.Tensor:
    """What ``clip_in_update`` divides the gradients by: ``1 / coef`` in fp32, taken on the CPU (one rounding,
    the same wherever the coefficient was computed)."""
    return torch.reciprocal(coef.detach().to("cpu", torch.float32))


def step_in_chunks(sub_groups: list[tuple[torch.optim.Optimizer, list[torch.Tensor], dict[str, Any]]],
                   coef: torch.Tensor | None, flat: torch.Tensor, compute_buf: torch.Tensor | None,
                   chunk: int | None = None, divide: bool = False, pool: TilePool | None = None) -> bool:
    """Step every (optimizer, parameters, settings) of one shard chunk by chunk: scale the gradients by ``coef``
    (clipping; None: no scaling), update with the fused kernel, and copy the updated parameters into
    ``compute_buf`` (the shard's compute-dtype copy, in step with ``flat`` before the call; None: no copy).
    Returns False, having changed nothing, when the path does not apply. ``chunk``: elements per chunk (None:
    ``CHUNK_ELEMENTS``). ``divide`` (``OffloadOptimizer(clip_in_update=True)``): scale as ``g / clip_inverse(coef)``,
    inside the kernel (its ``grad_scale``: no pass of its own) where :func:`kernel_divides_by_grad_scale` holds.
    ``pool``: where a scale or a copy shares the pass, run the chunks as tiles on a :class:`TilePool` (each tile's
    operations on one core; ``chunk`` None: ``TILE_ELEMENTS``) instead of one chunk at a time over every intra-op
    thread."""
    chunk = (TILE_ELEMENTS if pool is not None else CHUNK_ELEMENTS) if chunk is None else chunk
    if chunk <= 0 or chunk % ALIGN:
        raise ValueError(f"chunk must be a positive multiple of {ALIGN} elements, got {chunk}")
    kernels = fused_adam_kernels()  # torch's private kernel, checked once against the public step (_torch_private)
    if kernels is None:
        return False
    groups = []
    for sub, params, settings in sub_groups:
        group = _group_of(sub, params, settings)
        if group is None:
            return False
        groups.append(group)
    offsets = [[_offset_in(flat, p) for p in g.params] for g in groups]
    if compute_buf is not None and any(o is None for offs in offsets for o in offs):
        return False  # parameters that are no view of the shard: the caller copies the whole shard
    scale = coef.to("cpu") if coef is not None else None
    in_kernel: dict[str, Any] | None = None
    if divide and scale is not None:
        inverse, scale = clip_inverse(scale), None
        if kernel_divides_by_grad_scale():
            in_kernel = {"grad_scale": inverse}
        else:
            with torch.no_grad():
                for group in groups:
                    if group.grads:
                        foreach_div_(group.grads, inverse)
    if scale is None and compute_buf is None:
        # one kernel call per parameter: no pass to share the cache with (module docstring); tiles measured no
        # faster there (2.9B decoder, 16-core H200, a40ff1b: clip not firing 1116/1174 against 1128/1169 ms)
        chunk, pool = sys.maxsize, None
    tiles: list[Callable[[], None]] = []
    written: list[torch.Tensor] = []
    with torch.no_grad():
        for group, offs in zip(groups, offsets):
            if not group.params:
                continue
            foreach_add_(group.steps, 1)
            kernel = kernels[1] if group.decoupled else kernels[0]
            for i, offset in enumerate(offs):
                if pool is None:
                    _step_one(group, i, kernel, scale, compute_buf, offset, chunk, kwargs=in_kernel)
                else:
                    tiles += _chunk_work(group, i, kernel, scale, compute_buf, offset, chunk, kwargs=in_kernel)
                    written += _views(group, i)
    if pool is not None:
        pool.run(tiles)  # the pool's threads run with grad mode off (grad mode is per thread)
        mark_updated(written)
    return True


def _views(group: _Group, i: int) -> list[torch.Tensor]:
    """What the kernel reads and writes for parameter ``i`` of ``group``: parameter, gradient, moments."""
    views = [group.params[i], group.grads[i], group.exp_avgs[i], group.exp_avg_sqs[i]]
    return views + [group.max_exp_avg_sqs[i]] if group.max_exp_avg_sqs else views


def _chunk_work(group: _Group, i: int, kernel: FusedKernel, scale: torch.Tensor | None,
                compute_buf: torch.Tensor | None, offset: int | None, chunk: int,
                before_chunk: Callable[[int, int], None] | None = None,
                kwargs: dict[str, Any] | None = None) -> list[Callable[[], None]]:
    """Parameter ``i`` of ``group`` as one callable per chunk (see :func:`_step_one`); each runs its chunk's
    operations back to back and leaves the version counters to the caller. The chunks' views are cut here, so a
    callable makes as few Python-level torch calls as it can (on a TilePool each takes the GIL)."""
    settings = group.kwargs if kwargs is None else {**group.kwargs, **kwargs}
    flat_views = [t.view(-1) for t in _views(group, i)]
    steps = [group.steps[i]]
    copy = compute_buf is not None and offset is not None
    out: list[Callable[[], None]] = []
    for a, b in _pieces(flat_views[0].numel(), chunk):
        p, g, m, v = ([t[a:b]] for t in flat_views[:4])
        max_v = [flat_views[4][a:b]] if len(flat_views) > 4 else []
        target = compute_buf[offset + a:offset + b] if copy else None  # type: ignore[index,operator]
        out.append(functools.partial(_one_chunk, kernel, p, g, m, v, max_v, steps, settings, scale, target,
                                     None if before_chunk is None else functools.partial(before_chunk, a, b)))
    return out


def _one_chunk(kernel: FusedKernel, p: list[torch.Tensor], g: list[torch.Tensor], m: list[torch.Tensor],
               v: list[torch.Tensor], max_v: list[torch.Tensor], steps: list[torch.Tensor], settings: dict[str, Any],
               scale: torch.Tensor | None, target: torch.Tensor | None, before: Callable[[], None] | None) -> None:
    """One chunk's operations (callers run it with grad mode off: step_in_chunks, the speculation, a TilePool)."""
    if before is not None:
        before()
    if scale is not None:
        g[0].mul_(scale)
    call_fused_adam(kernel, p, g, m, v, max_v, steps, settings)
    if target is not None:
        target.copy_(p[0])


def _step_one(group: _Group, i: int, kernel: FusedKernel, scale: torch.Tensor | None, compute_buf: torch.Tensor | None,
              offset: int | None, chunk: int, before_chunk: Callable[[int, int], None] | None = None,
              kwargs: dict[str, Any] | None = None) -> None:
    """Parameter ``i`` of ``group``, chunk by chunk; ``before_chunk(a, b)`` runs first in each chunk (elements
    ``a:b`` of the parameter; the speculative update copies the originals' chunk into the spare buffers there);
    ``kwargs``: settings over the group's for the kernel (``grad_scale``)."""
    for work in _chunk_work(group, i, kernel, scale, compute_buf, offset, chunk, before_chunk, kwargs):
        work()
    mark_updated(_views(group, i))  # the kernel writes in place without counting it (see shardfuse._versions)
