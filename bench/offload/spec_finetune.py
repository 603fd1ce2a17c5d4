"""Speculative clipping on a fine-tune (issue 30 item 3): how often it commits, and what it does to the step time.

One device, a Hugging Face ``LlamaForCausalLM`` (random init from ``--config``, fp32 parameters; bf16 compute on a
GPU), in two phases, each step clipped at ``--max-norm``:

1. pre-training, once, with the model resident on the device (plain torch AdamW: it is fast there, so
   ``--pretrain-steps`` can be many): ``--pretrain-steps`` on prose, the repository's own Markdown as bytes (a token
   per byte);
2. the fine-tune from those weights, fully offloaded (``move_params_to_cpu=True``,
   ``OffloadOptimizer(gpu_budget_gib=0)``, torch's fused AdamW on the host, a fresh optimizer as a fine-tune from a
   checkpoint has): ``--steps`` on code, its Python sources as bytes, measured per step (loss, the global gradient
   norm ``clip_grad_norm_`` returned, whether clipping fired, wall time from one step's start to the next's).

The fine-tune runs twice in this process from the same weights with deterministic algorithms:
``speculative_clip=False``, then ``True``. The losses must be the same bits (exit status 1 if not). Reported per
run: the fine-tune's median step time (after ``--skip`` steps) with its spread, how often clipping fired, and for the
speculative run the fine-tune's committed / redone steps and units (``OffloadOptimizer.host_stats``) and the spare
host bytes; and the pre-training's last loss and gradient norms.

    python -m bench.offload.spec_finetune [--config 1b] [--pretrain-steps 300] [--steps 200] [--seq 1024]
                                          [--out spec_finetune.json]

The data are real text but the model starts from random weights (no weights can reach the GPU machines): the
fine-tune continues a pre-training on another kind of text, which is how the norm behaves after a shift of domain,
not a large pretrained model's (whose norms sit lower: more pre-training steps bring this one closer).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
CONFIGS = {
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256),
    "1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
               num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048),
}


def corpus(kind: str) -> torch.Tensor:
    """The repository's Markdown (``prose``) or Python sources (``code``) as one tensor of byte values."""
    patterns = {"prose": ("README.md", "docs/*.md"), "code": ("shardfuse/**/*.py",)}[kind]
    files = sorted({p for pattern in patterns for p in REPO.glob(pattern)})
    data = b"\n".join(p.read_bytes() for p in files)
    if not data:
        raise FileNotFoundError(f"no {kind} files under {REPO} ({patterns}): run from a shardfuse checkout")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def windows(data: torch.Tensor, steps: int, batch: int, seq: int, seed: int) -> list[torch.Tensor]:
    """``steps`` batches of ``batch`` random windows of ``seq`` tokens."""
    if data.numel() <= seq:
        raise ValueError(f"a corpus of {data.numel()} tokens has no window of --seq {seq}: lower --seq")
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, data.numel() - seq, (steps, batch), generator=gen)
    return [torch.stack([data[s:s + seq] for s in row.tolist()]) for row in starts]


def _plain_model(config: str) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(**CONFIGS[config], use_cache=False, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).float()


def pretrain(args: argparse.Namespace, device: torch.device) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    """The pre-training phase, resident on ``device`` (bf16 autocast on a GPU), clipped like the fine-tune; the
    weights (on the host) and per step: loss, norm, fired, seconds."""
    model = _plain_model(args.config).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=device.type == "cuda")
    vocab = CONFIGS[args.config]["vocab_size"]
    rows: list[dict[str, Any]] = []
    try:
        for ids in windows(corpus("prose") % vocab, args.pretrain_steps, args.batch, args.seq, seed=1):
            start = time.perf_counter()
            ids = ids.to(device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_norm))
            opt.step()
            opt.zero_grad(set_to_none=True)
            rows.append({"loss": loss.item(), "norm": norm, "fired": norm > args.max_norm,
                         "s": time.perf_counter() - start})
            if len(rows) % 50 == 0 or len(rows) == args.pretrain_steps:
                print(f"pretrain step {len(rows)}/{args.pretrain_steps} (resident): loss {rows[-1]['loss']:.4f} "
                      f"norm {norm:.3f} {1e3 * rows[-1]['s']:.0f} ms", flush=True)
        weights = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    finally:
        del model, opt
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return weights, rows


