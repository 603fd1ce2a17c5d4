"""``OffloadModel``: train an ``nn.Sequential`` larger than GPU memory by streaming slices from the host.

Drop-in for FairScale's ``fairscale.experimental.nn.OffloadModel``. The model is cut into slices of balanced
parameter count whose fp32 master weights live in pinned host memory; a slice is on the GPU only while it
computes, and the next one is copied in on a side stream meanwhile. See ``DESIGN.md`` ("Offload").
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, cast

import torch
from torch import nn
from torch.func import functional_call
from torch.utils._pytree import tree_map

from shardfuse._graph_guard import refuse_in_capture
from shardfuse._profiling import profiled
from shardfuse.offload._engine import Engine, GradBuffers, Loaded, Phase, Stashed, Step, make_optimizers
from shardfuse.offload._function import BlockCall, apply_block
from shardfuse.offload._microbatch import Packed
from shardfuse.offload._slices import Slice, partition
from shardfuse.sharding.core import _process_hooks

logger = logging.getLogger(__name__)

_CPU = torch.device("cpu")
_COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class _ParamRef:
    """Stands in for a saved tensor that is a view of a slice's parameter buffer (``recompute=False``)."""

    __slots__ = ("size", "stride", "offset")

    def __init__(self, t: torch.Tensor) -> None:
        self.size, self.stride, self.offset = t.shape, t.stride(), t.storage_offset()


