"""Moving slices between the host and the compute device: streams, buffer slots, gradients, optimizers.

Stream discipline (CUDA; on the CPU every stream and event is a no-op and copies are synchronous):

* the *compute* stream is the caller's current stream; all math runs there;
* host->device copies (slice parameters, stashed activations) run on the ``h2d`` side stream; before
  writing a slot the ``h2d`` stream waits for the compute stream (the slot's previous reader) and for the
  slot's last device->host read; the compute stream waits on the load's ``ready`` event before using it;
* device->host copies (boundary activations, gradients, updated master weights) run on the ``d2h`` side
  stream after waiting for the compute stream; a slot read by ``d2h`` records an event that its next
  writer waits on; host buffers are never read on the host before ``d2h`` is synchronised at the end of
  backward.

Lifetimes without ``record_stream``: a device tensor made on the compute stream and read by ``d2h`` (a
parked activation, optimizer state going home) is held with the copy's event in :class:`PendingFrees` and
dropped once that event has completed, or after the compute stream waited for it; the end of backward
synchronises ``d2h`` and drops them all. The host runs ahead of the GPU, so a query seldom finds a copy done:
where the code knows the compute stream is done with a source, it drops the hold after a compute-stream wait
(:meth:`Engine.release_stashed`), so that the source goes when its last other reference does, as it went with
``record_stream`` (a slice's input at the end of that slice's forward, whose compute the copy overlapped).

Parameter slots: two device buffers of the largest slice, reused (one computes while the other is being
filled). Gradient slots: two fp32 buffers (one is accumulated while the other drains to the host).

With the optimizer in backward (``Engine.carry``) the bus carries less: the last slice is loaded with its fp32
master in the forward and kept for its backward (no second load), and the first two slices, whose backward ends
the step with their updated copy on the device, stay there for the next forward (no load, no shadow home).
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from shardfuse._profiling import profiled
from shardfuse._streams import current_stream, new_stream, record_event, use_stream, wait_event, wait_stream
from shardfuse.offload._buffers import GradBuffers, PendingFrees, Slot, SlotPool, Stashed
from shardfuse.offload._slices import Slice


class Phase(enum.Enum):
    """What a slice is made resident for; its value names the profiler range (``shardfuse.offload:forward_load``)."""

    FORWARD = "forward"
    BACKWARD = "backward"


class Loaded:
    """A slice resident on the compute device (issued; usable after the compute stream waited ``ready``)."""

    def __init__(self, s: Slice, slot: Slot, master: Slot | None, stamp: tuple[int, int]) -> None:
        self.slice = s
        self.slot = slot
        self.master = master  # fp32 master copy on the device (optimizer in backward), may be ``slot``
        self.stamp = stamp
        self.ready: torch.cuda.Event | None = None
        self.inputs: list[torch.Tensor] = []  # restored activations (``stash`` brought back), on the device
        self.stash: Sequence[Any] | None = None  # whose stashed activations ``inputs`` are
        self.inputs_ready: torch.cuda.Event | None = None
        self.waited = False
        self.carried = False  # kept on the device from a backward for the next forward (see Engine.carries)

    def leaves(self, requires_grad: bool) -> list[torch.Tensor]:
        """Fresh leaf tensors viewing the slot, one per parameter (requiring grad where the master does)."""
        views = self.slice.views(self.slot.buf)
        return [
            v.detach().requires_grad_(requires_grad and p.requires_grad) for v, p in zip(views, self.slice.params)
        ]


class Step:
    """Bookkeeping of one forward with autograd until its backward finishes."""

    def __init__(self) -> None:
        self.grads: list[tuple[Slice, torch.Tensor]] = []
        self.finish_queued = False

    def __hash__(self) -> int:
        return id(self)


class Engine:
    """Owns the side streams and device buffers of one ``OffloadModel``."""

    def __init__(
        self,
        slices: Sequence[Slice],
        device: torch.device,
        compute_dtype: torch.dtype,
        master_dtype: torch.dtype,
        optimizers: Sequence[torch.optim.Optimizer | None] | None,
    ) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.lp = compute_dtype != master_dtype
        self.num_slices = len(slices)
        # With the optimizer in backward, fewer loads: the last slice comes with its master in the forward, the
        # first ones stay from the backward for the next forward (carries). Off: every slice loaded in forward and
        # backward, every shadow sent home (the schedule before; tests hold the two against each other).
        self.carry = optimizers is not None
        self.optimizers = list(optimizers) if optimizers is not None else None
        numel = max(s.numel for s in slices)
        self.param_pool = SlotPool(numel, compute_dtype, device, 2)
        # the low-precision pools get no slot at all in a full-precision run
        self.master_pool = SlotPool(numel, master_dtype, device, 2 if self.lp else 0)
        self.grad_pool = SlotPool(numel, master_dtype, device, 2)
        self.lp_grad_pool = SlotPool(numel, compute_dtype, device, 1 if self.lp else 0)
        self.pending = PendingFrees()
        self._prefetched: dict[int, Loaded] = {}
        self._h2d: torch.cuda.Stream | None = None
        self._d2h: torch.cuda.Stream | None = None
        self._steps: weakref.WeakSet[Step] = weakref.WeakSet()
        self._opt_moved: dict[nn.Parameter, list[str]] = {}
        self.bytes_moved = {"h2d": 0, "d2h": 0}  # bytes issued across the bus, for benchmarks

    def _count(self, direction: str, t: torch.Tensor) -> None:
        self.bytes_moved[direction] += t.numel() * t.element_size()

    # ------------------------------------------------------------------ streams
    def compute_stream(self) -> torch.cuda.Stream | None:
        return current_stream(self.device)

    @property
    def h2d(self) -> torch.cuda.Stream | None:
        if self._h2d is None:
            self._h2d = new_stream(self.device)
        return self._h2d

    @property
    def d2h(self) -> torch.cuda.Stream | None:
        if self._d2h is None:
            self._d2h = new_stream(self.device)
        return self._d2h

    def new_step(self) -> Step:
        step = Step()
        self._steps.add(step)
        return step

    def begin_backward(self, step: Step) -> None:
        """Called as a backward reaches ``step``'s slices: :meth:`finish` runs once that backward is through."""
        if step.finish_queued:
            return
        step.finish_queued = True
        self._steps.add(step)  # again, for a second backward through a retained graph
        torch.autograd.Variable._execution_engine.queue_callback(lambda: self.finish(step))

    # ------------------------------------------------------------------ loading
    def _needs_master(self, s: Slice, phase: Phase, for_backward: bool = False) -> bool:
        """Whether a load of ``s`` brings its fp32 master copy, which the optimizer in backward steps.

        ``for_backward``: a forward load kept on the device for the backward that follows (the last slice):
        it comes with its master at once, so that its backward needs no second load.
        """
        if self.optimizers is None or not s.trainable:
            return False
        return phase is Phase.BACKWARD or (for_backward and self.carry)

    def carries(self, s: Slice) -> bool:
        """Whether ``s`` stays on the device from its backward to the next forward.

        With the optimizer in backward the slice's device copy is the updated one when its backward ends, and
        the first slices' backward comes last: they stay (as many as there are parameter slots, the last slice
        excepted, which the forward loads with its master) and the next forward starts without loading them,
        nor does their low-precision shadow go home. A forward without autograd or a change of the master
        (stamp) drops them.
        """
        return self.carry and s.index < min(self.param_pool.count, self.num_slices - 1)

    def _issue(self, s: Slice, phase: Phase, stash: Sequence[Any] | None, for_backward: bool = False) -> Loaded:
        need_master = self._needs_master(s, phase, for_backward)
        compute, h2d = self.compute_stream(), self.h2d
        slot = self.param_pool.acquire()
        ld = Loaded(s, slot, None, s.stamp())
        wait_stream(h2d, compute)
        n = s.numel
        with use_stream(h2d), torch.no_grad():
            dst = slot.buf[:n]
            if not self.lp:
                wait_event(h2d, slot.event)
                dst.copy_(s.flat, non_blocking=True)
                self._count("h2d", s.flat)
                ld.master = slot if need_master else None
            elif need_master or not s.shadow_fresh():
                ms = self.master_pool.acquire()
                wait_event(h2d, ms.event)
                mdst = ms.buf[:n]
                mdst.copy_(s.flat, non_blocking=True)
                self._count("h2d", s.flat)
                # only the cast writes the parameter slot: the fp32 copy does not wait for the slot's last
                # device->host read (a shadow going home), the cast does
                wait_event(h2d, slot.event)
                dst.copy_(mdst)  # cast on the device: the fp32 weights crossed the bus once
                if need_master:
                    ld.master = ms
                else:
                    # refresh the low-precision host shadow so that later loads move half the bytes
                    self.master_pool.release(ms)
                    slot.event = s.shadow_event = self._copy_out(s.lp_shadow(), dst, record_event(h2d))
                    s.mark_shadow_fresh()
            else:
                shadow = s.lp_shadow()
                wait_event(h2d, s.shadow_event)  # the shadow may still be landing from its refresh
                wait_event(h2d, slot.event)
                dst.copy_(shadow, non_blocking=True)
                self._count("h2d", shadow)
            ld.ready = record_event(h2d)
        if stash is not None:
            ld.inputs, ld.inputs_ready = self._restore(stash)
            ld.stash = stash
        return ld

    def _copy_out(
        self, host: torch.Tensor, src: torch.Tensor, after: torch.cuda.Event | None
    ) -> torch.cuda.Event | None:
        """Copy ``src`` (device) into ``host`` on the d2h stream once ``after`` (or the compute stream) is done."""
        self._count("d2h", src)
        d2h = self.d2h
        if d2h is None:
            host.copy_(src)
            return None
        if after is not None:
            wait_event(d2h, after)
        else:
            wait_stream(d2h, self.compute_stream())
        with use_stream(d2h):
            host.copy_(src, non_blocking=True)
        return record_event(d2h)

    def _restore(self, stash: Sequence[Any]) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
        """Bring stashed activations back to the device on the h2d stream."""
        h2d = self.h2d
        out: list[torch.Tensor] = []
        # allocated on the compute stream, which is also where they are used and freed
        targets = [torch.empty(x.host.shape, dtype=x.host.dtype, device=x.device) if isinstance(x, Stashed) else None
                   for x in stash]
        wait_stream(h2d, self.compute_stream())
        with use_stream(h2d):
            for x, t in zip(stash, targets):
                if t is None:
                    out.append(x)
                    continue
                wait_event(h2d, x.event)  # never read the host copy before it has landed
                t.copy_(x.host, non_blocking=True)
                self._count("h2d", t)
                out.append(t)
        return out, record_event(h2d)

    def _compatible(self, ld: Loaded, phase: Phase, for_backward: bool = False) -> bool:
        if ld.stamp != ld.slice.stamp():
            return False  # the master changed since (an optimizer step): reload
        return not (self._needs_master(ld.slice, phase, for_backward) and ld.master is None)

    def _wait(self, ld: Loaded) -> None:
        # parameters and restored activations are waited separately: a slice kept resident since the
        # forward (already waited) gets its activations restored only when its backward starts
        compute = self.compute_stream()
        if not ld.waited:
            wait_event(compute, ld.ready)
        wait_event(compute, ld.inputs_ready)
        ld.waited = True
        ld.inputs_ready = None

    def _drop(self, ld: Loaded) -> None:
        # the compute stream waits for the copy first, so the slot is never reused under a running copy
        self._wait(ld)
        self.release(ld)

    def drop_prefetched(self, keep: int | None = None, keep_carried: bool = False) -> None:
        """Give back what is parked on the device, except slice ``keep`` (and the carried ones if asked)."""
        for idx in [i for i, ld in self._prefetched.items() if i != keep and not (keep_carried and ld.carried)]:
            self._drop(self._prefetched.pop(idx))

    def _make_room(self, s: Slice, phase: Phase, for_backward: bool) -> None:
        if not self.param_pool.has_free() or (
            self.lp and self._needs_master(s, phase, for_backward) and not self.master_pool.has_free()
        ):
            self.drop_prefetched(keep=s.index)

    def acquire(
        self, s: Slice, phase: Phase, stash: Sequence[Any] | None = None, for_backward: bool = False
    ) -> Loaded:
        """Make ``s`` resident for ``phase``; the compute stream may use it now.

        ``for_backward``: a forward load that stays for the backward after it (see :meth:`_needs_master`).
        """
        self.pending.collect()
        with profiled(f"shardfuse.offload:{phase.value}_load"):
            ld = self._prefetched.pop(s.index, None)
            if ld is not None and not self._compatible(ld, phase, for_backward):
                self._drop(ld)
                ld = None
            if ld is None:
                self._make_room(s, phase, for_backward)
                ld = self._issue(s, phase, stash, for_backward)
            elif stash is not None and ld.stash is not stash:
                # parked without activations (kept since the forward), or with another call's
                ld.inputs, ld.inputs_ready = self._restore(stash)
                ld.stash = stash
            self._wait(ld)
            ld.carried = False
            return ld

    def prefetch(
        self, s: Slice, phase: Phase, stash: Sequence[Any] | None = None, for_backward: bool = False
    ) -> None:
        """Start loading ``s`` on the side stream, if a slot is free; :meth:`acquire` picks it up."""
        with profiled(f"shardfuse.offload:{phase.value}_load"):
            if s.index in self._prefetched:
                return
            if not self.param_pool.has_free():
                return
            if self._needs_master(s, phase, for_backward) and self.lp and not self.master_pool.has_free():
                return
            self._prefetched[s.index] = self._issue(s, phase, stash, for_backward)

    def release(self, ld: Loaded, keep: bool = False) -> None:
        """Done computing with ``ld``; ``keep`` parks it for the backward that follows the forward."""
        self.pending.collect()
        if keep:
            self._prefetched[ld.slice.index] = ld
            return
        self.param_pool.release(ld.slot)
        if ld.master is not None and ld.master is not ld.slot:
            self.master_pool.release(ld.master)
        ld.inputs, ld.stash = [], None

    def _carry(self, ld: Loaded) -> None:
        """Keep ``ld``'s parameter slot, whose contents are current, for the next forward (see :meth:`carries`)."""
        if ld.master is not None and ld.master is not ld.slot:
            self.master_pool.release(ld.master)
            ld.master = None
        ld.inputs, ld.stash, ld.inputs_ready = [], None, None
        ld.stamp = ld.slice.stamp()  # after the optimizer step and the master's copy home
        ld.carried = True
        self._prefetched[ld.slice.index] = ld

    # ------------------------------------------------------------------ activations
    def stash(self, t: torch.Tensor) -> Any:
        """Park a boundary activation in pinned host memory (device->host on the d2h stream)."""
        if not self._on_device(t):
            return t
        host, event = self._copy_home(t)
        # made on the compute stream, which may free it at once: hold it until the copy has read it
        self.pending.hold(t, event, self.compute_stream())
        return Stashed(host, t.device, event)

    def release_stashed(self, stashed: Sequence[Any]) -> None:
        """The compute stream no longer reads the device tensors behind ``stashed`` (:meth:`stash` results):
        drop the engine's hold on them once the compute stream waited for their copies (see
        :meth:`PendingFrees.release`). The waits cost nothing where those copies overlapped a slice's compute."""
        self.pending.release([x.event for x in stashed if isinstance(x, Stashed)], self.compute_stream())

    def _on_device(self, t: torch.Tensor) -> bool:
        return t.is_cuda

    def _copy_home(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """A pinned host copy of ``t``, made on the d2h stream after the compute stream's work so far."""
        d2h = self.d2h
        wait_stream(d2h, self.compute_stream())
        with use_stream(d2h):
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
        self._count("d2h", t)
        return host, record_event(d2h)

    # ------------------------------------------------------------------ gradients
    def grad_buffers(self, s: Slice) -> GradBuffers:
        """Zeroed device gradient buffers for ``s``'s backward."""
        slot = self.grad_pool.acquire()
        wait_event(self.compute_stream(), slot.event)  # its previous contents are still draining to the host
        lp_slot = self.lp_grad_pool.acquire() if self.lp else None
        gb = GradBuffers(slot, lp_slot, s.numel)
        gb.flat.zero_()
        if gb.lp_flat is not None:
            gb.lp_flat.zero_()
        return gb

    def accumulate_microbatch(self, gb: GradBuffers) -> None:
        """Fold one microbatch's low-precision gradient into the fp32 gradient (no-op in fp32)."""
        if gb.lp_flat is not None:
            with torch.no_grad():
                gb.flat.add_(gb.lp_flat)
                gb.lp_flat.zero_()

    def finish_slice(self, ld: Loaded, gb: GradBuffers | None, step: Step) -> None:
        """After a slice's backward: step its optimizer or send its gradient home; release its buffers."""
        s = ld.slice
        with profiled("shardfuse.offload:backward_drop"):
            if gb is not None:
                if self.optimizers is not None:
                    self._optimizer_step(ld, gb)
                else:
                    host = torch.empty(s.numel, dtype=gb.flat.dtype, pin_memory=self.cuda)
                    gb.slot.event = self._copy_out(host, gb.flat, None)
                    step.grads.append((s, host))
                self.grad_pool.release(gb.slot)
                if gb.lp_slot is not None:
                    self.lp_grad_pool.release(gb.lp_slot)
            if self.carries(s):
                self._carry(ld)
            else:
                self.release(ld)

    def _optimizer_step(self, ld: Loaded, gb: GradBuffers) -> None:
        s = ld.slice
        opt = self.optimizers[s.index] if self.optimizers is not None else None
        if opt is None:
            return
        if ld.master is None:
            raise RuntimeError(
                f"shardfuse.offload internal error: slice {s.index} was loaded for backward without its fp32 "
                "master copy, which optimizer_in_backward steps; please report this with the OffloadModel options"
            )
        n = s.numel
        master = ld.master.buf[:n]
        with profiled("shardfuse.offload:optimizer_step"), torch.no_grad():
            self._state_to(opt, s, device=True)
            host_data = [p.data for p in s.params]
            for p, mv, gv in zip(s.params, s.views(master), s.views(gb.flat)):
                p.data = mv
                p.grad = gv if p.requires_grad else None
            try:
                opt.step()
            finally:
                opt.zero_grad(set_to_none=True)
                for p, hd in zip(s.params, host_data):
                    p.data = hd
            self._state_to(opt, s, device=False)
            ev = self._copy_out(s.flat, master, None)
            ld.master.event = ev
            if self.lp:
                self._after_step_lp(ld, master)

    def _after_step_lp(self, ld: Loaded, master: torch.Tensor) -> None:
        """The compute-dtype copy of a slice stepped on the device: where the next forward finds it.

        A carried slice keeps it in its slot; the last slice gets none (the next forward loads its master);
        any other slice sends it home as the low-precision shadow. A shadow not refreshed is stale and a forward
        without the device copy loads the master instead (and refreshes the shadow), as after a host step.
        """
        s = ld.slice
        if self.carry and not self.carries(s) and s.index == self.num_slices - 1:
            return
        dst = ld.slot.buf[: s.numel]
        dst.copy_(master)
        if not self.carries(s):
            ld.slot.event = s.shadow_event = self._copy_out(s.lp_shadow(), dst, None)
            s.mark_shadow_fresh()

    def _state_to(self, opt: torch.optim.Optimizer, s: Slice, device: bool) -> None:
        """Keep optimizer state on the host between steps; bring it to the device for the step."""
        if not self.cuda:
            return
        if device:
            for p in s.params:
                st = opt.state.get(p)
                if not st:
                    continue
                for k in self._opt_moved.get(p, []):
                    if k in st:
                        st[k] = st[k].to(self.device, non_blocking=True)
                        self._count("h2d", st[k])
            return
        d2h = self.d2h
        wait_stream(d2h, self.compute_stream())
        for p in s.params:
            st = opt.state.get(p)
            if not st:
                continue
            moved = []
            for k, v in st.items():
                if isinstance(v, torch.Tensor) and v.is_cuda:
                    with use_stream(d2h):
                        host = torch.empty(v.shape, dtype=v.dtype, pin_memory=True)
                        host.copy_(v, non_blocking=True)
                    self._count("d2h", v)
                    # instead of record_stream: until the copy read it
                    self.pending.hold(v, record_event(d2h), self.compute_stream())
                    st[k] = host
                    moved.append(k)
            self._opt_moved[p] = moved

    def finish(self, step: Step) -> None:
        """End of backward: wait for every device->host copy, then hand gradients to the master params."""
        if self._d2h is not None:
            self._d2h.synchronize()
        self.pending.release_all(self.compute_stream())  # every copy has finished: nothing to wait for
        with torch.no_grad():
            for s, host in step.grads:
                for p, g in zip(s.params, s.views(host)):
                    if not p.requires_grad:
                        continue
                    if p.grad is None:
                        p.grad = g
                    else:
                        p.grad.add_(g)  # gradient accumulation over several backwards
        step.grads = []
        step.finish_queued = False
        self._steps.discard(step)
        self.drop_prefetched(keep_carried=True)
        if not self._steps:
            self.clear()

    def idle(self) -> None:
        """After a forward without autograd: drop what is parked, give buffers back when no backward is due."""
        if not self._steps:
            self.drop_prefetched()
            self.clear()

    def clear(self) -> None:
        for pool in (self.param_pool, self.master_pool, self.grad_pool, self.lp_grad_pool):
            pool.clear()


def make_optimizers(
    slices: Sequence[Slice], factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer]
) -> list[torch.optim.Optimizer | None]:
    """One optimizer per slice over its trainable parameters (None for a slice without any)."""
    out: list[torch.optim.Optimizer | None] = []
    for s in slices:
        params = [p for p in s.params if p.requires_grad]
        out.append(factory(params) if params else None)
    return out
