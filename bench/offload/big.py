"""Offload of a model that outgrows the GPU: every implementation side by side on one GPU, against the floor.

    python -m bench.offload.big [--configs 2.9b-4k,2.9b-32k,6.7b-2k] [--impls resident,shardfuse,...]
                                [--steps 3] [--warmup 1] [--budget-gib 40] [--save] [--estimate]
    python -m bench.offload.big --device cpu --configs tiny,tiny-acc --steps 1 --warmup 0   # CPU plumbing only

Configurations (``big_impls.CONFIGS``): ``2.9b-4k`` = the Llama-style decoder of 2.9B parameters (dim 3072, 24
layers, 24 heads, ffn 8192, vocab 32000) at 2 x 2048 tokens per optimizer step; ``2.9b-32k`` = the same at
8 micro-batches of 2 x 2048 accumulated (32768 tokens per optimizer step); ``6.7b-2k`` = the shape of Llama-2-7B
(dim 4096, 32 layers, 32 heads, ffn 11008) at 1 x 2048. Implementations: see ``bench/offload/big_impls.py``
(``resident``, ``shardfuse``, ``shardfuse-budget``, ``shardfuse-host-accum`` (accumulating configurations
only), ``fairscale``, ``fsdp2``, ``deepspeed-zero2``, ``deepspeed-zero3``); one not installed is a skipped row.

Each measurement runs in its own process (``bench.offload.big_child``) under a timeout, so GPU peak memory and
host peak RSS are its own and an out-of-memory kill ends only it. First a process measures the hardware floor
(pinned host->device / device->host bandwidth, torch's fused CPU AdamW time per parameter); then per
configuration the resident run comes first (always: its forward + backward is the floor's GPU compute term; for
a model whose fp32 weights, gradients and AdamW state do not fit, forward + backward on bf16 parameters only;
``--no-floor`` skips both, for a before/after of shardfuse's own rows). The floor of a configuration is
max(GPU compute, PCIe, CPU optimizer): PCIe = the larger of 2 bytes/parameter (bf16 parameters) host->device
and 4 bytes/parameter (fp32 gradients) device->host, once per optimizer step, the two directions overlapped;
CPU optimizer = the measured fused-AdamW seconds per parameter x parameters.

``shardfuse-ssd`` (shards and AdamW state in files under ``$BIG_SSD_DIR``, see ``big_impls``): before the runs the
driver measures the sequential write and read bandwidth of that disk (``bench/offload/disk.py``, a
``$BIG_SSD_PROBE_GIB`` GiB file, default 4, O_DIRECT where possible) and prints the floor it implies: every
offloaded byte (4 B/param, +8 B/param of AdamW state on disk) read and written once per optimizer step. That
row's ``floor_ms`` is the larger of the configuration's floor and this disk floor (``disk_floor_ms``); it also
records the bytes the tier really read and wrote per step.

Writes ``$OUT/offload_big.json`` (``--out``; ./out/offload_big.json without $OUT) after every measurement, and
with ``--save`` ``bench/results/<gpu>/offload_big.json`` (under $BENCH_OUT when set). A table last.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench._progress import Progress
from bench.offload import disk, gpu_timeline, host_timeline
from bench.offload.big_impls import (
    AO_FALLBACK_BUDGET_GIB,
    CONFIGS,
    DEFAULT_CONFIGS,
    IMPLS,
    MODELS,
    VARIANTS,
    Job,
    ssd_settings,
    unavailable_reason,
)
from bench.offload.big_rows import ESTIMATE

REPO = Path(__file__).resolve().parents[2]
GIB = 2**30
# Opt-in: the no-clipping variants, the other settings' variants, the SSD tier (disk-bound: a configuration of
# its own per 10-minute call) and the torchao side by side (torchao and the budget at its GPU peak).
DEFAULT_IMPLS = tuple(i for i in IMPLS
                      if "-sib" not in i and "-spec" not in i and "-tl" not in i and "-ntl" not in i and "-gs" not in i
                      and not i.endswith(("-keep", "-allcores", "-hcc", "-cu", "-kl", "-nofire"))
                      and i not in ("shardfuse-ssd", "torchao") and "-ao" not in i)
FLOOR_BYTES = ("bf16 parameters host->device (2 B/param) and fp32 gradients device->host (4 B/param), once per "
               "optimizer step, the two directions overlapped")  # fmt: skip
FLOOR_ESTIMATE_S = 30.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), help=f"from {', '.join(CONFIGS)}")
    p.add_argument("--impls", default=",".join(DEFAULT_IMPLS), help=f"from {', '.join(IMPLS)} (resident always)")
    p.add_argument("--steps", type=int, default=3, help="timed optimizer steps (median and spread over them)")
    p.add_argument("--warmup", type=int, default=1, help="untimed optimizer steps before them")
    p.add_argument("--budget-gib", type=float, default=40.0, help="shardfuse-budget's gpu_budget_gib")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: plumbing on the tiny configs")
    p.add_argument("--out", default=None, help="result JSON (default $OUT/offload_big.json or out/offload_big.json)")
    p.add_argument("--save", action="store_true", help="also write bench/results/<gpu>/offload_big.json")
    p.add_argument(
        "--child-timeout",
        type=float,
        default=None,
        help="seconds per measurement (default: 3 x its estimate, at least 150)",
    )
    p.add_argument(
        "--opt-params",
        type=float,
        default=1e9,
        help="fp32 parameters the CPU AdamW floor is measured on (scaled linearly to each model)",
    )
    p.add_argument("--bw-gib", type=float, default=1.0,
                   help="GiB of the buffers the floor's copy bandwidths (host<->device, host memory) are timed on")
    p.add_argument("--no-floor", action="store_true",
                   help="skip the hardware floor and the resident runs (shardfuse's rows alone, e.g. bench.ab's "
                        "offload-big): the rows get no floor or resident ratio")
    p.add_argument("--estimate", action="store_true", help="print the time plan and exit")
    p.add_argument(
        "--merge",
        nargs="+",
        default=None,
        metavar="JSON",
        help="merge the result files of several calls on the same GPU into --out (no measurement)",
    )
    args = p.parse_args(argv)
    args.config_list = [c.strip() for c in args.configs.split(",") if c.strip()]
    args.impl_list = [i.strip() for i in args.impls.split(",") if i.strip()]
    bad = [c for c in args.config_list if c not in CONFIGS] + [i for i in args.impl_list if i not in IMPLS]
    if bad or not args.config_list:
        p.error(f"unknown configs/impls {bad}: configs from {', '.join(CONFIGS)}; impls from {', '.join(IMPLS)}")
    if args.steps < 1 or args.warmup < 0 or args.bw_gib * GIB < 4:
        p.error(f"need --steps >= 1, --warmup >= 0 and --bw-gib > 0, got {args.steps=} {args.warmup=} {args.bw_gib=}")
    if args.device == "cpu" and any(CONFIGS[c].model != "tiny" for c in args.config_list):
        p.error(f"--device cpu runs only the tiny configs (plumbing), not {args.configs}")
    return args


def plan(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(config, impl) in run order: per configuration the resident run first, then torchao (its GPU peak is the
    budget of the ``-ao`` rows)."""
    out = []
    for c in args.config_list:
        first = [] if args.no_floor else ["resident"]
        first += ["torchao"] if "torchao" in args.impl_list else []
        for impl in first + [i for i in args.impl_list if i not in ("resident", "torchao")]:
            if impl == "shardfuse-host-accum" and CONFIGS[c].accum == 1:
                continue  # the same run as the shardfuse row without accumulation
            out.append((c, impl))
    return out


