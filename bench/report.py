"""Render the stored benchmark results as ``docs/benchmarks.md`` (tables and PNG plots) and a README summary.

    python -m bench.report                            # docs/benchmarks.md + docs/img/*.png from bench/results
    python -m bench.report --results DIR --out FILE --img-dir DIR      # other places (e.g. a scratch copy)
    python -m bench.report --summary                  # print only the short README table
    python -m bench.report --readme README.md         # also rewrite the README's results table
    python -m bench.report --compare NEW.json         # regression check of an e2e/offload file, see bench.regress

Run from the repository root (``python -m`` puts it on ``sys.path``).

Inputs are the JSON files the benchmark runners write through ``bench.common.write_result``, one folder per
GPU architecture: ``bench/results/<gpu>/kernels.json`` (``bench.kernels.run``),
``bench/results/<gpu>/e2e_<N>gpu.json`` (``bench.e2e.run``; ``e2e_hf_<N>gpu.json`` and ``e2e_7b_<N>gpu.json`` for
its other models, named in their rows and sections from the file's ``config.model_kind`` and ``config.model``,
see ``e2e_model``) and ``bench/results/<gpu>/offload.json`` (``bench.offload.run``), read through
``bench.results_io``. Every file carries an ``"env"`` entry (GPU, versions, date, commit) that is printed above
each table. Missing files and keys are tolerated; with no results at all the page says so.

The README table goes between the lines ``<!-- results:start -->`` and ``<!-- results:end -->``; a README
that has neither marker but a line that is exactly ``RESULTS_TABLE`` gets that line replaced by the
markers and the table, so the next run finds the markers.

Plots need matplotlib (``pip install -e .[plot]``); without it the page is written without them and says
so. Only the standard library is needed otherwise (no torch import), so the report runs anywhere.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import statistics
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.results_io import DEFAULT_RESULTS, REPO, Result, e2e_summary, load_results

DEFAULT_OUT = REPO / "docs" / "benchmarks.md"
DEFAULT_IMG = REPO / "docs" / "img"

START_MARK = "<!-- results:start -->"
END_MARK = "<!-- results:end -->"
PLACEHOLDER = "RESULTS_TABLE"

# Display order and names of the end-to-end implementations (bench/e2e/run.py's --impls plus its baseline).
IMPL_ORDER = ("baseline", "shardfuse", "shardfuse-graph", "shardfuse-ref", "fsdp2", "fsdp1", "fairscale")
IMPL_LABEL = {
    "baseline": "one GPU, no sharding (autocast)",
    "shardfuse": "shardfuse `FullyShardedDataParallel`",
    "shardfuse-graph": "shardfuse, step captured by `capture_step` (CUDA graph)",
    "shardfuse-ref": "shardfuse at an older commit (reference)",  # with the commit: see impl_label()
    "fsdp2": "FSDP2 `fully_shard`",
    "fsdp1": "FSDP1",
    "fairscale": "FairScale FSDP",
}
CAPTURED = "shardfuse-graph"  # shardfuse's whole step captured by ``capture_step`` into a CUDA graph, replayed
REGIME_ORDER = ("8k", "4k", "1k")
REGIME_LABEL = {
    "8k": "8K tokens per GPU (compute-bound)",
    "4k": "4K tokens per GPU",  # batch 1 x seq 4096: the 7B-class decoder's regime
    "1k": "1K tokens per GPU (communication-bound)",
}
# The model an e2e file trained (``config.model_kind``, written by bench/e2e/run.py's ModelSpec; a file without
# it is the Llama-style decoder, as every file was before the key existed), see ``e2e_model``.
DECODER_KIND = "decoder"
HF_LLAMA_KIND = "hf-llama"
DEFAULT_DECODER_CONFIG = "bench"  # the decoder whose sections and README rows carry no model name

# Offload variants of bench/offload/run.py.
OFFLOAD_ORDER = (
    "plain",
    "plain_bf16_autocast",
    "shardfuse",
    "shardfuse_bf16",
    "shardfuse_opt_in_bwd",
    "shardfuse_bf16_opt_in_bwd",
    "shardfuse_keep_acts_opt_in_bwd",
    "shardfuse_offload_acts",
    "shardfuse_offload_acts_opt_in_bwd",
    "shardfuse_offload_acts_opt_in_bwd_4sl",
    "fairscale",
    "fsdp2_cpu_offload",
)
OFFLOAD_LABEL = {
    "plain": "plain GPU, everything resident",
    "plain_bf16_autocast": "plain GPU, bf16 autocast",
    "shardfuse": "shardfuse `OffloadModel`",
    "shardfuse_bf16": "shardfuse `OffloadModel`, `compute_dtype=bf16`",
    "shardfuse_opt_in_bwd": "shardfuse `OffloadModel`, `optimizer_in_backward`",
    "shardfuse_bf16_opt_in_bwd": "shardfuse `OffloadModel`, bf16 + `optimizer_in_backward`",
    "shardfuse_keep_acts_opt_in_bwd": "shardfuse `OffloadModel`, no checkpointing + `optimizer_in_backward`",
    "shardfuse_offload_acts": "shardfuse `OffloadModel`, `offload_activations` (8 slices)",
    "shardfuse_offload_acts_opt_in_bwd": "shardfuse `OffloadModel`, `offload_activations` + `optimizer_in_backward` "
    "(8 slices)",
    "shardfuse_offload_acts_opt_in_bwd_4sl": "shardfuse `OffloadModel`, `offload_activations` + "
    "`optimizer_in_backward` (4 slices)",
    "fairscale": "FairScale `OffloadModel`",
    "fsdp2_cpu_offload": "FSDP2 `fully_shard` + `CPUOffloadPolicy`",
}
KERNEL_BIG_BYTES = 64e6  # the "large buffer" threshold of the kernel summaries (bench/kernels/run.py uses it)
DASH = "-"


# ------------------------------------------------------------------------------------------------ formatting


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return None if math.isnan(v) or math.isinf(v) else float(v)


def fmt(v: Any, spec: str, suffix: str = "") -> str:
    """``format(v, spec) + suffix``, or a dash for missing / non-numeric / NaN values."""
    x = _num(v)
    return DASH if x is None else f"{format(x, spec)}{suffix}"


def fmt_bytes(n: Any) -> str:
    """Decimal units, as GB/s is: 1 MB = 1e6 bytes."""
    x = _num(n)
    if x is None:
        return DASH
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if x >= scale:
            return f"{x / scale:.1f} {unit}"
    return f"{x:.0f} B"


def cell(text: Any) -> str:
    """A markdown table cell: pipes escaped, newlines flattened."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def table(header: Sequence[str], rows: Iterable[Sequence[Any]], align: Sequence[str] | None = None) -> list[str]:
    """A markdown table; ``align`` holds "l" or "r" per column (default: first left, the rest right)."""
    align = align or ["l"] + ["r"] * (len(header) - 1)
    lines = [
        "| " + " | ".join(cell(h) for h in header) + " |",
        "|" + "|".join("---" if a == "l" else "---:" for a in align) + "|",
    ]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return lines


def gpu_label(gpu: str, results: Sequence[Result]) -> str:
    """A heading for one GPU folder: the device name recorded in the results, else the folder name."""
    names = sorted({str(r.env["gpu_name"]) for r in results if r.env.get("gpu_name")})
    return f"{gpu.upper()} ({', '.join(names)})" if names else gpu.upper()


