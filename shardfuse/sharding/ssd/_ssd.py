"""The SSD offload tier: flat shards (and optionally their optimizer state) that live in files between uses.

Where the data of an SSD-backed flat parameter is, at each phase of a step:

- between uses: in its file only; the parameter (and each offloaded optimizer-state tensor) keeps its shape and
  dtype but its storage is resized to 0 bytes, so a path that forgets to page it in fails loudly;
- gather (forward, backward): :class:`SsdHostShard` reads the file into the shard's own storage (pinned memory
  from torch's caching host allocator on a GPU machine, so the storage of an evicted shard is reused by the next
  one), the host-to-device copy reads it there, and the storage is given back once that copy's event completed;
- optimizer step (an ``OffloadOptimizer`` task on its worker thread, or a plain optimizer's ``step()``): a
  process-wide optimizer step pre-hook pages in the parameters (and state) the optimizer holds, the post-hook
  writes them behind and gives the memory back when the writes are done;
- gradients stay in the pinned host buffers of :class:`~shardfuse.sharding.host._host_shard.HostShard`.

Read-ahead: two learned sequences (:class:`OrderLearner`), the gathers and the optimizer steps, each remembering
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
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from shardfuse.sharding.core import _process_hooks
from shardfuse.sharding.core._flat_param import FlatParamHandle
from shardfuse.sharding.core._registry import handle_of
from shardfuse.sharding.host import _backing
from shardfuse.sharding.host._host_shard import HostShard
from shardfuse.sharding.ssd._ssd_config import OffloadConfig
from shardfuse.sharding.ssd._ssd_keep import Keep, OrderLearner
from shardfuse.sharding.ssd._ssd_store import IOOp, SsdStore, TensorFile, store_for

logger = logging.getLogger(__name__)

_STEPPING_ATTR = "_shardfuse_ssd_stepping"  # on an optimizer between its step pre- and post-hook


class Tier:
    """What the SSD-backed shards of one directory and setting share: the store, the learned orders, the shards
    read ahead but not used yet."""

    def __init__(self, config: OffloadConfig) -> None:
        self.config = config
        self.store: SsdStore = store_for(config.directory or "", config.io_threads, config.chunk_mb,
                                               config.direct_io)
        self.gathers = OrderLearner(config.read_ahead)
        self.keep = Keep(config.read_ahead)  # shards kept in memory between two uses in one step (_ssd_keep.py)
        self.steps = OrderLearner(config.read_ahead)
        self._unused: OrderedDict[int, weakref.ref[Page]] = OrderedDict()
        self._lock = threading.Lock()
        self.largest = 0  # bytes of the largest page: bounds the writes in flight
        self.pages_per_shard = 1  # the parameter and its offloaded optimizer states (bounds the unused read-ahead)

    def read_ahead(self, page: Page) -> None:
        if not page.prefetch():
            return
        with self._lock:
            self._unused[id(page)] = weakref.ref(page)
            over = len(self._unused) - 4 * self.config.read_ahead * self.pages_per_shard
            stale = [self._unused.popitem(last=False)[1]() for _ in range(max(0, over))]
        for p in stale:
            if p is not None:
                p.give_back()

    def used(self, page: Page) -> None:
        with self._lock:
            self._unused.pop(id(page), None)

    def write_room(self, nbytes: int) -> Any:
        return self.store.reserve(nbytes, self.config.read_ahead * max(self.largest, nbytes))


_TIERS: dict[OffloadConfig, Tier] = {}


@contextlib.contextmanager
def main_waits() -> Iterator[None]:
    """The caller waits for the ``OffloadOptimizer`` worker (closing it): no update waits for room to keep."""
    with contextlib.ExitStack() as stack:
        for tier in list(_TIERS.values()):
            stack.enter_context(tier.keep.main_waits())
        yield


def tier_for(config: OffloadConfig) -> Tier:
    tier = _TIERS.get(config)
    if tier is None:
        tier = _TIERS[config] = Tier(config)
    return tier


class Page:
    """One tensor whose memory comes and goes; while evicted its values live in ``file`` only.

    Every change of state happens under the shard's ``lock``; waits for I/O happen outside it. ``clean`` is the
    tensor's version when its memory last equalled the file (None: unknown, written back before eviction).
    """

    def __init__(self, tensor: torch.Tensor, file: TensorFile, lock: threading.Lock, tier: Tier,
                 strong: bool) -> None:
        self._strong = tensor if strong else None
        self._weak = weakref.ref(tensor)
        self.file = file
        self.lock = lock
        self.tier = tier
        self.nbytes = tensor.numel() * tensor.element_size()
        tier.largest = max(tier.largest, self.nbytes)
        self.resident = True
        self.pins = 0
        self.clean: int | None = None
        self.evict_wanted = False
        self.detached = False
        self.reading: IOOp | None = None
        self.writes = 0  # queued writes not done yet: a write reads the memory until it is done
        self.error: BaseException | None = None

    @property
    def tensor(self) -> torch.Tensor | None:
        return self._strong if self._strong is not None else self._weak()

    def _start_read(self, t: torch.Tensor) -> IOOp | None:
        """(lock held) Allocate and queue the read of an evicted tensor; return the read in flight, if any."""
        if not self.resident:
            t.untyped_storage().resize_(self.nbytes)
            self.resident = True
            self.clean = t._version
            self.reading = self.file.read(t, on_done=self._read_done)
        return self.reading

    def _read_done(self, err: BaseException | None) -> None:
        with self.lock:
            self.reading = None
            t = self.tensor
            if err is not None and t is not None:  # the memory holds garbage: the waiters raise
                t.untyped_storage().resize_(0)
                self.resident = False

    def prefetch(self) -> bool:
        """Start reading an evicted tensor in; False when there was nothing to do."""
        t = self.tensor
        with self.lock:
            if t is None or self.resident or self.detached:
                return False
            self._start_read(t)
            return True

    def page_in(self, pin: bool) -> None:
        """Make the tensor resident (wait for its read); ``pin``: keep it so until :meth:`page_out`."""
        t = self.tensor
        if t is None:
            return
        self.tier.used(self)
        with self.lock:
            self.evict_wanted = False
            err, self.error = self.error, None
            reading = self._start_read(t)
            if pin:
                self.pins += 1
        if err is not None:
            if pin:
                self.unpin()
            raise RuntimeError(f"{err} (the values are kept in memory; the next eviction writes them again)") \
                from err
        if reading is not None:
            try:
                reading.wait()
            except OSError:
                if pin:
                    self.unpin()
                raise

    def unpin(self) -> None:
        with self.lock:
            self.pins = max(0, self.pins - 1)

    def page_out(self, event: Any = None, keep: bool = False) -> None:
        """Release a pin; when none is left, write the tensor back if it changed and give its memory back once
        the write (and ``event``, a copy still reading it) is done; ``keep``: written back, kept in memory."""
        t = self.tensor
        if t is None:
            return
        release = self.tier.write_room(self.nbytes) if self.clean != t._version else None
        with self.lock:
            self.pins = max(0, self.pins - 1)
            if self.pins or not self.resident or self.detached:
                if release is not None:
                    release()
                return
            self.evict_wanted = not keep
            if self.clean != t._version:
                self.clean = t._version
                self.writes += 1
                self.file.write(t, on_done=lambda err: self._written(err, release))
            elif release is not None:
                release()
        if not keep:
            self.file.then(lambda: self._drop(event))

    def give_back(self, event: Any = None) -> None:
        """Evict a tensor read ahead (or kept) but not used (nothing to write: it equals its file) once ``event``
        (a copy still reading it) is done."""
        with self.lock:
            if self.pins or not self.resident:
                return
            self.evict_wanted = True
        self.file.then(lambda: self._drop(event))

    def _written(self, err: BaseException | None, release: Any) -> None:
        if release is not None:
            release()
        if err is not None:
            logger.error("%s", err)
        with self.lock:
            self.writes -= 1
            if err is not None:
                self.error = err
                self.clean = None  # the file is stale: the memory is kept and written again at the next eviction

    def _drop(self, event: Any) -> None:
        if event is not None:
            event.synchronize()  # a host-to-device copy still reading the memory
        t = self.tensor
        with self.lock:
            if (t is None or not self.evict_wanted or self.pins or self.writes or not self.resident or self.detached
                    or self.error is not None or self.clean != t._version):
                return
            t.untyped_storage().resize_(0)
            self.resident = False
            self.evict_wanted = False

    def detach(self) -> None:
        """Stay resident for good (the tensor leaves the SSD tier)."""
        self.page_in(pin=False)
        with self.lock:
            self.detached = True


def own_storage(t: torch.Tensor, pin: bool) -> None:
    """Give ``t`` a storage of its own that can be resized (evicted), pinned when ``pin`` (torch's caching host
    allocator: an evicted tensor's block is reused by the next one read in). ``pin_memory()`` and numpy-shared
    storages cannot be resized, a view shares its storage with others: those are copied once, here."""
    storage = t.untyped_storage()
    owns = t.storage_offset() == 0 and storage.nbytes() == t.numel() * t.element_size()
    if owns and storage.resizable() and (not pin or t.is_pinned()):
        return
    with torch.no_grad():
        t.data = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin).copy_(t)


class SsdShard:
    """The file-backed home of one flat shard and (``optimizer_state=True``) its per-element optimizer state."""

    def __init__(self, handle: FlatParamHandle, tier: Tier, name: str) -> None:
        self.tier = tier
        self.name = name
        self.lock = threading.Lock()
        self.handle = weakref.ref(handle)
        self.flat = handle.flat
        self.param = Page(self.flat, tier.store.new_file(name), self.lock, tier, strong=True)
        self.state_pages: dict[tuple[int, str], Page] = {}
        self._state_files: dict[tuple[int, str], TensorFile] = {}
        self.steps = 0  # optimizer steps taken (read-ahead of the steps skips shards already stepped this round)
        # The first write, synchronous: a directory that cannot take it fails at wrap time.
        self.param.page_out()
        self.param.file.then(lambda: None).wait()
        if self.param.error is not None:
            raise self.param.error
        if self.flat.untyped_storage().nbytes():
            raise RuntimeError(f"SSD offload: the shard {name} was written to {self.param.file.path} but its memory "
                               f"could not be given back (its storage cannot be resized): please report this")

    def params(self) -> list[torch.Tensor]:
        """The tensors an optimizer may hold for this shard: the flat parameter, or its original-parameter views."""
        h = self.handle()
        views = h.orig_views if h is not None else None
        return [self.flat] if views is None else list(views)

    def adopt_state(self, state: Any) -> None:
        """Track the per-element optimizer state of this shard's parameters in ``state`` (an optimizer's)."""
        if not self.tier.config.optimizer_state:
            return
        for i, p in enumerate(self.params()):
            st = state.get(p)
            for key, v in (st or {}).items():
                if not (isinstance(v, torch.Tensor) and v.device.type == "cpu" and v.numel() == p.numel()
                        and v.numel() > 0 and v.is_contiguous()):
                    continue
                page = self.state_pages.get((i, key))
                if page is not None and page.tensor is v:
                    continue
                own_storage(v, torch.cuda.is_available())
                file = self._state_files.get((i, key))
                if file is None:
                    file = self._state_files[(i, key)] = self.tier.store.new_file(f"{self.name}-state{i}-{key}")
                self.state_pages[(i, key)] = Page(v, file, self.lock, self.tier, strong=False)
        self.tier.pages_per_shard = max(self.tier.pages_per_shard, 1 + len(self.state_pages))

    def pages(self, state: bool) -> list[Page]:
        return [self.param, *self.state_pages.values()] if state else [self.param]

    def read_ahead(self, state: bool) -> None:
        for page in self.pages(state):
            self.tier.read_ahead(page)

    def page_in(self, state: bool, pin: bool) -> None:
        pages = self.pages(state)
        for page in pages:
            page.prefetch()  # every read in flight at once, then wait
        for page in pages:
            page.page_in(pin)

    def page_out(self, state: bool, keep: bool = False) -> None:
        """Write back what changed; evict it once written, except the parameter when ``keep``."""
        for page in self.pages(state):
            page.page_out(keep=keep and page is self.param)

    def settle(self) -> None:
        """Wait for the reads and write-backs queued on this shard's files."""
        for page in self.pages(state=True):
            page.file.settle()

    def leave(self) -> None:
        """The shard leaves the SSD tier (kept resident, e.g. on the GPU from now on); its files go with it."""
        for page in self.pages(state=True):
            page.detach()


