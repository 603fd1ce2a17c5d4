"""Flat parameters: one padded flat shard per (dtype, requires_grad, float8) group of a unit's own parameters.

A :class:`FlatParamHandle` owns

- ``flat``: the ``nn.Parameter`` the optimizer sees, this rank's 1/world_size shard (shard dtype, e.g. fp32);
- ``full_param``: a leaf tensor of the padded full size in the compute dtype whose storage is allocated only
  while the full parameters are gathered (``untyped_storage().resize_``); during forward the module's
  parameters are views of it, so autograd accumulates one flat full-size gradient into ``full_param.grad``.

Keeping the two tensors apart means neither ever changes dtype or shape, so autograd keeps a single gradient
accumulator for ``full_param`` across several forward passes, and ``flat.grad`` is always shard-shaped.

A float8 flat parameter (``fp8``, see ``_fp8_gather.py``) gathers float8 bytes instead while its shard is on the
compute device: ``full_param`` then only receives the gradient, its storage is never allocated.
"""

from __future__ import annotations

import functools
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shardfuse._profiling import profiled
from shardfuse._streams import Streams, record_event, use_stream, wait_event, wait_stream
from shardfuse.sharding.core import _collectives as coll
from shardfuse.sharding.core import _data_path as dp
from shardfuse.sharding.core._fp8_gather import Float8Gather
from shardfuse.sharding.core._fused_grads import Unflatten, requested_by_environment
from shardfuse.sharding.core._groups import MISSING_GROUP, Groups
from shardfuse.sharding.core._host_protocol import HostSide
from shardfuse.sharding.core._registry import (  # SHARD_MARK_KEY: re-exported for _dcp, _dcp_guard, _optim_state
    SHARD_MARK_ATTR,
    SHARD_MARK_KEY,
    flattened_into,
    register_handle,
)
from shardfuse.sharding.core._step_state import HandleStep

__all__ = ["SHARD_MARK_KEY", "BorrowedSlot", "FlatParamHandle", "ParamSlot", "ParamTable"]

def _reduce_orig_view(ref: weakref.ref[nn.Parameter], proto: int) -> tuple:
    """How an original-parameter view pickles: a meta parameter of its shape with its requires_grad and
    attributes, which the unpickled model replaces with a view of its unpickled shard."""
    v = ref()
    if v is None:  # the view pickles itself through this method: it is alive while it runs
        raise RuntimeError("an original-parameter view was freed while it was being pickled")
    state = {k: x for k, x in v.__dict__.items() if k != "__reduce_ex__"}
    meta = torch.empty(v.shape, dtype=v.dtype, device="meta")
    return torch._utils._rebuild_parameter_with_state, (meta, v.requires_grad, OrderedDict(), state)


@dataclass(frozen=True)
class ParamSlot:
    """One registration of an original parameter: ``module.<attr>`` is unique parameter ``index``."""

    module: nn.Module
    attr: str
    fqn: str  # name relative to the unit's wrapped module, e.g. "layers.0.weight"
    index: int


@dataclass(eq=False)
class BorrowedSlot:
    """A registration ``module.<attr>`` in a unit of a parameter another unit (the lender, a sibling) flattened:
    the lender's ``handle`` holds the shard and reduces the gradient; the borrower gathers that handle around its
    own forward and backward. ``fqn`` is relative to the borrower's wrapped module."""

    module: nn.Module
    attr: str
    fqn: str
    handle: FlatParamHandle
    index: int
    # The lending unit (a Unit) and the handle's index in it, found in the tree at lazy init.
    lender: Any = None
    lender_hi: int = -1


