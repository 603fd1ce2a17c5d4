"""``OffloadOptimizer``: the user's optimizer over a model wrapped with ``move_params_to_cpu=True``, stepped
per unit on a host thread and overlapped with the next forward (see ``_host_step.py``), with partial offload
under a GPU memory budget and host round trips amortised over ``no_sync`` accumulation."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import weakref
from typing import Any

import torch
from torch import nn

from shardfuse._torch_private import foreach_mul_, foreach_norm
from shardfuse.sharding.core import _collectives as coll
from shardfuse.sharding.core._flat_param import FlatParamHandle
from shardfuse.sharding.core._grad_reduce import clip_grad_norm
from shardfuse.sharding.core._registry import handle_of
from shardfuse.sharding.core._runtime import Unit
from shardfuse.sharding.core._tree import units_below
from shardfuse.sharding.host import _backing, _wrapped_hooks
from shardfuse.sharding.host._engine import engine_of, unit_of_root
from shardfuse.sharding.host._gpu_assist import GpuAssist
from shardfuse.sharding.host._host_keep import choose_kept, keep_room
from shardfuse.sharding.host._host_shard import HostShard
from shardfuse.sharding.host._host_step import (
    PER_ELEMENT_OPTIMIZERS,
    ShardPlan,
    StepWorker,
    apply_zero_grad,
    default_host_threads,
    host_task,
    make_sub_optimizers,
    scale_grads,
    settings_of,
    step_plan,
)
from shardfuse.sharding.host._host_trace import HostTrace
from shardfuse.sharding.host._offload_settings import check_arguments, check_settings
from shardfuse.sharding.host._placement import (
    budget_applies,
    choose_resident,
    make_resident,
    state_bytes_per_element,
    usable_device_bytes,
)
from shardfuse.sharding.host._speculative import Speculation

logger = logging.getLogger(__name__)

GIB = 1 << 30
# The first step() places units by the peak of a fully offloaded step; that peak holds the offloaded path's
# transient buffers, which the resident units do not add to, so the second step() places more units by the peak
# measured with the first placement (then the placement is fixed).
PLACEMENTS = 2
# Set to 1 to send offloaded gradients in the compute dtype where exact (opt-in: see OffloadOptimizer's docstring).
LOWP_GRADS_ENV = "SHARDFUSE_LOWP_GRADS"
HOST_TILES_ENV = "SHARDFUSE_HOST_TILES"  # "0": no tile pool (the scaled updates' chunks over torch's threads)
WIDEN_KEY = -1.0  # the worker's key of a gradient widening: ahead of every update (keys >= 0)


class OffloadOptimizer(_wrapped_hooks.WrapsOptimizer):
    """Step ``optimizer`` over a ``move_params_to_cpu=True`` model unit by unit on a host thread, overlapped with
    the GPU: gradients leave the GPU as each unit is reduced (into reused pinned buffers), the step returns at
    once, each unit's update runs on the host in forward order and writes a compute-dtype (bf16) copy, and the
    next forward of a unit waits only for that unit's update. Parameters after N steps equal those of stepping
    ``optimizer`` itself (Adam, AdamW, SGD are per-element; with ``clip_in_update`` up to clipping's rounding).

    Args:
        model: the root ``FullyShardedDataParallel`` (wrapped with ``move_params_to_cpu=True``).
        optimizer: a ``torch.optim.Adam``/``AdamW``/``SGD`` over ``model.parameters()`` (``fused=True`` is the
            fastest on the CPU).
        gpu_budget_gib: GPU memory (GiB) the run may use; the units that fit (counted from the start of the forward
            order) keep parameters, gradients and optimizer state on the GPU and are stepped there. ``None``: what
            the device had free at the peak of the first step; ``0``: offload everything.
        accumulate_on_gpu: under ``no_sync()`` keep the gathered compute-dtype parameters on the GPU between
            micro-steps, so parameters cross to the GPU once per optimizer step (costs the full compute-dtype
            parameters of every unit on the GPU while accumulating; gradients accumulate on the GPU either way).
        step_in_backward: start each unit's update as soon as its gradient reaches the host, while the rest of
            backward runs, instead of at ``step()``: the fastest schedule (the host optimizer overlaps backward
            too), for loops that call ``step()`` and ``zero_grad()`` after every synced backward and do not clip by
            the global norm (``clip_grad_norm_`` raises; it needs every gradient before any update). The values
            are the same as stepping after backward. Where a GPU budget may keep units resident, the first step
            updates after backward: the budget places units at that step(), and no unit's optimizer state is made
            on the host before.
        host_compute_copy: keep a compute-dtype (bf16) copy of each shard on the host, written after each update
            (with torch's fused Adam/AdamW in the update's own cache-sized pass), so half the bytes cross to the
            GPU; off by default: it costs host memory bandwidth, and the host optimizer is the bottleneck of an
            offloaded step (docs/api.md gives the measurements).
        host_threads: intra-op threads of the host optimizer step, set with ``torch.set_num_threads`` from the
            worker thread: torch's intra-op thread count is process-wide, so the main thread's CPU ops use it too.
            ``None``: the cores this process may use less one (at most torch's current count), left to the main
            thread that launches GPU work meanwhile (with every core in the optimizer's
            parallel regions, the one shared with the launching thread holds up each region).
        speculative_clip: exact clipping overlapped with backward: each unit's update runs as its gradient lands,
            out of place into spare host buffers; ``step()`` commits it (a pointer swap) where
            ``model.clip_grad_norm_``'s coefficient is exactly 1 (or there was no clip), else computes it again from
            the untouched originals with the coefficient: the values of ``speculative_clip=False``, bit for bit
            (``_speculative``). Loops as for ``step_in_backward`` (``step()`` and ``zero_grad()`` after each
            synced backward); not with ``step_in_backward``.
        speculative_clip_gib: host memory (GiB) for the spare buffers (shard, state, compute copy: 12 B/param with
            AdamW); the units that fit, in the order their gradients land, speculate, the others update after the
            norm. ``None``: every offloaded unit.
        speculative_backoff: after this many consecutive steps in which clipping fired (the speculations redone),
            stop speculating until a step's norm is under the clip again (same bits; ``None``: never stop).
        clip_in_update: scale the host shards' gradients for clipping inside the update: torch's fused Adam/AdamW
            kernel divides each by ``1 / coef`` (its ``grad_scale``) as it reads it, so clipping takes no pass over
            host memory of its own. The values are ``g / fp32(1 / coef)`` instead of ``clip_grad_norm_``'s
            ``g * coef``: within one rounding of it, not bit for bit (units on the GPU are scaled as torch does);
            every path of this optimizer (other optimizers, the first step, ``apply_pending_clip``, speculation's
            recompute) gives those same values. Off by default; not with ``step_in_backward`` (no clipping there).
        keep_params_gib: GPU memory (GiB) for keeping offloaded units' gathered compute-dtype parameters from
            their forward to their backward (with ``reshard_after_forward``), so backward gathers nothing: no second
            host->device copy of the shard (``_host_keep``). Units are picked from the end of the forward order
            (the first whose backward runs) while their full buffers fit, once the forward order is known (from
            the first ``step()``). ``0`` (default): keep none; ``None``: the room the device had at the peak of the
            steps so far, measured at the first ``step()`` after the budget placements (CUDA only).
        gpu_update_share: in steps where clipping scales the gradients (the host's slowest update), the fraction
            (0 to 1) of the offloaded parameters, the last units of the forward order, whose update the GPU runs
            beside the host's: each streams through reused device buffers and torch's fused CUDA kernel
            (``_gpu_assist``; values equal to the host's to fp32 rounding, as for resident units; their ``.grad``
            stays unclipped). ``0`` (default): every update on the host. Not with ``speculative_clip``.

    With ``SHARDFUSE_LOWP_GRADS=1`` in the environment (read here) gradients cross to the host in the compute dtype
    where that is exact (one rank, divide factors 1, no gradient held to accumulate into) and are widened to fp32 there
    (off by default: no faster on one H100, host RSS 12% higher; docs/api.md). With torch's fused ``Adam``/``AdamW``
    each shard's update runs clipping's scale, the kernel and the compute copy in one cache-sized pass per chunk
    (``_host_fused``; the optimizer's own values, bit for bit).

    ``clip_grad_norm_`` on the model takes the norm from per-unit norms computed on the GPU as gradients are
    reduced and scales each unit's gradient just before its update (not at all where the clip did not fire):
    reading ``.grad`` between the clip and the step shows unscaled values. ``state_dict()``,
    ``load_state_dict()`` and the model's state-dict and summon paths first finish a step in flight.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, gpu_budget_gib: float | None = None,
                 accumulate_on_gpu: bool = False, step_in_backward: bool = False,
                 host_compute_copy: bool = False, host_threads: int | None = None, speculative_clip: bool = False,
                 speculative_clip_gib: float | None = None, keep_params_gib: float | None = 0.0,
                 speculative_backoff: int | None = 3, clip_in_update: bool = False,
                 gpu_update_share: float = 0.0) -> None:
        check_arguments(unit_of_root(model), optimizer, gpu_budget_gib, PER_ELEMENT_OPTIMIZERS)
        check_settings(step_in_backward=step_in_backward, speculative_clip=speculative_clip,
                       speculative_clip_gib=speculative_clip_gib, speculative_backoff=speculative_backoff,
                       keep_params_gib=keep_params_gib, host_threads=host_threads, clip_in_update=clip_in_update,
                       gpu_update_share=gpu_update_share)
        old = engine_of(unit_of_root(model))
        if old is not None:  # a new optimizer for the same model (e.g. rebuilt to resume): the old one stops here
            old.close()
        self.step_in_backward = step_in_backward
        self.host_compute_copy = host_compute_copy
        self.clip_in_update = clip_in_update
        self._stepped_in_backward: set[int] = set()
        self.speculative_clip = speculative_clip
        self._spec = Speculation(speculative_clip_gib, speculative_backoff) if speculative_clip else None
        # Not Optimizer.__init__: param_groups, state and defaults are the user's optimizer's (properties below).
        self.optimizer = optimizer
        self.model = model
        self.root: Unit = unit_of_root(model)
        self.gpu_budget_gib = gpu_budget_gib
        self.accumulate_on_gpu = accumulate_on_gpu
        self.keep_params_gib = keep_params_gib
        self._keep_room: float | None = None if keep_params_gib is None else keep_params_gib * GIB  # bytes
        self._lowp_grads = os.environ.get(LOWP_GRADS_ENV, "0") == "1"
        self._lock = threading.Lock()
        self.host_threads = host_threads if host_threads is not None else default_host_threads()
        self._worker = StepWorker(self.host_threads, tiles=os.environ.get(HOST_TILES_ENV, "1") != "0")
        self.gpu_update_share = float(gpu_update_share)
        self._assist = GpuAssist(self.gpu_update_share) if gpu_update_share else None
        self._finalizer = weakref.finalize(self, _close_worker, self._worker, _backing.below(self.root), self._assist)
        self._plans: list[ShardPlan] = []
        self._plan_of_host: dict[int, ShardPlan] = {}
        self._signature: tuple = ()
        self._coef: torch.Tensor | None = None  # clipping's coefficient, for the host shards' next updates
        self._coef_deferred: set[int] = set()  # id(handle) of the shards whose scaling waits for their update
        self._placements = 0  # budget placements made (PLACEMENTS at most)
        self._moved_any = False
        self._trace: HostTrace | None = None  # trace_host()
        self._init_hook_dicts()
        self._attach()
        self.root.host_engine = weakref.ref(self)
        self._wrapped_hooks = _wrapped_hooks.attach(self, optimizer)

    # ----------------------------------------------------------------------------------------------
    # the user's optimizer, seen through this one
    # ----------------------------------------------------------------------------------------------

    def __repr__(self) -> str:
        return f"OffloadOptimizer({self.optimizer!r}, gpu_budget_gib={self.gpu_budget_gib})"

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()  # its pre-hook calls state_read()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)  # its hooks: synchronize() before, state_loaded() after

    def state_read(self) -> None:
        """Before the user's optimizer's ``state_dict()``: the updates in flight finished, its state on disk read in."""
        self.synchronize()
        _backing.page_in_optimizer_state(self.optimizer)  # ssd: optimizer state on disk is read in

    def state_loaded(self) -> None:
        """After the user's optimizer loaded a state dict: it has a new state dict, the per-shard optimizers share
        it from the next step on."""
        self._signature = ()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.synchronize()
        self.optimizer.add_param_group(param_group)
        self._signature = ()

    # ----------------------------------------------------------------------------------------------
    # the step
    # ----------------------------------------------------------------------------------------------

    def _attach(self) -> None:
        """A HostShard on every handle whose shard lives on the host (made once)."""
        for u in units_below(self.root):
            prec = u.config.precision
            compute = prec.compute_dtype if prec.mixed_precision and self.host_compute_copy else None
            for i, h in enumerate(u.handles):
                if (h.host is None or _backing.host_of(h)) and h.flat.device.type == "cpu":  # ssd: keep its host
                    host = _backing.host_of(h) or HostShard(h.flat, compute or h.dtype, pin=torch.cuda.is_available(),
                                                            name=f"{u.name}.flat_param_{i}")
                    host.keep_full_in_no_sync = self.accumulate_on_gpu
                    host.pending_scale = weakref.WeakMethod(self.apply_pending_clip)
                    if self.step_in_backward or self.speculative_clip:
                        host.on_grad_sent = self._on_grad_sent
                    if type(host) is HostShard:  # not the SSD tier's: its landing stays fp32
                        host.lowp_grads = self._lowp_grads
                        # The worker, not this object: a host shard must not keep its optimizer alive.
                        host.on_lowp_sent = functools.partial(_queue_widening, self._worker)
                    h.host = host

    def _handles_in_order(self) -> list[FlatParamHandle]:
        rs = self.root.root_state
        units = list(rs.fwd_order) if rs is not None and rs.order_recorded else []
        units += [u for u in units_below(self.root) if u not in units]
        seen: set[int] = set()
        out = []
        for u in units:
            for h in u.handles:
                if id(h) not in seen:
                    seen.add(id(h))
                    out.append(h)
        return out

    def _refresh_plans(self) -> None:
        signature = (id(self.optimizer.state), tuple(tuple(map(id, g["params"])) for g in self.param_groups),
                     bool(self.root.root_state and self.root.root_state.order_recorded))
        if signature == self._signature:
            return
        by_handle: dict[int, dict[int, list[torch.Tensor]]] = {}
        for gi, group in enumerate(self.param_groups):
            for p in group["params"]:
                h = handle_of(p)
                by_handle.setdefault(id(h) if h is not None else 0, {}).setdefault(gi, []).append(p)
        plans = [ShardPlan(h, sorted(by_handle[id(h)].items()), clip_in_update=self.clip_in_update,
                           pool=self._worker.pool)
                 for h in self._handles_in_order() if id(h) in by_handle]
        if 0 in by_handle:
            plans.append(ShardPlan(None, sorted(by_handle[0].items()), clip_in_update=self.clip_in_update))
        for plan in plans:
            make_sub_optimizers(self.optimizer, plan)
        self._plans = plans
        self._plan_of_host = {id(p.host): p for p in plans if p.host is not None}
        if self._assist is not None:
            self._assist.choose(plans, self.root.compute_device)
        self._signature = signature
        if self._spec is not None:
            self._spec.choose(plans, state_bytes_per_element(self.optimizer))
        self._attach_trace()
        if self._keep_room is not None:
            choose_kept(self.root.root_state, self._keep_room)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """Queue this step's updates (returns at once; the next forward of each unit waits for its own)."""
        if closure is not None:
            raise ValueError("OffloadOptimizer.step() takes no closure: compute the loss and backward before step()")
        if self._trace is not None:
            self._trace.mark("step")
        in_backward = self._stepped_in_backward or (self._spec is not None and self._spec.submitted())
        if not in_backward or self._placements < PLACEMENTS:
            # Updates still in flight from an earlier step must end before this one queues its own (and before a
            # budget placement moves shards). Under step_in_backward this step's updates are already queued and
            # running: they overlap the next forward, whose gathers wait for each unit's own update.
            self.synchronize()
        done_on_host: set[int] = set()
        if self._keep_room is None and self._placements >= PLACEMENTS:
            # keep_params_gib=None: the room once the placements are final (the plans stay: under step_in_backward
            # updates queued with them may still run)
            self._keep_room = keep_room(self.root.compute_device, self.gpu_budget_gib)
            choose_kept(self.root.root_state, self._keep_room)
        if self._placements < PLACEMENTS:
            done_on_host = self._place_by_budget()
        self._refresh_plans()
        coef, self._coef = self._coef, None
        deferred, self._coef_deferred = self._coef_deferred, set()
        for plan in self._plans:
            if plan.host is None and id(plan.handle) not in done_on_host:  # on the GPU: queued there, in order
                # Scaled at the clip already, unless it was a host shard then (made resident by the budget since).
                late = coef if id(plan.handle) in deferred else None
                step_plan(plan, settings_of(self.optimizer, plan), late)
        if self._spec is not None:  # commits or redoes the speculated updates, queues the others
            self._spec.step(self._plans, self.optimizer, coef.to("cpu") if coef is not None else None, self._lock,
                            self._worker)
        if (self.step_in_backward and self._stepped_in_backward) or self._spec is not None:
            # Updates were queued as gradients landed (the last units first); those not started yet go in forward
            # order now, so the next forward gets its first units first.
            self._stepped_in_backward.clear()
            position = {id(plan): i for i, plan in enumerate(self._plans)}
            for worker in [self._worker] + ([self._assist.worker] if self._assist is not None else []):
                worker.rekey(lambda tag: position.get(id(tag)))
            return
        self._stepped_in_backward.clear()
        host_coef = coef.to("cpu") if coef is not None else None
        if host_coef is not None and bool(host_coef == 1.0):
            # The clip did not fire (a finite norm under max_norm): g * 1 and g / 1 are g, bit for bit, so the
            # updates skip the scaling and its pass over host memory (the fine-tuning case: clipping rarely fires).
            host_coef = None
        for i, plan in enumerate(self._plans):  # forward order
            if plan.host is not None:
                plan.host.queue()
                self._submit(plan, settings_of(self.optimizer, plan), host_coef, key=i)

    def _on_grad_sent(self, host: HostShard, event: torch.cuda.Event | None) -> None:
        """``step_in_backward`` or ``speculative_clip``: a host shard's gradient copy is queued; start its update (or
        its speculative update) behind the copy."""
        if self._placements < (PLACEMENTS if self._spec is not None else 1) and self._budget_applies():
            # The first backward: the budget places units at the first step(), and an update now would make every
            # unit's optimizer state on the host first (the peak of full offload). This step updates after it.
            # (Speculation waits for both placements: a unit placed on the GPU must not hold a speculation.)
            return
        self._refresh_plans()
        plan = self._plan_of_host.get(id(host))
        if plan is None:  # a shard the optimizer does not hold
            return
        if self._spec is not None:
            settings = settings_of(self.optimizer, plan)
            update = self._spec.submit(plan, settings)
            if update is not None:  # else no spare room: it updates after the norm, at step()
                host.queue()
                self._worker.submit(host_task(plan, settings, None, self._lock, event, in_backward=True,
                                              update=update), key=len(self._plans), tag=plan)
            return
        if id(host) in self._stepped_in_backward:
            raise RuntimeError(
                "OffloadOptimizer(step_in_backward=True) already updated this unit in an earlier backward: call "
                "step() after every synced backward (accumulate with no_sync()), or use step_in_backward=False"
            )
        self._stepped_in_backward.add(id(host))
        host.queue()
        # Keyed after every update queued by an earlier step() (none are, in a step_in_backward loop), FIFO.
        self._worker.submit(host_task(plan, settings_of(self.optimizer, plan), None, self._lock, event,
                                      in_backward=True), key=len(self._plans), tag=plan)

    def _submit(self, plan: ShardPlan, settings: list[dict[str, Any]], coef: torch.Tensor | None, key: float) -> None:
        """Queue a host shard's update on the host worker, or, where clipping scales it, on the GPU's share."""
        task = self._assist.task(plan, settings, coef) if coef is not None and self._assist is not None else None
        worker = self._assist.worker if task is not None and self._assist is not None else self._worker
        worker.submit(task or host_task(plan, settings, coef, self._lock), key=key, tag=plan)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop (or zero) the gradients; a shard whose step is still queued gets it right after that step."""
        self._coef, self._coef_deferred = None, set()  # a clip not followed by step(): its gradients are gone
        if self._spec is not None and not set_to_none:
            raise ValueError("OffloadOptimizer(speculative_clip=True) updates each unit as its gradient lands, so "
                             "every synced backward must start from no gradient: zero_grad(set_to_none=True), or "
                             "speculative_clip=False to keep zeroed gradients")
        if not self._plans:
            self.optimizer.zero_grad(set_to_none=set_to_none)
            return
        with self._lock, self._assist.lock if self._assist is not None else contextlib.nullcontext():
            for plan in self._plans:
                if plan.host is not None and plan.host.in_flight:
                    plan.deferred_zero = set_to_none
                else:
                    apply_zero_grad(plan, set_to_none)

    def synchronize(self) -> None:
        """Block until every queued host step has finished; re-raise the first error one raised."""
        for u in units_below(self.root):
            for h in u.handles:
                if h.host is not None:
                    h.host.wait_ready()

    def host_stats(self) -> dict[str, float]:
        """Where the overlapped step's time went, in seconds since this optimizer was made: ``host_busy_s`` the
        worker spent in updates (``gpu_update_busy_s`` the GPU share's worker, queueing and waiting), ``wait_s``
        callers (the next forward's gathers, backward's gradient copies, state paths) spent blocked waiting for an
        update, ``update_s`` the workers' time updating (their waits for gradient and parameter copies left out;
        ``gpu_update_units``/``_elements``: the GPU share's so far). Differences between two calls give one step's
        share. ``grad_d2h_bytes`` and ``param_h2d_bytes`` count the bytes of gradients sent to the host and of
        parameters read for gathers; ``placements_left`` the budget's placements still to come (each at a
        ``step()``: time steps after them)."""
        hosts = [h.host for u in units_below(self.root) for h in u.handles if isinstance(h.host, HostShard)]
        out = {"host_busy_s": self._worker.busy_s, "wait_s": sum(h.stats.waited_s for h in hosts),
               "update_s": sum(h.stats.update_s for h in hosts), "host_threads": float(self.host_threads),
               "grad_d2h_bytes": float(sum(h.stats.grad_d2h_bytes for h in hosts)),
               "param_h2d_bytes": float(sum(h.stats.param_h2d_bytes for h in hosts)),
               "placements_left": float(PLACEMENTS - self._placements if self._budget_applies() else 0)}
        if self._assist is not None:  # gpu_update_share: its worker's busy time, unit updates and elements so far
            out.update(gpu_update_busy_s=self._assist.worker.busy_s, gpu_update_units=float(self._assist.units),
                       gpu_update_elements=float(self._assist.elements))
        if self._spec is not None:  # speculative_clip: spare bytes held, steps and unit updates committed/redone
            out.update({f"spec_{k}": float(v) for k, v in vars(self._spec.counts).items()},
                       spec_spare_bytes=float(self._spec.spare_bytes()))
        return out

    def trace_host(self, on: bool = True) -> HostTrace | None:
        """Start (``on``) or stop recording the host step's timeline (``HostTrace``: per offloaded unit, when its
        update was queued, taken, had its gradient, ran and finished, and when callers waited for it); returns
        the trace being recorded (None once stopped). A diagnostic for benchmarks: events accumulate until
        stopped."""
        self._trace = HostTrace() if on else None
        self._attach_trace()
        return self._trace

    def _attach_trace(self) -> None:
        for i, plan in enumerate(self._plans):  # the unit's index in the forward order
            if plan.host is not None:
                plan.host.trace = self._trace.recorder(i) if self._trace is not None else None

    def close(self) -> None:
        """Finish the steps in flight (and their SSD write-backs), end the worker thread (also done when this object
        is collected) and detach from the model, whose shards then train with a plain optimizer again."""
        self.synchronize()
        self._finalizer()
        for hook in self._wrapped_hooks:
            hook.remove()
        if engine_of(self.root) is self:
            self.root.host_engine = None
        for u in units_below(self.root):
            for h in u.handles:
                h.host = _backing.release(h)  # None, or the SSD host shard (the plain optimizer's path)

    # ----------------------------------------------------------------------------------------------
    # clipping
    # ----------------------------------------------------------------------------------------------

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """The model's ``clip_grad_norm_``: the global norm from the per-unit norms taken on the GPU (one
        all-reduce), the scaling deferred to each unit's update (host shards) or applied now (the others)."""
        if self.step_in_backward:
            raise RuntimeError(
                "OffloadOptimizer(step_in_backward=True) updates each unit as its gradient lands, before the global "
                "norm is known: clipping by it is impossible there; use step_in_backward=False to clip"
            )
        self.apply_pending_clip()  # a second clip measures the gradients the first one scaled, as torch's does
        unit = self.root
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        if float(norm_type) != 2.0:
            return self._plain_clip(grads, max_norm, norm_type)
        norms = []
        for p in self.model.parameters():
            g = p.grad
            if g is None or not g.numel():
                continue
            h = handle_of(p)
            host = h.host if h is not None and h.flat is p and isinstance(h.host, HostShard) else None
            sent = host.grad_copy if host is not None and g is host.grad_buf else None
            norm = sent.norm if sent is not None and sent.norm_valid else None
            norms.append(norm if norm is not None else foreach_norm([g], 2.0)[0])
        device = unit.compute_device
        if norms:
            local = torch.stack([n.float().to(device) for n in norms]).pow(2.0).sum()
        else:
            local = torch.zeros((), dtype=torch.float32, device=device)
        total = coll.all_reduce_(local, unit.groups.process_group, unit.world_size).pow(0.5)
        coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
        self._scale_now(coef)
        return total

    @torch.no_grad()
    def apply_pending_clip(self) -> None:
        """Scale the host shards' gradients by the coefficient of the last ``clip_grad_norm_`` now.

        ``clip_grad_norm_`` leaves the host shards' ``.grad`` unscaled and scales them inside their update at
        ``step()`` (one pass over host memory fewer), so between the two they still hold the unclipped gradients.
        Call this before reading or changing them there (logging the clipped gradients, adding noise); a second
        ``clip_grad_norm_`` calls it itself. The values are the same either way. It waits for the updates in flight
        (speculative ones included: they read these gradients); nothing pending, it returns at once."""
        coef, deferred = self._coef, self._coef_deferred
        self._coef, self._coef_deferred = None, set()  # the GPU-resident units were scaled at the clip
        if coef is None or not deferred or bool(coef == 1.0):  # x * 1.0 is x: speculations stay valid
            return
        self.synchronize()
        for plan in self._plans:
            if id(plan.handle) not in deferred:
                continue
            scale_grads([p.grad for _, params in plan.groups for p in params if p.grad is not None], coef,
                        plan.clip_in_update)
            if isinstance(plan.host, HostShard):
                plan.host.grad_copy.norm_valid = False  # taken before the scaling

    def _scale_now(self, coef: torch.Tensor) -> None:
        """Scale the gradients not stepped on the host now; keep ``coef`` for the host shards' updates."""
        self._refresh_plans()
        for plan in self._plans:
            if plan.host is not None:
                continue
            grads = [p.grad for _, params in plan.groups for p in params if p.grad is not None]
            if grads:
                foreach_mul_(grads, coef.to(grads[0].device))
        self._coef = coef  # none pending: clip_grad_norm_ applied the last one first
        self._coef_deferred |= {id(plan.handle) for plan in self._plans if plan.host is not None}

    def _plain_clip(self, grads: list[torch.Tensor], max_norm: float, norm_type: float) -> torch.Tensor:
        unit = self.root
        self.synchronize()
        return clip_grad_norm(grads, max_norm, norm_type, unit.compute_device, unit.groups.process_group,
                              unit.world_size)

    # ----------------------------------------------------------------------------------------------
    # partial offload
    # ----------------------------------------------------------------------------------------------

    def _budget_applies(self) -> bool:
        return budget_applies(self.root, self.gpu_budget_gib)

    def _place_by_budget(self) -> set[int]:
        """At the first steps (PLACEMENTS): keep the offloaded units that fit the room left under the budget
        resident on the GPU, the next ones in forward order. Returns the ids of the handles moved whose update
        already ran on the host in this step's backward (``step_in_backward``): not to be stepped again."""
        self._placements += 1
        device = self.root.compute_device
        resident_before = sum(1 for h in self._handles_in_order() if h.host is None)
        if not self._budget_applies() or (self._placements > 1 and not self._moved_any):
            self._placements = PLACEMENTS  # nothing fitted the first time: the peak will not change
            return set()
        if self.gpu_budget_gib is None:
            allowed = usable_device_bytes(device) - torch.cuda.max_memory_reserved(device)
        else:
            allowed = self.gpu_budget_gib * GIB - torch.cuda.max_memory_allocated(device)
        handles = [h for h in self._handles_in_order() if h.host is not None and h.orig_views is None]
        per_element = 4 + 4 + state_bytes_per_element(self.optimizer)  # shard, gradient, optimizer state
        count = choose_resident([h.flat.numel() for h in handles], allowed, per_element)
        moved = handles[:count]
        done_on_host = {id(h) for h in moved if h.host is not None and id(h.host) in self._stepped_in_backward}
        for h in moved:
            make_resident(h, self.optimizer, device)
        self._moved_any = self._moved_any or bool(moved)
        if moved:
            logger.info("OffloadOptimizer: %d more of %d offloaded shards (%.2f GiB with gradients and state) stay "
                        "on %s (placement %d; %d resident before)", len(moved), len(handles),
                        sum(h.flat.numel() for h in moved) * per_element / GIB, device, self._placements,
                        resident_before)
        self._signature = ()
        return done_on_host


def _queue_widening(worker: StepWorker, host: HostShard, event: torch.cuda.Event | None, copy: int) -> None:
    """A compute-dtype gradient copy is queued: widen it on the worker as it lands, ahead of any update."""
    worker.submit(host.widen_task(event, copy), key=WIDEN_KEY)


def _close_worker(worker: StepWorker, held: list[tuple[Any, list[Any]]], assist: GpuAssist | None) -> None:
    """Finish the queued updates and end the workers; an SSD-backed update waiting for room to keep its shard
    (for a gather that will not come now) goes on."""
    with _backing.main_waits(held):
        worker.close()
    if assist is not None:
        assist.close()