class SsdHostShard(HostShard):
    """A :class:`HostShard` whose fp32 shard is read from its file for each gather (no compute-dtype host copy:
    the file holds the fp32 shard, which the device casts)."""

    def __init__(self, flat: torch.Tensor, ssd: SsdShard, pin: bool, unit: Any = None) -> None:
        super().__init__(flat, flat.dtype, pin)
        self.ssd = ssd
        self._gathering = False
        self._unit = weakref.ref(unit) if unit is not None else None  # the runtime Unit: is a backward gather due?

    def wait_ready(self) -> None:
        """As :meth:`HostShard.wait_ready`; while blocked, the worker steps on without waiting for room to keep."""
        if not self.in_flight:
            super().wait_ready()
            return
        with self.ssd.tier.keep.main_waits(self):
            super().wait_ready()

    def before_step(self, in_backward: bool) -> None:
        """Worker thread, before this shard's update: step at most ``read_ahead`` units ahead of the gathers
        (the updated shards are kept for them). Not for updates in backward: their gathers come after it."""
        if not in_backward:
            self.ssd.tier.keep.wait_for_room(self.ssd)

    def _regathered(self) -> bool:
        """A forward gather whose unit backward gathers again (``reshard_after_forward``)."""
        unit = self._unit() if self._unit is not None else None
        rs = unit.root_state if unit is not None else None  # the forward's prefetch gathers a unit still IDLE
        if unit is None or rs is None or rs.in_backward or not torch.is_grad_enabled():
            return False
        return bool(unit.reshard_after_forward) and not unit._keep_full_for_backward()

    def source_for_gather(self, flat: torch.Tensor) -> torch.Tensor:
        self.wait_ready()
        tier = self.ssd.tier
        for nxt in tier.gathers.use(self.ssd):
            host = _host_of(nxt)
            # Not a shard with an update pending: its file is about to change.
            if host is not None and not host.in_flight and nxt.flat.grad is None:
                tier.read_ahead(nxt.param)
        self.ssd.param.page_in(pin=True)
        tier.keep.gathered(self.ssd)
        self._gathering = True
        return flat.detach()

    def note_h2d(self, stream: torch.cuda.Stream | None) -> None:
        super().note_h2d(stream)
        if self._gathering:
            self._gathering = False
            if not self._regathered():
                self.ssd.param.page_out(self.h2d_event)
                return
            self.ssd.param.page_out(keep=True)  # for backward's gather; the one gathered first goes beyond the bound
            for shard, event in self.ssd.tier.keep.keep_for_backward(self.ssd, self.h2d_event):
                shard.param.give_back(event)

    def reset_for_plain_optimizer(self) -> SsdHostShard:
        """What an ``OffloadOptimizer`` set on this host shard, undone (it closed; a plain optimizer steps now)."""
        self.keep_full_in_no_sync = False
        self.on_grad_sent = None
        return self

    def __getstate__(self) -> dict:
        raise TypeError("an SSD-offloaded shard cannot be pickled: its values live in a file of this process")


