"""The documentation stays correct: its code blocks run, its links resolve, and the benchmark report works.

Code blocks in ``docs/*.md`` (convention documented in ``docs/index.md``):

- ```` ```python run ````: executed in a fresh namespace, in this process, on the CPU;
- ```` ```python run-dist ````: the same, inside a one-process gloo group created before the block and
  destroyed after it (in a subprocess when this process already has a process group);
- ```` ```python ````: shown only (needs GPUs, torchrun or another library).

The conftest turns Triton's interpreter on without a GPU, so kernel calls in the blocks run the Triton code.
Also tested here: ``bench/report.py`` renders synthetic results of every runner's schema, rewrites a README's
results table, and ``bench/regress.py`` flags a 20% slowdown and passes a 1% one.
"""

from __future__ import annotations

import ast
import copy
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import regress, report  # noqa: E402

RUN = "python run"
RUN_DIST = "python run-dist"
# Every fence info string allowed in the docs: a typo such as "python runn" must not silently skip a block.
KNOWN_INFO = {"", "python", RUN, RUN_DIST, "bash", "text", "console", "json", "toml"}
BLOCK_LIMIT_S = 10.0  # each runnable block must stay quick (a few seconds on CPU; first calls pay imports)

FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


def doc_files() -> list[Path]:
    return sorted(DOCS.glob("*.md"))


def code_blocks(path: Path) -> list[tuple[int, str, str]]:
    """``(line number of the opening fence, info string, code)`` for every fenced block of ``path``."""
    text = path.read_text()
    return [(text.count("\n", 0, m.start()) + 1, m.group(1).strip(), m.group(2)) for m in FENCE.finditer(text)]


def runnable_blocks() -> list[Any]:
    params = []
    for path in doc_files():
        for line, info, code in code_blocks(path):
            if info in (RUN, RUN_DIST):
                params.append(pytest.param(path, line, info, code, id=f"{path.name}:{line}"))
    return params


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_in_subprocess(code: str, filename: str, with_group: bool) -> None:
    """Fallback when this process already belongs to a process group: run the block in a fresh interpreter."""
    prologue = ""
    if with_group:
        prologue = "import torch.distributed as dist\ndist.init_process_group('gloo', rank=0, world_size=1)\n"
    epilogue = "import torch.distributed as dist\nif dist.is_initialized():\n    dist.destroy_process_group()\n"
    script = f"{prologue}exec(compile({code!r}, {filename!r}, 'exec'), {{'__name__': '__docs__'}})\n{epilogue}"
    env = dict(
        os.environ,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        TRITON_INTERPRET="0",
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, f"{filename} failed:\n{proc.stdout}\n{proc.stderr}"


@pytest.mark.parametrize(("path", "line", "info", "code"), runnable_blocks())
def test_doc_block_runs(path: Path, line: int, info: str, code: str, monkeypatch: pytest.MonkeyPatch) -> None:
    filename = f"{path.relative_to(REPO)}:{line}"
    compiled = compile(code, filename, "exec")
    with_group = info == RUN_DIST
    start = time.perf_counter()
    if dist.is_available() and dist.is_initialized():
        _run_in_subprocess(code, filename, with_group)
    else:
        # A free port for blocks that create their own group (they use os.environ.setdefault).
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(_free_port()))
        try:
            if with_group:
                dist.init_process_group("gloo", rank=0, world_size=1)
            exec(compiled, {"__name__": "__docs__"})
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    elapsed = time.perf_counter() - start
    assert elapsed < BLOCK_LIMIT_S, f"{filename} took {elapsed:.1f}s: keep doc examples small"


def test_fence_info_strings_are_known() -> None:
    bad = [
        f"{p.name}:{line}: {info!r}" for p in doc_files() for line, info, _ in code_blocks(p) if info not in KNOWN_INFO
    ]
    assert not bad, f"unknown code fence info strings (allowed: {sorted(KNOWN_INFO)}): {bad}"


def test_docs_have_runnable_blocks() -> None:
    counts = {p.name: sum(info in (RUN, RUN_DIST) for _, info, _ in code_blocks(p)) for p in doc_files()}
    assert sum(counts.values()) >= 25, counts
    for name in ("index.md", "api.md", "kernels.md", "migration.md"):
        assert counts.get(name, 0) >= 1, f"{name} has no runnable example: {counts}"


