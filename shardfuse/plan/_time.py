"""The time model: one optimizer step of a setup, in milliseconds, from the measured floors.

* **compute**: forward + backward FLOPs (:meth:`ModelShape.flops_per_token`) at the kind's achieved TFLOP/s,
  one third forward, two thirds backward; activation checkpointing adds a forward.
* **communication** (shard > 1): per unit an all-gather of its bf16 parameters in forward and again in backward,
  a reduce-scatter of its fp32 gradient (at the synced micro-batch), ring times ``(k-1) alpha + (k-1)/k B / bw``
  (``bench.scale.model``); hidden behind compute except the root unit's, which opens forward and closes backward.
  Hybrid sharding adds the all-reduce of each fp32 gradient shard across nodes.
* **host launch** (eager): ``host_ms_per_unit`` per unit per micro-batch; the host runs ahead of the GPU, so the
  step is the longer of the two (a 1K-token step of a 1B model is host-bound).
* **GPU optimizer**: bytes per parameter (:data:`OPT_BYTES`) at the device copy bandwidth; with ``StepInBackward``
  (sharded setups of a workload that does not clip) :data:`SIB_HIDDEN` of it overlaps backward.
* **offload**: the fp32 shard crosses to the GPU for every gather (2 B with ``host_compute_copy``), the fp32
  gradient comes back once per optimizer step, overlapped with compute per phase (forward: max(compute, H2D),
  backward: max(compute, H2D, D2H)); the host update (CPU AdamW x the calibrated in-training slowdown, ranks of a
  node sharing its cores) runs after backward and the next forward waits for it (clipping), or overlaps the
  synced backward (``step_in_backward``); the forward of the resident units overlaps it either way.
* **ssd**: shards and optimizer state read once and written once per step, at the disk's read and write speeds
  one after the other (the ranks of a node share its disk).
"""

from __future__ import annotations

from dataclasses import dataclass

from shardfuse.plan._hardware import Floors
from shardfuse.plan._setup import Setup, Workload, state_bytes
from shardfuse.plan._shapes import ModelShape

__all__ = ["OPT_BYTES", "SIB_HIDDEN", "StepTime", "estimate_time", "ring_ms"]

# Bytes an optimizer step moves through GPU memory per parameter. Fused AdamW reads parameter, gradient and two
# moments and writes three (28 B, rounded up for the step counter and launch gaps); foreach takes more passes: the
# profiled AdamW step of bench/results/logs/h200x2-profile.log is 21.9 ps per parameter at 4,240 GB/s = 93 B.
OPT_BYTES = {("adamw", "fused"): 32.0, ("adamw", "foreach"): 93.0, ("sgd", "fused"): 20.0, ("sgd", "foreach"): 40.0}
# The share of the GPU optimizer step that StepInBackward hides behind backward (its updates on the post-backward
# stream share memory bandwidth with the backward's kernels): 10.3, 10.3 and 1.8 ms saved of a predicted 25 ms pass
# (7B decoder, float8, 2 x H200: e2e_7b_fp8_sib14_2gpu.json, e2e_7b_fp8_sib_2gpu.json, e2e_7b_fp8_sib_side_2gpu.json).
SIB_HIDDEN = 0.4
# Eager plain PyTorch (no sharding hooks) launches a block's work in this fraction of shardfuse's per-unit host
# time: the one-GPU 1K-token rows of bench/results/h200/e2e_2gpu.json, e2e_fused_2gpu.json, e2e_4gpu.json (54-62 ms
# for the 953M decoder) against shardfuse's 73.6 ms there (17 units x 4.33 ms).
PLAIN_LAUNCH_RATIO = 0.78
# The host optimizer's memory traffic relative to AdamW's (SGD with momentum: read p, g, m, write p, m).
HOST_OPT_RATIO = {"adamw": 1.0, "sgd": 20.0 / 28.0}


@dataclass(frozen=True)
class StepTime:
    step_ms: float
    compute_ms: float
    comm_ms: float  # all communication (overlapped or not)
    transfer_ms: float  # host <-> GPU copies, offload setups
    host_update_ms: float  # the host optimizer, offload setups
    disk_ms: float
    launch_ms: float  # eager host launch time
    bound: str  # what sets the step: "compute", "comm", "launch", "pcie", "host optimizer", "disk"


