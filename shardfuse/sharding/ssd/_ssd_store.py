"""The files of the SSD offload tier and the threads that read and write them.

One :class:`SsdStore` per model and setting, owned by that model's SSD tier (``_ssd_shard.Tier``; no module-level
table): it makes its own folder ``<dir>/shardfuse-ssd-rank<r>-pid<p>-<token>/`` at its first file (two models under
one directory get two folders), one :class:`TensorFile` per tensor (a flat shard, one optimizer state of it), and a
pool of ``io_threads`` threads of its own, which end when the model (so the store) is freed. A transfer is cut into
``chunk_mb`` pieces read or written in parallel with ``os.preadv``/``os.pwrite`` (they release the GIL); the
operations on one file run in the order they were queued (a read queued after a write reads what was written). An
error names the file, and is re-raised by whoever waits for the operation. With ``direct_io`` the files bypass the
page cache (``O_DIRECT``, the rules in ``_ssd_direct.py``) where the file system takes it, else the store falls back
to buffered I/O (``io_mode`` says which is in use). A file is deleted when its :class:`TensorFile` is collected (the
model freed and the I/O queued on it done: no I/O thread keeps a file past its last operation) or at interpreter
exit; the directory when its last file is gone. Files of a process killed by a signal stay.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import threading
import uuid
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from shardfuse.sharding.ssd._ssd_direct import O_DIRECT, Bounce, read_direct, refusal, write_direct

logger = logging.getLogger(__name__)

MIB = 1 << 20
# The system calls, here so that a test can make a write fail (no space left) without filling a disk.
_pwrite = os.pwrite
_preadv = os.preadv


class IOOp:
    """One queued read or write of a whole tensor (several chunks); ``wait()`` re-raises a chunk's error."""

    def __init__(self, chunks: int, on_done: Callable[[BaseException | None], None] | None) -> None:
        self._left = chunks
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._on_done = on_done
        self.error: BaseException | None = None
        if chunks == 0:
            self._finish()

    def chunk_done(self, err: BaseException | None) -> None:
        with self._lock:
            if err is not None and self.error is None:
                self.error = err
            self._left -= 1
            last = self._left == 0
        if last:
            self._finish()

    def _finish(self) -> None:
        on_done, self._on_done = self._on_done, None  # a done operation keeps nobody alive (its file: deletion)
        try:
            if on_done is not None:
                on_done(self.error)
        except BaseException as err:  # noqa: BLE001 - kept for the waiter
            logger.exception("SSD offload: completing an I/O operation failed")
            self.error = self.error or err
        finally:
            on_done = None  # dropped before the waiters wake, not when this frame ends
            self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> None:
        """Block until every chunk finished; raise the first error."""
        self._done.wait()
        if self.error is not None:
            raise self.error

    def wait_quietly(self) -> None:
        self._done.wait()


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (any dtype, bf16 included). Reads only what a tensor on
    disk lets through (its on-disk face, ``_ssd_face.py``): device, layout, size and address."""
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(f"SSD offload reads and writes contiguous CPU tensors, got {t.device} "
                         f"contiguous={t.is_contiguous()}")
    # ctypes, not .numpy(): a tensor shared with numpy gets a storage that can no longer be resized (evicted).
    # The caller keeps the memory alive until the operation is done.
    nbytes = t.numel() * t.element_size()
    return memoryview((ctypes.c_ubyte * nbytes).from_address(t.data_ptr())).cast("B")


def _logged(fn: Callable[[], None], path: str) -> None:
    """Run ``fn``; an error is logged (nobody may wait for it) and re-raised for whoever does."""
    try:
        fn()
    except BaseException:
        logger.exception("SSD offload: a queued step on %s failed", path)
        raise


def _run_job(task: list) -> None:
    """One queued chunk on an I/O thread. ``task`` is emptied first and the chunk's closure dropped before it is
    marked done: once a file's last operation is done no thread holds the file, so freeing the model deletes it
    at once (the pool's work item would otherwise keep it alive a moment longer)."""
    prev, op, io = task
    task.clear()
    if prev is not None:
        prev.wait_quietly()  # queued earlier on a FIFO pool: running or done, never behind this job
    err: BaseException | None = None
    try:
        io()
    except BaseException as e:  # noqa: BLE001 - handed to the waiter
        err = e
    del io
    op.chunk_done(err)


class TensorFile:
    """The file of one tensor: queued whole-tensor reads and writes, in order."""

    def __init__(self, store: SsdStore, path: str) -> None:
        self.store = store
        self.path = path
        self.direct = store.direct
        flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
        self.fd = os.open(path, flags | (O_DIRECT if self.direct else 0), 0o600)
        self._last: IOOp | None = None
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, store.forget, self.fd, path)

    def move_to(self, store: SsdStore) -> None:
        """Wrap time: the file joins ``store`` (the tier of the unit wrapped around its own): renamed into that
        store's folder (its descriptor stays open), its operations on that store's threads from now on."""
        if store is self.store:
            return
        self.settle()
        old_store, old_path = self.store, self.path
        path = store.claim(os.path.basename(old_path).split("-", 1)[-1].removesuffix(".bin"))
        try:
            os.rename(old_path, path)
        except OSError as err:
            store.forget(-1, path)
            raise OSError(err.errno, f"SSD offload: cannot move {old_path} into {store.dir} ({err.strerror})") from err
        self._finalizer.detach()
        self.store, self.path = store, path
        self._finalizer = weakref.finalize(self, store.forget, self.fd, path)
        old_store.forget(-1, old_path)  # no longer there: counts the old folder's file out (removed after its last)

    def write(self, t: torch.Tensor, on_done: Callable[[BaseException | None], None] | None = None) -> IOOp:
        """Queue writing ``t`` (which must stay resident until the operation is done)."""
        return self._queue(_bytes_of(t), True, on_done)

    def read(self, t: torch.Tensor, on_done: Callable[[BaseException | None], None] | None = None) -> IOOp:
        """Queue reading the file into ``t`` (allocated, the file's size)."""
        return self._queue(_bytes_of(t), False, on_done)

    def then(self, fn: Callable[[], None]) -> IOOp:
        """Run ``fn`` on an I/O thread once the operations queued so far on this file are done."""
        with self._lock:
            prev, op = self._last, IOOp(1, None)
            self._last = op
        path = self.path
        self._submit(op, [[prev, op, lambda: _logged(fn, path)]])
        return op

    def _submit(self, op: IOOp, jobs: list[list]) -> None:
        """Queue ``jobs`` (the chunks of ``op``) on the pool. A pool that takes no more work (the interpreter is
        exiting) fails the chunks it did not take at once: nobody waits for them forever."""
        for i, job in enumerate(jobs):
            try:
                self.store.pool.submit(_run_job, job)
            except RuntimeError as err:
                failed = OSError(errno.ECANCELED, f"SSD offload: an operation on {self.path} could not be queued "
                                 f"({err}); the file is incomplete")
                for _ in jobs[i:]:
                    op.chunk_done(failed)
                return

    def settle(self) -> None:
        """Wait until every operation queued on this file so far is done (errors are the waiters' to raise)."""
        with self._lock:
            last = self._last
        if last is not None:
            last.wait_quietly()

    def _queue(self, buf: memoryview, write: bool, on_done: Callable[[BaseException | None], None] | None) -> IOOp:
        chunk = self.store.chunk_bytes
        starts = list(range(0, len(buf), chunk))
        base = ctypes.addressof(ctypes.c_ubyte.from_buffer(buf)) if starts and self.direct else 0
        with self._lock:
            prev, op = self._last, IOOp(len(starts), on_done)
            self._last = op
        jobs = []
        for start in starts:
            piece = buf[start:start + chunk]
            io = (lambda p=piece, s=start: self._write_at(p, s, base + s)) if write else (
                lambda p=piece, s=start: self._read_at(p, s, base + s))
            jobs.append([prev, op, io])
        self._submit(op, jobs)
        return op

    def _write_all(self, view: memoryview, offset: int) -> None:
        done = 0
        try:
            while done < len(view):
                done += _pwrite(self.fd, view[done:], offset + done)
        except OSError as err:
            raise OSError(err.errno, f"{err.strerror} after {done} bytes") from err

    def _read_all(self, view: memoryview, offset: int, need: int) -> None:
        done = 0
        while done < len(view):
            got = _preadv(self.fd, [view[done:]], offset + done)
            if got == 0:
                if done >= need:
                    return
                raise OSError(5, f"the file ends at {offset + done} bytes")
            done += got

    def _write_at(self, piece: memoryview, offset: int, address: int) -> None:
        try:
            if self.direct:
                write_direct(piece, offset, address, self.store.bounce, self._write_all)
            else:
                self._write_all(piece, offset)
            self.store.count(written=len(piece))
        except OSError as err:
            raise OSError(err.errno, f"SSD offload: writing {len(piece)} bytes at offset {offset} of {self.path} "
                          f"failed ({err.strerror}); the file is incomplete: free space under {self.store.root} "
                          f"or pass another OffloadConfig(dir=...)") from err
        except Exception as err:  # not the disk's: named with the file all the same
            raise RuntimeError(f"SSD offload: writing {len(piece)} bytes at offset {offset} of {self.path} failed "
                               f"({type(err).__name__}: {err}); the file is incomplete") from err

    def _read_at(self, piece: memoryview, offset: int, address: int) -> None:
        try:
            if self.direct:
                read_direct(piece, offset, address, self.store.bounce, self._read_all)
            else:
                self._read_all(piece, offset, len(piece))
            self.store.count(read=len(piece))
        except OSError as err:
            raise OSError(err.errno, f"SSD offload: reading {len(piece)} bytes at offset {offset} of {self.path} "
                          f"failed ({err.strerror}): was the file removed or truncated?") from err
        except Exception as err:
            raise RuntimeError(f"SSD offload: reading {len(piece)} bytes at offset {offset} of {self.path} failed "
                               f"({type(err).__name__}: {err})") from err


