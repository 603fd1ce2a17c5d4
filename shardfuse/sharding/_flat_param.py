"""Flat parameters: one padded flat shard per (dtype, requires_grad) group of a unit's own parameters.

A :class:`FlatParamHandle` owns

- ``flat``: the ``nn.Parameter`` the optimizer sees, this rank's 1/world_size shard (shard dtype, e.g. fp32);
- ``full_param``: a leaf tensor of the padded full size in the compute dtype whose storage is allocated only
  while the full parameters are gathered (``untyped_storage().resize_``); during forward the module's
  parameters are views of it, so autograd accumulates one flat full-size gradient into ``full_param.grad``.

Keeping the two tensors apart means neither ever changes dtype or shape, so autograd keeps a single gradient
accumulator for ``full_param`` across several forward passes, and ``flat.grad`` is always shard-shaped.
"""

from __future__ import annotations

import functools
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shardfuse._profiling import profiled
from shardfuse._streams import Streams, record_event, use_stream, wait_event, wait_stream
from shardfuse.sharding import _collectives as coll
from shardfuse.sharding import _data_path as dp

# Marks original parameters once they were flattened: a later unit borrows them instead of flattening them again.
FLATTENED_MARK = "_shardfuse_flattened_into"
# On sharded parameters (flat, or original views): (rank, world_size), the shard this rank's optimizer state is of.
SHARD_MARK_ATTR = "_shardfuse_shard"
# The key under which an optimizer's per-parameter state carries that mark (see _setup.mark_optimizer_state).
SHARD_MARK_KEY = "shardfuse_shard"
# id(sharded parameter) -> (the parameter, its FlatParamHandle), both weakly. Not an attribute: parameters must
# stay picklable; not a WeakKeyDictionary: it compares tensors with ==.
_HANDLES: dict[int, tuple[weakref.ref[torch.Tensor], weakref.ref[FlatParamHandle]]] = {}


def _register_handle(p: torch.Tensor, handle: FlatParamHandle) -> None:
    key = id(p)
    _HANDLES[key] = (weakref.ref(p, lambda _, key=key: _HANDLES.pop(key, None)), weakref.ref(handle))


def handle_of(p: torch.Tensor) -> FlatParamHandle | None:
    """The handle whose shard ``p`` is (a flat parameter, or an original parameter's view), or None."""
    entry = _HANDLES.get(id(p))
    return entry[1]() if entry is not None and entry[0]() is p else None


# id(original parameter) -> (it, the handle it was flattened into, its unique index there), all weakly (as
# _HANDLES): a later unit whose modules register it too borrows it from that handle.
_FLATTENED: dict[int, tuple[weakref.ref[torch.Tensor], weakref.ref[FlatParamHandle], int]] = {}


def _register_flattened(p: torch.Tensor, handle: FlatParamHandle, index: int) -> None:
    key = id(p)
    _FLATTENED[key] = (weakref.ref(p, lambda _, key=key: _FLATTENED.pop(key, None)), weakref.ref(handle), index)


def flattened_into(p: torch.Tensor) -> tuple[FlatParamHandle, int] | None:
    """``(handle, unique index)`` of a parameter some unit already flattened: an original parameter, or its
    ``use_orig_params`` view; None for any other tensor."""
    entry = _FLATTENED.get(id(p))
    if entry is not None and entry[0]() is p:
        h = entry[1]()
        return None if h is None else (h, entry[2])
    h = handle_of(p)
    if h is not None and h.orig_views is not None:
        for i, v in enumerate(h.orig_views):
            if v is p:
                return h, i
    return None


def _reduce_orig_view(ref: weakref.ref[nn.Parameter], proto: int) -> tuple:
    """How an original-parameter view pickles: a meta parameter of its shape with its requires_grad and
    attributes, which the unpickled model replaces with a view of its unpickled shard."""
    v = ref()
    state = {k: x for k, x in v.__dict__.items() if k != "__reduce_ex__"}
    meta = torch.empty(v.shape, dtype=v.dtype, device="meta")
    return torch._utils._rebuild_parameter_with_state, (meta, v.requires_grad, OrderedDict(), state)


