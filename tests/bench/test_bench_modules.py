"""The benchmark code runs as modules from the repository root, without ``sys.path`` hacks.

``python -m bench.report`` / ``bench.regress`` / ``bench.e2e.host_overhead`` and ``torchrun -m bench.e2e.run``
run in subprocesses started in the repository root with no ``PYTHONPATH``: ``-m`` alone must make ``bench``,
``examples`` and ``shardfuse`` importable. ``bench/gpu_suite.sh`` must start every benchmark that way, and
its ``regress`` and ``kernels-pb`` stages are run here on the CPU (nothing to time, the plumbing only).
"""

from __future__ import annotations

import ast
import json
import math
import os
import pstats
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.common import free_port
from tests.bench._payloads import e2e_payload, kernels_payload, make_results_dir

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"


def _module_env(**extra: str) -> dict[str, str]:
    """This environment without PYTHONPATH (``-m`` from the root must suffice), the reference kernels on CPU."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(TRITON_INTERPRET="0", OMP_NUM_THREADS="1", **extra)
    return env


def _run(args: list[str], timeout: float = 120, **extra_env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=REPO, env=_module_env(**extra_env), capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


# ------------------------------------------------------------------------------------------------ static checks


def _sys_path_uses(path: Path) -> list[int]:
    """Lines of ``path`` that touch ``sys.path`` (insert, append, assignment, reading)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return sorted(
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr == "path"
        and isinstance(node.value, ast.Name) and node.value.id == "sys"
    )  # fmt: skip


NO_SYS_PATH = sorted(
    [*BENCH.rglob("*.py"), *(REPO / "examples").rglob("*.py"), REPO / "tests" / "test_docs.py"],
)


@pytest.mark.parametrize("path", NO_SYS_PATH, ids=lambda p: str(p.relative_to(REPO)))
def test_no_sys_path_hacks(path: Path) -> None:
    lines = _sys_path_uses(path)
    assert not lines, (
        f"{path.relative_to(REPO)} touches sys.path at lines {lines}: run it as a module from the repository "
        "root (python -m bench.x.y) instead; pytest gets the root through pyproject's pythonpath"
    )


def _suite_commands() -> list[str]:
    """bench/gpu_suite.sh's lines, continuation lines joined."""
    return (BENCH / "gpu_suite.sh").read_text().replace("\\\n", " ").splitlines()


def test_gpu_suite_starts_benchmarks_as_modules() -> None:
    lines = [ln for ln in _suite_commands() if not ln.lstrip().startswith("#")]
    as_script = [ln.strip() for ln in lines if re.search(r"(python3?|torchrun)\b[^|;]*\sbench/\S+\.py\b", ln)
                 and "pytest" not in ln]  # fmt: skip
    assert not as_script, f"benchmarks started as scripts (use python3 -m / torchrun -m): {as_script}"
    modules = sorted({m for ln in lines for m in re.findall(r"\s-m\s+(bench(?:\.\w+)+)", ln)})
    assert {"bench.e2e.run", "bench.offload.run", "bench.kernels.run", "bench.regress"} <= set(modules), modules
    missing = [m for m in modules if not (REPO / (m.replace(".", "/") + ".py")).is_file()]
    assert not missing, f"gpu_suite.sh runs modules that do not exist: {missing}"


def test_gpu_suite_compares_kernels_with_pytest_benchmark() -> None:
    text = " ".join(_suite_commands())
    for flag in ("--benchmark-autosave", "--benchmark-compare", "--benchmark-compare-fail", "--benchmark-storage"):
        assert flag in text, f"gpu_suite.sh's kernels-pb stage lacks {flag}"
    assert "bench/kernels/test_bench_kernels.py" in text
    assert not re.search(r"bench\.regress\S*\s+\S*kernels\.json", text), "kernels.json goes to pytest-benchmark"


def test_free_port_is_bindable() -> None:
    port = free_port()
    assert 0 < port < 65536
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


# ------------------------------------------------------------------------------------------------ as modules


