"""The host side of one offloaded flat parameter under :class:`~shardfuse.OffloadOptimizer`.

A :class:`HostShard` hangs on a :class:`FlatParamHandle` whose shard lives in host memory and keeps, next to the
fp32 shard ``flat``:

- ``grad_buf``: the pinned buffer the reduced gradient is copied into on the post-backward stream, reused every
  step (``flat.grad`` is this buffer once the copy has landed); ``stage_buf`` takes a second gradient when
  ``flat.grad`` already holds one (accumulation across backward passes);
- ``lowp_buf``: where the reduction is exact in the compute dtype (one rank, divide factors 1, no gradient held:
  ``_grad_reduce.exact_compute_dtype_grad``), the bf16/fp16 gradient crosses instead of its fp32 cast (half the
  bytes) into this pinned buffer, and is widened into ``grad_buf`` on the host (:meth:`HostShard.widen_grad`,
  exact) by the worker as the copy lands, or by the end of backward if the worker has not got to it: ``flat.grad``
  is the fp32 gradient whenever a user can read it, as on the fp32 path;
- ``compute_buf``: the parameters in the compute dtype (bf16), written by the optimizer step right after it
  updated the shard, so only 2 bytes per parameter cross to the GPU when the unit is gathered again;
- ``life``: where this shard's overlapped update is (:class:`UpdateState`, below); a gather waits until no update
  is in flight, so the next forward of a unit waits for that unit's update alone.

The update's lifecycle crosses threads, so it is an explicit state machine; each state has one owner, the only
thread that moves it on (so a state is never changed under a thread that acts on it):

    caller side (main thread, or autograd's device thread)       host worker thread (``_host_step.StepWorker``)
    IDLE / DONE --queue()--> QUEUED ----------------------------> GRAD_COPYING (waits for the gradient copy, the
                                                                   last host->device copy, SSD room)
                                                                  -> UPDATING (under the step lock)
    DONE <--------------------------------------------------------  ok
    FAILED <------------------------------------------------------  raised (in any worker state)
    FAILED --wait_ready() raises the error--> IDLE

A move not in :data:`TRANSITIONS` raises :class:`IllegalTransition` naming the shard and both states.

The widening of a compute-dtype gradient is no update: it runs once per copy, under ``_widen_lock``, by whichever of
the worker (a task queued ahead of every update) and the end of backward (main thread) comes first; the other
finds it done (or waits for it under the lock).

Lifetimes are held by events, never ``record_stream``: the optimizer step waits for the last host-to-device copy
that read ``compute_buf``/``flat`` before it writes them again, and the end of backward waits for the gradient
copies before ``flat.grad`` is read by anybody.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from shardfuse._streams import record_event, use_stream
from shardfuse._torch_private import foreach_norm

logger = logging.getLogger(__name__)

# Pinned memory allocated by torch's caching host allocator is rounded up to a power of two (a 450 MB shard takes
# 512 MiB, a 540 MB one 1 GiB); registering plain memory with the driver pins exactly what is asked for.


def host_buffer(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """An uninitialised host tensor of ``numel`` elements, page-locked (registered, not rounded) when ``pin``."""
    t = torch.empty(numel, dtype=dtype)
    if pin and numel and torch.cuda.is_available():
        nbytes = t.numel() * t.element_size()
        err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0)
        if int(err) != 0:  # e.g. the locked-memory limit: fall back to the caching allocator's pinned memory
            return torch.empty(numel, dtype=dtype, pin_memory=True)
        ptr = t.data_ptr()
        weakref.finalize(t.untyped_storage(), torch.cuda.cudart().cudaHostUnregister, ptr)
    return t


class UpdateState(enum.Enum):
    """Where the overlapped update of one host shard is (see the module's diagram)."""

    IDLE = "idle"  # no update since the last error was raised (or ever)
    QUEUED = "queued"  # queued on the worker by step() (or, step_in_backward, by the gradient copy)
    GRAD_COPYING = "grad_copying"  # taken by the worker: waiting for the copies into and out of its buffers
    UPDATING = "updating"  # the optimizer step and the compute-dtype copy run (under the step lock)
    DONE = "done"  # the last update finished
    FAILED = "failed"  # the last update raised; the error waits for the next caller of wait_ready()


IN_FLIGHT = frozenset({UpdateState.QUEUED, UpdateState.GRAD_COPYING, UpdateState.UPDATING})
TRANSITIONS: dict[UpdateState, frozenset[UpdateState]] = {
    UpdateState.IDLE: frozenset({UpdateState.QUEUED}),
    UpdateState.DONE: frozenset({UpdateState.QUEUED}),
    UpdateState.QUEUED: frozenset({UpdateState.GRAD_COPYING, UpdateState.FAILED}),
    UpdateState.GRAD_COPYING: frozenset({UpdateState.UPDATING, UpdateState.FAILED}),
    UpdateState.UPDATING: frozenset({UpdateState.DONE, UpdateState.FAILED}),
    UpdateState.FAILED: frozenset({UpdateState.IDLE}),
}


class IllegalTransition(RuntimeError):
    """A host shard's update was moved to a state its current state does not lead to."""


class UpdateLifecycle:
    """The state of one shard's update, its error, and the event callers block on (set while not in flight)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.state = UpdateState.IDLE
        self.error: BaseException | None = None  # set with FAILED, taken by take_error()
        self._lock = threading.Lock()  # makes check-and-move atomic (the caller side has two threads)
        self.settled = threading.Event()  # set iff the state is not in flight
        self.settled.set()

    def move(self, to: UpdateState, error: BaseException | None = None) -> None:
        """Move to ``to``; raise :class:`IllegalTransition` if the current state does not lead there."""
        with self._lock:
            came = self.state
            if to not in TRANSITIONS[came]:
                allowed = ", ".join(sorted(s.name for s in TRANSITIONS[came]))
                raise IllegalTransition(
                    f"host shard {self.name}: update state {came.name} -> {to.name} is not allowed (from {came.name} "
                    f"only {allowed}); an update was queued twice, or a state moved by the wrong thread")
            self.state = to
            if to is UpdateState.FAILED:
                self.error = error
            if to in IN_FLIGHT:
                self.settled.clear()
            else:
                self.settled.set()

    def take_error(self) -> BaseException | None:
        """FAILED -> IDLE, returning the error (None, and no move, in any other state)."""
        with self._lock:
            if self.state is not UpdateState.FAILED:
                return None
            err, self.error = self.error, None
            self.state = UpdateState.IDLE
            return err


@dataclass
class GradCopy:
    """The gradient on its way to the host (caller side: written by send_grad, read at the end of backward)."""

    target: torch.Tensor | None = None  # the buffer the in-flight copy writes (None: no copy in flight)
    # The gradient's L2 norm on the device, per reduction (invalid once accumulated on the host: that sum's norm
    # is computed on the host when asked for).
    norm: torch.Tensor | None = None
    norm_valid: bool = False


@dataclass
class HostStats:
    """Seconds for ``OffloadOptimizer.host_stats``."""

    waited_s: float = 0.0  # callers blocked in wait_ready
    update_s: float = 0.0  # the worker updating this shard, its waits for copies left out
    grad_d2h_bytes: int = 0  # gradient bytes copied device -> host (send_grad, caller side)
    param_h2d_bytes: int = 0  # parameter bytes read for gathers (source_for_gather, main thread)


class HostShard:
    """Host buffers, gradient landing and the compute-dtype copy of one offloaded flat parameter."""

    def __init__(self, flat: torch.Tensor, compute_dtype: torch.dtype, pin: bool, name: str = "flat_param") -> None:
        numel = flat.numel()
        self.pin = pin
        self.grad_buf = host_buffer(numel, flat.dtype, pin)
        self.stage_buf: torch.Tensor | None = None  # made on the first accumulation only
        # fp32 compute copies nothing: the shard itself crosses to the GPU.
        self.compute_buf = None if compute_dtype == flat.dtype else host_buffer(numel, compute_dtype, pin)
        self.copy_version = -1  # flat._version when compute_buf was last written
        self.h2d_event: torch.cuda.Event | None = None  # the last host->device copy reading the host copy
        self.life = UpdateLifecycle(name)
        self.grad_copy = GradCopy()
        self.stats = HostStats()
        self.trace: Callable[[str], None] | None = None  # OffloadOptimizer.trace_host: this shard's event recorder
        # Set by OffloadOptimizer(accumulate_on_gpu=True): under no_sync the gathered compute-dtype parameters
        # stay on the GPU between micro-steps, so the host round trip happens once per optimizer step.
        self.keep_full_in_no_sync = False
        # Set by OffloadOptimizer(step_in_backward=True): called with the copy's event once this shard's gradient
        # copy is queued, to start its update while the rest of backward runs.
        self.on_grad_sent: Callable[[HostShard, torch.cuda.Event | None], None] | None = None
        # Set by OffloadOptimizer (keep_params_gib): the gathered compute-dtype parameters stay on the GPU from this
        # unit's forward to its backward, which then gathers nothing.
        self.keep_for_backward = False
        # Set by OffloadOptimizer: this shard takes the compute-dtype gradient where the reduction is exact in it
        # (see the module docstring), widened on the host; on_lowp_sent queues the widening on the worker.
        self.lowp_grads = False
        self.lowp_buf: torch.Tensor | None = None  # made on the first such gradient
        self.on_lowp_sent: Callable[[HostShard, torch.cuda.Event | None, int], None] | None = None
        self._widen_lock = threading.Lock()  # one widening per copy (worker or end of backward)
        self._widen_pending: int | None = None  # the copy into lowp_buf not widened yet (its number)
        self._copies = 0  # compute-dtype copies sent (numbers them)
        # Set by OffloadOptimizer (weakly: a shard must not keep its optimizer alive): its apply_pending_clip, which
        # settle_grad calls before a reader outside the update (torch.nn.utils.clip_grad_norm_) sees the gradient.
        self.pending_scale: weakref.WeakMethod | None = None

    # ----------------------------------------------------------------------------------------------
    # the update's lifecycle
    # ----------------------------------------------------------------------------------------------

    @property
    def in_flight(self) -> bool:
        """An update of this shard is queued or running."""
        return not self.life.settled.is_set()

    def queue(self) -> None:
        """Caller side, right before the update is submitted to the worker."""
        self.life.move(UpdateState.QUEUED)
        self.note("queued")

    def wait_ready(self) -> None:
        """Block until no optimizer step of this shard is in flight; re-raise what such a step raised."""
        if not self.life.settled.is_set():
            self.note("wait")
            start = time.perf_counter()
            self.life.settled.wait()
            self.stats.waited_s += time.perf_counter() - start
            self.note("waited")
        err = self.life.take_error() if self.life.state is UpdateState.FAILED else None
        if err is not None:
            raise RuntimeError(f"the overlapped optimizer step of an offloaded shard failed ({self.life.name}): "
                               f"{err}") from err

    # ----------------------------------------------------------------------------------------------
    # gradients: device -> host on the post-backward stream, landed at the end of backward
    # ----------------------------------------------------------------------------------------------

    def send_grad(self, flat: torch.Tensor, dest: torch.Tensor, stream: torch.cuda.Stream | None,
                  lowp: torch.Tensor | None = None) -> None:
        """Queue the copy of the reduced shard gradient ``dest`` (on the device) to the host on ``stream``.

        Runs on the post-backward stream right after the reduction; the squared norm for clipping is taken on
        the device from the same tensor, so clipping never reads the host gradients. ``lowp``: the same gradient
        in the compute dtype, given where ``dest`` is its exact fp32 cast; it crosses instead (half the bytes)
        when this shard takes such gradients and holds none to accumulate into (then ``lowp_buf`` is widened
        into ``grad_buf`` on the host: :meth:`widen_grad`).
        """
        self.wait_ready()  # the optimizer may still read grad_buf from the last step
        if self.grad_copy.target is not None:
            # A second reduction in one backward (a unit whose hook fired twice): land the first one now.
            if stream is not None:
                stream.synchronize()
            self.land_grad(flat)
        if self.on_grad_sent is not None and flat.grad is not None:
            raise RuntimeError(
                "OffloadOptimizer(step_in_backward=True) updates each unit as its gradient lands, so every synced "
                "backward must start from no gradient: call zero_grad(set_to_none=True) after each step (and step "
                "after each synced backward), or use step_in_backward=False to accumulate across backward passes"
            )
        narrow = lowp is not None and self.lowp_grads and flat.grad is None
        if narrow and lowp is not None:
            src, target = lowp, self._lowp_target(lowp.dtype)
        else:
            src, target = dest, (self.grad_buf if flat.grad is None else self._stage())
        with use_stream(stream):
            target.copy_(src, non_blocking=True)
            # Clipping's per-shard norm, taken on the device as torch.nn.utils' foreach path takes it on the
            # host (from the fp32 gradient either way); an accumulated gradient's norm is not this one's, so it is
            # computed on the host if asked.
            valid = flat.grad is None and dest.numel() > 0
            norm = foreach_norm([dest], 2.0)[0] if valid else None
        self.stats.grad_d2h_bytes += src.numel() * src.element_size()
        self.grad_copy = GradCopy(target, norm, valid)
        wanted = self.on_grad_sent is not None or (narrow and self.on_lowp_sent is not None)
        event = record_event(stream) if wanted else None
        if narrow and self.on_lowp_sent is not None:
            self.on_lowp_sent(self, event, self._copies)
        if self.on_grad_sent is not None:
            self.on_grad_sent(self, event)

    def _lowp_target(self, dtype: torch.dtype) -> torch.Tensor:
        """The compute-dtype landing buffer, marked as holding a copy to widen (caller side, no copy in flight:
        the last one was landed, so widened, at the end of its backward)."""
        if self.lowp_buf is None or self.lowp_buf.dtype != dtype:
            self.lowp_buf = host_buffer(self.grad_buf.numel(), dtype, self.pin)
        with self._widen_lock:
            self._copies += 1
            self._widen_pending = self._copies
        return self.lowp_buf

    def widen_grad(self, copy: int | None = None) -> None:
        """Widen the compute-dtype gradient in ``lowp_buf`` into the fp32 ``grad_buf`` (exact), once per copy,
        after that copy finished: the worker does it as the copy lands, the end of backward if the worker has not
        got to it (under the lock: it waits for a widening in progress or finds it done). ``copy``: only that
        copy's (a task queued for an earlier one finds nothing to do); None: whichever is pending."""
        with self._widen_lock:
            pending = self._widen_pending
            if pending is None or (copy is not None and copy != pending):
                return
            if self.lowp_buf is None:  # cannot happen: the copy was made into it
                raise RuntimeError(f"host shard {self.life.name}: a compute-dtype gradient is pending without "
                                   f"its landing buffer")
            self.grad_buf.copy_(self.lowp_buf)
            self._widen_pending = None
        self.note("widened")

    def widen_task(self, event: torch.cuda.Event | None, copy: int) -> Callable[[], None]:
        """The worker's job for one compute-dtype gradient: wait for its copy, widen it. A failure is logged and
        left to the end of backward, which widens it again on the main thread and raises there."""

        def run() -> None:
            try:
                if event is not None:
                    event.synchronize()
                self.widen_grad(copy)
            except BaseException as err:  # noqa: BLE001 - raised again by land_grad on the main thread
                logger.warning("widening the gradient of %s on the host worker failed (the end of backward widens "
                               "it again): %s", self.life.name, err)

        return run

    def _stage(self) -> torch.Tensor:
        if self.stage_buf is None:
            self.stage_buf = host_buffer(self.grad_buf.numel(), self.grad_buf.dtype, self.pin)
        return self.stage_buf

    def settle_grad(self) -> None:
        """Apply the clip coefficient the engine left to this shard's update (see ``pending_scale``), if any."""
        apply = self.pending_scale() if self.pending_scale is not None else None
        if apply is not None:
            apply()

    def land_grad(self, flat: torch.Tensor) -> None:
        """After the copies finished (the caller synchronised the post-backward stream): ``flat.grad`` holds the
        gradient, accumulated on the host when it already held one (as the plain offload path does)."""
        target, self.grad_copy.target = self.grad_copy.target, None
        if target is None:
            return
        if target is self.lowp_buf:
            self.widen_grad()  # done by the worker already, or now
            target = self.grad_buf
        if target is self.grad_buf or flat.grad is None:  # the staging buffer is used only when a gradient was held
            flat.grad = self.grad_buf if target is self.grad_buf else target.clone()
        else:
            self.settle_grad()  # the held gradient clipped before this backward: scaled before the sum, as in torch
            flat.grad.add_(target)

    # ----------------------------------------------------------------------------------------------
    # parameters: host -> device when the unit is gathered
    # ----------------------------------------------------------------------------------------------

    def note(self, kind: str) -> None:
        """Record an event of this shard's timeline when ``OffloadOptimizer.trace_host`` is on."""
        if self.trace is not None:
            self.trace(kind)

    def before_step(self, in_backward: bool) -> None:
        """Worker thread, before this shard's optimizer step (outside the step lock): nothing here (the SSD tier
        waits for room to keep the updated shard)."""

    def source_for_gather(self, flat: torch.Tensor) -> torch.Tensor:
        """What crosses to the device when the unit is gathered: the compute-dtype copy (refreshed if the shard
        was changed outside an optimizer step, e.g. by ``load_state_dict`` or ``summon_full_params``)."""
        self.wait_ready()
        if self.compute_buf is None:
            src = flat.detach()
        else:
            if self.copy_version != flat._version:
                self.sync_h2d()
                with torch.no_grad():
                    self.compute_buf.copy_(flat.detach())
                self.copy_version = flat._version
            src = self.compute_buf
        self.stats.param_h2d_bytes += src.numel() * src.element_size()
        return src

    def note_h2d(self, stream: torch.cuda.Stream | None) -> None:
        """Record the host->device copy just queued on ``stream`` (the next optimizer step waits for it)."""
        self.h2d_event = record_event(stream)

    def sync_h2d(self) -> None:
        """Block until the last host->device copy from this shard's host buffers has finished."""
        event, self.h2d_event = self.h2d_event, None
        if event is not None:
            event.synchronize()

    def write_compute_copy(self, flat: torch.Tensor) -> None:
        """After an optimizer step updated ``flat``: the compute-dtype copy follows it (worker thread)."""
        if self.compute_buf is not None:
            with torch.no_grad():
                self.compute_buf.copy_(flat.detach())
        self.copy_version = flat._version