def _host_of(shard: SsdShard) -> SsdHostShard | None:
    h = shard.handle()
    host = h.host if h is not None else None
    return host if isinstance(host, SsdHostShard) else None


def ssd_of(p: torch.Tensor) -> SsdShard | None:
    """The SSD shard a parameter (flat, or an original-parameter view) belongs to, if any."""
    h = handle_of(p)
    host = h.host if h is not None else None
    return host.ssd if isinstance(host, SsdHostShard) else None


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
    tier = tier_for(config)
    _install_step_hooks()
    _backing.register(BACKING)
    for i, h in enumerate(handles):
        if h.flat.device.type != "cpu" or h.host is not None:
            continue
        name = f"{unit_name}-flat{i}".replace("/", "_").replace(" ", "")[:80]
        if not h.flat.untyped_storage().resizable():
            raise RuntimeError(f"the shards of {unit_name} need prepare() before their views are made")
        h.host = SsdHostShard(h.flat, SsdShard(h, tier, name), pin=torch.cuda.is_available(), unit=unit)


def ssd_host(h: FlatParamHandle) -> SsdHostShard | None:
    """The handle's file-backed host shard, if it has one (``OffloadOptimizer`` keeps it rather than make its own)."""
    return h.host if isinstance(h.host, SsdHostShard) else None


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