def estimate_s(config: str, impl: str, args: argparse.Namespace) -> float:
    cfg = CONFIGS[config]
    n_b = MODELS[cfg.model].num_params() / 1e9
    start, setup_per_b, opt_per_b, micro_per_b = ESTIMATE[impl]
    micro_tokens = cfg.batch * cfg.seq / 4096
    step = n_b * (opt_per_b + cfg.accum * micro_per_b * max(micro_tokens, 0.5))
    return start + setup_per_b * n_b + (args.warmup + args.steps) * step


def print_plan(todo: list[tuple[str, str]], args: argparse.Namespace) -> float:
    """The time plan; returns the total estimate in seconds (with --estimate, also of what is not installed here)."""
    total = 0.0 if args.no_floor else FLOOR_ESTIMATE_S
    print(f"offload_big plan ({args.warmup} warm-up + {args.steps} timed steps; rough seconds on one H100):")
    if not args.no_floor:
        print(f"  {'floor':<10} {'-':<22} ~{FLOOR_ESTIMATE_S:.0f} s")
    for config, impl in todo:
        reason = unavailable_reason(impl, args.device)
        est = estimate_s(config, impl, args)
        counted = reason is None or args.estimate
        total += est if counted else 0.0
        note = f" [skipped here: {reason}]" if reason else ""
        print(f"  {config:<10} {impl:<22} ~{est:.0f} s{note}" if counted else f"  {config:<10} {impl:<22}{note}")
    print(f"  total ~{total:.0f} s ({total / 60:.1f} min)", flush=True)
    return total


