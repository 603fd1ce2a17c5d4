"""Tiny models and the single-process reference trainer shared by the sharding tests.

Odd sizes (13, 37, 31...) make every flat parameter need padding for 2 and 4 ranks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from shardfuse.sharding import FullyShardedDataParallel as FSDP

VOCAB, DIM, HID, OUT = 31, 13, 37, 7


class Block(nn.Module):
    """Linear -> tanh -> Linear + LayerNorm, residual."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(DIM, HID)
        self.fc2 = nn.Linear(HID, DIM)
        self.norm = nn.LayerNorm(DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.fc2(torch.tanh(self.fc1(x))))


class Net(nn.Module):
    """Embedding -> 2 blocks (+ an optional extra block) -> head, with optional tying/freezing."""

    def __init__(self, tied: bool = False, frozen: bool = False, extra: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.extra = Block() if extra else None
        self.proj = nn.Linear(DIM, DIM, bias=False)
        self.head = nn.Linear(DIM, VOCAB if tied else OUT)
        self.register_buffer("scale", torch.full((DIM,), 0.5))
        if tied:
            self.head.weight = self.embed.weight  # the same Parameter registered twice in one unit
        if frozen:
            for p in self.blocks[0].fc1.parameters():
                p.requires_grad_(False)
            self.proj.weight.requires_grad_(False)

    def forward(self, ids: torch.Tensor, use_extra: bool = True, ckpt: bool = False) -> torch.Tensor:
        x = self.embed(ids) * self.scale
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=False) if ckpt else b(x)
        if self.extra is not None and use_extra:
            x = self.extra(x)
        return self.head(self.proj(x))


def build(cfg: dict[str, Any]) -> Net:
    """The unwrapped model, initialised identically on every rank."""
    torch.manual_seed(1234)
    return Net(tied=cfg.get("tied", False), frozen=cfg.get("frozen", False), extra=cfg.get("extra", False))


def fsdp_kwargs(cfg: dict[str, Any]) -> dict[str, Any]:
    keys = ("reshard_after_forward", "mixed_precision", "compute_dtype", "fp32_reduce_scatter",
            "move_params_to_cpu", "gradient_predivide_factor", "disable_reshard_on_root")
    return {k: cfg[k] for k in keys if k in cfg}


def wrap_model(model: Net, cfg: dict[str, Any]) -> FSDP:
    """Wrap the blocks (when ``nested``) and then the whole model."""
    kw = fsdp_kwargs(cfg)
    if cfg.get("nested", True):
        for i in range(len(model.blocks)):
            model.blocks[i] = FSDP(model.blocks[i], **kw)
        if model.extra is not None:
            model.extra = FSDP(model.extra, **kw)
    return FSDP(model, **kw)


def make_optim(params: Any, cfg: dict[str, Any]) -> torch.optim.Optimizer:
    if cfg.get("optim", "adamw") == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def batch(step: int, rank: int, world_size: int, per_rank: int = 3, seq: int = 5) -> tuple[torch.Tensor, ...]:
    """This rank's slice of the global batch of ``step`` (fresh random data every step)."""
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (per_rank * world_size, seq), generator=g)
    target = torch.randn(per_rank * world_size, seq, 1, generator=g)
    sl = slice(rank * per_rank, (rank + 1) * per_rank)
    return ids[sl], target[sl]


def loss_fn(model: nn.Module, ids: torch.Tensor, target: torch.Tensor, step: int, cfg: dict[str, Any]) -> torch.Tensor:
    kwargs = {}
    if cfg.get("extra"):
        kwargs["use_extra"] = step % 2 == 0  # unused in odd steps, on every rank
    if cfg.get("ckpt"):
        kwargs["ckpt"] = True
    out = model(ids, **kwargs)
    loss = (out.float() - target).pow(2).mean()
    if cfg.get("multi_forward"):
        out2 = model(ids.flip(0), **kwargs)
        loss = loss + out2.float().pow(2).mean()
    return loss


def divide_factors(world_size: int, cfg: dict[str, Any]) -> tuple[float, float]:
    from shardfuse.kernels._grad_divide import gradient_divide_factors

    if cfg.get("gradient_predivide_factor"):
        pre = float(cfg["gradient_predivide_factor"])
        return pre, world_size / pre
    return gradient_divide_factors(world_size)


def reference_train(
    cfg: dict[str, Any], world_size: int, steps: int
) -> tuple[Net, list[list[float]], torch.optim.Optimizer]:
    """Unsharded training in one process, combining per-rank gradients exactly as the sharded path does:
    ``sum over ranks in rank order of (g_r / pre)``, then ``/ post``, accumulated in fp32."""
    model = build(cfg)
    opt = make_optim(model.parameters(), cfg)
    pre, post = divide_factors(world_size, cfg)
    params = list(model.parameters())
    micro = cfg.get("no_sync_micro", 1)
    losses: list[list[float]] = []
    for step in range(steps):
        if not cfg.get("keep_grads"):
            opt.zero_grad(set_to_none=True)
        total: list[torch.Tensor | None] = [None] * len(params)
        step_losses = []
        for r in range(world_size):
            saved = [p.grad for p in params]
            for p in params:
                p.grad = None
            for m in range(micro):
                ids, target = batch(step * micro + m, r, world_size)
                loss = loss_fn(model, ids, target, step, cfg)
                loss.backward()
                step_losses.append(loss.item())
            for i, p in enumerate(params):
                if p.grad is not None:
                    g = p.grad / pre if pre != 1 else p.grad.clone()
                    total[i] = g if total[i] is None else total[i] + g
                p.grad = saved[i]
        for i, p in enumerate(params):
            if total[i] is None:
                continue
            g = total[i] / post if post != 1 else total[i]
            p.grad = g if p.grad is None else p.grad + g
        opt.step()
        losses.append(step_losses)
    return model, losses, opt
