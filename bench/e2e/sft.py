"""Many-shape SFT benchmark: the ``examples/sft_buckets.py`` loop (Hugging Face Llama, variable-length samples
padded to 4 buckets), its step captured by ``capture_step`` (one graph per bucket) against the same loop eager.

    torchrun --standalone --nproc_per_node 2 -m bench.e2e.sft --config 1b --steps 24 [--rounds 3]
    torchrun --standalone --nproc_per_node 2 -m bench.e2e.sft --device cpu --config tiny --steps 4  # smoke test

Each round builds the model twice from the same seeded weights and trains it on the same batches: eagerly
(``shardfuse``) and captured (``shardfuse-graph``), in that order. The batches are the example's (samples sorted
by length, cut into global batches of ``--batch`` per rank, shuffled, each padded to the bucket of its longest
sample on any rank). Before the timed steps both loops take the example's warm-up steps on the first batch and
one untimed step on the first batch of every other bucket, so every graph is captured before timing starts;
then ``--steps`` timed steps (synchronised before and after each). Reported per loop: the mean step time (max
over ranks), real tokens/s/GPU (the unpadded tokens of all ranks' batches per second, divided by the ranks), the
padded tokens/s/GPU, the peak memory and every timed step's loss (mean over ranks); per round whether the two
loops' losses are equal and their largest relative difference. AdamW at ``--lr`` (default 1e-4: at the example's
1e-3 the 1B model diverges within a few steps and then bf16's nondeterministic kernels send the two loops
apart), ``--exact``: attention through SDPA's math backend (the example's bit-equality setting), ``--bf16``: mixed
precision (bf16 compute on fp32 shards; the capture table runs it at ``--batch 1``, ~1K tokens/GPU on average, where
the host's launch work is what a captured step saves).

Rank 0 writes ``e2e_sft_<N>gpu.json`` (an e2e file: regime ``sft``, rows ``shardfuse`` and ``shardfuse-graph``,
each with ``host_load``) through ``bench.common.write_result``; a CPU run writes where ``bench.e2e.run``'s smoke
runs do.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import time
from typing import Any

import torch
import torch.distributed as dist

from bench.common import write_result
from bench.host_load import host_load_fields

REGIME = "sft"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", choices=("tiny", "1b"), default="1b")
    p.add_argument("--steps", type=int, default=24, help="timed steps per loop")
    p.add_argument("--batch", type=int, default=4, help="samples per rank and step")
    p.add_argument("--rounds", type=int, default=1, help="eager then captured, this often")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--exact", action="store_true", help="attention through SDPA's math backend (bit-equal loops)")
    p.add_argument("--bf16", action="store_true", help="mixed precision: bf16 compute on fp32 shards (the example "
                   "trains in fp32)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--name", default=None, help="result name (default e2e_sft_<N>gpu)")
    args = p.parse_args(argv)
    if args.steps < 1 or args.batch < 1 or args.rounds < 1:
        p.error(f"need --steps, --batch and --rounds >= 1, got {args.steps=} {args.batch=} {args.rounds=}")
    return args


def plan_batches(config: str, steps: int, batch: int, device: torch.device, seed: int = 100) -> dict[str, Any]:
    """The example's batches for ``steps`` timed steps: ``warm`` (the first batch, then the first batch of every
    other bucket, in the order they come) and ``timed``. Every rank calls it (padding agrees on the bucket)."""
    from examples.sft_buckets import BUCKETS, CONFIGS, batches, samples

    buckets = BUCKETS[config]
    world = dist.get_world_size()
    n = (steps + len(buckets) + 1) * batch * world
    data = batches(samples(n, CONFIGS[config]["vocab_size"], buckets[-1], seed=seed), batch, buckets, device)
    warm, seen = [data[0]], {data[0].bucket}
    for b in data[1:]:
        if b.bucket not in seen:
            warm.append(b)
            seen.add(b.bucket)
    rest = [b for b in data[1:] if all(b is not w for w in warm)]
    return {"warm": warm, "timed": rest[:steps], "buckets": buckets}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_loop(config: str, plan: dict[str, Any], device: torch.device, captured: bool, lr: float,
             warmup: int = 2, bf16: bool = False) -> dict[str, Any]:
    """Train a fresh model over the plan's batches, eager or captured; returns this rank's numbers."""
    from transformers import LlamaConfig

    import shardfuse
    from examples.sft_buckets import CONFIGS, build, make_optimizer, make_step

    model = build(LlamaConfig(**CONFIGS[config], attn_implementation="sdpa"), device, bf16=bf16)
    opt = make_optimizer(model, device)
    for group in opt.param_groups:  # a tensor lr under capturable AdamW stays a tensor
        group["lr"] = torch.tensor(lr, device=device) if torch.is_tensor(group["lr"]) else lr
    step = make_step(model, opt)
    first = plan["warm"][0]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    if captured:
        graphs = len(plan["buckets"])
        step = shardfuse.capture_step(step, first.input_ids, first.labels, warmup=warmup, max_graphs=graphs)
    else:
        for _ in range(warmup):
            step(first.input_ids, first.labels)
    for b in plan["warm"][1:]:
        step(b.input_ids, b.labels)
    times, losses, real = [], [], 0
    for b in plan["timed"]:
        sync(device)
        t0 = time.perf_counter()
        # .clone(): a replay returns the same tensor every call, overwritten by the next replay of that graph
        losses.append(step(b.input_ids, b.labels).clone())
        sync(device)
        times.append(time.perf_counter() - t0)
        real += int(b.lengths.sum())  # after the timing: a host sync
    out = {"times": times, "losses": torch.stack(losses).float().tolist(), "real_tokens": real,
           "padded_tokens": sum(b.input_ids.numel() for b in plan["timed"]),
           "peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0}  # fmt: skip
    if captured:
        out["graphs"] = len(step.signatures)
        step.close()
    del model, opt, step
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def make_row(impl: str, rnd: int, ranks: list[dict[str, Any]], plan: dict[str, Any], batch: int) -> dict[str, Any]:
    """One loop's result row from every rank's numbers (``run_loop``)."""
    world = len(ranks)
    steps = len(ranks[0]["times"])
    per_step = [max(r["times"][i] for r in ranks) for i in range(steps)]
    total = sum(per_step)
    losses = [sum(r["losses"][i] for r in ranks) / world for i in range(steps)]
    row: dict[str, Any] = {
        "impl": impl, "regime": REGIME, "round": rnd, "batch": batch, "seq": plan["buckets"][-1], "gpus": world,
        "step_ms": 1e3 * total / steps, "step_ms_rank0": 1e3 * sum(ranks[0]["times"]) / steps,
        "step_ms_list_rank0": [1e3 * t for t in ranks[0]["times"]],
        "tok_s_gpu": sum(r["real_tokens"] for r in ranks) / world / total,
        "padded_tok_s_gpu": sum(r["padded_tokens"] for r in ranks) / world / total,
        "loss_last": losses[-1], "losses": losses, "buckets": [b.bucket for b in plan["timed"]],
    }  # fmt: skip
    if any(r["peak_bytes"] for r in ranks):
        row["peak_gib"] = max(r["peak_bytes"] for r in ranks) / 2**30
    if "graphs" in ranks[0]:
        row["graphs"] = ranks[0]["graphs"]
    row["note"] = ("real tokens (unpadded) per second; variable lengths padded to the buckets "
                   f"{', '.join(map(str, plan['buckets']))}")
    return row


def compare_losses(eager: list[float], captured: list[float]) -> dict[str, Any]:
    """Whether the two loops' losses are equal, and their largest relative difference."""
    diffs = [abs(a - b) / max(abs(a), 1e-12) for a, b in zip(eager, captured)]
    return {"losses_equal": eager == captured, "max_rel_loss_diff": max(diffs, default=0.0)}


