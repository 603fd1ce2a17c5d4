"""The page's section of an ``offload_big.json`` (``bench.offload.big``): models that outgrow the GPU."""

from __future__ import annotations

import subprocess
from pathlib import Path

from bench.report._common import (
    DASH,
    OFFLOAD_BIG_LABEL,
    OFFLOAD_BIG_ORDER,
    OFFLOAD_BIG_SHORT,
    env_line,
    fmt,
    notes_block,
    table,
)
from bench.results_io import OffloadBigFile, OffloadBigFloor, OffloadBigRow, Result

BOUND_LABEL = {"compute_ms": "GPU compute", "pcie_ms": "PCIe", "cpu_opt_ms": "the CPU optimizer"}
HEADER = ["implementation", "step ms", "vs floor", "vs resident", "tokens/s", "GPU peak GiB", "host RSS GiB",
          "host B/param", "status"]  # fmt: skip
ALIGN = ["l", "r", "r", "r", "r", "r", "r", "r", "l"]
VS_TORCHAO = "speed vs torchao"
REPO = Path(__file__).resolve().parents[2]
# Changes to a variant's code path made after rows of it were measured: (part of the variant, commit, what changed).
# A row measured before the commit gets a note saying so (its numbers are what the code gave then) until a newer
# measurement replaces it.
PATH_CHANGES = (
    ("step-in-backward", "ebce2e1", "under step_in_backward, step() no longer waits for the updates queued during "
     "backward: they overlap the next forward"),
)  # fmt: skip


def params_text(n: float | None) -> str:
    """``2.9B`` (one decimal, billions), or ``?`` when not recorded."""
    return "?" if n is None else f"{n / 1e9:.1f}B"


def row_label(r: OffloadBigRow) -> str:
    """The implementation's label, with its GPU budget (shardfuse-budget) and its variant (in parentheses)."""
    label = OFFLOAD_BIG_LABEL.get(r.impl, r.impl)
    if r.impl == "shardfuse-budget" and r.gpu_budget_gib is not None:
        label += f" {r.gpu_budget_gib:g} GiB"
    return f"{label} ({r.variant})" if r.variant else label


def ordered_rows(rows: list[OffloadBigRow]) -> list[OffloadBigRow]:
    """Rows by OFFLOAD_BIG_ORDER (others after, by name), each implementation's plain row before its variants."""
    rank = {impl: i for i, impl in enumerate(OFFLOAD_BIG_ORDER)}
    pos = {id(r): i for i, r in enumerate(rows)}
    return sorted(rows, key=lambda r: (rank.get(r.impl, len(rank)), r.impl, r.variant is not None, pos[id(r)]))


def ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def config_title(f: OffloadBigFile, config: str) -> str:
    """``2.9b-4k: 2.9B parameters, 4,096 tokens per step`` (batch x seq, micro-batches) from the file's rows."""
    rows = f.rows_of(config)
    floor = f.floors.get(config)
    n = next((r.params for r in rows if r.params), floor.params if floor else None)
    r0 = next((r for r in rows if r.tokens_per_step), None)
    if r0 is None:
        return f"`{config}`: {params_text(n)} parameters"
    shape = f"batch {r0.batch} x seq {r0.seq}" if r0.batch and r0.seq else ""
    if r0.micro_batches and r0.micro_batches > 1:
        shape += f"{', ' if shape else ''}{r0.micro_batches} micro-batches accumulated"
    return f"`{config}`: {params_text(n)} parameters, {r0.tokens_per_step:,} tokens per step" + (
        f" ({shape})" if shape else ""
    )


def floor_line(floor: OffloadBigFloor | None, floor_ms: float | None) -> str:
    if floor is None:
        return f"Floor: {fmt(floor_ms, '.0f', ' ms')} (its terms are not recorded)."
    pcie = fmt(floor.pcie_ms, ".0f", " ms")
    if floor.h2d_ms is not None and floor.d2h_ms is not None:
        pcie += f" (in {floor.h2d_ms:.0f} ms, out {floor.d2h_ms:.0f} ms)"
    bound = BOUND_LABEL.get(floor.bound or "", floor.bound)
    return (
        f"Floor {fmt(floor_ms, '.0f', ' ms')} = max(GPU compute {fmt(floor.compute_ms, '.0f', ' ms')}, "
        f"PCIe {pcie}, CPU optimizer {fmt(floor.cpu_opt_ms, '.0f', ' ms')})"
        + (f": bound by {bound}." if bound else ".")
    )


