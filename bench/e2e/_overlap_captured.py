"""``bench.e2e.overlap --captured [--baseline] [--eager]``: where the captured sharded step's time goes.

The bench model (``--model decoder|hf-llama``, ``--config``) at ``--tokens`` per GPU (batch 1), every decoder
layer one shardfuse unit, bf16 compute, fp32 reduce-scatter, fused capturable AdamW, its whole step captured by
``shardfuse.capture_step``. After warm-up replays, ``--replays`` replays are profiled one by one with the torch
profiler (CUPTI kernel records) on every rank; rank 0 keeps the replay of median span and splits it into compute,
exposed communication and idle time (``bench.e2e._timeline``: a replayed graph hides the capture streams, so
collectives are told apart by their kernel names). ``--baseline``: the one-GPU unsharded step (fp32 weights under
bf16 autocast, the same tokens), captured the same way on rank 0 alone, split the same way, and the gap between the
two split into a compute delta and an exposed communication delta, with the compute kernels that add the most
time. ``--eager``: the same sharded step run eagerly, for its overlap. Rank 0 writes
``overlap_captured[_hf]_<N>gpu.json`` (``"kind": "overlap"``) through ``bench.common.write_result``.
"""

from __future__ import annotations

import argparse
import functools
import gc
import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from bench.common import write_result
from bench.e2e._model_specs import ModelSpec, model_spec
from bench.e2e._timeline import Kernel, gap, split_step, top_kernels
from bench.e2e._wrappers import wrap_shardfuse
from bench.host_load import host_load_fields


def kernels_of(events: Any) -> list[Kernel]:
    """The GPU kernels (and copies) of profiler events as ``(start_us, end_us, name)``, in start order."""
    out = [(float(e.time_range.start), float(e.time_range.end), str(e.name)) for e in events
           if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
           and e.time_range.end > 0]  # fmt: skip
    return sorted(out)


def profile_replays(step: Callable[[], Any], replays: int, group: Any) -> list[list[Kernel]]:
    """``replays`` steps, each profiled on its own (every rank in ``group`` enters each one together)."""
    out = []
    for _ in range(replays):
        torch.cuda.synchronize()
        if group is not None:
            dist.barrier(group=group)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        out.append(kernels_of(prof.events()))
    return out


def median_replay(replays: list[list[Kernel]]) -> list[Kernel]:
    spans = [split_step(k)["span_us"] for k in replays]
    return replays[spans.index(statistics.median_low(spans))]


def _one_step(model: torch.nn.Module, opt: torch.optim.Optimizer, spec: ModelSpec, autocast: bool,
              tokens: torch.Tensor) -> torch.Tensor:
    from bench.e2e.run import step_fn

    return step_fn(model, opt, tokens, autocast, spec)


def profile_step(spec: ModelSpec, args: argparse.Namespace, device: torch.device, sharded: bool, captured: bool,
                 group: Any) -> list[Kernel]:
    """Build, (capture,) warm up and profile one step kind; returns the median replay's kernels."""
    from shardfuse import capture_step

    model = spec.make(device, args.seed)
    if sharded:
        model = wrap_shardfuse(model, spec, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True, capturable=captured)
    gen = torch.Generator().manual_seed(args.seed * 7919 + dist.get_rank())
    tokens = torch.randint(0, spec.vocab_size, (1, min(args.tokens, spec.max_seq_len) + 1), generator=gen).to(device)
    step: Callable[..., Any] = functools.partial(_one_step, model, opt, spec, not sharded)
    if captured:
        step = capture_step(step, tokens, warmup=1)
    for _ in range(args.warmup):
        step(tokens)
    kernels = median_replay(profile_replays(functools.partial(step, tokens), args.replays, group))
    if captured:
        step.close()
    del model, opt, step
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return kernels


def _print(label: str, s: dict[str, Any]) -> None:
    print(f"{label:34s} span {s['span_us'] / 1e3:7.2f} ms: compute {s['compute_us'] / 1e3:6.2f}, exposed comm "
          f"{s['exposed_comm_us'] / 1e3:6.2f}, idle {s['idle_us'] / 1e3:6.2f} ({s['kernels']} kernels)")
    for kind, c in sorted(s["collectives"].items()):
        print(f"    {kind:14s} {c['count']:4d} kernels {c['us'] / 1e3:7.2f} ms, {100 * c['overlapped_share']:3.0f}% "
              f"overlapped by compute")


def run_captured(args: argparse.Namespace) -> None:
    """The captured profile (every rank calls it)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    host = dist.new_group(backend="gloo")
    spec = model_spec(args.model, args.config)
    payload: dict[str, Any] = {
        "kind": "overlap",
        "config": {"model_kind": spec.kind, "model": spec.name, "params": spec.num_params, "world_size": world,
                   "batch": 1, "seq": min(args.tokens, spec.max_seq_len), "replays": args.replays,
                   "optimizer": "AdamW (fused, capturable)", "compute_dtype": "bfloat16", "reduce_dtype": "float32",
                   "comm_by": "kernel name contains 'nccl'"},  # fmt: skip
        **host_load_fields(world),
    }
    if args.eager:
        payload["eager"] = split_step(profile_step(spec, args, device, True, False, host))
    sharded = profile_step(spec, args, device, True, True, host)
    payload["captured"] = split_step(sharded)
    base: list[Kernel] = []
    if args.baseline:
        if rank == 0:
            base = profile_step(spec, args, device, False, True, None)
            payload["baseline"] = split_step(base)
            payload["gap"] = gap(payload["captured"], payload["baseline"])
        dist.barrier(group=host)
    payload["top_kernels"] = top_kernels(sharded, base, n=12)
    if rank == 0:
        if len(sharded) < 10:
            print(f"warning: the profile holds only {len(sharded)} GPU records: this CUPTI does not report the "
                  "kernels inside graph replays, so the split below is not meaningful", flush=True)
        for label in ("eager", "captured", "baseline"):
            if label in payload:
                _print(f"{label} ({world if label != 'baseline' else 1} GPU)", payload[label])
        if "gap" in payload:
            g = payload["gap"]
            print(f"gap to one GPU captured {g['gap_us'] / 1e3:+.2f} ms: compute {g['compute_delta_us'] / 1e3:+.2f}, "
                  f"exposed comm {g['exposed_comm_delta_us'] / 1e3:+.2f}, idle {g['idle_delta_us'] / 1e3:+.2f}")
        for k in payload["top_kernels"]:
            print(f"    {k['delta_us'] / 1e3:+7.2f} ms ({k['count']:4d}x, {k['us'] / 1e3:6.2f} ms)  {k['name'][:90]}")
        tag = f"{spec.tag}_" if spec.tag else ""
        print(f"wrote {write_result(args.name or f'overlap_captured_{tag}{world}gpu', payload)}", flush=True)
