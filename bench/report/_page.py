"""The whole benchmarks page: the sections of every result file, how the numbers are made, the regression check."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.report._attribution import attribution_section
from bench.report._capture import overlap_section
from bench.report._common import anchor, gpu_label
from bench.report._e2e import e2e_section
from bench.report._host_step import host_step_section
from bench.report._kernels import kernels_section
from bench.report._models import DECODER_KIND, HF_LLAMA_KIND, e2e_models
from bench.report._offload import offload_section
from bench.report._offload_big import offload_big_section
from bench.report._plots import Plotter
from bench.report._readme import summary_table
from bench.report._scale import scale_section
from bench.report._spec_finetune import spec_finetune_section
from bench.results_io import Result

HOW_MEASURED = """\
## How these numbers are made

- `python -m bench.kernels.run`: every kernel family against the PyTorch sequences it replaces, at several sizes,
  with the GPU's own device-copy bandwidth measured in the same run (medians of CUDA-event timings; since
  2026-11-28 each case in 3 rounds with the implementations interleaved, the row the median of the rounds).
- `torchrun ... -m bench.e2e.run`: a Llama-style decoder trained with shardfuse, shardfuse with its whole
  step captured by `capture_step` into one CUDA graph and replayed (`shardfuse-graph`), FSDP2 `fully_shard`,
  FSDP1 (and FairScale when installed, and `shardfuse-ref`, shardfuse at an older commit built by
  `bench/e2e/make_ref.sh`), one after another in the same job, every decoder layer one sharded unit plus the
  root; two regimes per GPU: 8K tokens (batch 4 x seq 2048) and 1K tokens (batch 1 x seq 1024). With
  `--rounds N` the job runs every implementation once per round, N rounds interleaved, and the tables give
  medians over the rounds with their spread and ratios of those medians (files without rounds list one run).
  Step time is the max over ranks of the mean step time (forward, backward and optimizer step, synchronised
  before and after each step); tokens/s/GPU follows from it; MFU = (6 x matmul parameters x tokens + causal
  attention flops) / (step time x the dense bf16 peak named in the setup line); peak memory is
  `torch.cuda.max_memory_allocated` from after wrapping to the last step, max over ranks.
- `python -m bench.offload.run`: one GPU trains a model kept in host memory with shardfuse's `OffloadModel`,
  FairScale's `OffloadModel` (when installed) and FSDP2 with `CPUOffloadPolicy`, against the same model
  resident on the GPU. Host<->device GB/s is bytes copied per step divided by the step time: counted by
  `OffloadModel.transfer_stats()` for shardfuse, estimated from the parameter traffic for the others.
- `python -m bench.offload.big` (gpu_suite stage `offload-big`, `offload_big.json`): models that outgrow the GPU
  (the decoder at 2.9B parameters, 4096 and 32768 tokens per optimizer step, the latter 8 accumulated
  micro-batches; the 6.7B Llama-2-7B shape at 2048) trained on one GPU by the resident model (bf16 autocast, fused
  AdamW on the GPU), shardfuse `move_params_to_cpu` (full offload, and `shardfuse-budget` with a GPU budget),
  FairScale, FSDP2 `CPUOffloadPolicy` and DeepSpeed ZeRO-2 / ZeRO-3 offload, all clipping gradients at 1.0 (but
  the extra shardfuse rows marked "step-in-backward, no clipping"), each in its own process (its own GPU peak,
  `max_memory_allocated` after setup, and host peak RSS; a crash or memory kill ends only that row). Step time is
  the median of 3 synchronised optimizer steps after a warm-up, with the spread.
  Each row is held against its configuration's floor, max(GPU compute, PCIe, CPU optimizer), measured in the same
  job: GPU compute = the resident step's forward + backward (on bf16 weights when the fp32 model and its AdamW
  state do not fit); PCIe = bf16 parameters in (2 bytes/parameter) and fp32 gradients out (4 bytes/parameter)
  once per optimizer step at the measured pinned host->device and device->host bandwidths, the two directions
  overlapped; CPU optimizer = torch's fused CPU AdamW seconds per parameter (measured on up to 1B fp32 parameters
  in block-sized tensors, thread count recorded) times the parameter count. A configuration that does not fit
  one 10-minute command is split by `--impls` and the files joined with `--merge`. The stored H100 file has the
  shardfuse rows at HEAD; FairScale, FSDP2 and shardfuse side by side in one job (at 6bfddd1, on another H100 host
  whose CPU optimizer and PCIe were slower: floor 917 ms) are in
  `bench/results/logs/h100-offload-big-4k-side-by-side-6bfddd1.json.txt`: shardfuse 1500 ms, FairScale 4615,
  FSDP2 4990 (DeepSpeed did not finish within the command in either call).