def build(config: str, device: torch.device, weights: dict[str, torch.Tensor] | None = None) -> torch.nn.Module:
    """The model (from ``weights`` when given) on the host, one unit per decoder layer, shards kept on the host."""
    import shardfuse

    model = _plain_model(config)
    if weights is not None:
        model.load_state_dict(weights)
    kwargs: dict[str, Any] = dict(move_params_to_cpu=True, compute_device=device)
    if device.type == "cuda":
        kwargs.update(mixed_precision=True, compute_dtype=torch.bfloat16, fp32_reduce_scatter=True)
    with shardfuse.enable_wrap(wrapper_cls=shardfuse.FullyShardedDataParallel, **kwargs):
        policy = shardfuse.no_split_modules_policy(model)
        return shardfuse.wrap(shardfuse.auto_wrap(model, auto_wrap_policy=policy))


def train(args: argparse.Namespace, device: torch.device, speculative: bool,
          weights: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """The fine-tune, offloaded, from ``weights``, with ``speculative_clip=speculative``; per step: loss, norm,
    fired, seconds."""
    import shardfuse

    model = build(args.config, device, weights)
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=True)
    opt = shardfuse.OffloadOptimizer(model, inner, gpu_budget_gib=0, speculative_clip=speculative)
    vocab = CONFIGS[args.config]["vocab_size"]
    phases = [("code", args.steps, 2)]
    record: dict[str, Any] = {"speculative_clip": speculative}
    try:
        for kind, steps, seed in phases:
            batches = windows(corpus(kind) % vocab, steps, args.batch, args.seq, seed)
            before = opt.host_stats()
            rows = []
            for ids in batches:
                start = time.perf_counter()
                ids = ids.to(device)
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                norm = float(model.clip_grad_norm_(args.max_norm))
                opt.step()
                opt.zero_grad(set_to_none=True)
                rows.append({"loss": loss.item(), "norm": norm, "fired": norm > args.max_norm,
                             "s": time.perf_counter() - start})
                if len(rows) % 25 == 0 or len(rows) == steps:  # progress, so a run cut by its limit says how far
                    print(f"speculative_clip={speculative} {kind} step {len(rows)}/{steps}: loss {rows[-1]['loss']:.4f}"
                          f" norm {norm:.3f} {1e3 * rows[-1]['s']:.0f} ms", flush=True)
            opt.synchronize()
            after = opt.host_stats()
            record[kind] = {"steps": rows, "spec": {k.removeprefix("spec_"): after[k] - before.get(k, 0.0)
                                                    for k in after if k.startswith("spec_units_")
                                                    or k.startswith("spec_steps_")}}
            if speculative:
                record["spare_bytes"] = after.get("spec_spare_bytes", 0.0)
    finally:
        opt.close()
        del model, opt, inner
        gc.collect()
    return record


