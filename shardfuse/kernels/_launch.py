"""Launching a compiled Triton kernel with less host time than ``kernel[grid](...)``.

A repeat launch through Triton's JIT (``JITFunction.run``) binds the arguments and computes their specialisation
(one generated function), then builds the compile-cache key from it and the options (a ``str`` of the options
dict), reads Triton's knobs, and only then calls the compiled kernel's C launcher. On a 16-core H200 host that was
14.4 us per launch of a 16-tensor ``cast_shards`` plan against 6.4 us for the C launcher alone (2026-11-29;
docs/kernels.md, "Launching"), so below a few MB a Triton path lost to the PyTorch sequence it replaces on host
time alone.

:class:`DirectLauncher` keeps the first launch of each specialisation on the JIT path (which compiles, loads and
returns the ``CompiledKernel``) and launches later calls with the same specialisation straight through that kernel's
launcher. The specialisation comes from Triton's own binder, so the kernel launched is the one the JIT would pick
(same argument types, pointer alignments, integer classes, constexprs and options); what is skipped is the cache-key
string, the knob reads and the hooks' metadata. The JIT path is kept where that shortcut cannot be taken or would
change behaviour: a launch hook or a pre-run hook of the kernel is set (a profiler such as Proton's wants its
metadata), the kernel is Triton's interpreter's (CPU tensors), the binder or kernel does not look like the Triton
versions this was written against (3.6 on the GPU hosts, 3.9 read too), or ``SHARDFUSE_DIRECT_LAUNCH=0`` (read at
import). Triton's debug knobs changed after a kernel's first launch are not seen by the direct launches (they would
recompile on the JIT path): set ``SHARDFUSE_DIRECT_LAUNCH=0`` while toggling them.

Each launcher caches, per (device, specialisation, options), the compiled kernel's launcher, function handle and
packed metadata: compiled code Triton's own cache holds anyway, never a tensor.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from triton import knobs

__all__ = ["DirectLauncher", "ENABLED"]

_ENV = os.environ.get("SHARDFUSE_DIRECT_LAUNCH", "1").strip()
if _ENV not in ("0", "1"):
    raise ValueError(
        f"SHARDFUSE_DIRECT_LAUNCH={os.environ['SHARDFUSE_DIRECT_LAUNCH']!r}: set it to 1 (launch compiled kernels "
        "directly, the default) or 0 (every launch through Triton's JIT), or unset it"
    )
ENABLED = _ENV == "1"

# Bound here so that tests can stand in for them on a machine without a GPU.
_current_device: Callable[[], int] = torch.cuda.current_device
# The raw current stream as Triton's JIT gets it (torch's private getter: no Stream object per launch).
_raw_stream: Callable[[int], int] = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
    lambda device: torch.cuda.current_stream(device).cuda_stream)

_MAX_ENTRIES = 64  # specialisations per kernel; past it the cache starts again (a bound, never reached in practice)


def _hooked(hook: Any) -> bool:
    """Whether a launch hook is set: Triton 3.6 keeps a chain of them (``knobs.HookChain``, empty unless a profiler
    added one); older Triton a function or None."""
    return hook is not None and bool(getattr(hook, "calls", True))


class DirectLauncher:
    """``launcher[grid](*args, **kwargs)`` launches ``kernel`` as ``kernel[grid](*args, **kwargs)`` would.

    ``direct_launches`` counts the launches that took the direct path (tests read it).
    """

    __slots__ = ("kernel", "direct_launches", "_compiled")

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.direct_launches = 0
        # (device, specialisation, options) -> (launcher, function handle, packed metadata)
        self._compiled: dict[tuple, tuple[Any, Any, Any]] = {}

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid: tuple[int, ...], args: tuple, kwargs: dict[str, Any]) -> None:
        key, bound = self._bind(args, kwargs)
        if key is not None:
            hit = self._compiled.get(key)
            if hit is not None:
                run, function, metadata = hit
                n = len(grid)
                run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, _raw_stream(key[0]), function,
                    metadata, None, None, None, *bound)
                self.direct_launches += 1
                return
        compiled = self.kernel[grid](*args, **kwargs)
        if key is not None:
            self._remember(key, compiled)

    def _bind(self, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple | None, tuple]:
        """(cache key, every argument in signature order) of a launch the direct path may serve; (None, ()) where
        it may not."""
        if not ENABLED or _hooked(knobs.runtime.launch_enter_hook) or _hooked(knobs.runtime.launch_exit_hook):
            return None, ()
        caches = getattr(self.kernel, "device_caches", None)
        if caches is None or getattr(self.kernel, "pre_run_hooks", None):  # the interpreter's kernel; hooks to run
            return None, ()
        try:
            device = _current_device()
            binder = caches[device][4]
            bound, specialization, options = binder(*args, **kwargs)
            key = (device, tuple(specialization), tuple(options.items()))
            hash(key)
        except Exception:  # noqa: BLE001 - a Triton whose private binder differs: its JIT path serves the call
            return None, ()
        return key, tuple(bound.values())

    def _remember(self, key: tuple, compiled: Any) -> None:
        try:
            entry = (compiled.run, compiled.function, compiled.packed_metadata)
        except AttributeError:  # not a CompiledKernel of the kind this was written against: JIT launches only
            return
        if entry[1] is None:
            return
        if len(self._compiled) >= _MAX_ENTRIES:
            self._compiled.clear()
        self._compiled[key] = entry