def _table(f: OffloadBigFile, config: str) -> list[str]:
    floor_ms = f.floor_ms(config)
    resident = f.step_ms(config, "resident")
    torchao = f.step_ms(config, "torchao")  # a "speed vs torchao" column where this job measured torchao
    header, align = (HEADER[:-1] + [VS_TORCHAO, HEADER[-1]], ALIGN[:-1] + ["r", "l"]) if torchao else (HEADER, ALIGN)
    body, notes = [], []
    for r in ordered_rows(f.rows_of(config)):
        label = row_label(r)
        if not r.measured:
            body.append([label, *[DASH] * (len(header) - 2), r.status])  # the status, not partial numbers
            extra = f" (forward+backward {r.fwd_bwd_ms:.0f} ms)" if r.fwd_bwd_ms else ""
            notes.append(f"{label}: {r.status}: {r.reason or 'no measurement'}{extra}")
            continue
        spread = ""
        if r.step_ms_min is not None and r.step_ms_max is not None:
            spread = f" ({r.step_ms_min:.0f}-{r.step_ms_max:.0f})"
        body.append(
            [
                label,
                fmt(r.step_ms, ".0f") + spread,
                fmt(ratio(r.step_ms, r.floor_ms or floor_ms), ".2f", "x"),  # its own call's floor (merged files)
                fmt(ratio(r.step_ms, resident), ".2f", "x"),
                fmt(r.tokens_per_s or ratio(r.tokens_per_step, (r.step_ms or 0) / 1e3), ",.0f"),
                fmt(r.gpu_peak_gib, ".1f"),
                fmt(r.host_rss_gib, ".1f"),
                # the fp32 optimizer's minimum is 16 (parameter, gradient, two moments)
                fmt(ratio(r.host_rss_gib * 2**30, r.params) if r.host_rss_gib else None, ".1f"),
                *([fmt(ratio(torchao, r.step_ms), ".2f", "x")] if torchao else []),
                r.status,
            ]
        )
        if r.disk_floor_ms:
            notes.append(_ssd_note(label, r))
        notes.extend(_change_notes(label, r, r.commit or f.env.commit))
    if torchao:
        notes.append(f"{VS_TORCHAO}: torchao's step time over the row's, same job (above 1.00x: faster than "
                     "torchao); torchao cannot clip, so its row trains without clipping")
    return [*table(header, body, align), "", *notes_block(notes)]


def predates(measured: str | None, change: str, repo: Path = REPO) -> bool:
    """Whether commit ``measured`` lacks commit ``change`` (git; False where git cannot tell: an unknown commit,
    no history)."""
    if not measured:
        return False
    try:
        run = subprocess.run(["git", "merge-base", "--is-ancestor", change, measured], cwd=repo,
                             capture_output=True, timeout=30, check=False)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return False
    return run.returncode == 1  # 0: it has the change; 128: git cannot tell


def _change_notes(label: str, r: OffloadBigRow, commit: str | None) -> list[str]:
    return [f"{label}: measured at {commit}, before {change} ({what}); not measured since"
            for part, change, what in PATH_CHANGES
            if r.variant and part in r.variant and predates(commit, change)]  # fmt: skip


def _ssd_note(label: str, r: OffloadBigRow) -> str:
    """What an SSD row is judged against and what its tier moved."""
    moved = ""
    if r.ssd_read_gb_per_step is not None and r.ssd_written_gb_per_step is not None:
        moved = f"; it read {r.ssd_read_gb_per_step:.1f} GB and wrote {r.ssd_written_gb_per_step:.1f} GB per step"
    mode = f" ({r.ssd_io_mode} I/O)" if r.ssd_io_mode else ""
    return (f"{label}: vs floor is against the disk floor {r.disk_floor_ms / 1e3:.2f} s (every byte it keeps on "
            f"disk read and written once per step at the disk's measured bandwidth){moved}{mode}; worst step "
            f"{fmt(ratio(r.step_ms_max, r.disk_floor_ms), '.2f', 'x')} the disk floor")


