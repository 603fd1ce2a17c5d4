"""``OffloadConfig``: FairScale's setting of the SSD offload tier, and its rules.

A field of :class:`~shardfuse.sharding.core._config.OffloadPolicy` (``offload_config=``, the wrapper's keyword),
which the core carries opaquely (``TierSettings``: it reads only ``ssd``). Every rule about it is here: the
offload types, the directory (exists, is a directory, is writable), and the bounds of its tuning fields;
:func:`settle` applies them when the wrapper builds its config.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from dataclasses import dataclass
from typing import Any

SSD_OFFLOAD = "ssd_offload"
OFFLOAD_TYPES = (SSD_OFFLOAD,)


@dataclass(frozen=True)
class OffloadConfig:
    """Where the sharded parameters live between uses beyond host memory (FairScale 0.4's ``OffloadConfig``).

    ``offload_type="ssd_offload"``: each unit's fp32 flat shard (and with ``optimizer_state=True`` its optimizer
    state) lives in a file under ``dir``, one subdirectory per process, and is read back in ahead of use, in the
    recorded order of the gathers (forward, then backward) and of the optimizer steps, and written behind after
    each update, on ``io_threads`` background threads. It implies ``move_params_to_cpu=True`` and
    ``move_grads_to_cpu=True`` (gradients stay in pinned host memory). ``offload_type=None`` (FairScale's
    default) offloads nothing beyond what the other options say.

    Args:
        offload_type: ``"ssd_offload"`` or ``None``.
        dir: an existing, writable directory (an SSD); ``ssd_filepath_dir`` is FairScale 0.4.3's name for it.
        optimizer_state: keep the per-element optimizer state (Adam's moments, SGD's momentum) in files too,
            read ahead of each unit's optimizer step and written behind it.
        read_ahead: how many units are read ahead of use (per sequence: gathers, optimizer steps); also bounds
            the units whose writes may be in flight at once.
        io_threads: threads reading and writing the files.
        chunk_mb: size of one read or write call (MiB); a unit's file is read and written in such chunks in
            parallel.
        direct_io: open the files with ``os.O_DIRECT`` (Linux), so reads come from the disk and not from the
            page cache (an honest measure of what the disk allows; no cache memory spent on the shards). Each file
            then holds its tensor padded to a multiple of 4096 bytes; memory that is not 4096-aligned (pinned
            memory is) and a tensor's last partial block are moved through a page-aligned bounce buffer per I/O
            thread (up to ``chunk_mb`` each). Where the file system refuses ``O_DIRECT`` (tmpfs on older kernels,
            some network file systems) the files use buffered I/O, with one warning naming the directory.
    """

    offload_type: str | None = None
    dir: str | None = None
    ssd_filepath_dir: str | None = None
    optimizer_state: bool = False
    read_ahead: int = 2
    io_threads: int = 4
    chunk_mb: int = 64
    direct_io: bool = False

    def __post_init__(self) -> None:
        if self.offload_type is not None and self.offload_type not in OFFLOAD_TYPES:
            raise ValueError(f"OffloadConfig(offload_type={self.offload_type!r}) is not a known offload type: use "
                             f"offload_type={SSD_OFFLOAD!r} (parameters on disk) or None")
        if self.dir is not None and self.ssd_filepath_dir is not None and self.dir != self.ssd_filepath_dir:
            raise ValueError(f"OffloadConfig got dir={self.dir!r} and ssd_filepath_dir={self.ssd_filepath_dir!r}: "
                             f"ssd_filepath_dir is FairScale 0.4.3's name for dir; pass one of them")
        for name, low in (("read_ahead", 1), ("io_threads", 1), ("chunk_mb", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"OffloadConfig({name}={value!r}) must be an int >= {low}")
        if not isinstance(self.direct_io, bool):
            raise ValueError(f"OffloadConfig(direct_io={self.direct_io!r}) must be a bool")
        if self.offload_type == SSD_OFFLOAD and self.directory is None:
            raise ValueError(f"OffloadConfig(offload_type={SSD_OFFLOAD!r}) needs dir=<an existing directory on an "
                             f"SSD> (FairScale 0.4.3: ssd_filepath_dir=)")

    @property
    def directory(self) -> str | None:
        """``dir`` (or its FairScale 0.4.3 name ``ssd_filepath_dir``)."""
        return self.dir if self.dir is not None else self.ssd_filepath_dir

    @property
    def ssd(self) -> bool:
        """Parameters live on disk."""
        return self.offload_type == SSD_OFFLOAD


def as_offload_config(value: Any) -> OffloadConfig | None:
    """The wrapper's ``offload_config=``: ours, FairScale's (any object with ``offload_type`` and ``dir`` or
    ``ssd_filepath_dir``), or None."""
    if value is None or isinstance(value, OffloadConfig):
        return value
    if hasattr(value, "offload_type"):
        return OffloadConfig(offload_type=value.offload_type, dir=getattr(value, "dir", None),
                             ssd_filepath_dir=getattr(value, "ssd_filepath_dir", None))
    raise TypeError(f"offload_config must be shardfuse.OffloadConfig (or FairScale's), got {type(value).__name__}: "
                    f"pass OffloadConfig(offload_type='ssd_offload', dir=...)")


def check_ssd_dir(path: str) -> str:
    """The absolute path of an existing directory this process can create files in; else an error naming it."""
    full = os.path.abspath(os.path.expanduser(os.fspath(path)))
    if not os.path.exists(full):
        raise FileNotFoundError(f"OffloadConfig(dir={path!r}): {full} does not exist: create the directory first "
                                f"(mkdir -p {full}) or pass an existing one")
    if not os.path.isdir(full):
        raise NotADirectoryError(f"OffloadConfig(dir={path!r}): {full} is a file, not a directory: pass the "
                                 f"directory the shard files should go in")
    try:
        fd, probe = tempfile.mkstemp(prefix=".shardfuse-probe-", dir=full)
    except OSError as err:
        raise PermissionError(f"OffloadConfig(dir={path!r}): cannot create files in {full} ({err.strerror}): pass a "
                              f"directory this process can write to") from err
    os.close(fd)
    os.unlink(probe)
    return full


def settle(value: Any) -> OffloadConfig | None:
    """The wrapper's ``offload_config=`` as its config carries it (``core._config.make_config``'s ``settle_tier``):
    ours or FairScale's as an ``OffloadConfig``, and for the SSD tier its directory checked and made absolute."""
    offload = as_offload_config(value)
    if offload is not None and offload.ssd:
        offload = dataclasses.replace(offload, dir=check_ssd_dir(offload.directory or ""), ssd_filepath_dir=None)
    return offload
