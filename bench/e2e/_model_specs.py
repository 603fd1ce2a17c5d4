"""The models of ``bench.e2e.run`` (``--model``, ``--config``): how each is built, its decoder layers, its flops.

Split off ``bench.e2e.run``, which re-exports every public name here (``from bench.e2e.run import model_spec``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from examples.llama import DecoderLayer, Llama, LlamaConfig, count_params

MODELS = ("decoder", "hf-llama")
DECODER_CONFIGS = ("tiny", "small", "bench", "7b", "8b")  # examples.llama.LlamaConfig.named
# transformers.LlamaConfig arguments of ``--model hf-llama``. ``bench``: the decoder's bench shape with 4 key/value
# heads (grouped-query attention, as Llama 2/3 and TinyLlama): 852,559,872 parameters.
HF_CONFIGS: dict[str, dict[str, int]] = {
    "tiny": dict(vocab_size=257, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=32),
    "bench": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                  num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=4096),
}
TRANSFORMERS_MISSING = "needs the transformers package (pip install transformers), which is not importable here"


@dataclass(frozen=True)
class ModelSpec:
    """Everything the benchmark knows of one model, so the wrappers, the step and the flop count are shared."""

    kind: str  # one of MODELS
    name: str  # its --config
    tag: str  # "" or what the default result name carries: e2e_<tag>_<N>gpu
    layer_cls: type[nn.Module]  # the sharded unit
    make: Callable[[torch.device, int], nn.Module]  # the model on the device, initialised from the seed
    layers: Callable[[nn.Module], nn.ModuleList]  # the (unwrapped) model's list of decoder layers
    logits: Callable[[nn.Module, torch.Tensor], torch.Tensor]  # token ids (batch, seq) -> (batch, seq, vocab)
    num_params: int
    vocab_size: int
    dim: int  # width of the embeddings and of attention (heads x head size)
    n_layers: int
    max_seq_len: int
    config: dict[str, Any]  # recorded in the result JSON's config
    # The input embedding and the output head as (parent, attribute) pairs: the ``+split`` variant wraps each as a
    # sharded unit of its own (torchtitan's layout), so the first all-gather and the last reduce-scatter of a step
    # carry the embedding alone and the head's reduction overlaps the layers' backward.
    edges: Callable[[nn.Module], list[tuple[nn.Module, str]]] = lambda model: []
    split_edges: bool = False  # set by the +split variant for the wrapper
    keep_gathered: int = 0  # set by the +keepN variant: the last N layers not resharded after forward

    def flops_per_step(self, batch: int, seq: int) -> float:
        """Training flops of one step on one GPU: 6 N T for the matrix products plus causal attention."""
        n_matmul = self.num_params - self.vocab_size * self.dim  # the input embedding is a lookup, no flops
        tokens = batch * seq
        # QK^T and AV: 2 * 2 * seq^2 * dim per sequence and layer forward, halved by causality, x3 for backward.
        attention = 6.0 * self.n_layers * seq * seq * self.dim * batch
        return 6.0 * n_matmul * tokens + attention

    def result_name(self, world: int) -> str:
        """The default result name: e2e_<N>gpu, e2e_hf_<N>gpu, e2e_7b_<N>gpu or e2e_8b_<N>gpu."""
        return f"e2e_{self.tag}_{world}gpu" if self.tag else f"e2e_{world}gpu"


def _decoder_spec(name: str) -> ModelSpec:
    cfg = LlamaConfig.named(name)

    def make(device: torch.device, seed: int) -> nn.Module:
        with torch.device(device):
            model = Llama(cfg)
        return model.init_weights(seed)

    return ModelSpec(
        kind="decoder", name=name, tag=name if name in ("7b", "8b") else "", layer_cls=DecoderLayer, make=make,
        layers=lambda model: model.layers, logits=lambda model, tokens: model(tokens),
        num_params=cfg.num_params(), vocab_size=cfg.vocab_size, dim=cfg.dim, n_layers=cfg.n_layers,
        max_seq_len=cfg.max_seq_len, config=asdict(cfg),
        edges=lambda model: [(model, "tok_embeddings"), (model, "output")],
    )  # fmt: skip


def _import_transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(f"bench.e2e.run --model hf-llama {TRANSFORMERS_MISSING}: {exc}") from exc
    return transformers


def _hf_logits(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """``model(tokens).logits``; by key when a wrapper rebuilt the output as a plain dict."""
    out = model(tokens)
    return out["logits"] if isinstance(out, dict) else out.logits


def _hf_llama_spec(name: str) -> ModelSpec:
    transformers = _import_transformers()
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    if name not in HF_CONFIGS:
        raise ValueError(f"--model hf-llama has the configs {', '.join(HF_CONFIGS)}, not {name!r}")
    # No KV cache in training; SDPA attention (causal, no mask tensor) as the decoder's.
    hf_cfg = transformers.LlamaConfig(**HF_CONFIGS[name], use_cache=False, attn_implementation="sdpa")
    with torch.device("meta"):  # shapes only: the parameter count as transformers builds it
        num_params = count_params(transformers.LlamaForCausalLM(hf_cfg))

    def make(device: torch.device, seed: int) -> nn.Module:
        # transformers initialises from the global generator: seed it (the device's too) and put it back after.
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.device(device):
            torch.manual_seed(seed)
            return transformers.LlamaForCausalLM(hf_cfg).float()  # fp32 parameters, as the decoder's

    c = HF_CONFIGS[name]
    head_dim = c["hidden_size"] // c["num_attention_heads"]
    return ModelSpec(
        kind="hf-llama", name=name, tag="hf", layer_cls=LlamaDecoderLayer, make=make,
        layers=lambda model: model.model.layers, logits=_hf_logits,
        edges=lambda model: [(model.model, "embed_tokens"), (model, "lm_head")],
        num_params=num_params, vocab_size=c["vocab_size"], dim=c["num_attention_heads"] * head_dim,
        n_layers=c["num_hidden_layers"], max_seq_len=c["max_position_embeddings"],
        config={
            # The decoder's keys (the report shows them), then transformers' own.
            "dim": c["hidden_size"], "n_layers": c["num_hidden_layers"], "n_heads": c["num_attention_heads"],
            "n_kv_heads": c["num_key_value_heads"], "ffn_dim": c["intermediate_size"], "vocab_size": c["vocab_size"],
            "max_seq_len": c["max_position_embeddings"],
            "hf_class": "transformers.LlamaForCausalLM", "transformers": transformers.__version__,
            "hf_config": {**c, "tie_word_embeddings": hf_cfg.tie_word_embeddings, "rms_norm_eps": hf_cfg.rms_norm_eps,
                          "attn_implementation": hf_cfg._attn_implementation, "use_cache": hf_cfg.use_cache},
        },
    )  # fmt: skip


def model_spec(kind: str, name: str) -> ModelSpec:
    """The model ``kind`` (one of MODELS) in its config ``name``."""
    if kind == "decoder":
        return _decoder_spec(name)
    if kind == "hf-llama":
        return _hf_llama_spec(name)
    raise ValueError(f"unknown model {kind!r}: choose one of {', '.join(MODELS)}")

