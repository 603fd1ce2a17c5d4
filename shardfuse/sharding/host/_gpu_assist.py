"""The GPU's share of the offloaded update (``OffloadOptimizer(gpu_update_share=...)``): in steps where clipping
scales the gradients, the last units of the forward order, a set fraction of the offloaded parameters, are stepped
by the GPU while the host steps the others.
Each such unit streams through a few reused device buffers in chunks: its parameters, gradient and moments cross
to the device, torch's fused CUDA Adam/AdamW kernel updates them there, and the results cross back into the same
host memory (AdamW: 16 B/param to the device, 12 B back).

Why: after a clipped backward the host's update is most of the offloaded step, and the GPU and both copy engines
sit idle meanwhile. On one H200 of a 16-core host, torch's fused AdamW over 1B parameters took 213-299 ms on the
host, 249-281 ms streamed through the GPU this way, and 160-180 ms with about half on each at once. In training the
two share host memory and the bus, and the GPU's path (430-450 ms per billion parameters there) pays only where the
host's update is slow: where clipping fires (its scale shares the host's pass) the 2.9B decoder's step took 1052
against 1382 ms at a share of 0.5; where it does not, 976 against 969 at 0.35 and 1032 against 993 at 0.5, and under
``step_in_backward`` (the bus busy with backward's copies) 1003 against 840. So the share runs only where clipping
scales the update (docs/api.md, "The GPU's share of the update").

Values: the GPU's fused kernel, equal to the host's to fp32 rounding, as for the units a GPU budget keeps resident
(with a CPU compute device, as in the CPU suite, the very kernel the host runs: the same bits). The host gradient
is read, never written: where clipping fires its scale is applied on the device, so after ``step()`` an assisted
unit's ``.grad`` holds the unclipped gradient (a host unit's holds the clipped one; both are zeroed next).

Threads and streams: the assisted units' tasks run on a :class:`StepWorker` of their own (thread
``shardfuse-host-assist``), in forward order beside the host worker. Each is the host tier's task
(``_host_step.host_task``) with this module's update, under a lock of its own (``GpuAssist.lock``; the host worker
holds the step lock through each of its updates, so sharing it would serialise the two): the copies and kernels are
queued under it, and the wait for the last copy back runs outside it. Three CUDA
streams owned here (to the device, the kernels, back to the host) pipeline the chunks through ``SLOTS`` sets of
buffers; events order them, and a set is refilled only after its copies back have finished.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import torch

from shardfuse._streams import record_event, use_stream, wait_event
from shardfuse._torch_private import FusedKernel, call_fused_adam, foreach_add_, fused_adam_kernels
from shardfuse._versions import mark_updated
from shardfuse.sharding.host._host_fused import _Group, _group_of, _offset_in, _pieces, _scalar, _views, clip_inverse
from shardfuse.sharding.host._host_shard import HostShard, host_buffer
from shardfuse.sharding.host._host_step import ShardPlan, StepWorker, host_task

ASSIST_CHUNK = 1 << 23  # elements per chunk: a slot holds 4 fp32 buffers of 32 MiB (5 with amsgrad)
SLOTS = 3  # chunks in flight: one crossing to the device, one updating, one crossing back
STATE_NAMES = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


class GpuAssist:
    """The GPU's share of one ``OffloadOptimizer``'s host updates: which units it takes, its worker thread, its
    streams and buffers (owned here, made at the first chunk, dropped by :meth:`close`)."""

    def __init__(self, share: float) -> None:
        self.share = share
        self.worker = StepWorker(name="shardfuse-host-assist")
        self.chosen: set[int] = set()  # id(HostShard) of the units stepped here
        self.units = 0  # unit updates run on the device so far (host_stats)
        self.elements = 0  # their elements
        self._device = torch.device("cpu")
        self._streams: tuple[torch.cuda.Stream, torch.cuda.Stream, torch.cuda.Stream] | None = None
        self._buffers: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}  # (slot, role, dtype) -> buffer
        self._free: list[torch.cuda.Event | None] = [None] * SLOTS  # each slot's last copy back
        self._next = 0
        # The GPU share's step lock: its units' update states, deferred zero_grad and gradients (as the step lock
        # is for the host worker's units: zero_grad takes both, the step lock first), and the buffers above.
        self.lock = threading.Lock()

    def choose(self, plans: list[ShardPlan], device: torch.device) -> None:
        """Take units from the end of the forward order (``plans``' order) until ``share`` of the offloaded
        elements is reached: the host's updates of the first units, which the next forward needs first, start
        at once, while the GPU streams the last ones."""
        self._device = device
        hosts = [p for p in plans if type(p.host) is HostShard and p.handle is not None]
        target = self.share * sum(p.handle.flat.numel() for p in hosts if p.handle is not None)
        chosen: set[int] = set()
        taken = 0
        for plan in reversed(hosts):
            if taken >= target or plan.handle is None:
                break
            chosen.add(id(plan.host))
            taken += plan.handle.flat.numel()
        self.chosen = chosen

    def task(self, plan: ShardPlan, settings: list[dict[str, Any]], coef: torch.Tensor) -> Callable[[], None] | None:
        """(Main thread, in ``step()``, no update of ``plan`` in flight) The host tier's task for one of the share's
        units (see ``host_task``) with the update run on the device, under :attr:`lock` instead of the step lock,
        which the host worker holds through each update; None where the unit is not the share's or the device's
        path does not apply (the first step, which makes the state; another optimizer or settings): the host
        worker updates it then, so the state is only ever made there. The state is made page-locked here once
        (:func:`_pin_state`), not in a step the next forward waits for."""
        kernels = fused_adam_kernels()
        if plan.host is None or id(plan.host) not in self.chosen or kernels is None:
            return None
        groups = _groups(plan, settings, self._device.type == "cuda")
        if groups is None:
            return None
        return host_task(plan, settings, coef, self.lock,
                         update=functools.partial(self._update, plan, settings, coef, groups, kernels))

    def close(self) -> None:
        """End the worker (after its queued tasks) and drop the streams' buffers once their copies finished."""
        self.worker.close()
        with self.lock:
            for event in self._free:
                if event is not None:
                    event.synchronize()
            self._buffers.clear()
            self._free = [None] * SLOTS

    # ----------------------------------------------------------------------------------------------
    # one unit (assist thread, under self.lock)
    # ----------------------------------------------------------------------------------------------

    def _update(self, plan: ShardPlan, settings: list[dict[str, Any]], coef: torch.Tensor | None,
                groups: list[_Group], kernels: tuple[FusedKernel, FusedKernel]) -> Callable[[], None]:
        """Queue the unit's update on the device (``groups``: the fused kernel's inputs, taken by :meth:`task`);
        return the wait for its copies back."""
        host, handle = plan.host, plan.handle
        assert host is not None and handle is not None  # host_task checked
        for sub, group_settings in zip(plan.subs, settings):
            sub.param_groups[0].update(group_settings)
        flat = handle.flat
        offsets = [[_offset_in(flat, p) for p in g.params] for g in groups]
        in_sync = host.compute_buf is not None and host.copy_version == flat._version
        copy_buf = host.compute_buf if in_sync and all(o is not None for offs in offsets for o in offs) else None
        written: list[torch.Tensor] = []
        last: torch.cuda.Event | None = None
        scale = None  # clipping's factor as the device applies it (a divisor with clip_in_update), once per unit
        if coef is not None:
            scale = float(clip_inverse(coef) if plan.clip_in_update else coef.detach().to("cpu", torch.float32))
        with torch.no_grad():  # under self.lock (host_task holds it)
            for group, offs in zip(groups, offsets):
                if not group.params:
                    continue
                foreach_add_(group.steps, 1)
                kernel = kernels[1] if group.decoupled else kernels[0]
                kwargs = {**group.kwargs, "lr": _scalar(group.kwargs["lr"])}  # a host tensor: a number here
                for i, offset in enumerate(offs):
                    target = None
                    if copy_buf is not None and offset is not None:
                        target = copy_buf[offset:offset + group.params[i].numel()]
                    last = self._stream_param(group, i, kernel, kwargs, scale, plan.clip_in_update, target) or last
                    written += [t for j, t in enumerate(_views(group, i)) if j != 1]  # not the gradient: read only
        self.units += 1
        self.elements += flat.numel()
        return functools.partial(_settle, last, written, host, flat, copy_buf is not None)

    def _stream_param(self, group: _Group, i: int, kernel: FusedKernel, kwargs: dict[str, Any],
                      scale_value: float | None, divide: bool,
                      target: torch.Tensor | None) -> torch.cuda.Event | None:
        """Parameter ``i`` of ``group`` through the device, chunk by chunk; the event of its last copy back."""
        views = [t.view(-1) for t in _views(group, i)]
        _, comp, _ = self._stream_set()
        with use_stream(comp):  # made by the kernels' stream: no host wait for a copy from pageable memory
            step = torch.full((), float(group.steps[i]), dtype=group.steps[i].dtype, device=self._device)
            scale = None
            if scale_value is not None:
                scale = torch.full((), scale_value, dtype=torch.float32, device=self._device)
        last = None
        for a, b in _pieces(views[0].numel(), ASSIST_CHUNK):
            last = self._chunk(views, a, b, kernel, kwargs, step, scale, divide, target)
        return last

    def _chunk(self, views: list[torch.Tensor], a: int, b: int, kernel: FusedKernel, kwargs: dict[str, Any],
               step: torch.Tensor, scale: torch.Tensor | None, divide: bool,
               target: torch.Tensor | None) -> torch.cuda.Event | None:
        """Elements ``a:b``: to the device, scaled and updated there, back (with the compute copy's chunk)."""
        k, self._next = self._next, (self._next + 1) % SLOTS
        h2d, comp, d2h = self._stream_set()
        bufs = [self._buffer(k, role, t.dtype)[:b - a] for role, t in enumerate(views)]
        with use_stream(h2d):
            wait_event(h2d, self._free[k])
            for buf, src in zip(bufs, views):
                buf.copy_(src[a:b], non_blocking=True)
            loaded = record_event(h2d)
        with use_stream(comp):
            wait_event(comp, loaded)
            p, g, m, v, *max_v = bufs
            if scale is not None:
                (g.div_ if divide else g.mul_)(scale)
            call_fused_adam(kernel, [p], [g], [m], [v], max_v, [step], kwargs)
            low = None
            if target is not None:
                low = self._buffer(k, len(views), target.dtype)[:b - a]
                low.copy_(p)
            updated = record_event(comp)
        with use_stream(d2h):
            wait_event(d2h, updated)
            for j, (buf, dst) in enumerate(zip(bufs, views)):
                if j != 1:  # the gradient stays as it was on the host
                    dst[a:b].copy_(buf, non_blocking=True)
            if target is not None and low is not None:
                target[a:b].copy_(low, non_blocking=True)
            self._free[k] = record_event(d2h)
        return self._free[k]

    def _stream_set(self) -> tuple[Any, Any, Any]:
        if self._device.type != "cuda":
            return None, None, None
        if self._streams is None:
            self._streams = (torch.cuda.Stream(self._device), torch.cuda.Stream(self._device),
                             torch.cuda.Stream(self._device))
        return self._streams

    def _buffer(self, slot: int, role: int, dtype: torch.dtype) -> torch.Tensor:
        key = (slot, role, dtype)
        buf = self._buffers.get(key)
        if buf is None:
            buf = self._buffers[key] = torch.empty(ASSIST_CHUNK, dtype=dtype, device=self._device)
        return buf


def _groups(plan: ShardPlan, settings: list[dict[str, Any]], pin: bool) -> list[_Group] | None:
    """The fused kernel's inputs per group (``_host_fused._group_of``), or None where that path does not apply;
    with ``pin`` the optimizer state is made page-locked first where it is not (:func:`_pin_state`)."""
    if pin:
        _pin_state(plan)
    groups = []
    for sub, (_, params), group_settings in zip(plan.subs, plan.groups, settings):
        group = _group_of(sub, params, group_settings)
        if group is None:
            return None
        groups.append(group)
    return groups


def _pin_state(plan: ShardPlan) -> None:
    """Move the plan's optimizer state to page-locked host memory where it is not (once per tensor: the optimizer
    makes it pageable, and copies to and from the device from pageable memory are staged by the driver, at a
    fraction of the bus's speed; a loaded state dict is moved again at its first step in the share). Main thread,
    no update of the plan in flight: only the plan's own entries of the state change."""
    for sub, (_, params) in zip(plan.subs, plan.groups):
        for p in params:
            state = sub.state.get(p)
            for name in STATE_NAMES if state else ():
                t = state.get(name)  # type: ignore[union-attr]
                if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.numel() and not t.is_pinned():
                    pinned = host_buffer(t.numel(), t.dtype, True).view(t.shape)
                    pinned.copy_(t)
                    state[name] = pinned  # type: ignore[index]


def _settle(last: torch.cuda.Event | None, written: list[torch.Tensor], host: HostShard, flat: torch.Tensor,
            copied: bool) -> None:
    """(Assist thread, outside the step lock) wait for the unit's last copy back, then count the writes the
    copies made (version counters: the compute copy and the SSD write-behind read them) and refresh the compute
    copy where the device did not write it."""
    if last is not None:
        last.synchronize()
    mark_updated(written)
    if copied:
        host.copy_version = flat._version
    else:
        host.write_compute_copy(flat)