def summarize(run: dict[str, Any], skip: int) -> dict[str, Any]:
    """The fine-tune's median step time (after ``skip`` steps), spread, clipping rate and speculative counts."""
    steps = run["code"]["steps"]
    times = [r["s"] * 1e3 for r in steps[skip:]] or [r["s"] * 1e3 for r in steps]
    fired = sum(r["fired"] for r in steps)
    out = {"speculative_clip": run["speculative_clip"], "steps": len(steps), "step_ms": statistics.median(times),
           "step_ms_min": min(times), "step_ms_max": max(times), "clip_fired": fired,
           "clip_fired_share": fired / len(steps), "median_norm": statistics.median(r["norm"] for r in steps),
           **{f"finetune_{k}": v for k, v in run["code"]["spec"].items()}}
    if run["speculative_clip"]:
        committed = run["code"]["spec"].get("steps_committed", 0.0)
        out.update(commit_share=committed / len(steps), spare_gib=run.get("spare_bytes", 0.0) / 2**30)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", choices=sorted(CONFIGS), default="1b")
    p.add_argument("--pretrain-steps", type=int, default=300, help="resident pre-training steps (once)")
    p.add_argument("--steps", type=int, default=200, help="fine-tune steps (measured)")
    p.add_argument("--skip", type=int, default=3, help="fine-tune steps left out of the step time")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--max-norm", type=float, default=1.0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if min(args.pretrain_steps, args.skip) < 0 or args.steps < 1 or args.seq < 2 or args.max_norm <= 0:
        p.error(f"need --steps >= 1, --seq >= 2, --max-norm > 0 and non-negative --pretrain-steps/--skip, got "
                f"{args.steps=} {args.seq=} {args.max_norm=} {args.pretrain_steps=} {args.skip=}")
    return args


# What the one-rank process group sets in the environment: put back on return, so a caller in the same process
# (a test, then a subprocess it starts) does not inherit a finished group's rank and port.
_GROUP_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "CUBLAS_WORKSPACE_CONFIG")


def _both_runs(args: argparse.Namespace, device: torch.device) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The pre-training's steps, then the plain and the speculative fine-tune from its weights, in a one-rank
    group; the environment and torch's determinism setting as they were before, after."""
    import torch.distributed as dist

    from bench.offload.big_impls import init_world_of_one

    saved_env = {k: os.environ.get(k) for k in _GROUP_ENV}
    deterministic = torch.are_deterministic_algorithms_enabled()
    try:
        if device.type == "cuda":  # the two runs must take the same kernels to compare bits
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
        weights, pretrained = pretrain(args, device)
        init_world_of_one(device)
        try:
            return pretrained, [train(args, device, speculative, weights) for speculative in (False, True)]
        finally:
            dist.destroy_process_group()
    finally:
        torch.use_deterministic_algorithms(deterministic)
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    pretrained, runs = _both_runs(args, device)
    plain, spec = runs
    equal = [a["loss"] for a in plain["code"]["steps"]] == [b["loss"] for b in spec["code"]["steps"]]
    rows = [summarize(r, args.skip) for r in runs]
    norms = [r["norm"] for r in pretrained]
    result = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "losses_equal": equal, "step_ratio": rows[1]["step_ms"] / rows[0]["step_ms"], "rows": rows,
              "pretrain": {"steps": pretrained, "resident": True}, "runs": runs}
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1))
    for r in rows:
        spec_txt = (f"; committed {r['finetune_steps_committed']:.0f}/{r['steps']} steps "
                    f"({r['commit_share']:.1%}), redone {r['finetune_steps_redone']:.0f}; units committed "
                    f"{r['finetune_units_committed']:.0f}, redone {r['finetune_units_redone']:.0f}, late "
                    f"{r['finetune_units_late']:.0f}; spare {r['spare_gib']:.2f} GiB" if r["speculative_clip"] else "")
        print(f"speculative_clip={r['speculative_clip']!s:5s}: {r['step_ms']:.1f} ms/step "
              f"({r['step_ms_min']:.1f}-{r['step_ms_max']:.1f}) over {r['steps']} fine-tune steps; clipping fired "
              f"{r['clip_fired']} times ({r['clip_fired_share']:.1%}), median norm {r['median_norm']:.3f}{spec_txt}")
    if norms:
        print(f"pre-training (resident, {len(norms)} steps): last loss {pretrained[-1]['loss']:.4f}, norm median "
              f"{statistics.median(norms):.3f}, last {norms[-1]:.3f}")
    print(f"speculative / plain step time: {result['step_ratio']:.3f}; fine-tune losses "
          f"{'the same bits' if equal else 'DIFFER'} over {len(plain['code']['steps'])} steps")
    return 0 if equal else 1


if __name__ == "__main__":
    raise SystemExit(main())