def _pre_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Global optimizer step pre-hook: page in what ``optimizer`` steps (reading ahead the shards stepped next)."""
    shards = _shards_of(optimizer)
    if not shards:
        return
    _hook_state_dict(optimizer)
    for s in shards:
        s.adopt_state(optimizer.state)
        s.tier.keep.gathered(s)  # in use now: no longer kept for a gather
    state = shards[0].tier.config.optimizer_state
    for s in shards:
        for nxt in s.tier.steps.use(s):
            if nxt.steps == s.steps:  # not stepped yet this round
                nxt.read_ahead(state)
    for s in shards:
        for page in s.pages(state):
            page.prefetch()
    pinned: list[SsdShard] = []
    try:
        for s in shards:
            s.page_in(state, pin=True)
            pinned.append(s)
    except BaseException:
        for s in pinned:
            for page in s.pages(state):
                page.unpin()
        raise
    optimizer.__dict__[_STEPPING_ATTR] = shards


def _post_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Global optimizer step post-hook: write what ``optimizer`` stepped behind, and evict it once written."""
    shards = optimizer.__dict__.pop(_STEPPING_ATTR, None)
    if not shards:
        return
    for s in shards:
        s.adopt_state(optimizer.state)  # state made by this (first) step
        s.steps += 1
        host = _host_of(s)
        # An OffloadOptimizer update (in flight): kept for this step's forward gather, if room.
        keep = host is not None and host.in_flight and s.tier.keep.keep_for_gather(s)
        s.page_out(state=s.tier.config.optimizer_state, keep=keep)


