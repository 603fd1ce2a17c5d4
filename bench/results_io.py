"""Reading stored benchmark results: what both ``bench.report`` (tables, plots) and ``bench.regress``
(regression check) need, so that neither imports the other's internals.

Result files are the JSON that the runners write through ``bench.common.write_result``, one folder per GPU
architecture: ``bench/results/<gpu>/<name>.json``. Standard library only (no torch), like the report.
"""

from __future__ import annotations

import json
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from bench._results_fields import Env, _int, _obj, _objs, _pos, _text, num
from bench._results_offload_big import OFFLOAD_BIG_OK as OFFLOAD_BIG_OK
from bench._results_offload_big import OFFLOAD_BIG_VERSIONS as OFFLOAD_BIG_VERSIONS
from bench._results_offload_big import OffloadBigFile, OffloadBigFloor, OffloadBigHardware, OffloadBigRow

REPO = Path(__file__).resolve().parents[1]
DEFAULT_RESULTS = REPO / "bench" / "results"

__all__ = [
    "DEFAULT_RESULTS",
    "E2E_RATIO_IMPLS",
    "REPO",
    "CappedRun",
    "E2EConfig",
    "E2EFile",
    "E2ERow",
    "E2ESummary",
    "Env",
    "KernelBaseline",
    "KernelRow",
    "KernelsFile",
    "OffloadConfig",
    "OffloadFile",
    "OffloadBigFile",
    "OffloadBigFloor",
    "OffloadBigHardware",
    "OffloadBigRow",
    "OffloadVariant",
    "Result",
    "detect_kind",
    "e2e_summary",
    "load_file",
    "load_results",
]

# The implementations ``bench.e2e.run`` states ratios of median step times against (``vs_<impl>`` keys).
E2E_RATIO_IMPLS = ("fsdp2", "fairscale", "shardfuse", "shardfuse-ref", "baseline", "baseline-graph")


@dataclass
class Result:
    """One stored result file."""

    gpu: str  # the folder name under results/, e.g. "h200"
    name: str  # the file stem, e.g. "e2e_2gpu"
    path: Path
    kind: str  # "kernels", "e2e", "offload", "offload_big", "offload_attribution", "host_step", "overlap" (a
    # captured step's profile, bench.e2e.overlap --captured), "spec_finetune", "unknown" or "unreadable"
    data: dict[str, Any] = field(default_factory=dict)
    problem: str | None = None

    @property
    def env(self) -> Env:
        return Env.parse(self.data.get("env"))

    @property
    def is_gpu(self) -> bool:
        """False for a run on the CPU (a smoke test of a runner, not a measurement): ``env.gpu_key`` "cpu", or
        an e2e or offload_big file whose ``config.device`` is not "cuda"."""
        if self.env.gpu_key == "cpu":
            return False
        if self.kind == "offload_big":
            return self.offload_big().device in (None, "cuda")
        return not (self.kind == "e2e" and self.e2e().config.device not in (None, "cuda"))

    def e2e(self) -> E2EFile:
        return E2EFile.parse(self.data)

    def kernels(self) -> KernelsFile:
        return KernelsFile.parse(self.data)

    def offload(self) -> OffloadFile:
        return OffloadFile.parse(self.data)

    def offload_big(self) -> OffloadBigFile:
        return OffloadBigFile.parse(self.data)


def detect_kind(name: str, data: Any) -> str:
    """Which runner wrote ``data`` (by its keys, then by the file name)."""
    if not isinstance(data, dict):
        return "unknown"
    if data.get("kind") == "offload_big":  # bench.offload.big: a ``results`` list too, but not an e2e file
        return "offload_big"
    if data.get("kind") == "offload_attribution":  # a profiled offload_big run (bench.report._attribution)
        return "offload_attribution"
    if data.get("kind") == "overlap":  # the captured step's profile (bench.e2e.overlap --captured)
        return "overlap"
    if data.get("kind") == "spec_finetune" or (name.startswith("spec_finetune") and "floor" in data
                                               and isinstance(data.get("rows"), list)):
        return "spec_finetune"  # bench.offload.spec_finetune (files before its "kind": by name and keys)
    rows = data.get("rows")
    if data.get("kind") == "host_step" or (name == "host_step" and isinstance(rows, list) and rows
                                           and all(isinstance(r, dict) and "setting" in r for r in rows)):
        return "host_step"  # bench.offload.host_step (files before its "kind" are told by name and rows)
    if isinstance(rows, list) and (not rows or any(isinstance(r, dict) and "family" in r for r in rows)):
        return "kernels"
    if isinstance(data.get("results"), list):
        return "e2e"
    if isinstance(data.get("variants"), dict):
        return "offload"
    if name == "kernels":
        return "kernels"
    if name.startswith("e2e"):
        return "e2e"
    if name.startswith("offload_big"):
        return "offload_big"
    if name.startswith("offload"):
        return "offload"
    return "unknown"