def _setup_lines(f: OffloadBigFile) -> list[str]:
    lines = []
    others = ", ".join(f"{k} {v}" for k, v in f.versions.items())
    host = f.host
    if others or host:
        text = f"Other implementations: {others}." if others else ""
        if host.get("cpu_count"):
            text += f" Host: {host['cpu_count']} cores"
            text += f" ({host['affinity_cores']} in the process's affinity set)" if host.get("affinity_cores") else ""
            text += f", {host['torch_threads']} torch threads." if host.get("torch_threads") else "."
        lines += [text.strip(), ""]
    if f.merged_from:
        lines += [f"Joined from {len(f.merged_from)} runs (`--merge`), at commits "
                  + ", ".join(f"`{c}`" for c in f.merged_from) + ".", ""]  # fmt: skip
    steps = f"{f.steps} timed steps after {f.warmup} warm-up" if f.steps is not None else "timed steps"
    lines += [
        f"Setup: one GPU, each implementation in its own process; step ms = "
        f"{f.how.get('step_ms', 'median of the timed optimizer steps')} ({steps}), min-max in parentheses; "
        f"GPU peak = {f.how.get('gpu_peak', 'max_memory_allocated')}; "
        f"host RSS = {f.how.get('host_rss', 'the process peak RSS')}.",
        "",
    ]
    return lines


def _hardware_line(f: OffloadBigFile) -> list[str]:
    hw = f.hardware
    parts = []
    if hw.h2d_gbps is not None or hw.d2h_gbps is not None:
        buf = f" ({hw.bw_bytes / 2**30:.1f} GiB buffer)" if hw.bw_bytes else ""
        parts.append(f"pinned host->device {fmt(hw.h2d_gbps, '.1f', ' GB/s')}, device->host "
                     f"{fmt(hw.d2h_gbps, '.1f', ' GB/s')}{buf}")  # fmt: skip
    if hw.opt_s_per_param is not None:
        meta = [f"measured on {hw.opt_params_measured / 1e9:.2f}B parameters"] if hw.opt_params_measured else []
        meta += [f"{hw.opt_threads} threads"] if hw.opt_threads else []
        tail = f" ({', '.join(meta)})" if meta else ""
        what = hw.opt_impl or "the CPU optimizer"
        parts.append(f"{what}: {hw.opt_s_per_param * 1e12:.0f} ms per billion parameters{tail}")
        if hw.host_copy_gbps is not None:
            # AdamW reads parameter, gradient and two moments and writes three of them: 28 bytes per parameter.
            parts.append(f"host memory {hw.host_copy_gbps:.0f} GB/s read+write (torch copy), against which the "
                         f"optimizer's 28 bytes per parameter run at {28 / hw.opt_s_per_param / 1e9:.0f} GB/s: it is "
                         f"bound by host memory bandwidth, which the PCIe copies of an offloaded step share")
    disk = f.disk
    if disk.get("read_gbps") and disk.get("write_gbps"):
        size = f", {disk['probe_bytes'] / 2**30:.1f} GiB file" if disk.get("probe_bytes") else ""
        parts.append(f"the disk under the SSD rows' directory: sequential write {disk['write_gbps']:.2f} GB/s, read "
                     f"{disk['read_gbps']:.2f} GB/s ({disk.get('method') or 'method not recorded'}{size})")
    if not parts:
        return ["_Floor terms: not measured in this file._", ""]
    lines = ["Floor terms measured in this job: " + "; ".join(parts) + "."]
    if f.how.get("floor_bytes"):
        lines.append(f"Bytes over PCIe per optimizer step: {f.how['floor_bytes']}.")
    return [" ".join(lines), ""]


FOOTNOTE = (
    "_vs floor / vs resident: the step time over the configuration's floor / over the resident step (lower is "
    "better). The floor is that of a full offload, max(GPU compute, PCIe bytes / bandwidth, CPU optimizer time): a "
    "GPU budget keeps part of the model resident and can go below it. Every row clips gradients at 1.0 except those "
    'marked "no clipping"._'
)


def offload_big_section(res: Result) -> list[str]:
    f = res.offload_big()
    lines = [f"### Offload of models that outgrow the GPU (`{res.name}.json`)", "", env_line(res.env), ""]
    lines += _setup_lines(f) + _hardware_line(f)
    if not f.configs:
        return [*lines, "No rows in this file.", ""]
    for config in f.configs:
        lines += [f"#### {config_title(f, config)}", "", floor_line(f.floors.get(config), f.floor_ms(config)), ""]
        lines += _table(f, config)
    return [*lines, FOOTNOTE, ""]


# ------------------------------------------------------------------------------------------------ README rows

