"""Host (Python) time per call of every public kernel launcher, at 16 and 1000 tensors, and of the trusted
launches the sharding runtime calls (``[runtime]``: the same kernels without argument checks).

    python -m bench.kernels.host_overhead [--min-run-time 0.2]

(from the repository root). On a machine without a GPU the launchers run on CPU tensors with Triton's
interpreter switched on (so the Triton path is taken) and the kernel launches replaced by no-ops: what is
left is validation, plan lookup, table building and dispatch, the part that does not depend on the GPU.
On a GPU the kernels really launch on tiny tensors, so the time per call is the host's launch path end
to end (the GPU finishes each tiny kernel long before the next is issued). Where a launcher hands over to
a PyTorch op past a dispatch threshold, the 1000-tensor case is also timed with the Triton path forced.
Times are medians of ``torch.utils.benchmark.Timer.blocked_autorange`` (which synchronises CUDA). The PyTorch
path of the dispatching entry points, against the bare PyTorch sequence: ``python -m bench.kernels.dispatch_overhead``.
"""

from __future__ import annotations

import argparse
import importlib
import os
from collections.abc import Callable

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: take the Triton path on CPU

from torch.utils import benchmark  # noqa: E402

from bench.kernels.cases import forced_path  # noqa: E402

# By module path: ``shardfuse.kernels._chunk_cat`` the attribute is the function, not the module.
cast, cast_multi, chunk_cat, concat, flatten, grad_divide, grad_divide_multi = (
    importlib.import_module(f"shardfuse.kernels._{m}")
    for m in ("cast", "cast_multi", "chunk_cat", "concat", "flatten", "grad_divide", "grad_divide_multi")
)

KERNELS = {
    cast: ("_cast_shard_kernel",),
    cast_multi: ("_cast_shards_kernel",),
    flatten: ("_flat_segments_kernel",),
    chunk_cat: ("_chunk_cat_kernel",),
    concat: ("_concat_kernel",),
    grad_divide: ("_pre_divide_pad_kernel", "_post_divide_kernel"),
    grad_divide_multi: ("_pre_divide_pad_multi_kernel",),
}


class _NoLaunch:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](...)`` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def stub_launches() -> None:
    for module, names in KERNELS.items():
        for name in names:
            setattr(module, name, _NoLaunch())


def sizes(num: int) -> list[int]:
    # Small, uneven, some odd: the per-tensor host work is what is measured, not the copy.
    return [64 + 37 * (i % 11) + (i % 3) for i in range(num)]


def launchers(num: int, device: str) -> dict[str, Callable[[], object]]:
    ks = sizes(num)
    total = sum(ks)
    srcs = [torch.randn(k, device=device) for k in ks]
    flat_bf16 = torch.empty(total, dtype=torch.bfloat16, device=device)
    outs_bf16 = [torch.empty(k, dtype=torch.bfloat16, device=device) for k in ks]
    params = [torch.randn(k // 8 + 1, 8, device=device) for k in ks]
    padded = flatten.padded_numel(sum(p.numel() for p in params), 8)
    flat32 = torch.empty(padded, device=device)
    p_outs = [torch.empty_like(p) for p in params]
    rows = [torch.randn(k // 16 + 1, 16, device=device) for k in ks]
    cat_out = torch.empty(sum(r.shape[0] for r in rows), 16, device=device)
    cc_out = chunk_cat.chunk_cat(rows, 8, factor=4.0)
    pre_out = torch.empty(flatten.padded_numel(total, 8), device=device)
    list_cast = lambda: cast_multi.cast_shards(srcs, outs_bf16)
    cc = lambda: chunk_cat.chunk_cat(rows, 8, factor=4.0, out=cc_out)
    return {
        f"cast_shards flat ({num})": lambda: cast_multi.cast_shards(srcs, flat_bf16),
        f"cast_shards list ({num})": list_cast,
        f"cast_shards list, triton path ({num})": forced_path(
            "triton", ["cast_shards_list"], list_cast, (cast_multi, "FOREACH_MIN_TENSORS", 1 << 62),
            (cast_multi, "FOREACH_SMALL_MIN_TENSORS", 1 << 62),
        ),
        f"flatten_pad ({num})": lambda: flatten.flatten_pad(params, 8, out=flat32),
        f"unflatten_into ({num})": lambda: flatten.unflatten_into(flat32, p_outs),
        f"chunk_cat ({num})": cc,
        f"chunk_cat, triton path ({num})": forced_path(
            "triton", ["chunk_cat"], cc, (chunk_cat, "TORCH_MIN_TENSORS", 1 << 62)
        ),
        f"concat_microbatches ({num})": lambda: concat.concat_microbatches(rows, out=cat_out),
        f"pre_divide_pad ({num})": lambda: grad_divide_multi.pre_divide_pad(srcs, pre_out, 4.0),
        # The PyTorch ops of the same calls, for scale (real copies on CPU).
        f"torch._foreach_copy_ list ({num})": lambda: torch._foreach_copy_(outs_bf16, srcs),
        f"torch._chunk_cat + div_ ({num})": lambda: torch._chunk_cat(rows, 0, 8, out=cc_out).div_(4.0),
        f"torch.cat(out=) ({num})": lambda: torch.cat(rows, out=cat_out),
    }


def single_launchers(device: str) -> dict[str, Callable[[], object]]:
    src = torch.randn(4099, device=device)
    out16 = torch.empty(4099, dtype=torch.bfloat16, device=device)
    pad_out = torch.empty(4104, device=device)
    return {
        "cast_shard (1)": lambda: cast.cast_shard(src, out16),
        "cast_shard_unchecked (1) [runtime]": lambda: cast.cast_shard_unchecked(src, out16),
        "pre_divide_pad (1)": lambda: grad_divide_multi.pre_divide_pad(src, pad_out, 4.0),
        "pre_divide_pad_unchecked (1) [runtime]": lambda: grad_divide.pre_divide_pad_unchecked(src, pad_out, 4.0),
        "post_divide (1)": lambda: grad_divide.post_divide(src, pad_out[:4099], 2.0),
        "post_divide_unchecked (1) [runtime]": lambda: grad_divide.post_divide_unchecked(src, pad_out[:4099], 2.0),
    }


def time_us(fn: Callable[[], object], min_run_time: float) -> float:
    fn()  # warm-up: compiles, builds and caches the launch plan
    timer = benchmark.Timer("fn()", globals={"fn": fn})
    return timer.blocked_autorange(min_run_time=min_run_time).median * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--min-run-time", type=float, default=0.2, help="seconds of timed calls per case")
    args = parser.parse_args()
    real = torch.cuda.is_available()
    device = "cuda" if real else "cpu"
    if not real:
        stub_launches()
    where = f"real launches on {torch.cuda.get_device_name()}" if real else "CPU, no-op launches"
    print(f"host time per call ({where})")
    cases = dict(single_launchers(device))
    for num in (16, 1000):
        cases.update(launchers(num, device))
    for name, fn in cases.items():
        print(f"{name:40s} {time_us(fn, args.min_run_time):9.1f} us", flush=True)


if __name__ == "__main__":
    main()