def test_python_blocks_parse() -> None:
    """Shown-only blocks are not run, but they must at least be valid Python (signatures go in ``text`` blocks)."""
    errors = []
    for p in doc_files():
        for line, info, code in code_blocks(p):
            if info == "python":
                try:
                    ast.parse(code)
                except SyntaxError as exc:
                    errors.append(f"{p.name}:{line + (exc.lineno or 0)}: {exc.msg}")
    assert not errors, errors


def test_api_md_names_every_public_name() -> None:
    import shardfuse
    import shardfuse.kernels

    text = (DOCS / "api.md").read_text()
    names = [*shardfuse.__all__, *shardfuse.kernels.__all__]
    missing = [n for n in names if f"`{n}" not in text and f"`shardfuse.{n}`" not in text]
    assert not missing, f"public names not documented in docs/api.md: {missing}"


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _anchors(text: str) -> set[str]:
    return {report._anchor(re.sub(r"`", "", m)) for m in re.findall(r"^#+\s+(.*)$", text, re.MULTILINE)}


def test_relative_links_resolve() -> None:
    broken = []
    for p in doc_files():
        text = p.read_text()
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):
                continue  # external
            file_part, _, anchor = target.partition("#")
            dest = (p.parent / file_part).resolve() if file_part else p
            if not dest.exists():
                broken.append(f"{p.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest.read_text()):
                broken.append(f"{p.name}: {target} (no such heading)")
    assert not broken, broken


def _library_strings() -> list[str]:
    """Every string literal of the package, f-string placeholders rendered as ``{}``."""
    out = []
    for f in (REPO / "shardfuse").rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                out.append(node.value)
            elif isinstance(node, ast.JoinedStr):
                out.append("".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values))
    return out


def test_troubleshooting_quotes_real_messages() -> None:
    """Each entry heading of troubleshooting.md quotes (part of) a message the library really raises."""
    text = (DOCS / "troubleshooting.md").read_text()
    quoted = re.findall(r"^### `(.+)`\s*$", text, re.MULTILINE)
    assert len(quoted) >= 20, quoted
    strings = _library_strings()
    stale = [q for q in quoted if not any(q in s for s in strings)]
    assert not stale, f"troubleshooting.md quotes messages that shardfuse no longer raises: {stale}"


# ------------------------------------------------------------------------------------------------ benchmark report

ENV = {
    "date": "2026-11-30T12:00:00+00:00",
    "commit": "abc1234",
    "python": "3.12.3",
    "torch": "2.13.0+cu130",
    "gpu_key": "h200",
    "triton": "3.6.0",
    "gpu_name": "NVIDIA H200",
    "gpu_count": 2,
    "cuda": "13.0",
    "nccl": "2.28.9",
}


def e2e_payload(world: int = 2, shardfuse_ms: tuple[float, float] = (113.7, 52.3)) -> dict[str, Any]:
    """An ``e2e_<N>gpu.json`` as ``bench/e2e/run.py`` writes it (rows of every kind: measured, skipped)."""
    rows: list[dict[str, Any]] = []
    times = {"baseline": (121.8, 38.7), "shardfuse": shardfuse_ms, "fsdp2": (120.7, 70.0), "fsdp1": (121.7, 76.5)}
    for k, (regime, (batch, seq)) in enumerate({"8k": (4, 2048), "1k": (1, 1024)}.items()):
        for impl, ms in times.items():
            rows.append(
                {
                    "impl": impl,
                    "regime": regime,
                    "batch": batch,
                    "seq": seq,
                    "gpus": 1 if impl == "baseline" else world,
                    "step_ms": ms[k],
                    "step_ms_rank0": ms[k],
                    "step_ms_list_rank0": [ms[k]] * 3,
                    "tok_s_gpu": batch * seq / (ms[k] * 1e-3),
                    "loss_last": 10.37,
                    "mfu": 0.4321,
                    "peak_gib": 17.25,
                    "mem_after_wrap_gib_rank0": 2.0,
                }
            )
        rows.append({"impl": "fairscale", "regime": regime, "skipped": "not importable: No module named 'fairscale'"})
    config = {
        "model": "bench",
        "dim": 2048,
        "n_layers": 16,
        "n_heads": 16,
        "ffn_dim": 5632,
        "vocab_size": 32000,
        "max_seq_len": 2048,
        "params": 953223168,
        "world_size": world,
        "device": "cuda",
        "steps": 15,
        "warmup": 3,
        "lr": 1e-4,
        "optimizer": "AdamW (foreach default)",
        "compute_dtype": "bfloat16",
        "reduce_dtype": "float32",
        "peak_tflops": 989.0,
        "regimes": {"8k": [4, 2048], "1k": [1, 1024]},
        "nccl_nvls_enable": "0",
    }
    return {"env": dict(ENV, gpu_count=world), "config": config, "results": rows}


