"""Lazy initialisation on first use: the outermost unit becomes the root of its tree.

The root makes the side streams and the :class:`RootState` its units share; each unit settles its compute
device, creates its (unallocated) full buffers with their post-backward hooks, its reduction settings, and
casts its buffers to ``buffer_dtype`` on the compute device.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable

import torch
from torch import nn

from shardfuse._logging import warn_once
from shardfuse._streams import Streams
from shardfuse.sharding.core import _collectives as coll
from shardfuse.sharding.core import _data_path as dp
from shardfuse.sharding.core._devices import compute_device
from shardfuse.sharding.core._flat_param import FlatParamHandle
from shardfuse.sharding.core._groups import give_separate_reduce_scatter_groups
from shardfuse.sharding.core._hybrid import check_one_mesh, layout
from shardfuse.sharding.core._registry import OWNED_MARK, WRAPPED_MARK, iter_own_modules
from shardfuse.sharding.core._runtime import RootState, Unit
from shardfuse.sharding.core._state import TrainingState, check_state
from shardfuse.sharding.core._tree import unit_of, units_below

logger = logging.getLogger(__name__)


def lazy_init(unit: Unit) -> None:
    """Make the outermost unit above ``unit`` the root of its tree, once (until the tree is moved or cast)."""
    if unit.root_state is not None:
        return
    if unit.released:
        raise RuntimeError(
            f"this {unit.name} gave its parameters to a newer FullyShardedDataParallel wrapped around the same "
            f"module: use the new wrapper"
        )
    # A first call under inference_mode (evaluation before training) must not make the full buffers or the
    # cast buffers inference tensors, which training could never update again.
    with torch.inference_mode(False):
        _lazy_init(unit)


def _lazy_init(unit: Unit) -> None:
    top = unit
    while top.parent is not None:
        top = top.parent
    if top is not unit:
        if top.root_state is None:
            _lazy_init(top)
        if unit.root_state is not None:
            return
    units = units_below(unit)
    for u in units[1:]:
        check_state(u.training_state, (TrainingState.IDLE,), "initialising the root", u.name)
    for u in units:
        if u.groups.missing:
            raise RuntimeError(
                f"{u.name} was pickled, which drops its process groups: set model.process_group (and "
                f"process_group_reduce_scatter) on every FullyShardedDataParallel instance after unpickling"
            )
    check_one_mesh([u.name for u in units], [layout(u.groups) for u in units])
    _check_ranks_agree(unit, units)
    give_separate_reduce_scatter_groups([u.groups for u in units])
    _find_lenders(units)
    _check_orig_views(units)
    for u in units:
        _init_unit(u)
    rs = RootState(unit, units, Streams(unit.compute_device))
    for u in units:
        u.root_state = rs
        u.is_root = u is unit
        u.reshard_after_forward = u.config.reshard.reshard_after_forward
        if u.world_size == 1 < unit.world_size and u.groups.process_group is not unit.groups.process_group:
            u.no_broadcast_optim_state = True
    if unit.config.reshard.disable_reshard_on_root:
        unit.reshard_after_forward = False


def _find_lenders(units: list[Unit]) -> None:
    """Point each borrowed parameter at the unit of the tree that lends it; the lender must be in the tree, whose
    root's streams and backward bookkeeping both units then share."""
    owner = {id(h): (u, hi) for u in units for hi, h in enumerate(u.handles)}
    for u in units:
        for b in u.borrowed:
            found = owner.get(id(b.handle))
            if found is None:
                raise RuntimeError(
                    f"{u.name} shares parameter {b.fqn} with a FullyShardedDataParallel unit outside its tree "
                    f"(rooted at {units[0].name}): wrap the modules of both units in one outer "
                    f"FullyShardedDataParallel (the root), and run them through it"
                )
            b.lender, b.lender_hi = found


def _check_orig_views(units: list[Unit]) -> None:
    """With ``use_orig_params`` the modules must register the views of the shards that are trained and gathered:
    anything else (e.g. a copy a module kept from unpickling) would train silently apart from the model."""
    for u in units:
        for h in u.handles:
            if h.orig_views is None:
                continue
            for s in h.attr_slots:
                if s.module._parameters.get(s.attr) is not h.orig_views[s.index]:
                    raise RuntimeError(
                        f"parameter {s.fqn} of {u.name} is not the view of the sharded parameter that "
                        f"use_orig_params registered (the module holds another tensor, e.g. a copy left by "
                        f"unpickling the module without its FullyShardedDataParallel wrapper): an optimizer would "
                        f"step a tensor the model never reads; pickle and unpickle the whole wrapped model"
                    )


def reset_root(unit: Unit) -> None:
    """Forget the runtime after ``.to()``/``.cuda()``/``.half()``: full buffers and streams are rebuilt lazily."""
    for h in unit.handles:
        if h.full_param is not None:
            h.reshard()
        h.full_param = None
        if h.fp8 is not None:
            h.fp8.drop()
    unit.root_state = None
    unit.is_root = None


