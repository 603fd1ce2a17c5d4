"""Sequential bandwidth of the disk under a directory, and the floor it sets for an SSD-offloaded step.

``measure(dir, gib)`` writes a file of ``gib`` GiB in 64 MiB blocks, ``fsync``s it, and reads it back, timing
both. The page cache must not serve the read: the file is opened with ``O_DIRECT`` where the file system takes it
(buffers page-aligned); elsewhere (tmpfs, some network file systems) the written pages are dropped from the cache
after the ``fsync`` with ``posix_fadvise(DONTNEED)`` (no root needed), and the method is recorded. Dropping the
whole page cache would need root; a file larger than free memory is the other way out (pass a larger ``gib``).

The floor of one optimizer step with shards on disk: every fp32 parameter (4 B) and, with
``OffloadConfig(optimizer_state=True)``, its AdamW moments (8 B) are read once and written once, so
``floor = bytes / read_bandwidth + bytes / write_bandwidth`` (one disk serves both directions).
"""

from __future__ import annotations

import mmap
import os
import time
from typing import Any

MIB = 1 << 20
GIB = 1 << 30
BLOCK = 64 * MIB


def _open(path: str, flags: int) -> tuple[int, str]:
    direct = getattr(os, "O_DIRECT", 0)
    if direct:
        try:
            return os.open(path, flags | direct, 0o600), "O_DIRECT"
        except OSError:
            pass
    return os.open(path, flags, 0o600), "buffered + fsync + posix_fadvise(DONTNEED)"


def measure(directory: str, gib: float = 4.0) -> dict[str, Any]:
    """Sequential write and read GB/s of a ``gib`` GiB file under ``directory`` (removed afterwards)."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f".shardfuse-disk-probe-{os.getpid()}")
    blocks = max(1, int(gib * GIB) // BLOCK)
    buf = mmap.mmap(-1, BLOCK)  # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(MIB) * (BLOCK // MIB))
    try:
        fd, method = _open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        t0 = time.perf_counter()
        for i in range(blocks):
            os.pwrite(fd, buf, i * BLOCK)
        os.fsync(fd)
        write_s = time.perf_counter() - t0
        os.close(fd)
        if hasattr(os, "posix_fadvise"):
            fd = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        fd, _ = _open(path, os.O_RDONLY)
        t0 = time.perf_counter()
        for i in range(blocks):
            os.preadv(fd, [buf], i * BLOCK)
        read_s = time.perf_counter() - t0
        os.close(fd)
    finally:
        buf.close()
        if os.path.exists(path):
            os.unlink(path)
    nbytes = blocks * BLOCK
    return {"dir": directory, "probe_bytes": nbytes, "method": method, "write_gbps": nbytes / write_s / 1e9,
            "read_gbps": nbytes / read_s / 1e9}


def bytes_per_param(optimizer_state: bool) -> int:
    """Bytes of one parameter that must be read and written once per optimizer step."""
    return 4 + (8 if optimizer_state else 0)


def floor_ms(params: int, disk: dict[str, Any], optimizer_state: bool) -> float:
    """The disk's floor of one optimizer step (ms): read and write every offloaded byte once."""
    nbytes = params * bytes_per_param(optimizer_state)
    return (nbytes / (disk["read_gbps"] * 1e9) + nbytes / (disk["write_gbps"] * 1e9)) * 1e3
