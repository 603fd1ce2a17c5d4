"""The planner: which shardfuse setup fits a model on a machine, how fast it should run, and the code to start it.

    python -m shardfuse.plan llama-7b --gpus 8 --gpu-mem 80 --host-mem 512 --tokens 4096
    python -m shardfuse.plan path/to/config.json --gpus 1 --gpu-mem 24 --host-mem 64 --disk 500 --probe

or from Python (``shardfuse.plan`` is callable: ``shardfuse.plan(...)`` is :func:`plan`)::

    p = shardfuse.plan("6.7b", gpus=1, gpu_mem_gib=80, host_mem_gib=128, tokens=2048)
    print(p.text())            # the table, the recommendation and its code
    p.recommended.memory       # bytes: gpu_peak, host, disk

Every setup (sharded; hybrid over nodes; each with activation checkpointing; ``OffloadOptimizer`` with the GPU
budget it would pick; the SSD tier; plain PyTorch on one GPU as a reference) gets a GPU peak, host memory and disk,
and a step time from the machine's floors (stored per GPU kind, or measured with ``--probe``). The models, and
how close they come to every stored benchmark row, are in docs/planner.md. Nothing here imports torch unless the
model is an ``nn.Module`` or ``probe=True``.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass
from typing import Any

from shardfuse.plan._hardware import DEFAULT_KIND, KINDS, Floors, Machine, floors_for
from shardfuse.plan._planner import Prediction, candidate_setups, predict, recommend
from shardfuse.plan._setup import Setup, Workload
from shardfuse.plan._shapes import BUILTIN, ModelShape, decoder, resolve_model

__all__ = ["BUILTIN", "KINDS", "Floors", "Machine", "ModelShape", "Plan", "Prediction", "Setup", "Workload",
           "decoder", "floors_for", "plan", "predict"]  # fmt: skip


@dataclass(frozen=True)
class Plan:
    """Every setup predicted for ``shape`` on ``machine``; ``recommended`` is the fastest that fits (or None)."""

    shape: ModelShape
    machine: Machine
    workload: Workload
    floors: Floors
    predictions: list[Prediction]
    recommended: Prediction | None

    def text(self) -> str:
        from shardfuse.plan._render import render

        return render(self.shape, self.machine, self.workload, self.floors, self.predictions, self.recommended)

    def code(self) -> str | None:
        """The Python that starts the recommended setup (None when nothing fits)."""
        from shardfuse.plan._render import snippet

        if self.recommended is None:
            return None
        return snippet(self.recommended, self.machine.nodes, self.machine.gpus_per_node, self.workload.optimizer)


def _check_tokens(tokens: Any, seq: Any) -> tuple[int, int]:
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens <= 0:
        raise ValueError(f"tokens must be a positive integer (tokens per GPU per optimizer step), got {tokens!r}: "
                         f"e.g. 4096 for a batch of 2 sequences of 2048")
    seq = min(tokens, 2048) if seq is None else seq
    if not isinstance(seq, int) or isinstance(seq, bool) or seq <= 0 or tokens % seq:
        raise ValueError(f"seq must be a positive integer that divides tokens={tokens}, got {seq!r}: the tokens "
                         f"of a step are whole sequences")
    return tokens, seq


def _check_mesh(mesh: Any, machine: Machine) -> None:
    if mesh is None:
        return
    ok = isinstance(mesh, tuple) and len(mesh) == 2 and all(isinstance(x, int) and x >= 1 for x in mesh)
    if not ok:
        raise ValueError(f"mesh must be (replicas, shards), two integers >= 1, got {mesh!r}")
    replicas, shards = mesh
    if replicas * shards != machine.world:
        raise ValueError(f"mesh {replicas}x{shards} covers {replicas * shards} GPUs but nodes x gpus = "
                         f"{machine.nodes}x{machine.gpus_per_node} = {machine.world}: the mesh must cover every GPU "
                         f"(replicas x shards = nodes x GPUs per node)")
    if shards % machine.gpus_per_node and machine.gpus_per_node % shards:
        raise ValueError(f"mesh {replicas}x{shards}: {shards} shards and {machine.gpus_per_node} GPUs per node do "
                         f"not nest (a shard group must fill whole nodes or divide one): pick shards dividing or "
                         f"divided by the GPUs per node")


def plan(model: Any, *, gpus: int = 1, nodes: int = 1, mesh: tuple[int, int] | None = None,
         gpu_mem_gib: float | None = None, host_mem_gib: float = 256.0, disk_gib: float = 0.0, tokens: int = 4096,
         seq: int | None = None, micro_batches: int = 1, optimizer: str = "adamw", clip: bool = True,
         gpu_kind: str = DEFAULT_KIND, floors: Floors | None = None, probe: bool = False,
         probe_dir: str | None = None) -> Plan:
    """Predict every setup of ``model`` on ``nodes`` x ``gpus`` GPUs (per node) and recommend one.

    ``mesh``: the hybrid mesh ``(replicas, shards)`` (default ``(nodes, gpus)``); it must cover every GPU.
    ``model``: a built-in shape name (``sorted(BUILTIN)``, ``llama-7b``...), a local ``config.json`` path, a dict or
    ``transformers`` config, an ``nn.Module`` or a :class:`ModelShape` (``decoder(...)`` for dims).
    ``gpu_mem_gib`` (default: the GPU kind's), ``host_mem_gib`` and ``disk_gib`` (free space for the SSD tier; 0: no
    SSD tier) per node. ``tokens`` per GPU per optimizer step, in sequences of ``seq`` (default ``min(tokens,
    2048)``), split into ``micro_batches`` accumulated passes. ``floors``: throughputs to use (default: measured with
    ``probe=True``, else the stored ``gpu_kind``'s). Impossible inputs raise ``ValueError`` naming the value.
    """
    shape = resolve_model(model)
    tokens, seq = _check_tokens(tokens, seq)
    work = Workload(tokens, seq, micro_batches, optimizer, "fused", clip)
    if floors is None:
        if probe:
            from shardfuse.plan._probe import probe as run_probe

            floors = run_probe(None if gpu_kind == DEFAULT_KIND else gpu_kind, probe_dir)
        else:
            floors = floors_for(gpu_kind)
    machine = Machine(gpus, nodes, gpu_mem_gib if gpu_mem_gib is not None else floors.gpu_mem_gib, host_mem_gib,
                      disk_gib)  # fmt: skip
    _check_mesh(mesh, machine)
    setups = candidate_setups(shape, work, machine, mesh)
    preds = [predict(shape, s, work, floors, machine) for s in setups]
    plain = Setup("plain PyTorch, one GPU", "plain")
    preds.append(predict(shape, plain, work, floors, machine, reference=True))
    return Plan(shape, machine, work, floors, preds, recommend(preds))


class _CallableModule(types.ModuleType):
    """``shardfuse.plan`` is this package once imported (``python -m shardfuse.plan``, ``import shardfuse.plan``)
    and the function before: calling the package calls :func:`plan`, so ``shardfuse.plan(...)`` works either way."""

    def __call__(self, *args: Any, **kwargs: Any) -> Plan:
        return plan(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
