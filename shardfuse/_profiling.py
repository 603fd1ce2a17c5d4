"""Profiler ranges for every phase of shardfuse, free when no profiler runs."""

from __future__ import annotations

import contextlib

import torch
from torch.autograd import _profiler_enabled
from torch.profiler import record_function

_NULL_CONTEXT = contextlib.nullcontext()


def profiled(name: str) -> contextlib.AbstractContextManager:
    """``record_function(name)`` while a profiler runs; a no-op context (no dispatcher call) otherwise.

    Under ``torch.compile`` tracing it is always the no-op, so Dynamo never breaks a graph on it.
    """
    if torch.compiler.is_compiling() or not _profiler_enabled():
        return _NULL_CONTEXT
    return record_function(name)