@torch.no_grad()
def release_unit(unit: Unit) -> None:
    """Give ``unit``'s module its parameters back (full values, as ``nn.Parameter``s) so that a new wrapper can
    flatten them again; ``unit`` and the units nested in it leave their tree. Collective over ``unit``'s group."""
    units = units_below(unit)
    for u in units:
        check_state(u.training_state, (TrainingState.IDLE,), "wrapping the module again", u.name)
    shared = [b.fqn for b in unit.borrowed] + [s.fqn for h in unit.handles for s in h.attr_slots[len(h.slots):]]
    if shared:
        raise RuntimeError(
            f"{unit.name} shares parameters {shared[:8]} with sibling FullyShardedDataParallel units: it cannot "
            f"give them back to wrap its module again; wrap the whole model anew (build it again, or load its "
            f"state_dict() into a fresh copy)"
        )
    for h in unit.handles:
        full = h.gather_full_precision(h.flat.device)
        params = [nn.Parameter(v.clone(), requires_grad=h.requires_grad) for v in h.split_full(full)]
        h.reshard()
        for s in h.slots:
            s.module.__dict__.pop(s.attr, None)
            s.module._parameters[s.attr] = params[s.index]
    for _, m in iter_own_modules(unit.module):
        m.__dict__.pop(OWNED_MARK, None)
        if isinstance(m.__dict__.get("reset_parameters"), functools.partial):
            del m.__dict__["reset_parameters"]  # the guard against resets of flattened parameters
    for u in units:
        reset_root(u)
        if u is not unit and u.parent is unit:
            u.parent = None
    unit.released = True


def _init_unit(unit: Unit) -> None:
    """Compute device and dtypes, full buffers with their post-backward hooks, reduction dtype, buffers."""
    cfg = unit.config
    shards = unit.gather_handles[0].flat.device if unit.gather_handles else None
    fallback = None
    if shards is None:  # no parameters of its own: compute where its buffers (or nested parameters) are
        some = next(iter(unit.module.buffers()), None)
        fallback = some.device if some is not None else next((p.device for p in unit.module.parameters()), None)
    unit.compute_device = compute_device(cfg, shards, fallback)
    precision = cfg.precision
    for h in unit.handles:
        if h.full_param is None:
            dtype = precision.compute_dtype if precision.mixed_precision and precision.compute_dtype else h.dtype
            h.init_full_buffer(dtype, unit.compute_device, _post_backward_hook(unit, h), _fused_grad_hook(unit, h))
    unit.reduce_cfg.reduce_dtype = precision.reduce_dtype({h.compute_dtype for h in unit.handles})
    rc = unit.reduce_cfg
    for h in unit.handles:  # once, here: the per-step kernel launches (_data_path) check nothing
        full = h.made(h.full_param)
        dp.check_plan(h.flat, full, h.world_size, rc.reduce_dtype, rc.predivide, rc.postdivide, h.names[0])
    _cast_buffers(unit)


def _post_backward_hook(unit: Unit, handle: FlatParamHandle) -> Callable[[torch.Tensor], None]:
    """The full buffer's post-accumulate-grad hook, holding the unit and the handle weakly: the hook lives in the
    tensor's C++ autograd metadata, where Python's garbage collector cannot see it, so a strong reference back
    would keep the whole model alive after its last user let go of it."""
    unit_ref, handle_ref = weakref.ref(unit), weakref.ref(handle)

    def hook(full_param: torch.Tensor) -> None:
        u, h = unit_ref(), handle_ref()
        if u is not None and h is not None:
            u.post_backward(h, full_param)

    return hook


def _fused_grad_hook(unit: Unit, handle: FlatParamHandle) -> Callable[[torch.Tensor], None]:
    """The grad token's post-accumulate-grad hook (``_fused_grads.py``), holding both weakly like
    :func:`_post_backward_hook`."""
    unit_ref, handle_ref = weakref.ref(unit), weakref.ref(handle)

    def hook(token: torch.Tensor) -> None:
        token.grad = None  # an empty tensor: dropped, so the next backward sets it instead of adding
        u, h = unit_ref(), handle_ref()
        if u is not None and h is not None:
            u.post_backward_fused(h)

    return hook


def _cast_buffers(unit: Unit) -> None:
    """Floating buffers of owned modules to ``buffer_dtype`` on the compute device (originals remembered)."""
    buffer_dtype = unit.config.precision.buffer_dtype
    for _, m in iter_own_modules(unit.module):
        for name, b in m._buffers.items():
            if b is None:
                continue
            unit.buffer_dtypes.setdefault((id(m), name), b.dtype)
            dtype = buffer_dtype if (buffer_dtype is not None and b.is_floating_point()) else b.dtype
            if b.dtype != dtype or b.device != unit.compute_device:
                m._buffers[name] = b.to(device=unit.compute_device, dtype=dtype)


