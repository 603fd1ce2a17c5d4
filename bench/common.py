"""Helpers shared by the benchmark suites: where results go, what every result records, a free port."""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import platform
import re
import socket
import subprocess
from pathlib import Path
from typing import Any

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def free_port() -> int:
    """A TCP port that was free a moment ago on localhost (for a process group's rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gpu_key() -> str:
    """A short architecture key for results/<gpu>/: 'h100', 'h200', 'a100', or 'cpu'."""
    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name(0)
    m = re.search(r"\b([AHBL]\d{2,3})\b", name.upper())
    return m.group(1).lower() if m else re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def git_commit() -> str:
    # The device machine gets the working tree without .git: the caller passes the commit along.
    if os.environ.get("SHARDFUSE_COMMIT"):
        return os.environ["SHARDFUSE_COMMIT"]
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
            cwd=Path(__file__).resolve().parent,
        ).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def env_info() -> dict[str, Any]:
    """Versions and hardware, recorded with every result."""
    info: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gpu_key": gpu_key(),
        # The host: its CPU speed sets every host-bound row (H200 hosts of one kind differed up to 11x there).
        "host_cpus": usable_cpus(),
        "cpu_model": cpu_model(),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if torch.cuda.is_available():
        info["gpu_name"] = torch.cuda.get_device_name(0)
        info["gpu_count"] = torch.cuda.device_count()
        info["cuda"] = torch.version.cuda
        try:
            info["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version())
        except (AttributeError, RuntimeError):
            info["nccl"] = None
    return info


def usable_cpus() -> int | None:
    """The CPUs this process may run on (its affinity mask; the machine's count where the OS does not say)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count()


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str | None:
    """The CPU's model name (``/proc/cpuinfo``; ``platform.processor()`` elsewhere), None where neither says."""
    try:
        for line in cpuinfo.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or None


def host_topology(device: int | None = None, sys_root: Path = Path("/sys")) -> dict[str, Any]:
    """Where this process runs on the host: NUMA nodes, the CPUs it may use, and (on a GPU) the NUMA node of the
    GPU's PCIe slot, so runs on different GPUs of one host can be told apart (an offloaded step leans on host
    memory and PCIe; a GPU on the other socket can change it). None where the host does not say."""
    nodes = sorted(p.name for p in (sys_root / "devices/system/node").glob("node[0-9]*"))
    out: dict[str, Any] = {"numa_nodes": len(nodes) or None, "affinity_cores": usable_cpus(),
                           "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "gpu_numa_node": None}
    if device is not None and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(device)
        bus = [getattr(props, f"pci_{k}_id", None) for k in ("domain", "bus", "device")]
        if None not in bus:
            out["gpu_pci"] = f"{bus[0]:04x}:{bus[1]:02x}:{bus[2]:02x}.0"
            with contextlib.suppress(OSError, ValueError):  # a host that does not say
                out["gpu_numa_node"] = int((sys_root / "bus/pci/devices" / out["gpu_pci"] / "numa_node").read_text())
    return out


def results_path(name: str, key: str | None = None) -> Path:
    """bench/results/<gpu>/<name>.json, or $OUT/<gpu>/<name>.json when BENCH_OUT is set (device runs)."""
    base = Path(os.environ["BENCH_OUT"]) if os.environ.get("BENCH_OUT") else RESULTS_DIR
    path = base / (key or gpu_key()) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def write_result(name: str, payload: dict[str, Any], key: str | None = None) -> Path:
    """Write one benchmark's JSON with the environment attached; returns the path."""
    path = results_path(name, key)
    path.write_text(json.dumps({"env": env_info(), **payload}, indent=2, sort_keys=False) + "\n")
    return path


def copy_bandwidth_gbps(numel: int = 1 << 28, reps: int = 20) -> float:
    """This GPU's device-to-device copy bandwidth in GB/s (bytes read + written), measured now."""
    import triton.testing

    src = torch.randn(numel, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=100, return_mode="median")
    return 2 * numel * src.element_size() / (ms * 1e-3) / 1e9

