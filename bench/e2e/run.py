"""End-to-end training benchmark: shardfuse vs FSDP2 vs FSDP1 (vs FairScale), one after another in one job.

    torchrun --standalone --nproc_per_node 2 -m bench.e2e.run --regime both \\
        --impls shardfuse,fsdp2,fsdp1 --steps 20 --warmup 3 [--profile DIR]
    # CPU smoke test of the script itself (gloo, tiny model):
    torchrun --standalone --nproc_per_node 2 -m bench.e2e.run --device cpu --config tiny \\
        --impls shardfuse,fsdp2,fsdp1 --steps 2 --warmup 1
    # a Hugging Face LlamaForCausalLM (853M), and the 7B-class decoder at 1 x 4096 tokens per GPU:
    torchrun --standalone --nproc_per_node 2 -m bench.e2e.run --model hf-llama --regime 1k
    torchrun --standalone --nproc_per_node 2 -m bench.e2e.run --config 7b --regime 4k --no-baseline

From the repository root (``-m`` runs it as the module ``bench.e2e.run``, with the root on ``sys.path``).

The model (``--model``, see ``model_spec``), built on the device with the same seeded weights for every
implementation:

- ``decoder`` (default): the Llama-style decoder of ``examples/llama.py``; ``--config bench``: 953M parameters,
  ``--config 7b``: the 6.7B shape of Llama-2-7B (dim 4096, 32 layers, 32 heads, ffn 11008, vocab 32000).
- ``hf-llama``: Hugging Face ``transformers.LlamaForCausalLM`` from a ``LlamaConfig`` with its own random
  init (needs ``transformers``, imported only for this model); ``--config bench``: hidden 2048, 16 layers,
  16 query heads sharing 4 key/value heads, SwiGLU 5632, vocab 32000, untied output, SDPA attention:
  852,559,872 parameters; ``--config tiny`` for the CPU.

bf16 compute, fp32 gradient reduction and AdamW (lr 1e-4; ``--optim foreach``, PyTorch's default, or ``fused``
for every implementation alike), the loss the
next-token cross-entropy of the logits in fp32, every decoder layer (``DecoderLayer`` / ``LlamaDecoderLayer``)
one sharded unit plus the root:

- ``shardfuse``: ``FullyShardedDataParallel(mixed_precision=True, compute_dtype=bf16, fp32_reduce_scatter=True)``
- ``fsdp2``: ``fully_shard(mp_policy=MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32))``
- ``fsdp1``: ``torch.distributed.fsdp.FullyShardedDataParallel`` with ``MixedPrecision(bf16, fp32, bf16)``, a
  transformer auto-wrap policy, ``use_orig_params=False``
- ``shardfuse-graph``: shardfuse wrapped the same way, its whole step captured by ``shardfuse.capture_step`` and
  replayed (AdamW with ``capturable=True``, which under ``foreach`` takes extra passes over the optimizer state
  that the eager implementations skip; ``--optim fused`` runs the same fused kernel eager and captured; the
  capture's one warm-up step is the first untimed step)
- ``fairscale``: FairScale's FSDP with the same flags as shardfuse (when ``fairscale`` is importable)
- ``baseline``: one GPU, no sharding, fp32 parameters under ``torch.autocast(bf16)``; rank 0 runs it alone while
  the other ranks wait (``--no-baseline`` skips it).
- ``baseline-graph`` (by name in ``--impls``): that one-GPU step captured by ``capture_step`` (capturable AdamW),
  the host-free limit a captured sharded step is compared with
- ``fsdp2-compile``: ``torch.compile`` on each decoder layer, then ``fsdp2``'s wrapping

Regimes, per GPU: ``8k`` = batch 4 x seq 2048 (compute-bound), ``1k`` = batch 1 x seq 1024 (communication-bound),
``4k`` = batch 1 x seq 4096 (the 7B model's), ``8k1`` = batch 1 x seq 8192 (the 8B model's); ``--regime both`` =
``8k,1k``, or a comma-separated list. The sequence is capped at the model's ``max_seq_len`` (32 for tiny).

Measured per implementation and regime: mean step time (forward + backward + optimizer step, synchronised
before and after every step) over ``--steps`` after ``--warmup``, max over ranks; tokens/s/GPU; MFU =
(6 * N * tokens + causal attention flops 6 * L * seq^2 * dim * batch) / (step time * peak), N = the parameters
used in matrix products (all but the input embedding table), peak = ``--peak-tflops`` (989 TFLOP/s, H100/H200
dense bf16); peak memory (``max_memory_allocated`` from after wrapping to the last step, max over ranks), the peak
the allocator reserved and its allocation retries in the timed steps (each a failed device allocation, the cache
freed and a second try: a run near the memory cap); the last step's loss averaged over ranks (all implementations
start from the same weights and see the same data).

Variants (``bench.e2e._variants`` says more): ``--compile``, ``--float8 tensorwise|rowwise``, ``--ac`` for every
implementation, or per implementation as modifiers of its name (``fsdp2+fp8+ac``, ``shardfuse+fp8``, ``fsdp2+once``);
``shardfuse-budget``; ``--config 8b`` (Llama-3-8B's shape); ``--deadline``. A run out of memory on every rank is a
row with ``"oom": true`` and the job goes on; the summary adds ratios against FSDP2 (same modifiers; its best).

Every rank runs the same collectives with fixed step counts. An implementation that raises on every rank
alike (e.g. at wrap time) is recorded as an error and the job goes on; one that fails on some ranks only would
desynchronise the collectives, so the process-group timeout (``--pg-timeout``) then ends the job with a log.
Rank 0 writes ``e2e_<N>gpu.json`` (``e2e_hf_<N>gpu.json`` for ``hf-llama``, ``e2e_7b_<N>gpu.json`` for the 7b
decoder; the model kind and its config are in the file's ``config``) through ``bench.common.write_result`` after
every implementation (so a crash keeps what was measured) and prints a table at the end: under
``bench/results/<gpu>/`` (or ``$BENCH_OUT/<gpu>/``) for a GPU run; a CPU (gloo) run is a smoke test of the script,
not a measurement, so without ``$BENCH_OUT`` it writes under ``out/bench/cpu/`` (ignored by git), never where the
report and ``bench.regress`` read.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import gc
import importlib.util
import os
import statistics
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

# NVLink multicast (NVLS) stays off unless the caller set it; other variables are left alone.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

# The models (_model_specs) and the wrappers (_wrappers) have their own modules; their names stay importable here.
from bench._progress import Progress  # noqa: E402
from bench.common import free_port, write_result  # noqa: E402
from bench.e2e import _variants as variants_  # noqa: E402
from bench.e2e import recording  # noqa: E402
from bench.e2e._model_specs import (  # noqa: E402
    DECODER_CONFIGS,
    HF_CONFIGS,
    MODELS,
    TRANSFORMERS_MISSING,
    ModelSpec,
    model_spec,
)
from bench.e2e._wrappers import CAPTURED_IMPLS, ONE_GPU_IMPLS, WRAPPERS, unavailable_reason  # noqa: E402
from bench.e2e._wrappers import REF_PACKAGE as REF_PACKAGE  # noqa: E402
from bench.e2e._wrappers import wrap_fairscale as wrap_fairscale  # noqa: E402
from bench.e2e._wrappers import wrap_fsdp1 as wrap_fsdp1  # noqa: E402
from bench.e2e._wrappers import wrap_fsdp2 as wrap_fsdp2  # noqa: E402
from bench.e2e._wrappers import wrap_shardfuse as wrap_shardfuse  # noqa: E402
from bench.e2e._wrappers import wrap_shardfuse_ref as wrap_shardfuse_ref  # noqa: E402
from bench.host_load import host_load_fields  # noqa: E402
from examples.llama import next_token_loss  # noqa: E402

# Where a CPU smoke run writes when $BENCH_OUT is not set (the repository's out/, which .gitignore has).
SMOKE_OUT = Path(__file__).resolve().parents[2] / "out" / "bench"
# (batch, seq) per GPU
REGIMES: dict[str, tuple[int, int]] = {"8k": (4, 2048), "1k": (1, 1024), "4k": (1, 4096), "8k1": (1, 8192)}
REGIME_SETS = {"both": ("8k", "1k")}
IMPLS = ("shardfuse", "shardfuse-graph", "shardfuse-ref", "shardfuse-budget", "fsdp2", "fsdp1", "fairscale",
         "baseline-graph", "fsdp2-compile")
DEFAULT_PEAK_TFLOPS = 989.0  # H100/H200 SXM dense bf16


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line arguments."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=MODELS, default="decoder",
                   help="the decoder of examples/llama.py or Hugging Face's LlamaForCausalLM (needs transformers)")
    p.add_argument("--regime", default="both",
                   help=f"'both' (= 8k,1k) or a comma-separated list of {', '.join(REGIMES)}")
    p.add_argument("--impls", default="shardfuse,fsdp2,fsdp1", help=f"comma-separated, from {', '.join(IMPLS)}")
    p.add_argument("--steps", type=int, default=20, help="timed steps per implementation and regime")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before them")
    p.add_argument("--config", choices=DECODER_CONFIGS, default="bench",
                   help=f"model size (hf-llama: {', '.join(HF_CONFIGS)})")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--peak-tflops", type=float, default=DEFAULT_PEAK_TFLOPS, help="bf16 peak for MFU")
    p.add_argument("--no-baseline", action="store_true", help="skip the one-GPU unsharded baseline")
    p.add_argument("--profile-regime", default="1k", choices=tuple(REGIMES), help="the regime --profile records")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help=f"profile {recording.PROFILE_STEPS} eager steps of one regime (--profile-regime) of each "
                        f"implementation (rank 0): a chrome trace and a kernel-time summary (NCCL vs other kernels, "
                        f"the top kernels) per implementation in DIR")
    p.add_argument("--memory-peak", default=None, metavar="DIR",
                   help="after the timed steps of --profile-regime, one more step of each implementation under the "
                        "allocator's history: what is alive at its peak and who allocated it, in DIR (rank 0; "
                        "bench.e2e.memory_peak)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--optim", choices=("foreach", "fused"), default="foreach",
                   help="AdamW implementation for every implementation (the captured step adds capturable=True)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pg-timeout", type=float, default=600.0, help="process-group timeout in seconds")
    p.add_argument("--name", default=None, help="result name (default e2e_<N>gpu, e2e_hf_<N>gpu, e2e_7b_<N>gpu)")
    p.add_argument("--rounds", type=int, default=1,
                   help="repeat every (regime, impl) this often, interleaved; the table shows medians and spread")
    variants_.add_arguments(p)
    args = p.parse_args(argv)
    impls = [i.strip() for i in args.impls.split(",") if i.strip()]
    unknown = [i for i in impls if variants_.split_name(i)[0] not in IMPLS]
    if unknown or not impls:
        p.error(f"--impls {args.impls!r}: unknown {unknown}; choose from {', '.join(IMPLS)}")
    args.variants = variants_.check_arguments(p, args, impls, IMPLS)
    args.impl_list = impls
    regimes = list(REGIME_SETS.get(args.regime, [r.strip() for r in args.regime.split(",") if r.strip()]))
    bad = [r for r in regimes if r not in REGIMES]
    if bad or not regimes or len(set(regimes)) != len(regimes):
        p.error(f"--regime {args.regime!r}: give 'both' or a comma-separated list of distinct regimes from "
                f"{', '.join(REGIMES)}")
    args.regime_list = regimes
    if args.model == "hf-llama":
        if args.config not in HF_CONFIGS:
            p.error(f"--model hf-llama --config {args.config}: the Hugging Face model has the configs "
                    f"{', '.join(HF_CONFIGS)}")
        if importlib.util.find_spec("transformers") is None:
            p.error(f"--model hf-llama: {TRANSFORMERS_MISSING}")
    if args.rounds < 1:
        p.error(f"need --rounds >= 1, got {args.rounds}")
    if args.steps < 1 or args.warmup < 0:
        p.error(f"need --steps >= 1 and --warmup >= 0, got {args.steps=} {args.warmup=}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but no CUDA GPU is visible: pass --device cpu for a smoke test")
    return args


# ------------------------------------------------------------------------------------------------ measuring


def sync(device: torch.device) -> None:
    """Wait for the GPU (no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_data(vocab_size: int, batch: int, seq: int, rank: int, seed: int, device: torch.device) -> list[torch.Tensor]:
    """A few seeded random token batches of this rank, (batch, seq + 1) each, cycled through the steps."""
    gen = torch.Generator().manual_seed(seed * 7919 + rank)
    return [torch.randint(0, vocab_size, (batch, seq + 1), generator=gen).to(device) for _ in range(4)]


def step_fn(
    model: nn.Module, opt: torch.optim.Optimizer, tokens: torch.Tensor, autocast: bool, spec: ModelSpec,
    after_step: Callable[[], None] | None = None,
) -> torch.Tensor:
    """One training step (``after_step`` after the optimizer's, e.g. FSDP2's float8 scales); returns the loss."""
    ctx = torch.autocast(tokens.device.type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with ctx:
        logits = spec.logits(model, tokens[:, :-1])
    loss = next_token_loss(logits, tokens[:, 1:])
    loss.backward()
    opt.step()
    if after_step is not None:
        after_step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def _eager_step(
    model: nn.Module, opt: torch.optim.Optimizer, autocast: bool, spec: ModelSpec, tokens: torch.Tensor,
    after_step: Callable[[], None] | None = None,
) -> torch.Tensor:
    return step_fn(model, opt, tokens, autocast, spec, after_step)


def _alloc_retries(device: torch.device) -> int:
    """The caching allocator's retries so far: each a failed device allocation, the cached blocks freed and a second
    try; what steps pay that run near the memory cap."""
    return int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))


