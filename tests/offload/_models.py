"""Models shared by the offload tests."""

from __future__ import annotations

import torch
from torch import nn


def mlp(seed: int = 0, p: float = 0.25) -> nn.Sequential:
    """9 layers, uneven parameter counts (42, 48, 60, 40) and parameter-free layers between them."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(5, 7), nn.ReLU(), nn.Dropout(p),
        nn.Linear(7, 6), nn.Tanh(),
        nn.Linear(6, 10), nn.Dropout(p), nn.GELU(),
        nn.Linear(10, 4),
    )  # fmt: skip
