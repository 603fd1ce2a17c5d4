"""Host (Python and autograd) cost of the sharding layer per unit and step, on the CPU.

    PYTHONPATH=$PWD python bench/e2e/host_overhead.py [--units 16] [--dim 32] [--reps 12]

A stack of tiny residual blocks (so the math costs almost nothing) trains in a 1-process gloo group, once
plain and once with every block a ``FullyShardedDataParallel`` unit; the difference of the best step times is
what the wrapper adds on the host: what the communication-bound regime pays on every unit. One thread, runs
interleaved, best of ``--reps``: the machine's noise shows as the spread between repeated invocations.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from shardfuse import FullyShardedDataParallel as FSDP  # noqa: E402


class TinyBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.a = nn.Linear(dim, dim, bias=False)
        self.b = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.relu(self.a(self.norm(x))))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--units", type=int, default=16)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    plain = nn.Sequential(*[TinyBlock(args.dim) for _ in range(args.units)])
    layers = nn.Sequential(*[TinyBlock(args.dim) for _ in range(args.units)])
    for i in range(args.units):
        layers[i] = FSDP(layers[i])
    sharded = FSDP(layers)
    x = torch.randn(2, args.dim)

    def stepper(model: nn.Module):
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            model(x).pow(2).mean().backward()
            opt.step()

        return step

    best = {"plain": float("inf"), "shardfuse": float("inf")}
    steps = {"plain": stepper(plain), "shardfuse": stepper(sharded)}
    for _ in range(args.reps):
        for name, step in steps.items():
            for _ in range(3):
                step()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step()
            best[name] = min(best[name], (time.perf_counter() - t0) / args.steps * 1e3)
    extra = best["shardfuse"] - best["plain"]
    print(f"plain {best['plain']:.2f} ms/step, shardfuse {best['shardfuse']:.2f} ms/step: "
          f"{extra:.2f} ms per step, {extra / args.units * 1e3:.0f} us per unit and step")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