def _cuda_memory(device: torch.device, captured: Any, leftover: int, mem_after_wrap: int) -> dict[str, int]:
    """The memory numbers of an implementation's run: its peak allocated above what earlier ones left
    (``leftover``), with a captured step's own peaks (``captured``: the ``capture_step`` object, or None), the peak
    the allocator reserved, and what wrapping left allocated."""
    peak = torch.cuda.max_memory_allocated(device)
    out = {"leftover_bytes": leftover, "mem_after_wrap_bytes": mem_after_wrap,
           "peak_reserved_bytes": torch.cuda.max_memory_reserved(device)}
    if captured is not None:  # capture_step reset the peak statistics: its own numbers cover the warm-up and capture
        peak = max(peak, captured.eager_peak_bytes, captured.captured_peak_bytes)
        out["graph_pool_bytes"] = captured.graph_pool_bytes
    out["peak_bytes"] = peak - leftover
    return out


def measure(
    impl: str, regime: str, spec: ModelSpec, args: argparse.Namespace, device: torch.device, rank: int,
    extras: bool = True,
) -> dict[str, Any]:
    """Build, wrap and train ``impl`` for warmup + steps on this rank; returns this rank's numbers (``extras``:
    then ``--profile``'s and ``--memory-peak``'s steps, where asked)."""
    batch, seq = REGIMES[regime]
    seq = min(seq, spec.max_seq_len)
    # What earlier implementations left allocated (FairScale 0.4.13 never frees a trained model: its hooks keep
    # it alive): memory numbers are this implementation's own, above it.
    leftover = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    data = make_data(spec.vocab_size, batch, seq, rank, args.seed, device)
    model = spec.make(device, args.seed)
    variant = args.variants.get(impl) or variants_.Variant(impl, impl)
    graphed = variant.base in CAPTURED_IMPLS  # shardfuse-graph+split is captured too
    prepared = variants_.prepare(variant, model, spec, device, args, WRAPPERS, capturable=graphed)
    model, opt, after_step = prepared.model, prepared.opt, prepared.after_step
    autocast = variant.base in ONE_GPU_IMPLS
    if device.type == "cuda":
        mem_after_wrap = torch.cuda.memory_allocated(device) - leftover
        torch.cuda.reset_peak_memory_stats(device)
    step: Callable[[torch.Tensor], torch.Tensor] = functools.partial(_eager_step, model, opt, autocast, spec,
                                                                      after_step=after_step)
    first = 0
    if graphed:
        from shardfuse import capture_step

        # Its one warm-up step is the sequence's first (untimed) step: the same batches in the same order as
        # the eager implementations, so the last losses compare.
        step = capture_step(step, data[0], warmup=1)
        first = 1
    times, warm = [], []
    loss = None
    timed_from, retries_before = max(args.warmup, first), 0
    for i in range(first, timed_from + args.steps):
        if i == timed_from and device.type == "cuda":
            retries_before = _alloc_retries(device)
        sync(device)
        t0 = time.perf_counter()
        with torch.profiler.record_function(f"bench.e2e:{impl}_step"):
            loss = step(data[i % len(data)])
        sync(device)
        (times if i >= timed_from else warm).append(time.perf_counter() - t0)
    out: dict[str, Any] = {
        "batch": batch, "seq": seq, "step_ms_list": [t * 1e3 for t in times],
        "step_ms": 1e3 * sum(times) / len(times), "loss_last": loss.float().item(),
        "info": prepared.info, "warmup_s": sum(warm),
    }
    if device.type == "cuda":
        out.update(_cuda_memory(device, step if graphed else None, leftover, mem_after_wrap))
        out["alloc_retries"] = _alloc_retries(device) - retries_before
    if extras and not graphed and regime == args.profile_regime:
        one_step = functools.partial(step_fn, model, opt, autocast=autocast, spec=spec, after_step=after_step)
        recording.record_extras(impl, regime, args, device, rank, one_step, data, sync)
    del model, opt, loss, data, step, prepared, after_step
    return out


