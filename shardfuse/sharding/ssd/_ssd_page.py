"""One tensor of the SSD offload tier whose memory comes and goes (:class:`Page`): read in from its file for a use,
written behind after it, given back once written; and the states it goes through (:class:`PageState`).

A page is in exactly one :class:`PageState`; :meth:`Page._to` makes every change of state, under the page's lock,
and refuses one the table :data:`TRANSITIONS` does not list with an error naming the page and both states. Two
counts and one version go beside the state: ``pins`` (users of the memory: a gather, an optimizer step), ``writes``
(write-behinds queued and not done: each reads the memory until it is done) and ``clean`` (the tensor's version when
its memory last equalled its file; None: unknown). A read in flight is ``reading``.

While the tier does not use a tensor (between its uses, while it is read ahead, written behind or kept for its next
use) the tensor wears its on-disk face (``_ssd_face.py``): reading it raises an error naming it. It is itself again
in the states :attr:`PageState.IN_USE` and :attr:`PageState.DETACHED`: while the tier uses it (pinned) and after a
state-dict path read it in for the caller, until its next training use. ``docs/concurrency.md`` draws the machine.
"""

from __future__ import annotations

import enum
import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from shardfuse.sharding.ssd._ssd_face import Label, held_elsewhere, hide, show
from shardfuse.sharding.ssd._ssd_store import IOOp, TensorFile

logger = logging.getLogger(__name__)

Faces = Callable[[], list[tuple[torch.Tensor, Label]]]  # the tensors that show a page's memory to the user


class PageState(enum.Enum):
    """Where a page's values are and what the tier wants of its memory."""

    ON_DISK = "on disk"  # the memory given back; the file holds the values
    READING = "reading"  # the memory allocated, the file being read into it (read ahead, or for a use waiting)
    IN_USE = "in use"  # the memory holds the values, readable: pinned by a use, or read in for a state dict
    KEPT = "kept"  # the memory holds the values (written behind, or being written), kept for its next use
    EVICTING = "evicting"  # to be given back once its writes, its read and the copy reading it are done
    FAILED = "failed"  # a write-behind failed: the memory holds the only good copy, kept until written again
    DETACHED = "detached"  # left the tier: resident and readable for good

    targets: tuple[PageState, ...]  # the states it may go to (TRANSITIONS)
    shown: bool  # the tensor is itself (not its on-disk face)


# Every legal change of state, and what makes it.
TRANSITIONS: dict[PageState, dict[PageState, str]] = {
    PageState.ON_DISK: {PageState.READING: "prefetch / page_in: the read is queued"},
    PageState.READING: {
        PageState.IN_USE: "page_in: the read it waited for is done",
        PageState.KEPT: "the read ahead is done, nobody waits for it",
        PageState.EVICTING: "give_back: read ahead but not used",
        PageState.ON_DISK: "the read failed (the memory is given back; the file is kept)",
    },
    PageState.IN_USE: {
        PageState.KEPT: "page_out(keep=True): written behind, kept for the next use; or the last pin released",
        PageState.EVICTING: "page_out: written behind, given back once written",
        PageState.DETACHED: "detach: the tensor leaves the tier",
    },
    PageState.KEPT: {
        PageState.IN_USE: "page_in",
        PageState.EVICTING: "give_back: the next use will not come in time",
        PageState.FAILED: "its write-behind failed",
    },
    PageState.EVICTING: {
        PageState.ON_DISK: "_drop: its I/O and copy done, the memory is given back",
        PageState.IN_USE: "page_in: used again before it was given back",
        PageState.READING: "page_in: used again while its read ahead is in flight",
        PageState.FAILED: "its write-behind failed",
    },
    PageState.FAILED: {PageState.IN_USE: "page_in: used again (its page_out writes it again)"},
    PageState.DETACHED: {},
}
for _state in PageState:
    _state.targets = tuple(TRANSITIONS[_state])
    _state.shown = _state in (PageState.IN_USE, PageState.DETACHED)
_READING, _IN_USE, _KEPT, _EVICTING = PageState.READING, PageState.IN_USE, PageState.KEPT, PageState.EVICTING
_ON_DISK, _FAILED, _DETACHED = PageState.ON_DISK, PageState.FAILED, PageState.DETACHED