class SsdStore:
    """The per-process directory under ``root``, its files and the I/O threads.

    ``io_mode``: ``"buffered"``, ``"direct"`` (``O_DIRECT``), or with ``direct_io`` on a file system that refuses
    it ``"buffered (O_DIRECT refused: <why>)"``; decided when the first file is made (``"direct"`` until then)."""

    def __init__(self, root: str, threads: int, chunk_mb: int, rank: int, direct_io: bool = False) -> None:
        self.root = root
        self.direct_io = direct_io  # asked for; ``direct`` says whether it is in use
        self.io_mode = "direct" if direct_io else "buffered"
        self._probed = not direct_io
        self.bounce = Bounce()  # each I/O thread's aligned buffer (direct I/O of unaligned memory, partial blocks)
        self.dir = os.path.join(root, f"shardfuse-ssd-rank{rank}-pid{os.getpid()}-{uuid.uuid4().hex[:8]}")
        self.chunk_bytes = chunk_mb * MIB
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="shardfuse-ssd-io")
        self._lock = threading.RLock()  # a finalizer (forget) may run on a thread holding it
        self._count = 0
        self._serial = 0
        # Bytes of writes in flight, bounded by reserve(): what the write-behind may hold in memory.
        self._room = threading.Condition()
        self._writing = 0
        self.bytes_read = 0  # totals since the store was made (the offload benchmark reports them per step)
        self.bytes_written = 0

    def count(self, read: int = 0, written: int = 0) -> None:
        with self._lock:
            self.bytes_read += read
            self.bytes_written += written

    def claim(self, name: str) -> str:
        """The path of a new file ``name`` in the folder (made now, and its ``O_DIRECT`` probed, at the first),
        counted as one of its files (:meth:`forget` counts it out)."""
        with self._lock:
            # Counted first: a file freed meanwhile (a finalizer run by a collection on this thread) cannot make
            # the count 0 and remove the directory under this one.
            self._count += 1
            self._serial += 1
            try:
                os.makedirs(self.dir, exist_ok=True)
                if not self._probed:
                    self._probe()
            except BaseException:
                self._count -= 1
                raise
            return os.path.join(self.dir, f"{self._serial:05d}-{name}.bin")

    def new_file(self, name: str) -> TensorFile:
        path = self.claim(name)
        try:
            return TensorFile(self, path)
        except OSError as err:
            self.forget(-1, path)
            raise OSError(err.errno, f"SSD offload: cannot create {path} ({err.strerror}): pass a writable "
                          f"OffloadConfig(dir=...)") from err

    @property
    def direct(self) -> bool:
        """Files are (to be) opened with ``O_DIRECT``."""
        return self.io_mode == "direct"

    def _probe(self) -> None:
        """(lock held, first file) Whether the directory takes ``O_DIRECT``; else fall back, warning once."""
        self._probed = True
        why = refusal(self.dir)
        if why is not None:
            self.io_mode = f"buffered (O_DIRECT refused: {why})"
            logger.warning("SSD offload: OffloadConfig(direct_io=True) but %s under %s: the files in %s use "
                           "buffered I/O (reads may come from the page cache)", why, self.root, self.dir)

    def forget(self, fd: int, path: str) -> None:
        """A file's last user is gone: close and delete it (and the directory after its last file)."""
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        with self._lock:
            self._count -= 1
            if self._count == 0:
                with contextlib.suppress(OSError):
                    os.rmdir(self.dir)

    def reserve(self, nbytes: int, limit: int) -> Callable[[], None]:
        """Wait until ``nbytes`` more of writes in flight stay within ``limit`` (one write always may); returns
        the release to call when the write is done."""
        with self._room:
            while self._writing and self._writing + nbytes > limit:
                self._room.wait()
            self._writing += nbytes

        def release() -> None:
            with self._room:
                self._writing -= nbytes
                self._room.notify_all()

        return release


def new_store(root: str, threads: int, chunk_mb: int, direct_io: bool = False) -> SsdStore:
    """A store of its own under ``root`` for one model's tier (its folder named with this process's rank)."""
    rank = torch.distributed.get_rank() if torch.distributed.is_available() and torch.distributed.is_initialized() \
        else 0
    return SsdStore(root, threads, chunk_mb, rank, direct_io)
