"""``capture_step``: one whole training step captured into a CUDA graph and replayed.

A sharded step is host-bound at small batches: Python runs per unit (hooks, gathers, reductions) and about
a thousand kernels are launched one by one. Captured once, the step replays as one graph launch: forward and
backward with every hook, the side-stream all-gathers and reduce-scatters (NCCL), the Triton kernels,
gradient clipping and the optimizer step, with no host synchronisation.

On the CPU (inputs on the host) there is nothing to capture: the step runs eagerly with the same contract
(warm-up steps at capture time, the same input checks, the same refusals), so the CPU suite tests it.

Releasing: a graph that captured NCCL collectives holds a reference on each communicator it used (NCCL counts
the graphs as persistent users of the communicator and drops the count only when the graph is destroyed), and
destroying or aborting the communicator waits for that count to reach zero. A captured step that is still alive
when ``torch.distributed.destroy_process_group()`` runs would keep the process waiting forever. So a
:class:`CapturedStep` releases its graph on :meth:`CapturedStep.close`, on leaving its ``with`` block, when it is
garbage-collected, at interpreter exit, and when ``torch.distributed.destroy_process_group()`` tears down the
default group: importing shardfuse wraps that function (transparently while no captured step is open), so that
scripts that bind it with ``from torch.distributed import destroy_process_group`` after importing shardfuse get
the wrapper too.
"""

from __future__ import annotations

import functools
import gc
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from shardfuse._graph_guard import CaptureError, preparing_capture

_HOST_SYNC_HINTS = (
    "anything that waits for the GPU on the host inside the step (.item(), .cpu(), .tolist(), printing a "
    "tensor, Python control flow on a tensor's value, torch.cuda.synchronize()), tensors created on the host "
    "inside the step, or an optimizer without capturable=True"
)


# Every captured step not yet closed, to close before the default process group is destroyed.
_OPEN: weakref.WeakSet[CapturedStep] = weakref.WeakSet()
_torch_destroy_process_group: Callable[..., Any] | None = None


def _release_graph(graph: Any, device: torch.device) -> None:
    """Destroy a captured graph (and give back its private memory pool) once no replay of it is in flight."""
    torch.cuda.synchronize(device)
    graph.reset()


def close_all_captured_steps() -> None:
    """Close every captured step that is still open (see :meth:`CapturedStep.close`)."""
    for step in list(_OPEN):
        step.close()


def _destroy_process_group(group: Any = None) -> None:
    """``torch.distributed.destroy_process_group``, after closing the captured steps when the default group (and
    with it every group) is torn down: NCCL waits for the graphs that captured a communicator's collectives to be
    destroyed before it destroys the communicator."""
    from torch.distributed import distributed_c10d

    if group is None or group is distributed_c10d.GroupMember.WORLD:
        close_all_captured_steps()
    if _torch_destroy_process_group is None:  # pragma: no cover - installed before it can be called
        raise RuntimeError("shardfuse: torch.distributed.destroy_process_group was not wrapped")
    _torch_destroy_process_group(group)


def _wrap_destroy_process_group() -> None:
    """Make ``torch.distributed.destroy_process_group`` close the open captured steps first; installed once, when
    this module is imported."""
    global _torch_destroy_process_group
    if _torch_destroy_process_group is not None or not torch.distributed.is_available():
        return
    from torch.distributed import distributed_c10d

    _torch_destroy_process_group = distributed_c10d.destroy_process_group
    wrapper = functools.wraps(_torch_destroy_process_group)(_destroy_process_group)
    torch.distributed.destroy_process_group = wrapper
    distributed_c10d.destroy_process_group = wrapper


_wrap_destroy_process_group()


def _capture_failed(err: BaseException) -> CaptureError:
    """The error for a failed capture: a failed capture also fails at its end, so the first error of the chain
    (the context) names the cause."""
    first = err
    while first.__context__ is not None and first.__context__ is not first:
        first = first.__context__
    cause = str(first).split("\n")[0]
    return CaptureError(
        f"shardfuse.capture_step could not capture the step ({type(first).__name__}: {cause}); common causes: "
        f"{_HOST_SYNC_HINTS}. Move host work out of step_fn, or run the step eagerly"
    )


def _describe(leaf: Any) -> str:
    if isinstance(leaf, torch.Tensor):
        return f"tensor{tuple(leaf.shape)} {leaf.dtype} on {leaf.device}"
    return repr(leaf)


