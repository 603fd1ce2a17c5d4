"""Activation offload (:func:`offload_activations`): what chosen units' forwards save for backward waits in pinned
host memory, and comes back ahead of those units' backward.

Every unit's forward in a step is a *call*, numbered by the order in which the forwards ended (a nested unit ends
before the unit around it, the top unit last): its *position*. A chosen unit's forward runs under saved-tensor hooks.
Each tensor autograd saves there that is worth moving (a plain tensor on the compute device, dense, at least
``min_bytes``, not a gathered parameter, which the sharding layer gathers again for backward anyway) becomes a
``_Saved`` entry of the call's ``_Group``. When that forward ends, the ``d2h`` stream copies the group's tensors into
pinned host memory and their device memory goes back to the allocator once the copies ran (``record_stream``). When
the backward of the unit at position ``p`` starts (its pre-backward hook), the groups at positions
``p - prefetch_ahead`` to ``p`` still on the host are copied back on the ``h2d`` stream, into memory of the compute
stream's pool; autograd's unpack makes the compute stream wait for the copy. A group unpacked before it was
prefetched is fetched then (a *late fetch*, counted in :meth:`ActivationOffload.stats`).

Threads: the forward (packing, the copies out) runs on the caller's thread, the backward (unpacking, prefetching)
on autograd's device thread; ``ActivationOffload._lock`` guards the calls and every group's state and device copies
(docs/concurrency.md, "Activation offload").
"""

from __future__ import annotations

import contextlib
import enum
import logging
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from shardfuse._streams import current_stream, new_stream, record_event, use_stream, wait_event, wait_stream
from shardfuse.sharding.core._tree import require_unit, unit_of, units_below

logger = logging.getLogger(__name__)

__all__ = ["ActivationOffload", "GroupState", "offload_activations"]

DEFAULT_MIN_BYTES = 1 << 20  # smaller tensors stay: a copy's fixed cost outweighs the memory
# Copies back start this many forward positions before their unit's backward. Measured on one H200 (7B layers,
# float8, compiled, 4 of 8 layers offloaded at 16K tokens, docs/design.md "Activation offload"): the same step time
# at 2, 4 and 8 ahead, the peak 1.7 GiB higher at 8 (every copy back at the backward's start).
DEFAULT_PREFETCH_AHEAD = 2


class GroupState(enum.Enum):
    """Where one call's saved tensors are."""

    SAVING = "saving"  # the unit's forward runs: entries are added, their device tensors held
    ON_HOST = "on host"  # the copies to pinned host memory are queued; the device tensors are released
    FETCHING = "fetching"  # the copies back are queued; each device copy is held until autograd unpacks it
    DROPPED = "dropped"  # the forward raised: nothing was kept


TRANSITIONS: dict[GroupState, frozenset[GroupState]] = {
    GroupState.SAVING: frozenset({GroupState.ON_HOST, GroupState.DROPPED}),
    GroupState.ON_HOST: frozenset({GroupState.FETCHING}),
    # every entry unpacked: the device copies go, the host copies stay for a retained graph's next backward
    GroupState.FETCHING: frozenset({GroupState.ON_HOST}),
    GroupState.DROPPED: frozenset(),
}


class IllegalGroupMove(RuntimeError):
    """A group of offloaded activations was moved to a state its current state does not lead to."""


class _Group:
    """The tensors one call of a chosen unit saved for backward."""

    def __init__(self, unit_name: str, device: torch.device) -> None:
        self.unit_name = unit_name
        self.device = device
        self.state = GroupState.SAVING
        self.entries: list[weakref.ref[_Saved]] = []  # weak: autograd owns the entries, and frees them after use
        self.by_key: dict[tuple, _Saved] = {}  # while SAVING: the same tensor saved twice is copied once
        self.to_host: torch.cuda.Event | None = None
        self.to_device: torch.cuda.Event | None = None
        self.waited = False  # the compute stream waits for to_device already
        self.nbytes = 0

    def move(self, to: GroupState) -> None:
        """Move to ``to``; raise :class:`IllegalGroupMove` if the current state does not lead there."""
        if to not in TRANSITIONS[self.state]:
            allowed = ", ".join(sorted(s.name for s in TRANSITIONS[self.state])) or "nothing"
            raise IllegalGroupMove(
                f"activation offload of {self.unit_name}: group state {self.state.name} -> {to.name} is not allowed "
                f"(from {self.state.name} only {allowed}); a saved tensor was used outside its forward and backward")
        self.state = to

    def live(self) -> list[_Saved]:
        return [e for e in (r() for r in self.entries) if e is not None]