class _ActRef:
    """Stands in for a saved activation parked in host memory (``offload_activations``): its index."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


# Saved activations smaller than this stay on the device: moving them costs more host time than it frees.
MIN_OFFLOAD_BYTES = 1 << 20


class _SliceCall(BlockCall):
    """One slice's forward call: loads the slice around the compute, sends its gradients home after."""

    def __init__(
        self,
        model: OffloadModel,
        s: Slice,
        step: Step,
        prev: _SliceCall | None,
        args: Packed,
        keep_after_forward: bool,
    ) -> None:
        super().__init__(
            args,
            recompute=model.checkpoint_activation,
            num_microbatches=model.num_microbatches,
            offload_inputs=True,
            rng_device=model.device,
            stats_module=s.chain,
        )
        self.engine: Engine = model._engine
        self.slices: list[Slice] = model._slices
        self.slice = s
        self.step = step
        self.prev = prev
        self.next: weakref.ref[_SliceCall] | None = None  # the call of the next slice (runs backward first)
        if prev is not None:
            prev.next = weakref.ref(self)
        self.keep = keep_after_forward
        # the last slice's backward follows its forward at once: its activations stay on the device
        self.offload_acts = model.offload_activations and not keep_after_forward
        self._act_index: dict[tuple[Any, ...], tuple[int, weakref.ref]] = {}
        self.current: Loaded | None = None
        self.leaves: list[torch.Tensor] = []  # the parameters as leaves viewing ``current``'s slot
        self.grads: GradBuffers | None = None
        self._fwd_storage: int | None = None
        self._fwd_stamp: tuple[int, int] | None = None

    def describe(self) -> str:
        return f"OffloadModel slice {self.slice.index} (layers {self.slice.start} to {self.slice.stop - 1})"

    def graph_retained(self) -> bool:
        # The next slice's backward ran just before this one, in the same backward call: its Kept is gone
        # exactly when torch freed its saved tensors, i.e. when the graph is not retained.
        nxt = self.next() if self.next is not None else None
        return nxt is None or nxt.peek() is not None

    def _resident(self) -> Loaded:
        """The slice's device copy; only there between ``*_enter`` and ``*_exit``."""
        if self.current is None:
            raise RuntimeError(
                f"{self.describe()} is not resident on {self.engine.device}: its parameters and restored "
                "activations exist only during its forward and backward (shardfuse internal error; please report)"
            )
        return self.current

    def run(self, *args: Any) -> Any:
        self._resident()
        return functional_call(self.slice.chain, dict(zip(self.slice.names, self.leaves)), args)

    def forward_enter(self) -> None:
        if self.offload_acts and self.prev is not None and self.prev.prev is not None:
            # Bound the activations on the device to about three slices' worth: the device copies are
            # freed only once their device->host copy is done, and the host would run ahead of the bus.
            self.prev.prev.wait_parked()
        # the last slice stays for its backward, which comes next: loaded for it at once (with its master)
        self.current = self.engine.acquire(self.slice, Phase.FORWARD, for_backward=self.keep)
        self._fwd_stamp = self.current.stamp
        nxt = self.slice.index + 1
        if nxt < len(self.slices):
            self.engine.prefetch(self.slices[nxt], Phase.FORWARD, for_backward=nxt == len(self.slices) - 1)
        # recompute=False builds the graph now, so the parameters must be leaves that require grad
        self.leaves = self.current.leaves(requires_grad=not self.recompute)
        self._fwd_storage = self.current.slot.buf.untyped_storage().data_ptr()

    def forward_exit(self) -> None:
        self.engine.release(self._resident(), keep=self.keep)
        self.current = None
        self._act_index = {}
        # Device tensors held for their copies home go once the compute stream waited for those copies, which
        # have finished by now: this slice's stashed input (copied while the slice computed) and what the
        # previous slice parked (copied while this one computed). Held until a query found the copy done,
        # they outlived the step's forward: the host runs ahead, so the last two inputs were still held through
        # backward (+2 activations at the peak, 4.28 -> 4.53 GiB on the offload bench).
        done = list(self.held().saved)
        prev_kept = self.prev.peek() if self.prev is not None else None
        if prev_kept is not None:
            done += prev_kept.acts
        self.engine.release_stashed(done)
        if not self.recompute:
            self.held().leaves = self.leaves  # the kept graph's leaves: alive exactly as long as that graph
        self.leaves = []

    def stash(self, t: torch.Tensor) -> Any:
        return self.engine.stash(t)

    def unstash(self) -> list[torch.Tensor]:
        return self._resident().inputs

    def saved_tensors_hooks(self) -> contextlib.AbstractContextManager:
        # The graph kept by recompute=False must not pin the parameter slot: saved views of it become
        # references that are resolved against whatever slot holds the slice again in backward. With
        # offload_activations, saved activations are parked in host memory and come back with the slice.
        def pack(t: torch.Tensor) -> Any:
            try:
                storage = t.untyped_storage().data_ptr() if t.device.type != "meta" else None
            except (RuntimeError, NotImplementedError):
                storage = None
            if storage is not None and storage == self._fwd_storage:
                return _ParamRef(t)
            if self.offload_acts and storage is not None and self._offloadable(t):
                return self._park(t)
            # Never the tensor itself: a tensor saved as the output of its own node (ReLU saves its result)
            # would hold that node through its grad_fn, a cycle through autograd's C++ graph that Python's
            # garbage collector cannot see. Only a non-retained backward, which frees each node's saved
            # tensors as it goes, broke it; a retained graph (the last slice's, retain_graph=True) leaked its
            # activations every step. A detached alias shares the memory and holds no graph.
            return t.detach()

        def unpack(x: Any) -> torch.Tensor:
            if isinstance(x, _ParamRef):
                return self._resident().slot.buf.as_strided(x.size, x.stride, x.offset)
            if isinstance(x, _ActRef):
                return self._resident().inputs[x.index]
            return x

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def _offloadable(self, t: torch.Tensor) -> bool:
        return t.device == self.engine.device and t.numel() * t.element_size() >= MIN_OFFLOAD_BYTES

    def _park(self, t: torch.Tensor) -> _ActRef:
        # One tensor is often saved twice (an activation's output and the next layer's input): copy it once.
        # The address alone does not identify it: a parked tensor's memory is freed and soon holds the next
        # activation of the same shape, so the entry remembers the tensor itself (weakly).
        key = (t.data_ptr(), t.dtype, tuple(t.shape), t.stride(), t._version)
        hit = self._act_index.get(key)
        if hit is not None and hit[1]() is t:
            return _ActRef(hit[0])
        acts = self.held().acts
        idx = len(acts)
        self._act_index[key] = (idx, weakref.ref(t))
        acts.append(self.engine.stash(t))
        return _ActRef(idx)

    def wait_parked(self) -> None:
        """Block the host until this call's parked activations have reached host memory."""
        kept = self.peek()
        for x in reversed(kept.acts if kept is not None else []):  # one d2h stream: the last copy ends last
            if isinstance(x, Stashed) and x.event is not None:
                x.event.synchronize()
                break

    def backward_stash(self) -> list[Any] | None:
        """What to bring back to the device with the slice for its backward (None: nothing)."""
        kept = self.held()
        if self.recompute:
            return kept.saved
        return kept.acts or None

    def backward_enter(self) -> None:
        if self.slice.stamp() != self._fwd_stamp:
            # what plain autograd reports as "modified by an inplace operation": the recompute or the kept
            # graph would silently use the new weights
            raise RuntimeError(
                f"{self.describe()}: its parameters were modified in place (an optimizer step or load_state_dict) "
                f"after the forward this backward belongs to (version {self._fwd_stamp} -> {self.slice.stamp()}); "
                "run the forward again after changing the weights. With optimizer_in_backward every backward steps "
                "the weights, so backpropagate through each forward only once"
            )
        self.engine.begin_backward(self.step)
        self.current = self.engine.acquire(self.slice, Phase.BACKWARD, self.backward_stash())
        prev = self.prev
        if prev is not None and prev.peek() is not None:
            self.engine.prefetch(prev.slice, Phase.BACKWARD, prev.backward_stash())
        if self.recompute:
            self.leaves = self.current.leaves(requires_grad=True)
        else:
            self.leaves = self.held().leaves
        if self.slice.trainable:
            self.grads = self.engine.grad_buffers(self.slice)
            # autograd accumulates in place into a .grad that already exists: the gradients of every
            # microbatch land in the flat buffer, ready for one device->host copy
            for leaf, g in zip(self.leaves, self.slice.views(self.grads.target)):
                if leaf.requires_grad:
                    leaf.grad = g

    def microbatch_backward_exit(self, index: int) -> None:
        if self.grads is not None:
            self.engine.accumulate_microbatch(self.grads)

    def backward_exit(self) -> None:
        ld = self._resident()
        for leaf in self.leaves:
            leaf.grad = None
        self.engine.finish_slice(ld, self.grads, self.step)
        self.current, self.leaves, self.grads = None, [], None


