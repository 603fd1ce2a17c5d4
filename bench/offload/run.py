"""Offload benchmark: one GPU trains a model whose weights live in host memory.

    python -m bench.offload.run [--quick] [--steps 5] [--warmup 3] [--only plain,shardfuse,...]

Model ``nn.Sequential(*[Linear(8192, 8192), ReLU()] x 16)`` (1074M fp32 parameters), batch 4096, SGD, side by
side in one process:

* ``plain``: everything resident on the GPU; ``plain_bf16_autocast`` the same under bf16 autocast (the
  baseline to hold the ``compute_dtype=bf16`` variants against);
* ``shardfuse``: ``OffloadModel`` (4 slices, 4 microbatches, checkpoint_activation=True), plus the variants
  ``compute_dtype=bf16``, ``optimizer_in_backward`` and both together, and fp32 with
  ``checkpoint_activation=False`` and ``optimizer_in_backward`` (activations stay on the GPU, no recompute),
  and with ``offload_activations=True`` (activations parked in host memory, no recompute; 8 slices, one
  microbatch, with and without ``optimizer_in_backward``);
* ``fairscale``: FairScale's ``OffloadModel`` with the same settings, when importable;
* ``fsdp2_cpu_offload``: FSDP2 ``fully_shard`` per Linear with ``CPUOffloadPolicy`` in a world-size-1 group.

Reported per variant: step time (mean of the timed steps after warm-up), host<->device GB/s (bytes moved
per step / step time; measured by shardfuse's own counters, estimated from the parameter traffic for the
others), peak GPU memory, and for shardfuse's variants the PCIe floor: the pinned host<->device bandwidth is
measured first (``bench.offload.floor.link_bandwidth``), and a variant's floor is max(the bytes its schedule must
move host->device / H2D GB/s, the bytes device->host / D2H GB/s, the resident step time: ``plain``, or
``plain_bf16_autocast`` for a bf16 variant); ``floor_terms_gb`` lists those bytes term by term, ``phase_floor_ms``
adds the forward's and the backward's bus time instead (see ``bench/offload/floor.py``). Then a capped run:
``torch.cuda.set_per_process_memory_fraction`` limits the
process to a budget below 1/4 of a second model's size, and shardfuse trains that model anyway.
Writes ``bench/results/<gpu>/offload.json`` (or under $BENCH_OUT) and prints a table last.
"""

from __future__ import annotations

import argparse
import copy
import gc
import logging
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from bench.common import free_port, write_result
from bench.offload.floor import Variant, floor, link_bandwidth, necessary_bytes
from shardfuse.offload import OffloadModel

logger = logging.getLogger(__name__)
GIB = 2**30


def build(width: int, layers: int, seed: int = 0) -> nn.Sequential:
    """``layers`` x (Linear(width, width) + ReLU) on the host, fp32."""
    torch.manual_seed(seed)
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*mods)


