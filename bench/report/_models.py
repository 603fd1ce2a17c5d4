"""What an e2e file trained and who ran it, in the words of the page and the README."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from bench.report._common import IMPL_LABEL, IMPL_SHORT, MODIFIER_LABEL, MODIFIER_SHORT, modifier_text
from bench.results_io import E2EConfig, Result

# The model an e2e file trained (``config.model_kind``, written by bench/e2e/run.py's ModelSpec; a file without
# it is the Llama-style decoder, as every file was before the key existed), see ``e2e_model``.
DECODER_KIND = "decoder"
HF_LLAMA_KIND = "hf-llama"
DEFAULT_DECODER_CONFIG = "bench"  # the decoder whose sections and README rows carry no model name
DECODER_DIMS = ("dim", "n_layers", "n_heads", "ffn_dim", "vocab_size")


def ref_commit(res: Result) -> str | None:
    return res.e2e().config.shardfuse_ref_commit


def ref_label(res: Result, short: bool = False) -> str:
    """``shardfuse-ref``'s name: shardfuse at the commit recorded in ``config.shardfuse_ref_commit``."""
    commit = ref_commit(res)
    if short:
        return f"shardfuse at {commit}" if commit else "shardfuse (reference commit)"
    return f"shardfuse at `{commit}` (reference)" if commit else IMPL_LABEL["shardfuse-ref"]


def _with_modifiers(impl: str, names: dict[str, str], modifiers: dict[str, str]) -> str:
    """``shardfuse-graph+fused``: the base's name, then what each known modifier adds (else the name as it is)."""
    base, *mods = impl.split("+")
    texts = [modifier_text(m, modifiers) for m in mods]
    if base not in names or not mods or any(t is None for t in texts):
        return impl
    return f"{names[base]}, " + ", ".join(t for t in texts if t is not None)


def impl_label(res: Result, impl: str) -> str:
    if impl == "shardfuse-ref":
        return ref_label(res)
    return IMPL_LABEL.get(impl) or _with_modifiers(impl, IMPL_LABEL, MODIFIER_LABEL)


def impl_short(res: Result, impl: str) -> str:
    """A short name for running text (``shardfuse-ref``: "shardfuse at <commit>")."""
    if impl == "shardfuse-ref":
        return ref_label(res, short=True)
    return IMPL_SHORT.get(impl) or _with_modifiers(impl, IMPL_SHORT, MODIFIER_SHORT)


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


def _shape_text(shape: Mapping[str, Any], keys: Sequence[str]) -> str:
    return ", ".join(f"{k} {shape[k]}" for k in keys if k in shape)


def _hf_setup(cfg: E2EConfig, cls: str, count: str) -> str:
    """The setup line's model part for ``hf-llama``: transformers' own config names where the file has them."""
    hf = cfg.hf_config
    if hf:
        keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
        shape = [_shape_text(hf, (*keys, "intermediate_size", "vocab_size"))]
        if isinstance(hf.get("tie_word_embeddings"), bool):
            shape.append("tied input and output embeddings" if hf["tie_word_embeddings"] else "untied output layer")
        if hf.get("attn_implementation"):
            shape.append(f"`{hf['attn_implementation']}` attention")
    else:
        shape = [_shape_text(cfg.shape, ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size"))]
    shape_text = ", ".join(x for x in shape if x)
    parts = [f"{count} parameters, random init" if count else "random init"]
    if cfg.model:
        parts.append(f"`{cfg.model}` config" + (f": {shape_text}" if shape_text else ""))
    elif shape_text:
        parts.append(shape_text)
    if cfg.transformers:
        parts.append(f"transformers {cfg.transformers}")
    return f"Hugging Face `{cls}` ({'; '.join(parts)})"


def e2e_model(cfg: E2EConfig | dict[str, Any]) -> E2EModel:
    """The model of an e2e file's ``config``: bench/e2e/run.py's ``model_kind`` (``decoder`` when absent) and
    ``model`` (the config name: the decoder's ``bench``, ``7b``, ...; hf-llama's ``bench``); a run with fused
    AdamW (``config.optimizer``, ``--optim fused``) says so in its titles and README rows."""
    cfg = cfg if isinstance(cfg, E2EConfig) else E2EConfig.parse(cfg)
    model = _e2e_model(cfg)
    if "fused" not in (cfg.optimizer or ""):
        return model
    return dataclasses.replace(
        model,
        title=f"{model.title or 'decoder'}, fused AdamW",
        short=f"{model.short or 'decoder'}, fused AdamW",
        about=f"{model.about or 'the decoder'} with fused AdamW (`--optim fused`) for every implementation",
    )


def _decoder_model(cfg: E2EConfig, full: str, short: str) -> E2EModel:
    n, name, config = cfg.params, cfg.model, cfg.model or ""
    dims = _shape_text(cfg.shape, DECODER_DIMS)
    if name == "7b":
        setup = ""
        if n:
            setup = f"{full}-parameter 7B-class Llama-style decoder (`7b` config, the shape of Llama-2-7B"
            setup += f": {dims})" if dims else ")"
        title = f"7B-class decoder ({full})" if full else "7B-class decoder"
        about = "the Llama-style decoder in the shape of Llama-2-7B" + (f" ({full} parameters)" if full else "")
        return E2EModel(DECODER_KIND, config, title, "7B", about, setup)
    setup = ""
    if n:  # as the report has always written it
        setup = f"{n / 1e6:.0f}M-parameter Llama-style decoder (`{name or '?'}` config"
        setup += f": {dims})" if dims else ")"
    if name in (None, DEFAULT_DECODER_CONFIG):
        return E2EModel(DECODER_KIND, config, "", "", "", setup)
    title = f"Llama-style decoder, `{name}` config" + (f" ({full})" if full else "")
    about = f"the Llama-style decoder in its `{name}` config" + (f" ({full} parameters)" if full else "")
    return E2EModel(DECODER_KIND, config, title, " ".join(x for x in ("decoder", config, short) if x), about, setup)


def _e2e_model(cfg: E2EConfig) -> E2EModel:
    kind = cfg.model_kind or DECODER_KIND
    n = cfg.params
    full, short = (_count(n), _count(n, short=True)) if n else ("", "")
    if kind == DECODER_KIND:
        return _decoder_model(cfg, full, short)
    if kind == HF_LLAMA_KIND:
        cls = cfg.hf_class or "transformers.LlamaForCausalLM"
        title = f"Hugging Face {cls.rsplit('.', 1)[-1]}" + (f" ({full})" if full else "")
        about = f"Hugging Face `{cls}`" + (f" ({full} parameters, random init)" if full else " (random init)")
        short = " ".join(x for x in ("HF Llama", short) if x)
        return E2EModel(kind, cfg.model or "", title, short, about, _hf_setup(cfg, cls, full))
    title = f"model `{kind}`" + (f" ({full})" if full else "")
    setup = f"{full}-parameter `{kind}` model" if full else f"`{kind}` model"
    about = f"the `{kind}` model"
    return E2EModel(kind, cfg.model or "", title, " ".join(x for x in (kind, short) if x), about, setup)


def e2e_models(results: dict[str, list[Result]]) -> list[E2EModel]:
    """The named models (all but the decoder's bench config) of the e2e files, each once, in file order."""
    out: dict[str, E2EModel] = {}
    for rs in results.values():
        for r in rs:
            if r.kind == "e2e" and (m := e2e_model(r.e2e().config)).short:
                out.setdefault(m.short, m)
    return list(out.values())
