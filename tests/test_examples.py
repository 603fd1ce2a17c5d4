"""The example model (``examples/llama.py``) and the quickstart training script (``examples/train.py``).

The script runs in subprocesses with 2 gloo ranks on the CPU, as the README starts it (``python3
examples/train.py``: a script, not a module). ``TRITON_INTERPRET`` is set to 0 there so
shardfuse takes its PyTorch reference kernels on CPU tensors (the interpreted Triton path is covered by the
kernel tests and would make these runs slow).
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from examples.llama import (
    DecoderLayer,
    Llama,
    LlamaConfig,
    RMSNorm,
    apply_rope,
    count_params,
    next_token_loss,
    rope_tables,
)

REPO = Path(__file__).resolve().parents[1]


def _script_env() -> dict[str, str]:
    env = dict(os.environ)
    env["TRITON_INTERPRET"] = "0"
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("OMP_NUM_THREADS", None)  # the script's own launcher divides the cores among its ranks
    # As a user starts it from a shell: not under torchrun, whatever an earlier test left in this process.
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


# ------------------------------------------------------------------------------------------------ the model


def test_benchmark_model_has_953m_params_by_formula():
    cfg = LlamaConfig()
    d, f, v, n = 2048, 5632, 32000, 16
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.ffn_dim, cfg.vocab_size) == (d, n, 16, f, v)
    assert cfg.num_params() == 2 * v * d + n * (4 * d * d + 3 * d * f + 2 * d) + d == 953_223_168
    with torch.device("meta"):  # no memory: only shapes
        assert count_params(Llama(cfg)) == 953_223_168


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_param_count_matches_formula(name):
    cfg = LlamaConfig.named(name)
    with torch.device("meta"):
        model = Llama(cfg)
    assert count_params(model) == cfg.num_params()
    assert model.output.weight is not model.tok_embeddings.weight  # untied
    assert isinstance(model.layers, torch.nn.ModuleList) and all(isinstance(m, DecoderLayer) for m in model.layers)


def test_forward_is_causal_and_deterministic():
    cfg = LlamaConfig.tiny()
    model = Llama(cfg).init_weights(3)
    tokens = torch.randint(0, cfg.vocab_size, (2, 29))  # odd length below max_seq_len
    logits = model(tokens)
    assert logits.shape == (2, 29, cfg.vocab_size) and torch.isfinite(logits).all()
    changed = tokens.clone()
    changed[:, 17:] = (changed[:, 17:] + 1) % cfg.vocab_size
    out2 = model(changed)
    torch.testing.assert_close(out2[:, :17], logits[:, :17], rtol=0, atol=0)  # the past never sees the future
    assert not torch.allclose(out2[:, 17:], logits[:, 17:])
    one = model(tokens[:, :1])  # seq 1
    torch.testing.assert_close(one[:, 0], logits[:, 0], rtol=1e-5, atol=1e-5)
    loss = next_token_loss(logits[:, :-1], tokens[:, 1:])
    ref = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, cfg.vocab_size), tokens[:, 1:].reshape(-1))
    torch.testing.assert_close(loss, ref)
    assert abs(loss.item() - math.log(cfg.vocab_size)) < 1.0  # small logits at init: close to uniform


def test_init_weights_is_deterministic_per_seed():
    cfg = LlamaConfig.tiny()
    a, b, c = Llama(cfg).init_weights(5), Llama(cfg).init_weights(5), Llama(cfg).init_weights(6)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0)
        if name.endswith("norm.weight"):
            assert torch.equal(pa, torch.ones_like(pa))
        else:
            assert not torch.equal(pa, pc), name
    assert a.layers[0].attention.wq.weight.std().item() == pytest.approx(0.02, rel=0.1)


def test_rmsnorm_matches_formula():
    norm = RMSNorm(13, eps=1e-5)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(3, 5, 13)
    ref = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight
    torch.testing.assert_close(norm(x), ref)
    # Under mixed precision the wrapper hands the module bf16 weights: the output stays bf16, the statistics fp32.
    half = norm.to(torch.bfloat16)
    out = half(x.bfloat16())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


def test_rope_preserves_norm_and_depends_on_offset_only():
    head_dim, seq = 16, 11
    rope = rope_tables(head_dim, seq, 10000.0)
    q = torch.randn(head_dim).expand(1, 1, seq, head_dim)
    k = torch.randn(head_dim).expand(1, 1, seq, head_dim)
    rq, rk = apply_rope(q, rope), apply_rope(k, rope)
    torch.testing.assert_close(rq.norm(dim=-1), q.norm(dim=-1))
    scores = (rq[0, 0] @ rk[0, 0].T)  # scores[i, j] for the same vectors placed at positions i and j
    for off in range(-3, 4):
        diag = torch.diagonal(scores, off)
        torch.testing.assert_close(diag, diag[:1].expand_as(diag), rtol=1e-4, atol=1e-4)


def test_bad_config_and_input_errors():
    with pytest.raises(ValueError, match="dim=64 n_heads=3"):
        LlamaConfig(dim=64, n_heads=3)
    with pytest.raises(ValueError, match="dim=60 n_heads=4"):  # head size 15 is odd
        LlamaConfig(dim=60, n_heads=4)
    with pytest.raises(ValueError, match="LlamaConfig.n_layers must be >= 1, got 0"):
        LlamaConfig(n_layers=0)
    with pytest.raises(ValueError, match="unknown model config 'huge'"):
        LlamaConfig.named("huge")
    model = Llama(LlamaConfig.tiny())
    with pytest.raises(ValueError, match=r"max_seq_len=32, got shape \(1, 33\)"):
        model(torch.zeros(1, 33, dtype=torch.long))
    with pytest.raises(ValueError, match=r"got shape \(5,\)"):
        model(torch.zeros(5, dtype=torch.long))


# ------------------------------------------------------------------------------------------------ the scripts


def test_train_script_runs_and_passes_parity(tmp_path):
    plot = tmp_path / "plots" / "train.png"
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / "train.py"), "--steps", "4", "--plot", str(plot)],
        cwd=REPO, env=_script_env(), capture_output=True, text=True, timeout=120,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "step   4/4" in proc.stdout, out[-4000:]
    # One progress line per step (loss, throughput, peak, elapsed, time left), then the run's summary.
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("step ")]
    assert len(lines) == 4, out[-4000:]
    pattern = re.compile(r"^step +(\d+)/4  loss \d+\.\d{4} +[\d,]+ tok/s/rank  peak RSS [\d.]+ GiB  "
                         r"elapsed [\d.ms]+  eta [\d.ms]+$")
    assert [int(pattern.match(ln).group(1)) for ln in lines] == [1, 2, 3, 4], lines
    assert lines[-1].endswith("eta 0.0s"), lines[-1]
    assert re.search(r"^trained 4 steps in [\d.ms]+: [\d,]+ tok/s/rank on average after the first step$",
                     proc.stdout, re.MULTILINE), out[-4000:]
    if importlib.util.find_spec("matplotlib") is not None:
        assert proc.stdout.rstrip().endswith(f"plot of loss and throughput: {plot}"), out[-4000:]  # the last line
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert not plot.exists() and "plot" not in proc.stdout
    threads = max(1, len(os.sched_getaffinity(0)) // 2)  # 2 ranks share the cores, as under torchrun
    assert f", {threads} CPU thread(s) per rank" in proc.stdout, out[-4000:]
    assert "parity vs unsharded (fp32)" in proc.stdout and "\nPASS" in proc.stdout, out[-4000:]
    assert "FAIL" not in proc.stdout


def test_train_script_rejects_bad_arguments():
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / "train.py"), "--seq-len", "64"],
        cwd=REPO, env=_script_env(), capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode != 0 and "exceeds the tiny config's max_seq_len=32" in proc.stderr


def test_parity_check_can_fail(capsys):
    from examples.train import TOL_FP32, compare

    cfg = LlamaConfig.tiny()
    init = Llama(cfg).init_weights(0)
    init_sd = {k: v.clone() for k, v in init.state_dict().items()}
    ref = Llama(cfg).init_weights(1)  # "trained": moved away from init
    state = {k: v.clone() for k, v in ref.state_dict().items()}
    losses = [5.0, 4.5, 4.25]
    assert compare(losses, list(losses), state, ref, init_sd, mixed=False)
    assert capsys.readouterr().out.endswith("PASS\n")

    bumped = dict(state)
    bumped["layers.1.feed_forward.w2.weight"] = state["layers.1.feed_forward.w2.weight"] + 3 * TOL_FP32[1]
    assert not compare(losses, list(losses), bumped, ref, init_sd, mixed=False)
    out = capsys.readouterr().out
    assert "at layers.1.feed_forward.w2.weight" in out and out.endswith("FAIL\n")
    assert not compare(losses, [5.0, 4.5, 4.25 + 3 * TOL_FP32[0]], state, ref, init_sd, mixed=False)
    assert not compare([5.0, float("nan"), 4.0], [5.0, float("nan"), 4.0], state, ref, init_sd, mixed=False)
    nan_state = dict(state)
    nan_state["norm.weight"] = torch.full_like(state["norm.weight"], float("nan"))
    assert not compare(losses, list(losses), nan_state, ref, init_sd, mixed=True)
    # Wrapper-inserted names are tolerated; missing or extra names fail.
    assert compare(losses, list(losses), {"_fsdp_wrapped_module." + k: v for k, v in state.items()}, ref, init_sd,
                   mixed=True)
    assert not compare(losses, list(losses), {k: v for k, v in state.items() if k != "output.weight"}, ref, init_sd,
                       mixed=False)
    assert "state dict names differ" in capsys.readouterr().out


def test_script_argument_errors():
    from examples.train import parse_args, resolve_defaults

    with pytest.raises(SystemExit, match="--steps must be >= 1, got 0"):
        resolve_defaults(parse_args(["--steps", "0"]), use_cuda=False)
    with pytest.raises(SystemExit, match="--world-size must be >= 1, got 0"):
        resolve_defaults(parse_args(["--world-size", "0"]), use_cuda=False)
    args = resolve_defaults(parse_args([]), use_cuda=False)
    assert (args.config, args.steps, args.mixed_precision, args.seq_len) == ("tiny", 8, False, 32)
    args = resolve_defaults(parse_args([]), use_cuda=True)
    assert (args.config, args.steps, args.mixed_precision, args.seq_len) == ("small", 20, True, 1024)


def test_threads_per_rank(monkeypatch):
    from examples.train import threads_per_rank

    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert threads_per_rank(1) == cores
    assert threads_per_rank(3) == max(1, cores // 3)
    assert threads_per_rank(10 * cores) == 1  # more ranks than cores: still one thread each
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert threads_per_rank(2) == 3  # an explicit setting wins


def test_mesh_argument():
    from examples.train import check_mesh, parse_args

    args = parse_args(["--mesh", "2,3"])
    assert (args.mesh, args.world_size) == ((2, 3), 6)  # spawned without torchrun: R * S processes
    assert parse_args(["--mesh", "1,2", "--world-size", "2"]).mesh == (1, 2)
    assert (parse_args([]).mesh, parse_args([]).world_size) == (None, 2)  # the quickstart is unchanged
    for bad in ("2x2", "2", "0,4", "2,2,1", "a,b"):
        with pytest.raises(SystemExit):  # argparse: "expected R,S (replicas,shards), two integers >= 1"
            parse_args(["--mesh", bad])
    check_mesh(None, 3)
    check_mesh((2, 2), 4)
    with pytest.raises(SystemExit, match="--mesh 2,3 needs R \\* S = 6 processes, but the world size is 4"):
        check_mesh((2, 3), 4)


def test_progress_line_and_time_left():
    from examples.train import fmt_seconds, progress_line

    assert [fmt_seconds(s) for s in (0.04, 9.96, 42.4, 185.0, 3725.0, -1.0)] == [
        "0.0s", "10.0s", "42s", "3m05s", "1h02m", "0.0s"]
    # The first step (warm-up) is left out of the estimate once there are others: 7 steps left x 2 s.
    line = progress_line(3, 10, 2.5, 12345.6, "GPU", "peak mem 1.00 GiB", [30.0, 2.0, 2.0])
    assert line == ("step   3/10  loss 2.5000      12,346 tok/s/GPU  peak mem 1.00 GiB  elapsed 34s  eta 14s")
    assert progress_line(1, 4, 1.0, 1.0, "rank", "p", [3.0]).endswith("eta 9.0s")


def test_plot_is_written_or_skipped_quietly(tmp_path, monkeypatch):
    from examples.train import write_plot

    assert write_plot("", [1.0, 0.5], [10.0, 12.0], "rank") is None
    path = tmp_path / "sub" / "train.png"
    if importlib.util.find_spec("matplotlib") is not None:
        assert write_plot(str(path), [3.0, 2.0, 1.5], [10.0, 12.0, 11.0], "rank") == str(path)
        assert path.read_bytes()[:4] == b"\x89PNG"
        path.unlink()
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed: the import raises ImportError
    assert write_plot(str(path), [3.0, 2.0], [10.0, 12.0], "rank") is None
    assert not path.exists()