def free_memory(device: torch.device) -> None:
    """Release everything the last implementation left behind."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


# ------------------------------------------------------------------------------------------------ driver


def run_one(
    impl: str, regime: str, spec: ModelSpec, args: argparse.Namespace, device: torch.device,
    rank: int, world: int, host_group: dist.ProcessGroup | None, extras: bool = True,
) -> dict[str, Any]:
    """Measure one (impl, regime) on all ranks in lockstep; returns the row (meaningful on rank 0)."""
    batch, seq = REGIMES[regime]
    row: dict[str, Any] = {"impl": impl, "regime": regime, **host_load_fields(world)}
    only_rank0 = variants_.split_name(impl)[0] in ONE_GPU_IMPLS
    mine: dict[str, Any] = {}
    error, oom = None, False
    if not only_rank0 or rank == 0:
        try:
            mine = measure(impl, regime, spec, args, device, rank, extras)
        except Exception as exc:  # recorded, and the other ranks learn of it below
            traceback.print_exc()
            error, oom = f"rank {rank}: {type(exc).__name__}: {exc}", variants_.is_oom(exc)
    free_memory(device)
    # Host-side agreement (gloo): the baseline's waiting ranks block here until rank 0 is done.
    failed = torch.tensor([0.0 if error is None else 1.0, float(oom)])
    dist.all_reduce(failed, group=host_group)
    participants = 1 if only_rank0 else world
    stats = torch.tensor([
        mine.get("step_ms", 0.0), float(mine.get("peak_bytes", 0)), mine.get("loss_last", 0.0),
        float(mine.get("peak_reserved_bytes", 0)), float(mine.get("alloc_retries", 0)),
    ], dtype=torch.float64)
    maxed = stats.clone()
    dist.all_reduce(maxed, op=dist.ReduceOp.MAX, group=host_group)
    summed = stats.clone()
    dist.all_reduce(summed, group=host_group)
    if failed[0].item():
        row["error"] = error or "failed on another rank (see its log)"
        if failed[1].item():  # out of memory on some rank: the configuration does not fit
            row["oom"] = True
        return row
    if not mine:  # a rank that only waited for the baseline
        return row
    step_ms = maxed[0].item()
    tokens = mine["batch"] * mine["seq"]
    row.update(
        batch=mine["batch"], seq=mine["seq"], gpus=participants, step_ms=step_ms,
        step_ms_rank0=mine["step_ms"], step_ms_list_rank0=mine["step_ms_list"],
        tok_s_gpu=tokens / (step_ms * 1e-3), loss_last=summed[2].item() / participants,
        warmup_s_rank0=mine["warmup_s"], **mine["info"],
    )
    if (batch, seq) != (mine["batch"], mine["seq"]):
        row["note"] = f"regime {regime} capped to batch {mine['batch']} x seq {mine['seq']} by the model config"
    if device.type == "cuda":
        flops = spec.flops_per_step(mine["batch"], mine["seq"])
        row["mfu"] = flops / (step_ms * 1e-3) / (args.peak_tflops * 1e12)
        row["peak_gib"] = maxed[1].item() / 2**30
        # Over the ranks, the most: the reserved peak (earlier implementations' leftovers in it) and the timed
        # steps' allocation retries (each a free of the allocator's cache and a second try, near the memory cap).
        row["peak_reserved_gib"] = maxed[3].item() / 2**30
        row["alloc_retries"] = int(maxed[4].item())
        row["mem_after_wrap_gib_rank0"] = mine["mem_after_wrap_bytes"] / 2**30
        row["leftover_gib_rank0"] = mine["leftover_bytes"] / 2**30
        if "graph_pool_bytes" in mine:
            row["graph_pool_gib_rank0"] = mine["graph_pool_bytes"] / 2**30
    return row


def print_table(rows: list[dict[str, Any]]) -> None:
    """The compact comparison table (rank 0)."""
    ref = {r["regime"]: r["step_ms"] for r in rows if r["impl"] == "fsdp2" and "step_ms" in r}
    print(f"\n{'impl':15s} {'regime':6s} {'step ms':>9s} {'tok/s/GPU':>10s} {'MFU %':>6s} {'peak GiB':>9s} "
          f"{'loss':>7s} {'vs fsdp2':>9s}")
    for r in rows:
        if "step_ms" not in r:
            oom = "oom: " if r.get("oom") else ""
            print(f"{r['impl']:15s} {r['regime']:6s} {oom}{r.get('error') or r.get('skipped')}")
            continue
        mfu = f"{100 * r['mfu']:6.1f}" if "mfu" in r else f"{'-':>6s}"
        peak = f"{r['peak_gib']:9.2f}" if "peak_gib" in r else f"{'-':>9s}"
        speedup = f"{ref[r['regime']] / r['step_ms']:8.2f}x" if r["regime"] in ref else f"{'-':>9s}"
        print(f"{r['impl']:15s} {r['regime']:6s} {r['step_ms']:9.1f} {r['tok_s_gpu']:10,.0f} {mfu} {peak} "
              f"{r['loss_last']:7.3f} {speedup}")
    print("(vs fsdp2: FSDP2's step time / this step time; > 1 is faster)", flush=True)


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (impl, regime): the median step time over rounds, its spread, and ratios of medians against fsdp2,
    fairscale, shardfuse-ref and the one-GPU baseline (tokens/s/GPU ratios: > 1 is faster)."""
    by: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        if "step_ms" in r:
            by.setdefault((r["impl"], r["regime"]), []).append(r)
    out = []
    medians = {k: statistics.median(x["step_ms"] for x in v) for k, v in by.items()}
    for (impl, regime), runs in by.items():
        ms = [x["step_ms"] for x in runs]
        entry: dict[str, Any] = {
            "impl": impl, "regime": regime, "rounds": len(ms), "step_ms_median": medians[(impl, regime)],
            "step_ms_min": min(ms), "step_ms_max": max(ms),
            "tok_s_gpu_median": statistics.median(x["tok_s_gpu"] for x in runs),
            "peak_gib_max": max((x.get("peak_gib", 0.0) for x in runs), default=0.0),
        }
        for other in ("fsdp2", "fairscale", "shardfuse", "shardfuse-ref", "baseline", "baseline-graph"):
            if (other, regime) in medians and other != impl:
                entry[f"vs_{other}"] = medians[(other, regime)] / medians[(impl, regime)]
        out.append(entry)
    return out


