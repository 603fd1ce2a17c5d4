"""Host time of the dispatching entry points on their PyTorch path, against that PyTorch sequence called directly.

    python -m bench.kernels.dispatch_overhead [--min-run-time 0.2] [--numel 256]

(from the repository root). Below its size crossover (``shardfuse.kernels._crossover``) each dispatching entry
point runs the PyTorch sequence it replaces; what it adds on top is host work: the plan key (every tensor's
address), the plan lookup and its layout guard (one C++ check of every tensor's layout), building the destination
views. Each row times a repeat call of the entry
point with its crossover forced to "torch" (the plan cached by the warm-up call) beside the bare PyTorch
sequence on the same tensors, and prints both and the difference, in microseconds per call.

On a GPU the tensors are small CUDA tensors, so each call is bound by the host (the GPU finishes each tiny copy
long before the next call is issued): the difference is what a small call pays for going through the entry point.
Without a GPU the tensors are CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``, under which the
plan cache serves CPU tensors): the copies then run on the CPU, so keep ``--numel`` small. Times are medians of
``torch.utils.benchmark.Timer.blocked_autorange`` (which synchronises CUDA).
"""

from __future__ import annotations

import argparse
import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: the plan cache serves CPU tensors

from torch.utils import benchmark  # noqa: E402

from shardfuse.kernels import _crossover  # noqa: E402

# By module path: ``shardfuse.kernels._chunk_cat`` the attribute is the function, not the module.
cast_multi, chunk_cat, concat = (
    importlib.import_module(f"shardfuse.kernels._{m}") for m in ("cast_multi", "chunk_cat", "concat")
)

WORLD_SIZE = 8
FACTOR = 4.0  # a power of two: the PyTorch path of chunk_cat scales it exactly


@dataclass
class Pair:
    """One entry point at one size, and the PyTorch sequence its PyTorch path runs, on the same tensors."""

    entry: str
    num_tensors: int
    call: Callable[[], object]  # the entry point as users call it
    bare: Callable[[], object]  # the PyTorch sequence alone
    result: Callable[[], object]  # what both write (to compare them)
    also: dict[str, Callable[[], object]] = field(default_factory=dict)  # other forms of the bare sequence


def _sizes(num: int, numel: int) -> list[int]:
    # Uneven like real parameters.
    return [numel + 8 * (i % 5) + (i % 3) for i in range(num)]


def cast_pairs(num: int, numel: int, device: str) -> list[Pair]:
    sizes = _sizes(num, numel)
    srcs = [torch.randn(k, device=device) for k in sizes]
    flat = torch.empty(sum(sizes), dtype=torch.bfloat16, device=device)
    outs = [torch.empty(k, dtype=torch.bfloat16, device=device) for k in sizes]
    views = list(flat.split(sizes))
    return [
        # Bare: FSDP2's sequence, split views then copy; "kept views": split once, outside the timed call.
        Pair("cast_shards flat", num, lambda: cast_multi.cast_shards(srcs, flat),
             lambda: torch._foreach_copy_(flat.split(sizes), srcs), lambda: flat,
             {"kept views": lambda: torch._foreach_copy_(views, srcs)}),
        Pair("cast_shards list", num, lambda: cast_multi.cast_shards(srcs, outs),
             lambda: torch._foreach_copy_(outs, srcs), lambda: outs),
    ]


def chunk_cat_pair(num: int, numel: int, device: str) -> Pair:
    cols = 64
    tensors = [torch.randn(max(1, numel // cols) + i % 3, cols, device=device).to(torch.bfloat16) for i in range(num)]
    out = torch._chunk_cat(tensors, 0, WORLD_SIZE)

    def bare() -> None:
        torch._chunk_cat(tensors, 0, WORLD_SIZE, out=out)
        out.div_(FACTOR)

    return Pair("chunk_cat", num, lambda: chunk_cat.chunk_cat(tensors, WORLD_SIZE, factor=FACTOR, out=out), bare,
                lambda: out)


def concat_pair(num: int, numel: int, device: str) -> Pair:
    cols = 64
    parts = [torch.randn(max(1, numel // cols) + i % 3, cols, device=device).to(torch.bfloat16) for i in range(num)]
    out = torch.cat(parts)
    return Pair("concat_microbatches", num, lambda: concat.concat_microbatches(parts, out=out),
                lambda: torch.cat(parts, out=out), lambda: out)


def pairs(numel: int, device: str) -> list[Pair]:
    """The cases: the tensor counts of the kernel benchmark's dispatch rows that stay below the count rules
    (``FOREACH_MIN_TENSORS``, ``TORCH_MIN_TENSORS``, past which the entry point skips its plan altogether)."""
    found: list[Pair] = []
    for num in (4, 16, 31):
        found += cast_pairs(num, numel, device)
    found += [chunk_cat_pair(num, numel, device) for num in (16, 48, 95)]
    found += [concat_pair(num, numel, device) for num in (4, 16)]
    return found


def torch_path():
    """Every dispatching family forced to its PyTorch sequence."""
    return _crossover.override(dict.fromkeys(_crossover.FAMILIES, "torch"))


def time_us(fn: Callable[[], object], min_run_time: float) -> float:
    fn()  # warm-up: builds and caches the launch plan
    timer = benchmark.Timer("fn()", globals={"fn": fn})
    return timer.blocked_autorange(min_run_time=min_run_time).median * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--min-run-time", type=float, default=0.2, help="seconds of timed calls per case")
    parser.add_argument("--numel", type=int, default=256, help="elements per tensor (about)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    where = torch.cuda.get_device_name() if device == "cuda" else "CPU tensors, Triton interpreter"
    print(f"host us per call, PyTorch path forced ({where}; about {args.numel} elements per tensor)")
    print(f"{'entry point':20s} {'tensors':>7s} {'entry':>9s} {'bare':>9s} {'added':>9s}")
    with torch_path():
        for pair in pairs(args.numel, device):
            entry_us = time_us(pair.call, args.min_run_time)
            bare_us = time_us(pair.bare, args.min_run_time)
            also = "".join(f"  bare, {k}: {time_us(fn, args.min_run_time):.1f}" for k, fn in pair.also.items())
            print(f"{pair.entry:20s} {pair.num_tensors:7d} {entry_us:9.1f} {bare_us:9.1f} {entry_us - bare_us:+9.1f}"
                  f"{also}", flush=True)


if __name__ == "__main__":
    main()
