"""The planner's report as text, and the code that starts the recommended setup."""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardfuse.plan._memory import GIB

if TYPE_CHECKING:
    from shardfuse.plan._hardware import Floors, Machine
    from shardfuse.plan._planner import Prediction
    from shardfuse.plan._setup import Workload
    from shardfuse.plan._shapes import ModelShape

__all__ = ["render", "snippet"]


def _row(p: Prediction) -> str:
    m, t = p.memory, p.time
    fits = "yes" if p.fits else "no: " + "; ".join(p.problems)
    name = p.setup.name + (" [reference]" if p.reference else "")
    disk = f"{m.disk / GIB:8.1f}" if m.disk else f"{'-':>8s}"
    return (f"{name:44s} {m.gpu_peak / GIB:8.1f} {m.host / GIB:9.1f} {disk} {t.step_ms:9.0f} "
            f"{p.tokens_per_s_gpu:9,.0f}  {t.bound:15s} {fits}")


def render(s: ModelShape, mc: Machine, w: Workload, f: Floors, predictions: list[Prediction],
           best: Prediction | None) -> str:
    """The table of every setup and the recommendation, with the code to start it."""
    lines = [
        f"model {s.name}: {s.params / 1e9:.2f}B parameters, {s.n_layers} blocks + root as units "
        f"(dim {s.dim}, vocab {s.vocab_size})",
        f"machine: {mc.nodes} node(s) x {mc.gpus_per_node} GPU(s) of {mc.gpu_mem_gib:g} GiB, {mc.host_mem_gib:g} GiB "
        f"host and {mc.disk_gib:g} GiB disk per node",
        f"step: {w.tokens:,} tokens per GPU ({w.micro_batches} micro-batch(es), seq {w.seq}), {w.optimizer} "
        f"({w.optimizer_impl}), {'clipping' if w.clip else 'no clipping'}",
        f"floors ({f.source}): {f.tflops:.4g} TFLOP/s, pinned H2D/D2H {f.h2d_gbps:.3g}/{f.d2h_gbps:.3g} GB/s, CPU "
        f"AdamW {f.cpu_adamw_ps:.4g} ps/param (x{f.host_slowdown_calibrated:g} in training), disk read/write "
        f"{f.disk_read_gbps:.3g}/{f.disk_write_gbps:.3g} GB/s",
        "",
        f"{'setup':44s} {'GPU GiB':>8s} {'host GiB':>9s} {'disk GiB':>8s} {'step ms':>9s} {'tok/s/GPU':>9s}  "
        f"{'bound':15s} fits",
    ]
    lines += [_row(p) for p in predictions]
    if best is None:
        lines += ["", "No setup fits this machine. Give it more GPUs (--gpus, --nodes), host memory or disk (the SSD "
                      "tier), or fewer tokens per GPU (--tokens; accumulate with --micro-batches)."]  # fmt: skip
    else:
        lines += ["", f"recommended: {best.setup.name} (~{best.time.step_ms:,.0f} ms/step, "
                      f"{best.tokens_per_s_gpu:,.0f} tokens/s/GPU, {best.time.bound}-bound)", "",
                  snippet(best, mc.nodes, mc.gpus_per_node, w.optimizer)]  # fmt: skip
    return "\n".join(lines)


def snippet(p: Prediction, nodes: int, gpus_per_node: int, optimizer: str = "adamw") -> str:
    """Python that wraps ``model`` (its blocks of class ``Block``) for the setup of ``p`` and makes its optimizer;
    starts under ``torchrun`` (the launch line is the first comment)."""
    setup = p.setup
    launch = f"torchrun --nproc-per-node {gpus_per_node}" + (
        f" --nnodes {nodes} --rdzv-backend c10d --rdzv-endpoint HOST:29500" if nodes > 1 else "")
    imports = ["FullyShardedDataParallel as FSDP", "ModuleClassWrapPolicy", "auto_wrap", "enable_wrap", "wrap"]
    kwargs = ["mixed_precision=True", "compute_dtype=torch.bfloat16", "fp32_reduce_scatter=True"]
    body: list[str] = []
    if setup.replicas > 1:
        body.append(f'mesh = init_device_mesh("cuda", ({setup.replicas}, {setup.shard}), '
                    'mesh_dim_names=("replicate", "shard"))')  # fmt: skip
        kwargs.append("device_mesh=mesh")
    if setup.offloaded:
        imports.append("OffloadOptimizer")
        kwargs.append("move_params_to_cpu=True")
    if setup.kind == "ssd":
        imports.append("OffloadConfig")
        body.append('ssd = OffloadConfig(offload_type="ssd_offload", dir="/mnt/nvme/shardfuse", optimizer_state=True, '
                    'direct_io=True)  # a directory on a local NVMe SSD')  # fmt: skip
        kwargs.append("offload_config=ssd")
    if not setup.reshard_after_forward:
        kwargs.append("reshard_after_forward=False")
    if setup.checkpointing:
        imports.append("checkpoint_wrapper")
        body.append("for i, block in enumerate(model.layers):  # activation checkpointing of every block")
        body.append("    model.layers[i] = checkpoint_wrapper(block)")
    body.append("policy = ModuleClassWrapPolicy({Block})  # one unit per block, the rest is the root unit")
    body.append(f"with enable_wrap(wrapper_cls=FSDP, {', '.join(kwargs)}):")
    body.append("    model = wrap(auto_wrap(model, auto_wrap_policy=policy))")
    opt = ("torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)" if optimizer == "adamw"
           else "torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)")  # fmt: skip
    if setup.step_in_backward and not setup.offloaded:
        imports.append("StepInBackward")
        opt = f"StepInBackward(model, {opt})  # each unit's update in backward: no clip_grad_norm_"
    if setup.offloaded:
        extra = ", step_in_backward=True" if setup.step_in_backward else ""
        extra += ", accumulate_on_gpu=True" if setup.accumulate_on_gpu else ""
        opt = f"OffloadOptimizer(model, {opt}, gpu_budget_gib={setup.gpu_budget_gib:g}{extra})"
    body.append(f"opt = {opt}")
    head = [f"# {launch} train.py", "# in train.py, after dist.init_process_group(\"nccl\") and "
            "torch.cuda.set_device(local_rank);", "# `model` is your model (built on the CPU), `Block` its block "
            "class", "import torch"]  # fmt: skip
    if setup.replicas > 1:
        head.append("from torch.distributed.device_mesh import init_device_mesh")
    line = f"from shardfuse import {', '.join(imports)}"
    head += [line] if len(line) <= 100 else ["from shardfuse import (", *(f"    {i}," for i in imports), ")"]
    return "\n".join(head + [""] + body)
