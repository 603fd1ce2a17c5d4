"""The life of one sharded unit in a training step, in execution order.

1. forward (``pre_forward``, the wrapped module, ``post_forward``): gather the full parameters on the
   all-gather stream (and prefetch the next unit's), point the module's parameters at views of the full
   buffer, run the module, reshard (``reshard_after_forward``), hook the outputs for backward;
2. pre-backward (a hook on the outputs): gather again, prefetch the unit whose backward runs next;
3. post-backward (a hook on the full buffer's gradient accumulation): pre-divide/cast/pad, reduce-scatter and
   post-divide into ``flat.grad`` on the post-backward stream, reshard;
4. the root's final callback: reduce what no hook reduced, wait for the stream, return every unit to ``IDLE``.

A :class:`Unit` is the plain state object behind one ``FullyShardedDataParallel`` module; the units of one tree
share a :class:`RootState` (streams, the recorded forward order, backward bookkeeping) made at lazy init.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.autograd import Variable
from torch.utils import _pytree as pytree

from shardfuse._graph_guard import refuse_in_capture
from shardfuse._logging import warn_once
from shardfuse._profiling import profiled
from shardfuse._streams import Streams, use_stream, wait_stream
from shardfuse.sharding.core._config import ShardingConfig
from shardfuse.sharding.core._flat_param import BorrowedSlot, FlatParamHandle, ParamTable
from shardfuse.sharding.core._fp8_gather import refresh_scales
from shardfuse.sharding.core._fused_grads import materialize
from shardfuse.sharding.core._grad_reduce import (
    PendingFrees,
    ReduceConfig,
    finish_host_grads,
    flush_unsynced,
    reduce_grad,
)
from shardfuse.sharding.core._groups import Groups
from shardfuse.sharding.core._host_protocol import SavedActivations
from shardfuse.sharding.core._registry import iter_own_modules
from shardfuse.sharding.core._state import TrainingState, check_state

logger = logging.getLogger(__name__)

# Tensor attribute: the units that already hooked this output for backward (once per tensor and unit).
_HOOKED_ATTR = "_shardfuse_pre_backward_units"


def inside_backward() -> bool:
    """True while the autograd engine runs a backward (a checkpoint recompute calls forward from there)."""
    return torch._C._current_graph_task_id() != -1


def cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    """``tree`` with every floating tensor in it cast to ``dtype`` (autograd-aware)."""
    return pytree.tree_map_only(
        torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t, tree
    )


def refresh_float8_scales(rs: RootState) -> None:
    """At the root's forward: the float8 scales of every unit whose shard changed since the last step (the
    optimizer step, a load, a write), in one ``all_reduce(MAX)`` per process group (torchao's
    ``precompute_float8_dynamic_scale_for_fsdp``), on the all-gather stream ahead of the gathers."""
    if not rs.float8_handles:  # the common case, kept off the per-step path: no walk over every handle
        return
    stale = [s for h in rs.float8_handles if (s := h.stale_float8()) is not None]
    if not stale:
        return
    streams = rs.streams
    ag = streams.all_gather
    with profiled("shardfuse.sharding:refresh_float8_scales"):
        wait_stream(ag, streams.current())
        with use_stream(ag):
            refresh_scales(stale)


class RootState:
    """What the root shares with every unit of its tree: streams, the recorded order, backward bookkeeping."""

    def __init__(self, root: Unit, units: list[Unit], streams: Streams) -> None:
        self.root = root
        self.units = units
        self.streams = streams
        # Handles that gather float8 bytes: fixed at wrap time (flattening), before this state is made.
        self.float8_handles = [h for u in units for h in u.handles if h.fp8 is not None]
        self.fwd_order: list[Unit] = []
        self.order_recorded = False
        self.fwd_pos = 0
        self.prefetch_ok = False
        self.bwd_next: dict[int, Unit] = {}
        self.in_backward = False
        self.callback_queued = False
        self.pending = PendingFrees()
        # Set while units run outside the root's forward (e.g. generate()): no recording, no prefetch.
        self.order_paused = False

    def finish_recording(self) -> None:
        """Freeze the forward order and derive the backward prefetch order from it."""
        self.order_recorded = True
        seen: set[int] = set()
        seq: list[Unit] = []
        # Backward runs the root's hook first, then the other units in reverse forward order.
        for u in [self.root, *reversed(self.fwd_order)]:
            if id(u) not in seen:
                seen.add(id(u))
                seq.append(u)
        self.bwd_next = {id(a): b for a, b in zip(seq, seq[1:])}

    def forward_prefetch_target(self, unit: Unit) -> Unit | None:
        """The unit that ran after ``unit`` in the recorded forward order (None while recording/mismatched)."""
        if self.order_paused:
            return None
        pos = self.fwd_pos
        self.fwd_pos += 1
        if not self.order_recorded:
            self.fwd_order.append(unit)
            return None
        if not self.prefetch_ok:
            return None
        order = self.fwd_order
        if pos >= len(order) or order[pos] is not unit:
            self.prefetch_ok = False  # the order changed: stop prefetching for this pass
            return None
        return order[pos + 1] if pos + 1 < len(order) else None


class Unit:
    """The runtime state of one wrapped module: its flat parameter handles, phase and tree context."""

    def __init__(
        self,
        module: nn.Module,
        config: ShardingConfig,
        groups: Groups,
        handles: list[FlatParamHandle],
        param_table: ParamTable,
        borrowed: list[BorrowedSlot] | None = None,
    ) -> None:
        self.module = module
        self.config = config
        self.groups = groups  # shared with the handles and reduce_cfg: set_groups replaces the groups there
        self.handles = handles
        self.param_table = param_table
        # Parameters shared with sibling units that flattened them first: their handles are gathered (and
        # resharded) with this unit's own; the lender's post-backward hook reduces their gradients.
        self.borrowed = borrowed or []
        lent: dict[int, FlatParamHandle] = {id(b.handle): b.handle for b in self.borrowed}
        self.gather_handles = [*handles, *lent.values()] if lent else handles
        self.name = f"FullyShardedDataParallel({type(module).__name__})"
        self.training_state = TrainingState.IDLE
        self.is_root: bool | None = None
        self.parent: Unit | None = None  # the outermost unit that wraps this one (None for the top)
        self.released = False  # its module was wrapped again: the newer wrapper owns the parameters
        self.root_state: RootState | None = None
        # The top unit only: a weak reference to the OffloadOptimizer stepping this tree (_offload_optim.py), which
        # the state-dict, summon and clipping paths reach through the model the user holds. Weak: the optimizer
        # holds the model, and the model must not keep an optimizer the user dropped (and its worker) alive.
        self.host_engine: Callable[[], Any] | None = None
        # The top unit only: the parts of the storage tiers below host memory that keep this tree's shards (the SSD
        # tier's Tier, each owning its store: folder and I/O threads). Strong: the model owns them.
        self.lower_tiers: list[Any] = []
        # Every unit of a tree with activation offload: the host tier's ActivationOffload, which owns the step's
        # saved tensors (offload_activations); None: autograd keeps them on the device.
        self.saved_activations: SavedActivations | None = None
        self.require_backward_grad_sync = True
        self.require_all_reduce = True  # hybrid sharding: all-reduce across replicas (set_requires_all_reduce)
        self.reshard_after_forward = config.reshard.reshard_after_forward  # effective value, set at lazy init
        self.buffer_dtypes: dict[tuple[int, str], torch.dtype] = {}  # originals of cast buffers
        # FairScale: a size-1 group inside a larger tree (an expert) keeps its optimizer state local; lazy init
        # sets it for such units even when the flag was not passed.
        self.no_broadcast_optim_state = config.state_dict.no_broadcast_optim_state
        # Set at lazy init (_root.py), when the compute device is final.
        self.compute_device = torch.device("cpu")
        # The live divide factors (set_gradient_divide_factors); the reduce dtype is settled at lazy init.
        self.reduce_cfg = ReduceConfig(groups, *config.gradient.divide_factors())
        self.input_dtype = config.precision.input_dtype
        self._pre_backward_hook_fn = self.pre_backward  # one bound method: hooks compare equal, cheap to add

    def require_root_state(self) -> RootState:
        """The state the tree shares, made by the root's lazy init (its first forward)."""
        rs = self.root_state
        if rs is None:
            raise RuntimeError(
                f"{self.name} has no root state: it runs before its tree's lazy init (the root's first forward) "
                f"or after it was reset; run the root FullyShardedDataParallel's forward first"
            )
        return rs

    @property
    def rank(self) -> int:
        return self.groups.rank

    @property
    def world_size(self) -> int:
        return self.groups.world_size

    @property
    def trained_handles(self) -> int:
        """How many of the unit's flat parameters get gradients (reductions in flight per unit; at least 1)."""
        return max(1, sum(1 for h in self.handles if h.requires_grad))

    @property
    def gradient_predivide_factor(self) -> float:
        return self.reduce_cfg.predivide

    @property
    def gradient_postdivide_factor(self) -> float:
        return self.reduce_cfg.postdivide

    # ----------------------------------------------------------------------------------------------
    # pickling, groups
    # ----------------------------------------------------------------------------------------------

    def __getstate__(self) -> dict:
        # Streams and process groups do not pickle: the tree is initialised again on first use after the user
        # sets the groups (FairScale's convention), so pickling drops the runtime (Groups drops its groups).
        state = dict(self.__dict__)
        state["root_state"] = None
        state["host_engine"] = None  # the OffloadOptimizer stays with the original
        state["saved_activations"] = None  # so does the activation offload (its streams and pinned copies)
        state["is_root"] = None if self.parent is None else False
        # The tables keyed by id(module) would name the old process's objects: key them by the modules (pickle
        # restores those consistently) and by id again in __setstate__.
        modules = {id(m): m for _, m in iter_own_modules(self.module)}
        state["param_table"] = [(modules[k], v) for k, v in self.param_table.items() if k in modules]
        state["buffer_dtypes"] = [(modules[k], name, d) for (k, name), d in self.buffer_dtypes.items() if k in modules]
        return state

    def __setstate__(self, state: dict) -> None:
        # Units pickled before parameters could be shared across units borrow nothing.
        state.setdefault("borrowed", [])
        state.setdefault("host_engine", None)
        state.setdefault("lower_tiers", [])
        state.setdefault("saved_activations", None)
        state.setdefault("gather_handles", state["handles"])
        if isinstance(state.get("param_table"), list):
            state["param_table"] = {id(m): v for m, v in state["param_table"]}
        if isinstance(state.get("buffer_dtypes"), list):
            state["buffer_dtypes"] = {(id(m), name): d for m, name, d in state["buffer_dtypes"]}
        if state.get("reduce_cfg") is None:  # pickled before the divide factors had one home
            state["reduce_cfg"] = ReduceConfig(state["groups"], state.pop("gradient_predivide_factor"),
                                               state.pop("gradient_postdivide_factor"))
        state.pop("rank", None)
        state.pop("world_size", None)
        self.__dict__.update(state)
        for h in self.handles:  # one copy of the groups (older pickles gave each handle its own)
            h.groups = self.groups

    def set_groups(self, process_group: Any | None = None, reduce_scatter_group: Any | None = None) -> None:
        """Replace the process groups (e.g. after unpickling); they must hold the same ranks as before. The
        handles and the gradient reduction share :attr:`groups`, so they follow."""
        self.groups.replace(self.name, process_group, reduce_scatter_group)

    # ----------------------------------------------------------------------------------------------
    # gather / free
    # ----------------------------------------------------------------------------------------------

    def unshard(self) -> None:
        streams = self.require_root_state().streams
        for h in self.gather_handles:
            h.unshard(streams)

    def wait_and_set_views(self, set_views: bool = True) -> None:
        streams = self.require_root_state().streams
        for h in self.gather_handles:
            h.wait_full(streams)
            if set_views:
                h.set_views()

    def reshard(self) -> None:
        for h in self.gather_handles:
            h.reshard()

    def keeps_full(self, handle: FlatParamHandle) -> bool:
        """Under ``no_sync`` with ``OffloadOptimizer(accumulate_on_gpu=True)`` an offloaded shard's gathered
        parameters stay on the GPU between micro-steps (no host round trip until the step's last backward)."""
        host = handle.host
        return host is not None and host.keep_full_in_no_sync and not self.require_backward_grad_sync

    def reshard_unless_kept(self, after_forward: bool = False) -> None:
        """Free the full buffers but those kept under ``no_sync`` (:meth:`keeps_full`) and, ``after_forward`` with
        a backward possible (grad mode on), those of offloaded shards that keep their gathered parameters for
        backward (``OffloadOptimizer(keep_params_gib=...)``: backward then gathers nothing)."""
        for_backward = after_forward and torch.is_grad_enabled()
        for h in self.gather_handles:
            host = h.host
            if self.keeps_full(h) or (for_backward and host is not None and host.keep_for_backward):
                continue
            h.reshard()

    # ----------------------------------------------------------------------------------------------
    # 1. forward
    # ----------------------------------------------------------------------------------------------

    def pre_forward(self, args: tuple, kwargs: dict) -> tuple[tuple, dict, bool]:
        """Before the wrapped module runs: gather (and prefetch), cast the root's inputs, set the views.

        Returns the (possibly cast) inputs and whether this is an activation-checkpoint recompute inside
        backward, which :meth:`post_forward` must leave alone.
        """
        if self.config.offload.move_params_to_cpu:
            refuse_in_capture(
                f"{self.name} with move_params_to_cpu=True (cpu_offload)",
                "its shards and gradients live on the host, which every step synchronises with; train it eagerly, "
                "or keep the parameters on the GPU",
            )
        rs = self.require_root_state()
        if rs.in_backward:
            if inside_backward():
                return (*self._pre_recompute(args, kwargs), True)
            # The last backward raised (e.g. out of memory) before its final callback could run.
            warn_once(logger, "the previous backward did not finish (it raised); resetting the sharding state")
            rs.root.return_to_idle()
        check_state(
            self.training_state, (TrainingState.IDLE,), "forward()", self.name,
            "do not call a unit's forward from inside its own forward, summon_full_params() or backward",
        )
        cfg = self.config.precision
        self.training_state = TrainingState.FORWARD
        try:
            if self.is_root:
                rs.fwd_pos = 0
                rs.prefetch_ok = rs.order_recorded
                refresh_float8_scales(rs)
                if cfg.mixed_precision:
                    args, kwargs = cast_floats((args, kwargs), self.input_dtype)
            if cfg.force_input_to_fp32 and not cfg.mixed_precision:
                args, kwargs = cast_floats((args, kwargs), torch.float32)
            nxt = rs.forward_prefetch_target(self)
            self.unshard()
            if nxt is not None:
                with profiled("shardfuse.sharding:prefetch"):
                    nxt.unshard()
            for h in self.gather_handles:
                h.sync_requires_grad()
                h.step.forward_version = h.flat._version
            self.wait_and_set_views()
        except BaseException:
            self.training_state = TrainingState.IDLE
            raise
        return args, kwargs, False

    def post_forward(self, outputs: Any, recomputing: bool) -> Any:
        """After the wrapped module ran: reshard, hook the outputs for backward, back to ``IDLE``."""
        if recomputing:
            return outputs  # the full parameters stay for the backward that follows at once
        rs = self.require_root_state()
        try:
            if self.reshard_after_forward and not self._keep_full_for_backward():
                self.reshard_unless_kept(after_forward=True)
            if torch.is_grad_enabled():
                self._register_pre_backward_hooks(outputs)
        finally:
            self.training_state = TrainingState.IDLE
        if self.is_root and not rs.order_recorded:
            rs.finish_recording()
        if self.config.precision.clear_autocast_cache:
            torch.clear_autocast_cache()
        return outputs

    def abort_forward(self, recomputing: bool) -> None:
        """The wrapped module raised: leave the forward state (the full parameters are freed later)."""
        if not recomputing:
            self.training_state = TrainingState.IDLE

    def _keep_full_for_backward(self) -> bool:
        """The last unit of the recorded forward order is the first whose backward needs full parameters:
        freeing them now would only gather them again, with nothing to overlap, when backward starts."""
        rs = self.require_root_state()
        return torch.is_grad_enabled() and rs.prefetch_ok and bool(rs.fwd_order) and rs.fwd_order[-1] is self

    def _pre_recompute(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Forward during backward (activation checkpointing recompute): gather, keep params for backward."""
        with profiled("shardfuse.sharding:recompute_forward"):
            if self.training_state == TrainingState.IDLE:
                # Reentrant checkpointing runs the unit's backward without its pre-backward hook.
                self.training_state = TrainingState.BACKWARD_PRE
            if self.is_root and self.config.precision.mixed_precision:
                args, kwargs = cast_floats((args, kwargs), self.input_dtype)
            self.unshard()
            self.wait_and_set_views()
            return args, kwargs

    def _register_pre_backward_hooks(self, outputs: Any) -> None:
        key = id(self)
        for t in pytree.tree_leaves(outputs):
            if not isinstance(t, torch.Tensor) or not t.requires_grad:
                continue
            units = t.__dict__.get(_HOOKED_ATTR)
            if units is None:
                units = set()
                t.__dict__[_HOOKED_ATTR] = units
            if key in units:  # once per tensor and unit, however often it is returned
                continue
            units.add(key)
            t.register_hook(self._pre_backward_hook_fn)

    # ----------------------------------------------------------------------------------------------
    # 2. pre-backward
    # ----------------------------------------------------------------------------------------------

    def pre_backward(self, grad: torch.Tensor) -> None:
        """Hook on the unit's outputs: gather the full parameters for backward, prefetch the next unit's."""
        rs = self.require_root_state()
        with profiled("shardfuse.sharding:pre_backward"):
            self._check_unchanged_since_forward()  # before any state changes: the error leaves the tree usable
            if not rs.callback_queued:
                rs.callback_queued = True
                rs.in_backward = True
                Variable._execution_engine.queue_callback(rs.root.finish_backward)
            state = self.training_state
            if state == TrainingState.IDLE:
                self.training_state = TrainingState.BACKWARD_PRE
            elif state not in (TrainingState.BACKWARD_PRE, TrainingState.BACKWARD_POST):
                check_state(state, (TrainingState.IDLE, TrainingState.BACKWARD_PRE), "backward", self.name)
            if self.saved_activations is not None:  # first: its copies back overlap the gathers and this backward
                self.saved_activations.before_backward(self)
            # Idempotent: several outputs, several forwards and checkpoint recomputes all land here.
            self.unshard()
            if rs.order_recorded:
                nxt = rs.bwd_next.get(id(self))
                if nxt is not None and nxt.training_state == TrainingState.IDLE:
                    with profiled("shardfuse.sharding:prefetch"):
                        nxt.unshard()
            # The views autograd saved in forward share the full buffer's storage, restored in place. The
            # module attributes get fresh autograd-connected views too (grad mode is off inside backward):
            # an activation-checkpoint recompute inside the wrapped module reads them.
            with torch.enable_grad():
                self.wait_and_set_views()

    def _check_unchanged_since_forward(self) -> None:
        for h in self.gather_handles:
            seen = h.step.forward_version
            if seen is not None and h.flat._version != seen:
                raise RuntimeError(
                    f"the sharded parameters of {self.name} changed between its forward and its backward "
                    f"(version {seen} -> {h.flat._version}), e.g. optimizer.step() before "
                    f"loss.backward(): the gradients would not belong to the parameters the forward used; "
                    f"step the optimizer after backward"
                )

    # ----------------------------------------------------------------------------------------------
    # 3. post-backward
    # ----------------------------------------------------------------------------------------------

    def post_backward_fused(self, handle: FlatParamHandle) -> None:
        """Hook on the grad token (``_fused_grads.py``): the views' gradients of this backward pass go to the
        reduce-scatter input as they are where that is the old path's result; elsewhere they become the flat
        gradient ``AccumulateGrad`` would have made, and the old path runs on it."""
        stash, handle.step.fused = handle.step.fused, None
        if stash is None:
            return
        full_param = handle.made(handle.full_param)
        # Kept apart only for a fresh gradient reduced now by the device path: a second node's sum is already
        # flat; under no_sync (or onto a no_sync sum) the flat gradient must persist in full_param.grad; an
        # offloaded shard's reduction reads the flat gradient (exact_compute_dtype_grad, the host copies).
        if (isinstance(stash, torch.Tensor) or full_param.grad is not None or not self.require_backward_grad_sync
                or handle.host is not None):
            materialize(handle, full_param, stash)
            stash = None
        self.post_backward(handle, full_param, stash)

    def post_backward(self, handle: FlatParamHandle, full_param: torch.Tensor,
                      pieces: list[torch.Tensor | None] | None = None) -> None:
        """Hook on the full buffer's gradient: reduce-scatter it (or the views' gradients ``pieces``) into the
        shard's gradient, reshard."""
        with profiled("shardfuse.sharding:post_backward"):
            if self.training_state not in (TrainingState.BACKWARD_PRE, TrainingState.BACKWARD_POST) and not (
                # A handle lent to a sibling: the borrower's outputs alone may have led backward here.
                handle.lent and self.root_state is not None and self.root_state.in_backward
            ):
                raise RuntimeError(
                    f"the post-backward hook of {self.name} ran in state={self.training_state.name} "
                    f"without its pre-backward hook: backward reached the unit's parameters without going "
                    f"through its outputs (e.g. a tensor derived from a parameter view outside forward); "
                    f"compute the loss from the model's outputs"
                )
            self.training_state = TrainingState.BACKWARD_POST
            handle.step.fired = True
            rs = self.require_root_state()
            if self.require_backward_grad_sync:
                reduce_grad(handle, self.reduce_cfg, rs.streams, rs.pending, self.require_all_reduce, pieces,
                            keep=self.trained_handles)
            # Under no_sync the full gradient stays in full_param.grad and keeps accumulating.
            if not self.keeps_full(handle):
                handle.reshard()

    # ----------------------------------------------------------------------------------------------
    # 4. end of backward (root only)
    # ----------------------------------------------------------------------------------------------

    def finish_backward(self) -> None:
        """Root's final backward callback: flush reductions, reshard everything, return to IDLE."""
        rs = self.require_root_state()
        with profiled("shardfuse.sharding:wait_for_post_backward"):
            for u in rs.units:
                for h in u.handles:
                    # A group unused in this synced backward but holding no_sync gradients: reduce them now.
                    # (Usage must be the same on every rank, as in FairScale/FSDP2, or collectives mismatch.)
                    if not h.requires_grad or h.step.fired or not u.require_backward_grad_sync:
                        continue
                    if h.full_param is not None and h.full_param.grad is not None:
                        reduce_grad(h, u.reduce_cfg, rs.streams, rs.pending, u.require_all_reduce)
                    elif u.require_all_reduce:  # a gradient held back from the replica all-reduce: send it now
                        flush_unsynced(h, u.reduce_cfg, rs.streams, rs.pending)
            self.return_to_idle()

    def return_to_idle(self) -> None:
        """Root only: wait for issued reductions, reshard every unit and leave the backward bookkeeping."""
        rs = self.require_root_state()
        streams = rs.streams
        wait_stream(streams.current(), streams.post_backward)
        rs.pending.release_all()
        finish_host_grads(rs.pending, streams)
        for u in rs.units:
            for h in u.handles:
                kept = u.keeps_full(h)
                if not kept:
                    h.reshard()
                if h.step.grad_reduced:
                    h.grads_to_views()
                h.step.reset(keep_full=kept)
            if u.training_state in (TrainingState.BACKWARD_PRE, TrainingState.BACKWARD_POST):
                u.training_state = TrainingState.IDLE
        rs.in_backward = False
        rs.callback_queued = False
        if logger.isEnabledFor(logging.DEBUG):  # per-step record, off unless the user asks for DEBUG
            logger.debug("rank %d: backward finished, %d units back to IDLE, gradients reduced%s", self.rank,
                         len(rs.units), "" if self.require_backward_grad_sync else " (no_sync: kept full)")
