"""Tile shape sweep of flatten_pad's transposed path (the one tuning knob it has), on the benchmark's case.

    python -m bench.kernels.sweep_flatten_tile [--size 64M]

(from the repository root). Prints GB/s and % of the device copy bandwidth for each (tile, warps) pair;
the library's setting is ``shardfuse.kernels._flatten._TILE`` with ``shardfuse.kernels._common.NUM_WARPS``
warps.
"""

from __future__ import annotations

import argparse

import torch

from bench.kernels.bench_flatten import WORLD_SIZE, param_shapes
from bench.kernels.run import parse_size, time_ms
from shardfuse.kernels import _common as common
from shardfuse.kernels import _flatten as flatten


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="64M")
    args = ap.parse_args()
    n = parse_size(args.size)
    params = [torch.randn(s, device="cuda") for s in param_shapes(n)]
    transposed = [p.t() if p.dim() == 2 else p for p in params]
    total = sum(p.numel() for p in params)
    out = torch.empty(flatten.padded_numel(total, WORLD_SIZE), device="cuda")
    nbytes = 2 * out.numel() * 4
    src = torch.empty(n, device="cuda")
    copy_gbps = 2 * n * 4 / (time_ms(lambda: src.clone()) * 1e-3) / 1e9
    expected = flatten.flatten_pad_ref(transposed, WORLD_SIZE)
    default = (flatten._TILE, common.NUM_WARPS)
    print(f"flatten_pad, {len(params)} transposed fp32 params, {total} elements; copy {copy_gbps:.0f} GB/s")
    for tile in (32, 64, 128):
        for warps in (4, 8):
            flatten._TILE, common.NUM_WARPS = tile, warps
            common.clear_plan_caches()
            flatten.flatten_pad(transposed, WORLD_SIZE, out=out)
            ok = torch.equal(out, expected)
            gbps = nbytes / (time_ms(lambda: flatten.flatten_pad(transposed, WORLD_SIZE, out=out)) * 1e-3) / 1e9
            mark = " (library)" if (tile, warps) == default else ""
            print(f"tile {tile:>3} warps {warps}: {gbps:7.0f} GB/s {100 * gbps / copy_gbps:5.1f}% exact={ok}{mark}")
    flatten._TILE, common.NUM_WARPS = default
    common.clear_plan_caches()


if __name__ == "__main__":
    main()