# ------------------------------------------------------------------------------------------------ children


def describe_status(status: int) -> str:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        hint = " (SIGKILL: the host's memory limit or the timeout)" if sig == signal.SIGKILL else ""
        return f"killed by signal {sig}{hint}"
    return f"exited with code {os.WEXITSTATUS(status)}"


def run_child(job: Job, timeout: float) -> dict[str, Any]:
    """Run one measurement in its own process; its result, or what became of it. Output goes to ours."""
    with tempfile.TemporaryDirectory(prefix="offload_big_") as tmp:
        result_path = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "bench.offload.big_child", "--job", json.dumps(job.to_dict()),
               "--result", str(result_path)]  # fmt: skip
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=REPO, env=os.environ | {"PYTHONUNBUFFERED": "1"})
        pid, timed_out = proc.pid, False
        while True:
            done, status, usage = os.wait4(pid, os.WNOHANG)
            if done:
                break
            if time.perf_counter() - t0 > timeout:
                os.kill(pid, signal.SIGKILL)
                _, status, usage = os.wait4(pid, 0)
                timed_out = True
                break
            time.sleep(0.2)
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - t0
        result: dict[str, Any] = {}
        if result_path.exists():
            try:
                result = json.loads(result_path.read_text())
            except ValueError as exc:  # cut off while writing
                result = {"status": "error", "reason": f"unreadable result ({exc}); {describe_status(status)}"}
        elif timed_out:
            result = {"status": "error", "reason": f"timed out after {timeout:.0f} s"}
        else:
            result = {"status": "error", "reason": describe_status(status)}
    result["wall_s"] = wall
    result["host_rss_tree_gib"] = usage.ru_maxrss * 1024 / GIB  # KiB on Linux: the child and its children
    if result.get("host_rss_gib") is None:
        result["host_rss_gib"] = result["host_rss_tree_gib"]
    return result


# ------------------------------------------------------------------------------------------------ floors and rows


def config_floor(config: str, hw: dict[str, Any], resident: dict[str, Any]) -> dict[str, Any]:
    """The floor of ``config``: max(GPU compute, PCIe, CPU optimizer), each term in ms (None: not measured)."""
    n = MODELS[CONFIGS[config].model].num_params()
    terms: dict[str, float | None] = {"compute_ms": resident.get("fwd_bwd_ms"), "pcie_ms": None, "cpu_opt_ms": None}
    if hw.get("h2d_gbps") and hw.get("d2h_gbps"):
        h2d_ms = 2 * n / (hw["h2d_gbps"] * 1e9) * 1e3
        d2h_ms = 4 * n / (hw["d2h_gbps"] * 1e9) * 1e3
        terms.update(h2d_ms=h2d_ms, d2h_ms=d2h_ms, pcie_ms=max(h2d_ms, d2h_ms))
    if hw.get("opt_s_per_param"):
        terms["cpu_opt_ms"] = hw["opt_s_per_param"] * n * 1e3
    known = [v for k, v in terms.items() if k in ("compute_ms", "pcie_ms", "cpu_opt_ms") and v]
    return {"config": config, "params": n, **terms, "floor_ms": max(known) if known else None,
            "bound": max(("compute_ms", "pcie_ms", "cpu_opt_ms"), key=lambda k: terms[k] or 0.0) if known else None,
            "bytes": FLOOR_BYTES}  # fmt: skip