# The instance attribute that makes a module (the public wrapper) a unit: it holds the unit's runtime state.
# Flattening stops at such modules; their own parameters belong to their unit.
UNIT_ATTR = "_shardfuse_unit"
# Set on every module whose parameters a unit flattened: wrapping it (or a part of it) again is an error.
OWNED_MARK = "_shardfuse_owned_by"
# What a pickled unit holds instead of its process groups until the user sets them again.
MISSING_GROUP = "MISSING"


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


def iter_own_modules(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """``(prefix, submodule)`` pairs of ``module``'s tree, not descending into nested units (wrappers)."""
    yield prefix, module
    for name, child in module._modules.items():
        if child is None or UNIT_ATTR in child.__dict__:
            continue
        yield from iter_own_modules(child, f"{prefix}{name}.")


class FlatParamHandle:
    """One flat parameter group of a unit: sharded storage, the gathered full buffer and their views."""

    def __init__(
        self,
        params: list[nn.Parameter],
        slots: list[ParamSlot],
        *,
        group: coll.ProcessGroup,
        rank: int,
        world_size: int,
        shard_device: torch.device,
        pin: bool,
    ) -> None:
        """Flatten ``params`` (unique, one dtype and requires_grad) and keep this rank's shard.

        Args:
            params: the unique parameters of the group, in flattening order.
            slots: every registration of them (shared parameters appear more than once).
            group, rank, world_size: the process group the shard belongs to.
            shard_device: where the shard lives (the parameters' device, or CPU with move_params_to_cpu).
            pin: pin the CPU shard so host->device copies can run asynchronously.
        """
        self.group = group
        self.rank = rank
        self.world_size = world_size
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
        _register_handle(self.flat, self)
        # Split sizes of the full buffer into parameters plus the padding tail (one SplitBackward node).
        self.split_sizes = [*self.numels, self.padded_numel - self.numel]
        # Set by init_full_buffer() (lazy init, once the compute device is final).
        self.full_param: torch.Tensor | None = None
        self.full_data: torch.Tensor | None = None  # alias of full_param with its own version counter
        self.compute_dtype = self.dtype
        self.is_full = False
        self.gathered_version = -1
        # The shard's version when forward last used it: backward must see the same parameters.
        self.forward_version: int | None = None
        self.ag_event: torch.cuda.Event | None = None
        self.fired = False  # post-backward hook ran in this backward pass
        # While sharded, the original attributes are meta tensors: shape/dtype/`is None` checks (e.g. in
        # extra_repr) work, and reading data fails loudly instead of touching freed memory.
        self.placeholders = [torch.empty(s, dtype=self.dtype, device="meta") for s in self.shapes]
        self.clear_views()
        # use_orig_params: one nn.Parameter per original parameter, a 1-D view of this rank's piece of it in
        # ``flat`` (empty where the rank holds none of it); (offset in the shard, length) of each.
        self.orig_views: list[nn.Parameter] | None = None
        self.view_ranges: list[tuple[int, int]] = []
        # A reduction wrote ``flat.grad`` in this backward: only then do the views' gradients follow it (after a
        # no_sync backward, or with the unit unused, ``flat.grad`` may be a stale one the user zeroed on the views).
        self.grad_reduced = False
        # Host buffers of a shard stepped by an OffloadOptimizer (_host_shard.HostShard), else None.
        self.host: Any = None

    # ----------------------------------------------------------------------------------------------
    # set-up
    # ----------------------------------------------------------------------------------------------

    def init_full_buffer(
        self, compute_dtype: torch.dtype, device: torch.device, on_grad: Callable[[torch.Tensor], None]
    ) -> None:
        """Create the (unallocated) full buffer in ``compute_dtype`` on ``device``; ``on_grad(full_param)``
        runs once autograd has accumulated its gradient (the post-backward hook)."""
        self.compute_dtype = compute_dtype
        full = torch.empty(self.padded_numel, dtype=compute_dtype, device=device)
        full.untyped_storage().resize_(0)
        full.requires_grad_(self.requires_grad)
        self.full_param = full
        # ``.data`` gives an alias with a separate version counter: writing gathered values through it does
        # not invalidate the views autograd saved for backward.
        self.full_data = full.data
        self.is_full = False
        self._on_grad = on_grad
        self._hooked = False
        self._hook_if_trained()

    def _hook_if_trained(self) -> None:
        # A hook can only go on a tensor that requires grad; a frozen group gets it once it is unfrozen.
        if self.requires_grad and not self._hooked:
            self.full_param.register_post_accumulate_grad_hook(self._on_grad)
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
            v.__reduce_ex__ = functools.partial(_reduce_orig_view, weakref.ref(v))
            _register_handle(v, self)
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
        for slot in self.attr_slots:
            slot.module._parameters[slot.attr] = self.orig_views[slot.index]

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
        slot.module.__dict__[slot.attr] = self.views()[slot.index] if self.is_full else self.placeholders[slot.index]
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
        # Process groups do not pickle; the owner sets them again (FairScale's "MISSING" convention). The runtime
        # (the full buffer and its post-backward hook, a pending gather) is dropped: lazy init makes it again.
        state = dict(self.__dict__)
        state["group"] = MISSING_GROUP
        for key in ("_on_grad", "_hooked"):
            state.pop(key, None)
        state.update(full_param=None, full_data=None, is_full=False, gathered_version=-1, forward_version=None,
                     ag_event=None, fired=False, host=None)
        return state

    def __setstate__(self, state: dict) -> None:
        state.setdefault("attr_slots", state["slots"])  # pickled before sharing across units: nothing lent
        state.setdefault("host", None)
        self.__dict__.update(state)
        # The registries are per process, keyed by object ids: enter the unpickled shard (clip_grad_norm_,
        # optimizer-state and borrowing look it up there).
        _register_handle(self.flat, self)
        if self.orig_views is not None:
            # Pickle copied each original-parameter view into a tensor of its own, no longer a view of the
            # shard: make them again from it (the modules register them: FullyShardedDataParallel.__setstate__,
            # once the modules themselves are unpickled).
            self.make_orig_views()

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
        if self.is_full and self.gathered_version == self.flat._version:
            return
        ag = streams.all_gather
        with profiled("shardfuse.sharding:all_gather"):
            # The all-gather stream waits for all compute queued so far: the optimizer's last writes to the
            # shard, and the last reads of any buffer freed to this stream's pool, which it may now reuse.
            wait_stream(ag, streams.current())
            with use_stream(ag):
                storage = self.full_data.untyped_storage()
                if storage.size() == 0:
                    storage.resize_(self.nbytes)
                local = self.full_data.narrow(0, self.rank * self.shard_numel, self.shard_numel)
                src = self.flat.detach() if host is None else host.source_for_gather(self.flat)
                if src.device != local.device and src.dtype == local.dtype:
                    local.copy_(src, non_blocking=True)  # the host copy is in the compute dtype already
                else:
                    if src.device != local.device:
                        src = src.to(local.device, non_blocking=True)
                    dp.cast_shard(src, local)
                if host is not None:
                    host.note_h2d(ag)
                coll.all_gather_into(self.full_data, local, self.group, self.world_size)
                self.ag_event = record_event(ag)
        self.is_full = True
        self.gathered_version = self.flat._version

    def wait_full(self, streams: Streams) -> None:
        """Make the compute stream wait for the pending all-gather of this handle."""
        if self.ag_event is not None:
            wait_event(streams.current(), self.ag_event)
            self.ag_event = None

    def reshard(self) -> None:
        """Free the full buffer (storage size 0); views saved by autograd see it again after the next gather."""
        if not self.is_full:
            return
        # No record_stream: the block returns to the all-gather stream's pool, and every later allocation
        # there is preceded by that stream waiting for the compute stream (see unshard).
        self.full_data.untyped_storage().resize_(0)
        self.is_full = False
        self.ag_event = None
        self.clear_views()

    def views(self) -> list[torch.Tensor]:
        """Views of the gathered full buffer shaped like the original parameters (autograd-connected)."""
        chunks = torch.split_with_sizes(self.full_param, self.split_sizes)  # skips Tensor.split's Python layer
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


def flatten_own_params(
    module: nn.Module,
    *,
    group: coll.ProcessGroup,
    rank: int,
    world_size: int,
    move_params_to_cpu: bool,
    compute_device: torch.device | None,
    cuda_group: bool = False,
) -> tuple[list[FlatParamHandle], ParamTable, list[BorrowedSlot]]:
    """Flatten ``module``'s own parameters (not those of nested units) per (dtype, requires_grad) group.

    Under an NCCL group (``cuda_group``) parameters left on the CPU are sharded onto the compute device (the
    current CUDA device by default), as FairScale moves such modules. The original ``nn.Parameter`` objects
    leave their modules' ``_parameters`` (marked with ``FLATTENED_MARK``); the returned handles own the shards.
    Groups come in order of first appearance. A parameter a sibling unit already flattened (shared across
    units) is not flattened again but borrowed: its registrations come back as :class:`BorrowedSlot`, in the
    table as handle index ``-1 - k`` for the ``k``-th of them.
    """
    unique: dict[int, nn.Parameter] = {}
    regs: list[tuple[str, nn.Module, str, nn.Parameter]] = []
    borrowed: list[BorrowedSlot] = []
    order: dict[int, list[str]] = {}
    for prefix, m in iter_own_modules(module):
        for name, p in m._parameters.items():
            if p is None:
                continue
            if getattr(p, FLATTENED_MARK, None) is not None or handle_of(p) is not None:
                lent = flattened_into(p)
                if lent is None:
                    raise ValueError(
                        f"parameter {prefix}{name} was flattened by a FullyShardedDataParallel unit that no longer "
                        f"exists (or is a unit's flat parameter): its values are stale; register a live parameter"
                    )
                borrowed.append(BorrowedSlot(m, name, f"{prefix}{name}", *lent))
                order.setdefault(id(m), []).append(name)
                continue
            if not p.is_floating_point():
                raise TypeError(
                    f"parameter {prefix}{name} has dtype {p.dtype}; only floating-point parameters can be "
                    f"sharded: register it as a buffer instead"
                )
            unique.setdefault(id(p), p)
            regs.append((prefix, m, name, p))
            order.setdefault(id(m), []).append(name)
    if borrowed:
        _refuse_nested_lenders(module, borrowed)
    devices = {p.device for p in unique.values()}
    if len(devices) > 1:
        where = sorted({f"{pre}{n}: {p.device}" for pre, _, n, p in regs})[:8]
        raise ValueError(
            f"parameters of {type(module).__name__} are on several devices ({sorted(map(str, devices))}, e.g. "
            f"{where}): move the module to one device before wrapping"
        )
    param_device = next(iter(devices)) if devices else None
    if (
        compute_device is not None and not move_params_to_cpu and not cuda_group
        and param_device is not None and compute_device.type != param_device.type
    ):
        raise ValueError(
            f"compute_device={compute_device} differs from the parameters' device {param_device}: move "
            f"the module to {compute_device} before wrapping, or pass move_params_to_cpu=True"
        )
    groups: dict[tuple[torch.dtype, bool], list[nn.Parameter]] = {}
    for p in unique.values():
        groups.setdefault((p.dtype, p.requires_grad), []).append(p)
    shard_device = torch.device("cpu") if move_params_to_cpu else param_device
    if (
        cuda_group and not move_params_to_cpu and shard_device is not None and shard_device.type == "cpu"
        and torch.cuda.is_available()
    ):
        shard_device = compute_device or torch.device("cuda", torch.cuda.current_device())
    handles: list[FlatParamHandle] = []
    table: ParamTable = {}
    for hi, params in enumerate(groups.values()):
        index = {id(p): i for i, p in enumerate(params)}
        slots = [ParamSlot(m, name, f"{prefix}{name}", index[id(p)]) for prefix, m, name, p in regs if id(p) in index]
        handle = FlatParamHandle(
            params, slots, group=group, rank=rank, world_size=world_size, shard_device=shard_device,
            pin=move_params_to_cpu,
        )
        handles.append(handle)
        for s in slots:
            table.setdefault(id(s.module), []).append((s.attr, hi, s.index))
        for p in params:
            _register_flattened(p, handle, index[id(p)])
    for k, b in enumerate(borrowed):
        table.setdefault(id(b.module), []).append((b.attr, -1 - k, b.index))
    # Keep each module's original parameter order for state dicts.
    for mid, names in order.items():
        rank_of = {n: i for i, n in enumerate(names)}
        table[mid].sort(key=lambda e: rank_of[e[0]])
    for _, m, name, p in regs:
        m._parameters.pop(name, None)
        setattr(p, FLATTENED_MARK, True)
    for b in borrowed:
        b.module._parameters.pop(b.attr, None)
        b.handle.lend(ParamSlot(b.module, b.attr, b.fqn, b.index))
    for _, m in iter_own_modules(module):
        object.__setattr__(m, OWNED_MARK, True)
    return handles, table, borrowed


def _refuse_nested_lenders(module: nn.Module, borrowed: list[BorrowedSlot]) -> None:
    """Only siblings share: a unit nested inside this one reshards the parameter after its own forward, in the
    middle of this unit's forward, which still reads it."""
    nested = {id(h) for m in module.modules() if UNIT_ATTR in m.__dict__ for h in m.__dict__[UNIT_ATTR].handles}
    for b in borrowed:
        if id(b.handle) in nested:
            raise ValueError(
                f"parameter {b.fqn} is shared with a module already wrapped by another FullyShardedDataParallel "
                f"unit nested inside this {type(module).__name__}: parameters are shared only between sibling units "
                f"(neither inside the other); wrap the modules that share it in the same unit, or wrap each of them "
                f"as a sibling unit under a common root"
            )


def materialize_meta(
    module: nn.Module, device: torch.device, param_init_fn: Callable[[nn.Module], None] | None
) -> None:
    """Give ``module``'s own modules on the meta device real storage on ``device`` and their initial values.

    Called by each unit before it flattens, inner units first, so a model built under ``torch.device("meta")``
    never exists whole: only one unit's parameters are full at a time, then each rank keeps its shard. Each own
    module with meta tensors (nested units are already done and are never passed) goes to ``param_init_fn``
    (FSDP1's argument, e.g. ``m.to_empty(device=..., recurse=False)`` then a model's own init of ``m``), or by
    default is ``to_empty``-ed and its ``reset_parameters()`` runs. Parameters tied across modules stay tied.
    """
    own = [(prefix, m) for prefix, m in iter_own_modules(module)]
    if not any(_has_meta(m) for _, m in own):
        return
    first: dict[int, nn.Parameter] = {}  # id of a meta parameter -> what it became
    for prefix, m in own:
        if not _has_meta(m):
            continue
        tied = {name: first[id(p)] for name, p in m._parameters.items() if p is not None and id(p) in first}
        olds = {name: p for name, p in m._parameters.items() if p is not None and p.is_meta}
        if param_init_fn is not None:
            param_init_fn(m)
        else:
            m.to_empty(device=device, recurse=False)
            reset = getattr(m, "reset_parameters", None)
            if callable(reset):
                reset()
            elif olds.keys() - tied.keys():
                raise ValueError(
                    f"{prefix.rstrip('.') or '<the module itself>'} ({type(m).__name__}) is on the meta device and "
                    f"has no reset_parameters() to initialise {sorted(olds.keys() - tied.keys())}: pass "
                    f"param_init_fn=... (called with each such module) or build it on a real device"
                )
        for name, p in olds.items():
            if name in m._parameters and m._parameters[name] is not None:
                first.setdefault(id(p), m._parameters[name])
        for name, p in tied.items():
            m._parameters[name] = p
    left = sorted(f"{prefix}{name}" for prefix, m in own for name, t in (*m._parameters.items(), *m._buffers.items())
                  if t is not None and t.is_meta)
    if left:
        raise ValueError(
            f"{type(module).__name__} still has tensors on the meta device after initialisation ({left[:8]}): "
            f"param_init_fn must give every parameter and buffer of the module it gets real storage (e.g. "
            f"module.to_empty(device=..., recurse=False) then initialise them)"
        )


def _has_meta(m: nn.Module) -> bool:
    return any(t is not None and t.is_meta for t in (*m._parameters.values(), *m._buffers.values()))
