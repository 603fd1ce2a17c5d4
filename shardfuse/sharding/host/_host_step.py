"""The overlapped host optimizer step: one worker thread steps offloaded shards one unit at a time.

``OffloadOptimizer.step()`` returns at once. Each offloaded flat parameter is stepped on the worker thread in
the recorded forward order (its gradient scaled by the clipping coefficient first, then the user's optimizer
class over that shard alone, sharing the user's optimizer state, then the compute-dtype copy written), and its
:class:`HostShard`'s update moves to ``DONE`` (``_host_shard.UpdateState``): the next forward of that unit waits
for it and nothing else, so the CPU update of later units runs while the GPU computes earlier ones. torch's CPU
kernels release the GIL, so the main thread keeps launching GPU work while the worker steps.

Per-element optimizers (Adam, AdamW, SGD) give the same values stepped per shard as stepped all at once, so the
parameters equal the non-overlapped path's bit for bit.
"""

from __future__ import annotations

import heapq
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from shardfuse._torch_private import foreach_div_, foreach_mul_
from shardfuse._versions import hook_optimizer
from shardfuse.sharding.core._flat_param import FlatParamHandle
from shardfuse.sharding.host._host_fused import clip_inverse, step_in_chunks
from shardfuse.sharding.host._host_shard import HostShard, UpdateState
from shardfuse.sharding.host._host_tiles import TilePool

logger = logging.getLogger(__name__)

# Optimizers whose update of one parameter reads only that parameter's gradient and state: stepping each shard on
# its own equals one step over all of them.
PER_ELEMENT_OPTIMIZERS = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


class StepWorker:
    """One daemon thread that runs queued callables, the one with the smallest key first.

    Keys order the host's work: with ``step_in_backward`` updates are queued as gradients land (the last units of
    the forward order first) and re-keyed by forward position once backward has ended (:meth:`rekey`), so the
    next forward, which needs the first units first, waits for as few updates as possible.

    ``threads``: the intra-op threads the worker's optimizer kernels use (``torch.set_num_threads`` from the worker
    thread; torch's count is process-wide, so the main thread gets it too). One
    core is left to the main thread by default, which launches GPU work meanwhile: with every core in the
    optimizer's parallel regions, the thread that shares a core with the launching thread holds up each region.
    """

    def __init__(self, threads: int | None = None, tiles: bool = False, name: str = "shardfuse-host-step") -> None:
        # tiles: the updates' chunks run on a TilePool of ``threads`` single-threaded workers (``_host_tiles``)
        self.pool = TilePool(threads or default_host_threads()) if tiles else None
        self._heap: list[tuple[float, int, Any, Callable[[], None] | None]] = []
        self._cond = threading.Condition()
        self._seq = 0  # ties keep submission order
        self.threads = threads
        self.busy_s = 0.0  # seconds spent running tasks (read by OffloadOptimizer.host_stats)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        while True:
            with self._cond:
                while not self._heap:
                    self._cond.wait()
                _, _, _, task = heapq.heappop(self._heap)
            if task is None:
                return
            start = time.perf_counter()
            task()  # tasks catch their own errors (HostShard.life: FAILED) and always leave the in-flight states
            self.busy_s += time.perf_counter() - start

    def submit(self, task: Callable[[], None], key: float = 0.0, tag: Any = None) -> None:
        """Queue ``task``; among queued tasks the smallest ``key`` runs first, equal keys in submission order;
        ``tag`` is what :meth:`rekey` is given to find the task's new key."""
        with self._cond:
            self._seq += 1
            heapq.heappush(self._heap, (key, self._seq, tag, task))
            self._cond.notify()

    def rekey(self, key_of: Callable[[Any], float | None]) -> None:
        """New keys for the queued tasks from their tags (``key_of`` returns None to keep a key); a running task is
        unaffected."""
        with self._cond:
            entries = []
            for key, seq, tag, task in self._heap:
                new = key_of(tag) if task is not None else None
                entries.append((key if new is None else new, seq, tag, task))
            heapq.heapify(entries)
            self._heap = entries

    def close(self) -> None:
        """Finish the queued tasks and end the thread (idempotent)."""
        if self._thread.is_alive():
            self.submit(None, key=float("inf"))  # type: ignore[arg-type]  # the stop mark, after every task
            self._thread.join()
        if self.pool is not None:
            self.pool.close()


