"""``capture_step``: a whole training step captured into CUDA graphs (one per input shape) and replayed.

A sharded step is host-bound at small batches: Python runs per unit (hooks, gathers, reductions) and about
a thousand kernels are launched one by one. Captured once, the step replays as one graph launch: forward and
backward with every hook, the side-stream all-gathers and reduce-scatters (NCCL), the Triton kernels,
gradient clipping and the optimizer step, with no host synchronisation.

Variable-length batches: a graph replays fixed shapes, so the step keeps one graph per input signature (each
tensor leaf's shape and dtype, each other leaf's value), captured the first time a signature comes (after one
eager step on it, which is that call's training step), up to ``max_graphs``; every graph captures into one
memory pool (``shardfuse/_capture_graph.py`` says why that is safe). Batches padded to a few lengths
(``shardfuse.pad_to_bucket``) keep the count small.

On the CPU (inputs on the host) there is nothing to capture: the step runs eagerly with the same contract
(warm-up steps at capture time, the same input checks, signature bookkeeping and refusals), so the CPU suite
tests it.

Releasing: a graph that captured NCCL collectives holds a reference on each communicator it used (NCCL counts
the graphs as persistent users of the communicator and drops the count only when the graph is destroyed), and
destroying or aborting the communicator waits for that count to reach zero. A captured step that is still alive
when ``torch.distributed.destroy_process_group()`` runs would keep the process waiting forever. So a
:class:`CapturedStep` releases its graphs on :meth:`CapturedStep.close`, on leaving its ``with`` block, when it is
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
from torch.utils._pytree import tree_flatten

from shardfuse._capture_graph import StepGraph, release_graphs
from shardfuse._graph_guard import CaptureError, preparing_capture

__all__ = ["CapturedStep", "capture_step", "close_all_captured_steps"]

_ON_NEW_SHAPE = ("error", "evict")


# Every captured step not yet closed, to close before the default process group is destroyed.
_OPEN: weakref.WeakSet[CapturedStep] = weakref.WeakSet()
_torch_destroy_process_group: Callable[..., Any] | None = None


def close_all_captured_steps() -> None:
    """Close every captured step that is still open (see :meth:`CapturedStep.close`)."""
    for step in list(_OPEN):
        step.close()


def _destroy_process_group(group: Any = None) -> None:
    """``torch.distributed.destroy_process_group``, after a garbage collection and closing the captured steps when
    the default group (and with it every group) is torn down.

    The collection frees what a finished run left in reference cycles (a wrapped model, its optimizer, a
    DeviceMesh): they hold process groups, and a gloo group kept alive into interpreter exit can abort the process
    ("terminate called without an active exception", docs/troubleshooting.md). Closing the steps: NCCL waits for
    the graphs that captured a communicator's collectives to be destroyed before it destroys the communicator."""
    from torch.distributed import distributed_c10d

    if group is None or group is distributed_c10d.GroupMember.WORLD:
        gc.collect()
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


def _describe(leaf: Any) -> str:
    if isinstance(leaf, torch.Tensor):
        return f"tensor{tuple(leaf.shape)} {leaf.dtype} on {leaf.device}"
    return repr(leaf)



def _describe_signature(leaves: list[Any]) -> str:
    return "(" + ", ".join(_describe(x) for x in leaves) + ")"


def _hashable(value: Any) -> Any:
    try:
        hash(value)
    except TypeError:
        return ("unhashable", type(value).__qualname__, repr(value))
    return value


def _signature(leaves: list[Any]) -> tuple:
    """What selects a graph: each tensor leaf's shape and dtype, each other leaf's value."""
    return tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else ("value", _hashable(x))
                 for x in leaves)