class _Saved:
    """One tensor a chosen unit's forward saved, as autograd holds it (the pack hook's return value)."""

    __slots__ = ("group", "shape", "stride", "dtype", "source", "source_ref", "version", "host", "device_copy",
                 "packs", "unpacks", "__weakref__")

    def __init__(self, group: _Group, t: torch.Tensor) -> None:
        self.group = group
        self.shape, self.stride, self.dtype = t.shape, t.stride(), t.dtype
        self.source: torch.Tensor | None = t  # until its copy to the host is queued
        self.source_ref = weakref.ref(t)  # to see an in-place change made while it is still alive elsewhere
        self.version = t._version
        self.host: torch.Tensor | None = None
        self.device_copy: torch.Tensor | None = None
        self.packs, self.unpacks = 1, 0

    def describe(self) -> str:
        return f"a {tuple(self.shape)} {self.dtype} tensor that {self.group.unit_name}'s forward saved for backward"


class _Call:
    """One unit's forward in this step."""

    __slots__ = ("unit_id", "group", "backward_started")

    def __init__(self, unit_id: int, group: _Group | None) -> None:
        self.unit_id, self.group, self.backward_started = unit_id, group, False


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill a span of its storage without gaps or overlaps (a copy of the same strides is
    one plain copy, and the compiled backward finds the strides it was traced with)."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((s, n) for s, n in zip(t.stride(), t.shape) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