def kernels_payload(scale: float = 1.0) -> dict[str, Any]:
    """A ``kernels.json`` as ``bench/kernels/run.py`` writes it."""
    rows = []
    for n in (1 << 20, 1 << 26):
        for family, name, speedups in (
            ("shard_cast", f"fp32->bf16 flat shard n={n}", {"copy_": 1.01, "fsdp2_foreach_copy_x2": 1.87}),
            ("post_divide", f"fp32->fp32 += n={n}", {"div.to+add_": 2.46}),
        ):
            nbytes = 6 * n
            ms = nbytes / 3911e9 * 1e3 * scale
            gbps = nbytes / (ms * 1e-3) / 1e9
            rows.append(
                {
                    "family": family,
                    "name": name,
                    "numel": n,
                    "num_tensors": 1,
                    "bytes": nbytes,
                    "shardfuse_ms": ms,
                    "shardfuse_gbps": gbps,
                    "pct_copy_bw": 100 * gbps / 4213.0,
                    "baselines": {k: {"ms": ms * v, "speedup": v} for k, v in speedups.items()},
                }
            )
    return {"env": ENV, "copy_bandwidth_gbps": 4213.0, "sizes": [1 << 20, 1 << 26], "rows": rows}


def offload_payload(shardfuse_ms: float = 587.4) -> dict[str, Any]:
    """An ``offload.json`` as ``bench/offload/run.py`` writes it."""
    variants: dict[str, dict[str, Any]] = {
        "plain": {"step_ms": 508.1, "peak_gib": 8.94, "losses": [1.0], "h2d_gbps": 0.0, "d2h_gbps": 0.0},
        "shardfuse": {
            "step_ms": shardfuse_ms,
            "peak_gib": 3.17,
            "losses": [1.0],
            "h2d_gb_per_step": 8.6,
            "d2h_gb_per_step": 4.3,
            "h2d_gbps": 14.64,
            "d2h_gbps": 7.32,
        },
        "shardfuse_bf16": {"error": "RuntimeError: something broke"},
        "fairscale": {"skipped": "not importable: No module named 'fairscale'"},
        "fsdp2_cpu_offload": {
            "step_ms": 771.9,
            "peak_gib": 7.57,
            "losses": [1.0],
            "h2d_gbps": 11.13,
            "d2h_gbps": 5.56,
            "traffic": "estimated",
        },
    }
    for v in variants.values():
        v["wall_s"] = 1.0
        if "step_ms" in v:
            v["vs_plain"] = v["step_ms"] / 508.1
    config = {
        "width": 8192,
        "layers": 16,
        "batch": 4096,
        "slices": 4,
        "microbatches": 4,
        "lr": 1e-3,
        "warmup": 3,
        "steps": 5,
        "params_m": 1073.9,
        "model_gib": 4.0,
    }
    capped = {
        "model": "64 x Linear(4096, 4096) + ReLU",
        "params_m": 1074.0,
        "model_gib": 4.0,
        "budget_gib": 0.89,
        "model_over_budget": 4.5,
        "plain_weights_fit": False,
        "num_slices": 64,
        "batch": 4096,
        "step_ms": 912.6,
        "samples_per_s": 4488.0,
        "peak_gib": 0.85,
        "losses": [1.0],
    }
    return {"env": dict(ENV, gpu_count=1), "config": config, "variants": variants, "capped": capped}


def write_results(root: Path, gpu: str = "h200", **payloads: dict[str, Any]) -> Path:
    d = root / gpu
    d.mkdir(parents=True, exist_ok=True)
    for name, payload in payloads.items():
        (d / f"{name}.json").write_text(json.dumps(payload))
    return d


