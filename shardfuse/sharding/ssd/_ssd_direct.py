"""Direct I/O (``os.O_DIRECT``) for the SSD offload tier's files: alignment, the probe, the bounce buffers.

With ``OffloadConfig(direct_io=True)`` a store's files bypass the page cache, so a read really comes from the
disk. ``O_DIRECT`` needs the memory address, the file offset and the length of every transfer aligned to the
logical block size (:data:`ALIGN`, 4096 bytes): a file holds its tensor's bytes padded up to a multiple of
:data:`ALIGN`; a chunk whose memory is aligned (pinned memory is page-aligned) moves its whole blocks straight
from or into the tensor, and the rest (a chunk of unaligned memory, the last partial block) goes through a
page-aligned bounce buffer of the I/O thread (at most one chunk each). Where the file system refuses ``O_DIRECT``
(``EINVAL``; an OS without it) the store falls back to buffered I/O, with one warning naming the directory.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
import uuid
from collections.abc import Callable

ALIGN = 4096
O_DIRECT: int = getattr(os, "O_DIRECT", 0)
_REFUSED = (errno.EINVAL, errno.EOPNOTSUPP)
WriteAll = Callable[[memoryview, int], None]  # (bytes, file offset): write them all
ReadAll = Callable[[memoryview, int, int], None]  # (buffer, file offset, bytes needed before the file may end)


def round_up(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`ALIGN`."""
    return -(-n // ALIGN) * ALIGN


def refusal(directory: str) -> str | None:
    """Why files under ``directory`` cannot be read and written with ``O_DIRECT`` (None: they can). Opens, writes
    and reads back one block of a probe file (some file systems take the flag at open and refuse the transfer)."""
    if not O_DIRECT:
        return "this OS has no O_DIRECT"
    path = os.path.join(directory, f".shardfuse-direct-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | O_DIRECT, 0o600)
    except OSError as err:
        if err.errno in _REFUSED:
            return f"opening a file with O_DIRECT failed ({err.strerror})"
        raise
    block = memoryview(mmap.mmap(-1, ALIGN))
    try:
        os.pwrite(fd, block, 0)
        os.preadv(fd, [block], 0)
    except OSError as err:
        if err.errno in _REFUSED:
            return f"an O_DIRECT transfer failed ({err.strerror})"
        raise
    finally:
        block.release()
        os.close(fd)
        os.unlink(path)
    return None


class Bounce(threading.local):
    """Each I/O thread's page-aligned buffer (anonymous ``mmap``), grown to the largest transfer asked for."""

    def __init__(self) -> None:
        self.buf: mmap.mmap | None = None

    def get(self, nbytes: int) -> memoryview:
        if self.buf is None or len(self.buf) < nbytes:
            self.buf = mmap.mmap(-1, round_up(max(nbytes, 1)))
        return memoryview(self.buf)[:nbytes]


def write_direct(piece: memoryview, offset: int, address: int, bounce: Bounce, write_all: WriteAll) -> None:
    """Write ``piece`` (at memory ``address``) at file ``offset`` (a multiple of :data:`ALIGN`) of an ``O_DIRECT``
    file: its whole blocks in place if aligned, the rest through ``bounce``, padded with zeros."""
    n = len(piece)
    body = n - n % ALIGN if address % ALIGN == 0 else 0
    if body:
        write_all(piece[:body], offset)
    rest = n - body
    if rest:
        with bounce.get(round_up(rest)) as view:
            view[:rest] = piece[body:]
            view[rest:] = bytes(len(view) - rest)
            write_all(view, offset + body)


def read_direct(piece: memoryview, offset: int, address: int, bounce: Bounce, read_all: ReadAll) -> None:
    """Fill ``piece`` (at memory ``address``) from file ``offset`` (a multiple of :data:`ALIGN`) of an
    ``O_DIRECT`` file: its whole blocks in place if aligned, the rest read padded into ``bounce`` and copied."""
    n = len(piece)
    body = n - n % ALIGN if address % ALIGN == 0 else 0
    if body:
        read_all(piece[:body], offset, body)
    rest = n - body
    if rest:
        with bounce.get(round_up(rest)) as view:
            read_all(view, offset + body, rest)
            piece[body:] = view[:rest]