def print_summary(summary: list[dict[str, Any]]) -> None:
    """Medians over rounds with their spread, and the ratios of medians (rank 0)."""
    if not summary or max(s["rounds"] for s in summary) < 2:
        return
    others = ("fsdp2", "fairscale", "shardfuse", "shardfuse-ref", "baseline", "baseline-graph")
    print(f"\n{'impl':15s} {'regime':6s} {'rounds':>6s} {'median ms':>10s} {'min-max ms':>16s} {'tok/s/GPU':>10s} "
          + " ".join(f"{'vs ' + o:>16s}" for o in others))
    for s in summary:
        ratios = " ".join(f"{s['vs_' + o]:15.2f}x" if f"vs_{o}" in s else f"{'-':>16s}" for o in others)
        spread = f"{s['step_ms_min']:.1f}-{s['step_ms_max']:.1f}"
        print(f"{s['impl']:15s} {s['regime']:6s} {s['rounds']:6d} {s['step_ms_median']:10.1f} {spread:>16s} "
              f"{s['tok_s_gpu_median']:10,.0f} {ratios}")
    print("(ratios of median step times: the other's / this one's; > 1 means this one is faster)", flush=True)


def _init_distributed(args: argparse.Namespace) -> tuple[int, int, int]:
    """Join torchrun's process group (or make a world of one); returns (rank, world, local_rank)."""
    if "RANK" not in os.environ:
        os.environ.update(
            RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
        )
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
    dist.init_process_group(
        "nccl" if args.device == "cuda" else "gloo", timeout=datetime.timedelta(seconds=args.pg_timeout)
    )
    return rank, world, local_rank