def make_row(config: str, impl: str, job: Job, result: dict[str, Any]) -> dict[str, Any]:
    """A ``results`` row: the fixed keys first (None where not measured), then the rest of the child's result."""
    cfg = CONFIGS[config]
    row: dict[str, Any] = {
        "impl": VARIANTS[impl][0] if impl in VARIANTS else impl,
        "config": config,
        "tokens_per_step": cfg.tokens_per_step,
        "params": MODELS[cfg.model].num_params(),
        "step_ms": result.get("step_ms"),
        "floor_ms": None,
        "gpu_peak_gib": result.get("gpu_peak_gib"),
        "host_rss_gib": result.get("host_rss_gib"),
        "status": result.get("status", "error"),
        "micro_batches": cfg.accum,
        "batch": cfg.batch,
        "seq": cfg.seq,
    }
    if impl in VARIANTS:
        row["variant"] = VARIANTS[impl][1]
    if row["impl"] == "shardfuse-budget":
        row["gpu_budget_gib"] = result.get("gpu_budget_gib", job.budget_gib)
    for k, v in result.items():
        row.setdefault(k, v)
    if row["step_ms"]:
        row["tokens_per_s"] = cfg.tokens_per_step / (row["step_ms"] / 1e3)
    if row["host_rss_gib"]:  # issue 20: host bytes per parameter (the fp32 optimizer's minimum is 16)
        row["host_bytes_per_param"] = row["host_rss_gib"] * GIB / row["params"]
    return row


def budget_gib(impl: str, config: str, rows: list[dict[str, Any]], args: argparse.Namespace) -> float | None:
    """``gpu_budget_gib`` of a ``shardfuse-budget*`` row: ``--budget-gib``, or for the ``-ao`` rows the GPU peak of
    this job's ``torchao`` row of the same configuration (``AO_FALLBACK_BUDGET_GIB`` where it measured none)."""
    if not impl.startswith("shardfuse-budget"):
        return None
    if "-ao" not in impl:
        return args.budget_gib
    ao = next((r for r in rows if r["config"] == config and r["impl"] == "torchao" and r["status"] == "ok"
               and r.get("gpu_peak_gib")), None)
    if ao is None:
        print(f"   {impl}: no torchao GPU peak measured in this job; gpu_budget_gib={AO_FALLBACK_BUDGET_GIB:g} "
              "(torchao's peak measured on an H100 for issue 30)", flush=True)
        return AO_FALLBACK_BUDGET_GIB
    return round(float(ao["gpu_peak_gib"]), 2)


def vs_torchao(rows: list[dict[str, Any]], config: str) -> None:
    """``speed_vs_torchao`` on ``config``'s measured rows: torchao's step time over the row's (above 1: faster)."""
    mine = [r for r in rows if r["config"] == config]
    ao = next((r["step_ms"] for r in mine if r["impl"] == "torchao" and r["status"] == "ok" and r["step_ms"]), None)
    for r in mine:
        if ao and r["step_ms"]:
            r["speed_vs_torchao"] = ao / r["step_ms"]


