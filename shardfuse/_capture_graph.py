"""One CUDA graph of a captured step (one input signature): static inputs, eager steps, capture, replay, release.

Every graph of a :class:`shardfuse.CapturedStep` captures into the step's one memory pool
(``torch.cuda.graph_pool_handle()``). Between replays a graph's pool memory holds only what its step returns
and keeps (outputs; state the step allocates and keeps alive); the step's temporaries are free again, so the
next capture reuses them. The graphs never run at the same time (one stream, one call at a time), so a graph
may overwrite another's temporaries. The pool never shrinks while a graph of it lives: it grows to what the
captures needed, in the order they came.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import TreeSpec, tree_unflatten

from shardfuse._capture_errors import capture_failed
from shardfuse._graph_guard import CaptureError, preparing_capture


class StepGraph:
    """The captured step for one input signature: its static input buffers (what a call copies the batch
    into), the graph, the outputs the graph overwrites each replay, and the memory measured around it."""

    def __init__(self, leaves: list[Any], spec: TreeSpec) -> None:
        self.static = [x.detach().clone().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x
                       for x in leaves]
        self.args = tree_unflatten(self.static, spec)
        self.graph: Any = None
        self.outputs: Any = None
        self.eager_peak_bytes = 0
        self.captured_peak_bytes = 0
        self.pool_growth_bytes = 0

    def load(self, leaves: list[Any]) -> None:
        """Copy a batch into the static input buffers (queued on the stream, no host synchronisation)."""
        for static, new in zip(self.static, leaves):
            if isinstance(static, torch.Tensor):
                static.detach().copy_(new, non_blocking=True)

    def eager(self, step_fn: Callable[..., Any], steps: int, device: torch.device) -> Any:
        """``steps`` eager steps on the static inputs, on a side stream, so that lazy work (initialisation,
        communicators, kernel compilation and tuning for these shapes, optimizer state) stays out of the
        capture; the last one's peak memory is measured. Returns the last step's outputs."""
        main = torch.cuda.current_stream(device)
        side = torch.cuda.Stream(device=device)
        side.wait_stream(main)
        out = None
        with preparing_capture(), torch.cuda.stream(side):
            for i in range(steps):
                if i == steps - 1:
                    torch.cuda.synchronize(device)
                    torch.cuda.reset_peak_memory_stats(device)
                out = step_fn(*self.args)
            torch.cuda.synchronize(device)
            self.eager_peak_bytes = torch.cuda.max_memory_allocated(device)
        main.wait_stream(side)
        torch.cuda.synchronize(device)
        return out

    def capture(self, step_fn: Callable[..., Any], device: torch.device, pool: Any) -> None:
        """Capture one step (its GPU work is recorded, not run) into the shared ``pool``."""
        with preparing_capture():
            gc.collect()
            # The allocator counts what the capture allocates and frees like an eager step (replays allocate
            # nothing); what the pool grows by is what memory_reserved grows by. torch.cuda.graph empties the
            # cache before capturing: so do we first, or the growth comes out short (even < 0).
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            reserved = torch.cuda.memory_reserved(device)
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=pool):
                    outputs = step_fn(*self.args)
            except CaptureError:
                raise
            except (RuntimeError, AssertionError) as err:
                # What torch raises for work a stream capture cannot record (CUDA errors such as "operation not
                # permitted when stream is capturing", an optimizer's capturable check), re-raised with the
                # op, the step's line and the fix; the step's own errors already surfaced in the eager steps.
                raise capture_failed(err) from err
            self.graph, self.outputs = graph, outputs
            self.captured_peak_bytes = torch.cuda.max_memory_allocated(device)
            self.pool_growth_bytes = torch.cuda.memory_reserved(device) - reserved

    def replay(self, leaves: list[Any]) -> Any:
        """Copy the batch in, replay the graph; returns the static outputs (overwritten by the next replay)."""
        self.load(leaves)
        self.graph.replay()
        return self.outputs

    def reset(self) -> None:
        """Destroy the graph (the caller synchronised first) and drop what it kept in the pool."""
        if self.graph is not None:
            self.graph.reset()
        self.graph = self.outputs = None
        self.static, self.args = [], None


def release_graphs(graphs: dict[Any, StepGraph], device: torch.device) -> None:
    """Destroy every graph of ``graphs`` (and give their pool back) once no replay is in flight."""
    if graphs:
        torch.cuda.synchronize(device)
    for entry in graphs.values():
        entry.reset()
    graphs.clear()