def load_file(path: Path, gpu: str | None = None) -> Result:
    """Read one result file; a file that cannot be parsed becomes a Result of kind ``unreadable``."""
    gpu = gpu if gpu is not None else path.parent.name
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        return Result(gpu, path.stem, path, "unreadable", {}, f"{type(exc).__name__}: {exc}")
    if not isinstance(data, dict):
        return Result(gpu, path.stem, path, "unknown", {}, "top level is not a JSON object")
    return Result(gpu, path.stem, path, detect_kind(path.stem, data), data)


def _result_sort_key(r: Result) -> tuple[int, int, str]:
    order = {"e2e": 0, "overlap": 0, "offload": 1, "offload_big": 2, "offload_attribution": 2, "kernels": 3,
             "spec_finetune": 2, "host_step": 4, "unknown": 5, "unreadable": 6}
    m = re.search(r"(\d+)gpu", r.name)
    return order.get(r.kind, 6), int(m.group(1)) if m else 0, r.name


def load_results(results_dir: Path) -> dict[str, list[Result]]:
    """``{gpu: [results...]}`` for every ``<results_dir>/<gpu>/*.json``, GPUs and files in a stable order."""
    out: dict[str, list[Result]] = {}
    if not results_dir.is_dir():
        return out
    for gpu_dir in sorted(p for p in results_dir.iterdir() if p.is_dir() and not p.name.startswith(".")):
        files = sorted(gpu_dir.glob("*.json"))
        if files:
            out[gpu_dir.name] = sorted((load_file(f, gpu_dir.name) for f in files), key=_result_sort_key)
    return out


# ------------------------------------------------------------------------------------------------ e2e rounds


