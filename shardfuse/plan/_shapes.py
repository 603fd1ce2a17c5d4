"""Model shapes for the planner: what its memory and time models need to know about a model.

A :class:`ModelShape` is a stack of ``n_layers`` equal blocks (each one sharded unit) plus a root (embeddings,
final norm, output: the root unit), with the widths that set the activations (``dim``, ``vocab_size``) and the
attention FLOPs. It comes from a built-in name (:data:`BUILTIN`), a Hugging Face ``config.json`` (a path, a dict
or a ``transformers`` config object: read locally, never downloaded), an ``nn.Module`` (its parameters counted),
or explicit dims (:func:`decoder`). Plain arithmetic: nothing here imports torch unless given a module.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["BUILTIN", "ModelShape", "decoder", "from_hf_config", "from_module", "resolve_model"]


@dataclass(frozen=True)
class ModelShape:
    """A decoder-like model: ``n_layers`` blocks of ``layer_params`` each, plus ``root_params`` in the root unit."""

    name: str
    dim: int
    n_layers: int
    layer_params: int
    root_params: int
    vocab_size: int = 0  # 0: no output projection over a vocabulary (no logits term in the activations)
    embed_params: int = 0  # parameters of the input embedding table (a lookup, no matmul FLOPs)

    @property
    def params(self) -> int:
        return self.n_layers * self.layer_params + self.root_params

    @property
    def units(self) -> int:
        """Sharded units: one per block plus the root."""
        return self.n_layers + 1

    @property
    def largest_unit(self) -> int:
        return max(self.layer_params, self.root_params)

    def unit_sizes(self) -> list[int]:
        """Parameters per unit in forward order: the root first (its forward starts first), then the blocks."""
        return [self.root_params] + [self.layer_params] * self.n_layers

    def flops_per_token(self, seq: int) -> float:
        """Forward + backward FLOPs per token: 6 x the matmul parameters (all but the embedding lookup) + 12 L d s
        for attention (QK^T and AV, the causal half not subtracted: ``bench.scale.model``'s convention)."""
        return 6.0 * (self.params - self.embed_params) + 12.0 * self.n_layers * self.dim * seq


def decoder(name: str, dim: int, n_layers: int, n_heads: int, ffn_dim: int, vocab_size: int,
            n_kv_heads: int | None = None, tied: bool = False) -> ModelShape:
    """A Llama-style decoder (``examples/llama.py``): RMSNorms, q/k/v/o projections, SwiGLU, untied output
    unless ``tied``. Checks the numbers and names the bad one."""
    for label, value in (("dim", dim), ("n_layers", n_layers), ("n_heads", n_heads), ("ffn_dim", ffn_dim),
                         ("vocab_size", vocab_size)):  # fmt: skip
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"model {name!r}: {label} must be a positive integer, got {value!r}: "
                             f"fix the config (or the --dims value)")
    kv = n_kv_heads or n_heads
    if dim % n_heads or n_heads % kv:
        raise ValueError(f"model {name!r}: dim={dim} n_heads={n_heads} n_kv_heads={kv}: dim must divide into "
                         f"n_heads heads and n_heads into n_kv_heads groups; fix the config")
    kv_dim = dim * kv // n_heads
    layer = 2 * dim * dim + 2 * dim * kv_dim + 3 * dim * ffn_dim + 2 * dim
    embed = vocab_size * dim
    root = embed + dim + (0 if tied else vocab_size * dim)
    return ModelShape(name, dim, n_layers, layer, root, vocab_size, embed)


# The shapes of examples/llama.py's LlamaConfig and bench/offload/big_impls.py's MODELS (the stored rows).
BUILTIN: dict[str, ModelShape] = {
    s.name: s
    for s in (
        decoder("tiny", 64, 2, 4, 176, 257),
        decoder("small", 1024, 12, 16, 2816, 32000),
        decoder("bench", 2048, 16, 16, 5632, 32000),  # 953,223,168 parameters (the e2e benchmark model)
        decoder("2.9b", 3072, 24, 24, 8192, 32000),
        decoder("6.7b", 4096, 32, 32, 11008, 32000),  # Llama-2-7B's shape, LlamaConfig.llama_7b()
        decoder("70b", 8192, 80, 64, 28672, 32000, n_kv_heads=8),
    )
}
ALIASES = {"953m": "bench", "7b": "6.7b", "llama-7b": "6.7b", "llama2-7b": "6.7b", "llama-2-7b": "6.7b",
           "llama-70b": "70b", "llama2-70b": "70b", "llama-2-70b": "70b"}  # fmt: skip


def _get(cfg: Any, *names: str, default: Any = None) -> Any:
    for n in names:
        value = cfg.get(n) if isinstance(cfg, dict) else getattr(cfg, n, None)
        if value is not None:
            return value
    return default