@pytest.fixture
def results_dir(tmp_path: Path) -> Path:
    root = tmp_path / "results"
    write_results(root, "h200", e2e_2gpu=e2e_payload(2), kernels=kernels_payload(), offload=offload_payload())
    write_results(root, "h100", e2e_4gpu=e2e_payload(4, (118.4, 47.9)))
    (root / "h100" / "broken.json").write_text("{ not json")
    return root


def test_report_renders_synthetic_results(results_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "docs" / "benchmarks.md"
    assert report.main(["--results", str(results_dir), "--out", str(out), "--no-plots"]) == 0
    text = out.read_text()
    # one section per GPU, with the environment of each table
    assert "## H100 (NVIDIA H200)" in text and "## H200 (NVIDIA H200)" in text
    assert "NCCL 2.28.9" in text and "commit `abc1234`" in text and "triton 3.6.0" in text
    # e2e: step ms, tokens/s/GPU, MFU %, peak GiB, speedup vs FSDP2, skipped FairScale
    assert "| shardfuse `FullyShardedDataParallel` | 113.7 | 72,049 | 43.2 | 17.25 | 1.06x |" in text
    assert "| FSDP2 `fully_shard` | 70.0 | 14,629 | 43.2 | 17.25 | 1.00x |" in text
    assert "| shardfuse `FullyShardedDataParallel` | 47.9 | 21,378 |" in text  # the H100 4-GPU file
    assert "FairScale FSDP: skipped: not importable" in text
    # kernels: GB/s, % of copy bandwidth and the speedup over every baseline
    assert "**4,213 GB/s**" in text
    assert "| fp32->bf16 flat shard n=67108864 | 402.7 MB | 0.1030 | 3,911 | 92.8% | 1.01x | 1.87x |" in text
    assert "vs `div.to+add_`" in text and "2.46x" in text
    # offload: step time vs plain, host<->device GB/s (estimated ones marked), peak memory, capped run
    assert "| shardfuse `OffloadModel` | 587.4 | 1.16x | 14.6 | 7.3 | 3.17 |" in text
    assert "| FSDP2 `fully_shard` + `CPUOffloadPolicy` | 771.9 | 1.52x | 11.1* | 5.6* | 7.57 |" in text
    assert "error: RuntimeError: something broke" in text and "912.6" in text
    assert "`h100/broken.json`: not shown" in text
    assert "Plots were skipped" in text
    # the README summary goes to stdout when no --readme is given
    printed = capsys.readouterr().out
    assert "| H200 | training, 2 GPUs, 8K tokens/GPU | tokens/s/GPU | 72,049 (1.06x) | 67,871 | 67,313 | - |" in printed


def test_report_plots(results_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "site" / "benchmarks.md"
    assert report.main(["--results", str(results_dir), "--out", str(out)]) == 0
    pngs = sorted(p.name for p in (out.parent / "img").glob("*.png"))
    assert pngs == [
        "h100_e2e_4gpu_tokens.png",
        "h200_e2e_2gpu_tokens.png",
        "h200_kernels_gbps.png",
        "h200_offload_step.png",
    ]
    assert "](img/h200_kernels_gbps.png)" in out.read_text()


def test_report_without_results(tmp_path: Path) -> None:
    out = tmp_path / "benchmarks.md"
    assert report.main(["--results", str(tmp_path / "nothing"), "--out", str(out), "--no-plots"]) == 0
    assert "No benchmark results are stored yet" in out.read_text()
    (tmp_path / "empty" / "h100").mkdir(parents=True)
    assert report.main(["--results", str(tmp_path / "empty"), "--out", str(out)]) == 0
    assert "No benchmark results are stored yet" in out.read_text()


def test_report_tolerates_missing_keys(tmp_path: Path) -> None:
    e2e = e2e_payload()
    for row in e2e["results"]:
        row.pop("mfu", None)
        row.pop("peak_gib", None)
    del e2e["env"], e2e["config"]
    kern = kernels_payload()
    kern["rows"][0].pop("baselines")
    del kern["copy_bandwidth_gbps"]
    root = tmp_path / "r"
    write_results(root, "a100", e2e_2gpu=e2e, kernels=kern, offload={"variants": {}})
    out = tmp_path / "b.md"
    assert report.main(["--results", str(root), "--out", str(out), "--no-plots"]) == 0
    text = out.read_text()
    assert "_Environment: not recorded._" in text and "| 113.7 | 72,049 | - | - | 1.06x |" in text


def test_readme_table_is_rewritten(results_dir: Path, tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("# project\n\n## Results\n\nRESULTS_TABLE\n\n## Documentation\n")
    out = tmp_path / "docs" / "benchmarks.md"
    args = ["--results", str(results_dir), "--out", str(out), "--no-plots", "--readme", str(readme)]
    assert report.main(args) == 0
    first = readme.read_text()
    assert "RESULTS_TABLE" not in first and report.START_MARK in first and report.END_MARK in first
    assert "72,049 (1.06x)" in first and "](docs/benchmarks.md)" in first
    assert first.startswith("# project\n") and first.endswith("## Documentation\n")
    assert report.main(args) == 0
    assert readme.read_text() == first  # idempotent: the markers are found the second time
    with pytest.raises(ValueError, match="RESULTS_TABLE"):
        report.update_readme("no table here\n", ["x"])


def _regress(tmp_path: Path, name: str, old: dict[str, Any], new: dict[str, Any], *extra: str) -> int:
    root = tmp_path / "stored"
    write_results(root, "h200", **{name: old})
    new_path = tmp_path / "new" / f"{name}.json"
    new_path.parent.mkdir(exist_ok=True)
    new_path.write_text(json.dumps(new))
    return regress.main([str(new_path), "--results", str(root), *extra])


@pytest.mark.parametrize(
    ("name", "make", "slower"),
    [
        ("e2e_2gpu", lambda f: e2e_payload(2, (113.7 * f, 52.3)), "shardfuse 8k"),
        ("kernels", lambda f: kernels_payload(f), "shard_cast"),
        ("offload", lambda f: offload_payload(587.4 * f), "shardfuse"),
    ],
    ids=["e2e", "kernels", "offload"],
)
def test_regression_check(tmp_path: Path, capsys: pytest.CaptureFixture, name: str, make: Any, slower: str) -> None:
    old = make(1.0)
    assert _regress(tmp_path, name, old, make(1.20)) == 1
    out = capsys.readouterr().out
    assert "REGRESSION" in out and "+20.0%" in out and slower in out and "FAIL" in out
    assert _regress(tmp_path, name, old, make(1.01)) == 0
    assert "PASS" in capsys.readouterr().out
    assert _regress(tmp_path, name, old, make(0.80)) == 0  # faster is fine
    assert _regress(tmp_path, name, old, make(1.20), "--noise", "0.25") == 0  # a wider band


def test_regression_check_flags_a_failed_row_and_ignores_baselines(tmp_path: Path) -> None:
    old = e2e_payload()
    broken = copy.deepcopy(old)
    for row in broken["results"]:
        if row["impl"] == "shardfuse" and row["regime"] == "1k":
            for k in ("step_ms", "tok_s_gpu", "mfu", "peak_gib"):
                row.pop(k)
            row["error"] = "rank 0: RuntimeError: boom"
    assert _regress(tmp_path, "e2e_2gpu", old, broken) == 1
    slower_fsdp2 = copy.deepcopy(old)
    for row in slower_fsdp2["results"]:
        if row["impl"] == "fsdp2":
            row["step_ms"] *= 1.5
    assert _regress(tmp_path, "e2e_2gpu", old, slower_fsdp2) == 0


def test_regression_check_without_stored_result(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    new = tmp_path / "e2e_2gpu.json"
    new.write_text(json.dumps(e2e_payload()))
    assert regress.main([str(new), "--results", str(tmp_path / "none")]) == 0
    assert "nothing to compare" in capsys.readouterr().out
    assert report.main(["--compare", str(new), "--results", str(tmp_path / "none")]) == 0


def test_report_script_runs_standalone(results_dir: Path, tmp_path: Path) -> None:
    """``python bench/report.py --summary`` and ``python bench/regress.py`` work as plain scripts."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "report.py"), "--results", str(results_dir), "--summary"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "tokens/s/GPU" in proc.stdout
    new = tmp_path / "kernels.json"
    new.write_text(json.dumps(kernels_payload(1.2)))
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "regress.py"),
            str(new),
            "--baseline",
            str(results_dir / "h200" / "kernels.json"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAIL" in proc.stdout
