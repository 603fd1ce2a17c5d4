"""``python -m shardfuse.plan``: the planner's command line (``--help`` says everything)."""

from __future__ import annotations

import argparse
import sys

from shardfuse.plan import plan
from shardfuse.plan._hardware import DEFAULT_KIND, KINDS
from shardfuse.plan._shapes import ALIASES, BUILTIN, decoder

DESCRIPTION = """\
Which shardfuse setup fits MODEL on your GPUs, how fast it should run, and the code to start it.

For each setup (sharded; hybrid over nodes; each with activation checkpointing; OffloadOptimizer with the GPU
budget it would pick; the SSD tier when --disk is given; plain PyTorch on one GPU as a reference) it prints the GPU
peak per GPU, host memory and disk per node, the predicted step time and tokens/s/GPU, what bounds the step, and
whether it fits; then the fastest setup that fits and the Python that starts it. Step times come from measured
floors (GPU throughput, pinned copy bandwidth, CPU optimizer speed): --probe measures them here, otherwise the
stored ones of --gpu-kind are used. docs/planner.md describes the models and their accuracy against the stored
benchmark rows (GPU memory within 15%, step time within 25%)."""

EPILOG = f"""\
MODEL: a built-in shape ({", ".join(sorted(BUILTIN))}; aliases {", ".join(sorted(ALIASES))}), a local Hugging
Face config.json (or its directory; nothing is downloaded), or --dims instead.

examples:
  python -m shardfuse.plan llama-7b --gpus 8 --gpu-mem 80 --host-mem 1024 --tokens 8192
  python -m shardfuse.plan 6.7b --gpus 1 --gpu-mem 80 --host-mem 128 --disk 500 --tokens 2048
  python -m shardfuse.plan ./config.json --nodes 2 --gpus 8 --gpu-kind h200 --tokens 4096 --micro-batches 2
  python -m shardfuse.plan --dims 4096,32,32,11008,32000 --gpus 4 --probe"""


def parse_dims(text: str) -> tuple[int, ...]:
    parts = text.split(",")
    if len(parts) not in (5, 6) or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"expected DIM,LAYERS,HEADS,FFN,VOCAB[,KV_HEADS] (positive integers), "
                                         f"got {text!r}")
    return tuple(int(p) for p in parts)


def parse_mesh(text: str) -> tuple[int, int]:
    parts = text.split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() and int(p) >= 1 for p in parts):
        raise argparse.ArgumentTypeError(f"expected R,S (replicas,shards), two integers >= 1, got {text!r}")
    return int(parts[0]), int(parts[1])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m shardfuse.plan", description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("model", nargs="?", help="built-in shape name or config.json path (or use --dims)")
    p.add_argument("--dims", type=parse_dims, metavar="DIM,LAYERS,HEADS,FFN,VOCAB[,KV]",
                   help="a Llama-style decoder's shape instead of MODEL")
    p.add_argument("--gpus", type=int, default=1, help="GPUs per node (default 1)")
    p.add_argument("--nodes", type=int, default=1, help="nodes (default 1); > 1 adds hybrid sharding")
    p.add_argument("--mesh", type=parse_mesh, metavar="R,S",
                   help="the hybrid mesh: R replicas x S shards, R * S = nodes x gpus (default: nodes x gpus)")
    p.add_argument("--gpu-mem", type=float, default=None, help="GiB per GPU (default: the GPU kind's)")
    p.add_argument("--host-mem", type=float, default=256.0, help="host memory GiB per node (default 256)")
    p.add_argument("--disk", type=float, default=0.0, help="free GiB per node for the SSD tier (default 0: none)")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per GPU per optimizer step (default 4096)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default min(tokens, 2048))")
    p.add_argument("--micro-batches", type=int, default=1, help="accumulated micro-batches per step (default 1)")
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw", help="adamw (default) or sgd (momentum)")
    p.add_argument("--no-clip", action="store_true",
                   help="no gradient clipping: OffloadOptimizer may then step during backward (step_in_backward)")
    p.add_argument("--gpu-kind", default=DEFAULT_KIND,
                   help=f"stored floors to use: {', '.join(sorted(KINDS))} (default {DEFAULT_KIND})")
    p.add_argument("--probe", action="store_true", help="measure this machine's floors (GPU, copies, CPU AdamW)")
    p.add_argument("--probe-dir", default=None, help="with --probe: also measure the disk under this directory")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if (args.model is None) == (args.dims is None):
        parser.error("give MODEL or --dims (one of them): e.g. `python -m shardfuse.plan llama-7b`")
    try:
        model = args.model
        if args.dims is not None:
            d = args.dims
            model = decoder("dims", d[0], d[1], d[2], d[3], d[4], n_kv_heads=d[5] if len(d) == 6 else None)
        result = plan(model, gpus=args.gpus, nodes=args.nodes, mesh=args.mesh, gpu_mem_gib=args.gpu_mem,
                      host_mem_gib=args.host_mem, disk_gib=args.disk, tokens=args.tokens, seq=args.seq,
                      micro_batches=args.micro_batches, optimizer=args.optimizer, clip=not args.no_clip,
                      gpu_kind=args.gpu_kind, probe=args.probe, probe_dir=args.probe_dir)  # fmt: skip
    except (ValueError, TypeError) as exc:
        print(f"python -m shardfuse.plan: error: {exc}", file=sys.stderr)
        return 2
    print(result.text())
    return 0 if result.recommended is not None else 1


if __name__ == "__main__":
    sys.exit(main())
