"""``torch.compiler.disable`` applied on first use: it imports ``torch._dynamo`` (~0.5 s), which ``import
shardfuse`` should not pay; only code running under ``torch.compile`` asks for the wrapped functions."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def disabled_on_first_use(*fns: Callable[..., Any]) -> Callable[[], list[Callable[..., Any]]]:
    """A function returning ``[torch.compiler.disable(f) for f in fns]``, made at its first call and kept. Under
    ``torch.compile``, Dynamo runs that first call eagerly (a graph break) and traces the later ones' list."""
    wrapped: list[Callable[..., Any]] = []

    def get() -> list[Callable[..., Any]]:
        if not wrapped:
            wrapped.extend([torch.compiler.disable(f) for f in fns])
        return wrapped

    return get