def default_output(device: torch.device) -> None:
    """A CPU (gloo) smoke run writes under ``SMOKE_OUT`` unless $BENCH_OUT says where: never into bench/results/."""
    if device.type != "cuda" and not os.environ.get("BENCH_OUT"):
        os.environ["BENCH_OUT"] = str(SMOKE_OUT)


def _with_summary(payload: dict[str, Any]) -> dict[str, Any]:
    """``payload`` with its summary of the rows so far (medians, ratios; written after every run, so a job that
    ends early keeps it)."""
    payload["summary"] = summarize(payload["results"])
    variants_.variant_ratios(payload["summary"])
    return payload


def _run_and_record(
    impl: str, regime: str, rnd: int, progress: Progress, *, spec: ModelSpec, args: argparse.Namespace,
    device: torch.device, rank: int, world: int, host_group: dist.ProcessGroup | None, name: str,
    payload: dict[str, Any],
) -> dict[str, Any]:
    """One run on every rank; rank 0 prints it and writes the result file. Returns the row."""
    if rank == 0:
        print(progress.line(f"round {rnd} {impl} {regime} ..."), flush=True)
    t0 = time.perf_counter()
    # --profile and --memory-peak record in the first round (a deadline may cut the later ones).
    row = run_one(impl, regime, spec, args, device, rank, world, host_group, extras=rnd == 0)
    row.update(round=rnd, wall_s=time.perf_counter() - t0)
    payload["results"].append(row)
    if rank == 0:
        if "step_ms" in row:
            print(f"   {row['step_ms']:.1f} ms/step, {row['tok_s_gpu']:,.0f} tok/s/GPU, "
                  f"loss {row['loss_last']:.3f}", flush=True)
        else:
            print(f"   {'out of memory' if row.get('oom') else 'error'}: {row['error']}", flush=True)
        write_result(name, _with_summary(payload))
    return row