class FlatParamHandle:
    """One flat parameter group of a unit: sharded storage, the gathered full buffer and their views."""

    # True (the default): views made by the Unflatten node (_fused_grads.py), whose gradients go to the
    # reduce-scatter input without being concatenated first (the same bytes: tested on gloo and on NCCL, eager and
    # captured). False: torch.split_with_sizes, one flat gradient. Read at lazy init (init_full_buffer);
    # SHARDFUSE_FUSED_GRADS=0/1, when set, decides instead.
    fuse_grads = True

    def __init__(
        self,
        params: list[nn.Parameter],
        slots: list[ParamSlot],
        *,
        groups: Groups,
        shard_device: torch.device,
        pin: bool,
    ) -> None:
        """Flatten ``params`` (unique, one dtype and requires_grad) and keep this rank's shard.

        Args:
            params: the unique parameters of the group, in flattening order.
            slots: every registration of them (shared parameters appear more than once).
            groups: the unit's process groups (shared: ``set_groups`` on the unit reaches the handle too).
            shard_device: where the shard lives (the parameters' device, or CPU with move_params_to_cpu).
            pin: pin the CPU shard so host->device copies can run asynchronously.
        """
        self.groups = groups
        rank, world_size = groups.rank, groups.world_size
        self.shapes = [p.shape for p in params]
        self.numels = [p.numel() for p in params]
        self.slots = slots
        # Every module attribute that shows this handle's parameters: ``slots``, plus registrations in units
        # that borrow them (see lend()); the same list object as long as nothing is lent.
        self.attr_slots = slots
        self.names = [""] * len(params)
        for s in slots:  # the first registration names the parameter
            if not self.names[s.index]:
                self.names[s.index] = s.fqn
        self.requires_grad = params[0].requires_grad
        self.dtype = params[0].dtype
        self.numel = sum(self.numels)
        with torch.no_grad():
            full = dp.flatten_pad([p.detach() for p in params], world_size, dtype=self.dtype)
        self.padded_numel = full.numel()
        self.shard_numel = self.padded_numel // world_size
        # A fresh contiguous tensor: the full flattened buffer is released when this returns.
        shard = full.narrow(0, rank * self.shard_numel, self.shard_numel).clone()
        del full
        if shard.device != shard_device:
            shard = shard.to(shard_device)
        if pin and shard.device.type == "cpu" and torch.cuda.is_available():
            shard = shard.pin_memory()
        self.flat = nn.Parameter(shard, requires_grad=self.requires_grad)
        # Which shard an optimizer holds for this parameter, (rank, world_size) (see _setup.mark_optimizer_state);
        # None: not split. A tuple: the optimizer's load_state_dict keeps tuples of numbers as they are.
        self.shard_mark = (rank, world_size) if world_size > 1 else None
        setattr(self.flat, SHARD_MARK_ATTR, self.shard_mark)
        register_handle(self.flat, self)
        # Split sizes of the full buffer into parameters plus the padding tail (one SplitBackward node).
        self.split_sizes = [*self.numels, self.padded_numel - self.numel]
        # Set by init_full_buffer() (lazy init, once the compute device is final).
        self.full_param: torch.Tensor | None = None
        self.full_data: torch.Tensor | None = None  # alias of full_param with its own version counter
        self.grad_token: torch.Tensor | None = None  # see init_full_buffer
        self.compute_dtype = self.dtype
        self.step = HandleStep()  # per-step flags, apart from this fixed layout
        # Hybrid sharding under set_requires_all_reduce(False): this rank's reduce-scattered gradient sum, not yet
        # all-reduced across replicas (reduce dtype, before the post-divide); the next all-reduce carries it.
        self.unsynced_grad: torch.Tensor | None = None
        # While sharded, the original attributes are meta tensors: shape/dtype/`is None` checks (e.g. in
        # extra_repr) work, and reading data fails loudly instead of touching freed memory.
        self.placeholders = [torch.empty(s, dtype=self.dtype, device="meta") for s in self.shapes]
        self.clear_views()
        # use_orig_params: one nn.Parameter per original parameter, a 1-D view of this rank's piece of it in
        # ``flat`` (empty where the rank holds none of it); (offset in the shard, length) of each.
        self.orig_views: list[nn.Parameter] | None = None
        self.view_ranges: list[tuple[int, int]] = []
        # Host buffers of a shard stepped by an OffloadOptimizer (_host_shard.HostShard), else None.
        self.host: HostSide | None = None
        # Set by a StepInBackward: called on the post-backward stream as soon as a reduction has written the
        # resident ``flat.grad``; steps the shard and takes the gradient (returns True), or leaves it (False).
        self.grad_consumer: Callable[[FlatParamHandle], bool] | None = None
        # The float8 all-gather of float8 weights (use_float8), else None.
        self.fp8: Float8Gather | None = None

    def use_float8(self, marker: Any) -> None:
        """Gather this group's weights as float8 bytes (``marker``: see ``_fp8_gather.py``) while the shard is on
        the compute device."""
        modules: list[nn.Module | None] = [None] * len(self.shapes)
        for s in self.slots:
            if modules[s.index] is None:
                modules[s.index] = s.module
        self.fp8 = Float8Gather(marker, modules)
        self.fp8.set_pieces(self.numels, self.rank, self.shard_numel)

    @property
    def group(self) -> coll.ProcessGroup:
        """The process group the shard belongs to."""
        return self.groups.process_group

    @property
    def rank(self) -> int:
        return self.groups.rank

    @property
    def world_size(self) -> int:
        return self.groups.world_size

    # ----------------------------------------------------------------------------------------------
    # set-up
    # ----------------------------------------------------------------------------------------------

    def init_full_buffer(
        self, compute_dtype: torch.dtype, device: torch.device, on_grad: Callable[[torch.Tensor], None],
        on_fused: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        """Create the (unallocated) full buffer in ``compute_dtype`` on ``device``; ``on_grad(full_param)``
        runs once autograd has accumulated its gradient (the post-backward hook), ``on_fused(grad_token)`` once
        the views made by the Unflatten node received theirs (its post-backward hook; None: views by split)."""
        self.compute_dtype = compute_dtype
        full = torch.empty(self.padded_numel, dtype=compute_dtype, device=device)
        full.untyped_storage().resize_(0)
        full.requires_grad_(self.requires_grad)
        self.full_param = full
        # ``.data`` gives an alias with a separate version counter: writing gathered values through it does
        # not invalidate the views autograd saved for backward.
        self.full_data = full.data
        # The empty leaf every Unflatten node of this handle feeds (see _fused_grads.py): no memory, one hook.
        # Made only where that path is chosen (SHARDFUSE_FUSED_GRADS if set, else fuse_grads): views() follows it.
        self.grad_token = None
        from_env = requested_by_environment()
        if on_fused is not None and (self.fuse_grads if from_env is None else from_env):
            self.grad_token = torch.empty(0, dtype=compute_dtype, device=device, requires_grad=True)
            self.grad_token.register_post_accumulate_grad_hook(on_fused)
        self.step.reset()
        self._on_grad = on_grad
        self._hooked = False
        self._hook_if_trained()

    def _hook_if_trained(self) -> None:
        # A hook can only go on a tensor that requires grad; a frozen group gets it once it is unfrozen.
        if self.requires_grad and not self._hooked:
            self.made(self.full_param).register_post_accumulate_grad_hook(self._on_grad)
            self._hooked = True

    # ----------------------------------------------------------------------------------------------
    # original parameters as views of the shard (use_orig_params)
    # ----------------------------------------------------------------------------------------------

    def make_orig_views(self) -> list[nn.Parameter]:
        """The original parameters as 1-D views of this rank's piece of each in ``flat`` (they share its storage
        and version counter, so optimizer steps on them are steps on the shard); shaped like the parameters when
        there is one rank."""
        start = self.rank * self.shard_numel
        end = start + self.shard_numel
        base = self.flat.detach()
        self.view_ranges = []
        offset = 0
        for n in self.numels:
            lo, hi = max(offset, start), min(offset + n, end)
            self.view_ranges.append((lo - start, hi - lo) if hi > lo else (0, 0))
            offset += n
        # With one rank nothing is split: each view keeps its parameter's shape, as FairScale leaves unsharded
        # parameters (0-dim ones stay 1-D, so their per-element optimizer state never looks like a 0-dim "step").
        whole = self.world_size == 1
        # Views made again (after a move or cast, or unpickling) keep what was set on the old ones: a parameter
        # frozen on its own, attributes a user marked it with.
        old = self.orig_views if self.orig_views is not None and len(self.orig_views) == len(self.shapes) else None
        self.orig_views = [
            nn.Parameter(base.narrow(0, a, n).view(shape) if whole and len(shape) else base.narrow(0, a, n),
                         requires_grad=self.requires_grad if old is None else old[i].requires_grad)
            for i, ((a, n), shape) in enumerate(zip(self.view_ranges, self.shapes))
        ]
        for i, v in enumerate(self.orig_views):
            if old is not None:
                v.__dict__.update((k, x) for k, x in old[i].__dict__.items() if k != "__reduce_ex__")
            setattr(v, SHARD_MARK_ATTR, self.shard_mark)
            # Pickle cannot keep a view a view: it would write the whole shard's storage once per view, and load
            # tensors of their own. A view pickles as a meta placeholder instead (its requires_grad and attributes
            # kept), and the unpickled handle makes the views again from its shard (see __setstate__).
            # (Written into the instance dict, as an assignment would: the class's method stays.)
            v.__dict__["__reduce_ex__"] = functools.partial(_reduce_orig_view, weakref.ref(v))
            register_handle(v, self)
        return self.orig_views

    def follow_shard_dtype(self) -> None:
        """After ``.half()``/``.to(dtype)`` cast the shard (called resharded, with the runtime reset): the
        parameters have the shard's dtype now, so the computation (without mixed precision), state dicts and the
        placeholders follow it, as FairScale computes in the cast parameters' dtype."""
        dtype = self.flat.dtype
        if dtype == self.dtype:
            return
        self.dtype = dtype
        self.placeholders = [torch.empty(s, dtype=dtype, device="meta") for s in self.shapes]
        self.clear_views()

    def register_orig_views(self) -> None:
        """Register the original-parameter views where the parameters were (every registration, the borrowing
        siblings' too), after :meth:`make_orig_views` made them again."""
        views = self.orig_views
        if views is None:
            raise RuntimeError(f"{self.names[0]}: register_orig_views() before make_orig_views()")
        for slot in self.attr_slots:
            slot.module._parameters[slot.attr] = views[slot.index]

    def grads_from_views(self) -> None:
        """Before a reduction accumulates into ``flat.grad``: take over what the optimizer did to the views'
        gradients (``zero_grad(set_to_none=True)`` drops them, a user may assign new ones)."""
        g = self.flat.grad
        if self.orig_views is None or g is None:
            return
        if all(v.grad is None for v in self.orig_views):
            self.flat.grad = None  # a fresh gradient, not an accumulation
            return
        for v, (a, n) in zip(self.orig_views, self.view_ranges):
            piece = g.narrow(0, a, n)
            if v.grad is None:
                piece.zero_()
            elif v.grad.data_ptr() != piece.data_ptr():
                piece.copy_(v.grad.reshape(-1))

    def grads_to_views(self) -> None:
        """After a reduction: each trainable view's gradient is its piece of ``flat.grad``."""
        if self.orig_views is None:
            return
        g = self.flat.grad
        for v, (a, n) in zip(self.orig_views, self.view_ranges):
            v.grad = g.narrow(0, a, n).view(v.shape) if g is not None and v.requires_grad else None

    def sync_requires_grad(self) -> None:
        """Follow ``flat.requires_grad`` (a user may freeze the shard after wrapping), or with original
        parameters whether any of them trains: the full buffer, hence the module's parameter views, require a
        gradient exactly when the shard does."""
        if self.orig_views is not None:
            self.flat.requires_grad_(any(v.requires_grad for v in self.orig_views))
        wanted = self.flat.requires_grad
        if wanted != self.requires_grad:
            self.requires_grad = wanted
            if self.full_param is not None:
                self.full_param.requires_grad_(wanted)
                self._hook_if_trained()

    def lend(self, slot: ParamSlot) -> None:
        """Another unit's module registers parameter ``slot.index`` too (``slot.fqn`` is relative to that unit):
        its attribute follows this handle from now on, like the own registrations (views while gathered,
        placeholders while sharded; the original-parameter view registered where there is one)."""
        self.attr_slots = [*self.attr_slots, slot]
        shown = self.views()[slot.index] if self.step.is_full else self.placeholders[slot.index]
        slot.module.__dict__[slot.attr] = shown
        if self.orig_views is not None:
            slot.module._parameters[slot.attr] = self.orig_views[slot.index]

    @property
    def lent(self) -> bool:
        """Some parameter of this handle is registered in another unit's modules too."""
        return self.attr_slots is not self.slots

    def index_of(self, t: torch.Tensor) -> int | None:
        """The unique index of the parameter ``t`` stands for (its placeholder, its original-parameter view, what
        one of its attributes shows now, or the original parameter), or None."""
        found = flattened_into(t)
        if found is not None:
            return found[1] if found[0] is self else None
        for i, ph in enumerate(self.placeholders):
            if ph is t:
                return i
        for s in self.attr_slots:
            if s.module.__dict__.get(s.attr) is t or s.module._parameters.get(s.attr) is t:
                return s.index
        return None

    def __getstate__(self) -> dict:
        # The runtime (the full buffer and its post-backward hook, a pending gather) is dropped: lazy init makes
        # it again. The groups pickle without their process groups (Groups.__getstate__).
        state = dict(self.__dict__)
        for key in ("_on_grad", "_hooked"):
            state.pop(key, None)
        state.update(full_param=None, full_data=None, grad_token=None, step=HandleStep(), host=None,
                     unsynced_grad=None, grad_consumer=None)
        return state

    def __setstate__(self, state: dict) -> None:
        state.setdefault("attr_slots", state["slots"])  # pickled before sharing across units: nothing lent
        state.setdefault("host", None)
        state.setdefault("grad_consumer", None)
        state.setdefault("unsynced_grad", None)
        state.setdefault("fp8", None)
        state.setdefault("grad_token", None)
        if "groups" not in state:  # pickled before the groups were shared: the unit points it at its own
            state["groups"] = Groups(MISSING_GROUP, MISSING_GROUP, state.pop("rank"), state.pop("world_size"))
            state.pop("group", None)
        for key in ("is_full", "gathered_version", "forward_version", "ag_event", "fired", "grad_reduced"):
            state.pop(key, None)
        state.setdefault("step", HandleStep())
        self.__dict__.update(state)
        # The shard's link to this handle pickled as an empty set (HandleRef): link it again (clip_grad_norm_,
        # optimizer-state and borrowing look it up there).
        register_handle(self.flat, self)
        if self.orig_views is not None:
            # Pickle copied each original-parameter view into a tensor of its own, no longer a view of the
            # shard: make them again from it (the modules register them: FullyShardedDataParallel.__setstate__,
            # once the modules themselves are unpickled).
            self.make_orig_views()

    def made(self, full: torch.Tensor | None) -> torch.Tensor:
        """``full`` (``self.full_param`` or ``self.full_data``), made by :meth:`init_full_buffer` at lazy init."""
        if full is None:
            raise RuntimeError(
                f"the full buffer of the flat parameter holding {self.names[0]} is not made yet (or was dropped by "
                f".to()/.half()/pickling): it is made at the root's lazy init, its first forward"
            )
        return full

    @property
    def nbytes(self) -> int:
        """Bytes of the gathered full buffer."""
        return self.padded_numel * torch.empty((), dtype=self.compute_dtype).element_size()

    # ----------------------------------------------------------------------------------------------
    # gather / free
    # ----------------------------------------------------------------------------------------------

    def unshard(self, streams: Streams) -> None:
        """Issue the rebuild of the full parameters on the all-gather stream (idempotent).

        The shard is cast (or copied) straight into this rank's slice of the padded full buffer, which is
        then all-gathered in place. The compute stream must call :meth:`wait_full` before reading it.
        """
        host = self.host
        if host is not None:
            host.wait_ready()  # an optimizer step of this shard may be in flight on the host
        step = self.step
        if step.is_full and step.gathered_version == self.flat._version:
            return
        ag = streams.all_gather
        fp8 = self.fp8
        if fp8 is not None and self.gathers_float8():
            with profiled("shardfuse.sharding:all_gather_fp8"):
                wait_stream(ag, streams.current())
                with use_stream(ag):
                    fp8.gather(self.flat.detach(), self.padded_numel, self.rank, self.group, self.world_size)
                    step.ag_event = record_event(ag)
            step.is_full, step.float8 = True, True
            step.gathered_version = self.flat._version
            return
        step.float8 = False
        with profiled("shardfuse.sharding:all_gather"):
            # The all-gather stream waits for all compute queued so far: the optimizer's last writes to the
            # shard, and the last reads of any buffer freed to this stream's pool, which it may now reuse.
            wait_stream(ag, streams.current())
            with use_stream(ag):
                full_data = self.made(self.full_data)
                storage = full_data.untyped_storage()
                if storage.size() == 0:
                    storage.resize_(self.nbytes)
                local = full_data.narrow(0, self.rank * self.shard_numel, self.shard_numel)
                src = self.flat.detach() if host is None else host.source_for_gather(self.flat)
                if src.device != local.device and src.dtype == local.dtype:
                    local.copy_(src, non_blocking=True)  # the host copy is in the compute dtype already
                else:
                    if src.device != local.device:
                        src = src.to(local.device, non_blocking=True)
                    dp.cast_shard(src, local)
                if host is not None:
                    host.note_h2d(ag)
                coll.all_gather_into(full_data, local, self.group, self.world_size)
                step.ag_event = record_event(ag)
        step.is_full = True
        step.gathered_version = self.flat._version

    def gathers_float8(self) -> bool:
        """The next gather sends float8 bytes: a float8 group whose shard is on the compute device (not stepped on
        the host)."""
        full = self.full_data
        return self.fp8 is not None and self.host is None and full is not None and self.flat.device == full.device

    def stale_float8(self) -> tuple[Float8Gather, torch.Tensor, coll.ProcessGroup, int] | None:
        """``(gather, shard, group, world size)`` for ``refresh_scales`` when this handle gathers float8 bytes from
        a shard changed since its scales were refreshed, else None."""
        fp8 = self.fp8
        if fp8 is None or not self.gathers_float8():
            return None
        shard = self.flat.detach()  # shares the version counter
        if not fp8.stale(shard):
            return None
        return fp8, shard, self.group, self.world_size

    def wait_full(self, streams: Streams) -> None:
        """Make the compute stream wait for the pending all-gather of this handle."""
        step = self.step
        if step.ag_event is not None:
            wait_event(streams.current(), step.ag_event)
            step.ag_event = None

    def reshard(self) -> None:
        """Free the full buffer (storage size 0); views saved by autograd see it again after the next gather."""
        if not self.step.is_full:
            return
        # No record_stream: the block returns to the all-gather stream's pool, and every later allocation
        # there is preceded by that stream waiting for the compute stream (see unshard).
        if self.step.float8:
            assert self.fp8 is not None
            self.fp8.free()
        else:
            self.made(self.full_data).untyped_storage().resize_(0)
        self.step.freed()
        self.clear_views()

    def views(self) -> list[torch.Tensor]:
        """Views of the gathered full buffer shaped like the original parameters (autograd-connected)."""
        full = self.made(self.full_param)
        token = self.grad_token
        if self.step.float8:  # the layers' float8 weights over the gathered bytes
            assert self.fp8 is not None
            if token is not None and full.requires_grad and torch.is_grad_enabled():
                return self.fp8.weights_fused(token, self)
            return self.fp8.weights(full, self.split_sizes, self.shapes)
        if token is not None and full.requires_grad and torch.is_grad_enabled():
            return list(Unflatten.apply(token, [full], self))
        # torch.split_with_sizes skips Tensor.split's Python layer.
        chunks = torch.split_with_sizes(full, self.split_sizes)
        return [c.view(s) for c, s in zip(chunks, self.shapes)]

    def set_views(self) -> None:
        """Point every original parameter attribute at its view of the full buffer."""
        views = self.views()
        for s in self.attr_slots:
            # Plain attribute (the Parameter was removed from module._parameters at wrap time); writing the
            # instance dict skips nn.Module.__setattr__'s checks on the hot path.
            s.module.__dict__[s.attr] = views[s.index]

    def clear_views(self) -> None:
        """Point the original parameter attributes at meta placeholders (the full buffer is freed)."""
        for s in self.attr_slots:
            s.module.__dict__[s.attr] = self.placeholders[s.index]

    # ----------------------------------------------------------------------------------------------
    # full-precision gathers (state dicts, summon_full_params, optimizer state)
    # ----------------------------------------------------------------------------------------------

    def gather_full_precision(self, device: torch.device, source: torch.Tensor | None = None) -> torch.Tensor:
        """All-gather ``source`` (default: the shard) in its own dtype into a fresh padded buffer on ``device``."""
        src = self.flat.detach() if source is None else source
        out = torch.empty(self.padded_numel, dtype=src.dtype, device=device)
        local = out.narrow(0, self.rank * self.shard_numel, self.shard_numel)
        local.copy_(src)
        coll.all_gather_into(out, local, self.group, self.world_size)
        return out

    def shard_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a padded full buffer."""
        return full.narrow(0, self.rank * self.shard_numel, self.shard_numel)

    def split_full(self, full: torch.Tensor) -> list[torch.Tensor]:
        """Views of an unpadded-or-padded full buffer shaped like the original parameters."""
        return [c.view(s) for c, s in zip(torch.split_with_sizes(full, self.split_sizes), self.shapes)]


ParamTable = dict[int, list[tuple[str, int, int]]]
"""id(module) -> ``(attr, handle index, unique index)`` of each parameter the module registered, in its order.
Ids are of this process's objects: a pickled unit keys it by the modules themselves (see ``Unit.__getstate__``)."""