def _page_in_state(optimizer: torch.optim.Optimizer) -> None:
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


_hooked_optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()


def _hook_state_dict(optimizer: torch.optim.Optimizer) -> None:
    """A plain optimizer's ``state_dict()`` reads its state: page it in first."""
    if optimizer not in _hooked_optimizers:
        optimizer.register_state_dict_pre_hook(_page_in_state)
        _hooked_optimizers.add(optimizer)


def _install_step_hooks() -> None:
    """Once per process: the optimizer step hooks that page SSD-backed shards in and out around any step, installed
    where every process-wide hook is (``_process_hooks``, after the hook that counts a fused optimizer's writes).
    Not subject to ``set_process_hooks(False)``: without them an SSD-backed model cannot be stepped at all."""
    _process_hooks.require_step_hooks("ssd_step_hooks", _pre_step, _post_step)


class SsdBacking:  # the SSD tier as the host tier's host._backing.BackingStore; attach() registers it
    host_of = staticmethod(ssd_host)
    release = staticmethod(host_after_engine)
    leave = staticmethod(leave_tier)
    page_in = staticmethod(page_in_tree)
    page_in_optimizer_state = staticmethod(_page_in_state)  # OffloadOptimizer.state_dict(): the state, read in
    main_waits = staticmethod(main_waits)


BACKING = SsdBacking()