class ActivationOffload:
    """The activation offload of one wrapped model (made by :func:`offload_activations`; see its docstring).

    Every unit of the model refers to it (``Unit.saved_activations``): the model owns it. :meth:`remove` detaches it.
    """

    def __init__(self, model: nn.Module, units: int | Iterable[nn.Module] | Callable[[str, nn.Module], bool], *,
                 prefetch_ahead: int | None = None, min_bytes: int = DEFAULT_MIN_BYTES) -> None:
        top = require_unit(model)
        if top.parent is not None:
            raise ValueError(f"offload_activations() takes the outermost FullyShardedDataParallel wrapper; "
                             f"{top.name} is nested in {top.parent.name}: pass that one")
        every = units_below(top)
        taken = [u for u in every if u.saved_activations is not None]
        if taken:
            raise ValueError(f"{taken[0].name} already offloads activations: call remove() on the ActivationOffload "
                             f"offload_activations() returned before making another")
        if prefetch_ahead is None:
            prefetch_ahead = DEFAULT_PREFETCH_AHEAD
        if isinstance(prefetch_ahead, bool) or not isinstance(prefetch_ahead, int) or prefetch_ahead < 0:
            raise ValueError(f"prefetch_ahead={prefetch_ahead!r}: give a number of units >= 0 (how many positions "
                             f"before a unit's backward its activations start coming back), or None for the default")
        chosen = _choose(model, every, units, prefetch_ahead)
        if isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0:
            raise ValueError(f"min_bytes={min_bytes!r}: give a size in bytes >= 0 (smaller saved tensors stay)")
        self.prefetch_ahead = prefetch_ahead
        self.min_bytes = min_bytes
        self.chosen_names = [u.name for u in chosen]
        self._chosen = {id(u) for u in chosen}
        # The handles each chosen unit gathers, its nested units' included: their buffers are never offloaded.
        self._gathered = {id(u): [h for v in units_below(u) for h in v.gather_handles] for u in chosen}
        self._units = [weakref.ref(u) for u in every]
        self._lock = threading.Lock()  # guards _calls, the groups' states and device copies, _late
        self._calls: list[_Call] = []
        self._late = 0
        self._streams: tuple[torch.cuda.Stream | None, torch.cuda.Stream | None] | None = None
        for u in every:
            u.saved_activations = self

    def __repr__(self) -> str:
        return (f"ActivationOffload({len(self._chosen)} units, prefetch_ahead={self.prefetch_ahead}, "
                f"min_bytes={self.min_bytes})")

    def remove(self) -> None:
        """Stop offloading: the units' later forwards save on the device again (graphs already made still fetch)."""
        for ref in self._units:
            u = ref()
            if u is not None and u.saved_activations is self:
                u.saved_activations = None
        self._new_step()

    def stats(self) -> dict[str, int]:
        """What the step so far (since the top unit's last forward began) moved: calls offloaded, tensors and bytes
        copied to the host, and late fetches (a group unpacked before its prefetch)."""
        with self._lock:
            groups = [c.group for c in self._calls if c.group is not None]
            return {"calls": len(groups), "tensors": sum(len(g.entries) for g in groups),
                    "bytes": sum(g.nbytes for g in groups), "late_fetches": self._late}

    # ------------------------------------------------------------------------------------------------------------
    # called by the sharding core: the unit's forward (caller's thread) and pre-backward (autograd's device thread)

    @contextlib.contextmanager
    def forward_context(self, unit: Any) -> Iterator[None]:
        """Around the wrapped module's forward (not an activation-checkpoint recompute)."""
        if unit.is_root:
            self._new_step()
        if id(unit) not in self._chosen or not torch.is_grad_enabled():  # under no_grad nothing is saved
            yield
            self._end_call(unit, None)
            return
        if unit.compute_device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"offload_activations: {unit.name}'s forward is being captured into a CUDA graph, "
                               f"whose memory stays on the device; call remove() on the ActivationOffload before "
                               f"capturing the step, or train this model eagerly")
        group = _Group(unit.name, unit.compute_device)
        hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(group, unit, t), self._unpack)
        try:
            hooks.__enter__()
        except RuntimeError:  # torch.autograd.graph.disable_saved_tensors_hooks is in force
            logger.warning("offload_activations: saved-tensor hooks are disabled here; %s keeps its activations on "
                           "the device", unit.name)
            yield
            self._end_call(unit, None)
            return
        try:
            yield
        except BaseException:
            hooks.__exit__(None, None, None)
            with self._lock:
                group.move(GroupState.DROPPED)
            raise
        hooks.__exit__(None, None, None)
        self._offload(group)
        self._end_call(unit, group)

    def before_backward(self, unit: Any) -> None:
        """``unit``'s backward starts: copy back the groups from its position back to ``prefetch_ahead`` before."""
        with self._lock:
            calls = self._calls
            pos = next((i for i in range(len(calls) - 1, -1, -1)
                        if calls[i].unit_id == id(unit) and not calls[i].backward_started), None)
            if pos is None:
                return
            calls[pos].backward_started = True
            for c in reversed(calls[max(0, pos - self.prefetch_ahead):pos + 1]):
                if c.group is not None and c.group.state is GroupState.ON_HOST:
                    self._fetch(c.group)

    # ------------------------------------------------------------------------------------------------------------

    def _new_step(self) -> None:
        with self._lock:
            for c in self._calls:  # device copies nobody unpacked (a branch without backward) go now
                if c.group is not None:
                    for e in c.group.live():
                        e.device_copy = None
            self._calls = []
            self._late = 0

    def _end_call(self, unit: Any, group: _Group | None) -> None:
        with self._lock:
            self._calls.append(_Call(id(unit), group))

    def _side_streams(self, device: torch.device) -> tuple[torch.cuda.Stream | None, torch.cuda.Stream | None]:
        if self._streams is None:
            self._streams = (new_stream(device), new_stream(device))
        return self._streams

    def _offloadable(self, unit: Any, t: torch.Tensor) -> bool:
        if type(t) is not torch.Tensor or t.device != unit.compute_device:  # parameters, subclasses, other devices
            return False
        if t.numel() * t.element_size() < self.min_bytes or not _dense(t):
            return False
        ptr = t.untyped_storage().data_ptr()
        for h in self._gathered[id(unit)]:  # the gathered parameters come back with the next gather
            if h.full_data is not None and h.full_data.untyped_storage().data_ptr() == ptr:
                return False
            fp8 = h.fp8
            if fp8 is not None and fp8.data is not None and fp8.data.untyped_storage().data_ptr() == ptr:
                return False
        return True

    def _pack(self, group: _Group, unit: Any, t: torch.Tensor) -> Any:
        if group.state is not GroupState.SAVING or not self._offloadable(unit, t):
            return t
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        e = group.by_key.get(key)
        if e is not None and e.version == t._version:
            e.packs += 1
            return e
        e = _Saved(group, t)
        group.by_key[key] = e
        group.entries.append(weakref.ref(e))
        group.nbytes += t.numel() * t.element_size()
        return e

    def _offload(self, group: _Group) -> None:
        """The forward ended: queue the copies of the group's tensors to pinned host memory, release them."""
        live = group.live()
        group.by_key.clear()
        for e in live:
            src = e.source
            if src is not None and src._version != e.version:
                with self._lock:
                    group.move(GroupState.DROPPED)
                raise RuntimeError(_modified(e, src._version))
        cuda = group.device.type == "cuda"
        d2h, _ = self._side_streams(group.device)
        wait_stream(d2h, current_stream(group.device))
        with use_stream(d2h):
            for e in live:
                src = e.source
                assert src is not None
                e.host = torch.empty_strided(e.shape, e.stride, dtype=e.dtype, pin_memory=cuda)
                e.host.copy_(src, non_blocking=cuda)
                if d2h is not None:
                    src.record_stream(d2h)  # the memory returns to the allocator once this copy ran
                e.source = None
            group.to_host = record_event(d2h)
        with self._lock:
            group.move(GroupState.ON_HOST)

    def _fetch(self, group: _Group) -> None:
        """Queue the copies of ``group``'s tensors back to the device (``_lock`` held)."""
        live = [e for e in group.live() if e.host is not None]
        compute = current_stream(group.device)
        for e in live:  # allocated from the compute stream's pool, where this backward frees memory
            e.device_copy = torch.empty_strided(e.shape, e.stride, dtype=e.dtype, device=group.device)
            e.unpacks = 0
        _, h2d = self._side_streams(group.device)
        wait_stream(h2d, compute)
        with use_stream(h2d):
            wait_event(h2d, group.to_host)
            for e in live:
                assert e.device_copy is not None and e.host is not None
                e.device_copy.copy_(e.host, non_blocking=group.device.type == "cuda")
            group.to_device = record_event(h2d)
        group.waited = False
        group.move(GroupState.FETCHING)

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Saved):
            return packed
        e, group = packed, packed.group
        with self._lock:
            alive = e.source_ref()
            if alive is not None and alive._version != e.version:
                raise RuntimeError(_modified(e, alive._version))
            if e.device_copy is None:
                if group.state is GroupState.FETCHING:  # unpacked again after its group's copies were used
                    group.move(GroupState.ON_HOST)
                self._late += 1
                self._fetch(group)
            if not group.waited:
                wait_event(current_stream(group.device), group.to_device)
                group.waited = True
            t = e.device_copy
            assert t is not None
            e.unpacks += 1
            if e.unpacks >= e.packs:
                e.device_copy = None
                if all(x.device_copy is None for x in group.live()):
                    group.move(GroupState.ON_HOST)
        return t