def add_ratios(rows: list[dict[str, Any]], floor: dict[str, Any], disk_bw: dict[str, Any] | None = None) -> None:
    """floor_ms, vs_floor and vs_resident on the rows of ``floor``'s configuration (``shardfuse-ssd``: the larger of
    that floor and the floor of the disk measured in ``disk_bw``)."""
    mine = [r for r in rows if r["config"] == floor["config"]]
    resident = next((r["step_ms"] for r in mine if r["impl"] == "resident" and r["step_ms"]), None)
    for r in mine:
        r["floor_ms"] = floor["floor_ms"]
        if r["impl"] == "shardfuse-ssd" and disk_bw and disk_bw.get("read_gbps"):
            state = bool(r.get("ssd_optimizer_state", ssd_settings()["ssd_optimizer_state"]))
            r["disk_floor_ms"] = disk.floor_ms(r["params"], disk_bw, state)
            r["floor_ms"] = max(r["disk_floor_ms"], floor["floor_ms"] or 0.0)
        if r["step_ms"] and r["floor_ms"]:
            r["vs_floor"] = r["step_ms"] / r["floor_ms"]
        if r["step_ms"] and resident:
            r["vs_resident"] = r["step_ms"] / resident


def print_hw_floor(hw: dict[str, Any]) -> None:
    env = hw.get("env", {})
    print(f"\n== hardware floor on {env.get('gpu_name', 'no GPU')} ({hw.get('host', {}).get('cpu_count')} host cores, "
          f"torch {env.get('torch')}, commit {env.get('commit')})")  # fmt: skip
    if hw.get("h2d_gbps"):
        print(f"   pinned host->device {hw['h2d_gbps']:.1f} GB/s, device->host {hw['d2h_gbps']:.1f} GB/s "
              f"({hw['bw_bytes'] / GIB:.1f} GiB buffer, CUDA events, median of 10)")  # fmt: skip
    if hw.get("opt_s"):
        print(
            f"   fused CPU AdamW: {hw['opt_s'] * 1e3:.0f} ms over {hw['opt_params_measured'] / 1e9:.2f}B fp32 params "
            f"on {hw['opt_threads']} threads = {hw['opt_s_per_param'] * 1e12:.0f} ms per billion parameters"
        )
    if hw.get("host_copy_gbps") and hw.get("opt_s_per_param"):
        print(f"   host memory: {hw['host_copy_gbps']:.0f} GB/s read+write (torch copy); the fused CPU AdamW moves "
              f"28 B per parameter = {28 / hw['opt_s_per_param'] / 1e9:.0f} GB/s, sharing it with the PCIe copies")
    print(f"   bytes assumed per optimizer step: {FLOOR_BYTES}", flush=True)


def print_config_floor(f: dict[str, Any]) -> None:
    def ms(k: str) -> str:
        return f"{f[k]:.0f}" if f.get(k) else "-"

    print(f"== floor {f['config']} ({f['params'] / 1e9:.2f}B params): GPU compute {ms('compute_ms')} ms, PCIe "
          f"{ms('pcie_ms')} ms (in {ms('h2d_ms')}, out {ms('d2h_ms')}), CPU optimizer {ms('cpu_opt_ms')} ms -> "
          f"floor {ms('floor_ms')} ms ({f['bound']})", flush=True)  # fmt: skip


