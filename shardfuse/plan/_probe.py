"""``--probe``: measure this machine's floors (a few seconds each) instead of using a stored GPU kind's.

* bf16 matrix products of the decoder's sizes, forward+backward-like (three products per step), as TFLOP/s,
  scaled by the ratio of a stored kind's achieved step throughput to its matmul peak (a step is not one matmul);
* pinned host <-> device copies of 512 MiB, each way;
* torch's fused AdamW on the CPU over fp32 tensors (what ``OffloadOptimizer`` runs), picoseconds per parameter;
* optionally the SSD tier's directory: write then read back a file with ``O_DIRECT`` where the file system takes it.

Everything else (NVLink, the network, the calibrated slowdowns) comes from the stored kind closest to this GPU.
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any

from shardfuse.plan._hardware import DEFAULT_KIND, Floors, floors_for

__all__ = ["MATMUL_TO_STEP", "probe"]

# A compute-bound training step reaches this fraction of the bf16 matmul throughput measured here: the H200's
# large bf16 products run at ~790 TFLOP/s (ANCHORS.md), its stored compute-bound steps at ~404 (_hardware.KINDS).
MATMUL_TO_STEP = 0.51


def _timed(fn: Any, sync: Any, repeat: int = 5) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def _gpu(torch: Any, dev: Any) -> dict[str, float]:
    n = 8192
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    sync = torch.cuda.synchronize
    mm = _timed(lambda: [a @ b for _ in range(3)], sync)
    tflops = 3 * 2 * n**3 / mm / 1e12
    numel = 128 * 2**20  # 512 MiB of fp32
    host = torch.empty(numel, dtype=torch.float32, pin_memory=True)
    devbuf = torch.empty(numel, dtype=torch.float32, device=dev)
    h2d = _timed(lambda: devbuf.copy_(host, non_blocking=True), sync)
    d2h = _timed(lambda: host.copy_(devbuf, non_blocking=True), sync)
    src = torch.empty(numel, dtype=torch.float32, device=dev)
    hbm = _timed(lambda: devbuf.copy_(src), sync)
    return {"tflops": tflops * MATMUL_TO_STEP, "h2d_gbps": 4 * numel / h2d / 1e9,
            "d2h_gbps": 4 * numel / d2h / 1e9, "hbm_gbps": 2 * 4 * numel / hbm / 1e9,
            "gpu_mem_gib": torch.cuda.get_device_properties(dev).total_memory / 2**30}  # fmt: skip


def _cpu_adamw(torch: Any, numel: int) -> float:
    """Picoseconds per parameter of one fused CPU AdamW step over ``numel`` fp32 parameters."""
    p = torch.zeros(numel, dtype=torch.float32, requires_grad=True)
    p.grad = torch.randn(numel, dtype=torch.float32)
    opt = torch.optim.AdamW([p], lr=1e-4, fused=True)
    return _timed(opt.step, lambda: None, repeat=3) / numel * 1e12


def _disk(directory: str, nbytes: int) -> dict[str, float]:
    """Write then read ``nbytes`` under ``directory`` (O_DIRECT where allowed), GB/s; the file is removed."""
    import mmap

    block = 64 * 2**20
    buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(block))
    flags = getattr(os, "O_DIRECT", 0)
    fd_, path = tempfile.mkstemp(dir=directory, prefix="shardfuse-plan-probe-")
    os.close(fd_)
    try:
        try:
            fd = os.open(path, os.O_WRONLY | flags)
        except OSError:
            fd, flags = os.open(path, os.O_WRONLY), 0
        t0 = time.perf_counter()
        for _ in range(nbytes // block):
            os.write(fd, buf)
        os.fsync(fd)
        write = time.perf_counter() - t0
        os.close(fd)
        fd = os.open(path, os.O_RDONLY | flags)
        t0 = time.perf_counter()
        while os.readv(fd, [buf]) == block:
            pass
        read = time.perf_counter() - t0
        os.close(fd)
    finally:
        os.unlink(path)
    return {"disk_read_gbps": nbytes / read / 1e9, "disk_write_gbps": nbytes / write / 1e9}


def probe(kind: str | None = None, disk_dir: str | None = None, cpu_params: int = 100_000_000,
          disk_bytes: int = 2 * 2**30) -> Floors:
    """This machine's floors (see the module docstring); ``kind`` names the stored kind for what is not measured
    (default: the GPU's own name when stored, else h100). Without CUDA only the CPU (and disk) are measured."""
    import torch

    measured: dict[str, float] = {"cpu_adamw_ps": _cpu_adamw(torch, cpu_params)}
    name = "cpu"
    if torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
        name = torch.cuda.get_device_name(dev)
        measured.update(_gpu(torch, dev))
        if kind is None:
            kind = next((k for k in ("h200", "h100") if k in name.lower()), DEFAULT_KIND)
    if disk_dir is not None:
        if not os.path.isdir(disk_dir):
            raise ValueError(f"--probe-dir {disk_dir!r} is not a directory: give an existing directory on the disk "
                             f"the SSD tier would use")
        measured.update(_disk(disk_dir, disk_bytes))
    base = floors_for(kind or DEFAULT_KIND)
    floors = base.with_overrides(**measured)
    from dataclasses import replace

    return replace(floors, kind=base.kind, source=f"probed on this machine ({name}; the rest stored {base.kind})")