class CapturedStep:
    """A training step captured by :func:`capture_step`; call it with a new batch to run one step.

    Calling it copies the batch into the static input buffers and replays the graph (CUDA), or runs the step
    eagerly (CPU). It returns what ``step_fn`` returned: on CUDA the same tensors every call, overwritten by
    the next call (``.item()`` or ``.clone()`` what you keep).

    :meth:`close` (or leaving ``with capture_step(...) as step:``) releases the graph; so do garbage collection,
    interpreter exit and ``torch.distributed.destroy_process_group()``. A closed step refuses to run.
    """

    def __init__(self, step_fn: Callable[..., Any], example_inputs: tuple[Any, ...], warmup: int) -> None:
        leaves, self._spec = tree_flatten(example_inputs)
        self._signature = [self._leaf_signature(x) for x in leaves]
        self._step_fn: Callable[..., Any] | None = step_fn
        self.graphed = any(isinstance(x, torch.Tensor) and x.is_cuda for x in leaves)
        self.eager_peak_bytes: int | None = None
        self.captured_peak_bytes: int | None = None
        self.graph_pool_bytes: int | None = None
        self.replays = 0
        self.closed = False
        self._graph: Any = None
        self._static: list[Any] = []
        self._outputs: Any = None
        self._release: weakref.finalize | None = None
        if self.graphed:
            self._capture(step_fn, leaves, warmup)
            # Also at garbage collection and interpreter exit; holds the graph, not this object.
            self._release = weakref.finalize(self, _release_graph, self._graph, self._device)
        else:
            with preparing_capture():
                for _ in range(warmup):
                    step_fn(*example_inputs)
        _OPEN.add(self)

    def close(self) -> None:
        """Release the step: destroy its CUDA graph and give back its memory pool (after any replay in flight
        finishes), so that the process group can be destroyed and the process exit. Idempotent; a closed step
        refuses to run. Also done on leaving ``with capture_step(...) as step:``, when the step is
        garbage-collected, at interpreter exit, and by ``torch.distributed.destroy_process_group()``. Every rank
        that captured must close before the communicators it used are destroyed."""
        if self.closed:
            return
        self.closed = True
        _OPEN.discard(self)
        if self._release is not None:
            self._release()
        self._graph = self._outputs = self._step_fn = None
        self._static = []

    def __enter__(self) -> CapturedStep:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def _leaf_signature(leaf: Any) -> tuple:
        if isinstance(leaf, torch.Tensor):
            return ("tensor", tuple(leaf.shape), leaf.dtype, leaf.device, leaf.requires_grad)
        return ("value", leaf)

    def _check(self, inputs: tuple[Any, ...]) -> list[Any]:
        leaves, spec = tree_flatten(inputs)
        if spec != self._spec:
            raise CaptureError(
                f"shardfuse.capture_step: the step was captured for inputs structured as {self._spec}, got {spec}: "
                f"pass the same structure every call, or capture again for the new one"
            )
        for i, (leaf, want) in enumerate(zip(leaves, self._signature)):
            got = self._leaf_signature(leaf)
            if got != want:
                what = "tensor" if want[0] == "tensor" else "value"
                raise CaptureError(
                    f"shardfuse.capture_step: input leaf #{i} is {_describe(leaf)}, but the step was captured for a "
                    f"{what} {want[1:] if what == 'tensor' else want[1]!r} (shape, dtype, device, requires_grad): a "
                    f"captured step replays fixed shapes and constants; pad the batch to the captured shape, or call "
                    f"capture_step again for the new one (a graph per shape)"
                )
        return leaves

    def _capture(self, step_fn: Callable[..., Any], leaves: list[Any], warmup: int) -> None:
        device = self._device = next(x.device for x in leaves if isinstance(x, torch.Tensor) and x.is_cuda)
        self._static = [x.detach().clone().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x
                        for x in leaves]
        args = tree_unflatten(self._static, self._spec)
        with preparing_capture():
            self._warm_up(step_fn, args, warmup, device)
            gc.collect()
            # The allocator counts what the capture allocates and frees like an eager step (replays allocate
            # nothing); the private pool the graph keeps is what memory_reserved grows by. torch.cuda.graph
            # empties the cache before capturing: so do we first, or the growth comes out short (even < 0).
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            reserved = torch.cuda.memory_reserved(device)
            self._graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(self._graph):
                    self._outputs = step_fn(*args)
            except CaptureError:
                raise
            except (RuntimeError, AssertionError) as err:
                # What torch raises for work a stream capture cannot record (CUDA errors such as "operation not
                # permitted when stream is capturing", an optimizer's capturable assertion), re-raised with the
                # fix; the step's own errors already surfaced in the eager warm-up.
                raise _capture_failed(err) from err
            self.captured_peak_bytes = torch.cuda.max_memory_allocated(device)
            self.graph_pool_bytes = torch.cuda.memory_reserved(device) - reserved

    def _warm_up(self, step_fn: Callable[..., Any], args: Any, warmup: int, device: torch.device) -> None:
        """The warm-up steps on a side stream (lazy init, NCCL communicators, Triton compilation, optimizer
        state), so nothing of it lands in the capture; the last step measures the eager peak."""
        main = torch.cuda.current_stream(device)
        side = torch.cuda.Stream(device=device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            for i in range(warmup):
                if i == warmup - 1:
                    torch.cuda.synchronize(device)
                    torch.cuda.reset_peak_memory_stats(device)
                step_fn(*args)
            torch.cuda.synchronize(device)
            self.eager_peak_bytes = torch.cuda.max_memory_allocated(device)
        main.wait_stream(side)
        torch.cuda.synchronize(device)

    def __call__(self, *inputs: Any) -> Any:
        """Run one step on ``inputs`` (same structure, shapes and dtypes as the example inputs)."""
        if self.closed or self._step_fn is None:
            raise CaptureError(
                "shardfuse.capture_step: this CapturedStep was closed (close(), the end of its with block, or "
                "torch.distributed.destroy_process_group()), which released its graph: capture the step again with "
                "shardfuse.capture_step(step_fn, *example_inputs) (after init_process_group, if the group was "
                "destroyed)"
            )
        leaves = self._check(inputs)
        if not self.graphed:
            with preparing_capture():
                return self._step_fn(*inputs)
        for static, new in zip(self._static, leaves):
            if isinstance(static, torch.Tensor):
                static.detach().copy_(new, non_blocking=True)
        self._graph.replay()
        self.replays += 1
        return self._outputs


def capture_step(step_fn: Callable[..., Any], *example_inputs: Any, warmup: int = 3) -> CapturedStep:
    """Capture one whole training step into a CUDA graph; returns a :class:`CapturedStep` to call per batch.

    ``step_fn(*inputs)`` is the step: forward, backward, optional ``clip_grad_norm_``, ``optimizer.step()``
    (a torch optimizer built with ``capturable=True``) and ``zero_grad``; it may loop over micro-batches under
    ``no_sync()``. ``example_inputs`` (tensors, or lists/tuples/dicts of them) fix the shapes: later calls must
    match them. ``warmup`` eager steps run first on the example inputs (real training steps: lazy init,
    communicators, kernel compilation and optimizer state happen there), then the step is captured (not run).

    With CUDA inputs the step is a CUDA graph: every call copies the batch into static buffers and replays it,
    without host synchronisation. Memory, in bytes: ``eager_peak_bytes`` (the last warm-up step's peak),
    ``captured_peak_bytes`` (the captured step's, counted the same way) and ``graph_pool_bytes`` (what the
    graph's private pool keeps reserved); measuring them resets the device's peak-memory statistics. With host
    inputs it runs eagerly under the same contract.

    Raises :class:`CaptureError` for what a graph cannot replay: CPU offload (``move_params_to_cpu``,
    ``OffloadModel``), host synchronisation inside the step, a new input shape (capture again).
    """
    if not callable(step_fn):
        raise TypeError(f"capture_step needs a callable step_fn, got {type(step_fn).__name__}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
        raise ValueError(
            f"capture_step(warmup={warmup!r}): needs an int >= 1 (lazy init and optimizer state must exist before "
            f"capture; 3 is a good default)"
        )
    leaves, _ = tree_flatten(example_inputs)
    if not any(isinstance(x, torch.Tensor) for x in leaves):
        raise ValueError(
            "capture_step needs example inputs with at least one tensor (the batch the step is captured for), got "
            f"{[_describe(x) for x in leaves]}"
        )
    devices = {x.device.type for x in leaves if isinstance(x, torch.Tensor)}
    if len(devices) > 1:
        raise ValueError(
            f"capture_step: example inputs on {sorted(devices)}: put the batch on one device (the GPU to capture a "
            f"graph, the host to run eagerly)"
        )
    return CapturedStep(step_fn, example_inputs, warmup)