README_BENCH = "offload of a model that outgrows the GPU"
# The README's fixed columns after shardfuse's (FairScale, one GPU, FSDP2, FSDP1) and the implementations in them.
README_COLUMNS = ("fairscale", "resident", "fsdp2", None)
README_OURS = ("shardfuse", "shardfuse-budget", "shardfuse-ssd")  # un-varianted rows only (variants: the page)
README_VS = ("fairscale", "fsdp2", "deepspeed-zero2", "deepspeed-zero3")  # ratio order in shardfuse's cell
README_DS = {"deepspeed-zero2": "ZeRO-2", "deepspeed-zero3": "ZeRO-3"}  # named after "DeepSpeed" once
README_NOTE = (
    f' Rows "{README_BENCH}" (`bench.offload.big`, one GPU, each implementation in its own process): median '
    "step ms; in parentheses shardfuse's step time over the configuration's floor max(GPU compute, PCIe bytes / "
    "bandwidth, CPU optimizer time), over the resident step on one GPU (with its GPU peak over the resident one) "
    "and over each other implementation's (lower is better); FairScale = its FSDP with `move_params_to_cpu`, "
    "FSDP2 = `fully_shard` + `CPUOffloadPolicy`; a status (oom, skipped, error; compute-only: the resident model "
    "does not fit) stands where a row has no step time."
)


def _cell(r: OffloadBigRow | None) -> str:
    """A step time for a README column: the ms, the row's status when it has no time, a dash when absent."""
    if r is None:
        return DASH
    return fmt(r.step_ms, ".0f") if r.measured else r.status


def _ours_cell(f: OffloadBigFile, config: str, ours: OffloadBigRow) -> str:
    if not ours.measured:
        return ours.status
    step = ours.step_ms
    parts = []
    if (x := ratio(step, ours.floor_ms or f.floor_ms(config))) is not None:
        parts.append(f"{x:.2f}x {'disk ' if ours.disk_floor_ms else ''}floor")
    if ours.disk_floor_ms and ours.host_rss_gib:
        parts.append(f"{ours.host_rss_gib:.1f} GiB host memory")
    resident = f.find(config, "resident")
    if resident is not None and resident.measured:
        mem = ratio(ours.gpu_peak_gib, resident.gpu_peak_gib)
        parts.append(f"{ratio(step, resident.step_ms):.2f}x one GPU" + (f", {mem:.2f}x its GPU peak" if mem else ""))
    vs = []
    for impl in README_VS:
        other = f.find(config, impl)
        if other is not None and other.measured:
            name = README_DS.get(impl, OFFLOAD_BIG_SHORT.get(impl, impl))
            first_ds = impl in README_DS and not any(impl2 in README_DS for impl2, _ in vs)
            vs.append((impl, f"{ratio(step, other.step_ms):.2f}x {'DeepSpeed ' if first_ds else ''}{name}"))
    vs_text = [text for _, text in vs]
    parts += [", ".join(vs_text)] if vs_text else []
    return fmt(step, ".0f") + (f" ({'; '.join(parts)})" if parts else "")


def _metric(f: OffloadBigFile, config: str, ours: OffloadBigRow) -> str:
    extra = []
    floor = ours.floor_ms or f.floor_ms(config)  # the floor measured in the call that measured this row
    if floor is not None:
        extra.append(f"{'disk ' if ours.disk_floor_ms else ''}floor {floor:.0f}")
    ds = [(name, r) for impl, name in README_DS.items() if (r := f.find(config, impl)) is not None]
    if ds:
        extra.append("DeepSpeed " + ", ".join(f"{name} {_cell(r)}" for name, r in ds))
    return "step ms" + (f" ({'; '.join(extra)})" if extra else "")


def readme_rows(gpu: str, res: Result) -> list[list[str]]:
    """README rows of an offload_big file: per configuration, shardfuse's and shardfuse-budget's plain rows."""
    f = res.offload_big()
    rows = []
    for config in f.configs:
        r0 = next((r for r in f.rows_of(config) if r.tokens_per_step), None)
        floor = f.floors.get(config)
        n = next((r.params for r in f.rows_of(config) if r.params), floor.params if floor else None)
        bench = f"{README_BENCH}, {params_text(n)}"
        if r0 is not None:
            bench += f", {r0.tokens_per_step} tokens/step"
            bench += f" ({r0.micro_batches} micro-batches)" if r0.micro_batches and r0.micro_batches > 1 else ""
        others = [_cell(f.find(config, impl)) if impl else DASH for impl in README_COLUMNS]
        for impl in README_OURS:
            ours = f.find(config, impl)
            if ours is None:
                continue
            what = bench
            if impl == "shardfuse-budget":
                budget = f" {ours.gpu_budget_gib:g} GiB" if ours.gpu_budget_gib is not None else ""
                what += f", GPU budget{budget} (shardfuse-budget)"
            elif impl == "shardfuse-ssd":
                what += ", shards and optimizer state on SSD (shardfuse-ssd)"
            rows.append([gpu.upper(), what, _metric(f, config, ours), _ours_cell(f, config, ours), *others])
    return rows
