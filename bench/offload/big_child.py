"""One measurement of ``bench.offload.big`` in its own process: the hardware floor, or one implementation.

    python -m bench.offload.big_child --job '{"impl": "shardfuse", "config": "2.9b-4k", ...}' --result PATH

Started by the driver (``bench.offload.big``), one process per measurement, so that GPU peak memory and host
peak RSS are this measurement's own and a crash or an out-of-memory kill ends only this process. Writes one JSON
object to ``--result`` (also on failure: ``status`` is ``ok``, ``skipped``, ``oom`` or ``error``).

* ``impl == "floor"``: pinned host->device and device->host copy bandwidth (CUDA events, a large buffer), and
  torch's fused CPU AdamW over ``extra.opt_params`` fp32 parameters in tensors of ``extra.chunk`` elements (the
  size of one decoder block's flat parameter), with the thread count used; also the environment.
* any implementation: build, wrap, ``warmup`` untimed then ``steps`` timed optimizer steps (each one
  ``accum`` micro-batches, synchronised before and after); the median, the spread, GPU peak memory
  (``max_memory_allocated`` from after setup to the end) and this process's peak RSS. ``resident`` also times
  forward + backward apart (the floor's compute term); with ``extra.compute_only`` it runs only those, on bf16
  parameters, for a model whose fp32 weights, gradients and AdamW state do not fit on the GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from bench.offload import gpu_timeline, host_timeline
from bench.offload.big_impls import Job, ResidentTrainer, Skip, Trainer, build_model, make_batches, make_trainer

GIB = 2**30


def peak_rss_gib() -> float | None:
    """This process's peak resident set size (VmHWM), from /proc; None where there is no /proc."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / GIB
    except OSError:
        return None
    return None


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------------------------------------ floor


