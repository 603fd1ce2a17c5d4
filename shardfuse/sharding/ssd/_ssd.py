"""The SSD offload tier: flat shards (and optionally their optimizer state) that live in files between uses.

Where the data of an SSD-backed flat parameter is, at each phase of a step:

- between uses: in its file only; the parameter (and each offloaded optimizer-state tensor) keeps its shape and
  dtype but its storage is resized to 0 bytes, and from the moment the tier stops using it it wears its on-disk
  face (``_ssd_face.py``): any read raises an error naming it, on every rank, whether or not the I/O thread has given
  the memory back yet (a tensor :class:`~shardfuse.sharding.ssd._ssd_page.Page` manages);
- gather (forward, backward): :class:`SsdHostShard` reads the file into the shard's own storage (pinned memory
  from torch's caching host allocator on a GPU machine, so the storage of an evicted shard is reused by the next
  one), the host-to-device copy reads it there, and the storage is given back once that copy's event completed;
- optimizer step (an ``OffloadOptimizer`` task on its worker thread, or a plain optimizer's ``step()``): the
  optimizer's own step pre-hook pages in the parameters (and state) it holds, its post-hook writes them behind and
  gives the memory back when the writes are done (the one process-wide hook, :func:`_dispatch`, gives an optimizer
  these hooks at its first step);
- who owns what: the model. Its shards (:class:`~shardfuse.sharding.ssd._ssd_shard.SsdShard`, on the handles' host
  shards) hold their pages and files and the :class:`~shardfuse.sharding.ssd._ssd_shard.Tier` of the model's tree
  (one per setting; the units wrapped first make theirs one when the unit around them is wrapped, and their files
  move into its folder), which owns its store: a folder and I/O threads of this model's own. The root wrapper's
  state lists the tiers (``Unit.lower_tiers``). Freeing the model frees them all, the files, the folder and the
  I/O threads; no module-level registry keeps any;
- gradients stay in the pinned host buffers of :class:`~shardfuse.sharding.host._host_shard.HostShard`.

Read-ahead: two learned sequences (``_ssd_keep.OrderLearner``), the gathers and the optimizer steps, each remembering
which ``read_ahead`` shards followed a pair of shards last time: after the first step the gathers read ahead in
forward order, then in reverse in backward, and the steps in whatever order the optimizer steps them. Writes in
flight are bounded (``read_ahead`` times the largest shard), so a disk slower than the optimizer slows the step
instead of filling memory; shards read ahead but not used are given back beyond ``4 * read_ahead``.

Paths that read or write the shards outside a step (state dicts, ``summon_full_params``, checkpoints, optimizer
state dicts) call :func:`page_in_tree` (through ``settle``/``finish_host_steps``): every shard is read in and stays
in memory, marked as possibly changed, until its next training use writes it back and evicts it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from shardfuse import _versions
from shardfuse.sharding.core import _process_hooks
from shardfuse.sharding.core._flat_param import FlatParamHandle
from shardfuse.sharding.core._tree import units_below
from shardfuse.sharding.host import _backing
from shardfuse.sharding.ssd._ssd_config import OffloadConfig
from shardfuse.sharding.ssd._ssd_shard import SsdHostShard, SsdShard, Tier, host_of, own_storage, ssd_host, ssd_of
from shardfuse.sharding.ssd._ssd_store import SsdStore

__all__ = ["attach", "host_after_engine", "io_bytes", "io_modes", "leave_tier", "main_waits", "own_storage",
           "page_in_optimizer_state", "page_in_tree", "prepare", "refuse", "ssd_host", "stores_of", "tiers_below"]

logger = logging.getLogger(__name__)

_STEPPING_ATTR = "_shardfuse_ssd_stepping"  # on an optimizer between its step pre- and post-hook
_HOOKED_ATTR = "_shardfuse_ssd_hooked"  # on an optimizer: (parameters held when last looked at, its hooks or None)


def tiers_below(unit: Any) -> list[Tier]:
    """The tiers of the SSD-backed shards of ``unit`` and the units nested in it (one per setting)."""
    seen: dict[int, Tier] = {}
    for u in units_below(unit):
        for h in u.handles:
            host = ssd_host(h)
            if host is not None:
                seen.setdefault(id(host.ssd.tier), host.ssd.tier)
    return list(seen.values())


@contextlib.contextmanager
def main_waits(tiers: Iterable[Tier]) -> Iterator[None]:
    """The caller waits for the ``OffloadOptimizer`` worker (closing it): no update of ``tiers`` (the model's,
    :func:`tiers_below`) waits for room to keep."""
    with contextlib.ExitStack() as stack:
        for tier in tiers:
            stack.enter_context(tier.keep.main_waits())
        yield


def _tree_tier(unit: Any, config: OffloadConfig) -> Tier:
    """The tier of ``unit``'s tree for ``config``: the units nested in it were wrapped before it, each making its
    own; they become one (the shards of a model share their learned orders and bounds), or a new one."""
    below = [t for t in tiers_below(unit) if t.config == config] if unit is not None else []
    if not below:
        return Tier(config)
    tier = below[0]
    for u in units_below(unit):
        for h in u.handles:
            host = ssd_host(h)
            if host is not None and host.ssd.tier in below[1:]:
                host.ssd.move_to(tier)
    return tier


# ------------------------------------------------------------------------------------------------------
# wiring: wrap time, optimizer steps, user paths
# ------------------------------------------------------------------------------------------------------


def prepare(handles: Iterable[FlatParamHandle]) -> None:
    """Wrap time, before any view of the shards is made: each CPU shard gets a storage that can be evicted."""
    for h in handles:
        if h.flat.device.type == "cpu":
            own_storage(h.flat, torch.cuda.is_available())


def attach(handles: Iterable[FlatParamHandle], config: OffloadConfig, unit_name: str, unit: Any = None) -> None:
    """Wrap time: move each CPU shard of ``handles`` into its file and give it its file-backed host shard."""
    tier = _tree_tier(unit, config)  # owned by the shards (so by the model): no registry keeps it
    _install_step_hook()
    _backing.register(BACKING)
    for i, h in enumerate(handles):
        if h.flat.device.type != "cpu" or h.host is not None:
            continue
        name = f"{unit_name}-flat{i}".replace("/", "_").replace(" ", "")[:80]
        if not h.flat.untyped_storage().resizable():
            raise RuntimeError(f"the shards of {unit_name} need prepare() before their views are made")
        h.host = SsdHostShard(h.flat, SsdShard(h, tier, name, unit, i), pin=torch.cuda.is_available(), unit=unit)
    if unit is not None:  # the top unit (the root wrapper's state) lists its tree's tiers; the units inside, none
        for u in units_below(unit)[1:]:
            u.lower_tiers = []
        unit.lower_tiers = tiers_below(unit)


def stores_of(model: Any) -> list[SsdStore]:
    """The SSD stores of a wrapped model (or runtime unit) and the units nested in it: one per setting, each with
    its own folder and I/O threads."""
    unit = getattr(model, "_unit", model)
    return [t.store for t in tiers_below(unit)]


def io_bytes(model: Any) -> tuple[int, int]:
    """Bytes read and written so far by the SSD stores of ``model`` (benchmarks report them per step)."""
    stores = stores_of(model)
    return sum(s.bytes_read for s in stores), sum(s.bytes_written for s in stores)


def io_modes(model: Any) -> dict[str, str]:
    """Each SSD store of ``model``: its folder and its ``io_mode`` (``"direct"``, ``"buffered"``, or the fallback
    and why)."""
    return {s.dir: s.io_mode for s in stores_of(model)}


def host_after_engine(h: FlatParamHandle) -> SsdHostShard | None:
    """What ``handle.host`` becomes when an ``OffloadOptimizer`` lets go: the SSD host shard (reset, its queued
    write-backs done: nothing in flight keeps the files once the model is freed) or None."""
    host = ssd_host(h)
    if host is None:
        return None
    host.ssd.settle()
    return host.reset_for_plain_optimizer()


def leave_tier(h: FlatParamHandle) -> None:
    """Before a shard is made resident on the GPU (``OffloadOptimizer``'s budget): read it in for good."""
    host = ssd_host(h)
    if host is not None:
        host.ssd.leave()


def page_in_tree(units: Iterable[Any]) -> None:
    """Before a state-dict, summon or checkpoint path reads or writes the shards: read every SSD-backed shard of
    ``units`` (and its tracked optimizer state) in; they stay resident, written back at their next training use
    (marked possibly changed: those paths may write through any alias)."""
    shards = [host.ssd for u in units for h in u.handles if (host := ssd_host(h)) is not None]
    for s in shards:
        for page in s.pages(state=True):
            page.prefetch()
    for s in shards:
        s.page_in(state=True, pin=False)
        for page in s.pages(state=True):
            with page.lock:
                page.clean = None


_FIXES = {
    "pickling": "save model.state_dict() (or model.sharded_state_dict() with torch.distributed.checkpoint) and load "
                "it into a model wrapped anew",
    ".to()/.cuda()/.half()": "the shards stay in their files and the units compute on compute_device; move or cast "
                             "the module before wrapping it",
}


def refuse(units: Iterable[Any], what: str) -> None:
    """Raise for an operation the SSD tier does not support (pickling, ``.to()``)."""
    fix = _FIXES[what]
    for u in units:
        if any(ssd_host(h) is not None for h in u.handles):
            raise NotImplementedError(
                f"{what} is not supported for a model whose shards live on disk (offload_config="
                f"OffloadConfig(offload_type='ssd_offload')): {fix}"
            )


def _shards_of(optimizer: torch.optim.Optimizer) -> list[SsdShard]:
    seen: dict[int, SsdShard] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            s = ssd_of(p)
            if s is not None:
                seen.setdefault(id(s), s)
    return list(seen.values())


def _dispatch(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """The SSD tier's one process-wide hook, a global optimizer step pre-hook: at an optimizer's first step (and
    when its parameter groups changed) it looks for SSD-backed parameters (parameter -> handle -> shard -> tier: no
    registry); an optimizer holding some gets hooks of its own (step pre- and post-hook, state-dict pre-hook), which
    run in this step already. The tier cannot register them at wrap time: the optimizer is made after wrapping."""
    count = sum(len(g["params"]) for g in optimizer.param_groups)
    hooked = optimizer.__dict__.get(_HOOKED_ATTR)
    if hooked is not None and hooked[0] == count:
        return
    handles = hooked[1] if hooked is not None else None
    if handles is None and _shards_of(optimizer):
        # Its own fused-versions hook first: its post-hooks run before the global ones, in the order registered,
        # and the write-behind reads the version counters a fused step bumps only through that hook.
        _versions.hook_optimizer(optimizer)
        handles = (optimizer.register_step_pre_hook(_pre_step), optimizer.register_step_post_hook(_post_step),
                   optimizer.register_state_dict_pre_hook(_page_in_state))
    optimizer.__dict__[_HOOKED_ATTR] = (count, handles)


def _pre_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """The optimizer's step pre-hook: page in what it steps (reading ahead the shards stepped next)."""
    shards = _shards_of(optimizer)
    if not shards:
        return
    for s in shards:
        s.adopt_state(optimizer.state)
        s.tier.keep.gathered(s)  # in use now: no longer kept for a gather
    for s in shards:
        for nxt in s.tier.steps.use(s):
            if nxt.steps == s.steps:  # not stepped yet this round
                nxt.read_ahead(nxt.tier.config.optimizer_state)
    for s in shards:
        for page in s.pages(s.tier.config.optimizer_state):
            page.prefetch()
    pinned: list[SsdShard] = []
    try:
        for s in shards:
            s.page_in(s.tier.config.optimizer_state, pin=True)
            pinned.append(s)
    except BaseException:
        for s in pinned:
            for page in s.pages(s.tier.config.optimizer_state):
                page.unpin()
        raise
    optimizer.__dict__[_STEPPING_ATTR] = shards


def _post_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """The optimizer's step post-hook: write what it stepped behind, and evict it once written."""
    shards = optimizer.__dict__.pop(_STEPPING_ATTR, None)
    if not shards:
        return
    for s in shards:
        s.adopt_state(optimizer.state)  # state made by this (first) step
        s.steps += 1
        host = host_of(s)
        # An OffloadOptimizer update (in flight): kept for this step's forward gather, if room.
        keep = host is not None and host.in_flight and s.tier.keep.keep_for_gather(s)
        s.page_out(state=s.tier.config.optimizer_state, keep=keep)


def _page_in_state(optimizer: torch.optim.Optimizer) -> None:
    """The optimizer's state-dict pre-hook: its state of SSD-backed shards, read in."""
    shards = _shards_of(optimizer)
    for s in shards:
        s.adopt_state(optimizer.state)
    if shards:
        page_in_shards(shards)


def page_in_shards(shards: list[SsdShard]) -> None:
    for s in shards:
        s.page_in(state=True, pin=False)
        for page in s.pages(state=True):
            with page.lock:
                page.clean = None


def page_in_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """``OffloadOptimizer.state_dict()``: the user's optimizer's state of SSD-backed shards, read in."""
    _page_in_state(optimizer)


def _install_step_hook() -> None:
    """Once per process: :func:`_dispatch`, installed where every process-wide hook is (``_process_hooks``). Not
    subject to ``set_process_hooks(False)``: without it an SSD-backed model cannot be stepped at all."""
    _process_hooks.require_step_hooks("ssd_step_hooks", _dispatch)


class SsdBacking:  # the SSD tier as the host tier's host._backing.BackingStore; attach() registers it
    host_of = staticmethod(ssd_host)
    release = staticmethod(host_after_engine)
    leave = staticmethod(leave_tier)
    page_in = staticmethod(page_in_tree)
    page_in_optimizer_state = staticmethod(page_in_optimizer_state)  # OffloadOptimizer.state_dict(): the state
    tiers_below = staticmethod(tiers_below)
    main_waits = staticmethod(main_waits)


BACKING = SsdBacking()
