"""The SSD tier's residency policy: the learned orders it reads ahead in (:class:`OrderLearner`), and which shards
stay in memory between two uses in one step, and for how long (:class:`Keep`).

Per step every shard (and with ``optimizer_state`` its moments) should be read once and written once, as the
disk floor counts. Two uses follow each other closely enough to keep the memory between them:

- the optimizer step, then this step's forward gather: ``OffloadOptimizer``'s worker steps the units in forward
  order; each updated shard is written behind and kept (``for_gather``) until the forward gathers it. The worker
  steps at most ``bound`` units ahead of the gathers: before stepping another unit it waits for room
  (:meth:`Keep.wait_for_room`), unless the main thread is itself waiting for the worker (a gather of a unit not
  stepped yet, ``synchronize``, a state dict): then the worker goes on and what it steps is evicted once written;
- the forward gather, then backward's gather of the same unit (``reshard_after_forward``): kept (``for_backward``)
  after the forward's host-to-device copy; beyond ``bound`` the one gathered first is evicted (backward gathers
  in reverse, so the last ones of the forward are those it needs first).

Eviction follows use: a kept shard goes when the gather that was waiting for it has copied it. At most ``bound``
shards are kept for each kind of next use; ``peak`` records the most kept at once (tests).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import OrderedDict, deque
from collections.abc import Iterator
from typing import Any


class Keep:
    """The shards of one tier kept resident between two uses (see the module docstring)."""

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self._cond = threading.Condition()
        # Weak references: a kept shard does not keep its model (and its files) alive.
        self.for_gather: OrderedDict[int, weakref.ref] = OrderedDict()  # SsdShards stepped, waiting for a gather
        self.for_backward: OrderedDict[int, tuple[weakref.ref, Any]] = OrderedDict()  # (SsdShard, copy event)
        self._waits: list[Any] = []  # what the main thread waits for now: HostShards (their update), None (all)
        self.peak = (0, 0)  # the most shards kept at once, for a gather and for backward (tests)
        # Bytes of stepped shards not kept for their gather (no room while the main thread waited for the worker):
        # each is read again at its gather, the one read per step the floor does not count (tests, stats).
        self.refused_bytes = 0

    def _note_peak(self) -> None:
        self.peak = (max(self.peak[0], len(self.for_gather)), max(self.peak[1], len(self.for_backward)))

    def wait_for_room(self, shard: Any) -> None:
        """Worker thread, before stepping ``shard``: wait until another stepped shard may be kept (or the main
        thread waits for the worker)."""
        with self._cond:
            self.for_gather.pop(id(shard), None)
            while len(self.for_gather) >= self.bound and not self._main_blocked():
                self._cond.wait()

    def _main_blocked(self) -> bool:
        """(condition held) The main thread waits for an update not done yet (or for every update)."""
        return any(host is None or host.in_flight for host in self._waits)

    def keep_for_gather(self, shard: Any) -> bool:
        """After ``shard``'s step: keep it for its gather if there is room (else it is evicted once written)."""
        with self._cond:
            if len(self.for_gather) >= self.bound:
                self.refused_bytes += shard.param.nbytes
                return False
            self.for_gather[id(shard)] = weakref.ref(shard)
            self._note_peak()
            return True

    def gathered(self, shard: Any) -> None:
        """Main thread, a gather of ``shard`` reads it now: neither kind of keep waits for it any longer."""
        with self._cond:
            found = self.for_gather.pop(id(shard), None) is not None
            self.for_backward.pop(id(shard), None)
            if found:
                self._cond.notify_all()

    def keep_for_backward(self, shard: Any, event: Any) -> list[tuple[Any, Any]]:
        """After a forward gather copied ``shard`` (backward gathers it again): keep it; returns the (shard, copy
        event) pairs that no longer fit, gathered first, for the caller to evict."""
        with self._cond:
            self.for_backward[id(shard)] = (weakref.ref(shard), event)
            over = len(self.for_backward) - self.bound
            evicted = [self.for_backward.popitem(last=False)[1] for _ in range(max(0, over))]
            self._note_peak()
        return [(s, event) for ref, event in evicted if (s := ref()) is not None]

    @contextlib.contextmanager
    def main_waits(self, host: Any = None) -> Iterator[None]:
        """The main thread waits for ``host``'s update (None: for the worker to finish): meanwhile the worker does
        not wait for room, as the gather that would make room may come only after that update."""
        with self._cond:
            self._waits.append(host)
            self._cond.notify_all()
        try:
            yield
        finally:
            with self._cond:
                self._waits.remove(host)

    def kept(self) -> list[Any]:
        """The shards kept now (either kind)."""
        with self._cond:
            refs = [*self.for_gather.values(), *(ref for ref, _ in self.for_backward.values())]
        return [s for s in (ref() for ref in refs) if s is not None]


class OrderLearner:
    """Learns which items follow which: after a pair ``(a, b)`` came the items it returns for it next time."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self._hist: deque[weakref.ref] = deque(maxlen=depth + 2)
        self._follow: dict[tuple[int, int], list[weakref.ref]] = {}
        self._lock = threading.Lock()

    def use(self, item: Any) -> list[Any]:
        """Record ``item`` as used now; return what followed the last two items the last time."""
        with self._lock:
            self._hist.append(weakref.ref(item))
            h = list(self._hist)
            if len(h) == self.depth + 2:
                self._follow[(id(h[0]()), id(h[1]()))] = h[2:]
            if len(h) < 2:
                return []
            nxt = self._follow.get((id(h[-2]()), id(h[-1]())), [])
        return [x for x in (r() for r in nxt) if x is not None and x is not item]