class Page:
    """One tensor whose memory comes and goes; while evicted its values live in ``file`` only.

    Every change of state happens under the shard's ``lock`` (:meth:`_to`); waits for I/O happen outside it.
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
        self.state = PageState.IN_USE  # made from a tensor in memory, which its first page_out writes
        self.pins = 0
        self.clean: int | None = None
        self.reading: IOOp | None = None
        self.writes = 0  # queued writes not done yet: a write reads the memory until it is done
        self.failure: BaseException | None = None  # what made it FAILED (the last write-behind's error)
        self.internal = 0  # aliases of the memory the tier itself keeps (not the user's)
        self.held_warned = False

    @property
    def tensor(self) -> torch.Tensor | None:
        return self._strong if self._strong is not None else self._weak()

    def _to(self, new: PageState) -> None:
        """(lock held) Go to state ``new``; the tensor shows its values in IN_USE and DETACHED only."""
        old = self.state
        if new not in old.targets:
            raise RuntimeError(
                f"SSD offload: {self.name()}: the page cannot go from {old.name} to {new.name} (it may go to "
                f"{', '.join(t.name for t in old.targets) or 'nothing'}): please report this, with the traceback")
        self.state = new
        if new.shown is not old.shown:
            (show if new.shown else hide)(self.faces())

    def name(self) -> str:
        """The tensor as the user's model names it (its first face's label), else its file."""
        faces = self.faces()
        return faces[0][1]()[0] if faces else self.file.path

    def _start_read(self, t: torch.Tensor) -> None:
        """(lock held, ON_DISK) Allocate the memory and queue the read."""
        t.untyped_storage().resize_(self.nbytes)
        self.clean = t._version
        self._to(_READING)
        self.reading = self.file.read(t, on_done=self._read_done)

    def _read_done(self, err: BaseException | None) -> None:
        with self.lock:
            self.reading = None
            t = self.tensor
            if t is None or self.state is _DETACHED:
                return
            if err is not None:  # the memory holds garbage: the waiters raise
                t.untyped_storage().resize_(0)
                self._to(_ON_DISK)
            elif self.state is _READING and not self.pins:
                self._to(_KEPT)  # read ahead: a page_in (if any) finds it kept

    def prefetch(self) -> bool:
        """Start reading an evicted tensor in; False when there was nothing to do."""
        t = self.tensor
        with self.lock:
            if t is None or self.state is not _ON_DISK:
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
            if pin:
                self.pins += 1
            state = self.state
            if state is _ON_DISK:
                self._start_read(t)
            elif state is _KEPT or state is _FAILED or (state is _EVICTING and self.reading is None):
                self._to(_IN_USE)
            elif state is _EVICTING:
                self._to(_READING)  # given back while its read ahead is in flight: wait for that read
            reading = self.reading
        if reading is not None:
            try:
                reading.wait()
            except BaseException as read_err:
                if pin:
                    self.unpin()
                raise RuntimeError(f"SSD offload: reading {self.name()} in from {self.file.path} failed: {read_err}; "
                                   f"its file is kept, the next use reads it again") from read_err
        with self.lock:
            if self.state is _READING or self.state is _KEPT:
                self._to(_IN_USE)

    def unpin(self) -> None:
        """Release a pin without a write-behind (the use did not happen): kept in memory, equal to its file."""
        with self.lock:
            self.pins = max(0, self.pins - 1)
            if not self.pins and self.state is _IN_USE:
                self._to(_KEPT)

    def page_out(self, event: Any = None, keep: bool = False) -> None:
        """Release a pin; when none is left, write the tensor back if it changed and give its memory back once
        the write (and ``event``, a copy still reading it) is done; ``keep``: written back, kept in memory."""
        t = self.tensor
        if t is None:
            return
        release = self.tier.write_room(self.nbytes) if self.clean != t._version else None
        with self.lock:
            self.pins = max(0, self.pins - 1)
            if self.pins or self.state is not _IN_USE:  # still used, detached, or not resident
                if release is not None:
                    release()
                return
            # No longer the caller's to read: the I/O threads write it and give it back.
            self._to(_KEPT if keep else _EVICTING)
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
            if self.pins or not (self.state is _KEPT or self.state is _READING):
                return
            self._to(_EVICTING)
        self.file.then(lambda: self._drop(event))

    def _written(self, err: BaseException | None, release: Any) -> None:
        if release is not None:
            release()
        if err is not None:
            logger.error("SSD offload: %s: %s (the values are kept in memory; raised at the next use of the tier)",
                         self.name(), err)
        with self.lock:
            self.writes -= 1
            if err is None:
                return
            self.failure = err
            self.clean = None  # the file is stale: the memory is kept and written again at the next eviction
            if self.state is _KEPT or self.state is _EVICTING:
                self._to(_FAILED)
        self.tier.failed(self, err)

    def _drop(self, event: Any) -> None:
        if event is not None:
            event.synchronize()  # a host-to-device copy still reading the memory
        t = self.tensor
        with self.lock:
            if t is None or self.state is not _EVICTING or self.pins or self.writes or self.clean != t._version:
                return
            if held_elsewhere(t, len(self.faces()) + self.internal):
                self._warn_held()
                return  # kept in memory (equal to its file) until its next use, which tries again
            t.untyped_storage().resize_(0)
            self._to(_ON_DISK)

    def _warn_held(self) -> None:
        if not self.held_warned:
            self.held_warned = True
            logger.warning("SSD offload: %s stays in memory after its use: a tensor taken from it while it was "
                           "readable (p.data, p.detach()) still holds its memory; drop such references to let the "
                           "tier give the memory back", self.name())

    def detach(self) -> None:
        """Stay resident for good (the tensor leaves the SSD tier)."""
        if self.tensor is None:  # optimizer state since replaced: nothing to keep
            return
        self.page_in(pin=False)
        with self.lock:
            if self.state is not _DETACHED:
                self._to(_DETACHED)