class OffloadModel(nn.Module):
    """Train an ``nn.Sequential`` whose weights live in host memory, streamed to ``device`` slice by slice.

    Args:
        model: the model, an ``nn.Sequential``. Its first layer receives all positional inputs of
            :meth:`forward`; every later layer receives the previous layer's output (one argument).
        device: where the slices compute (a CUDA device; CPU for CPU-only runs and tests).
        offload_device: where the weights live between uses; only the CPU is supported.
        num_slices: number of slices, balanced by parameter count (contiguous layer ranges).
        checkpoint_activation: keep only slice-boundary activations (in pinned host memory) and recompute
            each slice in backward, microbatch by microbatch. Without it, activations stay on the device.
        num_microbatches: split every batched input (dim 0) into this many microbatches per slice.
        compute_dtype: compute in this dtype (bf16/fp16). The fp32 master weights stay on the host, a host
            shadow in ``compute_dtype`` is what crosses the bus, and gradients come back as fp32 on the
            master parameters. Floating inputs are cast to it.
        optimizer_in_backward: ``factory(params) -> Optimizer``, called once per slice; that optimizer is
            stepped and zero_grad'ed on the device while the slice is resident in backward (optimizer state
            is kept on the host between steps). The master parameters then get no ``.grad``, and **the user
            must not step an optimizer of their own** (it would see no gradients).
        offload_activations: with ``checkpoint_activation=False``, park every activation autograd saves
            (of at least ``MIN_OFFLOAD_BYTES``) in pinned host memory as soon as it is made, and bring a
            slice's activations back with its parameters for its backward: no recompute and little device
            memory, for twice the activation bytes on the bus (copies overlap compute on side streams). The
            last slice keeps its activations (its backward comes next). Not with ``checkpoint_activation``.

    Parameters keep their names and identity (``"0.weight"``, ...): ``parameters()``, ``state_dict()`` and
    ``load_state_dict()`` work as on the original model, and any torch optimizer can step them on the host
    after ``backward()``. Buffers (e.g. batch-norm statistics) are small and stay on ``device``; the recompute
    of ``checkpoint_activation`` leaves running statistics alone (the forward updated them once per
    microbatch). ``backward(retain_graph=True)`` keeps what backward needs for a second backward, as with
    plain autograd.
    Do not move the model with ``.to()`` / ``.cuda()`` / ``.half()``: placement is this class's job.
    """

    def __init__(
        self,
        model: nn.Sequential,
        device: torch.device | str,
        offload_device: torch.device | str = _CPU,
        num_slices: int = 3,
        checkpoint_activation: bool = False,
        num_microbatches: int = 1,
        *,
        compute_dtype: torch.dtype | None = None,
        optimizer_in_backward: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None,
        offload_activations: bool = False,
    ) -> None:
        super().__init__()
        device, offload_device = _check_placement(model, device, offload_device)
        _check_options(num_slices, checkpoint_activation, num_microbatches, compute_dtype, optimizer_in_backward,
                       offload_activations)  # fmt: skip
        master_dtype = _master_dtype(model)
        layers = list(model.named_children())
        ranges = _slice_ranges(layers, num_slices)

        self.device = device
        self.offload_device = offload_device
        self.num_slices = num_slices
        self.checkpoint_activation = checkpoint_activation
        self.num_microbatches = num_microbatches
        self.compute_dtype = compute_dtype
        self.offload_activations = offload_activations
        for name, layer in layers:
            self.add_module(name, layer)
        with torch.no_grad():
            for m in self.modules():
                for k, b in m._buffers.items():
                    if b is not None:
                        m._buffers[k] = b.to(device)
        pin = device.type == "cuda"
        self._slices: list[Slice] = [Slice(i, a, layers[a:b], pin) for i, (a, b) in enumerate(ranges)]
        # a compute dtype other than the master's: a host shadow in that dtype is what crosses the bus
        lp_dtype = compute_dtype if compute_dtype is not None and compute_dtype != master_dtype else None
        if lp_dtype is not None:
            for s in self._slices:
                s.make_shadow(lp_dtype, pin)
        self._optimizers = make_optimizers(self._slices, optimizer_in_backward) if optimizer_in_backward else None
        _process_hooks.require_fused_versions()  # a fused optimizer's updates must change the slices' stamps
        self._engine = Engine(self._slices, device, lp_dtype or master_dtype, master_dtype, self._optimizers)
        logger.info(
            "OffloadModel: %d layers in %d slices %s, device=%s, checkpoint=%s, microbatches=%d, compute=%s",
            len(layers), num_slices, ranges, device, checkpoint_activation, num_microbatches, compute_dtype,
        )

    # ------------------------------------------------------------------ introspection
    @property
    def slice_ranges(self) -> list[tuple[int, int]]:
        """The ``[start, stop)`` layer range of each slice."""
        return [(s.start, s.stop) for s in self._slices]

    @property
    def optimizers(self) -> list[torch.optim.Optimizer | None]:
        """The per-slice optimizers made by ``optimizer_in_backward`` (empty without it)."""
        return list(self._optimizers or [])

    def __len__(self) -> int:
        return len(self._modules)

    def __getitem__(self, idx: int) -> nn.Module:
        """The layer at position ``idx``, as in the original ``nn.Sequential``."""
        # not children(): a layer that appears twice (a shared activation module) keeps both positions
        return cast(nn.Module, list(self._modules.values())[idx])

    def transfer_stats(self, reset: bool = False) -> dict[str, int]:
        """Bytes copied host->device (``"h2d"``) and device->host (``"d2h"``) so far; ``reset`` zeroes them."""
        stats = dict(self._engine.bytes_moved)
        if reset:
            self._engine.bytes_moved = {"h2d": 0, "d2h": 0}
        return stats

    def _apply(self, fn: Any, recurse: bool = True) -> OffloadModel:
        raise RuntimeError(
            "OffloadModel places its parameters itself (pinned host memory, streamed to the device): do not "
            "call .to()/.cuda()/.cpu()/.half()/.float() on it; pass device= and compute_dtype= to OffloadModel"
        )

    # ------------------------------------------------------------------ forward
    def _prepare_input(self, x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if x.is_floating_point() and self.compute_dtype is not None:
            return x.to(self.device, dtype=self.compute_dtype, non_blocking=True)
        return x.to(self.device, non_blocking=True)

    def forward(self, *inputs: Any) -> Any:
        """Run the model; with autograd enabled the result can be backpropagated as usual."""
        if not inputs:
            raise ValueError("OffloadModel.forward needs at least one input")
        refuse_in_capture(
            "an OffloadModel",
            "it moves each slice between host and GPU and waits for the copies every step; run it eagerly",
        )
        args: tuple[Any, ...] = tree_map(self._prepare_input, inputs)
        if not torch.is_grad_enabled():
            return self._forward_no_grad(args)
        step = self._engine.new_step()
        prev: _SliceCall | None = None
        n = len(self._slices)
        out: Any = None
        for i, s in enumerate(self._slices):
            packed = Packed(args)
            if s.trainable or any(t.requires_grad for t in packed.tensors):
                call = _SliceCall(self, s, step, prev, packed, keep_after_forward=i == n - 1)
                out = apply_block(call, packed.tensors)
                prev = call
            else:
                with torch.no_grad():
                    out = self._run_streamed(s, args)
            args = (out,)
        return out

    def _run_streamed(self, s: Slice, args: Sequence[Any]) -> Any:
        ld = self._engine.acquire(s, Phase.FORWARD)
        if s.index + 1 < len(self._slices):
            self._engine.prefetch(self._slices[s.index + 1], Phase.FORWARD)
        with profiled("shardfuse.offload:forward_compute"):
            out = functional_call(s.chain, dict(zip(s.names, ld.leaves(False))), tuple(args))
        with profiled("shardfuse.offload:forward_drop"):
            self._engine.release(ld)
        return out

    def _forward_no_grad(self, args: tuple[Any, ...]) -> Any:
        out: Any = None
        for s in self._slices:
            out = self._run_streamed(s, args)
            args = (out,)
        self._engine.idle()
        return out

    def extra_repr(self) -> str:
        return (
            f"device={self.device}, num_slices={self.num_slices}, slices={self.slice_ranges}, "
            f"checkpoint_activation={self.checkpoint_activation}, num_microbatches={self.num_microbatches}, "
            f"compute_dtype={self.compute_dtype}, offload_activations={self.offload_activations}"
        )

    def named_slices(self) -> Iterator[tuple[int, list[str]]]:
        """Each slice's index with the names of the layers it holds."""
        for s in self._slices:
            yield s.index, list(s.chain._modules)


def _check_device(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"device={device} but CUDA is not available: pass device=torch.device('cpu') for a CPU-only run"
            )
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return device
    if device.type != "cpu":
        raise ValueError(f"device={device} is not supported: OffloadModel computes on a CUDA device (or the CPU)")
    return device


def _check_placement(
    model: nn.Module, device: torch.device | str, offload_device: torch.device | str
) -> tuple[torch.device, torch.device]:
    """The model is a non-empty ``nn.Sequential``; the compute and offload devices are supported ones."""
    if not isinstance(model, nn.Sequential):
        raise TypeError(
            f"OffloadModel needs an nn.Sequential, got {type(model).__name__}: express the model as "
            "nn.Sequential(*layers), each layer taking the previous layer's output"
        )
    if len(model) == 0:
        raise ValueError("OffloadModel got an empty nn.Sequential: give it at least one layer")
    device = _check_device(device)
    offload_device = torch.device(offload_device)
    if offload_device.type != "cpu":
        raise ValueError(
            f"offload_device={offload_device} is not supported: weights are offloaded to host memory, "
            "pass offload_device=torch.device('cpu')"
        )
    return device, offload_device


def _check_options(
    num_slices: Any,
    checkpoint_activation: bool,
    num_microbatches: Any,
    compute_dtype: torch.dtype | None,
    optimizer_in_backward: Any,
    offload_activations: Any,
) -> None:
    """Refuse option values OffloadModel cannot honour, naming the value and what to pass instead."""
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(f"num_microbatches={num_microbatches!r} must be an int >= 1")
    if not isinstance(num_slices, int):
        raise TypeError(f"num_slices={num_slices!r} must be an int")
    if compute_dtype is not None and compute_dtype not in _COMPUTE_DTYPES:
        raise ValueError(f"compute_dtype={compute_dtype} is not supported: use one of {list(_COMPUTE_DTYPES)}")
    if not isinstance(offload_activations, bool):
        raise TypeError(f"offload_activations={offload_activations!r} must be a bool")
    if offload_activations and checkpoint_activation:
        raise ValueError(
            "offload_activations=True needs checkpoint_activation=False: checkpointing already keeps only "
            "the slice-boundary activations (in host memory) and recomputes the rest; pick one of the two"
        )
    if optimizer_in_backward is not None and not callable(optimizer_in_backward):
        raise TypeError(
            f"optimizer_in_backward must be a callable params -> Optimizer, got "
            f"{type(optimizer_in_backward).__name__}: e.g. lambda ps: torch.optim.SGD(ps, lr=0.1)"
        )


def _master_dtype(model: nn.Module) -> torch.dtype:
    """The one floating dtype of every parameter (fp32 for a model without parameters)."""
    params = list(model.parameters())
    dtypes = sorted({str(p.dtype) for p in params})
    if len(dtypes) > 1 or any(not p.is_floating_point() for p in params):
        raise TypeError(
            f"OffloadModel needs all parameters in one floating dtype, got {dtypes}: convert the model "
            "first (e.g. model.float()) and use compute_dtype= for low-precision compute"
        )
    return params[0].dtype if params else torch.float32


def _slice_ranges(layers: Sequence[tuple[str, nn.Module]], num_slices: int) -> list[tuple[int, int]]:
    """Layer ranges of balanced parameter count; a parameter shared by two slices is refused."""
    ranges = partition([sum(p.numel() for p in m.parameters()) for _, m in layers], num_slices)
    owner: dict[int, int] = {}
    for i, (a, b) in enumerate(ranges):
        for _, m in layers[a:b]:
            for p in m.parameters():
                if owner.setdefault(id(p), i) != i:
                    raise ValueError(
                        f"a parameter of shape {tuple(p.shape)} is shared by slices {owner[id(p)]} and {i}: "
                        "tied weights must fall into one slice; change num_slices or untie them"
                    )
    return ranges