class CapturedStep:
    """A training step captured by :func:`capture_step`; call it with a batch to run one step.

    It keeps one CUDA graph per input signature (each tensor leaf's shape and dtype, each other leaf's value),
    at most ``max_graphs`` of them, all in one memory pool. A call with a kept signature copies the batch into
    that graph's static input buffers and replays it; a call with a new signature runs the step eagerly once
    (that call's training step) and captures the signature's graph for the next calls. On the host the step
    runs eagerly every call, with the same signature bookkeeping, bound and checks. A call returns what
    ``step_fn`` returned: on CUDA replays the same tensors every call, overwritten by the next call
    (``.item()`` or ``.clone()`` what you keep).

    :meth:`close` (or leaving ``with capture_step(...) as step:``) releases the graphs; so do garbage
    collection, interpreter exit and ``torch.distributed.destroy_process_group()``. A closed step refuses to run.
    """

    def __init__(self, step_fn: Callable[..., Any], example_inputs: tuple[Any, ...], warmup: int,
                 max_graphs: int = 8, on_new_shape: str = "error") -> None:
        leaves, self._spec = tree_flatten(example_inputs)
        self._kinds = [(x.device, x.requires_grad) if isinstance(x, torch.Tensor) else None for x in leaves]
        self._step_fn: Callable[..., Any] | None = step_fn
        self.max_graphs, self.on_new_shape = max_graphs, on_new_shape
        self.graphed = any(isinstance(x, torch.Tensor) and x.is_cuda for x in leaves)
        self.eager_peak_bytes: int | None = None
        self.captured_peak_bytes: int | None = None
        self.graph_pool_bytes: int | None = None
        self.replays = self.captures = self.evictions = 0
        self.closed = False
        # Kept signatures, least recently used first; their graphs on CUDA (None on the host).
        self._graphs: dict[tuple, StepGraph] = {}
        self._seen: dict[tuple, None] = {}
        self._release: weakref.finalize | None = None
        if self.graphed:
            self._device = next(x.device for x in leaves if isinstance(x, torch.Tensor) and x.is_cuda)
            self._pool = torch.cuda.graph_pool_handle()
            # Also at garbage collection and interpreter exit; holds the graphs, not this object.
            self._release = weakref.finalize(self, release_graphs, self._graphs, self._device)
            self._add_graph(_signature(leaves), leaves, warmup)
        else:
            with preparing_capture():
                for _ in range(warmup):
                    step_fn(*example_inputs)
            self._seen[_signature(leaves)] = None
            self.captures = 1
        _OPEN.add(self)

    @property
    def signatures(self) -> list[tuple]:
        """The input signatures kept (one graph each on CUDA), least recently used first: per input leaf, a
        tensor's ``(shape, dtype)`` or another leaf's ``("value", value)``."""
        return list(self._graphs if self.graphed else self._seen)

    def close(self) -> None:
        """Release the step: destroy its CUDA graphs and give back their memory pool (after any replay in
        flight finishes), so that the process group can be destroyed and the process exit. Idempotent; a closed
        step refuses to run. Also done on leaving ``with capture_step(...) as step:``, when the step is
        garbage-collected, at interpreter exit, and by ``torch.distributed.destroy_process_group()``. Every rank
        that captured must close before the communicators it used are destroyed."""
        if self.closed:
            return
        self.closed = True
        _OPEN.discard(self)
        if self._release is not None:
            self._release()
        self._step_fn = None
        self._seen.clear()

    def __enter__(self) -> CapturedStep:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check(self, inputs: tuple[Any, ...]) -> list[Any]:
        """The input leaves, after checking what every signature shares: the structure, which leaves are
        tensors, their device and requires_grad."""
        leaves, spec = tree_flatten(inputs)
        if spec != self._spec:
            raise CaptureError(
                f"shardfuse.capture_step: the step was captured for inputs structured as {self._spec}, got {spec}: "
                f"pass the same structure every call, or capture again for the new one"
            )
        for i, (leaf, kind) in enumerate(zip(leaves, self._kinds)):
            got = (leaf.device, leaf.requires_grad) if isinstance(leaf, torch.Tensor) else None
            if (got is None) != (kind is None) or (got is not None and got != kind):
                want = "a non-tensor value" if kind is None else f"a tensor on {kind[0]} with requires_grad={kind[1]}"
                has = "" if got is None else f" with requires_grad={got[1]}"
                raise CaptureError(
                    f"shardfuse.capture_step: input leaf #{i} is {_describe(leaf)}{has}, but the step was captured "
                    f"for {want}: shapes and dtypes may change from call to call (a graph per signature), the "
                    f"device, requires_grad and which inputs are tensors may not; pass it as the example inputs "
                    f"had it, or capture another step"
                )
        return leaves

    def _admit(self, signature: tuple, leaves: list[Any]) -> None:
        """Make room for a new signature: refuse it at the bound, or evict the least recently used one."""
        kept = self._graphs if self.graphed else self._seen
        if len(kept) < self.max_graphs:
            return
        if self.on_new_shape == "error":
            raise CaptureError(
                f"shardfuse.capture_step: a new input signature {_describe_signature(leaves)} would be graph "
                f"#{len(kept) + 1}, over max_graphs={self.max_graphs} (kept: {self.signatures}): pad batches to a "
                f"few fixed shapes (shardfuse.pad_to_bucket), raise max_graphs, or pass on_new_shape='evict' to "
                f"drop the least recently used graph"
            )
        oldest = next(iter(kept))
        if self.graphed:
            release_graphs({oldest: self._graphs.pop(oldest)}, self._device)
        else:
            del self._seen[oldest]
        self.evictions += 1

    def _add_graph(self, signature: tuple, leaves: list[Any], steps: int) -> Any:
        """Run ``steps`` eager steps on a new signature's batch, then capture its graph; returns the last
        eager step's outputs."""
        entry = StepGraph(leaves, self._spec)
        out = entry.eager(self._step_fn_or_raise(), steps, self._device)
        entry.capture(self._step_fn_or_raise(), self._device, self._pool)
        self._graphs[signature] = entry
        self.captures += 1
        self.eager_peak_bytes = max(self.eager_peak_bytes or 0, entry.eager_peak_bytes)
        self.captured_peak_bytes = max(self.captured_peak_bytes or 0, entry.captured_peak_bytes)
        self.graph_pool_bytes = (self.graph_pool_bytes or 0) + entry.pool_growth_bytes
        return out

    def _step_fn_or_raise(self) -> Callable[..., Any]:
        if self.closed or self._step_fn is None:
            raise CaptureError(
                "shardfuse.capture_step: this CapturedStep was closed (close(), the end of its with block, or "
                "torch.distributed.destroy_process_group()), which released its graphs: capture the step again "
                "with shardfuse.capture_step(step_fn, *example_inputs) (after init_process_group, if the group "
                "was destroyed)"
            )
        return self._step_fn

    def __call__(self, *inputs: Any) -> Any:
        """Run one step on ``inputs`` (the example inputs' structure; shapes and dtypes may differ)."""
        step_fn = self._step_fn_or_raise()
        leaves = self._check(inputs)
        signature = _signature(leaves)
        if signature in self._graphs:
            self._graphs[signature] = self._graphs.pop(signature)  # now the most recently used
        elif signature in self._seen:
            self._seen[signature] = self._seen.pop(signature)
        else:
            self._admit(signature, leaves)
            if self.graphed:
                return self._add_graph(signature, leaves, 1)
            self._seen[signature] = None
            self.captures += 1
        if not self.graphed:
            with preparing_capture():
                return step_fn(*inputs)
        self.replays += 1
        return self._graphs[signature].replay(leaves)