def _modified(e: _Saved, now: int) -> str:
    return (f"offload_activations: {e.describe()} was modified by an in-place operation after it was saved (version "
            f"{e.version} -> {now}); without the offload autograd would raise here too. Clone it before the in-place "
            f"operation, or leave this unit out of offload_activations(units=...)")


def spread(count: int, units: int, prefetch_ahead: int) -> list[int]:
    """The indices, in forward order, of ``count`` of ``units`` innermost units to offload: evenly spaced from the
    first over those whose backward starts at least ``prefetch_ahead + 1`` units into the backward (all the first
    ``count`` where fewer are left than that).

    Spaced, each copy back has the backward of the units between two offloaded ones to hide in: a group's copy back
    takes longer than a decoder layer's backward (2 x H200, the 7B decoder's layers at 4K tokens, float8: ~9.5 against
    ~6 ms), so the first N layers' copies fell behind one another (+26 ms in a 197 ms backward for 9 of 32, copies
    started 2 positions ahead) where 9 spread cost nothing, at the same peak (docs/design.md, "Activation offload").
    The last units are left out because their copies back would start with the backward, at its peak."""
    room = max(count, units - prefetch_ahead - 1)
    if count == 1:
        return [0]
    step = (room - 1) / (count - 1)  # >= 1: the indices rise strictly
    return [round(i * step) for i in range(count)]