def _run_rounds(
    variants: list[variants_.Variant], regimes: list[str], args: argparse.Namespace, rank: int,
    host_group: dist.ProcessGroup | None, payload: dict[str, Any], record: Callable[..., dict[str, Any]],
) -> None:
    """Every round (one after the first only where ``--deadline`` leaves it the time the last one would take
    without its warm-up's compiling), then the ``+once`` runs (while the deadline is not past)."""
    rounds, once = variants_.plan_runs(regimes, variants, args.rounds)
    progress = Progress(sum(len(r) for r in rounds) + len(once))
    deadline = variants_.Deadline(args.deadline)
    for rnd, runs in enumerate(rounds):
        if rnd and not deadline.agree(deadline.allows(deadline.last_round_s), host_group):
            payload["config"]["stopped_by_deadline"] = {"rounds_run": rnd, "elapsed_s": deadline.elapsed()}
            if rank == 0:
                print(f"-- --deadline {args.deadline:g} s: no round {rnd} (elapsed {deadline.elapsed():.0f} s, the "
                      f"next round ~{deadline.last_round_s:.0f} s)", flush=True)
            break
        done = [record(v.name, regime, rnd, progress) for regime, v in runs]
        deadline.round_done(variants_.steady_round_s(done, args.warmup))
    for regime, v in once:
        if deadline.agree(deadline.allows(0.0), host_group):
            record(v.name, regime, 0, progress)
        else:
            reason = f"past the --deadline of {args.deadline:g} s (elapsed {deadline.elapsed():.0f} s)"
            payload["results"].append({"impl": v.name, "regime": regime, "skipped": reason, "round": 0})


