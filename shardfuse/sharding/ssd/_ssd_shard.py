"""The SSD tier's objects: :class:`Tier` (what the shards of one model and setting share), :class:`SsdShard` (the
file-backed home of one flat shard and its optimizer state) and :class:`SsdHostShard` (the host shard a gather reads
it through). How they are wired into wrapping, gathers and optimizer steps: ``_ssd.py``.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import OrderedDict
from typing import Any

import torch

from shardfuse.sharding.core._flat_param import FlatParamHandle
from shardfuse.sharding.core._registry import handle_of
from shardfuse.sharding.core._tree import clean_key, unit_of
from shardfuse.sharding.host._host_shard import HostShard
from shardfuse.sharding.ssd._ssd_config import OffloadConfig
from shardfuse.sharding.ssd._ssd_face import Label
from shardfuse.sharding.ssd._ssd_keep import Keep, OrderLearner
from shardfuse.sharding.ssd._ssd_page import Page, PageState
from shardfuse.sharding.ssd._ssd_store import SsdStore, TensorFile, new_store

logger = logging.getLogger(__name__)

_READ_PARAMS = ("read the parameters inside `with model.summon_full_params():` or through model.state_dict() "
                "(each reads the shards in from disk first)")
_READ_STATE = "read the optimizer state through optimizer.state_dict() (it reads the state in from disk first)"


class Tier:
    """What the SSD-backed shards of one model and setting share: the store (its own folder and I/O threads, owned
    here: freed with the model), the learned orders, the shards read ahead but not used yet."""

    def __init__(self, config: OffloadConfig) -> None:
        self.config = config
        self.store: SsdStore = new_store(config.directory or "", config.io_threads, config.chunk_mb, config.direct_io)
        self.gathers = OrderLearner(config.read_ahead)
        self.keep = Keep(config.read_ahead)  # shards kept in memory between two uses in one step (_ssd_keep.py)
        self.steps = OrderLearner(config.read_ahead)
        self._unused: OrderedDict[int, weakref.ref[Page]] = OrderedDict()
        self._failures: dict[int, tuple[weakref.ref[Page], BaseException]] = {}  # write-behinds not reported yet
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

    def used(self, page: Page, report: bool = False) -> None:
        """``page`` is used now (no longer read ahead but unused); ``report``: raise the write-behinds that failed
        since the last report, all of them at once."""
        with self._lock:
            self._unused.pop(id(page), None)
            if not (report and self._failures):
                return
            failures, self._failures = self._failures, {}
        _raise_failures(list(failures.values()))

    def failed(self, page: Page, err: BaseException) -> None:
        """I/O thread: the write-behind of ``page`` failed (its values stay in memory): the next use raises it."""
        with self._lock:
            self._failures[id(page)] = (weakref.ref(page), err)

    def forget_failure(self, page: Page) -> None:
        with self._lock:
            self._failures.pop(id(page), None)

    def write_room(self, nbytes: int) -> Any:
        return self.store.reserve(nbytes, self.config.read_ahead * max(self.largest, nbytes))


def _raise_failures(failures: list[tuple[weakref.ref[Page], BaseException]]) -> None:
    """Raise one error for the failed write-behinds of these pages (each stays FAILED until written again)."""
    lines = []
    for ref, err in failures:
        page = ref()
        if page is None:
            continue
        lines.append(f"{page.name()}: {err}")
    if not lines:
        return
    first = failures[0][1]
    raise RuntimeError(
        f"SSD offload: writing the values of {len(lines)} tensor(s) behind to their files failed: "
        + "; ".join(lines) + ". Nothing is lost: the values are kept in memory (state dicts and checkpoints read "
        "them) and written again at their next eviction; free space on the disk (or fix its fault) and go on, or "
        "save a checkpoint now") from first


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

    def __init__(self, handle: FlatParamHandle, tier: Tier, name: str, unit: Any = None, index: int = 0) -> None:
        self.tier = tier
        self.name = name
        self.unit = weakref.ref(unit) if unit is not None else None  # the runtime Unit, to name the parameters
        self.index = index  # the handle's index in its unit: flat_param_<index>
        self.lock = threading.Lock()
        self.handle = weakref.ref(handle)
        self.flat = handle.flat
        self._faces: tuple[Any, list[tuple[torch.Tensor, Label]]] = (False, [])
        self.param = Page(self.flat, tier.store.new_file(name), self.lock, tier, strong=True, faces=self.param_faces)
        self._source = self.flat.detach()
        self.param.internal = 1  # _source
        self.state_pages: dict[tuple[int, str], Page] = {}
        self._state_files: dict[tuple[int, str], TensorFile] = {}
        self.steps = 0  # optimizer steps taken (read-ahead of the steps skips shards already stepped this round)
        # The first write, synchronous: a directory that cannot take it fails at wrap time.
        self.param.page_out()
        self.param.file.then(lambda: None).wait()
        if self.param.state is PageState.FAILED:
            tier.forget_failure(self.param)  # raised here, at wrap time
            raise self.param.failure  # type: ignore[misc]
        if self.flat.untyped_storage().nbytes():
            raise RuntimeError(f"SSD offload: the shard {name} was written to {self.param.file.path} but its memory "
                               f"could not be given back (its storage cannot be resized): please report this")

    def param_faces(self) -> list[tuple[torch.Tensor, Label]]:
        """The flat parameter and its original-parameter views, with their labels (made again when the views are)."""
        h = self.handle()
        views = h.orig_views if h is not None else None
        if self._faces[0] is not views:
            faces: list[tuple[torch.Tensor, Label]] = [(self.flat, _labeller(self, None))]
            faces += [(v, _labeller(self, j)) for j, v in enumerate(views or ())]
            self._faces = (views, faces)
        return self._faces[1]

    def label(self, view: int | None, state: str | None = None) -> tuple[str, str]:
        """What the on-disk face's error says of the flat parameter (``view`` None) or of an original-parameter
        view, or of its optimizer state ``state``: its name in the model (FairScale's clean names), and the fix."""
        h, unit = self.handle(), self.unit() if self.unit is not None else None
        names = h.names if h is not None else []
        prefix = _unit_path(unit)
        if view is None:
            held = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            name = f"{prefix}flat_param_{self.index} (the flat shard of {held})"
        else:
            name = f"{prefix}{names[view] if view < len(names) else view}"
        if state is not None:
            return f"the optimizer state {state!r} of {name}", _READ_STATE
        return name, _READ_PARAMS

    def source(self, flat: torch.Tensor) -> torch.Tensor:
        """The flat shard as a plain tensor for a gather's copy: one alias kept by the tier (counted among the
        page's holders), so a caller still holding it does not keep the memory from being given back."""
        if self._source.data_ptr() != flat.data_ptr():  # ``flat.data`` was replaced
            self._source = flat.detach()
        return self._source

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
                label = _labeller(self, None if self.params()[0] is self.flat else i, key)
                self.state_pages[(i, key)] = Page(v, file, self.lock, self.tier, strong=False,
                                                  faces=_state_faces(v, label))
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

    def move_to(self, tier: Tier) -> None:
        """Wrap time: share ``tier`` (a unit wrapped around this shard's unit made the tiers of its tree one); the
        files move into its store's folder."""
        self.tier = tier
        for file in {id(f): f for f in [self.param.file, *self._state_files.values()]}.values():
            file.move_to(tier.store)
        for page in self.pages(state=True):
            page.tier = tier
            tier.largest = max(tier.largest, page.nbytes)
        tier.pages_per_shard = max(tier.pages_per_shard, 1 + len(self.state_pages))

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
            host = host_of(nxt)
            # Not a shard with an update pending: its file is about to change.
            if host is not None and not host.in_flight and nxt.flat.grad is None:
                tier.read_ahead(nxt.param)
        unit = self._unit() if self._unit is not None else None
        rs = unit.root_state if unit is not None else None
        self.ssd.param.page_in(pin=True, report=rs is None or not rs.in_backward)  # failed writes: before compute
        tier.keep.gathered(self.ssd)
        self._gathering = True
        return self.ssd.source(flat)

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
        self.pending_scale = None
        return self

    def __getstate__(self) -> dict:
        raise TypeError("an SSD-offloaded shard cannot be pickled: its values live in a file of this process")


def _labeller(shard: SsdShard, view: int | None, state: str | None = None) -> Label:
    """``shard.label(view, state)`` for a face's error, without a reference from the tensor to its shard."""
    ref = weakref.ref(shard)

    def label() -> tuple[str, str]:
        s = ref()
        return s.label(view, state) if s is not None else ("a tensor of a freed SSD-offloaded model", "")

    return label


def _state_faces(v: torch.Tensor, label: Label) -> Any:
    """An optimizer-state page's faces: the state tensor (held weakly, as the page holds it)."""
    ref = weakref.ref(v)

    def faces() -> list[tuple[torch.Tensor, Label]]:
        t = ref()
        return [] if t is None else [(t, label)]

    return faces


def _unit_path(unit: Any) -> str:
    """The path of ``unit`` in its tree, as the model's clean names start (``"blocks.0."``; ``""`` at the root)."""
    top = unit
    while getattr(top, "parent", None) is not None:
        top = top.parent
    if top is None or top is unit:
        return ""
    for path, m in top.module.named_modules():
        if unit_of(m) is unit:
            return f"{clean_key(path)}."
    return f"{unit.name}: "


def host_of(shard: SsdShard) -> SsdHostShard | None:
    h = shard.handle()
    host = h.host if h is not None else None
    return host if isinstance(host, SsdHostShard) else None


def ssd_of(p: torch.Tensor) -> SsdShard | None:
    """The SSD shard a parameter (flat, or an original-parameter view) belongs to, if any."""
    h = handle_of(p)
    host = h.host if h is not None else None
    return host.ssd if isinstance(host, SsdHostShard) else None


def ssd_host(h: FlatParamHandle) -> SsdHostShard | None:
    """The handle's file-backed host shard, if it has one (``OffloadOptimizer`` keeps it rather than make its own)."""
    return h.host if isinstance(h.host, SsdHostShard) else None