def default_host_threads() -> int:
    """Intra-op threads for the host optimizer: the cores this process may use, less one for the main thread."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores - 1, torch.get_num_threads()))


@dataclass
class ShardPlan:
    """What one optimizer step does for one flat parameter: the user's parameters that are views of it (the flat
    parameter itself, or the original parameters with ``use_orig_params``), per user param group, and the
    single-shard optimizers that step them (sharing the user's optimizer state)."""

    handle: FlatParamHandle | None  # None: parameters that are no shard (stepped on the caller's thread)
    groups: list[tuple[int, list[torch.Tensor]]]  # (user group index, parameters)
    subs: list[torch.optim.Optimizer] = field(default_factory=list)
    deferred_zero: bool | None = None  # zero_grad(set_to_none=...) came while the step was queued
    clip_in_update: bool = False  # OffloadOptimizer(clip_in_update=True): clipping divides by 1 / coef
    pool: TilePool | None = None  # the worker's tile pool (StepWorker.pool): the chunked update runs there

    @property
    def host(self) -> HostShard | None:
        host = self.handle.host if self.handle is not None else None
        return host if isinstance(host, HostShard) else None


def make_sub_optimizers(optimizer: torch.optim.Optimizer, plan: ShardPlan) -> None:
    """One optimizer of the user's class per (shard, user group), with the group's settings and the user's
    ``state`` dict itself, so its step updates the user's optimizer state."""
    plan.subs = []
    for gi, params in plan.groups:
        settings = {k: v for k, v in optimizer.param_groups[gi].items() if k != "params"}
        sub = type(optimizer)([{"params": params, **settings}])  # type: ignore[call-arg]  # defaults in the group
        sub.state = optimizer.state
        # Counts its fused writes itself (the compute copy and the SSD write-behind read the version counters), so
        # the host tier needs no process-wide hook for the optimizers it builds.
        hook_optimizer(sub)
        plan.subs.append(sub)


def settings_of(optimizer: torch.optim.Optimizer, plan: ShardPlan) -> list[dict[str, Any]]:
    """The user's settings (lr, betas, ...) of the plan's groups now: a step queued now uses these even if an LR
    scheduler changes them before the worker gets to it."""
    return [{k: v for k, v in optimizer.param_groups[gi].items() if k != "params"} for gi, _ in plan.groups]


def scale_grads(grads: list[torch.Tensor], coef: torch.Tensor, divide: bool) -> None:
    """Clipping's scale in place: ``g * coef`` (torch's), or ``g / clip_inverse(coef)`` with ``divide``
    (``clip_in_update``: the values the fused kernel's ``grad_scale`` gives)."""
    if not grads:
        return
    if divide:
        foreach_div_(grads, clip_inverse(coef).to(grads[0].device))
    else:
        foreach_mul_(grads, coef.to(grads[0].device))


def step_plan(plan: ShardPlan, settings: list[dict[str, Any]], coef: torch.Tensor | None) -> None:
    """Scale the plan's gradients by ``coef`` (clipping) and step them with ``settings`` (see settings_of)."""
    with torch.no_grad():
        for (_, params), sub, group_settings in zip(plan.groups, plan.subs, settings):
            if coef is not None:
                scale_grads([p.grad for p in params if p.grad is not None], coef, plan.clip_in_update)
            sub.param_groups[0].update(group_settings)
            sub.step()


def host_task(plan: ShardPlan, settings: list[dict[str, Any]], coef: torch.Tensor | None,
              lock: threading.Lock, copy_event: torch.cuda.Event | None = None,
              in_backward: bool = False,
              update: Callable[[], Callable[[], None] | None] | None = None) -> Callable[[], None]:
    """The worker's job for one offloaded shard: wait for the last copy that read its host buffers, step it,
    refresh the compute-dtype copy, apply a ``zero_grad`` that came meanwhile, then release the unit's next
    gather. Runs under ``lock`` so ``zero_grad`` sees each shard either queued (and defers) or done.

    ``in_backward``: started by the gradient copy itself (``step_in_backward=True``): wait for ``copy_event``
    and land the gradient (the end of backward lands the same buffer again on the main thread).

    ``update``: what runs instead of the shard's step (``_speculative``: the out-of-place update of
    ``speculative_clip``; ``_gpu_assist``: the GPU's share), in the same place: under ``lock``, in ``UPDATING``,
    before a deferred ``zero_grad``. It may return a callable that waits for work it queued elsewhere (the GPU's
    copies): that runs outside ``lock`` (the host worker's updates go on meanwhile), still in ``UPDATING``, and the
    task takes ``lock`` again to finish.
    """
    host, handle = plan.host, plan.handle
    if host is None or handle is None:
        raise RuntimeError("host_task() needs the plan of a host shard (one whose handle has a HostShard)")
    # Queued by step() (not in backward): the gradients it is for, as they are now (see _reclaim_grads).
    queued_with = [] if in_backward else [(p, p.grad, p.grad._version) for _, ps in plan.groups for p in ps
                                          if p.grad is not None]

    def run() -> None:
        host.note("task")
        try:
            host.life.move(UpdateState.GRAD_COPYING)
            if copy_event is not None:
                copy_event.synchronize()  # outside the lock: zero_grad must not wait for a copy
            if in_backward:
                host.widen_grad()  # a compute-dtype gradient: widened already by the task queued before this one
                host.note("grad_ready")
            host.before_step(in_backward)  # ssd: at most read_ahead updated shards wait for their gathers
        except BaseException as err:  # noqa: BLE001 - handed to the caller side, raised at the next wait
            _failed(host, err)
            return
        with lock:
            try:
                host.life.move(UpdateState.UPDATING)
                if in_backward:
                    handle.flat.grad = host.grad_buf
                    handle.grads_to_views()  # use_orig_params: the optimizer steps the views
                host.sync_h2d()
                host.note("update")
                start = time.perf_counter()
                dropped = _reclaim_grads(queued_with, host.life.name)
                wait = None
                if update is None:
                    step_host_shard(plan, host, handle, settings, coef, plan.pool)
                else:
                    wait = update()
            except BaseException as err:  # noqa: BLE001 - handed to the caller side, raised at the next wait
                plan.deferred_zero = None
                _failed(host, err)
                return
            if wait is None:  # done in this hold of the lock: a lock holder never sees this shard UPDATING
                _complete(plan, host, dropped, start)
                return
        _finish_after(wait, plan, host, lock, dropped, start)

    return run


def _finish_after(wait: Callable[[], None], plan: ShardPlan, host: HostShard, lock: threading.Lock,
                  dropped: list[torch.Tensor], start: float) -> None:
    """The end of a host task whose update queued work elsewhere: wait for it outside ``lock`` (still
    ``UPDATING``: ``zero_grad`` defers), then complete under ``lock``."""
    try:
        wait()
    except BaseException as err:  # noqa: BLE001 - handed to the caller side, raised at the next wait
        with lock:
            plan.deferred_zero = None
            _failed(host, err)
        return
    with lock:
        _complete(plan, host, dropped, start)


def _complete(plan: ShardPlan, host: HostShard, dropped: list[torch.Tensor], start: float) -> None:
    """(Under the task's lock) drop the gradients the update put back, apply a ``zero_grad`` that came meanwhile
    and release the unit's gather."""
    try:
        for p in dropped:
            p.grad = None
        apply_zero_grad(plan, plan.deferred_zero)
        host.stats.update_s += time.perf_counter() - start
        host.note("done")
        plan.deferred_zero = None
        host.life.move(UpdateState.DONE)  # under the lock: zero_grad sees it queued (defers) or done
    except BaseException as err:  # noqa: BLE001 - handed to the caller side, raised at the next wait
        plan.deferred_zero = None
        _failed(host, err)


def _reclaim_grads(queued_with: list[tuple[torch.Tensor, torch.Tensor, int]], name: str) -> list[torch.Tensor]:
    """(Worker, under the step lock) The gradients an update was queued with, back where a caller dropped them
    since (``model.zero_grad()`` right after ``step()`` sets ``.grad`` to None while the update waits: the update
    still steps them, and the parameters it put them back on are returned, to drop again after it). A gradient
    changed in place since (zeroed, scaled) is refused: the update would step what the caller made of it."""
    dropped = []
    for p, grad, version in queued_with:
        now = p.grad
        if now is grad and grad._version == version:
            continue
        if now is None and grad._version == version:
            p.grad = grad
            dropped.append(p)
            continue
        raise RuntimeError(
            f"the gradient of a parameter of {name} changed after OffloadOptimizer.step() queued its update "
            f"({'replaced' if now is not None and now is not grad else 'written in place'}, e.g. by "
            f"model.zero_grad(set_to_none=False) or a clip after step()): zero the gradients with the "
            f"OffloadOptimizer's zero_grad(), which waits for the update, or call its synchronize() before "
            f"changing them"
        )
    return dropped


def _failed(host: HostShard, err: BaseException) -> None:
    logger.error("overlapped optimizer step of %s failed: %s", host.life.name, err)
    host.life.move(UpdateState.FAILED, err)


def step_host_shard(plan: ShardPlan, host: HostShard, handle: FlatParamHandle, settings: list[dict[str, Any]],
                    coef: torch.Tensor | None, pool: TilePool | None) -> None:
    """Step one host shard and refresh its compute-dtype copy: chunk by chunk in one cache-sized pass where
    ``_host_fused`` applies (torch's fused Adam/AdamW, state made), else the optimizer's own step, then the copy.
    The SSD tier's shards take the optimizer's own step: its step hooks page them in and write them behind.
    ``pool``: the tile pool of the calling worker (``ShardPlan.pool``; None: the chunks over torch's threads)."""
    in_sync = host.compute_buf is not None and host.copy_version == handle.flat._version
    chunked = type(host) is HostShard and step_in_chunks(
        [(sub, params, s) for sub, (_, params), s in zip(plan.subs, plan.groups, settings)], coef, handle.flat,
        host.compute_buf if in_sync else None, divide=plan.clip_in_update,
        pool=pool)
    if not chunked:
        step_plan(plan, settings, coef)
    else:
        for sub, group_settings in zip(plan.subs, settings):
            sub.param_groups[0].update(group_settings)
    if chunked and (in_sync or host.compute_buf is None):
        host.copy_version = handle.flat._version  # the copy followed each chunk
    else:
        host.write_compute_copy(handle.flat)


def apply_zero_grad(plan: ShardPlan, set_to_none: bool | None) -> None:
    """``zero_grad`` for the plan's parameters (``None``: nothing to do)."""
    if set_to_none is None:
        return
    for _, params in plan.groups:
        for p in params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.zero_()