def env_line(env: dict[str, Any]) -> str:
    """One line with the environment a result was measured in."""
    if not env:
        return "_Environment: not recorded._"
    parts = []
    gpu = env.get("gpu_name")
    if gpu:
        count = env.get("gpu_count")
        parts.append(f"GPU {gpu}" + (f" x{count}" if count else ""))
    elif env.get("gpu_key"):
        parts.append(f"GPU key {env['gpu_key']}")
    for key, label in (
        ("torch", "torch"),
        ("triton", "triton"),
        ("cuda", "CUDA"),
        ("nccl", "NCCL"),
        ("python", "Python"),
    ):
        if env.get(key):
            parts.append(f"{label} {env[key]}")
    if env.get("date"):
        parts.append(f"date {env['date']}")
    if env.get("commit"):
        parts.append(f"commit `{env['commit']}`")
    return "_Environment: " + "; ".join(parts) + "._"


def _rel(target: Path, start_dir: Path) -> str:
    return Path(os.path.relpath(target.resolve(), start_dir.resolve())).as_posix()


# ------------------------------------------------------------------------------------------------ plots


class Plotter:
    """Saves PNG plots under ``img_dir`` when matplotlib is importable (and plots are wanted)."""

    def __init__(self, img_dir: Path, enabled: bool = True) -> None:
        self.img_dir = img_dir
        self.plt = None
        self.reason = "" if enabled else "plots were not requested (--no-plots)"
        self.written: list[Path] = []
        if enabled:
            try:
                import matplotlib

                matplotlib.use("Agg")
                import matplotlib.pyplot as plt

                self.plt = plt
            except ImportError:
                self.reason = "matplotlib is not installed (`pip install -e .[plot]`)"

    @property
    def available(self) -> bool:
        return self.plt is not None

    def save(self, fig: Any, name: str) -> Path:
        self.img_dir.mkdir(parents=True, exist_ok=True)
        path = self.img_dir / name
        fig.tight_layout()
        # No software/date metadata: an unchanged plot stays byte-identical between runs.
        fig.savefig(path, dpi=110, metadata={"Software": None})
        self.plt.close(fig)
        self.written.append(path)
        return path

    def e2e(self, res: Result, rows: list[dict[str, Any]], summary: Sequence[dict[str, Any]] = ()) -> Path | None:
        """Grouped bars of tokens/s/GPU per regime and implementation: the medians over rounds, with the
        tokens/s/GPU of the slowest and fastest round as error bars, when there is a ``summary``, else the rows."""
        if not self.available:
            return None
        value: dict[tuple[str, str], float] = {}
        spread: dict[tuple[str, str], tuple[float, float]] = {}
        if summary:
            for e in summary:
                tok, med = _num(e.get("tok_s_gpu_median")), _num(e.get("step_ms_median"))
                if not tok:
                    continue
                key = (e["regime"], e["impl"])
                value[key] = tok
                lo_ms, hi_ms = _num(e.get("step_ms_min")), _num(e.get("step_ms_max"))
                if med and lo_ms and hi_ms:  # tokens/s/GPU is inverse to the step time
                    spread[key] = (tok - tok * med / hi_ms, tok * med / lo_ms - tok)
        else:
            value = {(r["regime"], r["impl"]): r["tok_s_gpu"] for r in rows if _num(r.get("tok_s_gpu"))}
        regimes = _ordered({rg for rg, _ in value}, REGIME_ORDER)
        impls = _ordered({impl for _, impl in value}, IMPL_ORDER)
        if not regimes or not impls:
            return None
        fig, ax = self.plt.subplots(figsize=(7, 3.6))
        width = 0.8 / len(impls)
        for i, impl in enumerate(impls):
            xs = [j + (i - (len(impls) - 1) / 2) * width for j in range(len(regimes))]
            ys = [value.get((rg, impl), 0.0) for rg in regimes]
            label = {
                "baseline": "one GPU, unsharded",
                CAPTURED: IMPL_SHORT[CAPTURED],
                "shardfuse-ref": _ref_label(res, short=True),
            }.get(impl, impl)
            err = None
            if spread:
                err = [[spread.get((rg, impl), (0.0, 0.0))[k] for rg in regimes] for k in (0, 1)]
            ax.bar(xs, ys, width, label=label, **({"yerr": err, "capsize": 2} if err else {}))
        ax.set_xticks(range(len(regimes)))
        ax.set_xticklabels([REGIME_LABEL.get(r, r) for r in regimes], fontsize=8)
        ax.set_ylabel("tokens/s/GPU")
        world = res.data.get("config", {}).get("world_size", "?")
        rounds = max((int(e.get("rounds") or 0) for e in summary), default=0)
        how = f", medians of {rounds} rounds (whiskers: slowest to fastest round)" if rounds > 1 else ""
        model = e2e_model(_e2e_cfg(res)).short
        what = f"{world} GPUs, {model}" if model else f"{world} GPUs"
        ax.set_title(f"{res.gpu.upper()}: end-to-end training, {what}{how}", **({"fontsize": 9} if how else {}))
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
        return self.save(fig, f"{res.gpu}_{res.name}_tokens.png")

    def kernels(self, res: Result, families: dict[str, list[dict[str, Any]]], copy_gbps: float | None) -> Path | None:
        """GB/s against bytes moved, one panel per kernel family: shardfuse, its baselines, the copy line."""
        if not self.available or not families:
            return None
        n = len(families)
        cols = min(3, n)
        nrows = math.ceil(n / cols)
        fig, axes = self.plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.2 * nrows), squeeze=False)
        for ax, (family, rows) in zip([a for row in axes for a in row], families.items()):
            series: dict[str, list[tuple[float, float]]] = {}
            for r in rows:
                nbytes = _num(r.get("bytes"))
                if not nbytes:
                    continue
                variant = _variant(r.get("name", ""))
                gbps = _num(r.get("shardfuse_gbps"))
                if gbps:
                    series.setdefault(f"shardfuse {variant}", []).append((nbytes, gbps))
                for label, b in (r.get("baselines") or {}).items():
                    ms = _num(b.get("ms")) if isinstance(b, dict) else None
                    if ms:
                        series.setdefault(f"{label} {variant}", []).append((nbytes, nbytes / (ms * 1e-3) / 1e9))
            for label, pts in series.items():
                pts.sort()
                style = "-o" if label.startswith("shardfuse") else "--x"
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label.strip(), markersize=3)
            if copy_gbps:
                ax.axhline(copy_gbps, color="black", linewidth=0.8, linestyle=":", label="device copy")
            ax.set_xscale("log")
            ax.set_title(family, fontsize=9)
            ax.set_xlabel("bytes moved", fontsize=8)
            ax.set_ylabel("GB/s", fontsize=8)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=5)
        for ax in [a for row in axes for a in row][n:]:
            ax.set_visible(False)
        return self.save(fig, f"{res.gpu}_{res.name}_gbps.png")

    def offload(self, res: Result, variants: dict[str, dict[str, Any]]) -> Path | None:
        """Horizontal bars of step time per variant."""
        if not self.available:
            return None
        names = [v for v in _ordered(variants, OFFLOAD_ORDER) if _num(variants[v].get("step_ms"))]
        if not names:
            return None
        fig, ax = self.plt.subplots(figsize=(7, 0.45 * len(names) + 1.2))
        ax.barh(range(len(names)), [variants[v]["step_ms"] for v in names])
        ax.set_yticks(range(len(names)))
        ax.set_yticklabels(names, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("step time, ms (lower is better)")
        ax.set_title(f"{res.gpu.upper()}: offload")
        ax.grid(axis="x", alpha=0.3)
        return self.save(fig, f"{res.gpu}_{res.name}_step.png")


def _ordered(keys: Iterable[str], preferred: Sequence[str]) -> list[str]:
    keys = list(dict.fromkeys(keys))
    return [k for k in preferred if k in keys] + sorted(k for k in keys if k not in preferred)


def _variant(name: str) -> str:
    """A kernel case name without its size (``"fp32->bf16 flat shard n=1048576"`` -> ``"fp32->bf16 flat shard"``)."""
    return re.sub(r"\s*\bn=\d+", "", str(name)).strip()


# ------------------------------------------------------------------------------------------------ sections


def _ref_commit(res: Result) -> str | None:
    cfg = res.data.get("config")
    commit = cfg.get("shardfuse_ref_commit") if isinstance(cfg, dict) else None
    return str(commit) if commit else None


def _ref_label(res: Result, short: bool = False) -> str:
    """``shardfuse-ref``'s name: shardfuse at the commit recorded in ``config.shardfuse_ref_commit``."""
    commit = _ref_commit(res)
    if short:
        return f"shardfuse at {commit}" if commit else "shardfuse (reference commit)"
    return f"shardfuse at `{commit}` (reference)" if commit else IMPL_LABEL["shardfuse-ref"]


def impl_label(res: Result, impl: str) -> str:
    return _ref_label(res) if impl == "shardfuse-ref" else IMPL_LABEL.get(impl, impl)


IMPL_SHORT = {
    "baseline": "one GPU",
    "shardfuse": "shardfuse",
    "shardfuse-graph": "shardfuse (captured)",
    "fsdp2": "FSDP2",
    "fsdp1": "FSDP1",
    "fairscale": "FairScale",
}


def impl_short(res: Result, impl: str) -> str:
    """A short name for running text (``shardfuse-ref``: "shardfuse at <commit>")."""
    return _ref_label(res, short=True) if impl == "shardfuse-ref" else IMPL_SHORT.get(impl, impl)


def _e2e_rows(res: Result) -> list[dict[str, Any]]:
    rows = res.data.get("results")
    return (
        [r for r in rows if isinstance(r, dict) and r.get("impl") and r.get("regime")] if isinstance(rows, list) else []
    )


@dataclass(frozen=True)
class E2EModel:
    """What an e2e file trained, in the words of the page and the README (see ``e2e_model``)."""

    kind: str  # ``config.model_kind``: "decoder" (also for files without the key), "hf-llama", ...
    config: str  # ``config.model``, the config name: the decoder's "bench" or "7b", hf-llama's "bench"; "" if absent
    title: str  # for section and plot titles; "" for the decoder's bench config (its titles name no model)
    short: str  # the name in README rows; "" for the decoder's bench config
    about: str  # what ``short`` stands for, in the note under the README table
    setup: str  # the model part of the section's setup line; "" when the file does not say


def _count(n: float, short: bool = False) -> str:
    """A parameter count: ``6.7B``, ``852.6M`` (``short``: ``853M``)."""
    if n >= 1e9:
        return f"{n / 1e9:.1f}B"
    return f"{n / 1e6:.0f}M" if short else f"{n / 1e6:.1f}M"


def _shape_text(cfg: dict[str, Any], keys: Sequence[str]) -> str:
    return ", ".join(f"{k} {cfg[k]}" for k in keys if k in cfg)


def _hf_setup(cfg: dict[str, Any], cls: str, count: str) -> str:
    """The setup line's model part for ``hf-llama``: transformers' own config names where the file has them."""
    hf = cfg.get("hf_config") if isinstance(cfg.get("hf_config"), dict) else {}
    if hf:
        keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
        shape = [_shape_text(hf, (*keys, "intermediate_size", "vocab_size"))]
        if isinstance(hf.get("tie_word_embeddings"), bool):
            shape.append("tied input and output embeddings" if hf["tie_word_embeddings"] else "untied output layer")
        if hf.get("attn_implementation"):
            shape.append(f"`{hf['attn_implementation']}` attention")
    else:
        shape = [_shape_text(cfg, ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size"))]
    shape_text = ", ".join(x for x in shape if x)
    parts = [f"{count} parameters, random init" if count else "random init"]
    if cfg.get("model"):
        parts.append(f"`{cfg['model']}` config" + (f": {shape_text}" if shape_text else ""))
    elif shape_text:
        parts.append(shape_text)
    if cfg.get("transformers"):
        parts.append(f"transformers {cfg['transformers']}")
    return f"Hugging Face `{cls}` ({'; '.join(parts)})"


def e2e_model(cfg: dict[str, Any]) -> E2EModel:
    """The model of an e2e file's ``config``: bench/e2e/run.py's ``model_kind`` (``decoder`` when absent) and
    ``model`` (the config name: the decoder's ``bench``, ``7b``, ...; hf-llama's ``bench``); a run with fused
    AdamW (``config.optimizer``, ``--optim fused``) says so in its titles and README rows."""
    model = _e2e_model(cfg)
    if "fused" not in str(cfg.get("optimizer", "")):
        return model
    return dataclasses.replace(
        model, title=f"{model.title or 'decoder'}, fused AdamW", short=f"{model.short or 'decoder'}, fused AdamW",
        about=f"{model.about or 'the decoder'} with fused AdamW (`--optim fused`) for every implementation",
    )


def _e2e_model(cfg: dict[str, Any]) -> E2EModel:
    kind = str(cfg.get("model_kind") or DECODER_KIND)
    name = cfg.get("model")
    config = str(name) if name else ""
    n = _num(cfg.get("params"))
    full, short = (_count(n), _count(n, short=True)) if n else ("", "")
    if kind == DECODER_KIND:
        dims = _shape_text(cfg, ("dim", "n_layers", "n_heads", "ffn_dim", "vocab_size"))
        if name == "7b":
            setup = ""
            if n:
                setup = f"{full}-parameter 7B-class Llama-style decoder (`7b` config, the shape of Llama-2-7B"
                setup += f": {dims})" if dims else ")"
            title = f"7B-class decoder ({full})" if full else "7B-class decoder"
            about = "the Llama-style decoder in the shape of Llama-2-7B" + (f" ({full} parameters)" if full else "")
            return E2EModel(kind, config, title, "7B", about, setup)
        setup = ""
        if n:  # as the report has always written it
            setup = f"{n / 1e6:.0f}M-parameter Llama-style decoder (`{cfg.get('model', '?')}` config"
            setup += f": {dims})" if dims else ")"
        if name in (None, DEFAULT_DECODER_CONFIG):
            return E2EModel(kind, config, "", "", "", setup)
        title = f"Llama-style decoder, `{name}` config" + (f" ({full})" if full else "")
        about = f"the Llama-style decoder in its `{name}` config" + (f" ({full} parameters)" if full else "")
        return E2EModel(kind, config, title, " ".join(x for x in ("decoder", config, short) if x), about, setup)
    if kind == HF_LLAMA_KIND:
        cls = str(cfg.get("hf_class") or "transformers.LlamaForCausalLM")
        title = f"Hugging Face {cls.rsplit('.', 1)[-1]}" + (f" ({full})" if full else "")
        about = f"Hugging Face `{cls}`" + (f" ({full} parameters, random init)" if full else " (random init)")
        short = " ".join(x for x in ("HF Llama", short) if x)
        return E2EModel(kind, config, title, short, about, _hf_setup(cfg, cls, full))
    title = f"model `{kind}`" + (f" ({full})" if full else "")
    setup = f"{full}-parameter `{kind}` model" if full else f"`{kind}` model"
    return E2EModel(kind, config, title, " ".join(x for x in (kind, short) if x), f"the `{kind}` model", setup)


def _e2e_cfg(res: Result) -> dict[str, Any]:
    cfg = res.data.get("config")
    return cfg if isinstance(cfg, dict) else {}


def _regime_shape(res: Result, regime: str, rows: list[dict[str, Any]]) -> str:
    for r in rows:
        if r.get("regime") == regime and r.get("batch") and r.get("seq"):
            return f"batch {r['batch']} x seq {r['seq']}"
    shape = res.data.get("config", {}).get("regimes", {}).get(regime)
    if isinstance(shape, (list, tuple)) and len(shape) == 2:
        return f"batch {shape[0]} x seq {shape[1]}"
    return ""


def _e2e_config_line(cfg: dict[str, Any], rounds: int = 0) -> str:
    if not cfg:
        return ""
    bits = []
    model = e2e_model(cfg).setup
    if model:
        bits.append(model)
    if cfg.get("compute_dtype"):
        bits.append(f"{cfg['compute_dtype']} compute")
    if cfg.get("reduce_dtype"):
        bits.append(f"{cfg['reduce_dtype']} gradient reduction")
    if cfg.get("optimizer"):
        bits.append(str(cfg["optimizer"]))
    if cfg.get("steps") is not None:
        each = f"each round the mean of {cfg['steps']} steps" if rounds > 1 else f"mean of {cfg['steps']} steps"
        bits.append(f"{each} after {cfg.get('warmup', '?')} warm-up")
    if rounds > 1:
        bits.append(f"{rounds} interleaved rounds")
    if _num(cfg.get("peak_tflops")):
        bits.append(f"MFU against {cfg['peak_tflops']:g} TFLOP/s")
    if cfg.get("device") and cfg["device"] != "cuda":
        bits.append(f"device {cfg['device']} (smoke run, not a measurement)")
    return "Setup: " + "; ".join(bits) + "." if bits else ""


def e2e_section(res: Result, plots: Plotter, out_dir: Path) -> list[str]:
    cfg = res.data.get("config") if isinstance(res.data.get("config"), dict) else {}
    world = cfg.get("world_size")
    title = f"End-to-end training, {world} GPUs" if world else "End-to-end training"
    model = e2e_model(cfg).title
    title += f", {model}" if model else ""
    lines = [f"### {title} (`{res.name}.json`)", "", env_line(res.env), ""]
    summary = e2e_summary(res.data)
    rounds = max((int(_num(e.get("rounds")) or 0) for e in summary), default=0)
    setup = _e2e_config_line(cfg, rounds)
    if setup:
        lines += [setup, ""]
    rows = _e2e_rows(res)
    if summary:
        return lines + e2e_rounds_body(res, rows, summary, plots, out_dir)
    if not rows:
        return lines + ["No rows in this file.", ""]
    for regime in _ordered({r["regime"] for r in rows}, REGIME_ORDER):
        rr = [r for r in rows if r["regime"] == regime]
        shape = _regime_shape(res, regime, rr)
        lines += [f"#### {REGIME_LABEL.get(regime, regime)}" + (f", {shape}" if shape else ""), ""]
        fsdp2 = next((_num(r.get("step_ms")) for r in rr if r["impl"] == "fsdp2" and _num(r.get("step_ms"))), None)
        body, notes = [], []
        for impl in _ordered({r["impl"] for r in rr}, IMPL_ORDER):
            for r in (x for x in rr if x["impl"] == impl):
                label = impl_label(res, impl)
                step = _num(r.get("step_ms"))
                if step is None:
                    why = r.get("error") or r.get("skipped") or "no measurement"
                    body.append([label, "failed" if r.get("error") else "skipped", DASH, DASH, DASH, DASH])
                    notes.append(f"{label}: {'error' if r.get('error') else 'skipped'}: {why}")
                    continue
                mfu = _num(r.get("mfu"))
                speed = f"{fsdp2 / step:.2f}x" if fsdp2 and impl != "baseline" else DASH
                body.append(
                    [
                        label,
                        fmt(step, ".1f"),
                        fmt(r.get("tok_s_gpu"), ",.0f"),
                        DASH if mfu is None else f"{100 * mfu:.1f}",
                        fmt(r.get("peak_gib"), ".2f"),
                        speed,
                    ]
                )
                if r.get("note"):
                    notes.append(f"{label}: {r['note']}")
                notes += _captured_memory_notes(label, [r]) if impl == CAPTURED else []
        lines += table(["implementation", "step ms", "tokens/s/GPU", "MFU %", "peak GiB", "vs FSDP2"], body)
        lines.append("")
        lines += [f"- {n}" for n in notes]
        if notes:
            lines.append("")
    lines += ["_vs FSDP2: FSDP2's step time divided by this step time (above 1.00x is faster)._", ""]
    img = plots.e2e(res, rows)
    if img is not None:
        lines += [f"![tokens/s/GPU, {res.gpu} {res.name}]({_rel(img, out_dir)})", ""]
    return lines


def _pct(hi: float, lo: float) -> float:
    return 100.0 * (hi / lo - 1.0)


def _noise_line(res: Result, rows: list[dict[str, Any]], summary: list[dict[str, Any]], regime: str) -> str:
    """How far rounds (and steps within a round) of one implementation moved in one regime, from the data."""
    spans = [
        (_pct(e["step_ms_max"], e["step_ms_min"]), e["impl"])
        for e in summary
        if e["regime"] == regime
        and (_num(e.get("rounds")) or 0) > 1
        and _num(e.get("step_ms_min"))
        and _num(e.get("step_ms_max"))
    ]
    if not spans:
        return ""
    lo, hi = min(spans), max(spans)
    text = (
        f"the mean step time of one implementation moved by {lo[0]:.0f}-{hi[0]:.0f}% from its fastest to its "
        f"slowest round (most: {impl_short(res, hi[1])})"
    )
    steps = [
        (_pct(max(ms), min(ms)), r["impl"])
        for r in rows
        if r["regime"] == regime
        and "round" in r
        and isinstance(ms := r.get("step_ms_list_rank0"), list)
        and ms
        and all(_num(x) for x in ms)
    ]
    if steps:
        top = max(steps)
        text += f", single steps within one round by up to {top[0]:.0f}% ({impl_short(res, top[1])}, rank 0)"
    return text


def _leak_line(rows: list[dict[str, Any]]) -> str:
    """A note when the memory after wrapping the same implementation grows from round to round: something an
    earlier run left allocated then inflates every later peak."""
    after: dict[tuple[str, str], dict[int, float]] = {}
    for r in rows:
        v = _num(r.get("mem_after_wrap_gib_rank0"))
        if v is not None and isinstance(r.get("round"), int):
            after.setdefault((r["impl"], r["regime"]), {})[r["round"]] = v
    growth = [(by[max(by)] - by[min(by)]) / (max(by) - min(by)) for by in after.values() if len(by) > 1]
    if not growth or max(growth) < 0.25:
        return ""
    everything = [v for by in after.values() for v in by.values()]
    return (
        "Memory: in this job the memory allocated right after wrapping the same implementation grew by up to "
        f"{max(growth):.2f} GiB from one round to the next (rank 0, {min(everything):.2f} to "
        f"{max(everything):.2f} GiB over the job): earlier runs left memory allocated, and it inflates the peaks "
        "of later runs. *peak GiB* is therefore the lowest peak over rounds, which still carries what the runs "
        "before it left; *peak above wrap GiB* (peak minus the memory right after wrapping, median over rounds) "
        "does not carry it, and leaves out the wrapped model itself."
    )


def _captured_memory_notes(label: str, measured: list[dict[str, Any]]) -> list[str]:
    """What the peaks of the captured step mean: its graph pool where the rows carry one; without it (rows
    measured before ``bench.e2e.run`` recorded ``capture_step``'s own numbers) the peak covers the replays only."""
    pools = [p for r in measured if (p := _num(r.get("graph_pool_gib_rank0"))) is not None]
    if pools:
        return [
            f"{label}: the CUDA graph's private memory pool kept {statistics.median(pools):.2f} GiB reserved "
            f"(rank 0{', median over rounds' if len(pools) > 1 else ''})"
        ]
    if any(_num(r.get("peak_gib")) is not None for r in measured):
        return [
            f"{label}: these rows carry no graph pool (`graph_pool_gib_rank0`): they were measured before "
            "`bench.e2e.run` recorded `capture_step`'s own memory numbers, so its peaks cover the replays only "
            "(not the warm-up, the capture or the memory the graph keeps in its private pool) and do not "
            "compare with the eager peaks"
        ]
    return []


def e2e_rounds_body(
    res: Result, rows: list[dict[str, Any]], summary: list[dict[str, Any]], plots: Plotter, out_dir: Path
) -> list[str]:
    """Per regime one table of medians over the interleaved rounds of one job (files with a ``summary``)."""
    lines: list[str] = []
    rounds = max(int(_num(e.get("rounds")) or 0) for e in summary)
    first = [r for r in rows if r.get("round") == 0]
    regimes = list(dict.fromkeys(r["regime"] for r in first))
    impls = list(dict.fromkeys(r["impl"] for r in first))
    order = ", ".join(impl_short(res, i) for i in impls)
    regimes_text = " then ".join(REGIME_LABEL.get(x, x).split(" (")[0] for x in regimes)
    if first and rounds > 1:
        lines += [
            f"Each round runs {regimes_text}, every implementation once per regime in this order: {order}; "
            f"{rounds} such rounds, interleaved in one job. The tables give medians over the rounds:",
            "",
        ]
    elif first:  # ``--rounds 1``: one run each, in the layout of rounds
        lines += [f"The job ran {regimes_text}, every implementation once per regime in this order: {order}.", ""]
    # A ratio column per implementation measured in this file (a file without the one-GPU baseline, such as
    # the 7B model's, has no column against it).
    measured_impls = {e["impl"] for e in summary}
    ratio_cols = [
        (impl, name)
        for impl, name in (("fairscale", "vs FairScale"), ("baseline", "vs one GPU"), ("fsdp2", "vs FSDP2"))
        if impl in measured_impls
    ]
    if any(e["impl"] == CAPTURED for e in summary):
        ratio_cols.append(("shardfuse", "vs eager shardfuse"))
    if any(e["impl"] == "shardfuse-ref" for e in summary):
        ratio_cols.append(("shardfuse-ref", f"vs {_ref_label(res, short=True)}"))
    with_wrap = any(_num(r.get("mem_after_wrap_gib_rank0")) is not None for r in rows)
    noise: list[str] = []
    for regime in _ordered({e["regime"] for e in summary} | {r["regime"] for r in rows}, REGIME_ORDER):
        rr = [r for r in rows if r["regime"] == regime]
        ss = {e["impl"]: e for e in summary if e["regime"] == regime}
        shape = _regime_shape(res, regime, rr)
        lines += [f"#### {REGIME_LABEL.get(regime, regime)}" + (f", {shape}" if shape else ""), ""]
        body, notes = [], []
        for impl in _ordered(set(ss) | {r["impl"] for r in rr}, IMPL_ORDER):
            label = impl_label(res, impl)
            mine = [r for r in rr if r["impl"] == impl]
            for r in mine:
                if _num(r.get("step_ms")) is None:
                    kind = "error" if r.get("error") else "skipped"
                    where = f" (round {r['round']})" if "round" in r else ""
                    notes.append(f"{label}: {kind}{where}: {r.get('error') or r.get('skipped') or 'no measurement'}")
            e = ss.get(impl)
            if e is None:
                failed = any(r.get("error") for r in mine)
                blank = [DASH] * (5 + with_wrap + len(ratio_cols))
                body.append([label, "failed" if failed else "skipped", *blank])
                continue
            measured = [r for r in mine if _num(r.get("step_ms")) is not None]
            mfu = [m for r in measured if (m := _num(r.get("mfu"))) is not None]
            peaks = [p for r in measured if (p := _num(r.get("peak_gib"))) is not None]
            peak = min(peaks) if peaks else _num(e.get("peak_gib_max"))
            wraps = [(_num(r.get("peak_gib")), _num(r.get("mem_after_wrap_gib_rank0"))) for r in measured]
            added = [p - w for p, w in wraps if p is not None and w is not None]
            lo, hi = _num(e.get("step_ms_min")), _num(e.get("step_ms_max"))
            row = [
                label,
                str(int(n)) if (n := _num(e.get("rounds"))) is not None else DASH,
                fmt(e.get("step_ms_median"), ".1f"),
                _span(lo, hi, ".1f", "") if lo is not None and hi is not None else DASH,
                fmt(e.get("tok_s_gpu_median"), ",.0f"),
                f"{100 * statistics.median(mfu):.1f}" if mfu else DASH,
                fmt(peak, ".2f"),
            ]
            if with_wrap:
                row.append(fmt(statistics.median(added), ".2f") if added else DASH)
            row += [fmt(e.get(f"vs_{other}"), ".2f", "x") if other != impl else DASH for other, _ in ratio_cols]
            body.append(row)
            notes += _captured_memory_notes(label, measured) if impl == CAPTURED else []
        header = ["implementation", "rounds", "median step ms", "min-max ms", "median tokens/s/GPU", "MFU %"]
        header += ["peak GiB"]
        header += ["peak above wrap GiB"] if with_wrap else []
        header += [c for _, c in ratio_cols]
        lines += table(header, body)
        lines.append("")
        lines += [f"- {n}" for n in notes]
        if notes:
            lines.append("")
        moved = _noise_line(res, rr, summary, regime)
        if moved:
            noise.append(f"{REGIME_LABEL.get(regime, regime).split(' (')[0]}: {moved}")
    vs_one_gpu = (
        "; vs one GPU compares with one GPU training the same tokens per GPU without communication"
        if "baseline" in measured_impls
        else ""
    )
    if rounds > 1:
        lines += [
            f"_vs X: X's median step time divided by this one's (above 1.00x is faster): ratios of the medians over "
            f"{rounds} interleaved rounds in one job, not of single runs; min-max: the fastest and the slowest "
            f"round's mean step time; MFU %: median over rounds{vs_one_gpu}._",
            "",
        ]
    else:
        lines += [
            "_vs X: X's step time divided by this one's (above 1.00x is faster), one run each in the same job"
            f"{vs_one_gpu}._",
            "",
        ]
    if noise:
        lines += [
            "The hosts are noisy, so read differences inside the min-max spreads as ties. " + "; ".join(noise) + ".",
            "",
        ]
    leak = _leak_line(rows)
    if leak:
        lines += [leak, ""]
    img = plots.e2e(res, rows, summary)
    if img is not None:
        lines += [f"![tokens/s/GPU, {res.gpu} {res.name}]({_rel(img, out_dir)})", ""]
    return lines


def _kernel_families(res: Result) -> dict[str, list[dict[str, Any]]]:
    rows = res.data.get("rows")
    fams: dict[str, list[dict[str, Any]]] = {}
    for r in rows if isinstance(rows, list) else []:
        if isinstance(r, dict) and r.get("family"):
            fams.setdefault(str(r["family"]), []).append(r)
    return fams


def _speedups(rows: list[dict[str, Any]]) -> list[float]:
    return [
        s
        for r in rows
        for b in (r.get("baselines") or {}).values()
        if isinstance(b, dict) and (s := _num(b.get("speedup"))) is not None
    ]


def kernel_summary(res: Result) -> list[tuple[str, int, float | None, float | None, float | None, float | None]]:
    """Per family: (family, cases, min and max % of copy bandwidth at >= 64 MB, min and max speedup)."""
    out = []
    for family, rows in _kernel_families(res).items():
        big = [p for r in rows if (_num(r.get("bytes")) or 0) >= KERNEL_BIG_BYTES and (p := _num(r.get("pct_copy_bw")))]
        sp = _speedups(rows)
        out.append(
            (
                family,
                len(rows),
                min(big) if big else None,
                max(big) if big else None,
                min(sp) if sp else None,
                max(sp) if sp else None,
            )
        )
    return out


def kernels_section(res: Result, plots: Plotter, out_dir: Path) -> list[str]:
    lines = [f"### Kernels (`{res.name}.json`)", "", env_line(res.env), ""]
    copy_gbps = _num(res.data.get("copy_bandwidth_gbps"))
    if copy_gbps:
        lines += [
            f"Device copy bandwidth measured in the same run (bytes read + written): **{copy_gbps:,.0f} GB/s**. "
            "GB/s counts the fewest bytes each operation must move (every input read once, every output "
            "written once); a PyTorch sequence that makes more passes scores lower for them.",
            "",
        ]
    fams = _kernel_families(res)
    if not fams:
        return lines + ["No rows in this file.", ""]
    lines += ["Summary (large buffers are those of at least 64 MB moved):", ""]
    body = [
        [f"`{f}`", n, fmt(lo, ".1f", "%"), fmt(hi, ".1f", "%"), fmt(smin, ".2f", "x"), fmt(smax, ".2f", "x")]
        for f, n, lo, hi, smin, smax in kernel_summary(res)
    ]
    lines += table(
        ["family", "cases", "min % of copy BW, large", "max % of copy BW, large", "min speedup", "max speedup"], body
    )
    lines.append("")
    for family, rows in fams.items():
        labels = list(dict.fromkeys(k for r in rows for k in (r.get("baselines") or {})))
        lines += [f"#### `{family}`", ""]
        body = []
        for r in sorted(rows, key=lambda r: (_variant(r.get("name", "")), _num(r.get("bytes")) or 0)):
            base = r.get("baselines") or {}
            body.append(
                [
                    r.get("name", DASH),
                    fmt_bytes(r.get("bytes")),
                    fmt(r.get("shardfuse_ms"), ".4f"),
                    fmt(r.get("shardfuse_gbps"), ",.0f"),
                    fmt(r.get("pct_copy_bw"), ".1f", "%"),
                ]
                + [fmt((base.get(lb) or {}).get("speedup"), ".2f", "x") for lb in labels]
            )
        header = ["case", "bytes moved", "shardfuse ms", "GB/s", "% of copy BW"] + [f"vs `{lb}`" for lb in labels]
        lines += table(header, body)
        lines.append("")
    lines += [
        "_vs X: the time of PyTorch sequence X divided by shardfuse's time for the same case (above 1.00x is faster)._",
        "",
    ]
    img = plots.kernels(res, fams, copy_gbps)
    if img is not None:
        lines += [f"![kernel GB/s, {res.gpu}]({_rel(img, out_dir)})", ""]
    return lines


def offload_section(res: Result, plots: Plotter, out_dir: Path) -> list[str]:
    lines = [f"### Offload (`{res.name}.json`)", "", env_line(res.env), ""]
    cfg = res.data.get("config") if isinstance(res.data.get("config"), dict) else {}
    if cfg:
        model = (
            f"{cfg.get('layers', '?')} x (Linear({cfg.get('width', '?')}, {cfg.get('width', '?')}) + ReLU)"
            + (f", {cfg['params_m']:.0f}M fp32 parameters" if _num(cfg.get("params_m")) else "")
            + (f" ({cfg['model_gib']:.2f} GiB)" if _num(cfg.get("model_gib")) else "")
        )
        lines += [
            f"Setup: {model}; batch {cfg.get('batch', '?')}; SGD; {cfg.get('slices', '?')} slices, "
            f"{cfg.get('microbatches', '?')} microbatches, activation checkpointing; mean of "
            f"{cfg.get('steps', '?')} steps after {cfg.get('warmup', '?')} warm-up.",
            "",
        ]
    variants = res.data.get("variants")
    variants = {k: v for k, v in variants.items() if isinstance(v, dict)} if isinstance(variants, dict) else {}
    if not variants:
        lines += ["No variants in this file.", ""]
    else:
        body, notes, estimated = [], [], False
        for name in _ordered(variants, OFFLOAD_ORDER):
            v = variants[name]
            label = OFFLOAD_LABEL.get(name, name)
            if _num(v.get("step_ms")) is None:
                body.append([label, "failed" if v.get("error") else "skipped", DASH, DASH, DASH, DASH])
                notes.append(
                    f"{label}: {'error' if v.get('error') else 'skipped'}: "
                    f"{v.get('error') or v.get('skipped') or 'no measurement'}"
                )
                continue
            mark = "*" if v.get("traffic") == "estimated" else ""
            estimated |= bool(mark)
            body.append(
                [
                    label,
                    fmt(v.get("step_ms"), ".1f"),
                    fmt(v.get("vs_plain"), ".2f", "x"),
                    fmt(v.get("h2d_gbps"), ".1f", mark),
                    fmt(v.get("d2h_gbps"), ".1f", mark),
                    fmt(v.get("peak_gib"), ".2f"),
                ]
            )
        lines += table(
            ["variant", "step ms", "vs plain GPU", "host->device GB/s", "device->host GB/s", "peak GPU GiB"], body
        )
        lines.append("")
        lines += [f"- {n}" for n in notes]
        if notes:
            lines.append("")
        lines.append(
            "_vs plain GPU: this step time divided by the plain GPU step time (lower is better). "
            "GB/s: bytes copied per step / step time"
            + ("; * estimated from the parameter traffic rather than counted" if estimated else "")
            + "._"
        )
        lines.append("")
    capped = res.data.get("capped")
    if isinstance(capped, dict) and capped:
        lines += ["Capped run (the process is held to a GPU memory budget smaller than the model):", ""]
        if _num(capped.get("step_ms")) is None:
            lines += [f"- failed: {capped.get('error', 'no measurement')}", ""]
        else:
            body = [
                [
                    capped.get("model", DASH),
                    fmt(capped.get("model_gib"), ".2f"),
                    fmt(capped.get("budget_gib"), ".2f"),
                    fmt(capped.get("model_over_budget"), ".1f", "x"),
                    fmt(capped.get("step_ms"), ".1f"),
                    fmt(capped.get("samples_per_s"), ",.0f"),
                    fmt(capped.get("peak_gib"), ".2f"),
                ]
            ]
            lines += table(
                ["model", "model GiB", "budget GiB", "model / budget", "step ms", "samples/s", "peak GPU GiB"], body
            )
            lines.append("")
    img = plots.offload(res, variants)
    if img is not None:
        lines += [f"![offload step time, {res.gpu}]({_rel(img, out_dir)})", ""]
    return lines


def other_section(res: Result) -> list[str]:
    why = res.problem or "not written by a known benchmark runner"
    return [f"- `{res.gpu}/{res.path.name}`: not shown ({why})."]


# ------------------------------------------------------------------------------------------------ the page


HOW_MEASURED = """\
## How these numbers are made

- `python -m bench.kernels.run`: every kernel family against the PyTorch sequences it replaces, at several sizes,
  with the GPU's own device-copy bandwidth measured in the same run (medians of CUDA-event timings).
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
- `torchrun ... -m bench.e2e.host_profile` (gpu_suite stage `host-profile`): where an eager step's time goes on
  the host, the decoder at 1K tokens per GPU: each implementation's host enqueue time against its synchronised
  step (close together: the step is host-bound) and a cProfile of rank 0. Last run on 2xH200:
  `bench/results/logs/h200x2-host-profile.log`.
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
    shown = [(m.kind, m.config) for m in _e2e_models(results)]
    said = [
        text
        for (kind, config), text in HOW_MEASURED_MODELS.items()
        if (kind, config) in shown or config is None and any(k == kind for k, _ in shown)
    ]
    if not said:
        return HOW_MEASURED
    bullet = f"- {'; '.join(said)}: the same implementations, measurements and ratios as the decoder's.\n"
    assert HOW_MEASURED_AFTER in HOW_MEASURED
    return HOW_MEASURED.replace(HOW_MEASURED_AFTER, bullet + HOW_MEASURED_AFTER, 1)


REGRESSION_NOTE = """\
## Regression check

`python -m bench.regress NEW.json` compares a fresh end-to-end or offload result file with the stored file
of the same name for the same GPU (`bench/results/<gpu>/<name>.json`, the GPU taken from the new file's
`env.gpu_key`) and exits with status 1 when a shardfuse time (training step time, offload step time) is
slower by more than the noise band (`--noise`, default 5%), or when a shardfuse row measured before now
failed. The other implementations are listed for context only: when FSDP2 slowed down by the same amount,
the machine changed, not shardfuse (the check prints a note when their median changed beyond the band).
`--baseline OLD.json` compares with a given file; `python -m bench.report --compare NEW.json` runs the same
check; `bash bench/gpu_suite.sh` runs it on every e2e and offload file it writes (stage `regress`).

Kernel regressions go through pytest-benchmark's own storage and compare: the suite's `kernels-pb` stage
runs `bench/kernels/test_bench_kernels.py` with `--benchmark-autosave`, and with `--benchmark-compare
--benchmark-compare-fail median:10%` against the newest run stored for that GPU in
`bench/results/<gpu>/pytest-benchmark/` (copy the run it saved under `$OUT/work/pytest-benchmark/` there to
make it the new reference).
"""


def render(results: dict[str, list[Result]], out_path: Path, plots: Plotter) -> str:
    """The whole ``benchmarks.md`` text."""
    out_dir = out_path.parent
    lines = [
        "# Benchmark results",
        "",
        "<!-- Generated by `python -m bench.report` from bench/results/<gpu>/*.json: edit the script, not this "
        "file. -->",
        "",
    ]
    if not results:
        lines += [
            "No benchmark results are stored yet: `bench/results/` holds no `<gpu>/*.json` files.",
            "",
            "Run `bash bench/gpu_suite.sh` on a GPU machine (or the runners one by one, see below), copy the JSON "
            "files it writes into `bench/results/<gpu>/`, and run `python -m bench.report` to render this page.",
            "",
            HOW_MEASURED,
            REGRESSION_NOTE,
        ]
        return "\n".join(lines)
    lines += ["Results by GPU architecture:", ""]
    for gpu, rs in results.items():
        lines.append(
            f"- [{gpu_label(gpu, rs)}](#{_anchor(gpu_label(gpu, rs))}): " + ", ".join(f"`{r.name}`" for r in rs)
        )
    lines.append("")
    if not plots.available:
        lines += [f"_Plots were skipped: {plots.reason}._", ""]
    lines += ["## Summary", ""] + summary_table(results, link=None) + [""]
    for gpu, rs in results.items():
        lines += [f"## {gpu_label(gpu, rs)}", ""]
        others: list[str] = []
        for r in rs:
            if r.kind == "e2e":
                lines += e2e_section(r, plots, out_dir)
            elif r.kind == "kernels":
                lines += kernels_section(r, plots, out_dir)
            elif r.kind == "offload":
                lines += offload_section(r, plots, out_dir)
            else:
                others += other_section(r)
        if others:
            lines += ["Other files in this folder:", ""] + others + [""]
    lines += [how_measured(results), REGRESSION_NOTE]
    return "\n".join(lines)


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


# ------------------------------------------------------------------------------------------------ README table


# The ratios a training row of the README table gives for shardfuse, in this order, and the columns it has.
README_RATIOS = (("fairscale", "FairScale"), ("baseline", "one GPU"), ("fsdp2", "FSDP2"))
README_COLUMNS = ("fairscale", "baseline", "fsdp2", "fsdp1")
# The row of the captured step (right after shardfuse's) gives these too, and the one against eager shardfuse.
README_CAPTURED_RATIOS = (*README_RATIOS, ("shardfuse", "eager shardfuse"))
README_CAPTURED_BENCH = ", step captured (capture_step)"


def _training_cells(
    res: Result, regime: str, impl: str = "shardfuse", ratios: Sequence[tuple[str, str]] = README_RATIOS
) -> tuple[str, dict[str, str], int] | None:
    """(``impl``'s tokens/s/GPU with its ``ratios``, tokens/s/GPU per README column, rounds) for one regime of
    an e2e file: medians over rounds when it has a summary (``rounds`` > 0), else the single run's numbers."""
    summary = [e for e in e2e_summary(res.data) if e["regime"] == regime]
    if summary:
        tok = {e["impl"]: _num(e.get("tok_s_gpu_median")) for e in summary}
        ours = next((e for e in summary if e["impl"] == impl), {})
        ratio = {other: _num(ours.get(f"vs_{other}")) for other, _ in ratios}
        rounds = max(int(_num(e.get("rounds")) or 0) for e in summary)
    else:
        tok = {x["impl"]: _num(x.get("tok_s_gpu")) for x in _e2e_rows(res) if x["regime"] == regime}
        mine = tok.get(impl)
        # same tokens per GPU and step in every implementation: the tokens/s ratio is the step time ratio
        ratio = {o: mine / t if mine and (t := tok.get(o)) else None for o, _ in ratios}
        rounds = 0
    if not any(v is not None for v in tok.values()):
        return None
    ours_text = fmt(tok.get(impl), ",.0f")
    parts = [f"{ratio[o]:.2f}x {name}" for o, name in ratios if ratio.get(o)]
    if ours_text != DASH and parts:
        ours_text += f" ({', '.join(parts)})"
    return ours_text, {c: fmt(tok.get(c), ",.0f") for c in README_COLUMNS}, rounds


def _has_captured(res: Result, regime: str) -> bool:
    """Whether an e2e file measured the captured step in ``regime`` (its summary, else its rows)."""
    summary = [e for e in e2e_summary(res.data) if e["regime"] == regime]
    if summary:
        return any(e["impl"] == CAPTURED and _num(e.get("tok_s_gpu_median")) for e in summary)
    return any(r["impl"] == CAPTURED and _num(r.get("tok_s_gpu")) for r in _e2e_rows(res) if r["regime"] == regime)


def _span(lo: float, hi: float, spec: str, suffix: str) -> str:
    a, b = format(lo, spec), format(hi, spec)
    return f"{a}{suffix}" if a == b else f"{a}-{b}{suffix}"


def summary_rows(results: dict[str, list[Result]]) -> list[list[str]]:
    """Rows of the short table: one per (GPU, e2e file, regime), one per offload file, one per kernel file."""
    rows: list[list[str]] = []
    for gpu, rs in results.items():
        for r in rs:
            if r.kind == "e2e":
                world = r.data.get("config", {}).get("world_size")
                model = e2e_model(_e2e_cfg(r)).short  # "" for the decoder's bench config, as the rows always were
                named = f"{model}, " if model else ""
                regimes = {x["regime"] for x in _e2e_rows(r)} | {e["regime"] for e in e2e_summary(r.data)}
                for regime in _ordered(regimes, REGIME_ORDER):
                    bench = (
                        f"training, {world} GPUs, {named}{regime.upper()} tokens/GPU"
                        if world
                        else f"training, {named}{regime}"
                    )
                    kinds = [("shardfuse", README_RATIOS, "")]
                    if _has_captured(r, regime):
                        kinds.append((CAPTURED, README_CAPTURED_RATIOS, README_CAPTURED_BENCH))
                    for impl, ratios, what in kinds:
                        cells = _training_cells(r, regime, impl, ratios)
                        if cells is None:
                            continue
                        ours, others, rounds = cells
                        metric = f"tokens/s/GPU, median of {rounds} rounds" if rounds > 1 else "tokens/s/GPU"
                        rows.append([gpu.upper(), bench + what, metric, ours, *(others[c] for c in README_COLUMNS)])
            elif r.kind == "offload":
                v = r.data.get("variants") if isinstance(r.data.get("variants"), dict) else {}
                ms = {k: _num(x.get("step_ms")) for k, x in v.items() if isinstance(x, dict)}
                if not any(x is not None for x in ms.values()):
                    continue
                plain = ms.get("plain")
                gib = {k: _num(x.get("peak_gib")) for k, x in v.items() if isinstance(x, dict)}
                plain_gib = gib.get("plain")
                metric = f"step ms (plain GPU {plain:.1f})" if plain else "step ms"
                # FairScale's settings (checkpointing), then the fastest fp32 setting: activations on the
                # host, no recompute, optimizer in backward (with its memory, the other half of the target)
                for variant, what in (
                    ("shardfuse", "offload, 1 GPU"),
                    (
                        "shardfuse_offload_acts_opt_in_bwd",
                        "offload, 1 GPU, `offload_activations` + optimizer in backward",
                    ),
                ):
                    ours = fmt(ms.get(variant), ".1f")
                    if ours == DASH and variant != "shardfuse":
                        continue
                    if ours != DASH and plain:
                        ours += f" ({ms[variant] / plain:.2f}x plain"
                        if gib.get(variant) is not None and plain_gib:
                            ours += f", {gib[variant] / plain_gib:.2f}x its memory"
                        ours += ")"
                    rows.append(
                        [
                            gpu.upper(),
                            what,
                            metric,
                            ours,
                            fmt(ms.get("fairscale"), ".1f"),
                            DASH,
                            fmt(ms.get("fsdp2_cpu_offload"), ".1f"),
                            DASH,
                        ]
                    )
            elif r.kind == "kernels":
                summ = kernel_summary(r)
                lows = [x[2] for x in summ if x[2] is not None]
                highs = [x[3] for x in summ if x[3] is not None]
                smin = [x[4] for x in summ if x[4] is not None]
                smax = [x[5] for x in summ if x[5] is not None]
                if lows:
                    rows.append(
                        [
                            gpu.upper(),
                            "kernels, buffers >= 64 MB",
                            "% of copy bandwidth",
                            _span(min(lows), max(highs), ".0f", "%"),
                            DASH,
                            DASH,
                            DASH,
                            DASH,
                        ]
                    )
                if smin:
                    rows.append(
                        [
                            gpu.upper(),
                            "kernels, all sizes",
                            "speedup vs the PyTorch sequence replaced",
                            _span(min(smin), max(smax), ".2f", "x"),
                            DASH,
                            DASH,
                            DASH,
                            DASH,
                        ]
                    )
    return rows


def summary_table(results: dict[str, list[Result]], link: str | None = "docs/benchmarks.md") -> list[str]:
    """The short results table (markdown lines) for the README (``link``: to benchmarks.md) or the page itself."""
    rows = summary_rows(results)
    where = f"[{Path(link).name}]({link})" if link else "the sections below"
    captured = ""
    if any(row[1].endswith(README_CAPTURED_BENCH) for row in rows):
        captured = (
            ' Rows "step captured (capture_step)": shardfuse\'s whole training step captured by `capture_step` '
            "into one CUDA graph and replayed (shardfuse column), with the same ratios and one more, against eager "
            "shardfuse."
        )
    if not rows:
        return [f"No benchmark results are stored yet (see {where} for how to produce them)."]
    named = [
        m
        for m in _e2e_models(results)
        if any(row[1].startswith("training, ") and f" {m.short}, " in row[1] for row in rows)
    ]
    models = ""
    if named:
        models = (
            f" Training rows name their model unless it is the Llama-style decoder's `{DEFAULT_DECODER_CONFIG}` "
            "config: " + "; ".join(f'"{m.short}" = {m.about}' for m in named) + "."
        )
    lines = table(
        ["GPU", "benchmark", "metric", "shardfuse", "FairScale", "one GPU", "FSDP2", "FSDP1"],
        rows,
        ["l", "l", "l", "r", "r", "r", "r", "r"],
    )
    lines += [
        "",
        "Ratios in parentheses: training, shardfuse's step time against FairScale's, one GPU's (the same tokens "
        "per GPU, unsharded, no communication) and FSDP2's (above 1.00x is faster; where the metric says "
        '"median of N rounds", medians over rounds interleaved in one job on noisy hosts, else one run each); '
        "offload, against the plain GPU step (lower is better). Offload columns: FSDP2 = `fully_shard` with "
        f"`CPUOffloadPolicy`, FairScale = its `OffloadModel`.{captured}{models} Every number comes from "
        "`bench/results/`; "
        f"environments, spreads over rounds and details in {where}.",
    ]
    return lines


def _e2e_models(results: dict[str, list[Result]]) -> list[E2EModel]:
    """The named models (all but the decoder's bench config) of the e2e files, each once, in file order."""
    out: dict[str, E2EModel] = {}
    for rs in results.values():
        for r in rs:
            if r.kind == "e2e" and (m := e2e_model(_e2e_cfg(r))).short:
                out.setdefault(m.short, m)
    return list(out.values())


def update_readme(text: str, table_lines: Sequence[str]) -> str:
    """``text`` with the results table put between the markers (or in place of the ``RESULTS_TABLE`` line)."""
    block = "\n".join([START_MARK, *table_lines, END_MARK])
    start, end = text.find(START_MARK), text.find(END_MARK)
    if start != -1 and end != -1:
        if end < start:
            raise ValueError(f"{END_MARK!r} comes before {START_MARK!r}: fix the README by hand")
        return text[:start] + block + text[end + len(END_MARK) :]
    if start != -1 or end != -1:
        raise ValueError(f"the README has only one of {START_MARK!r} and {END_MARK!r}: add the other one")
    lines = text.split("\n")
    hits = [i for i, line in enumerate(lines) if line == PLACEHOLDER]
    if not hits:
        raise ValueError(f"the README has neither {START_MARK!r} ... {END_MARK!r} nor a line {PLACEHOLDER!r}")
    i = hits[0]
    return "\n".join(lines[:i] + [block] + lines[i + 1 :])


# ------------------------------------------------------------------------------------------------ command line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", type=Path, default=DEFAULT_RESULTS, help="folder of <gpu>/*.json result files")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the markdown page to write")
    p.add_argument("--img-dir", type=Path, default=None, help="where PNG plots go (default: img/ beside --out)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--readme", type=Path, default=None, help="also rewrite the results table of this README")
    p.add_argument("--summary", action="store_true", help="print the short table only; write nothing")
    p.add_argument(
        "--compare",
        type=Path,
        default=None,
        metavar="NEW.json",
        help="regression check of an e2e or offload NEW.json against the stored result (python -m bench.regress)",
    )
    p.add_argument("--noise", type=float, default=0.05, help="noise band of --compare (fraction, default 0.05)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.compare is not None:
        from bench import regress  # only here: the report itself needs none of it

        return regress.main([str(args.compare), "--results", str(args.results), "--noise", str(args.noise)])
    results = load_results(args.results)
    if args.summary:
        print("\n".join(summary_table(results)))
        return 0
    img_dir = args.img_dir if args.img_dir is not None else args.out.parent / "img"
    plots = Plotter(img_dir, enabled=not args.no_plots)
    text = render(results, args.out, plots)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text if text.endswith("\n") else text + "\n")
    n_files = sum(len(v) for v in results.values())
    print(f"wrote {args.out} ({n_files} result files, {len(results)} GPUs, {len(plots.written)} plots)")
    if not plots.available and results:
        print(f"plots skipped: {plots.reason}")
    readme_link = _rel(args.out, args.readme.parent) if args.readme is not None else "docs/benchmarks.md"
    table_lines = summary_table(results, readme_link)
    if args.readme is not None:
        args.readme.write_text(update_readme(args.readme.read_text(), table_lines))
        print(f"updated the results table of {args.readme}")
    else:
        print("\n".join(table_lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
