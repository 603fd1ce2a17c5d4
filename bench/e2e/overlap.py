"""Where communication overlaps compute: a kernel timeline of one training step, from torch.profiler.

    torchrun --standalone --nproc_per_node 2 -m bench.e2e.overlap [--units 6] [--dim 4096]
    torchrun --standalone --nproc_per_node 2 -m bench.e2e.overlap --captured --baseline [--model hf-llama]

A stack of ``units`` residual MLP blocks (two dim x dim GEMMs each), every block one shardfuse unit plus the
root, bf16 compute and fp32 reduce-scatter. After warm-up steps (the first records the forward order), one
step is profiled. Rank 0 prints every kernel in start order (stream, start and duration in us, name) and
the share of all-gather / reduce-scatter time during which any kernel on another stream (compute) ran, with
and without the step's first collective of each kind (it includes the wait for the slowest rank).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import ProfilerActivity, profile

from shardfuse import FullyShardedDataParallel as FSDP


class WideBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.a = nn.Linear(dim, dim, bias=False)
        self.b = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.relu(self.a(x)))


def merged_overlap(comm: list[tuple[float, float]], busy: list[tuple[float, float]]) -> float:
    """Time of ``comm`` intervals covered by the union of ``busy`` intervals."""
    merged: list[list[float]] = []
    for s, e in sorted(busy):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return sum(max(0.0, min(e0, e1) - max(s0, s1)) for s0, e0 in comm for s1, e1 in merged)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--units", type=int, default=6, help="residual MLP blocks (without --captured)")
    ap.add_argument("--dim", type=int, default=4096, help="their width (without --captured)")
    ap.add_argument("--tokens", type=int, default=None,
                    help="tokens per GPU (default 8192; with --captured 1024, batch 1)")
    ap.add_argument("--captured", action="store_true", help="profile the bench model's captured step")
    ap.add_argument("--baseline", action="store_true", help="with --captured: also the one-GPU captured step")
    ap.add_argument("--eager", action="store_true", help="with --captured: also the same sharded step, eager")
    ap.add_argument("--model", choices=("decoder", "hf-llama"), default="decoder")
    ap.add_argument("--config", default="bench")
    ap.add_argument("--replays", type=int, default=5, help="profiled steps (each on its own); the median is kept")
    ap.add_argument("--warmup", type=int, default=3, help="steps before them")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default=None, help="result name (default overlap_captured[_hf]_<N>gpu)")
    args = ap.parse_args(argv)
    if (args.baseline or args.eager) and not args.captured:
        ap.error("--baseline and --eager go with --captured")
    if args.replays < 1 or args.warmup < 0:
        ap.error(f"need --replays >= 1 and --warmup >= 0, got {args.replays=} {args.warmup=}")
    if args.tokens is None:
        args.tokens = 1024 if args.captured else 8192
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    if args.captured:
        from bench.e2e._overlap_captured import run_captured

        run_captured(args)
        dist.destroy_process_group()
        return
    toy_step_profile(args, rank)
    dist.destroy_process_group()


def toy_step_profile(args: argparse.Namespace, rank: int) -> None:
    """The residual-MLP stack's eager step: every kernel and the collectives' overlap (rank 0 prints)."""
    torch.manual_seed(0)
    kw = dict(mixed_precision=True, compute_dtype=torch.bfloat16, fp32_reduce_scatter=True)
    layers = nn.Sequential(*[WideBlock(args.dim) for _ in range(args.units)]).cuda()
    for i in range(args.units):
        layers[i] = FSDP(layers[i], **kw)
    model = FSDP(layers, **kw)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(args.tokens, args.dim, device="cuda")

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(x).float().pow(2).mean().backward()
        opt.step()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > 0]
    kernels.sort(key=lambda e: e.time_range.start)
    t0 = kernels[0].time_range.start if kernels else 0
    comm = {"allgather": [], "reducescatter": []}
    busy = []
    for e in kernels:
        name = e.name.lower()
        span = (e.time_range.start, e.time_range.end)
        kind = next((k for k in comm if k in name), None)
        if kind:
            comm[kind].append(span)
        elif "nccl" not in name and "memcpy" not in name and "memset" not in name:
            busy.append(span)
    if rank == 0:
        for e in kernels:
            print(f"{getattr(e, 'device_resource_id', '?'):>4} {e.time_range.start - t0:10.1f} "
                  f"{e.time_range.elapsed_us():9.1f}  {e.name[:90]}")
        total = kernels[-1].time_range.end - t0 if kernels else 0
        print(f"\nstep kernels span {total / 1e3:.2f} ms; compute busy {sum(b - a for a, b in busy) / 1e3:.2f} ms")
        for kind, spans in comm.items():
            # The step's first collective also waits for the slowest rank to arrive: report without it too.
            for label, sel in ((kind, spans), (f"{kind} (w/o 1st)", spans[1:])):
                tot = sum(b - a for a, b in sel)
                ov = merged_overlap(sel, busy)
                print(f"{label:26s} {len(sel):3d} kernels {tot / 1e3:7.2f} ms, overlapped with compute "
                      f"{ov / 1e3:7.2f} ms ({100 * ov / max(tot, 1e-9):.0f}%)")


if __name__ == "__main__":
    main()