def test_report_and_regress_run_as_modules(tmp_path: Path) -> None:
    results = make_results_dir(tmp_path / "results")
    proc = _run([sys.executable, "-m", "bench.report", "--results", str(results), "--summary"], timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "tok/s/GPU" in proc.stdout and "best peer, same job" in proc.stdout  # the README's headline table
    new = tmp_path / "e2e_2gpu.json"
    new.write_text(json.dumps(e2e_payload(2, (113.7 * 1.2, 52.3))))
    stored = results / "h200" / "e2e_2gpu.json"
    proc = _run([sys.executable, "-m", "bench.regress", str(new), "--baseline", str(stored)], timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAIL" in proc.stdout and "shardfuse 8k" in proc.stdout
    kern = tmp_path / "kernels.json"
    kern.write_text(json.dumps(kernels_payload(1.2)))
    proc = _run([sys.executable, "-m", "bench.regress", str(kern), "--results", str(results)], timeout=60)
    assert proc.returncode == 2 and "pytest-benchmark" in proc.stderr, proc.stdout + proc.stderr


def test_host_overhead_runs_as_module(capsys: pytest.CaptureFixture) -> None:
    proc = _run([sys.executable, "-m", "bench.e2e.host_overhead", "--units", "2", "--reps", "2", "--steps", "3"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    m = re.search(r"plain ([\d.]+) ms/step, shardfuse ([\d.]+) ms/step: (-?[\d.]+) ms per step", proc.stdout)
    assert m, proc.stdout
    assert float(m.group(1)) > 0 and float(m.group(2)) > 0
    from bench.e2e.host_overhead import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--steps", "0"])
    assert "--steps must be >= 1, got 0" in capsys.readouterr().err


def test_host_profile_runs_as_module(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "-m", "bench.e2e.host_profile", "--device", "cpu", "--config", "tiny", "--impls", "shardfuse,fsdp2",
        "--steps", "2", "--top", "5", "--out", str(tmp_path),
    ]  # fmt: skip
    proc = _run(cmd, timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    for impl in ("shardfuse", "fsdp2"):
        m = re.search(rf"{impl}: median host enqueue ([\d.]+) ms, synchronised step ([\d.]+) ms", proc.stdout)
        assert m and 0 < float(m.group(1)) <= float(m.group(2)) + 0.05, proc.stdout
        stats = pstats.Stats(str(tmp_path / f"{impl}.pstats"))
        assert stats.total_calls > 0  # type: ignore[attr-defined]
    from bench.e2e.host_profile import parse_args

    for bad, message in ((["--impls", "baseline"], "unsupported --impls ['baseline']"),
                         (["--steps", "0"], "--steps must be >= 1, got 0")):  # fmt: skip
        with pytest.raises(SystemExit):
            parse_args(bad)
        assert message in capsys.readouterr().err


def test_e2e_bench_cpu_smoke(tmp_path: Path) -> None:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "-m", "bench.e2e.run", "--device", "cpu", "--config", "tiny", "--regime", "1k",
        "--impls", "shardfuse,fsdp2", "--steps", "2", "--warmup", "1", "--profile", str(tmp_path / "prof"),
    ]  # fmt: skip
    proc = _run(cmd, timeout=180, BENCH_OUT=str(tmp_path))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    result = json.loads((tmp_path / "cpu" / "e2e_2gpu.json").read_text())
    rows = {r["impl"]: r for r in result["results"]}
    assert set(rows) == {"baseline", "shardfuse", "fsdp2"}
    for impl, row in rows.items():
        assert "error" not in row and "skipped" not in row, (impl, row)
        assert row["step_ms"] > 0 and math.isfinite(row["loss_last"]) and row["seq"] == 32
    # Same weights, same data, one step of lr 1e-4 apart: the sharded runs train alike.
    assert abs(rows["shardfuse"]["loss_last"] - rows["fsdp2"]["loss_last"]) < 1e-2
    assert list((tmp_path / "prof").glob("shardfuse_1k_*.json")), "no profiler trace written"
    # A progress line per measurement: baseline, shardfuse, fsdp2 in the one round, the time left after the first.
    line = r"^-- \[(\d)/3\] round 0 (\S+) 1k \.\.\. \(elapsed \d+ s, left ([^)]+)\)$"
    progress = re.findall(line, proc.stdout, re.M)
    assert [(i, impl) for i, impl, _ in progress] == [("1", "baseline"), ("2", "shardfuse"), ("3", "fsdp2")], out
    assert progress[0][2] == "?" and all(left.startswith("~") for _, _, left in progress[1:]), progress


def test_e2e_cpu_run_writes_outside_results(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU smoke run must not land in bench/results/, where the report would show it as a GPU row."""
    from bench.common import RESULTS_DIR
    from bench.e2e.run import SMOKE_OUT, default_output

    monkeypatch.delenv("BENCH_OUT", raising=False)
    default_output(torch.device("cpu"))
    assert os.environ["BENCH_OUT"] == str(SMOKE_OUT) and not SMOKE_OUT.is_relative_to(RESULTS_DIR)
    assert SMOKE_OUT.relative_to(Path(__file__).resolve().parents[2]).parts[0] == "out"  # /out/ is git-ignored
    monkeypatch.setenv("BENCH_OUT", "/elsewhere")
    default_output(torch.device("cpu"))
    assert os.environ["BENCH_OUT"] == "/elsewhere"  # an explicit $BENCH_OUT wins
    monkeypatch.delenv("BENCH_OUT")
    default_output(torch.device("cuda", 0))
    assert "BENCH_OUT" not in os.environ  # a GPU run writes bench/results/<gpu>/ as before


def test_e2e_bench_argument_errors(capsys: pytest.CaptureFixture) -> None:
    from bench.e2e.run import parse_args

    for argv, message in [
        (["--impls", "shardfuse,deepspeed"], "unknown ['deepspeed']"),
        (["--steps", "0"], "need --steps >= 1"),
    ] + ([] if torch.cuda.is_available() else [(["--device", "cuda"], "no CUDA GPU is visible")]):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert message in capsys.readouterr().err
    assert parse_args(["--impls", "fsdp2, shardfuse", "--device", "cpu"]).impl_list == ["fsdp2", "shardfuse"]


def test_e2e_bench_hf_llama_cpu_smoke(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "-m", "bench.e2e.run", "--device", "cpu", "--model", "hf-llama", "--config", "tiny", "--regime", "1k",
        "--impls", "shardfuse,shardfuse-graph,fsdp2", "--steps", "2", "--warmup", "1",
    ]  # fmt: skip
    proc = _run(cmd, timeout=180, BENCH_OUT=str(tmp_path))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert not (tmp_path / "cpu" / "e2e_2gpu.json").exists(), "the HF run must not overwrite the decoder's result"
    result = json.loads((tmp_path / "cpu" / "e2e_hf_2gpu.json").read_text())
    cfg = result["config"]
    assert (cfg["model_kind"], cfg["model"], cfg["hf_class"]) == ("hf-llama", "tiny", "transformers.LlamaForCausalLM")
    assert cfg["hf_config"]["num_hidden_layers"] == cfg["n_layers"] == 2 and cfg["hf_config"]["use_cache"] is False
    assert cfg["params"] == 125_376 and cfg["regimes"] == {"1k": [1, 1024]}
    rows = {r["impl"]: r for r in result["results"]}
    assert set(rows) == {"baseline", "shardfuse", "shardfuse-graph", "fsdp2"}
    for impl, row in rows.items():
        assert "error" not in row and "skipped" not in row, (impl, row)
        assert row["regime"] == "1k" and row["step_ms"] > 0 and math.isfinite(row["loss_last"]) and row["seq"] == 32
    # The same HF init (seeded) and data: the sharded runs train alike, the captured step as the eager one.
    losses = [rows[i]["loss_last"] for i in ("shardfuse", "shardfuse-graph", "fsdp2")]
    assert max(losses) - min(losses) < 5e-3, losses
    assert abs(rows["shardfuse"]["loss_last"] - rows["shardfuse-graph"]["loss_last"]) < 1e-5


def test_e2e_bench_model_specs() -> None:
    from bench.e2e.run import REGIMES, model_spec
    from examples.llama import DecoderLayer, Llama, LlamaConfig, count_params

    # The 7B-class decoder: Llama-2-7B's shape, counted by formula and on the meta device (nothing allocated).
    cfg = LlamaConfig.named("7b")
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.ffn_dim, cfg.vocab_size, cfg.max_seq_len) == (
        4096, 32, 32, 11008, 32000, 4096)  # fmt: skip
    assert cfg.num_params() == 6_738_415_616
    with torch.device("meta"):
        assert count_params(Llama(cfg)) == 6_738_415_616
    spec = model_spec("decoder", "7b")
    assert spec.layer_cls is DecoderLayer and spec.num_params == 6_738_415_616 and spec.max_seq_len == 4096
    assert spec.result_name(2) == "e2e_7b_2gpu" and model_spec("decoder", "bench").result_name(2) == "e2e_2gpu"
    assert REGIMES["4k"] == (1, 4096)
    n_matmul = 6_738_415_616 - 32000 * 4096
    assert spec.flops_per_step(1, 4096) == 6.0 * n_matmul * 4096 + 6.0 * 32 * 4096**2 * 4096
    # The same formula as before for the bench decoder (MFU of the stored results stays comparable).
    bench = model_spec("decoder", "bench")
    assert bench.flops_per_step(4, 2048) == 6.0 * (953_223_168 - 32000 * 2048) * 8192 + 6.0 * 16 * 2048**2 * 2048 * 4

    pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    hf = model_spec("hf-llama", "bench")
    assert hf.num_params == 852_559_872 and hf.layer_cls is LlamaDecoderLayer and hf.result_name(2) == "e2e_hf_2gpu"
    assert (hf.dim, hf.n_layers, hf.vocab_size, hf.config["n_kv_heads"]) == (2048, 16, 32000, 4)
    tiny = model_spec("hf-llama", "tiny")
    state = torch.get_rng_state()
    a, b = tiny.make(torch.device("cpu"), 5), tiny.make(torch.device("cpu"), 5)
    assert torch.equal(torch.get_rng_state(), state), "building the HF model must leave the global RNG alone"
    assert count_params(a) == tiny.num_params == 125_376
    layers = tiny.layers(a)
    assert layers is a.model.layers and len(layers) == 2 and all(isinstance(m, LlamaDecoderLayer) for m in layers)
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), f"{name}: the seeded HF init differs between two builds"
    tokens = torch.randint(0, tiny.vocab_size, (2, 9))
    assert tiny.logits(a, tokens).shape == (2, 9, tiny.vocab_size)


def test_e2e_bench_model_and_regime_arguments(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from bench.e2e.run import parse_args

    base = ["--device", "cpu"]
    assert parse_args(base).regime_list == ["8k", "1k"] and parse_args(base).model == "decoder"
    assert parse_args([*base, "--regime", "4k"]).regime_list == ["4k"]
    assert parse_args([*base, "--regime", "8k, 1k,4k"]).regime_list == ["8k", "1k", "4k"]
    assert parse_args([*base, "--config", "7b"]).config == "7b"
    for argv, message in [
        (["--regime", "2k"], "--regime '2k'"),
        (["--regime", "1k,1k"], "distinct regimes"),
        (["--model", "hf-llama", "--config", "7b"], "--model hf-llama --config 7b"),
        (["--model", "gpt"], "invalid choice"),
    ]:
        with pytest.raises(SystemExit):
            parse_args([*base, *argv])
        assert message in capsys.readouterr().err, argv
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "transformers" else real(n, *a))
    with pytest.raises(SystemExit):
        parse_args([*base, "--model", "hf-llama", "--config", "tiny"])
    assert "needs the transformers package" in capsys.readouterr().err
    assert parse_args(base).model == "decoder"  # the decoder never needs it


def test_gpu_suite_has_hf_and_7b_stages_by_name_only() -> None:
    lines = _suite_commands()
    text = "\n".join(lines)
    # step NAME SECONDS ...: run under timeout within the device's 10 minutes per command, as the e2e stage
    limits = {m.group(1): int(m.group(2)) for ln in lines if (m := re.search(r"\bstep (e2e\S*) (\d+) torchrun", ln))}
    assert set(limits) == {"e2e", "e2e-hf", "e2e-7b"} and max(limits.values()) <= 600, limits
    hf = next(ln for ln in lines if re.search(r"\bstep e2e-hf\b", ln))
    assert "-m bench.e2e.run --model hf-llama --regime 1k" in hf
    assert '"${E2E_IMPLS:-shardfuse,shardfuse-graph,fairscale,fsdp2}"' in hf and "${E2E_ARGS:-}" in hf
    b7 = next(ln for ln in lines if re.search(r"\bstep e2e-7b\b", ln))
    assert "-m bench.e2e.run --config 7b --regime 4k" in b7 and "--no-baseline" in b7
    assert '"${E2E_IMPLS:-shardfuse,shardfuse-graph,fsdp2,fairscale}"' in b7 and "${E2E_ARGS:-}" in b7
    assert re.search(r"^\s*e2e-hf\)", text, re.MULTILINE) and re.search(r"^\s*e2e-7b\)", text, re.MULTILINE)
    defaults = " ".join(ln for ln in lines if "STAGES=(" in ln or "STAGES+=(" in ln)
    assert "e2e" in defaults and "e2e-hf" not in defaults and "e2e-7b" not in defaults, defaults


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU run of the suite's stages (nothing is timed)")
def test_gpu_suite_regress_and_kernels_pb_stages(tmp_path: Path) -> None:
    out = tmp_path / "out"
    results = out / "work" / "results" / "cpu"
    results.mkdir(parents=True)
    payload = e2e_payload()
    payload["env"]["gpu_key"] = "cpu"
    (results / "e2e_2gpu.json").write_text(json.dumps(payload))
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])  # its python3 is ours
    proc = _run(["bash", str(BENCH / "gpu_suite.sh"), "regress", "kernels-pb"], timeout=300, OUT=str(out), PATH=path)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    summary = (out / "work" / "summary.txt").read_text()
    assert re.search(r"^regress\s+rc=0\b", summary, re.MULTILINE), summary + log[-3000:]
    assert re.search(r"^kernels-pb\s+rc=0\b", summary, re.MULTILINE), summary + log[-3000:]
    assert "nothing to compare" in (out / "work" / "regress.log").read_text()  # no stored cpu results
    assert "saving only" in log  # no stored pytest-benchmark run for the cpu
    assert (out / "suite.tgz").is_file()