def _check_ranks_agree(root: Unit, units: list[Unit]) -> None:
    """Once per tree: every rank must have wrapped the same units.

    Ranks that wrap differently would issue mismatched collectives (a crash or hang deep in the backend); one
    object all-gather here turns that into an error naming the first difference. (Initial values were made to
    agree unit by unit at wrap time: ``_setup.agree_on_initial_values``.)
    """
    world = root.world_size
    if world == 1 or not coll.is_process_group(root.groups.process_group):
        return
    layout = [(u.name, [(h.numel, str(h.dtype), h.requires_grad) for h in u.handles]) for u in units]
    everyone = coll.all_gather_object(layout, root.groups.process_group, world)
    first_layout = everyone[0]
    for rank, other_layout in enumerate(everyone[1:], start=1):
        if other_layout != first_layout:
            diff = next(
                (i for i, (a, b) in enumerate(zip(first_layout, other_layout)) if a != b),
                min(len(first_layout), len(other_layout)),
            )
            mine = first_layout[diff] if diff < len(first_layout) else "no unit"
            theirs = other_layout[diff] if diff < len(other_layout) else "no unit"
            raise RuntimeError(
                f"ranks wrapped the model differently: {len(first_layout)} units on rank 0, {len(other_layout)} on "
                f"rank {rank}; unit #{diff} is {mine} (name, [(numel, dtype, requires_grad) per flat group]) on rank "
                f"0 but {theirs} on rank {rank}: build and wrap the same model on every rank"
            )


def apply_to_unit(unit: Unit, fn: Callable[[torch.Tensor], torch.Tensor], apply: Callable[[], nn.Module]) -> nn.Module:
    """A wrapper's ``.to()``/``.cuda()``/``.half()``: ``apply()`` (``nn.Module._apply``) moves the module; the shards,
    their original-parameter views and the remembered buffer dtypes follow, and the runtime is rebuilt lazily."""
    for u in units_below(unit):
        check_state(u.training_state, (TrainingState.IDLE,), "moving or casting the model", u.name)
    # Buffers lazy init cast to buffer_dtype remember their dtype from before (state dicts give it back): a
    # cast such as .half() changes that too.
    cast = [(m, name, b) for _, m in iter_own_modules(unit.module) for name, b in m._buffers.items()
            if b is not None and (id(m), name) in unit.buffer_dtypes]
    out = apply()
    for m, name, b in cast:
        now = m._buffers.get(name)
        if now is not None and now.dtype != b.dtype:
            key = (id(m), name)
            unit.buffer_dtypes[key] = fn(torch.empty(0, dtype=unit.buffer_dtypes[key], device=b.device)).dtype
    if unit.config.params.use_orig_params:
        # nn.Module._apply moved the registered views (copies now) but not the unregistered shards: move the
        # shards and make fresh views of them (build the optimizer after moving the model).
        with torch.no_grad():
            for h in unit.handles:
                h.flat.data = fn(h.flat)
                if h.flat.grad is not None:
                    h.flat.grad = fn(h.flat.grad)
                h.make_orig_views()
                h.register_orig_views()  # borrowing siblings register the same views
                h.grads_to_views()
    reset_root(unit)
    for h in unit.handles:  # .half() and the like: the parameters now have the shard's new dtype
        h.follow_shard_dtype()
    return out


def take_module(module: nn.Module) -> None:
    """Refuse what cannot be wrapped; a module wrapped before is taken back from its earlier wrapper."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"FullyShardedDataParallel wraps an nn.Module, got {type(module).__name__}")
    if unit_of(module) is not None:
        raise ValueError(
            "module is already a FullyShardedDataParallel instance: wrap each module once "
            "(nest instances by wrapping inner submodules, then the outer module)"
        )
    prior = module.__dict__.get(WRAPPED_MARK)
    if prior is not None:
        # Wrapping a module again (FairScale allows it, e.g. for inference after training): the earlier wrapper
        # hands its parameters back, full, and stops working. Collective, like wrapping itself.
        release_unit(prior)
        warn_once(logger, f"{type(module).__name__} was wrapped again: its earlier {prior.name} gave its "
                          f"parameters back to the new wrapper and stops working (using it raises); wrap a module "
                          f"once unless you mean to replace the wrapper")
    owned = next((p or "<the module itself>" for p, m in iter_own_modules(module) if OWNED_MARK in m.__dict__), None)
    if owned is not None:
        raise ValueError(
            f"the parameters of {type(module).__name__} (at {owned!r}) already belong to an outer "
            f"FullyShardedDataParallel unit, which flattened them: wrap inner modules first, then the outer "
            f"module (or use auto_wrap)"
        )
