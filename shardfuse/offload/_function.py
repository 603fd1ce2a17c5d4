"""The offload checkpoint autograd Function, shared by ``OffloadModel`` slices and ``checkpoint_wrapper``.

One :class:`BlockCall` object describes one forward call of a block (an offload slice, or a module wrapped
by ``checkpoint_wrapper``) from its forward to the end of its backward. :class:`OffloadCheckpointFunction`
is the autograd node that runs it. Two modes:

* ``recompute=True``: the forward runs under ``no_grad`` and keeps only the block's inputs (optionally in
  host memory); backward recomputes the forward per microbatch with the CPU and CUDA RNG state (and
  autocast state) of the original forward restored, then backpropagates the matching chunk of the output
  gradient through the recomputed graph. The recompute does not update normalisation running statistics:
  the forward already did, as the plain module does once.
* ``recompute=False``: the forward builds the autograd graph per microbatch and keeps it (activations stay
  resident); backward runs it. Subclasses may replace saved tensors by tokens (saved-tensor hooks), which is
  how an offloaded slice avoids pinning its parameters into the graph.

Both modes split every batched input (tensor leaves with ``ndim >= 1``) along dim 0 into microbatches and
join the microbatch results with the chunked concat kernel.

What a call keeps for its backward (stashed inputs, kept graphs, parked activations) lives in a :class:`Kept`
that the autograd graph owns, as a tensor saved for backward: torch frees it right after the block's
backward unless ``retain_graph=True``, so a second backward works as with ``torch.utils.checkpoint``.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from shardfuse._profiling import profiled
from shardfuse.offload._microbatch import Packed, batch_size_of, join_batch, microbatch_sizes, split_batch
from shardfuse.offload._replay import (
    RngState,
    autocast_replay,
    capture_autocast,
    cuda_devices_of,
    rng_replay,
    running_stats_frozen,
)

CHECKPOINT_GRAD_ERROR = (
    "Checkpointing is not compatible with .grad() or backward(inputs=...): the block is recomputed inside "
    "backward and writes parameter gradients as a side effect; call loss.backward() instead"
)

SECOND_BACKWARD_ERROR = (
    "Trying to backward through {what} a second time, but what it saved for backward was freed by the first "
    "backward: pass retain_graph=True to the first backward() to backpropagate through the graph twice"
)


# ----------------------------------------------------------------------------------------- the block call


class Kept:
    """What one block call keeps from its forward for its backward; the autograd graph owns it."""

    __slots__ = ("saved", "inner", "acts", "leaves", "__weakref__")

    def __init__(self) -> None:
        self.saved: list[Any] = []  # stashed inputs for the recompute (recompute=True)
        self.inner: list[tuple[_GradSink, list[Any]]] = []  # per-microbatch graph and roots (recompute=False)
        self.acts: list[Any] = []  # activations parked in host memory by a subclass
        self.leaves: list[torch.Tensor] = []  # the kept graph's parameter leaves, for a subclass


class BlockCall:
    """One forward call of a block, carried to its backward by :class:`OffloadCheckpointFunction`.

    Subclasses override the ``*_enter`` / ``*_exit`` hooks (make parameters resident, release them, move
    gradients) and :meth:`run`; the base class does the microbatching, RNG replay and autograd plumbing.
    """

    profile_prefix = "shardfuse.offload"

    def __init__(
        self,
        args: Packed,
        *,
        recompute: bool,
        num_microbatches: int = 1,
        offload_inputs: bool = False,
        rng_device: torch.device | None = None,
        stats_module: nn.Module | None = None,
    ) -> None:
        self.args = args
        self.recompute = recompute
        self.num_microbatches = num_microbatches
        self.offload_inputs = offload_inputs
        self.rng_device = rng_device
        self.stats_module = stats_module  # whose running statistics the recompute must leave alone
        self.sizes: list[int] = [0]
        self.split_in: list[bool] = []
        self.grad_in: list[bool] = []
        self.out = Packed(None)  # the output's structure, taken from the first microbatch
        self.out_split: list[bool] = []
        self._rng: list[RngState] = []
        self._autocast: list[tuple[str, bool, torch.dtype]] = []
        # Held strongly until the graph takes it over (apply_block), then weakly: a call is referenced by its
        # graph node for as long as the graph lives, its Kept only until torch frees the saved tensors.
        self.kept: Kept | None = Kept()
        self._kept_ref: weakref.ref[Kept] | None = None
        self._one_shot = False  # the graph could not take Kept over: free it after the first backward

    # ---- what is kept for backward
    def peek(self) -> Kept | None:
        """What this call keeps for its backward, or None once it was freed."""
        if self.kept is not None:
            return self.kept
        return self._kept_ref() if self._kept_ref is not None else None

    def held(self) -> Kept:
        """What this call keeps for its backward; raises when a backward already freed it."""
        kept = self.peek()
        if kept is None:
            raise RuntimeError(SECOND_BACKWARD_ERROR.format(what=self.describe()))
        return kept

    def describe(self) -> str:
        """Names the block in error messages."""
        return f"a {self.profile_prefix} block"

    def graph_retained(self) -> bool:
        """Whether the backward running now keeps the graph (``retain_graph=True``); True when not known.

        Decides whether a kept graph (``recompute=False``) is run with ``retain_graph``: then it is freed
        with this call's :class:`Kept` right after the block's backward instead of node by node.
        """
        return True

    # ---- hooks for subclasses
    def run(self, *args: Any) -> Any:
        """Compute the block on one microbatch (the positional arguments of the block)."""
        raise NotImplementedError(f"{type(self).__name__} must define run(): how its block computes one microbatch")

    def forward_enter(self) -> None:
        """Called before the forward computes (make parameters resident)."""

    def forward_exit(self) -> None:
        """Called after the forward computed every microbatch."""

    def backward_enter(self) -> None:
        """Called when backward reaches the block, before any recompute."""

    def microbatch_backward_exit(self, index: int) -> None:
        """Called after the backward of microbatch ``index``."""

    def backward_exit(self) -> None:
        """Called after the backward of every microbatch (move gradients out, release parameters)."""

    def saved_tensors_hooks(self) -> contextlib.AbstractContextManager:
        """Saved-tensor hooks around the graph kept by ``recompute=False`` (none by default)."""
        return contextlib.nullcontext()

    def stash(self, t: torch.Tensor) -> Any:
        """Keep an input for the recompute; moved to host memory when ``offload_inputs``."""
        if self.offload_inputs and t.device.type != "cpu":
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
            host.copy_(t, non_blocking=True)
            return (host, t.device)
        return t

    def unstash(self) -> list[torch.Tensor]:
        """The stashed inputs, back on their devices."""
        out = []
        for s in self.held().saved:
            if isinstance(s, tuple):
                host, dev = s
                out.append(host.to(dev, non_blocking=True))
            else:
                out.append(s)
        return out

    # ---- forward
    def forward(self, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """Run the block on every microbatch; return the joined tensor leaves of its output."""
        batch = batch_size_of(tensors, "block inputs") if self.num_microbatches > 1 else None
        if self.num_microbatches > 1 and batch is None:
            raise ValueError(
                f"num_microbatches={self.num_microbatches} needs at least one input tensor with a batch dim "
                "(ndim >= 1); use num_microbatches=1"
            )
        self.sizes = microbatch_sizes(batch, self.num_microbatches) if batch is not None else [0]
        self.split_in = [t.dim() >= 1 for t in tensors]
        # Recorded now: the stashed copies brought back for the recompute are new tensors that no longer
        # know which inputs required grad.
        self.grad_in = [_wants_grad(t) for t in tensors]
        per_mb = [split_batch(t, self.sizes) for t in tensors]
        mbs = [[chunks[j] for chunks in per_mb] for j in range(len(self.sizes))]

        kept = self.held()
        self.forward_enter()
        if self.recompute:
            # stash before computing, so that a device->host copy overlaps the compute
            with profiled(f"{self.profile_prefix}:forward_drop"):
                kept.saved = [self.stash(t) for t in tensors]
        outs: list[list[torch.Tensor]] = []
        with profiled(f"{self.profile_prefix}:forward_compute"):
            if self.recompute:
                self._autocast = capture_autocast()
                rng_devs = cuda_devices_of(tensors, self.rng_device)
                with torch.no_grad():
                    for j, mb in enumerate(mbs):
                        self._rng.append(RngState.capture(rng_devs))
                        outs.append(self._flatten_out(self.run(*self.args.rebuild(mb)), j))
            else:
                with torch.enable_grad(), self.saved_tensors_hooks():
                    for j, mb in enumerate(mbs):
                        sink = _GradSink(mb, self.grad_in)
                        flat = self._flatten_out(self.run(*self.args.rebuild(sink.inputs)), j)
                        outs.append([o.detach() for o in flat])
                        # neither the microbatch inputs nor the outputs are kept: only the graph, its roots
                        # as gradient edges where torch can start backward from them
                        kept.inner.append((sink.detach_inputs(), _graph_roots(flat)))
                        del flat
        with profiled(f"{self.profile_prefix}:forward_drop"):
            self.forward_exit()
        with torch.no_grad():
            joined = [join_batch([o[k] for o in outs]) for k in range(len(outs[0]))]
        self.out_split = [len(outs) > 1 for _ in joined]
        # The call lives until backward (in ctx): holding the inputs or the first microbatch's outputs here
        # would keep every block's activations on the device, which is what recompute exists to avoid.
        self.args.drop_tensors()
        self.out.drop_tensors()
        return tuple(joined)

    def _flatten_out(self, out: Any, index: int) -> list[torch.Tensor]:
        packed = Packed(out)
        if index == 0:
            self.out = packed
        return packed.tensors

    # ---- backward
    def backward(self, grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Backpropagate ``grads`` (one per output tensor leaf); return one gradient per input tensor."""
        kept = self.held()  # before any side effect: a second backward without retain_graph raises here
        self.backward_enter()
        n_mb = len(self.sizes)
        grad_mbs = [self._split_grad(g, n_mb) for g in grads]
        in_grads: list[list[torch.Tensor | None]] = []
        if self.recompute:
            per_mb = [split_batch(t, self.sizes) for t in self.unstash()]
            for j in range(n_mb):
                detached = [_detach_for_grad(chunks[j], g) for chunks, g in zip(per_mb, self.grad_in)]
                with (
                    profiled(f"{self.profile_prefix}:backward_recompute"),
                    rng_replay(self._rng[j]),
                    autocast_replay(self._autocast),
                    running_stats_frozen(self.stats_module),
                    torch.enable_grad(),
                ):
                    outs = Packed(self.run(*self.args.rebuild(detached))).tensors
                with profiled(f"{self.profile_prefix}:backward_pass"):
                    _run_backward(outs, [g[j] for g in grad_mbs])
                in_grads.append([d.grad if d.requires_grad else None for d in detached])
                del outs, detached
                self.microbatch_backward_exit(j)
            del per_mb
        else:
            retain = self.graph_retained()
            for j, (sink, roots) in enumerate(kept.inner):
                with profiled(f"{self.profile_prefix}:backward_pass"):
                    _run_backward(roots, [g[j] for g in grad_mbs], retain_graph=retain)
                in_grads.append(sink.grads)
                sink.grads = [None] * len(sink.grads)  # a retained graph must not hold on to them
                self.microbatch_backward_exit(j)
        del kept
        self.backward_exit()
        if self._one_shot:
            self.kept = None
        with torch.no_grad():
            return [self._join_grad([g[k] for g in in_grads], self.split_in[k]) for k in range(len(self.split_in))]

    def _split_grad(self, g: torch.Tensor | None, n_mb: int) -> list[torch.Tensor | None]:
        if g is None or n_mb == 1:
            return [g] * n_mb
        if g.dim() == 0 or g.shape[0] != sum(self.sizes):
            raise ValueError(
                f"output gradient of shape {tuple(g.shape)} does not have the batch ({sum(self.sizes)} rows) as "
                "dim 0, so it cannot be split into microbatches: a block must keep the batch dim to use "
                "num_microbatches > 1"
            )
        return list(torch.split(g, self.sizes, dim=0))

    def _join_grad(self, parts: list[torch.Tensor | None], was_split: bool) -> torch.Tensor | None:
        present = [p for p in parts if p is not None]
        if not present:
            return None
        if len(parts) == 1:
            return parts[0]
        if not was_split:
            # a 0-dim input shared by every microbatch: its gradient is the sum over microbatches
            total = present[0].clone()
            for p in present[1:]:
                total += p
            return total
        if len(present) != len(parts):
            like = present[0]
            parts = [
                like.new_zeros((n, *like.shape[1:])) if p is None else p for p, n in zip(parts, self.sizes)
            ]
        return join_batch(parts)  # type: ignore[arg-type]