def main(argv: list[str] | None = None) -> None:
    """Run every requested (regime, impl) and write the result JSON."""
    args = parse_args(argv)
    rank, world, local_rank = _init_distributed(args)
    device = torch.device("cuda", local_rank) if args.device == "cuda" else torch.device("cpu")
    default_output(device)
    mem_cap = variants_.cap_gpu_memory(args.gpu_mem_gib, device)
    # Host-side bookkeeping goes through gloo, so waiting ranks never spin on a GPU collective.
    host_group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None
    spec = model_spec(args.model, args.config)
    regimes = args.regime_list
    impls = (["baseline"] if not args.no_baseline else []) + args.impl_list
    name = args.name or spec.result_name(world)
    if rank == 0:
        print(f"e2e: {world} x {device.type}, {args.model} {args.config} model ({spec.num_params:,} params), "
              f"regimes {regimes}, impls {impls}, {args.warmup} warm-up + {args.steps} timed steps", flush=True)
    payload: dict[str, Any] = {
        "config": {
            "model": args.config, "model_kind": spec.kind, **spec.config, "params": spec.num_params,
            "world_size": world,
            "device": device.type, "steps": args.steps, "warmup": args.warmup, "lr": args.lr,
            "optimizer": f"AdamW ({args.optim})", "peak_memory": "above what earlier runs left allocated",
            "compute_dtype": "bfloat16", "reduce_dtype": "float32",
            "peak_tflops": args.peak_tflops, "regimes": {r: REGIMES[r] for r in regimes},
            "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE"),
            "pytorch_cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
            "compile": args.compile, "ac": args.ac, "float8": args.float8, "budget_gib": args.budget_gib,
            "deadline_s": args.deadline, **mem_cap,
        },
        "results": [],
    }
    rows: list[dict[str, Any]] = payload["results"]
    variants = {impl: args.variants.get(impl) or variants_.Variant(impl, impl) for impl in impls}
    unavailable = {impl: unavailable_reason(v.base.removesuffix("-budget")) or variants_.unavailable(v)
                   for impl, v in variants.items()}
    for impl, reason in unavailable.items():
        if reason is not None:
            rows.extend({"impl": impl, "regime": regime, "skipped": reason} for regime in regimes)
            if rank == 0:
                print(f"-- {impl}: skipped ({reason})", flush=True)
    ready = [v for impl, v in variants.items() if unavailable[impl] is None]
    record = functools.partial(_run_and_record, spec=spec, args=args, device=device, rank=rank, world=world,
                               host_group=host_group, name=name, payload=payload)
    _run_rounds(ready, regimes, args, rank, host_group, payload, record)
    if rank == 0:
        path = write_result(name, _with_summary(payload))
        print_table(rows)
        print_summary(payload["summary"])
        if any(v.name != v.base or v.modifiers != (None, False, False, False) for v in variants.values()):
            print("\n" + "\n".join(variants_.variant_table(payload)))
        print(f"wrote {path}", flush=True)
    dist.barrier(group=host_group)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