def from_hf_config(cfg: Any, name: str | None = None) -> ModelShape:
    """A shape from a Hugging Face config: a ``config.json`` path, its dict, or a ``transformers`` config object
    (Llama, Mistral, Qwen, GPT-NeoX-style key names). Read locally; nothing is downloaded."""
    if isinstance(cfg, (str, Path)):
        path = Path(cfg)
        if path.is_dir():
            path = path / "config.json"
        try:
            cfg = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"model config {str(path)!r} could not be read ({type(exc).__name__}: {exc}): "
                             f"pass a local config.json (the planner never downloads)") from exc
        name = name or path.parent.name or path.name
    dims = {
        "dim": _get(cfg, "hidden_size", "d_model", "n_embd"),
        "n_layers": _get(cfg, "num_hidden_layers", "n_layer", "num_layers"),
        "n_heads": _get(cfg, "num_attention_heads", "n_head"),
        "ffn_dim": _get(cfg, "intermediate_size", "ffn_dim", "n_inner"),
        "vocab_size": _get(cfg, "vocab_size"),
    }
    missing = [k for k, v in dims.items() if v is None]
    if missing == ["ffn_dim"] and dims["dim"] is not None:
        dims["ffn_dim"] = 4 * dims["dim"]
    elif missing:
        raise ValueError(f"model config {name or type(cfg).__name__!r} lacks {missing} (hidden_size, "
                         f"num_hidden_layers, num_attention_heads, intermediate_size, vocab_size): give the shape "
                         f"with --dims instead")
    return decoder(str(name or _get(cfg, "model_type", default="hf-config")), **dims,
                   n_kv_heads=_get(cfg, "num_key_value_heads"),
                   tied=bool(_get(cfg, "tie_word_embeddings", default=False)))  # fmt: skip


def from_module(module: Any, name: str | None = None) -> ModelShape:
    """A shape from an ``nn.Module``: the blocks are the longest ``nn.ModuleList`` (each one a unit), the root the
    rest; ``dim``/``vocab_size`` from its first ``nn.Embedding`` (else the first ``nn.Linear``'s input width)."""
    from torch import nn

    if not isinstance(module, nn.Module):
        raise TypeError(f"expected an nn.Module, got {type(module).__name__}")
    total = sum(p.numel() for p in module.parameters())
    lists = [m for m in module.modules() if isinstance(m, nn.ModuleList) and len(m)]
    blocks = max(lists, key=len) if lists else None
    if blocks is None:
        raise ValueError(f"model {type(module).__name__}: no nn.ModuleList of blocks found (the planner shards one "
                         f"unit per block): pass its dims instead (--dims or plan(dims=...))")
    layer = max(sum(p.numel() for p in b.parameters()) for b in blocks)
    emb = next((m for m in module.modules() if isinstance(m, nn.Embedding)), None)
    lin = next((m for m in module.modules() if isinstance(m, nn.Linear)), None)
    dim = emb.embedding_dim if emb is not None else (lin.in_features if lin is not None else 1)
    vocab = emb.num_embeddings if emb is not None else 0
    root = max(total - layer * len(blocks), 0)
    return ModelShape(name or type(module).__name__, dim, len(blocks), layer, root, vocab, vocab * dim)


def resolve_model(model: Any) -> ModelShape:
    """A :class:`ModelShape` from whatever the user gave (see the module docstring)."""
    if isinstance(model, ModelShape):
        return model
    if isinstance(model, Path):
        return from_hf_config(model)
    if isinstance(model, str):
        key = ALIASES.get(model.lower(), model.lower())
        if key in BUILTIN:
            return BUILTIN[key]
        if Path(model).exists():
            return from_hf_config(model)
        raise ValueError(f"unknown model {model!r}: not a built-in shape ({', '.join(sorted(BUILTIN))}, or "
                         f"{', '.join(sorted(ALIASES))}) and no such local file: pass a built-in name, a local "
                         f"config.json path (nothing is downloaded), or the dims (--dims DIM,LAYERS,HEADS,FFN,VOCAB)")
    if isinstance(model, dict):
        return from_hf_config(model, model.get("_name_or_path") or None)
    if hasattr(model, "parameters") and callable(model.parameters):
        return from_module(model)
    if hasattr(model, "to_dict") and hasattr(model, "hidden_size"):  # a transformers PretrainedConfig
        return from_hf_config(model, getattr(model, "name_or_path", None) or None)
    raise TypeError(f"model of type {type(model).__name__} not understood: pass a built-in name, a config.json "
                    f"path, a dict or transformers config, an nn.Module, or a ModelShape")
