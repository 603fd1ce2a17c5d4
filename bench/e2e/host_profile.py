"""Where the eager step's host time goes on GPUs: host enqueue time against the synchronised step, and a
cProfile of rank 0, for each implementation in turn (the decoder, 1K tokens per GPU, fused AdamW).

    torchrun --standalone --nproc_per_node 2 -m bench.e2e.host_profile [--impls shardfuse,fairscale]
        [--steps 10] [--out DIR] [--device cpu --config tiny]

Each implementation trains 5 warm-up steps, then ``--steps`` timed steps without the profiler (the host
enqueue time: from the step's start until the host returns from it; the synchronised step: until the GPU is
done too), then ``--steps`` more under cProfile. A step whose host enqueue time is close to its synchronised
time is host-bound: the GPU waits for the host. Rank 0 prints the medians and the profile's top functions
and writes ``<impl>.pstats`` to ``--out`` (default ``$OUT`` or the working directory). cProfile sees the main
thread only: hooks that autograd runs on its device threads in backward are missing from the profile (their
time is still in the host enqueue time). ``--device cpu`` (gloo, for the tests) checks the plumbing only.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import functools
import io
import os
import pstats
import statistics
import time

import torch
import torch.distributed as dist

from bench.e2e import run as e2e

WARMUP = 5


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--impls", default="shardfuse,fairscale", help="comma-separated, from bench.e2e.run")
    ap.add_argument("--steps", type=int, default=10, help="timed steps, then as many profiled ones")
    ap.add_argument("--top", type=int, default=30, help="functions printed, by own time")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for <impl>.pstats")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: gloo, plumbing only")
    ap.add_argument("--config", default="bench", help="the decoder's config (tiny for --device cpu)")
    args = ap.parse_args(argv)
    # The eager sharded steps only: the captured step has no host work to profile, the one-GPU baseline runs
    # on one rank under autocast.
    choices = sorted(set(e2e.WRAPPERS) - {"baseline", "shardfuse-graph"})
    unknown = [i for i in args.impls.split(",") if i not in choices]
    if unknown:
        ap.error(f"unsupported --impls {unknown}: choose from {choices}")
    if args.steps < 1:
        ap.error(f"--steps must be >= 1, got {args.steps}")
    return args


def profile_impl(impl: str, args: argparse.Namespace, device: torch.device, rank: int) -> None:
    spec = e2e.model_spec("decoder", args.config)
    batch, seq = e2e.REGIMES["1k"]
    seq = min(seq, spec.max_seq_len)
    data = e2e.make_data(spec.vocab_size, batch, seq, rank, 0, device)
    model = e2e.WRAPPERS[impl](spec.make(device, 0), spec, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    step = functools.partial(e2e._eager_step, model, opt, False, spec)
    host, synced = [], []
    prof = cProfile.Profile()
    for i in range(WARMUP + 2 * args.steps):
        profiled = i >= WARMUP + args.steps
        e2e.sync(device)
        t0 = time.perf_counter()
        if profiled:
            prof.enable()
        step(data[i % len(data)])
        if profiled:
            prof.disable()
        t1 = time.perf_counter()
        e2e.sync(device)
        if WARMUP <= i < WARMUP + args.steps:
            host.append(t1 - t0)
            synced.append(time.perf_counter() - t0)
    if rank == 0:
        print(
            f"{impl}: median host enqueue {1e3 * statistics.median(host):.1f} ms, synchronised step "
            f"{1e3 * statistics.median(synced):.1f} ms ({args.steps} steps, rank 0)"
        )
        prof.dump_stats(os.path.join(args.out, f"{impl}.pstats"))
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(args.top)
        print(text.getvalue())
    del model, opt, step
    if device.type == "cuda":
        torch.cuda.empty_cache()
    dist.barrier()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench.e2e.host_profile: no CUDA GPU here; pass --device cpu (plumbing only)")
    if "RANK" not in os.environ:
        raise SystemExit("bench.e2e.host_profile runs under torchrun: torchrun --nproc_per_node 2 -m ...")
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank) if args.device == "cuda" else torch.device("cpu")
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", timeout=datetime.timedelta(seconds=120))
    try:
        for impl in args.impls.split(","):
            profile_impl(impl, args, device, rank)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