- `python -m bench.scale --gpus 8,64,512 [--model 953m|7b|70b]`: a model, not a measurement, of flat vs hybrid
  sharding to 512 GPUs (ring alpha-beta collectives, compute, AdamW and host enqueue time, calibrated on the
  2-GPU H200 runs above; its 2-GPU predictions are within 15% of them): formula, validation, the 8/64/512
  tables and plots in [scale.md](scale.md), numbers in `bench/results/scale_model.json`; `--model 8b --wire fp8`:
  the fp8 all-gather's predicted effect on Llama-3-8B at 8K tokens per GPU against the bf16 one (scale.md, "The
  fp8 all-gather on the wire"; `bench/results/scale_model_8b_fp8.json`).
- `torchrun ... -m bench.e2e.host_profile` (gpu_suite stage `host-profile`): where an eager step's time goes on
  the host, the decoder at 1K tokens per GPU: each implementation's host enqueue time against its synchronised
  step (close together: the step is host-bound) and a cProfile of rank 0. Last run on 2xH200:
  `bench/results/logs/h200x2-host-profile.log`.
- `bash bench/gpu_suite.sh capture-table` (issue 31's table: `e2e_capture_<N>gpu.json`, `e2e_capture_hf_<N>gpu.json`,
  `e2e_capture_sft_<N>gpu.json`, `overlap_captured_<N>gpu.json`): 1K tokens per GPU, fused AdamW, `CT_ROUNDS`
  interleaved rounds, each part its own process under `timeout`. The decoder and HF Llama with the one-GPU step
  captured by `capture_step` (`baseline-graph`, the host-free limit: column *vs one GPU captured*), shardfuse eager
  and captured, FairScale (decoder, when installed) and FSDP2 with per-layer `torch.compile` (`fsdp2-compile`); the
  many-shape SFT regime (`bench.e2e.sft`: the loop of `examples/sft_buckets.py`, HF Llama 1B, variable lengths padded
  to 4 buckets, one graph per bucket, eager and captured on the same batches; tokens/s/GPU count real tokens, and the
  page says whether the two loops' losses are equal); and the captured step's profile (`bench.e2e.overlap --captured
  --baseline`): one replay's kernels from CUPTI, communication told apart by kernel name, split into compute,
  exposed communication and idle time, and the gap to the one-GPU captured step split the same way. Rows measured
  on a loaded host carry `host_load` (`bench/host_load.py`), are marked under their table, and the planner's
  accuracy check skips them.
- `bash bench/gpu_suite.sh` runs the GPU tests and all three on one machine (results under
  `$OUT/work/results/<gpu>/`, packed in `$OUT/suite.tgz`). Run alone, each runner writes
  `bench/results/<gpu>/<name>.json`; this page is rendered from those files by `python -m bench.report`, and
  `python -m bench.regress NEW.json` compares a new training or offload result with the stored one (see
  [Regression check](#regression-check) below).
"""

# Inserted into HOW_MEASURED after the e2e bullet, for the models whose files are shown (see ``how_measured``):
# by (model_kind, config name), None for any config.
_HF_LLAMA_HOW = (
    "`--model hf-llama` (`e2e_hf_<N>gpu.json`) trains Hugging Face `transformers.LlamaForCausalLM` built with its "
    "own random init from a `LlamaConfig` (`bench` config: 852.6M parameters, 16 layers, hidden 2048, 16 query "
    "heads sharing 4 key/value heads, SDPA attention), every `LlamaDecoderLayer` one sharded unit"
)
_DECODER_7B_HOW = (
    "`--config 7b` (`e2e_7b_<N>gpu.json`) trains the decoder in the shape of Llama-2-7B (6.7B parameters: dim 4096, "
    "32 layers, 32 heads, ffn 11008) at 4K tokens per GPU (batch 1 x seq 4096), which `bench/gpu_suite.sh` runs "
    "without the one-GPU baseline (`--no-baseline`: fp32 weights, gradients and AdamW state alone are 108 GB)"
)
HOW_MEASURED_MODELS: dict[tuple[str, str | None], str] = {
    (HF_LLAMA_KIND, None): _HF_LLAMA_HOW,
    (DECODER_KIND, "7b"): _DECODER_7B_HOW,
}
HOW_MEASURED_AFTER = "- `python -m bench.offload.run`"


def how_measured(results: dict[str, list[Result]]) -> str:
    """HOW_MEASURED, with a bullet on the other models of ``bench.e2e.run`` when their files are shown."""
    shown = [(m.kind, m.config) for m in e2e_models(results)]
    said = [
        text
        for (kind, config), text in HOW_MEASURED_MODELS.items()
        if (kind, config) in shown or config is None and any(k == kind for k, _ in shown)
    ]
    if not said:
        return HOW_MEASURED
    bullet = f"- {'; '.join(said)}: the same implementations, measurements and ratios as the decoder's.\n"
    if HOW_MEASURED_AFTER not in HOW_MEASURED:
        raise ValueError(f"HOW_MEASURED has no line {HOW_MEASURED_AFTER!r} to put the models' bullet before")
    return HOW_MEASURED.replace(HOW_MEASURED_AFTER, bullet + HOW_MEASURED_AFTER, 1)


REGRESSION_NOTE = """\
## Regression check

`python -m bench.regress NEW.json` compares a fresh end-to-end or offload result file (`offload.json`,
`offload_big.json`) with the stored file of the same name for the same GPU (`bench/results/<gpu>/<name>.json`,
the GPU taken from the new file's `env.gpu_key`) and exits with status 1 when a shardfuse time (training step
time, offload step time) is slower by more than the noise band (`--noise`, default 5%), when a shardfuse row's
peak GPU memory (in `offload_big.json` also its host RSS) grew by 10% or more (`--mem-growth`), or when a
shardfuse row measured before now failed.
The other implementations are listed for context only: when FSDP2 slowed down by the same amount,
the machine changed, not shardfuse (the check prints a note when their median changed beyond the band).
`--baseline OLD.json` compares with a given file; `python -m bench.report --compare NEW.json` runs the same
check; `bash bench/gpu_suite.sh` runs it on every e2e and offload file it writes (stage `regress`).

Kernel regressions go through pytest-benchmark's own storage and compare: the suite's `kernels-pb` stage
runs `bench/kernels/test_bench_kernels.py` with `--benchmark-autosave`, and with `--benchmark-compare
--benchmark-compare-fail median:10%` against the newest run stored for that GPU in
`bench/results/<gpu>/pytest-benchmark/` (copy the run it saved under `$OUT/work/pytest-benchmark/` there to
make it the new reference).

Before/after on one machine (issue 19's "within noise of before, same job, interleaved"): `python -m bench.ab
--before DIR --after DIR --rounds 3 --bench e2e,offload --out ab.json` runs the one-GPU e2e (1k regime, shardfuse)
and offload (`plain`, `shardfuse`, `shardfuse_offload_acts_opt_in_bwd`) benchmarks from two source trees, each
run in its own process with `PYTHONPATH` and the working directory set to its tree (the run checks that
`shardfuse` was imported from there), the tree that goes first alternating per round. It prints per row the
median of each tree, after / before, each tree's min-max over rounds and PASS, FAIL or BETTER against the noise
threshold (10% step time, 5% peak memory; `plain` touches no shardfuse code and shows the machine's own noise),
and writes both trees' commits, every run and the comparison to the JSON; exit status 1 on a FAIL or a failed
run. On a GPU machine: extract the old tree with `mkdir .before && git archive COMMIT | tar -x -C .before && echo
COMMIT > .before/COMMIT`, carry `.before/` and run `SHARDFUSE_COMMIT=<this commit> bash bench/gpu_suite.sh ab`
(about 6-7 minutes on one H100; `$OUT/ab.json`, one log per run in the archive's `ab_logs/`).
"""


NOTES_HEADING = "### Where these rows come from"
NOTES_FILE = "NOTES.md"  # beside the <gpu>/ folders: what the files cannot say (calls joined, changes since)

HEADER = [
    "# Benchmark results",
    "",
    "<!-- Generated by `python -m bench.report` from bench/results/<gpu>/*.json: edit the script, not this file. -->",
    "",
]
NO_RESULTS = [
    "No benchmark results are stored yet: `bench/results/` holds no `<gpu>/*.json` files.",
    "",
    "Run `bash bench/gpu_suite.sh` on a GPU machine (or the runners one by one, see below), copy the JSON "
    "files it writes into `bench/results/<gpu>/`, and run `python -m bench.report` to render this page.",
    "",
]


def other_section(res: Result) -> list[str]:
    why = res.problem or "not written by a known benchmark runner"
    return [f"- `{res.gpu}/{res.path.name}`: not shown ({why})."]


def gpu_section(gpu: str, rs: list[Result], plots: Plotter, out_dir: Path) -> list[str]:
    """One GPU folder's heading and the section of each of its files."""
    lines = [f"## {gpu_label(gpu, rs)}", ""]
    others: list[str] = []
    for r in rs:
        if r.kind == "e2e":
            lines += e2e_section(r, plots, out_dir)
        elif r.kind == "kernels":
            lines += kernels_section(r, plots, out_dir)
        elif r.kind == "offload":
            lines += offload_section(r, plots, out_dir)
        elif r.kind == "offload_big":
            lines += offload_big_section(r)
        elif r.kind == "host_step":
            lines += host_step_section(r)
        elif r.kind == "spec_finetune":
            lines += spec_finetune_section(r)
        elif r.kind == "overlap":
            lines += overlap_section(r)
        elif r.kind == "offload_attribution":
            note = r.path.with_suffix(".md")
            lines += attribution_section(r, note.read_text(encoding="utf-8") if note.exists() else None)
        else:
            others += other_section(r)
    if others:
        lines += ["Other files in this folder:", "", *others, ""]
    return lines


def render(results: dict[str, list[Result]], out_path: Path, plots: Plotter,
           scale: dict[str, Any] | None = None, notes: str | None = None) -> str:
    """The whole ``benchmarks.md`` text (``scale``: the scale model's file, when there is one; ``notes``: the
    provenance of the stored rows, ``NOTES.md`` beside the result folders, shown under the summary)."""
    lines = list(HEADER)
    if not results:
        return "\n".join([*lines, *NO_RESULTS, HOW_MEASURED, REGRESSION_NOTE])
    lines += ["Results by GPU architecture:", ""]
    for gpu, rs in results.items():
        label = gpu_label(gpu, rs)
        lines.append(f"- [{label}](#{anchor(label)}): " + ", ".join(f"`{r.name}`" for r in rs))
    lines.append("")
    if not plots.available:
        lines += [f"_Plots were skipped: {plots.reason}._", ""]
    lines += ["## Summary", ""] + summary_table(results, link=None) + [""]
    if notes and notes.strip():
        lines += [NOTES_HEADING, "", notes.strip(), ""]
    for gpu, rs in results.items():
        lines += gpu_section(gpu, rs, plots, out_path.parent)
    if scale is not None:
        lines += scale_section(scale)
    lines += [how_measured(results), REGRESSION_NOTE]
    return "\n".join(lines)