def print_row(r: dict[str, Any]) -> None:
    if r["step_ms"]:
        vs = f", {r['vs_floor']:.2f}x floor" if r.get("vs_floor") else ""
        vs += f", {r['vs_resident']:.2f}x resident" if r.get("vs_resident") else ""
        vs += f", {r['speed_vs_torchao']:.2f}x torchao's speed" if r.get("speed_vs_torchao") else ""
        print(
            f"   {r['step_ms']:.0f} ms/step ({r['step_ms_min']:.0f}-{r['step_ms_max']:.0f}){vs}, GPU peak "
            f"{r['gpu_peak_gib'] or 0:.1f} GiB, host RSS {r['host_rss_gib'] or 0:.1f} GiB "
            f"({r.get('host_bytes_per_param') or 0:.1f} B/param)",
            flush=True,
        )
        if r.get("host_busy_ms") is not None:
            updating = f" ({r['host_update_ms']:.0f} updating)" if r.get("host_update_ms") is not None else ""
            print(f"   host optimizer busy {r['host_busy_ms']:.0f} ms/step{updating} on {r['host_threads']:.0f} "
                  f"threads, callers waited {r['host_wait_ms']:.0f} ms/step for it", flush=True)
        if r.get("spec_spare_gib") is not None:
            print(f"   speculative clip: {r['spec_steps_committed']} steps committed, {r['spec_steps_redone']} redone "
                  f"(units: {r['spec_units_committed']} committed, {r['spec_units_redone']} redone, "
                  f"{r['spec_units_late']} updated after the norm), spare {r['spec_spare_gib']:.1f} GiB", flush=True)
        if r.get("host_timeline"):
            print("\n".join(host_timeline.table(r["host_timeline"])), flush=True)
        if r.get("gpu_timeline"):
            print(gpu_timeline.table(r["gpu_timeline"]), flush=True)
        if r.get("profiled_host_timeline"):
            print("   (profiled step, host side)\n" + "\n".join(host_timeline.table(r["profiled_host_timeline"])),
                  flush=True)
        if r.get("disk_floor_ms"):
            print(f"   SSD tier: read {r.get('ssd_read_gb_per_step') or 0:.1f} GB and wrote "
                  f"{r.get('ssd_written_gb_per_step') or 0:.1f} GB per step; disk floor {r['disk_floor_ms']:.0f} ms, "
                  f"{r['step_ms'] / r['disk_floor_ms']:.2f}x it", flush=True)
    else:
        extra = f" (forward+backward {r['fwd_bwd_ms']:.0f} ms)" if r.get("fwd_bwd_ms") else ""
        print(f"   {r['status']}: {r.get('reason', '')}{extra}", flush=True)


def fmt_key(r: dict[str, Any], k: str, fmt: str) -> str:
    return format(r[k], fmt) if r.get(k) else "-"


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"\n{'config':<9} {'impl':<17} {'tok/step':>8} {'step ms':>8} {'spread':>11} {'tok/s':>7} "
          f"{'floor':>6} {'x floor':>7} {'x resid':>7} {'GPU GiB':>7} {'host GiB':>8}")  # fmt: skip
    for r in rows:
        variant = r.get("variant")
        sib = "+sib" if "step-in-backward" in str(variant) else ""
        sib += "+all" if "all cores" in str(variant) else ""
        sib += "+keep" if "reshard_after" in str(variant) else ""
        sib += "+hcc" if "host_compute_copy" in str(variant) else ""
        sib += "+spec" if "speculative_clip" in str(variant) else ""
        sib += "+nf" if "never fires" in str(variant) else ""
        sib += "+ao" if "torchao" in str(variant) else ""
        sib += "+cu" if "clip_in_update" in str(variant) else ""
        sib += "+kl" if "bf16 gradients" in str(variant) else ""
        name = r["impl"] + {"host-accum": "+ha", None: ""}.get(variant, sib)
        if not r["step_ms"]:
            print(f"{r['config']:<9} {name:<17} {r['tokens_per_step']:>8} {r['status']}: {r.get('reason', '')[:70]}")
            continue

        spread = f"{r['step_ms_min']:.0f}-{r['step_ms_max']:.0f}"
        print(
            f"{r['config']:<9} {name:<17} {r['tokens_per_step']:>8} {r['step_ms']:>8.0f} {spread:>11} "
            f"{r['tokens_per_s']:>7.0f} {fmt_key(r, 'floor_ms', '6.0f'):>6} {fmt_key(r, 'vs_floor', '6.2f'):>6}x "
            f"{fmt_key(r, 'vs_resident', '6.2f'):>6}x {fmt_key(r, 'gpu_peak_gib', '7.1f'):>7} "
            f"{fmt_key(r, 'host_rss_gib', '8.1f'):>8}"
        )
    print("(+ha: accumulate_on_gpu=False; +sib: step_in_backward=True, no clipping; +all: host_threads = every "
          "core; +keep: reshard_after_forward=False; +hcc: host_compute_copy=True; +spec: speculative_clip=True; +nf: "
          "max_norm 1e9, clipping never fires; +ao: GPU budget = torchao's GPU peak; +cu: clip_in_update=True; "
          "+kl: keep_params_gib=auto and bf16 gradients to the host; x floor / x resident: step time over the floor / "
          "resident step)")