def run_round(args: argparse.Namespace, rnd: int, plan: dict[str, Any], device: torch.device,
              host: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Eager then captured on the same batches (every rank); the rows and the loss comparison (on every rank)."""
    from examples.sft_buckets import exact_attention

    rows = []
    with exact_attention(device) if args.exact else contextlib.nullcontext():
        for impl, captured in (("shardfuse", False), ("shardfuse-graph", True)):
            load = host_load_fields(dist.get_world_size())
            mine = run_loop(args.config, plan, device, captured, args.lr, bf16=args.bf16)
            ranks: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, mine, group=host)
            rows.append({**make_row(impl, rnd, ranks, plan, args.batch), **load})
    return rows, {"round": rnd, **compare_losses(rows[0]["losses"], rows[1]["losses"])}


def main(argv: list[str] | None = None) -> None:
    from bench.e2e.run import _init_distributed, default_output, summarize
    from examples.sft_buckets import CONFIGS

    args = parse_args(argv)
    args.pg_timeout = 600.0
    rank, world, local_rank = _init_distributed(args)
    device = torch.device("cuda", local_rank) if args.device == "cuda" else torch.device("cpu")
    default_output(device)
    host = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None
    plan = plan_batches(args.config, args.steps, args.batch, device)
    payload: dict[str, Any] = {
        "config": {"model": args.config, "model_kind": "hf-llama", "world_size": world, "device": device.type,
                   "steps": args.steps, "warmup": len(plan["warm"]) + 1, "lr": args.lr,
                   "optimizer": "AdamW (fused, capturable)" if device.type == "cuda" else "AdamW",
                   "compute_dtype": "bfloat16 (mixed precision, fp32 shards)" if args.bf16 else
                   "float32 (the example wraps without mixed precision)",
                   "regimes": {REGIME: [args.batch, plan["buckets"][-1]]}, "buckets": list(plan["buckets"]),
                   "exact_attention": args.exact, "loop": "examples/sft_buckets.py",
                   "hf_config": dict(CONFIGS[args.config])},  # fmt: skip
        "results": [], "sft": [],
    }
    for rnd in range(args.rounds):
        rows, check = run_round(args, rnd, plan, device, host)
        payload["results"] += rows
        payload["sft"].append(check)
        if rank == 0:
            e, c = rows
            print(f"round {rnd}: eager {e['step_ms']:.1f} ms ({e['tok_s_gpu']:,.0f} real tok/s/GPU), captured "
                  f"{c['step_ms']:.1f} ms ({c['tok_s_gpu']:,.0f}): {e['step_ms'] / c['step_ms']:.2f}x; losses "
                  f"{'equal' if check['losses_equal'] else 'differ'} (max rel {check['max_rel_loss_diff']:.2e}); "
                  f"last {e['loss_last']:.4f} / {c['loss_last']:.4f}", flush=True)
            write_result(args.name or f"e2e_sft_{world}gpu", payload)
    if rank == 0:
        payload["summary"] = summarize(payload["results"])
        print(f"wrote {write_result(args.name or f'e2e_sft_{world}gpu', payload)}", flush=True)
    dist.barrier(group=host)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
