"""Logging shared by the package: warnings once per job (on the first rank only), per-step debug records.

Library modules log through ``logging.getLogger(__name__)`` and never configure handlers; a user turns the
per-step records on with ``logging.getLogger("shardfuse").setLevel(logging.DEBUG)`` (and a handler).
"""

from __future__ import annotations

import logging

import torch.distributed as dist

_warned: set[str] = set()


def _first_rank() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def warn_once(logger: logging.Logger, message: str) -> None:
    """``logger.warning(message)`` the first time this message comes up in the process, on rank 0 only: a
    warning every rank and every unit would repeat says nothing more."""
    if message in _warned:
        return
    _warned.add(message)
    if _first_rank():
        logger.warning(message)
