"""``bench.report`` on e2e files of the other models of ``bench.e2e.run``: ``e2e_hf_<N>gpu.json`` (``--model
hf-llama``, regime 1k) and ``e2e_7b_<N>gpu.json`` (``--config 7b``, regime 4k, no one-GPU baseline). Their rows
of the page's summary and their sections name the model, as the README's headline rows do; the decoder's files
(``model_kind`` absent or ``decoder``, ``bench`` config) render as they always did."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import report
from tests.bench._payloads import e2e_7b_payload, e2e_hf_payload, e2e_payload, e2e_rounds_payload, write_results

# e2e_hf_payload: medians one GPU 41, shardfuse 51, shardfuse-graph 26, FairScale 61, FSDP2 56 ms at 1 x 1024 tokens
README_HF = (
    "| H200 | training, 2 GPUs, HF Llama 853M, 1K tokens/GPU | tokens/s/GPU, median of 3 rounds "
    "| 20,078 (1.20x FairScale, 0.80x one GPU, 1.10x FSDP2) | 16,787 | 24,976 | 18,286 | - |"
)
README_HF_CAPTURED = (
    "| H200 | training, 2 GPUs, HF Llama 853M, 1K tokens/GPU, step captured (capture_step) "
    "| tokens/s/GPU, median of 3 rounds "
    "| 39,385 (2.35x FairScale, 1.58x one GPU, 2.15x FSDP2, 1.96x eager shardfuse) | 16,787 | 24,976 | 18,286 | - |"
)
# e2e_7b_payload: one run each of shardfuse 400, shardfuse-graph 390, FSDP2 440 ms at 1 x 4096 tokens; no one-GPU
# baseline and no FairScale, so neither has a ratio or a number
README_7B = "| H200 | training, 2 GPUs, 7B, 4K tokens/GPU | tokens/s/GPU | 10,240 (1.10x FSDP2) | - | - | 9,309 | - |"
README_7B_CAPTURED = (
    "| H200 | training, 2 GPUs, 7B, 4K tokens/GPU, step captured (capture_step) | tokens/s/GPU "
    "| 10,503 (1.13x FSDP2, 1.03x eager shardfuse) | - | - | 9,309 | - |"
)
# the decoder's rows (e2e_rounds_payload), without a model name
README_DECODER_1K = (
    "| H200 | training, 2 GPUs, 1K tokens/GPU | tokens/s/GPU, median of 3 rounds "
    "| 20,480 (1.08x FairScale, 0.84x one GPU, 1.38x FSDP2) | 18,963 | 24,381 | 14,841 | - |"
)
HF_TITLE = "### End-to-end training, 2 GPUs, Hugging Face LlamaForCausalLM (852.6M) (`e2e_hf_2gpu.json`)"
SEVEN_B_TITLE = "### End-to-end training, 2 GPUs, 7B-class decoder (6.7B) (`e2e_7b_2gpu.json`)"
CAPTURED_LABEL = "shardfuse, step captured by `capture_step` (CUDA graph)"


def _render(tmp_path: Path, plots: bool = False, **payloads: dict) -> tuple[str, str]:
    root = tmp_path / "results"
    write_results(root, "h200", **payloads)
    out = tmp_path / "docs" / "benchmarks.md"
    readme = tmp_path / "README.md"
    readme.write_text("# p\n\nRESULTS_TABLE\n")
    args = ["--results", str(root), "--out", str(out), "--readme", str(readme)]
    assert report.main(args + ([] if plots else ["--no-plots"])) == 0
    return out.read_text(), readme.read_text()


def _section(text: str, heading: str) -> str:
    """From ``heading`` to the next section of the same or a higher level."""
    start = text.index(heading)
    level = heading.split(" ", 1)[0]
    ends = [i for h in ("\n## ", f"\n{level} ") if (i := text.find(h, start + len(heading))) != -1]
    return text[start : min(ends, default=len(text))]


def _training_rows(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("| H200 | training")]


def test_summary_rows_name_the_model(tmp_path: Path) -> None:
    text, readme = _render(
        tmp_path, e2e_2gpu=e2e_rounds_payload(), e2e_hf_2gpu=e2e_hf_payload(), e2e_7b_2gpu=e2e_7b_payload()
    )
    rows = _training_rows(text)
    # the decoder's two rows as always, then the 7B's and the HF model's, each with its captured-step row
    assert len(rows) == 6
    assert rows[0].startswith("| H200 | training, 2 GPUs, 8K tokens/GPU | ") and rows[1] == README_DECODER_1K
    assert rows[2:] == [README_7B, README_7B_CAPTURED, README_HF, README_HF_CAPTURED]
    # the note under the table says what the model names stand for
    assert (
        "Training rows name their model unless it is the Llama-style decoder's `bench` config: "
        '"7B" = the Llama-style decoder in the shape of Llama-2-7B (6.7B parameters); '
        '"HF Llama 853M" = Hugging Face `transformers.LlamaForCausalLM` (852.6M parameters, random init).'
    ) in text
    # the README: headline rows only, the HF model's captured step against its best peer of the job (FSDP2 here)
    assert _training_rows(readme) == [] and "name their model" not in readme
    assert (
        "| 2x H200 | training, HF LlamaForCausalLM 853M, `capture_step` | 1,024 | 39,385 tok/s/GPU | FSDP2 18,286 "
        "| 2.15x | `abc1234` |"
    ) in readme


def test_hf_section(tmp_path: Path) -> None:
    text, _ = _render(tmp_path, e2e_hf_2gpu=e2e_hf_payload())
    hf = _section(text, HF_TITLE)
    assert "Llama-style decoder" not in hf
    assert (
        "Setup: Hugging Face `transformers.LlamaForCausalLM` (852.6M parameters, random init; `bench` config: "
        "hidden_size 2048, num_hidden_layers 16, num_attention_heads 16, num_key_value_heads 4, intermediate_size "
        "5632, vocab_size 32000, untied output layer, `sdpa` attention; transformers 4.57.1); bfloat16 compute;"
    ) in hf
    assert "#### 1K tokens per GPU (communication-bound), batch 1 x seq 1024" in hf
    assert "| vs FairScale | vs one GPU | vs FSDP2 | vs eager shardfuse |" in hf
    assert "| shardfuse `FullyShardedDataParallel` | 3 | 51.0 | 50.0-52.0 | 20,078 | 25.0 | 30.00 | 22.00 " in hf
    assert f"| {CAPTURED_LABEL} | 3 | 26.0 | 25.0-27.0 | 39,385 |" in hf
    assert "| 2.35x | 1.58x | 2.15x | 1.96x |" in hf
    assert f"- {CAPTURED_LABEL}: the CUDA graph's private memory pool kept 1.50 GiB reserved" in hf
    assert "ratios of the medians over 3 interleaved rounds in one job" in hf
    # "How these numbers are made" says how the file was made, and only for the model shown
    how = _section(text, "## How these numbers are made")
    assert "- `--model hf-llama` (`e2e_hf_<N>gpu.json`) trains Hugging Face `transformers.LlamaForCausalLM`" in how
    assert "`--config 7b`" not in how
    # the results list names the file
    assert "`e2e_hf_2gpu`" in text.split("## Summary")[0]


def test_7b_section(tmp_path: Path) -> None:
    text, _ = _render(tmp_path, e2e_7b_2gpu=e2e_7b_payload())
    seven = _section(text, SEVEN_B_TITLE)
    assert (
        "Setup: 6.7B-parameter 7B-class Llama-style decoder (`7b` config, the shape of Llama-2-7B: dim 4096, "
        "n_layers 32, n_heads 32, ffn_dim 11008, vocab_size 32000); bfloat16 compute;"
    ) in seven
    assert "#### 4K tokens per GPU, batch 1 x seq 4096" in seven
    # one run each: no rounds in the text
    assert (
        "The job ran 4K tokens per GPU, every implementation once per regime in this order: shardfuse -> "
        "shardfuse (captured) -> FSDP2." in seven
    )
    assert "_vs X: X's step time divided by this one's (above 1.00x is faster), one run each in the same job._" in seven
    assert "interleaved" not in seven and "median over rounds" not in seven
    # neither the one-GPU baseline nor FairScale was measured: no ratio columns against them
    assert (
        "| implementation | rounds | median step ms | min-max ms | median tokens/s/GPU | MFU % | peak GiB "
        "| peak above wrap GiB | vs FSDP2 | vs eager shardfuse |"
    ) in seven
    assert "vs one GPU" not in seven and "vs FairScale" not in seven
    assert (
        "| shardfuse `FullyShardedDataParallel` | 1 | 400.0 | 400.0 | 10,240 | 25.0 | 30.00 | 22.00 | 1.10x | - |"
        in (seven)
    )
    assert f"| {CAPTURED_LABEL} | 1 | 390.0 | 390.0 | 10,503 | 25.0 | 30.00 | 22.00 | 1.13x | 1.03x |" in seven
    assert "| FairScale FSDP | skipped | - | - | - | - | - | - | - | - |" in seven
    assert "- FairScale FSDP: skipped: not importable" in seven
    how = _section(text, "## How these numbers are made")
    assert "- `--config 7b` (`e2e_7b_<N>gpu.json`) trains the decoder in the shape of Llama-2-7B" in how
    assert "--model hf-llama" not in how


def test_decoder_files_name_no_model(tmp_path: Path) -> None:
    """Files of the decoder's bench config, with ``model_kind`` or without it (files written before the key): no
    model in their rows or titles, no note on model names, no bullet on other models."""
    with_kind = e2e_rounds_payload()
    with_kind["config"]["model_kind"] = "decoder"
    for i, payload in enumerate((e2e_rounds_payload(), with_kind)):
        text, readme = _render(tmp_path / str(i), e2e_2gpu=payload)
        assert README_DECODER_1K in text and README_DECODER_1K not in readme
        assert "### End-to-end training, 2 GPUs (`e2e_2gpu.json`)" in text
        assert "Setup: 953M-parameter Llama-style decoder (`bench` config: dim 2048, n_layers 16, n_heads 16" in text
        assert "name their model" not in text and "--model hf-llama" not in text and "--config 7b" not in text
        assert "| 2x H200 | training, 953M decoder, sharded, small batch | 1,024 | 20,480 tok/s/GPU | FairScale " \
            "18,963 | 1.08x | `abc1234` |" in readme
    text, readme = _render(tmp_path / "single", e2e_4gpu=e2e_payload(4))
    assert "| H200 | training, 4 GPUs, 1K tokens/GPU | tokens/s/GPU |" in text
    assert "| 4x H200 | training, 953M decoder, 4 GPUs | 8,192 |" in readme
    assert "### End-to-end training, 4 GPUs (`e2e_4gpu.json`)" in text


def test_e2e_model() -> None:
    old = report.e2e_model(e2e_payload()["config"])  # no model_kind
    assert (old.kind, old.config, old.title, old.short) == ("decoder", "bench", "", "")
    assert report.e2e_model({}) == report.E2EModel("decoder", "", "", "", "", "")
    seven = report.e2e_model(e2e_7b_payload()["config"])
    assert (seven.title, seven.short) == ("7B-class decoder (6.7B)", "7B")
    hf = report.e2e_model(e2e_hf_payload()["config"])
    assert (hf.kind, hf.title, hf.short) == ("hf-llama", "Hugging Face LlamaForCausalLM (852.6M)", "HF Llama 853M")
    # hf-llama without its hf_config, and without a parameter count: the decoder-named keys, no count
    bare = report.e2e_model({"model_kind": "hf-llama", "model": "tiny", "dim": 64, "n_kv_heads": 2})
    assert (bare.title, bare.short) == ("Hugging Face LlamaForCausalLM", "HF Llama")
    assert (
        bare.setup == "Hugging Face `transformers.LlamaForCausalLM` (random init; `tiny` config: dim 64, n_kv_heads 2)"
    )
    # another decoder config is named too (it is not the bench model); an unknown kind by its own name
    small = report.e2e_model({"model": "small", "params": 220_000_000})
    assert (small.title, small.short) == ("Llama-style decoder, `small` config (220.0M)", "decoder small 220M")
    other = report.e2e_model({"model_kind": "mixtral", "params": 46.7e9})
    assert (other.title, other.short) == ("model `mixtral` (46.7B)", "mixtral 46.7B")


def test_regime_order() -> None:
    assert report._ordered({"1k", "4k", "8k", "2k"}, report.REGIME_ORDER) == ["8k", "4k", "1k", "2k"]
    assert report.REGIME_LABEL["4k"] == "4K tokens per GPU"


def test_model_plots(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    text, _ = _render(tmp_path, plots=True, e2e_hf_2gpu=e2e_hf_payload(), e2e_7b_2gpu=e2e_7b_payload())
    pngs = sorted(p.name for p in (tmp_path / "docs" / "img").glob("*.png"))
    assert pngs == ["h200_e2e_7b_2gpu_tokens.png", "h200_e2e_hf_2gpu_tokens.png"]
    assert "](img/h200_e2e_hf_2gpu_tokens.png)" in _section(text, HF_TITLE)


def test_names_with_modifiers_read_as_the_base_and_what_each_adds() -> None:
    from bench.report._models import impl_label, impl_short

    res = None  # only shardfuse-ref reads the result
    assert impl_label(res, "shardfuse-graph+fused") == ("shardfuse, step captured by `capture_step` (CUDA graph), "
                                                        "fused gradient pre-divide (`SHARDFUSE_FUSED_GRADS=1`)")
    assert impl_short(res, "fsdp2-compile+split") == "FSDP2 + compile, split"
    assert impl_short(res, "shardfuse+fp8+ac") == "shardfuse, float8, AC"
    # an unknown base or modifier: the name as it is
    assert impl_label(res, "mystery+fused") == "mystery+fused" and impl_short(res, "shardfuse+odd") == "shardfuse+odd"
    assert impl_label(res, "shardfuse") == "shardfuse `FullyShardedDataParallel`"
    # modifiers with a count (+aoffN: activation offload of N layers; +acK: checkpointing of one layer in K), and
    # ones without their count
    assert impl_short(res, "shardfuse+fp8+aoff4") == "shardfuse, float8, 4 layers' activations offloaded"
    assert impl_label(res, "shardfuse+aoff12").endswith(
        "activation offload of 12 layers (`offload_activations`)")
    assert impl_short(res, "shardfuse+aoff") == "shardfuse+aoff"
    assert impl_short(res, "fsdp2+fp8+ac4") == "FSDP2, float8, AC of 1 layer in 4"
    assert impl_label(res, "fsdp2+ac2").endswith("activation checkpointing of one layer in 2")
    assert impl_short(res, "fsdp2+acK") == "fsdp2+acK" and impl_short(res, "fsdp2+ac") == "FSDP2, AC"
    assert impl_short(res, "shardfuse+fp8+keep16") == "shardfuse, float8, 16 layers kept gathered"
    assert impl_label(res, "fsdp2+keep2").endswith("the last 2 layers kept gathered for backward")
    assert impl_short(res, "shardfuse+keep") == "shardfuse+keep"
    assert impl_short(res, "shardfuse+rspg") == "shardfuse, RS group"
