"""Launch-shape sweep of the flat shard cast (``shardfuse.kernels._cast``), against ``out.copy_(src)``.

    python -m bench.kernels.sweep_cast_block [--sizes 16M,64M,256M] [--dtype bf16]

(from the repository root; needs a CUDA GPU). The kernel streams each element once (read fp32, write the compute
dtype), so its knobs are the elements per program (``BLOCK``), the warps per program, the cache hint of its loads
and stores, and whether offsets are 64-bit (needed past 2^31 elements) or 32-bit. Prints, per size, each variant's
GB/s and its speed over ``copy_`` (torch's cast kernel, the ceiling the report's ``shard_cast`` rows compare with),
the library's own launch marked (no cache hint since 2026-11-28: evict_first cost 10% on an H200), the best
variant last; every variant's output is checked bit-equal to ``copy_``'s.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton
import triton.language as tl

from bench.kernels.run import parse_size, time_ms
from shardfuse.kernels import _common as common
from shardfuse.kernels._cast import cast_shard_unchecked

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@triton.jit
def _variant_kernel(src, dst, n, BLOCK: tl.constexpr, EVICT: tl.constexpr, IDX64: tl.constexpr):
    pid = tl.program_id(0)
    if IDX64:
        pid = pid.to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    if (pid + 1) * BLOCK <= n:
        if EVICT:
            x = tl.load(src + offs, eviction_policy="evict_first")
            tl.store(dst + offs, x.to(dst.dtype.element_ty), eviction_policy="evict_first")
        else:
            tl.store(dst + offs, tl.load(src + offs).to(dst.dtype.element_ty))
    else:
        mask = offs < n
        tl.store(dst + offs, tl.load(src + offs, mask=mask).to(dst.dtype.element_ty), mask=mask)


def _variant(src: torch.Tensor, out: torch.Tensor, block: int, warps: int, evict: bool, idx64: bool):
    n = src.numel()
    grid = (triton.cdiv(n, block),)
    return lambda: _variant_kernel[grid](src, out, n, BLOCK=block, EVICT=evict, IDX64=idx64, num_warps=warps)


def sweep(n: int, dtype: torch.dtype) -> None:
    src = torch.randn(n, device="cuda")
    out = torch.empty(n, dtype=dtype, device="cuda")
    ref = torch.empty_like(out).copy_(src)
    nbytes = n * (4 + out.element_size())
    gbps = lambda ms: nbytes / (ms * 1e-3) / 1e9  # noqa: E731
    copy_ms = time_ms(lambda: out.copy_(src))
    lib_ms = time_ms(lambda: cast_shard_unchecked(src, out))
    print(f"\nn={n} fp32->{str(dtype).split('.')[-1]}: copy_ {gbps(copy_ms):.0f} GB/s; library "
          f"(BLOCK {common.BLOCK_SIZE}, {common.NUM_WARPS} warps, no cache hint, 64-bit) {gbps(lib_ms):.0f} GB/s "
          f"= {copy_ms / lib_ms:.3f}x copy_")
    best = None
    for block, warps, evict, idx64 in itertools.product((1024, 2048, 4096, 8192, 16384), (4, 8, 16), (True, False),
                                                       (True, False)):
        if block // (32 * warps) < 4:
            continue  # fewer than 4 elements a thread: no full 16-byte vector
        run = _variant(src, out, block, warps, evict, idx64)
        out.fill_(float("nan"))
        run()
        exact = torch.equal(out, ref)
        ms = time_ms(run)
        library = (common.BLOCK_SIZE, common.NUM_WARPS, False, True)
        mark = " (library)" if (block, warps, evict, idx64) == library else ""
        print(f"BLOCK {block:>5} warps {warps:>2} evict_first {evict!s:>5} idx64 {idx64!s:>5}: {gbps(ms):6.0f} GB/s "
              f"{copy_ms / ms:6.3f}x copy_ exact={exact}{mark}")
        if exact and (best is None or ms < best[0]):
            best = (ms, block, warps, evict, idx64)
    if best is not None:
        ms, block, warps, evict, idx64 = best
        print(f"best: BLOCK {block} warps {warps} evict_first {evict} idx64 {idx64}: {copy_ms / ms:.3f}x copy_")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="16M,64M,256M")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}")
    for size in args.sizes.split(","):
        sweep(parse_size(size), DTYPES[args.dtype])


if __name__ == "__main__":
    main()