def _choose(model: nn.Module, every: list[Any],
            units: int | Iterable[nn.Module] | Callable[[str, nn.Module], bool], prefetch_ahead: int) -> list[Any]:
    """The units ``units`` names: N innermost units spread over the model (:func:`spread`), those a predicate of
    (name, wrapper) picks, or the given wrappers (or the modules they wrap)."""
    top = every[0]
    named = [(name, m, u) for name, m in model.named_modules() if (u := unit_of(m)) is not None]
    inner = [u for _, _, u in named if u is not top and len(units_below(u)) == 1]
    if isinstance(units, bool):
        raise TypeError(f"units={units!r}: give a count, the wrapped modules, or a predicate of (name, module)")
    if isinstance(units, int):
        if not 1 <= units <= len(inner):
            raise ValueError(f"units={units}: the model has {len(inner)} innermost units below the top one; offload "
                             f"1..{len(inner)} of them, or name the modules")
        return [inner[i] for i in spread(units, len(inner), prefetch_ahead)]
    if callable(units):
        picked = [u for name, m, u in named if u is not top and units(name, m)]
        if not picked:
            raise ValueError("units=<predicate>: it picked no unit (it gets each nested FullyShardedDataParallel "
                             "wrapper's name and module); check the names with model.named_modules()")
        return picked
    by_module = {id(m): u for _, m, u in named}
    by_module.update({id(u.module): u for u in every})
    picked, unknown = [], []
    for m in units:
        u = by_module.get(id(m))
        (unknown.append(type(m).__name__) if u is None else picked.append(u))
    if unknown or not picked:
        raise ValueError(f"units: {', '.join(unknown) or 'nothing'} given where FullyShardedDataParallel wrappers "
                         f"of this model (or the modules they wrap) were expected")
    return list({id(u): u for u in picked}.values())


def offload_activations(model: nn.Module, units: int | Iterable[nn.Module] | Callable[[str, nn.Module], bool], *,
                        prefetch_ahead: int | None = None, min_bytes: int = DEFAULT_MIN_BYTES) -> ActivationOffload:
    """Keep what chosen units' forwards save for backward in pinned host memory between forward and backward.

    Offloading a unit lowers the step's peak (the start of the backward) by what it saved, and its copies overlap
    the rest of the forward and the backward of the units after it on two side streams. Values and gradients are the
    same as without it.

    Args:
        model: the outermost ``FullyShardedDataParallel`` wrapper.
        units: how many of the innermost wrapped units to offload, spread evenly from the first one over all but the
            last ``prefetch_ahead + 1`` (:func:`spread`: each copy back then has the units between two offloaded ones
            to hide behind), or the wrapped modules themselves (wrappers or the modules they wrap), or a predicate
            ``(name, wrapper) -> bool`` over the nested wrappers. A chosen unit's nested units' activations go with it.
        prefetch_ahead: when a unit's backward starts, the activations of the units up to this many forward
            positions before it start coming back (default 2). Larger hides slower copies, at the cost of holding
            them on the device longer.
        min_bytes: saved tensors smaller than this stay on the device (default 1 MiB).

    Returns the :class:`ActivationOffload`, which the model keeps; ``remove()`` turns it off. Raises ``ValueError``
    for units that are not this model's and for a second offload on the same model. The forward of a chosen unit
    cannot be captured into a CUDA graph (``capture_step``) nor traced whole by ``torch.compile`` (compile the
    layers inside the wrappers instead).
    """
    return ActivationOffload(model, units, prefetch_ahead=prefetch_ahead, min_bytes=min_bytes)
