"""Device buffers of the offload engine and their lifetimes: slots, held copy sources, parked activations.

Nothing here issues a copy; :mod:`shardfuse.offload._engine` does, and records the events these classes keep.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shardfuse._streams import wait_event


class PendingFrees:
    """Device tensors read by the ``d2h`` stream, held until that read is over (instead of ``record_stream``).

    Each entry is a tensor and the event recorded after its last read. :meth:`collect` drops the entries whose
    event has completed (a query, no wait); :meth:`release_all` makes the compute stream wait for every event
    first, so that memory the caching allocator hands out again is never written under a running copy.
    """

    # At most this many tensors held: beyond it the oldest is released after a device-side wait of the compute
    # stream, so held copies cannot pile up while the host runs ahead of the GPU (record_stream, which this
    # replaces, let the allocator reclaim each block as soon as its copy finished; a tight memory cap needs that).
    MAX_HELD = 2

    def __init__(self) -> None:
        self._items: list[tuple[torch.Tensor, torch.cuda.Event]] = []

    def hold(self, tensor: torch.Tensor, event: torch.cuda.Event | None,
             compute: torch.cuda.Stream | None = None) -> None:
        """Keep ``tensor`` alive until ``event`` (None: the read already happened, on the CPU); past
        :attr:`MAX_HELD`, the oldest goes after ``compute`` waits for its read."""
        if event is None:
            return
        self.collect()
        self._items.append((tensor, event))
        while len(self._items) > self.MAX_HELD:
            _, old_event = self._items.pop(0)
            wait_event(compute, old_event)

    def collect(self) -> None:
        """Drop the tensors whose read has finished."""
        self._items = [(t, ev) for t, ev in self._items if not ev.query()]

    def release(self, events: Sequence[torch.cuda.Event | None], compute: torch.cuda.Stream | None) -> None:
        """Drop the tensors read by the copies behind ``events`` after a device-side wait of ``compute`` for
        each: the caller knows the compute stream is done with them, so each goes when its last other reference
        does, as with ``record_stream`` (which gave the memory back to the allocator's count at that moment)."""
        done = {id(ev) for ev in events if ev is not None}
        kept: list[tuple[torch.Tensor, torch.cuda.Event]] = []
        for t, ev in self._items:
            if id(ev) in done:
                wait_event(compute, ev)
            else:
                kept.append((t, ev))
        self._items = kept

    def release_all(self, compute: torch.cuda.Stream | None) -> None:
        """Drop every tensor after a device-side wait of ``compute`` for its read."""
        for _, ev in self._items:
            wait_event(compute, ev)
        self._items.clear()

    def __len__(self) -> int:
        return len(self._items)


class Slot:
    __slots__ = ("buf", "event")

    def __init__(self, buf: torch.Tensor) -> None:
        self.buf = buf
        self.event: torch.cuda.Event | None = None  # last device->host read of ``buf`` still in flight


class SlotPool:
    """At most ``count`` device buffers of ``numel`` elements, allocated on first use and reused."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device, count: int) -> None:
        self.numel, self.dtype, self.device, self.count = numel, dtype, device, count
        self._free: list[Slot] = []
        self._made = 0

    def has_free(self) -> bool:
        return bool(self._free) or self._made < self.count

    def acquire(self) -> Slot:
        if self._free:
            return self._free.pop()
        if self._made >= self.count:
            raise RuntimeError(f"shardfuse.offload internal error: all {self.count} {self.dtype} slots are in use")
        self._made += 1
        return Slot(self._alloc())

    def _alloc(self) -> torch.Tensor:
        return torch.empty(self.numel, dtype=self.dtype, device=self.device)

    def release(self, slot: Slot) -> None:
        self._free.append(slot)

    def clear(self) -> None:
        """Give the buffers back to the caching allocator, if none is in use."""
        if len(self._free) == self._made:
            self._free, self._made = [], 0


class Stashed:
    """A boundary activation parked in pinned host memory; ``event`` marks the end of its copy."""

    __slots__ = ("host", "device", "event")

    def __init__(self, host: torch.Tensor, device: torch.device, event: torch.cuda.Event | None) -> None:
        self.host, self.device, self.event = host, device, event


class GradBuffers:
    """The device gradient buffers of one slice's backward."""

    __slots__ = ("slot", "lp_slot", "flat", "lp_flat")

    def __init__(self, slot: Slot, lp_slot: Slot | None, n: int) -> None:
        self.slot, self.lp_slot = slot, lp_slot
        self.flat = slot.buf[:n]
        self.lp_flat = lp_slot.buf[:n] if lp_slot is not None else None

    @property
    def target(self) -> torch.Tensor:
        """Where autograd accumulates (compute dtype)."""
        return self.lp_flat if self.lp_flat is not None else self.flat