# ------------------------------------------------------------------------------------------------ driver


def out_path(args: argparse.Namespace) -> Path:
    if args.out:
        return Path(args.out)
    return Path(os.environ["OUT"]) / "offload_big.json" if os.environ.get("OUT") else Path("out/offload_big.json")


def write(payload: dict[str, Any], args: argparse.Namespace) -> list[Path]:
    paths = [out_path(args)]
    if args.save:
        from bench.common import results_path

        paths.append(results_path("offload_big", payload["env"].get("gpu_key") or "unknown"))
    for p in paths:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(payload, indent=1, default=str) + "\n")
    return paths


def measure_hardware(args: argparse.Namespace) -> dict[str, Any]:
    cfgs = [MODELS[CONFIGS[c].model] for c in args.config_list]
    n = min(int(args.opt_params), max(m.num_params() for m in cfgs))
    chunk = max(4 * m.dim * m.dim + 3 * m.dim * m.ffn_dim for m in cfgs)  # one decoder block's flat parameter
    job = Job(impl="floor", config=args.config_list[0], device=args.device,
              extra={"opt_params": n, "chunk": chunk, "env_only": bool(args.no_floor),
                     "bw_bytes": int(args.bw_gib * GIB)})  # fmt: skip
    print("== environment only (--no-floor) ..." if args.no_floor else "== floor: copy bandwidth and CPU optimizer ...",
          flush=True)
    return run_child(job, timeout=args.child_timeout or 300)


def resident_extra(config: str, hw: dict[str, Any]) -> dict[str, Any]:
    """Forward + backward only when fp32 weights, gradients and AdamW state (16 B/param) cannot fit the GPU."""
    n = MODELS[CONFIGS[config].model].num_params()
    total = hw.get("gpu_total_gib")
    return {"compute_only": True} if total and 16 * n / GIB + 4 > total else {}


def measure_disk(args: argparse.Namespace) -> dict[str, Any] | None:
    """With ``shardfuse-ssd`` among the implementations: the disk under its directory, and the floors it sets."""
    if "shardfuse-ssd" not in args.impl_list:
        return None
    where = ssd_settings()["ssd_dir"]
    gib = float(os.environ.get("BIG_SSD_PROBE_GIB", "4"))
    bw = disk.measure(where, gib)
    print(f"== disk under {where}: sequential write {bw['write_gbps']:.2f} GB/s, read {bw['read_gbps']:.2f} GB/s "
          f"({bw['probe_bytes'] / GIB:.1f} GiB file, {bw['method']})")
    for c in args.config_list:
        n = MODELS[CONFIGS[c].model].num_params()
        for state in (True, False):
            per = disk.bytes_per_param(state)
            print(f"   {c}: disk floor {disk.floor_ms(n, bw, state) / 1e3:.2f} s per optimizer step ({per} B/param "
                  f"read and written once: fp32 shards{' + AdamW state' if state else ''})", flush=True)
    return bw


def run_all(args: argparse.Namespace, payload: dict[str, Any], hw: dict[str, Any]) -> None:
    rows: list[dict[str, Any]] = payload["results"]
    disk_bw = payload.get("disk")
    todo = plan(args)
    progress = Progress(len(todo), [estimate_s(c, i, args) if unavailable_reason(i, args.device) is None else 0.0
                                    for c, i in todo])  # fmt: skip
    for config, impl in todo:
        job = Job(impl=impl, config=config, steps=args.steps, warmup=args.warmup, lr=args.lr, device=args.device,
                  budget_gib=budget_gib(impl, config, rows, args),
                  extra=resident_extra(config, hw) if impl == "resident" else {})  # fmt: skip
        reason = unavailable_reason(impl, args.device)
        print(progress.line(f"{config} {impl} ..."), flush=True)
        if reason is not None:
            result: dict[str, Any] = {"status": "skipped", "reason": reason}
        else:
            timeout = args.child_timeout or max(150.0, 3 * estimate_s(config, impl, args))
            result = run_child(job, timeout)
        rows.append(make_row(config, impl, job, result))
        if impl == "resident":
            floor = config_floor(config, hw, result)
            payload["floors"][config] = floor
            print_row(rows[-1])
            print_config_floor(floor)
        if config in payload["floors"]:  # not with --no-floor
            add_ratios(rows, payload["floors"][config], disk_bw)
        vs_torchao(rows, config)
        if impl != "resident":
            print_row(rows[-1])
        write(payload, args)


