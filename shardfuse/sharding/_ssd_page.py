"""One tensor of the SSD offload tier whose memory comes and goes (:class:`Page`): read in from its file for a use,
written behind after it, given back once written.

While the tier does not use a tensor (between its uses, while it is read ahead, written behind or kept for its next
use) the tensor wears its on-disk face (``_ssd_face.py``): reading it raises an error naming it. It is itself again
while the tier uses it (pinned) and after a state-dict path read it in for the caller, until its next training use.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from shardfuse.sharding._ssd_face import Label, held_elsewhere, hide, show
from shardfuse.sharding._ssd_store import IOOp, TensorFile

logger = logging.getLogger(__name__)

Faces = Callable[[], list[tuple[torch.Tensor, Label]]]  # the tensors that show a page's memory to the user


class Page:
    """One tensor whose memory comes and goes; while evicted its values live in ``file`` only.

    Every change of state happens under the shard's ``lock``; waits for I/O happen outside it. ``clean`` is the
    tensor's version when its memory last equalled the file (None: unknown, written back before eviction).
    ``faces``: the tensors the user holds that show this memory (the tensor, and views of it) with their labels.
    """

    def __init__(self, tensor: torch.Tensor, file: TensorFile, lock: threading.Lock, tier: Any,
                 strong: bool, faces: Faces) -> None:
        self._strong = tensor if strong else None
        self._weak = weakref.ref(tensor)
        self.file = file
        self.lock = lock
        self.tier = tier
        self.faces = faces
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
        self.internal = 0  # aliases of the memory the tier itself keeps (not the user's)
        self.held_warned = False

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

    def page_in(self, pin: bool, report: bool = False) -> None:
        """Make the tensor resident (wait for its read) and readable; ``pin``: keep it so until :meth:`page_out`;
        ``report``: first raise the write-behinds of the tier that failed (a forward's gather: before the step
        computes anything). Other uses read the values kept in memory and write them again."""
        t = self.tensor
        if t is None:
            return
        self.tier.used(self, report)
        with self.lock:
            self.evict_wanted = False
            if pin:
                self.pins += 1
            reading = self._start_read(t)
        if reading is not None:
            try:
                reading.wait()
            except BaseException as read_err:
                if pin:
                    self.unpin()
                raise RuntimeError(f"SSD offload: reading {self.name()} in from {self.file.path} failed: {read_err}; "
                                   f"its file is kept, the next use reads it again") from read_err
        with self.lock:
            if self.resident:
                show(self.faces())

    def name(self) -> str:
        """The tensor as the user's model names it (its first face's label), else its file."""
        faces = self.faces()
        return faces[0][1]()[0] if faces else self.file.path

    def unpin(self) -> None:
        with self.lock:
            self.pins = max(0, self.pins - 1)
            if not self.pins and not self.detached:
                hide(self.faces())

    def page_out(self, event: Any = None, keep: bool = False) -> None:
        """Release a pin; when none is left, write the tensor back if it changed and give its memory back once
        the write (and ``event``, a copy still reading it) is done; ``keep``: written back, kept in memory."""
        t = self.tensor
        if t is None:
            return
        release = self.tier.write_room(self.nbytes) if self.clean != t._version else None
        with self.lock:
            self.pins = max(0, self.pins - 1)
            if self.pins or self.detached:
                if release is not None:
                    release()
                return
            hide(self.faces())  # no longer the caller's to read: the I/O threads write it and give it back
            if not self.resident:
                if release is not None:
                    release()
                return
            self.evict_wanted = not keep
            if self.clean != t._version:
                self.clean = t._version
                self.writes += 1
                try:
                    self.file.write(t, on_done=lambda err: self._written(err, release))
                except BaseException:  # not queued: nothing will call _written
                    self.writes -= 1
                    self.clean = None
                    if release is not None:
                        release()
                    raise
            elif release is not None:
                release()
        if not keep:
            self.file.then(lambda: self._drop(event))

    def give_back(self, event: Any = None) -> None:
        """Evict a tensor read ahead (or kept) but not used (nothing to write: it equals its file) once ``event``
        (a copy still reading it) is done."""
        with self.lock:
            if self.pins or not self.resident or self.detached:
                return
            hide(self.faces())
            self.evict_wanted = True
        self.file.then(lambda: self._drop(event))

    def _written(self, err: BaseException | None, release: Any) -> None:
        if release is not None:
            release()
        if err is not None:
            logger.error("SSD offload: %s: %s (the values are kept in memory; raised at the next use of the tier)",
                         self.name(), err)
        with self.lock:
            self.writes -= 1
            if err is not None:
                self.error = err
                self.clean = None  # the file is stale: the memory is kept and written again at the next eviction
        if err is not None:
            self.tier.failed(self, err)

    def _drop(self, event: Any) -> None:
        if event is not None:
            event.synchronize()  # a host-to-device copy still reading the memory
        t = self.tensor
        with self.lock:
            if (t is None or not self.evict_wanted or self.pins or self.writes or not self.resident or self.detached
                    or self.error is not None or self.clean != t._version):
                return
            faces = self.faces()
            if held_elsewhere(t, len(faces) + self.internal):
                self._warn_held()
                return  # kept in memory (equal to its file) until its next use, which tries again
            t.untyped_storage().resize_(0)
            self.resident = False
            self.evict_wanted = False

    def _warn_held(self) -> None:
        if not self.held_warned:
            self.held_warned = True
            logger.warning("SSD offload: %s stays in memory after its use: a tensor taken from it while it was "
                           "readable (p.data, p.detach()) still holds its memory; drop such references to let the "
                           "tier give the memory back", self.name())

    def detach(self) -> None:
        """Stay resident for good (the tensor leaves the SSD tier)."""
        self.page_in(pin=False)
        with self.lock:
            self.detached = True
