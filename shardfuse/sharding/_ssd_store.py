"""The files of the SSD offload tier and the threads that read and write them.

One :class:`SsdStore` per directory and process: it makes ``<dir>/shardfuse-ssd-rank<r>-pid<p>-<token>/`` at its
first file, one :class:`TensorFile` per tensor (a flat shard, one optimizer state of it), and a pool of
``io_threads`` threads. A transfer is cut into ``chunk_mb`` pieces read or written in parallel with
``os.preadv``/``os.pwrite`` (they release the GIL); the operations on one file run in the order they were
queued (a read queued after a write reads what was written). An error names the file, and is re-raised by
whoever waits for the operation. A file is deleted when its :class:`TensorFile` is collected (the model freed)
or at interpreter exit; the directory when its last file is gone. Files of a process killed by a signal stay.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
import uuid
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

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
        try:
            if self._on_done is not None:
                self._on_done(self.error)
        except BaseException as err:  # noqa: BLE001 - kept for the waiter
            logger.exception("SSD offload: completing an I/O operation failed")
            self.error = self.error or err
        finally:
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
    """The bytes of a contiguous CPU tensor, without a copy (any dtype, bf16 included)."""
    flat = t.detach().reshape(-1)
    if not flat.is_contiguous() or flat.device.type != "cpu":
        raise ValueError(f"SSD offload reads and writes contiguous CPU tensors, got {flat.device} "
                         f"contiguous={flat.is_contiguous()}")
    # ctypes, not .numpy(): a tensor shared with numpy gets a storage that can no longer be resized (evicted).
    # The caller keeps the memory alive until the operation is done.
    nbytes = flat.numel() * flat.element_size()
    return memoryview((ctypes.c_ubyte * nbytes).from_address(flat.data_ptr())).cast("B")


def _logged(fn: Callable[[], None], path: str) -> None:
    """Run ``fn``; an error is logged (nobody may wait for it) and re-raised for whoever does."""
    try:
        fn()
    except BaseException:
        logger.exception("SSD offload: a queued step on %s failed", path)
        raise


class TensorFile:
    """The file of one tensor: queued whole-tensor reads and writes, in order."""

    def __init__(self, store: SsdStore, path: str) -> None:
        self.store = store
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        self._last: IOOp | None = None
        self._lock = threading.Lock()
        weakref.finalize(self, store.forget, self.fd, path)

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
        self.store.pool.submit(self._job, prev, op, lambda: _logged(fn, self.path))
        return op

    def _queue(self, buf: memoryview, write: bool, on_done: Callable[[BaseException | None], None] | None) -> IOOp:
        chunk = self.store.chunk_bytes
        starts = list(range(0, len(buf), chunk))
        with self._lock:
            prev, op = self._last, IOOp(len(starts), on_done)
            self._last = op
        for start in starts:
            piece = buf[start:start + chunk]
            io = (lambda p=piece, s=start: self._write_at(p, s)) if write else (
                lambda p=piece, s=start: self._read_at(p, s))
            self.store.pool.submit(self._job, prev, op, io)
        return op

    def _job(self, prev: IOOp | None, op: IOOp, io: Callable[[], None]) -> None:
        if prev is not None:
            prev.wait_quietly()  # queued earlier on a FIFO pool: running or done, never behind this job
        err: BaseException | None = None
        try:
            io()
        except BaseException as e:  # noqa: BLE001 - handed to the waiter
            err = e
        op.chunk_done(err)

    def _write_at(self, piece: memoryview, offset: int) -> None:
        done = 0
        try:
            while done < len(piece):
                done += _pwrite(self.fd, piece[done:], offset + done)
            self.store.count(written=done)
        except OSError as err:
            raise OSError(err.errno, f"SSD offload: writing {len(piece)} bytes at offset {offset} of {self.path} "
                          f"failed after {done} bytes ({err.strerror}); the file is incomplete: free space "
                          f"under {self.store.root} or pass another OffloadConfig(dir=...)") from err

    def _read_at(self, piece: memoryview, offset: int) -> None:
        done = 0
        try:
            while done < len(piece):
                got = _preadv(self.fd, [piece[done:]], offset + done)
                if got == 0:
                    raise OSError(5, f"the file ends at {offset + done} bytes")
                done += got
            self.store.count(read=done)
        except OSError as err:
            raise OSError(err.errno, f"SSD offload: reading {len(piece)} bytes at offset {offset} of {self.path} "
                          f"failed ({err.strerror}): was the file removed or truncated?") from err


class SsdStore:
    """The per-process directory under ``root``, its files and the I/O threads."""

    def __init__(self, root: str, threads: int, chunk_mb: int, rank: int) -> None:
        self.root = root
        self.dir = os.path.join(root, f"shardfuse-ssd-rank{rank}-pid{os.getpid()}-{uuid.uuid4().hex[:8]}")
        self.chunk_bytes = chunk_mb * MIB
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="shardfuse-ssd-io")
        self._lock = threading.Lock()
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

    def new_file(self, name: str) -> TensorFile:
        with self._lock:
            os.makedirs(self.dir, exist_ok=True)
            self._serial += 1
            self._count += 1
            path = os.path.join(self.dir, f"{self._serial:05d}-{name}.bin")
        try:
            return TensorFile(self, path)
        except OSError as err:
            self.forget(-1, path)
            raise OSError(err.errno, f"SSD offload: cannot create {path} ({err.strerror}): pass a writable "
                          f"OffloadConfig(dir=...)") from err

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


_STORES: dict[tuple[str, int, int], SsdStore] = {}
_STORES_LOCK = threading.Lock()


def store_for(root: str, threads: int, chunk_mb: int) -> SsdStore:
    """The process's store under ``root`` (one per directory and I/O settings)."""
    rank = torch.distributed.get_rank() if torch.distributed.is_available() and torch.distributed.is_initialized() \
        else 0
    key = (root, threads, chunk_mb)
    with _STORES_LOCK:
        store = _STORES.get(key)
        if store is None:
            store = _STORES[key] = SsdStore(root, threads, chunk_mb, rank)
        return store


def io_bytes() -> tuple[int, int]:
    """Bytes read and written by every store of this process so far."""
    with _STORES_LOCK:
        stores = list(_STORES.values())
    return sum(s.bytes_read for s in stores), sum(s.bytes_written for s in stores)