def copy_gbps(nbytes: int, to_device: bool, reps: int = 10) -> float:
    """Pinned host <-> device copy bandwidth in GB/s (one direction), median over ``reps`` CUDA-event timings."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host.fill_(1)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    src, dst = (host, dev) if to_device else (dev, host)
    for _ in range(2):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    ms = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        ms.append(start.elapsed_time(end))
    del host, dev
    return nbytes / (statistics.median(ms) * 1e-3) / 1e9


def cpu_adamw_seconds(numel: int, chunk: int, steps: int = 3) -> dict[str, Any]:
    """torch's fused CPU AdamW over ``numel`` fp32 parameters (tensors of ``chunk``): median seconds per step."""
    chunk = max(1, min(chunk, numel))
    base = torch.randn(chunk)
    sizes = [chunk] * (numel // chunk) + ([numel % chunk] if numel % chunk else [])
    params = [torch.nn.Parameter(base[:n].clone()) for n in sizes]
    for p in params:
        p.grad = base[: p.numel()] * 1e-3
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    opt.step()  # allocates the state
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    return {"opt_params_measured": numel, "opt_tensor_numel": chunk, "opt_s": med, "opt_s_list": times,
            "opt_s_per_param": med / numel, "opt_threads": torch.get_num_threads(),
            "opt_impl": "torch.optim.AdamW(fused=True) on the CPU, fp32"}  # fmt: skip


def host_copy_gbps(nbytes: int = 1 << 30, reps: int = 5) -> float:
    """Host memory bandwidth as torch's multi-threaded copy between two fp32 tensors sees it: bytes read plus
    written per second (median). The fused CPU AdamW reads 16 and writes 12 bytes per parameter: if its rate is
    near this, the host optimizer is bound by memory bandwidth, which the PCIe copies share."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / statistics.median(times) / 1e9


def measure_floor(job: Job) -> dict[str, Any]:
    from bench.common import env_info

    out: dict[str, Any] = {"status": "ok", "env": env_info()}
    for pkg in ("fairscale", "deepspeed", "transformers"):  # versions without importing them
        try:
            out["env"][pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out["env"][pkg] = None
    out["host"] = {"cpu_count": os.cpu_count(), "affinity_cores": len(os.sched_getaffinity(0)),
                   "torch_threads": torch.get_num_threads()}  # fmt: skip
    if job.extra.get("env_only"):  # bench.offload.big --no-floor: the environment alone
        return out
    if job.device == "cuda":
        torch.cuda.set_device(0)
        nbytes = int(job.extra.get("bw_bytes", 1 << 30))
        props = torch.cuda.get_device_properties(0)
        out["gpu_total_gib"] = props.total_memory / GIB
        out["h2d_gbps"] = copy_gbps(nbytes, to_device=True)
        out["d2h_gbps"] = copy_gbps(nbytes, to_device=False)
        out["bw_bytes"] = nbytes
    out.update(cpu_adamw_seconds(int(job.extra["opt_params"]), int(job.extra.get("chunk", 1 << 27))))
    out["host_copy_bytes"] = int(job.extra.get("bw_bytes", 1 << 30))  # bench.offload.big --bw-gib
    out["host_copy_gbps"] = host_copy_gbps(out["host_copy_bytes"])
    return out


# ------------------------------------------------------------------------------------------------ one implementation


class ComputeOnly(ResidentTrainer):
    """Forward + backward of the resident model on bf16 parameters, no optimizer (the floor's compute term when
    the fp32 model and its AdamW state do not fit on the GPU)."""

    def forward_loss(self, tokens: torch.Tensor) -> torch.Tensor:
        from bench.offload.big_impls import loss_of

        return loss_of(self.model(tokens[:, :-1]), tokens)

    def finish(self) -> None:
        for p in self.model.parameters():
            p.grad = None


def setup(job: Job, device: torch.device) -> Trainer:
    if job.impl == "resident" and job.extra.get("compute_only"):
        model = build_model(job.cfg, device, job.seed).to(torch.bfloat16)
        return ComputeOnly(model, None, job.cfg.accum, {"compute_only": True, "params_dtype": "bf16"})
    return make_trainer(job, device)


def speculation_counts(first: dict[str, float], last: dict[str, float]) -> dict[str, Any]:
    """``OffloadOptimizer(speculative_clip=True)``: steps and unit updates committed and redone over the timed steps
    (warm-up left out), and the spare host memory held (nothing for other optimizers)."""
    if "spec_spare_bytes" not in last:
        return {}
    keys = ("spec_steps_committed", "spec_steps_redone", "spec_steps_paused", "spec_units_committed",
            "spec_units_redone", "spec_units_late")
    return {**{k: int(last.get(k, 0) - first.get(k, 0)) for k in keys},
            "spec_spare_gib": last["spec_spare_bytes"] / 2**30}


def timed_steps(trainer: Trainer, job: Job, device: torch.device, split: bool) -> dict[str, Any]:
    """``warmup`` + ``steps`` optimizer steps; times of the timed ones (and of their forward + backward)."""
    data = make_batches(job.cfg, device, job.seed)
    accum = job.cfg.accum
    times, fwd_bwd, losses = [], [], []
    host_stats = getattr(trainer.opt, "host_stats", None)  # shardfuse.OffloadOptimizer: where the step's time went
    marks: list[dict[str, float]] = []  # at the start of each timed step, and at the end
    trace, traced = None, (0.0, 0.0)
    last = job.warmup + job.steps - 1
    for i in range(job.warmup + job.steps):
        sync(device)
        if i >= job.warmup and host_stats is not None:
            marks.append(host_stats())
        if i == last and os.environ.get("BIG_TRACE") and hasattr(trainer.opt, "trace_host"):
            trace = trainer.opt.trace_host()  # the last timed step's host timeline (bench.offload.host_timeline)
        t0 = time.perf_counter()
        loss = None
        for m in range(accum):
            loss = trainer.micro(data[(i * accum + m) % len(data)], last=m == accum - 1)
        if split:
            sync(device)
        t1 = time.perf_counter()
        trainer.finish()
        sync(device)
        t2 = time.perf_counter()
        assert loss is not None
        losses.append(float(loss))
        if i >= job.warmup:
            times.append(1e3 * (t2 - t0))
            fwd_bwd.append(1e3 * (t1 - t0))
        if i == last:
            traced = (t0, t2)
    out: dict[str, Any] = {"step_ms": statistics.median(times), "step_ms_min": min(times),
                           "step_ms_max": max(times), "step_ms_list": times, "losses": losses}  # fmt: skip
    if host_stats is not None:
        trainer.opt.synchronize()
        marks.append(host_stats())
        # Per timed step (the median over the windows between step starts; a window also holds the tail of the
        # previous step's host updates, so the first one carries the warm-up's first-touch of the optimizer state;
        # the last window, which ends with synchronize() and its wait, is left out where two others exist):
        # the worker's busy time, the part of it spent updating, and the time callers (mostly the next forward)
        # waited for it.
        windows = list(zip(marks, marks[1:]))
        windows = windows[:-1] if len(windows) > 2 else windows
        for key, name in (("host_busy_s", "host_busy_ms"), ("wait_s", "host_wait_ms"),
                          ("update_s", "host_update_ms")):
            if key in marks[-1]:
                out[name] = 1e3 * statistics.median(b[key] - a[key] for a, b in windows)
        for key, name in (("grad_d2h_bytes", "grad_d2h_gb"), ("param_h2d_bytes", "param_h2d_gb")):
            if key in marks[-1]:  # what crossed PCIe per step (gradients in the compute dtype where exact)
                out[name] = 1e-9 * statistics.median(b[key] - a[key] for a, b in windows)
        out["host_threads"] = marks[-1]["host_threads"]
        out.update(speculation_counts(marks[0], marks[-1]))
    if trace is not None:  # from the last step's start to the end of its updates (synchronize() above)
        out["host_timeline"] = host_timeline.summarize(trace.events, traced[0], time.perf_counter(), traced[1])
        trainer.opt.trace_host(False)
    if split:
        out["fwd_bwd_ms"] = statistics.median(fwd_bwd)
        out["fwd_bwd_ms_list"] = fwd_bwd
    if os.environ.get("BIG_PROFILE") and device.type == "cuda":
        out.update(profiled_step(trainer, job, device, data, job.warmup + job.steps))
    return out


def profiled_step(trainer: Trainer, job: Job, device: torch.device, data: list[torch.Tensor], i: int) -> dict:
    """One more optimizer step (after the timed ones) under the profiler, to the end of its host updates: the GPU
    engines' busy times (``bench.offload.gpu_timeline``) and, for shardfuse, the host timeline of the same window."""
    accum, tracer = job.cfg.accum, getattr(trainer.opt, "trace_host", None)
    sync(device)
    trace = tracer() if tracer is not None else None
    with gpu_timeline.profiled_step(True, f"{job.config}_{job.impl}") as attribution:
        t0 = time.perf_counter()
        for m in range(accum):
            trainer.micro(data[(i * accum + m) % len(data)], last=m == accum - 1)
        trainer.finish()
        sync(device)
        t1 = time.perf_counter()
        if hasattr(trainer.opt, "synchronize"):
            trainer.opt.synchronize()
        t2 = time.perf_counter()
    out: dict[str, Any] = {"profiled_step_ms": 1e3 * (t1 - t0), "gpu_timeline": attribution()}
    if trace is not None and tracer is not None:
        out["profiled_host_timeline"] = host_timeline.summarize(trace.events, t0, t2, t1)
        tracer(False)
    return out


def _ssd_io_bytes(model: Any) -> tuple[int, int] | None:
    """Bytes the model's SSD stores read and wrote so far (an older shardfuse: every store of the process)."""
    try:
        from shardfuse.sharding.ssd._ssd import io_bytes  # one store per model
    except ImportError:
        try:
            from shardfuse.sharding.ssd._ssd_store import io_bytes as every_store  # type: ignore[attr-defined]
        except ImportError:
            return None
        return every_store()  # type: ignore[no-any-return]
    return io_bytes(model)


def settle_steps(trainer: Trainer) -> int:
    """Untimed steps a row needs before its timed ones: ``OffloadOptimizer`` with a GPU budget places units at its
    first ``step()`` calls (``placements_left``), moving shards and making optimizer state, so those steps and the
    one after the last placement are no steady-state steps (a 6.7B budget row's first step after one warm-up took
    9.1 s against ~1.6 s). 0 where nothing is placed (no budget, another optimizer)."""
    stats = getattr(trainer.opt, "host_stats", None)
    left = int(stats().get("placements_left", 0)) if stats is not None else 0
    return left + 1 if left > 0 else 0


def measure_impl(job: Job) -> dict[str, Any]:
    device = torch.device(job.device)
    if device.type == "cuda":
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
    t0 = time.perf_counter()
    try:
        trainer = setup(job, device)
    except Skip as exc:
        return {"status": "skipped", "reason": str(exc)}
    out: dict[str, Any] = {"status": "ok", "setup_s": time.perf_counter() - t0, **trainer.info,
                           "switch_interval_s": sys.getswitchinterval()}
    if device.type == "cuda":
        out["gpu_peak_setup_gib"] = torch.cuda.max_memory_allocated(device) / GIB
        torch.cuda.reset_peak_memory_stats(device)
    io0 = _ssd_io_bytes(trainer.model) if job.impl == "shardfuse-ssd" else None
    job = dataclasses.replace(job, warmup=max(job.warmup, settle_steps(trainer)))
    out["warmup_steps"] = job.warmup
    out.update(timed_steps(trainer, job, device, split=job.impl == "resident"))
    if io0 is not None:  # the SSD tier: bytes it read and wrote per optimizer step (warm-up steps included)
        io1 = _ssd_io_bytes(trainer.model) or io0
        count = job.warmup + job.steps
        out.update(ssd_read_gb_per_step=(io1[0] - io0[0]) / count / 1e9,
                   ssd_written_gb_per_step=(io1[1] - io0[1]) / count / 1e9)
    if trainer.info.get("compute_only"):
        out["status"] = "compute-only"
        out["reason"] = "fp32 weights, gradients and AdamW state do not fit on this GPU: forward+backward only"
        out.pop("step_ms", None)
    if device.type == "cuda":
        out["gpu_peak_gib"] = torch.cuda.max_memory_allocated(device) / GIB
        out["gpu_reserved_peak_gib"] = torch.cuda.max_memory_reserved(device) / GIB
        free, total = torch.cuda.mem_get_info(device)
        out["gpu_used_end_gib"] = (total - free) / GIB
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--job", required=True, help="the Job as JSON")
    ap.add_argument("--result", required=True, help="where to write the result JSON")
    args = ap.parse_args(argv)
    job = Job(**json.loads(args.job))
    if os.environ.get("BIG_SWITCH_INTERVAL"):  # a diagnostic: how long a thread waits for the GIL at most
        sys.setswitchinterval(float(os.environ["BIG_SWITCH_INTERVAL"]))
    try:
        result = measure_floor(job) if job.impl == "floor" else measure_impl(job)
    except torch.cuda.OutOfMemoryError as exc:
        traceback.print_exc()
        result = {"status": "oom", "reason": f"GPU out of memory: {str(exc).splitlines()[0][:300]}"}
    except Exception as exc:  # recorded in the row; the driver goes on with the next implementation
        traceback.print_exc()
        result = {"status": "error", "reason": f"{type(exc).__name__}: {str(exc)[:500]}"}
    result["host_rss_gib"] = peak_rss_gib()
    Path(args.result).write_text(json.dumps(result, default=str))
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown (process groups, DeepSpeed's and FairScale's hooks): the result is written.
    os._exit(0)


if __name__ == "__main__":
    main()