def ring_ms(nbytes: float, ranks: int, gbps: float, alpha_us: float, all_reduce: bool = False) -> float:
    """A ring all-gather / reduce-scatter (or all-reduce) of ``nbytes`` (the full size) over ``ranks`` ranks."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    factor = 2.0 if all_reduce else 1.0
    return factor * ((ranks - 1) * alpha_us * 1e-3 + (ranks - 1) / ranks * nbytes / (gbps * 1e6))


def _comm(shape: ModelShape, setup: Setup, work: Workload, f: Floors) -> tuple[float, float]:
    """(all communication, the exposed part) of one step, ms."""
    bw = min(f.nvlink_gbps, f.inter_gbps) if setup.inter_node else f.nvlink_gbps
    alpha = max(f.nvlink_alpha_us, f.inter_alpha_us) if setup.inter_node else f.nvlink_alpha_us
    gathers = work.micro_batches * (2 if setup.reshard_after_forward else 1)

    def unit(n: int) -> float:
        ag = ring_ms(2.0 * n, setup.shard, bw, alpha) * gathers
        rs = ring_ms(4.0 * n, setup.shard, bw, alpha)
        ar = ring_ms(4.0 * n / setup.shard, setup.replicas, f.inter_gbps, f.inter_alpha_us, all_reduce=True)
        return ag + rs + ar

    total = shape.n_layers * unit(shape.layer_params) + unit(shape.root_params)
    return total, unit(shape.root_params)


def estimate_time(shape: ModelShape, setup: Setup, work: Workload, f: Floors) -> StepTime:
    """The predicted step of ``setup`` (see the module docstring)."""
    compute = shape.flops_per_token(work.seq) * work.tokens / (f.tflops * 1e9)
    fwd, bwd = compute / 3.0, 2.0 * compute / 3.0
    if setup.checkpointing:
        bwd += fwd
    comm, exposed = _comm(shape, setup, work, f)
    per_byte = OPT_BYTES[(work.optimizer, work.optimizer_impl)] / (f.hbm_gbps * 1e6)
    launch = f.host_ms_per_unit_calibrated * shape.units * work.micro_batches
    if setup.kind == "plain":
        launch *= PLAIN_LAUNCH_RATIO
    if not setup.offloaded:
        opt = per_byte * shape.params / setup.shard
        if setup.step_in_backward:  # StepInBackward: each unit's update beside the backward of the next ones
            opt *= 1.0 - SIB_HIDDEN
        gpu = max(fwd + bwd, comm - exposed) + exposed + opt
        step = max(gpu, launch)
        bound = "launch" if launch >= gpu else ("comm" if comm - exposed > fwd + bwd else "compute")
        return StepTime(step, fwd + bwd, comm, 0.0, 0.0, 0.0, launch, bound)
    return _offload_time(shape, setup, work, f, fwd, bwd, comm, exposed, per_byte, launch)


def _offload_time(shape: ModelShape, setup: Setup, work: Workload, f: Floors, fwd: float, bwd: float, comm: float,
                  exposed: float, per_byte: float, launch: float) -> StepTime:
    m = work.micro_batches
    off = (shape.params - setup.resident_params) / setup.shard  # offloaded parameters per rank
    h2d = (2.0 if setup.host_compute_copy else 4.0) * off / (f.h2d_gbps * 1e6)
    d2h = 4.0 * off / (f.d2h_gbps * 1e6)
    kept = setup.accumulate_on_gpu and m > 1
    fwd_phases = [max(fwd / m, h2d if (j == 0 or not kept) else 0.0) for j in range(m)]
    bwd_h2d = h2d if setup.reshard_after_forward and not kept else 0.0
    bwd_phases = [max(bwd / m, bwd_h2d, d2h if j == m - 1 else 0.0) for j in range(m)]
    # The host update, the ranks of a node sharing its cores: ranks_per_node x the per-rank parameters.
    host = (f.cpu_adamw_ps * 1e-9 * f.host_slowdown_calibrated * HOST_OPT_RATIO[work.optimizer]
            * off * setup.ranks_per_node)  # fmt: skip
    resident_fwd = fwd / m * setup.resident_params / shape.params  # overlaps the update
    opt_gpu = per_byte * setup.resident_params / setup.shard
    if setup.step_in_backward:
        tail = max(bwd_phases[-1], host - resident_fwd)
        step = sum(fwd_phases) + sum(bwd_phases[:-1]) + tail + opt_gpu
    else:
        step = sum(fwd_phases) + sum(bwd_phases) + max(0.0, host - resident_fwd) + opt_gpu
    step += exposed + max(0.0, comm - exposed - (fwd + bwd))
    disk = 0.0
    if setup.kind == "ssd":
        nbytes = (4.0 + state_bytes(work.optimizer)) * off * setup.ranks_per_node
        disk = nbytes / (f.disk_read_gbps * 1e6) + nbytes / (f.disk_write_gbps * 1e6)
        step = max(step, disk + fwd_phases[0])
    step = max(step, launch)
    terms = {"disk": disk, "host optimizer": host, "pcie": max(h2d, d2h) * (m + 1), "compute": fwd + bwd,
             "launch": launch}  # fmt: skip
    return StepTime(step, fwd + bwd, comm, h2d * m + d2h, host, disk, launch, max(terms, key=lambda k: terms[k]))
