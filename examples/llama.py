"""A Llama-style decoder: the model of the end-to-end benchmark and of ``examples/train.py``.

Pre-norm decoder layers (RMSNorm -> causal self-attention with rotary position embeddings -> residual,
RMSNorm -> SwiGLU feed-forward -> residual), a final RMSNorm and an untied output projection. All linear
layers are bias-free. Attention runs through ``F.scaled_dot_product_attention(is_causal=True)``.

``LlamaConfig()`` is the benchmark model of DESIGN.md (dim 2048, 16 layers, 16 heads, SwiGLU ffn 5632,
vocab 32000: 953,223,168 parameters); ``LlamaConfig.tiny()`` runs on a CPU in milliseconds;
``LlamaConfig.llama_7b()`` (``named("7b")``) is the 7B-class shape of Llama-2-7B (6,738,415,616 parameters);
``LlamaConfig.llama3_8b()`` (``named("8b")``) the shape of Llama-3-8B, with grouped-query attention (8 key/value
heads; 8,030,261,248 parameters). Pure PyTorch, no dependencies beyond it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["DecoderLayer", "Llama", "LlamaConfig", "RMSNorm", "count_params", "next_token_loss"]


@dataclass(frozen=True)
class LlamaConfig:
    """Model shape. The defaults are the 953M-parameter benchmark model."""

    dim: int = 2048
    n_layers: int = 16
    n_heads: int = 16
    ffn_dim: int = 5632
    vocab_size: int = 32000
    max_seq_len: int = 2048
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    n_kv_heads: int | None = None  # key/value heads (grouped-query attention); None: as many as n_heads

    def __post_init__(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "ffn_dim", "vocab_size", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"LlamaConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 2:
            raise ValueError(
                f"LlamaConfig needs dim divisible by n_heads with an even head size for rotary embeddings: "
                f"dim={self.dim} n_heads={self.n_heads}: pick n_heads so that dim // n_heads is even"
            )
        if self.n_kv_heads is not None and (self.n_kv_heads < 1 or self.n_heads % self.n_kv_heads):
            raise ValueError(
                f"LlamaConfig.n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads} (each key/value head "
                f"serves n_heads // n_kv_heads query heads): pick a divisor of n_heads, or None for one per head"
            )

    @property
    def head_dim(self) -> int:
        """Per-head width."""
        return self.dim // self.n_heads

    @property
    def kv_dim(self) -> int:
        """Width of the key and value projections (``n_kv_heads`` heads of ``head_dim``)."""
        return self.head_dim * (self.n_kv_heads or self.n_heads)

    @classmethod
    def bench(cls) -> LlamaConfig:
        """The benchmark model of DESIGN.md (~953M parameters)."""
        return cls()

    @classmethod
    def small(cls) -> LlamaConfig:
        """A few hundred million parameters (~220M), for ``examples/train.py`` on GPUs."""
        return cls(dim=1024, n_layers=12, n_heads=16, ffn_dim=2816, vocab_size=32000, max_seq_len=1024)

    @classmethod
    def tiny(cls) -> LlamaConfig:
        """A CPU-sized model for tests and smoke runs (133,568 parameters)."""
        return cls(dim=64, n_layers=2, n_heads=4, ffn_dim=176, vocab_size=257, max_seq_len=32)

    @classmethod
    def llama_7b(cls) -> LlamaConfig:
        """The 7B-class shape of Llama-2-7B (dim 4096, 32 layers, 32 heads, SwiGLU ffn 11008, vocab 32000,
        sequences up to 4096): 6,738,415,616 parameters, 27 GB in fp32. For GPUs only."""
        return cls(dim=4096, n_layers=32, n_heads=32, ffn_dim=11008, vocab_size=32000, max_seq_len=4096)

    @classmethod
    def llama3_8b(cls) -> LlamaConfig:
        """The shape of Llama-3-8B (dim 4096, 32 layers, 32 query heads sharing 8 key/value heads, SwiGLU ffn
        14336, vocab 128256, untied output, rope theta 500000, sequences up to 8192): 8,030,261,248 parameters,
        32 GB in fp32. For GPUs only."""
        return cls(dim=4096, n_layers=32, n_heads=32, ffn_dim=14336, vocab_size=128256, max_seq_len=8192,
                   rope_theta=500000.0, n_kv_heads=8)

    @classmethod
    def named(cls, name: str) -> LlamaConfig:
        """``'tiny'``, ``'small'``, ``'bench'``, ``'7b'`` or ``'8b'``."""
        table = {"tiny": cls.tiny, "small": cls.small, "bench": cls.bench, "7b": cls.llama_7b, "8b": cls.llama3_8b}
        if name not in table:
            raise ValueError(f"unknown model config {name!r}: choose one of {sorted(table)}")
        return table[name]()

    def num_params(self) -> int:
        """Parameter count by formula (embedding + layers + final norm + untied output)."""
        d = self.dim
        per_layer = 2 * d * d + 2 * d * self.kv_dim + 3 * d * self.ffn_dim + 2 * d  # wq wo, wk wv, w1 w2 w3, norms
        return self.vocab_size * d + self.n_layers * per_layer + d + d * self.vocab_size


def count_params(module: nn.Module) -> int:
    """Number of parameters of ``module`` (shared ones counted once)."""
    return sum(p.numel() for p in module.parameters())


class RMSNorm(nn.Module):
    """Root-mean-square layer norm; the statistics are computed in fp32 whatever the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise the last dimension and scale by ``weight``."""
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rope_tables(head_dim: int, seq_len: int, theta: float, device: torch.device | None = None) -> torch.Tensor:
    """cos and sin tables of rotary embeddings, stacked: shape (2, seq_len, head_dim), fp32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)  # rotate-half layout: the two halves share frequencies
    return torch.stack([angles.cos(), angles.sin()])


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape (batch, heads, seq, head_dim) by the tables of :func:`rope_tables`."""
    seq = x.shape[-2]
    cos, sin = rope[0, :seq].to(x.dtype), rope[1, :seq].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Attention(nn.Module):
    """Multi-head causal self-attention with rotary embeddings (grouped-query with ``cfg.n_kv_heads``)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.n_kv_heads = cfg.n_kv_heads or cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.kv_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.kv_dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        """(batch, seq, dim) -> (batch, seq, dim)."""
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k, v = (w(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2) for w in (self.wk, self.wv))
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        if self.n_kv_heads != self.n_heads:  # each key/value head serves n_heads // n_kv_heads query heads
            # Repeated rather than SDPA's enable_gqa, which not every attention backend takes (torchtitan's way).
            k, v = (t.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1) for t in (k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., dim) -> (..., dim)."""
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class DecoderLayer(nn.Module):
    """One pre-norm transformer block: the unit every sharded wrapper wraps."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        """(batch, seq, dim) -> (batch, seq, dim); ``rope`` from :func:`rope_tables`."""
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """The decoder: ``tok_embeddings`` -> ``layers`` -> ``norm`` -> ``output`` (untied), returns logits."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList([DecoderLayer(cfg) for _ in range(cfg.n_layers)])
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        # Not persistent: derived from the config, so it stays out of state dicts. Kept in fp32; attention casts
        # it to the activations' dtype.
        self.register_buffer("rope", rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token ids (batch, seq) -> logits (batch, seq, vocab_size)."""
        if tokens.dim() != 2 or tokens.shape[1] > self.cfg.max_seq_len:
            raise ValueError(
                f"Llama takes token ids of shape (batch, seq) with seq <= max_seq_len={self.cfg.max_seq_len}, "
                f"got shape {tuple(tokens.shape)}: crop or reshape the batch"
            )
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x, self.rope)
        return self.output(self.norm(x))

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> Llama:
        """Deterministic initialisation from ``seed`` (same values for the same seed and device type).

        Linear weights ~ N(0, 0.02), output projections of each block scaled by 1/sqrt(2 * n_layers) (GPT-2
        style), embeddings ~ N(0, 1), norms = 1. Each parameter draws from its own generator seeded from
        ``seed`` and its index, so the result does not depend on the global RNG. Returns ``self``.
        """
        std = 0.02
        out_std = std / math.sqrt(2 * self.cfg.n_layers)
        for i, (name, p) in enumerate(self.named_parameters()):
            gen = torch.Generator(device=p.device).manual_seed(seed * 1_000_003 + i)
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name == "tok_embeddings.weight":
                p.normal_(0.0, 1.0, generator=gen)
            elif name.endswith(("wo.weight", "w2.weight")):
                p.normal_(0.0, out_std, generator=gen)
            else:
                p.normal_(0.0, std, generator=gen)
        self.rope.copy_(rope_tables(self.cfg.head_dim, self.cfg.max_seq_len, self.cfg.rope_theta, self.rope.device))
        return self


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``logits`` (batch, seq, vocab) against ``targets`` (batch, seq), in fp32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
