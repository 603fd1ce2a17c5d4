"""The setups worth trying on a machine, each predicted, and the one to start with."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from shardfuse.plan._hardware import Floors, Machine
from shardfuse.plan._memory import GIB, MemoryEstimate, choose_resident, estimate_memory
from shardfuse.plan._setup import Setup, Workload, state_bytes
from shardfuse.plan._shapes import ModelShape
from shardfuse.plan._time import StepTime, estimate_time

__all__ = ["GPU_USABLE", "HOST_USABLE", "Prediction", "candidate_setups", "offload_setup", "predict", "recommend"]

GPU_USABLE = 0.92  # of a GPU's memory: what OffloadOptimizer's default budget takes (sharding.host._placement's)
HOST_USABLE = 0.90  # of a node's memory (the OS, page cache, data loaders)


@dataclass(frozen=True)
class Prediction:
    """One setup, predicted: its memory, its step time, and whether it fits the machine (why not, if not)."""

    setup: Setup
    memory: MemoryEstimate
    time: StepTime
    tokens_per_gpu: int
    problems: tuple[str, ...] = ()  # empty: it fits
    reference: bool = False  # shown for comparison, never recommended (plain PyTorch)

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def tokens_per_s_gpu(self) -> float:
        return self.tokens_per_gpu / (self.time.step_ms * 1e-3)


def predict(shape: ModelShape, setup: Setup, work: Workload, floors: Floors, machine: Machine | None = None,
            reference: bool = False) -> Prediction:
    """Memory and step time of ``setup``; with ``machine``, whether it fits there."""
    mem = estimate_memory(shape, setup, work)
    time = estimate_time(shape, setup, work, floors)
    problems: list[str] = []
    if machine is not None:
        gpu_room = GPU_USABLE * machine.gpu_mem_gib
        if mem.gpu_peak / GIB > gpu_room:
            problems.append(f"GPU peak {mem.gpu_peak / GIB:.1f} GiB > {gpu_room:.1f} GiB usable")
        host_room = HOST_USABLE * machine.host_mem_gib
        if mem.host / GIB > host_room:
            problems.append(f"host {mem.host / GIB:.1f} GiB > {host_room:.1f} GiB usable per node")
        if mem.disk / GIB > machine.disk_gib:
            problems.append(f"disk {mem.disk / GIB:.1f} GiB > {machine.disk_gib:g} GiB free per node")
    return Prediction(setup, mem, time, work.tokens, tuple(problems), reference)


def offload_setup(shape: ModelShape, base: Setup, work: Workload, budget_gib: float) -> Setup:
    """``base`` (an offload or ssd setup) with the units ``OffloadOptimizer(gpu_budget_gib=budget_gib)`` would keep
    on the GPU: those that fit the budget less the full offload's peak, counted from the start of the forward."""
    full = estimate_memory(shape, dataclasses.replace(base, resident_params=0), work).gpu_peak
    per_param = (8.0 + state_bytes(work.optimizer)) / base.shard
    resident = choose_resident(shape.unit_sizes(), budget_gib * GIB - full, per_param) if budget_gib > 0 else 0
    return dataclasses.replace(base, resident_params=resident, gpu_budget_gib=budget_gib)


def _sharded(machine: Machine, ckpt: bool, mesh: tuple[int, int] | None, sib: bool) -> list[Setup]:
    n, g = machine.nodes, machine.gpus_per_node
    tag = " + checkpointing" if ckpt else ""
    out = [Setup(f"sharded{tag}", "sharded", shard=n * g, checkpointing=ckpt, step_in_backward=sib, inter_node=n > 1,
                 ranks_per_node=g)]
    replicas, shards = mesh or (n, g)
    if replicas > 1:
        out.append(Setup(f"hybrid {replicas}x{shards}{tag}", "sharded", shard=shards, replicas=replicas,
                         checkpointing=ckpt, step_in_backward=sib, inter_node=shards > g,
                         ranks_per_node=g))  # fmt: skip
    return out


def candidate_setups(shape: ModelShape, work: Workload, machine: Machine,
                     mesh: tuple[int, int] | None = None) -> list[Setup]:
    """The setups the planner compares: sharded (and hybrid over nodes; with ``StepInBackward`` where the workload
    does not clip) with and without activation checkpointing,
    OffloadOptimizer with the budget it would pick (with checkpointing when the activations need it), the SSD
    tier (when there is disk), and plain PyTorch on one GPU as a reference."""
    n, g = machine.nodes, machine.gpus_per_node
    world = n * g
    budget = math.floor(GPU_USABLE * machine.gpu_mem_gib)
    sib = not work.clip  # without clipping the optimizer may step in backward (StepInBackward, OffloadOptimizer's)
    setups = _sharded(machine, False, mesh, sib) + _sharded(machine, True, mesh, sib)
    for ckpt in (False, True):
        tag = " + checkpointing" if ckpt else ""
        base = Setup(f"offload (budget {budget} GiB){tag}", "offload", shard=world, checkpointing=ckpt,
                     step_in_backward=sib, inter_node=n > 1, ranks_per_node=g)  # fmt: skip
        setups.append(offload_setup(shape, base, work, budget))
    if machine.disk_gib > 0:
        for ckpt in (False, True):
            tag = " + checkpointing" if ckpt else ""
            setups.append(Setup(f"SSD tier{tag}", "ssd", shard=world, checkpointing=ckpt, step_in_backward=sib,
                                reshard_after_forward=False, inter_node=n > 1, ranks_per_node=g))  # fmt: skip
    return setups


def recommend(predictions: list[Prediction]) -> Prediction | None:
    """The fastest setup that fits (the first listed among equals); None when none fits."""
    fitting = [p for p in predictions if p.fits and not p.reference]
    return min(fitting, key=lambda p: p.time.step_ms) if fitting else None