def nparams(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def free_gpu() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def time_steps(step: Callable[[], float], warmup: int, steps: int) -> tuple[float, list[float], float]:
    """Mean step time in ms over ``steps`` after ``warmup``; the losses; peak GPU GiB over all of them."""
    torch.cuda.reset_peak_memory_stats()
    losses = []
    for _ in range(warmup):
        losses.append(step())
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        losses.append(step())
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return 1e3 * sum(times) / len(times), losses, torch.cuda.max_memory_allocated() / GIB


def sgd_step(model: nn.Module, opt: torch.optim.Optimizer | None, x: torch.Tensor) -> Callable[[], float]:
    def step() -> float:
        out = model(x)
        loss = out.float().pow(2).mean()
        loss.backward()
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def run_plain(base: nn.Sequential, x: torch.Tensor, cfg: dict[str, Any], autocast: bool = False) -> dict[str, Any]:
    model = copy.deepcopy(base).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"])
    step = sgd_step(model, opt, x)
    if autocast:  # fp32 weights, bf16 matrix products: the fair baseline of the bf16 offload variants
        fp32_step = step

        def step() -> float:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                return fp32_step()

    ms, losses, peak = time_steps(step, cfg["warmup"], cfg["steps"])
    del model, opt
    return {"step_ms": ms, "peak_gib": peak, "losses": [float(v) for v in losses], "h2d_gbps": 0.0, "d2h_gbps": 0.0}


def traffic_of(model: OffloadModel, base: nn.Sequential, x: torch.Tensor, **kw: Any) -> Variant:
    """What decides ``model``'s bus traffic (its slices, dtype, options), for the floor."""
    layers = list(base)
    ranges = model.slice_ranges
    return Variant(
        slice_params=[sum(p.numel() for m in layers[a:b] for p in m.parameters()) for a, b in ranges],
        slice_linears=[sum(isinstance(m, nn.Linear) for m in layers[a:b]) for a, b in ranges],
        act_numel=x.numel(),
        compute_bytes=(model.compute_dtype or torch.float32).itemsize,
        opt_in_backward=bool(model.optimizers),
        checkpoint=model.checkpoint_activation,
        offload_activations=model.offload_activations,
    )


def run_shardfuse(base: nn.Sequential, x: torch.Tensor, cfg: dict[str, Any], **kw: Any) -> dict[str, Any]:
    lr = cfg["lr"]
    if kw.pop("opt_in_backward", False):
        kw["optimizer_in_backward"] = lambda ps: torch.optim.SGD(ps, lr=lr)
    checkpoint = kw.pop("checkpoint", True)
    slices, microbatches = kw.pop("slices", cfg["slices"]), kw.pop("microbatches", cfg["microbatches"])
    model = OffloadModel(copy.deepcopy(base), torch.device("cuda"), num_slices=slices,
                         checkpoint_activation=checkpoint, num_microbatches=microbatches, **kw)  # fmt: skip
    need = necessary_bytes(traffic_of(model, base, x))
    opt = None if "optimizer_in_backward" in kw else torch.optim.SGD(model.parameters(), lr=lr)
    step = sgd_step(model, opt, x)
    for _ in range(cfg["warmup"]):
        step()
    model.transfer_stats(reset=True)
    ms, losses, peak = time_steps(step, 0, cfg["steps"])
    moved = model.transfer_stats()
    per_step = {k: v / cfg["steps"] for k, v in moved.items()}
    del model, opt, step
    return {
        "step_ms": ms,
        "peak_gib": peak,
        "losses": [float(v) for v in losses],
        "num_slices": slices,
        "num_microbatches": microbatches,
        "h2d_gb_per_step": per_step["h2d"] / 1e9,
        "d2h_gb_per_step": per_step["d2h"] / 1e9,
        "h2d_gbps": per_step["h2d"] / 1e9 / (ms / 1e3),
        "d2h_gbps": per_step["d2h"] / 1e9 / (ms / 1e3),
        "compute_dtype": str(kw.get("compute_dtype", torch.float32)).removeprefix("torch."),
        "_need": need,  # replaced by the floor once the resident baselines are in (add_floors)
    }


def add_floors(rows: dict[str, dict[str, Any]], link: dict[str, float]) -> None:
    """Each shardfuse row's floor (bf16 rows against the bf16-autocast resident step), ratio and excess bytes."""
    for r in rows.values():
        need = r.pop("_need", None)
        if need is None:
            continue
        resident = rows.get("plain_bf16_autocast" if r["compute_dtype"] == "bfloat16" else "plain", {})
        r.update(floor(need, link, resident.get("step_ms")))
        r["link_h2d_gbps"], r["link_d2h_gbps"] = link["h2d_gbps"], link["d2h_gbps"]
        r["vs_floor"] = r["step_ms"] / r["floor_ms"]
        r["vs_phase_floor"] = r["step_ms"] / r["phase_floor_ms"]
        # bytes the engine moved beyond what the schedule needs (alignment padding: a few KB)
        r["excess_h2d_gb"] = r["h2d_gb_per_step"] - r["floor_h2d_gb"]
        r["excess_d2h_gb"] = r["d2h_gb_per_step"] - r["floor_d2h_gb"]


def run_fairscale(base: nn.Sequential, x: torch.Tensor, cfg: dict[str, Any]) -> dict[str, Any]:
    from fairscale.experimental.nn.offload import OffloadModel as FairScaleOffload

    model = FairScaleOffload(copy.deepcopy(base), device=torch.device("cuda"), offload_device=torch.device("cpu"),
                             num_slices=cfg["slices"], checkpoint_activation=True,
                             num_microbatches=cfg["microbatches"])  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"])
    ms, losses, peak = time_steps(sgd_step(model, opt, x), cfg["warmup"], cfg["steps"])
    pbytes = nparams(base) * 4
    del model, opt
    # estimated: params in and out in forward and in backward, gradients out
    return {"step_ms": ms, "peak_gib": peak, "losses": [float(v) for v in losses],
            "h2d_gbps": 2 * pbytes / 1e9 / (ms / 1e3), "d2h_gbps": 3 * pbytes / 1e9 / (ms / 1e3),
            "traffic": "estimated"}  # fmt: skip


def run_fsdp2(base: nn.Sequential, x: torch.Tensor, cfg: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    if not dist.is_initialized():
        dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"tcp://127.0.0.1:{free_port()}",
                                rank=0, world_size=1)  # fmt: skip
    model = copy.deepcopy(base)
    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m, offload_policy=CPUOffloadPolicy())
    fully_shard(model, offload_policy=CPUOffloadPolicy())
    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"])
    ms, losses, peak = time_steps(sgd_step(model, opt, x), cfg["warmup"], cfg["steps"])
    pbytes = nparams(base) * 4
    del model, opt
    # estimated: params gathered in forward and again in backward (reshard after forward), gradients out
    return {"step_ms": ms, "peak_gib": peak, "losses": [float(v) for v in losses],
            "h2d_gbps": 2 * pbytes / 1e9 / (ms / 1e3), "d2h_gbps": pbytes / 1e9 / (ms / 1e3),
            "traffic": "estimated"}  # fmt: skip