def e2e_summary(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Per (impl, regime) medians over the interleaved rounds of an e2e file (``bench.e2e.run --rounds N``).

    The file's own ``summary`` when it has one; else one computed from the rows that carry a ``round`` key, as
    ``bench.e2e.run.summarize`` does (a file written mid-run has rows but no summary yet); ``[]`` for a file of
    one run without rounds (the older layout). Each entry has ``impl``, ``regime``, ``rounds``,
    ``step_ms_median``, ``step_ms_min``, ``step_ms_max``, ``tok_s_gpu_median``, ``peak_gib_max`` (where
    measured) and ``vs_<other>`` for every other implementation of ``E2E_RATIO_IMPLS`` measured in that
    regime: the other's median step time divided by this one's (above 1 this one is faster). Ratios the stored
    summary lacks are filled in from its medians; stored ones are kept as they are.
    """
    stored = data.get("summary")
    entries: list[dict[str, Any]] = []
    if isinstance(stored, list):
        entries = [
            dict(e)
            for e in stored
            if isinstance(e, dict) and e.get("impl") and e.get("regime") and _pos(e.get("step_ms_median"))
        ]
    if not entries:
        rows = data.get("results")
        rows = [r for r in rows if isinstance(r, dict)] if isinstance(rows, list) else []
        by: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for r in rows:
            if "round" in r and r.get("impl") and r.get("regime") and _pos(r.get("step_ms")):
                by.setdefault((str(r["impl"]), str(r["regime"])), []).append(r)
        for (impl, regime), runs in by.items():
            ms = [float(x["step_ms"]) for x in runs]
            tok = [float(x["tok_s_gpu"]) for x in runs if _pos(x.get("tok_s_gpu"))]
            peaks = [float(x["peak_gib"]) for x in runs if _pos(x.get("peak_gib"))]
            entry: dict[str, Any] = {
                "impl": impl,
                "regime": regime,
                "rounds": len(ms),
                "step_ms_median": statistics.median(ms),
                "step_ms_min": min(ms),
                "step_ms_max": max(ms),
            }
            if tok:
                entry["tok_s_gpu_median"] = statistics.median(tok)
            if peaks:
                entry["peak_gib_max"] = max(peaks)
            entries.append(entry)
    medians = {(e["impl"], e["regime"]): float(e["step_ms_median"]) for e in entries}
    for e in entries:
        for other in E2E_RATIO_IMPLS:
            theirs = medians.get((other, e["regime"]))
            if other != e["impl"] and theirs is not None and _pos(e.get(f"vs_{other}")) is None:
                e[f"vs_{other}"] = theirs / float(e["step_ms_median"])
    return entries


# ------------------------------------------------------------------------------------------------ typed layouts
#
# The JSON layouts of the runners, parsed into typed records: the report and the regression check read these and
# nothing else of a file. Numbers are finite floats or None (missing, non-numeric, NaN, infinite); texts are str or
# None; a field of the wrong JSON type reads as missing, so a damaged file renders with dashes instead of failing.
# The field readers and ``Env`` are in ``bench._results_fields``, the offload_big records in
# ``bench._results_offload_big``: imported above, so ``from bench.results_io import X`` works for all of them.

T = TypeVar("T")


@dataclass(frozen=True)
class E2ERow:
    """One run of one implementation in one regime (a row of ``results``)."""

    impl: str
    regime: str
    round: int | None = None  # None: a file of one run without rounds (the older layout)
    batch: int | None = None
    seq: int | None = None
    step_ms: float | None = None
    tok_s_gpu: float | None = None
    mfu: float | None = None
    peak_gib: float | None = None
    mem_after_wrap_gib_rank0: float | None = None
    graph_pool_gib_rank0: float | None = None
    step_ms_list_rank0: tuple[float | None, ...] | None = None
    error: str | None = None
    skipped: str | None = None  # set (to the reason) when the implementation could not run there
    note: str | None = None
    host_load: str | None = None  # set (why) when the host was loaded while the row was measured (bench.host_load)

    @classmethod
    def parse(cls, r: dict[str, Any]) -> E2ERow:
        steps = r.get("step_ms_list_rank0")
        floats = ("step_ms", "tok_s_gpu", "mfu", "peak_gib", "mem_after_wrap_gib_rank0", "graph_pool_gib_rank0")
        return cls(
            impl=str(r["impl"]), regime=str(r["regime"]), round=_int(r.get("round")),
            batch=_int(r.get("batch")), seq=_int(r.get("seq")), **{k: num(r.get(k)) for k in floats},
            step_ms_list_rank0=tuple(num(x) for x in steps) if isinstance(steps, list) else None,
            error=_text(r.get("error")), skipped=_text(r.get("skipped")) if "skipped" in r else None,
            note=_text(r.get("note")), host_load=_text(r.get("host_load")),
        )  # fmt: skip

    @property
    def why(self) -> str:
        """Why this row has no step time."""
        return self.error or self.skipped or "no measurement"


@dataclass(frozen=True)
class E2ESummary:
    """Medians over the rounds of one (implementation, regime), see ``e2e_summary``."""

    impl: str
    regime: str
    rounds: int
    step_ms_median: float | None
    step_ms_min: float | None
    step_ms_max: float | None
    tok_s_gpu_median: float | None
    peak_gib_max: float | None
    vs: dict[str, float | None]  # other implementation -> its median step time / this one's

    @classmethod
    def parse(cls, e: dict[str, Any]) -> E2ESummary:
        vs = {k[3:]: num(v) for k, v in e.items() if k.startswith("vs_")}
        return cls(
            impl=str(e["impl"]), regime=str(e["regime"]), rounds=int(num(e.get("rounds")) or 0),
            step_ms_median=num(e.get("step_ms_median")), step_ms_min=num(e.get("step_ms_min")),
            step_ms_max=num(e.get("step_ms_max")), tok_s_gpu_median=num(e.get("tok_s_gpu_median")),
            peak_gib_max=num(e.get("peak_gib_max")), vs=vs,
        )  # fmt: skip


# The decoder's shape keys in an e2e ``config`` (and the HF model's, as bench/e2e/run.py's ModelSpec writes them).
E2E_SHAPE_KEYS = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size")


@dataclass(frozen=True)
class E2EConfig:
    """``config`` of an e2e file: the model trained and how it was measured."""

    present: bool = False  # False when the file has no (or an empty) config
    model_kind: str | None = None
    model: str | None = None  # the config name: "bench", "7b", ...
    params: float | None = None
    shape: dict[str, Any] = field(default_factory=dict)  # E2E_SHAPE_KEYS the file has, as written
    hf_class: str | None = None
    hf_config: dict[str, Any] = field(default_factory=dict)
    transformers: str | None = None
    world_size: int | None = None
    device: str | None = None
    steps: int | None = None
    warmup: int | None = None
    optimizer: str | None = None
    compute_dtype: str | None = None
    reduce_dtype: str | None = None
    peak_tflops: float | None = None
    regimes: dict[str, tuple[Any, Any]] = field(default_factory=dict)  # regime -> (batch, seq)
    shardfuse_ref_commit: str | None = None

    @classmethod
    def parse(cls, v: Any) -> E2EConfig:
        c = _obj(v)
        regimes = {str(k): (s[0], s[1]) for k, s in _obj(c.get("regimes")).items()
                   if isinstance(s, (list, tuple)) and len(s) == 2}  # fmt: skip
        texts = ("model_kind", "model", "hf_class", "transformers", "device", "optimizer", "compute_dtype",
                 "reduce_dtype", "shardfuse_ref_commit")  # fmt: skip
        return cls(
            present=bool(c), params=num(c.get("params")), shape={k: c[k] for k in E2E_SHAPE_KEYS if k in c},
            hf_config=_obj(c.get("hf_config")), world_size=_int(c.get("world_size")),
            steps=_int(c.get("steps")), warmup=_int(c.get("warmup")), peak_tflops=num(c.get("peak_tflops")),
            regimes=regimes, **{k: _text(c.get(k)) for k in texts},
        )  # fmt: skip


@dataclass(frozen=True)
class E2EFile:
    """An ``e2e_*.json`` of ``bench.e2e.run``: its rows, in file order, and the medians over its rounds."""

    config: E2EConfig
    rows: list[E2ERow]  # rows with an implementation and a regime
    summary: list[E2ESummary]  # empty for a file of one run without rounds

    @classmethod
    def parse(cls, data: dict[str, Any]) -> E2EFile:
        rows = [E2ERow.parse(r) for r in _objs(data.get("results")) if r.get("impl") and r.get("regime")]
        return cls(E2EConfig.parse(data.get("config")), rows, [E2ESummary.parse(e) for e in e2e_summary(data)])


@dataclass(frozen=True)
class KernelBaseline:
    ms: float | None
    speedup: float | None


@dataclass(frozen=True)
class KernelRow:
    """One case of ``bench.kernels.run``: a kernel at one size, with the PyTorch sequences it replaces."""

    family: str
    name: str | None
    bytes: float | None
    shardfuse_ms: float | None
    shardfuse_gbps: float | None
    pct_copy_bw: float | None
    baselines: dict[str, KernelBaseline]  # label -> its time and shardfuse's speedup over it

    @classmethod
    def parse(cls, r: dict[str, Any]) -> KernelRow:
        base = _obj(r.get("baselines"))
        baselines = {str(k): KernelBaseline(num(_obj(b).get("ms")), num(_obj(b).get("speedup")))
                     for k, b in base.items()}  # fmt: skip
        return cls(str(r["family"]), str(r["name"]) if "name" in r else None, num(r.get("bytes")),
                   num(r.get("shardfuse_ms")), num(r.get("shardfuse_gbps")), num(r.get("pct_copy_bw")),
                   baselines)  # fmt: skip


@dataclass(frozen=True)
class KernelsFile:
    copy_bandwidth_gbps: float | None
    families: dict[str, list[KernelRow]]  # in file order

    @classmethod
    def parse(cls, data: dict[str, Any]) -> KernelsFile:
        fams: dict[str, list[KernelRow]] = {}
        for r in _objs(data.get("rows")):
            if r.get("family"):
                fams.setdefault(str(r["family"]), []).append(KernelRow.parse(r))
        return cls(num(data.get("copy_bandwidth_gbps")), fams)


@dataclass(frozen=True)
class OffloadVariant:
    """One variant of ``bench.offload.run`` (a value of ``variants``)."""

    step_ms: float | None = None
    peak_gib: float | None = None
    vs_plain: float | None = None
    h2d_gbps: float | None = None
    d2h_gbps: float | None = None
    estimated_traffic: bool = False  # the GB/s are estimated from the parameter traffic, not counted
    error: str | None = None
    skipped: str | None = None
    # the PCIe floor (bench/offload/floor.py; shardfuse variants of files written since it exists)
    floor_ms: float | None = None
    vs_floor: float | None = None
    floor_bound: str | None = None  # "h2d", "d2h" or "compute"
    phase_floor_ms: float | None = None
    vs_phase_floor: float | None = None
    floor_h2d_gb: float | None = None
    floor_d2h_gb: float | None = None
    commit: str | None = None  # set where the variant was carried over from a run at another commit

    @classmethod
    def parse(cls, v: dict[str, Any]) -> OffloadVariant:
        floats = ("step_ms", "peak_gib", "vs_plain", "h2d_gbps", "d2h_gbps", "floor_ms", "vs_floor", "phase_floor_ms",
                  "vs_phase_floor", "floor_h2d_gb", "floor_d2h_gb")  # fmt: skip
        return cls(
            **{k: num(v.get(k)) for k in floats},
            estimated_traffic=v.get("traffic") == "estimated", error=_text(v.get("error")),
            skipped=_text(v.get("skipped")) if "skipped" in v else None, floor_bound=_text(v.get("floor_bound")),
            commit=_text(v.get("commit")),
        )  # fmt: skip


@dataclass(frozen=True)
class CappedRun:
    """``capped``: shardfuse training a model larger than the GPU memory it is allowed."""

    model: str | None = None
    model_gib: float | None = None
    budget_gib: float | None = None
    model_over_budget: float | None = None
    step_ms: float | None = None
    samples_per_s: float | None = None
    peak_gib: float | None = None
    error: str | None = None

    @classmethod
    def parse(cls, c: dict[str, Any]) -> CappedRun:
        keys = ("model_gib", "budget_gib", "model_over_budget", "step_ms", "samples_per_s", "peak_gib")
        model, error = c.get("model"), c.get("error")
        return cls(str(model) if model is not None else None, **{k: num(c.get(k)) for k in keys},
                   error=str(error) if error is not None else None)  # fmt: skip


@dataclass(frozen=True)
class OffloadConfig:
    present: bool = False
    layers: int | None = None
    width: int | None = None
    batch: int | None = None
    slices: int | None = None
    microbatches: int | None = None
    steps: int | None = None
    warmup: int | None = None
    params_m: float | None = None
    model_gib: float | None = None
    link_h2d_gbps: float | None = None  # pinned copy bandwidth measured in the same job (``link``)
    link_d2h_gbps: float | None = None
    link_duplex_gbps: float | None = None

    @classmethod
    def parse(cls, v: Any) -> OffloadConfig:
        c = _obj(v)
        link = _obj(c.get("link"))
        ints = ("layers", "width", "batch", "slices", "microbatches", "steps", "warmup")
        return cls(bool(c), **{k: _int(c.get(k)) for k in ints}, params_m=num(c.get("params_m")),
                   model_gib=num(c.get("model_gib")), link_h2d_gbps=num(link.get("h2d_gbps")),
                   link_d2h_gbps=num(link.get("d2h_gbps")), link_duplex_gbps=num(link.get("duplex_gbps")))  # fmt: skip


@dataclass(frozen=True)
class OffloadFile:
    config: OffloadConfig
    variants: dict[str, OffloadVariant]  # in file order
    capped: CappedRun | None  # None when the file has no capped run

    @classmethod
    def parse(cls, data: dict[str, Any]) -> OffloadFile:
        raw = _obj(data.get("variants"))
        variants = {str(k): OffloadVariant.parse(v) for k, v in raw.items() if isinstance(v, dict)}
        capped = _obj(data.get("capped"))
        return cls(OffloadConfig.parse(data.get("config")), variants, CappedRun.parse(capped) if capped else None)