def capture_step(step_fn: Callable[..., Any], *example_inputs: Any, warmup: int = 3, max_graphs: int = 8,
                 on_new_shape: str = "error") -> CapturedStep:
    """Capture a whole training step into CUDA graphs, one per input shape; returns a :class:`CapturedStep`
    to call per batch.

    ``step_fn(*inputs)`` is the step: forward, backward, optional ``clip_grad_norm_``, ``optimizer.step()``
    (a torch optimizer built with ``capturable=True``) and ``zero_grad``; it may loop over micro-batches under
    ``no_sync()``. ``example_inputs`` (tensors, or lists/tuples/dicts of them) fix the structure, which leaves
    are tensors, their device and ``requires_grad``. ``warmup`` eager steps run first on the example inputs
    (real training steps: lazy init, communicators, kernel compilation and optimizer state happen there), then
    their graph is captured (not run).

    A call with another signature (a tensor leaf's shape or dtype, or another leaf's value) runs the step
    eagerly once on that batch (that call's step: the training sequence equals an eager loop's) and captures a
    graph for it; every graph shares one memory pool. At most ``max_graphs`` are kept: at a new signature
    beyond them ``on_new_shape="error"`` raises :class:`CaptureError` (pad batches to a few shapes:
    :func:`shardfuse.pad_to_bucket`), ``"evict"`` releases the least recently used graph first.

    With CUDA inputs the step is a CUDA graph: every call copies the batch into static buffers and replays it,
    without host synchronisation. Memory, in bytes, over the graphs captured: ``eager_peak_bytes`` (the highest
    peak of the eager steps measured: the last warm-up step, each new signature's step), ``captured_peak_bytes``
    (the highest peak of a capture, counted the same way) and ``graph_pool_bytes`` (what the shared pool keeps
    reserved); measuring them resets the device's peak-memory statistics. With host inputs it runs eagerly
    under the same contract.

    Raises :class:`CaptureError` for what a graph cannot replay: CPU offload (``move_params_to_cpu``,
    ``OffloadModel``), host synchronisation inside the step (the message names the line), a new signature past
    ``max_graphs``.
    """
    if not callable(step_fn):
        raise TypeError(f"capture_step needs a callable step_fn, got {type(step_fn).__name__}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
        raise ValueError(
            f"capture_step(warmup={warmup!r}): needs an int >= 1 (lazy init and optimizer state must exist before "
            f"capture; 3 is a good default)"
        )
    if isinstance(max_graphs, bool) or not isinstance(max_graphs, int) or max_graphs < 1:
        raise ValueError(
            f"capture_step(max_graphs={max_graphs!r}): needs an int >= 1, the number of input signatures (one "
            f"graph each) to keep; 8 is the default"
        )
    if on_new_shape not in _ON_NEW_SHAPE:
        raise ValueError(
            f"capture_step(on_new_shape={on_new_shape!r}): choose 'error' (refuse a new signature past "
            f"max_graphs) or 'evict' (release the least recently used graph)"
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
    return CapturedStep(step_fn, example_inputs, warmup, max_graphs, on_new_shape)
