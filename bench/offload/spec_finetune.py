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

``--commit-steps N`` adds the case where speculation commits: the same pair of fine-tunes, ``N`` steps each, at a
clip the norms stay under (``--commit-max-norm``; by default 1.25x the largest norm of the plain run above), so
the step time of a committing speculative step is measured against the plain clipped one in the same process.

The floor is measured in the same process (on a GPU): the pre-training's resident forward and backward (bf16
autocast: the resident step the issue judges against), torch's fused CPU AdamW alone over the model's parameter
count, and the pinned copy bandwidth each way. The clipped floor is backward + the host update (no update can start
before the norm is known); the overlapped floor, the one a committing speculative step can reach, is
max(forward + backward, PCIe, host update). Each row gets ``vs_clipped_floor`` and ``vs_overlap_floor``.

    python -m bench.offload.spec_finetune [--config 1b] [--pretrain-steps 300] [--steps 200] [--seq 1024]
                                          [--commit-steps 0] [--commit-max-norm auto] [--out spec_finetune.json]

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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
            ids = ids.to(device)
            _sync(device)
            start = time.perf_counter()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                loss = model(input_ids=ids, labels=ids).loss
            _sync(device)
            forward_end = time.perf_counter()
            loss.backward()
            _sync(device)
            backward_end = time.perf_counter()
            norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_norm))
            opt.step()
            opt.zero_grad(set_to_none=True)
            rows.append({"loss": loss.item(), "norm": norm, "fired": norm > args.max_norm,
                         "s": time.perf_counter() - start, "fwd_s": forward_end - start,
                         "bwd_s": backward_end - forward_end})
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
          weights: dict[str, torch.Tensor] | None = None, *, steps: int | None = None,
          max_norm: float | None = None) -> dict[str, Any]:
    """The fine-tune, offloaded, from ``weights``, with ``speculative_clip=speculative``, ``steps`` steps (default
    ``--steps``) clipped at ``max_norm`` (default ``--max-norm``); per step: loss, norm, fired, seconds."""
    import shardfuse

    steps = args.steps if steps is None else steps
    max_norm = args.max_norm if max_norm is None else max_norm
    model = build(args.config, device, weights)
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=True)
    backoff = {} if args.spec_backoff is None else {"speculative_backoff": args.spec_backoff or None}
    opt = shardfuse.OffloadOptimizer(model, inner, gpu_budget_gib=0, speculative_clip=speculative,
                                     **(backoff if speculative else {}))
    vocab = CONFIGS[args.config]["vocab_size"]
    phases = [("code", steps, 2)]
    record: dict[str, Any] = {"speculative_clip": speculative, "max_norm": max_norm}
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
                norm = float(model.clip_grad_norm_(max_norm))
                opt.step()
                opt.zero_grad(set_to_none=True)
                rows.append({"loss": loss.item(), "norm": norm, "fired": norm > max_norm,
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
    out = {"speculative_clip": run["speculative_clip"], "max_norm": run["max_norm"], "steps": len(steps),
           "step_ms": statistics.median(times),
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
    p.add_argument("--commit-steps", type=int, default=0,
                   help="steps of the second pair, at a clip the norms stay under (0: no second pair)")
    p.add_argument("--commit-max-norm", type=float, default=None,
                   help="the second pair's clip (default: 1.25x the largest norm of the plain fine-tune)")
    p.add_argument("--spec-backoff", type=int, default=None,
                   help="OffloadOptimizer's speculative_backoff (default: the library's; 0: never pause)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if min(args.pretrain_steps, args.skip, args.commit_steps) < 0 or args.steps < 1 or args.seq < 2 \
            or args.max_norm <= 0 or (args.commit_max_norm is not None and args.commit_max_norm <= 0):
        p.error(f"need --steps >= 1, --seq >= 2, --max-norm > 0, --commit-max-norm > 0 and non-negative "
                f"--pretrain-steps/--skip/--commit-steps, got {args.steps=} {args.seq=} {args.max_norm=} "
                f"{args.commit_max_norm=} {args.pretrain_steps=} {args.skip=} {args.commit_steps=}")
    return args


# What the one-rank process group sets in the environment: put back on return, so a caller in the same process
# (a test, then a subprocess it starts) does not inherit a finished group's rank and port.
_GROUP_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "CUBLAS_WORKSPACE_CONFIG")


def commit_norm(args: argparse.Namespace, plain: dict[str, Any]) -> float:
    """The commit pair's clip: ``--commit-max-norm``, or 1.25x the largest norm of the plain fine-tune."""
    if args.commit_max_norm is not None:
        return float(args.commit_max_norm)
    return 1.25 * max(r["norm"] for r in plain["code"]["steps"])


def measure_floor(model_numel: int, chunk: int, device: torch.device, pretrained: list[dict[str, Any]],
                  skip: int) -> dict[str, Any]:
    """The floor terms in ms, measured here: the resident forward and backward (medians of the pre-training after
    ``skip`` steps), torch's fused CPU AdamW alone over ``model_numel`` fp32 parameters, and the pinned copies
    (bf16 parameters in, fp32 gradients out, as ``bench.offload.big`` counts them); then the clipped floor
    (backward + host update) and the overlapped one (max of forward + backward, PCIe, host update)."""
    from bench.offload.big_child import copy_gbps, cpu_adamw_seconds

    timed = pretrained[skip:] or pretrained
    from bench.common import host_topology

    out: dict[str, Any] = {"params": model_numel, "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
                           "topology": host_topology((device.index or 0) if device.type == "cuda" else None)}
    if timed:
        out["fwd_ms"] = 1e3 * statistics.median(r["fwd_s"] for r in timed)
        out["bwd_ms"] = 1e3 * statistics.median(r["bwd_s"] for r in timed)
    out["cpu_opt_ms"] = 1e3 * cpu_adamw_seconds(model_numel, chunk)["opt_s"]
    terms = [out["cpu_opt_ms"]]
    if device.type == "cuda":
        out["h2d_gbps"], out["d2h_gbps"] = copy_gbps(1 << 30, True), copy_gbps(1 << 30, False)
        out["pcie_ms"] = 1e3 * max(2 * model_numel / (out["h2d_gbps"] * 1e9), 4 * model_numel / (out["d2h_gbps"] * 1e9))
        terms.append(out["pcie_ms"])
    if "bwd_ms" in out:
        out["clipped_floor_ms"] = out["bwd_ms"] + out["cpu_opt_ms"]
        terms.append(out["fwd_ms"] + out["bwd_ms"])
    out["overlap_floor_ms"] = max(terms)
    return out


def _pair(args: argparse.Namespace, device: torch.device, weights: dict[str, torch.Tensor], steps: int,
          max_norm: float) -> list[dict[str, Any]]:
    return [train(args, device, speculative, weights, steps=steps, max_norm=max_norm) for speculative in (False, True)]


def _all_runs(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """The pre-training's steps, the floor, then the plain and the speculative fine-tune from its weights (and with
    ``--commit-steps``, the pair again at the commit clip), in a one-rank group; the environment and torch's
    determinism setting as they were before, after."""
    import torch.distributed as dist

    from bench.offload.big_impls import init_world_of_one

    saved_env = {k: os.environ.get(k) for k in _GROUP_ENV}
    deterministic = torch.are_deterministic_algorithms_enabled()
    try:
        if device.type == "cuda":  # the two runs must take the same kernels to compare bits
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
        weights, pretrained = pretrain(args, device)
        numel = sum(v.numel() for k, v in weights.items() if v.is_floating_point())
        floor = measure_floor(numel, max(v.numel() for v in weights.values()), device, pretrained, args.skip)
        print_floor(floor)  # now, so that a run cut by its limit still says what its host could do
        init_world_of_one(device)
        try:
            out: dict[str, Any] = {"pretrained": pretrained, "floor": floor,
                                   "runs": _pair(args, device, weights, args.steps, args.max_norm)}
            if args.commit_steps:
                out["commit_runs"] = _pair(args, device, weights, args.commit_steps, commit_norm(args, out["runs"][0]))
            return out
        finally:
            dist.destroy_process_group()
    finally:
        torch.use_deterministic_algorithms(deterministic)
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def judge_pair(runs: list[dict[str, Any]], skip: int, floor: dict[str, Any]) -> dict[str, Any]:
    """The pair's rows (with their ratios to the floors), whether its losses are the same bits, and the
    speculative / plain step time."""
    rows = [summarize(r, skip) for r in runs]
    for r in rows:
        for key in ("clipped_floor_ms", "overlap_floor_ms"):
            if floor.get(key):
                r["vs_" + key.removesuffix("_ms")] = r["step_ms"] / floor[key]
    plain, spec = runs
    equal = [a["loss"] for a in plain["code"]["steps"]] == [b["loss"] for b in spec["code"]["steps"]]
    return {"rows": rows, "losses_equal": equal, "step_ratio": rows[1]["step_ms"] / rows[0]["step_ms"]}


def print_pair(name: str, pair: dict[str, Any]) -> None:
    for r in pair["rows"]:
        spec_txt = (f"; committed {r['finetune_steps_committed']:.0f}/{r['steps']} steps "
                    f"({r['commit_share']:.1%}), redone {r['finetune_steps_redone']:.0f}, paused by the back-off "
                    f"{r.get('finetune_steps_paused', 0):.0f}; units committed "
                    f"{r['finetune_units_committed']:.0f}, redone {r['finetune_units_redone']:.0f}, late "
                    f"{r['finetune_units_late']:.0f}; spare {r['spare_gib']:.2f} GiB" if r["speculative_clip"] else "")
        floors = "".join(f"; {r[k]:.2f}x the {k[3:].replace('_', ' ')}" for k in ("vs_clipped_floor",
                                                                                   "vs_overlap_floor") if k in r)
        print(f"{name} clip {r['max_norm']:.3g}, speculative_clip={r['speculative_clip']!s:5s}: {r['step_ms']:.1f} "
              f"ms/step ({r['step_ms_min']:.1f}-{r['step_ms_max']:.1f}) over {r['steps']} fine-tune steps; clipping "
              f"fired {r['clip_fired']} times ({r['clip_fired_share']:.1%}), median norm {r['median_norm']:.3f}"
              f"{floors}{spec_txt}")
    print(f"{name}: speculative / plain step time {pair['step_ratio']:.3f}; fine-tune losses "
          f"{'the same bits' if pair['losses_equal'] else 'DIFFER'} over {pair['rows'][0]['steps']} steps")


def print_floor(floor: dict[str, Any]) -> None:
    parts = [f"{k} {floor[k]:.1f} ms" for k in ("fwd_ms", "bwd_ms", "cpu_opt_ms", "pcie_ms") if k in floor]
    print(f"floor ({floor['params'] / 1e9:.2f}B parameters, {floor['threads']} threads of {floor['cpu_count']} cores): "
          + ", ".join(parts) + (f"; clipped floor {floor['clipped_floor_ms']:.1f} ms (backward + host update)"
                                if "clipped_floor_ms" in floor else "")
          + f"; overlapped floor {floor['overlap_floor_ms']:.1f} ms")
    if floor.get("topology"):
        print(f"host topology: {floor['topology']}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    measured = _all_runs(args, device)
    pretrained, floor = measured["pretrained"], measured["floor"]
    pair = judge_pair(measured["runs"], args.skip, floor)
    norms = [r["norm"] for r in pretrained]
    from bench.common import env_info

    result = {"kind": "spec_finetune", "env": env_info(),
              "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "host": {"cpu_count": os.cpu_count(), "host_shared": os.environ.get("BENCH_HOST_SHARED") == "1"},
              **pair, "floor": floor, "pretrain": {"steps": pretrained, "resident": True}, "runs": measured["runs"]}
    if "commit_runs" in measured:
        result["commit"] = {**judge_pair(measured["commit_runs"], args.skip, floor), "runs": measured["commit_runs"]}
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1))
    print_pair("fine-tune", pair)
    if "commit" in result:
        print_pair("commit case", result["commit"])
    if norms:
        print(f"pre-training (resident, {len(norms)} steps): last loss {pretrained[-1]['loss']:.4f}, norm median "
              f"{statistics.median(norms):.3f}, last {norms[-1]:.3f}")
    equal = pair["losses_equal"] and result.get("commit", {}).get("losses_equal", True)
    return 0 if equal else 1


if __name__ == "__main__":
    raise SystemExit(main())