def merge(paths: list[str], args: argparse.Namespace) -> None:
    """One result from the files of several calls on the same GPU model (split to fit a command's time limit).

    Each configuration's rows keep the floor of the call that measured them (the resident run is in every call);
    a (config, impl, variant) measured twice keeps the later file's row; the environment (commit, host) is the
    last file's, ``merged_from`` lists each file's commit, and each row gets its own file's commit, date and host
    core count (``commit``, ``date``, ``host_cores``) where it has none.
    """
    files = [json.loads(Path(p).read_text()) for p in paths]
    gpus = {f.get("env", {}).get("gpu_name") for f in files}
    if len(gpus) > 1:
        sys.exit(f"--merge: the files come from different GPUs {sorted(map(str, gpus))}: merge only one GPU's runs")
    rows: dict[tuple[str, str, str], dict[str, Any]] = {}
    for f in files:
        for r in f.get("results", []):
            r.setdefault("commit", f.get("env", {}).get("commit"))
            r.setdefault("date", f.get("env", {}).get("date"))
            r.setdefault("host_cores", (f.get("host") or {}).get("cpu_count"))  # hosts differ in CPU optimizer speed
            rows[(r["config"], r["impl"], r.get("variant", ""))] = r
    payload = dict(files[-1])
    payload.update(results=list(rows.values()), merged_from=[{"path": p, "commit": f.get("env", {}).get("commit"),
                   "hardware_floor": f.get("hardware_floor")} for p, f in zip(paths, files)])  # fmt: skip
    payload["floors"] = {k: v for f in files for k, v in f.get("floors", {}).items()}
    payload["disk"] = next((f["disk"] for f in reversed(files) if f.get("disk")), None)  # the SSD rows' disk probe
    written = write(payload, args)
    print_table(payload["results"])
    print(f"merged {len(paths)} files into {', '.join(map(str, written))}", flush=True)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.merge:
        merge(args.merge, args)
        return
    todo = plan(args)
    print_plan(todo, args)
    if args.estimate:
        return
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench.offload.big needs a CUDA GPU for the real run, and none is visible here; "
                 "`--device cpu --configs tiny,tiny-acc` runs the plumbing on a tiny model")  # fmt: skip
    t0 = time.perf_counter()
    hw = measure_hardware(args)
    print_hw_floor(hw)
    payload: dict[str, Any] = {
        "kind": "offload_big",
        "env": hw.get("env", {}),
        "host": hw.get("host", {}),
        "hardware_floor": {k: v for k, v in hw.items() if k not in ("env", "host")},
        "config": {"configs": {c: vars(CONFIGS[c]) for c in args.config_list}, "impls": args.impl_list,
                   "steps": args.steps, "warmup": args.warmup, "lr": args.lr, "budget_gib": args.budget_gib,
                   "device": args.device, "step_ms": "median of the timed optimizer steps",
                   "gpu_peak": "max_memory_allocated from after setup to the last step",
                   "host_rss": "the measurement process's peak RSS (VmHWM)", "floor_bytes": FLOOR_BYTES},
        "floors": {},
        "results": [],
    }  # fmt: skip
    payload["disk"] = measure_disk(args)
    run_all(args, payload, hw)
    payload["wall_s"] = time.perf_counter() - t0
    paths = write(payload, args)
    print_table(payload["results"])
    print(f"wrote {', '.join(map(str, paths))} ({payload['wall_s']:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
