"""What the planner knows about the machine: the measured floors of one GPU kind and its host, and the size of
the cluster the user has.

:class:`Floors` are throughputs measured on a machine (``python -m shardfuse.plan --probe`` measures them on
yours, :mod:`shardfuse.plan._probe`); :data:`KINDS` holds the stored ones of the GPU kinds the benchmarks ran on,
each number with where it came from. The ``*_calibrated`` fields are the few constants fitted to the stored
benchmark rows (``tests/test_plan.py`` checks every prediction against those rows).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

__all__ = ["DEFAULT_KIND", "Floors", "KINDS", "Machine", "floors_for"]

GIB = 2**30


@dataclass(frozen=True)
class Floors:
    """Measured throughputs of one GPU and its host (what a step cannot beat) and the calibrated slowdowns."""

    kind: str
    gpu_mem_gib: float  # memory of one GPU
    tflops: float  # achieved bf16 forward+backward TFLOP/s of a compute-bound step (not the datasheet peak)
    hbm_gbps: float  # device copy bandwidth, read + write (the GPU optimizer step is bound by it)
    h2d_gbps: float  # pinned host -> device copy
    d2h_gbps: float  # pinned device -> host copy
    cpu_adamw_ps: float  # torch's fused CPU AdamW, picoseconds per fp32 parameter, alone on the host's cores
    nvlink_gbps: float  # bus bandwidth of all-gather / reduce-scatter rings inside a node, large messages
    nvlink_alpha_us: float  # per-step ring latency inside a node
    inter_gbps: float = 50.0  # per-GPU network bandwidth between nodes (400 Gb/s InfiniBand / RoCE per GPU)
    inter_alpha_us: float = 10.0
    disk_read_gbps: float = 3.0  # the SSD tier's directory (an NVMe SSD); --probe-dir measures yours
    disk_write_gbps: float = 3.0
    # Calibrated (see KINDS for the rows each comes from):
    host_slowdown_calibrated: float = 1.5  # the host update inside training vs cpu_adamw_ps alone
    host_ms_per_unit_calibrated: float = 4.4  # eager host time to launch one unit's work per step (Python, hooks)
    source: str = ""

    def with_overrides(self, **kw: float | None) -> Floors:
        """A copy with the given fields replaced (None values ignored); each must be a positive number."""
        given = {k: v for k, v in kw.items() if v is not None}
        for k, v in given.items():
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"{k} must be a positive number, got {v!r}: measured throughputs are positive "
                                 f"(use --probe to measure them on this machine)")
        return Floors(**{**asdict(self), **given}) if given else self


# H100 SXM 80GB and H200 SXM, 32-core hosts, torch 2.11, as stored under bench/results/<gpu>/.
#
# tflops: bf16 forward+backward of the Llama-style decoders at 2-8K tokens: H100 from offload_big.json's floors
#   (resident forward+backward: 2.9B 4K 390, 2.9B 32K 368, 6.7B 2K 480 TFLOP/s; mean 413); H200 from its
#   offload_big floors (2.9B 4K 419, 6.7B 2K 418) and e2e_2gpu.json's one-GPU 8K step (bench.scale: 374); mean 404.
# h2d/d2h, cpu_adamw_ps: offload_big.json hardware_floor (1 GiB pinned copies; fused AdamW over 1e9 fp32
#   parameters on 32 threads: 131.7 ps on the H100 host, 178.5 ps on the H200 one).
# hbm_gbps: kernels.json copy_bandwidth_gbps (2,997 and 4,240 GB/s).
# nvlink: ANCHORS.md / bench/results/scale_model.json fits of the H200 all-gather bus bandwidth (2 GPUs: 260 GB/s,
#   38 us per ring step); H100 SXM has the same NVLink 4 (NV18).
# host_slowdown_calibrated: inside a training step the host update of a 2.9B/6.7B model ran at ~230 ps per
#   parameter on both hosts (offload_big shardfuse rows, step time less the transfers: H100 2.9B 4K 228,
#   32K 208, 6.7B 2K 251; H200 2.9B 4K 235), while fused AdamW alone ran at 131.7 / 178.5 ps: the ratio, 1.73 on
#   the H100 host and 1.32 on the H200 host (memory traffic of the copies and the GPU launch thread share the
#   host). ANCHORS.md's 16-core H100 host shows the same: 919 ms in training vs 559 ms alone (1.64).
# host_ms_per_unit_calibrated: the median host enqueue time of an eager shardfuse step (953M decoder, 1K tokens,
#   17 units): 73.6 ms on the H200 host (bench/results/logs/h200x2-host-profile.log, scale_model.json), 4.33 ms
#   per unit; on the H100 hosts ANCHORS.md's eager 1K steps give 78.2 ms (2 GPUs) and 55.2 ms (4 GPUs): 4.0.
KINDS: dict[str, Floors] = {
    "h100": Floors("h100", 79.2, 413.0, 2997.0, 55.1, 55.0, 131.7, 260.0, 38.0, host_slowdown_calibrated=1.73,
                   host_ms_per_unit_calibrated=4.0, source="stored: bench/results/h100 (H100 80GB HBM3)"),
    "h200": Floors("h200", 139.8, 404.0, 4240.0, 54.9, 55.1, 178.5, 260.0, 38.0, disk_read_gbps=2.55,
                   disk_write_gbps=3.07, host_slowdown_calibrated=1.32, host_ms_per_unit_calibrated=4.33,
                   source="stored: bench/results/h200 (H200 141GB)"),
}
DEFAULT_KIND = "h100"


def floors_for(kind: str) -> Floors:
    """The stored floors of ``kind`` (``h100``, ``h200``; case and an ``nvidia-`` prefix ignored)."""
    key = kind.lower().removeprefix("nvidia-").removeprefix("nvidia ").replace(" ", "")
    key = {"h100-80gb": "h100", "h100sxm": "h100", "h200sxm": "h200"}.get(key, key)
    if key not in KINDS:
        raise ValueError(f"unknown GPU kind {kind!r}: stored floors exist for {sorted(KINDS)}; for another GPU run "
                         f"with --probe on it (measures its floors), or pass --gpu-kind h100 and override the "
                         f"numbers you know (--tflops, --h2d-gbps, ...)")
    return KINDS[key]


@dataclass(frozen=True)
class Machine:
    """The cluster: ``nodes`` x ``gpus_per_node`` GPUs of ``gpu_mem_gib`` each, ``host_mem_gib`` and
    ``disk_gib`` (free space for the SSD tier) per node."""

    gpus_per_node: int
    nodes: int
    gpu_mem_gib: float
    host_mem_gib: float
    disk_gib: float

    def __post_init__(self) -> None:
        for name in ("gpus_per_node", "nodes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}: count whole GPUs and nodes")
        for name in ("gpu_mem_gib", "host_mem_gib"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a positive number of GiB, got {value!r}: give the memory of one "
                                 f"{'GPU' if name == 'gpu_mem_gib' else 'node'}")
        if not isinstance(self.disk_gib, (int, float)) or not math.isfinite(self.disk_gib) or self.disk_gib < 0:
            raise ValueError(f"disk_gib must be >= 0 GiB, got {self.disk_gib!r}: the free space of the SSD tier's "
                             f"directory (0: no SSD tier)")

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes
