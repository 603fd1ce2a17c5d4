"""``capture_step``: one whole training step captured into a CUDA graph and replayed.

A sharded step is host-bound at small batches: Python runs per unit (hooks, gathers, reductions) and about
a thousand kernels are launched one by one. Captured once, the step replays as one graph launch: forward and
backward with every hook, the side-stream all-gathers and reduce-scatters (NCCL), the Triton kernels,
gradient clipping and the optimizer step, with no host synchronisation.

On the CPU (inputs on the host) there is nothing to capture: the step runs eagerly with the same contract
(warm-up steps at capture time, the same input checks, the same refusals), so the CPU suite tests it.
"""

from __future__ import annotations

import gc
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


def _describe(leaf: Any) -> str:
    if isinstance(leaf, torch.Tensor):
        return f"tensor{tuple(leaf.shape)} {leaf.dtype} on {leaf.device}"
    return repr(leaf)


class CapturedStep:
    """A training step captured by :func:`capture_step`; call it with a new batch to run one step.

    Calling it copies the batch into the static input buffers and replays the graph (CUDA), or runs the step
    eagerly (CPU). It returns what ``step_fn`` returned: on CUDA the same tensors every call, overwritten by
    the next call (``.item()`` or ``.clone()`` what you keep).
    """

    def __init__(self, step_fn: Callable[..., Any], example_inputs: tuple[Any, ...], warmup: int) -> None:
        leaves, self._spec = tree_flatten(example_inputs)
        self._signature = [self._leaf_signature(x) for x in leaves]
        self._step_fn = step_fn
        self.graphed = any(isinstance(x, torch.Tensor) and x.is_cuda for x in leaves)
        self.eager_peak_bytes: int | None = None
        self.captured_peak_bytes: int | None = None
        self.graph_pool_bytes: int | None = None
        self.replays = 0
        if self.graphed:
            self._capture(leaves, warmup)
        else:
            with preparing_capture():
                for _ in range(warmup):
                    step_fn(*example_inputs)

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

    def _capture(self, leaves: list[Any], warmup: int) -> None:
        device = next(x.device for x in leaves if isinstance(x, torch.Tensor) and x.is_cuda)
        self._static = [x.detach().clone().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x
                        for x in leaves]
        args = tree_unflatten(self._static, self._spec)
        main = torch.cuda.current_stream(device)
        side = torch.cuda.Stream(device=device)
        # Warm-up on a side stream (lazy init, NCCL communicators, Triton compilation, optimizer state), so
        # nothing of it lands in the capture; the last step measures the eager peak.
        with preparing_capture():
            side.wait_stream(main)
            with torch.cuda.stream(side):
                for i in range(warmup):
                    if i == warmup - 1:
                        torch.cuda.synchronize(device)
                        torch.cuda.reset_peak_memory_stats(device)
                    self._step_fn(*args)
                torch.cuda.synchronize(device)
                self.eager_peak_bytes = torch.cuda.max_memory_allocated(device)
            main.wait_stream(side)
            torch.cuda.synchronize(device)
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
                    self._outputs = self._step_fn(*args)
            except CaptureError:
                raise
            except (RuntimeError, AssertionError) as err:
                # What torch raises for work a stream capture cannot record (CUDA errors such as "operation not
                # permitted when stream is capturing", an optimizer's capturable assertion), re-raised with the
                # fix; the step's own errors already surfaced in the eager warm-up. A failed capture also fails at
                # its end: the first error (the context) names the cause.
                first = err
                while first.__context__ is not None and first.__context__ is not first:
                    first = first.__context__
                cause = str(first).split("\n")[0]
                raise CaptureError(
                    f"shardfuse.capture_step could not capture the step ({type(first).__name__}: {cause}); common "
                    f"causes: "
                    f"{_HOST_SYNC_HINTS}. Move host work out of step_fn, or run the step eagerly"
                ) from err
            self.captured_peak_bytes = torch.cuda.max_memory_allocated(device)
            self.graph_pool_bytes = torch.cuda.memory_reserved(device) - reserved

    def __call__(self, *inputs: Any) -> Any:
        """Run one step on ``inputs`` (same structure, shapes and dtypes as the example inputs)."""
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