def run_capped(cfg: dict[str, Any]) -> dict[str, Any]:
    """Train a model >= 4x larger than the GPU memory budget the process is held to."""
    width, layers, batch = cfg["cap_width"], cfg["cap_layers"], cfg["cap_batch"]
    base = build(width, layers, seed=1)
    model_bytes = nparams(base) * 4
    budget = model_bytes / cfg["cap_ratio"]
    free_gpu()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(budget / total)
    try:
        try:  # the plain model does not fit (its weights alone exceed the budget)
            probe = torch.empty(model_bytes // 4, device="cuda")
            plain_fits = True
            del probe
        except torch.cuda.OutOfMemoryError:
            plain_fits = False
        x = torch.randn(batch, width, device="cuda")
        model = OffloadModel(base, torch.device("cuda"), num_slices=layers, checkpoint_activation=True,
                             num_microbatches=cfg["microbatches"])  # fmt: skip
        opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"])
        ms, losses, peak = time_steps(sgd_step(model, opt, x), cfg["warmup"], cfg["steps"])
        del model, opt, x
    finally:
        free_gpu()
        torch.cuda.set_per_process_memory_fraction(1.0)
    return {
        "model": f"{layers} x Linear({width}, {width}) + ReLU",
        "params_m": nparams(base) / 1e6,
        "model_gib": model_bytes / GIB,
        "budget_gib": budget / GIB,
        "model_over_budget": model_bytes / budget,
        "plain_weights_fit": plain_fits,
        "num_slices": layers,
        "batch": batch,
        "step_ms": ms,
        "samples_per_s": batch / (ms / 1e3),
        "peak_gib": peak,
        "losses": [float(v) for v in losses],
    }


def parse_args() -> argparse.Namespace:
    """Command-line arguments."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller models and fewer steps (smoke run)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 5, quick 2)")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 3, quick 1)")
    ap.add_argument("--only", default="", help="comma-separated variants to run (default: all)")
    return ap.parse_args()


def make_config(args: argparse.Namespace) -> dict[str, Any]:
    """The model sizes, steps and learning rate of the run (smaller ones with ``--quick``)."""
    q = args.quick
    cfg: dict[str, Any] = {
        "width": 2048 if q else 8192, "layers": 8 if q else 16, "batch": 1024 if q else 4096,
        "slices": 4, "microbatches": 4, "lr": 1e-3,
        "warmup": args.warmup if args.warmup is not None else (1 if q else 3),
        "steps": args.steps if args.steps is not None else (2 if q else 5),
        "cap_width": 1024 if q else 4096, "cap_layers": 32 if q else 64, "cap_batch": 1024 if q else 4096,
        "cap_ratio": 4.5,
    }  # fmt: skip
    return cfg


def variants() -> list[tuple[str, Callable[..., dict[str, Any]], dict[str, Any]]]:
    """Every variant in the order they run: its name, the function that runs it, that function's options."""
    return [
        ("plain", run_plain, {}),
        ("plain_bf16_autocast", run_plain, {"autocast": True}),
        ("shardfuse", run_shardfuse, {}),
        ("shardfuse_bf16", run_shardfuse, {"compute_dtype": torch.bfloat16}),
        ("shardfuse_opt_in_bwd", run_shardfuse, {"opt_in_backward": True}),
        ("shardfuse_bf16_opt_in_bwd", run_shardfuse, {"compute_dtype": torch.bfloat16, "opt_in_backward": True}),
        # activations stay on the GPU: no recompute, so the step can approach the plain one
        ("shardfuse_keep_acts_opt_in_bwd", run_shardfuse, {"checkpoint": False, "opt_in_backward": True}),
        # no recompute and activations parked in host memory: both bus directions carry them, overlapped;
        # microbatches only add copies without recompute, and smaller slices keep less on the device
        ("shardfuse_offload_acts", run_shardfuse, {"checkpoint": False, "offload_activations": True,
                                                   "slices": 8, "microbatches": 1}),
        ("shardfuse_offload_acts_opt_in_bwd", run_shardfuse, {"checkpoint": False, "offload_activations": True,
                                                              "opt_in_backward": True, "slices": 8,
                                                              "microbatches": 1}),
        ("shardfuse_offload_acts_opt_in_bwd_4sl", run_shardfuse, {"checkpoint": False, "offload_activations": True,
                                                                  "opt_in_backward": True, "microbatches": 1}),
        ("fairscale", run_fairscale, {}),
        ("fsdp2_cpu_offload", run_fsdp2, {}),
    ]


def run_variants(
    base: nn.Sequential, x: torch.Tensor, cfg: dict[str, Any], only: set[str],
) -> dict[str, dict[str, Any]]:
    """Each variant in ``only`` (every one when empty): its row, or why it has none (skipped, error)."""
    rows: dict[str, dict[str, Any]] = {}
    for name, fn, kw in variants():
        if only and name not in only:
            continue
        logger.info("== %s", name)
        t0 = time.perf_counter()
        try:
            rows[name] = fn(base, x, cfg, **kw)
        except ImportError as e:
            rows[name] = {"skipped": f"not importable: {e}"}
        except Exception as e:  # a failed variant is reported, the others still run
            rows[name] = {"error": f"{type(e).__name__}: {e}"}
            traceback.print_exc()
        rows[name]["wall_s"] = time.perf_counter() - t0
        logger.info("   %s", {k: v for k, v in rows[name].items() if k not in ("losses", "_need")})
        free_gpu()
    return rows


def main() -> None:
    """Run the selected variants, then the capped run; write offload.json and print the table."""
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not torch.cuda.is_available():
        sys.exit("bench.offload.run needs a CUDA GPU")
    torch.cuda.set_device(0)
    cfg = make_config(args)
    t_start = time.perf_counter()
    base = build(cfg["width"], cfg["layers"])
    cfg["params_m"] = nparams(base) / 1e6
    cfg["model_gib"] = nparams(base) * 4 / GIB
    x = torch.randn(cfg["batch"], cfg["width"], device="cuda")
    logger.info("model: %d x Linear(%d) + ReLU, %.0fM params (%.2f GiB fp32), batch %d",
                cfg["layers"], cfg["width"], cfg["params_m"], cfg["model_gib"], cfg["batch"])  # fmt: skip
    link = cfg["link"] = link_bandwidth()
    logger.info("pinned host->device %.1f GB/s, device->host %.1f GB/s, both at once %.1f GB/s each (%d MiB, median "
                "of %d)", link["h2d_gbps"], link["d2h_gbps"], link["duplex_gbps"], link["bytes"] / 2**20,
                link["reps"])  # fmt: skip

    only = {v for v in args.only.split(",") if v}
    rows = run_variants(base, x, cfg, only)
    del x, base  # the capped run gets a GPU with nothing else allocated
    free_gpu()
    capped: dict[str, Any] = {}
    if not only or "capped" in only:
        logger.info("== capped")
        try:
            capped = run_capped(cfg)
        except Exception as e:
            capped = {"error": f"{type(e).__name__}: {e}"}
            traceback.print_exc()
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    plain_ms = rows.get("plain", {}).get("step_ms")
    for r in rows.values():
        if plain_ms and "step_ms" in r:
            r["vs_plain"] = r["step_ms"] / plain_ms
    add_floors(rows, link)
    cfg["total_wall_s"] = time.perf_counter() - t_start
    path = write_result("offload", {"config": cfg, "variants": rows, "capped": capped})
    print_summary(cfg, rows, capped, path)


def print_summary(cfg: dict[str, Any], rows: dict[str, dict[str, Any]], capped: dict[str, Any], path: Any) -> None:
    """The table of variants (with each shardfuse variant's floor), the bytes behind the floors, the capped run."""
    nan = float("nan")
    link = cfg["link"]
    print(f"\nOffload benchmark ({cfg['layers']} x Linear({cfg['width']}) + ReLU, {cfg['params_m']:.0f}M params, "
          f"batch {cfg['batch']}, {cfg['slices']} slices, {cfg['microbatches']} microbatches) -> {path}")  # fmt: skip
    print(f"pinned PCIe: host->device {link['h2d_gbps']:.1f} GB/s, device->host {link['d2h_gbps']:.1f} GB/s, "
          f"both at once {link['duplex_gbps']:.1f} GB/s each")  # fmt: skip
    print(f"{'variant':<38}{'step ms':>10}{'vs plain':>10}{'H2D GB/s':>10}{'D2H GB/s':>10}{'peak GiB':>10}"
          f"{'floor ms':>10}{'x floor':>9}{'phase ms':>10}{'x phase':>9}")  # fmt: skip
    for name, r in rows.items():
        if "step_ms" not in r:
            print(f"{name:<38}  {r.get('skipped') or r.get('error')}")
            continue
        est = "*" if r.get("traffic") == "estimated" else " "
        print(f"{name:<38}{r['step_ms']:>10.1f}{r.get('vs_plain', nan):>9.2f}x"
              f"{r['h2d_gbps']:>9.1f}{est}{r['d2h_gbps']:>9.1f}{est}{r['peak_gib']:>10.2f}"
              f"{r.get('floor_ms', nan):>10.1f}{r.get('vs_floor', nan):>8.2f}x"
              f"{r.get('phase_floor_ms', nan):>10.1f}{r.get('vs_phase_floor', nan):>8.2f}x")  # fmt: skip
    print("(* estimated from parameter traffic; floor: max(H2D bytes / H2D GB/s, D2H bytes / D2H GB/s, resident step);"
          " phase: forward bus time + backward bus time)")  # fmt: skip
    for name, r in rows.items():
        if "floor_terms_gb" not in r:
            continue
        print(f"{name}: floor {r['floor_ms']:.1f} ms ({r['floor_bound']}-bound); needs {r['floor_h2d_gb']:.3f} GB "
              f"H2D ({r['floor_h2d_ms']:.1f} ms), {r['floor_d2h_gb']:.3f} GB D2H ({r['floor_d2h_ms']:.1f} ms); moved "
              f"{r['h2d_gb_per_step']:.3f} / {r['d2h_gb_per_step']:.3f} GB")  # fmt: skip
        for direction, terms in r["floor_terms_gb"].items():
            for term, gb in terms.items():
                print(f"    {direction} {gb:7.3f} GB  {term}")
    if "step_ms" in capped:
        print(f"capped: {capped['model']} = {capped['model_gib']:.2f} GiB in a {capped['budget_gib']:.2f} GiB budget "
              f"({capped['model_over_budget']:.1f}x): {capped['step_ms']:.1f} ms/step, "
              f"{capped['samples_per_s']:.0f} samples/s, peak {capped['peak_gib']:.2f} GiB")  # fmt: skip
    elif capped:
        print(f"capped: {capped.get('error')}")


if __name__ == "__main__":
    main()
