"""Host (Python and autograd) cost of the sharding layer per unit and step, on the CPU.

    python -m bench.e2e.host_overhead [--units 16] [--dim 32] [--reps 12] [--steps 60]

A stack of tiny residual blocks (so the math costs almost nothing) trains in a 1-process gloo group, once
plain and once with every block a ``FullyShardedDataParallel`` unit; the difference of the best step times is
what the wrapper adds on the host: what the communication-bound regime pays on every unit. Each measurement
is a ``torch.utils.benchmark.Timer`` run of ``--steps`` training steps (after its own warm-up) on one thread;
the two models alternate for ``--reps`` rounds and the best round of each counts: the machine's noise shows as
the spread between repeated invocations.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.benchmark import Timer

from bench.common import free_port
from shardfuse import FullyShardedDataParallel as FSDP


class TinyBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.a = nn.Linear(dim, dim, bias=False)
        self.b = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.relu(self.a(self.norm(x))))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--units", type=int, default=16, help="blocks, each one shardfuse unit")
    ap.add_argument("--dim", type=int, default=32, help="width of the blocks")
    ap.add_argument("--reps", type=int, default=12, help="alternating rounds; the best one of each model counts")
    ap.add_argument("--steps", type=int, default=60, help="training steps per timed round")
    args = ap.parse_args(argv)
    for name in ("units", "dim", "reps", "steps"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    return args


def stepper(model: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    """One SGD training step of ``model`` on ``x``."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()
        opt.step()

    return step


def measure(args: argparse.Namespace) -> dict[str, float]:
    """Best ms per step of the plain and of the sharded stack (a process group must exist)."""
    torch.manual_seed(0)
    plain = nn.Sequential(*[TinyBlock(args.dim) for _ in range(args.units)])
    layers = nn.Sequential(*[TinyBlock(args.dim) for _ in range(args.units)])
    for i in range(args.units):
        layers[i] = FSDP(layers[i])
    sharded = FSDP(layers)
    x = torch.randn(2, args.dim)
    timers = {
        name: Timer(stmt="step()", globals={"step": stepper(model, x)}, num_threads=1, label=name)
        for name, model in (("plain", plain), ("shardfuse", sharded))
    }
    best = dict.fromkeys(timers, float("inf"))
    for _ in range(args.reps):
        for name, timer in timers.items():
            best[name] = min(best[name], timer.timeit(args.steps).mean * 1e3)
    return best


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        best = measure(args)
    finally:
        dist.destroy_process_group()
    extra = best["shardfuse"] - best["plain"]
    print(f"plain {best['plain']:.2f} ms/step, shardfuse {best['shardfuse']:.2f} ms/step: "
          f"{extra:.2f} ms per step, {extra / args.units * 1e3:.0f} us per unit and step")


if __name__ == "__main__":
    main()