def _wants_grad(t: torch.Tensor) -> bool:
    return t.requires_grad and (t.is_floating_point() or t.is_complex())


def _detach_for_grad(t: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    return t.detach().requires_grad_(requires_grad)


def _run_backward(outs: Sequence[Any], grads: list[torch.Tensor | None], retain_graph: bool = False) -> None:
    """Backpropagate ``grads`` from ``outs``: tensors, gradient edges, or None for outputs without a graph."""
    pairs = [(o, g) for o, g in zip(outs, grads) if _has_graph(o) and g is not None]
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs], retain_graph=retain_graph)


def _has_graph(o: Any) -> bool:
    return o is not None and (not isinstance(o, torch.Tensor) or o.requires_grad)


# torch >= 2.7 starts backward from gradient edges, so a kept graph need not pin its output tensors
_EDGE_ROOTS = torch.torch_version.TorchVersion(torch.__version__) >= "2.7"


def _graph_roots(outs: list[torch.Tensor]) -> list[Any]:
    """What backward later starts from: gradient edges (or the tensors themselves on older torch)."""
    if not _EDGE_ROOTS:
        return [o if o.requires_grad else None for o in outs]
    return [torch.autograd.graph.get_gradient_edge(o) if o.requires_grad else None for o in outs]


class _GradSink:
    """Microbatch inputs entering a kept graph through :class:`_SinkFn`, which catches their gradients.

    A leaf that requires grad would do the same, but autograd's accumulator node keeps the leaf (and so the
    whole input activation) alive until backward; the sink keeps nothing but the gradients it receives.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], wants_grad: Sequence[bool]) -> None:
        self.grads: list[torch.Tensor | None] = [None] * len(tensors)
        self.inputs: list[torch.Tensor] = []
        dummy = torch.empty(0, requires_grad=True)
        for k, (t, g) in enumerate(zip(tensors, wants_grad)):
            self.inputs.append(_SinkFn.apply(self, k, dummy, t.detach()) if g else t.detach())

    def detach_inputs(self) -> _GradSink:
        """Drop the references to the inputs (called once the forward has used them)."""
        self.inputs = []
        return self


class _SinkFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, sink: _GradSink, k: int, dummy: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        ctx.sink, ctx.k = sink, k
        return t.view_as(t)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[None, None, None, None]:
        ctx.sink.grads[ctx.k] = g
        return None, None, None, None


class OffloadCheckpointFunction(torch.autograd.Function):
    """Autograd node of one :class:`BlockCall`, whose forward already ran (see :func:`apply_block`).

    ``dummy`` is a 0-element tensor that requires grad: it puts the node into the graph even when no input
    requires grad (the first block of a model, fed by data), so that backward reaches the block's parameters.
    ``token`` is saved for backward, and :func:`apply_block`'s saved-tensor hooks store the call's
    :class:`Kept` in its place, which hands its lifetime to torch.
    """

    @staticmethod
    def forward(
        ctx: Any,
        call: BlockCall,
        outs: list[torch.Tensor],
        dummy: torch.Tensor,
        token: torch.Tensor,
        *tensors: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        ctx.call = call
        ctx.save_for_backward(token)
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError(CHECKPOINT_GRAD_ERROR)
        in_grads = ctx.call.backward(grads)
        return (None, None, None, None, *in_grads)


def _hand_to_graph(stack: contextlib.ExitStack, token: torch.Tensor, kept: Kept) -> bool:
    """Saved-tensor hooks that save ``kept`` in place of ``token``; False where such hooks are disabled."""

    def pack(t: torch.Tensor) -> Any:
        return kept if t is token else t

    def unpack(x: Any) -> Any:
        return token if x is kept else x

    try:
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, unpack))
    except RuntimeError:  # torch.autograd.graph.disable_saved_tensors_hooks is in force
        return False
    return True


def apply_block(call: BlockCall, tensors: Sequence[torch.Tensor]) -> Any:
    """Run ``call``'s forward, put its :class:`OffloadCheckpointFunction` node into the graph, rebuild the output.

    The forward runs before the node is made (under ``no_grad``; a kept graph enables grad itself), so that
    the saved-tensor hooks around the node's creation see nothing but ``token``.
    """
    with torch.no_grad():
        outs = call.forward(tuple(tensors))
    kept = call.held()
    token = torch.empty(0)
    dummy = torch.empty(0, requires_grad=True)
    with contextlib.ExitStack() as stack:
        owned = _hand_to_graph(stack, token, kept)
        flat = OffloadCheckpointFunction.apply(call, list(outs), dummy, token, *tensors)
    if owned:
        call._kept_ref = weakref.ref(kept)
        call.kept = None
    else:
        call._one_shot = True
    return call.out.rebuild(flat)
