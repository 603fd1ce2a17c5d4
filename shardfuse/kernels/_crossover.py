"""Size crossovers of the dispatching entry points: below them, on CUDA, the entry point runs the PyTorch sequence
it replaces (same bits), because there the fixed cost of a Triton launch from Python is more than the kernel saves.

A rule is a :class:`Crossover` per GPU kind and family, fitted from the stored measurements
(``bench/results/<gpu>/kernels.json``) by ``python -m bench.kernels.crossover``; ``tests/bench`` holds ``MEASURED``
to what that fit gives for the stored files. The families and the rows each is fitted on:

- ``"cast_shards_list"``: ``cast_shards(srcs, [outs])`` vs ``torch._foreach_copy_(outs, srcs)``
  (``shard_cast_dispatch`` "list" rows);
- ``"cast_shards_flat"``: ``cast_shards(srcs, flat_out)`` vs ``torch._foreach_copy_`` into views of ``flat_out``
  (``shard_cast_dispatch`` "flat" rows);
- ``"chunk_cat"``: ``chunk_cat`` (no cast, power-of-two factor) vs ``torch._chunk_cat`` and one scaling pass. Not
  fitted, and on no kind in ``MEASURED``, so the kernel always (overrides still force either path): behind a launch
  plan the PyTorch pair costs the same plan key and layout guard as the kernel, then ``torch._chunk_cat``'s host
  work in place of one launch, and two passes over the output in place of one. On an H200 host the plan's PyTorch
  path, forced, was slower than its kernel at every case probed, 48 to 1024 tensors of 16K to 128K elements
  (docs/kernels.md, "Dispatch"). The many-tensor branch that skips the plan (``_chunk_cat.use_torch_chunk_cat``)
  is the count rule of the module itself;
- ``"concat"``: ``concat_microbatches`` vs ``torch.cat`` (``concat`` rows).

The H100 rules come from ``bench/results/h100/kernels.json`` (commit b5976d4, launches through Triton's JIT), the
H200 rules from four runs of one kernel code pooled (``bench.kernels.crossover.run_files``: the count rules' values
aside, which only choose between the two paths the runs time apart): ``bench/results/h200/kernels.json`` (81ed8f3,
a 32-core host) and ``kernels_runs/`` 241027f, 7faacaa (16-core hosts) and c7c0c05 (32-core); three interleaved
rounds per case (seven for a case whose every timing is under 20 us, nine for one whose rounds disagree by more than
20%) on one GPU of the host, launches through ``_launch.DirectLauncher``, each forced path forced once around its
timing. 241027f's host was up to 2x slower in host time than 7faacaa's (the bare ``_chunk_cat`` + ``div_`` of 1024
tensors x 8K: 334.4 us against 158.5): on it 31 tensors x 16K lost through the kernel (15.4 us against 11.9), so the
pooled rule takes the list form's kernel from 768 KiB below 17 tensors and from 384 KiB a tensor above (7faacaa's or
81ed8f3's alone: below 9, or from 96 KiB a tensor), and ``concat``'s never (the 4 GiB row lost there). The f19e517
runs' slower hosts had 8-31 x 16K lose too (13.6-18.9 us against 10.7-12.9): a host slower still would see 8-16 x 16K
lose by up to 1.7x (docs/kernels.md, "Dispatch").
Any other GPU kind gets ``FALLBACK``: for each family, the most cautious of the measured kinds' rules
(:func:`merge`). CPU tensors under
Triton's interpreter always take the kernel (``CPU``), so that the CPU suite exercises it.

Overriding: :func:`set_crossover` replaces one rule (for one kind, or for every kind), :func:`override` does so
for the duration of a ``with`` block (tests and benchmarks force a path this way), and the environment variable
``SHARDFUSE_KERNEL_DISPATCH`` set to ``triton`` or ``torch`` forces one path everywhere (read at import).
Launch plans remember the decision made for their tensors under the overrides in force (their keys carry
:func:`token`), so a forced path caches plans of its own and leaves the others in place.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields

import torch

__all__ = ["Crossover", "crossover", "gpu_kind", "override", "set_crossover"]

FAMILIES = ("cast_shards_list", "cast_shards_flat", "chunk_cat", "concat")


@dataclass(frozen=True)
class Crossover:
    """When an entry point runs its Triton kernel on CUDA rather than the PyTorch sequence (:meth:`triton`).

    A call of ``num`` tensors moving ``nbytes`` (each input read once, each output written once) takes the kernel
    when ``num >= many_tensors`` (at any size); else when ``nbytes >= min_bytes`` and either ``num < max_tensors``
    or ``nbytes / num >= big_tensor_bytes``. The default takes the kernel always.
    """

    min_bytes: float = 0
    max_tensors: float = math.inf
    many_tensors: float = math.inf
    big_tensor_bytes: float = math.inf

    def triton(self, num: int, nbytes: int) -> bool:
        if num >= self.many_tensors:
            return True
        if nbytes < self.min_bytes:
            return False
        return num < self.max_tensors or nbytes >= self.big_tensor_bytes * max(num, 1)


ALWAYS = Crossover()
NEVER = Crossover(min_bytes=math.inf)

# Fitted by `python -m bench.kernels.crossover` from bench/results/<kind>/kernels.json (see the module docstring).
MEASURED: dict[str, dict[str, Crossover]] = {
    "h100": {
        "cast_shards_list": Crossover(min_bytes=12582912, max_tensors=17),
        "cast_shards_flat": Crossover(min_bytes=math.inf, many_tensors=1000),
        "concat": Crossover(min_bytes=268427264),
    },
    "h200": {
        "cast_shards_list": Crossover(min_bytes=786432, max_tensors=17, big_tensor_bytes=393216),
        "cast_shards_flat": Crossover(min_bytes=1572864),
        "concat": NEVER,
    },
}


def merge(rules: list[Crossover]) -> Crossover:
    """The most cautious of ``rules``: the kernel only where every one of them takes it."""
    if not rules:
        return ALWAYS
    return Crossover(
        min_bytes=max(r.min_bytes for r in rules),
        max_tensors=min(r.max_tensors for r in rules),
        many_tensors=max(r.many_tensors for r in rules),
        big_tensor_bytes=max(r.big_tensor_bytes for r in rules),
    )


FALLBACK: dict[str, Crossover] = {
    f: merge([kind[f] for kind in MEASURED.values() if f in kind]) for f in FAMILIES
}
CPU = "cpu"  # the kind of CPU tensors (Triton's interpreter): the kernel always, unless overridden

_FORCED = {"triton": ALWAYS, "torch": NEVER}
_ENV = os.environ.get("SHARDFUSE_KERNEL_DISPATCH", "").strip().lower()
if _ENV and _ENV not in _FORCED:
    raise ValueError(
        f"SHARDFUSE_KERNEL_DISPATCH={_ENV!r} is not a dispatch mode: set it to 'triton' or 'torch', or unset it"
    )

# Overrides: kind (or None for every kind) -> family -> rule.
_OVERRIDES: dict[str | None, dict[str, Crossover]] = {}
# One small int per distinct set of overrides, part of every launch-plan key (``_common.guarded_key``): a plan
# remembers the path picked under the rules in force when it was built, and a forced path (``override``) builds
# and caches plans of its own without evicting the others.
_TOKENS: dict[tuple, int] = {(): 0}
_token = 0


def token() -> int:
    """The current set of overrides, as a small int (0: none)."""
    return _token


@functools.cache
def _cuda_kind(index: int) -> str:
    name = torch.cuda.get_device_name(index).lower()
    return next((kind for kind in MEASURED if kind in name), "other")


def gpu_kind(device: torch.device) -> str:
    """``"h100"``, ``"h200"``, ``"other"`` for another CUDA GPU, or ``"cpu"``."""
    if device.type != "cuda":
        return CPU
    return _cuda_kind(torch.cuda.current_device() if device.index is None else device.index)


def crossover(family: str, device: torch.device) -> Crossover:
    """The rule in force for ``family`` on ``device``."""
    kind = gpu_kind(device)
    for key in (kind, None):
        rule = _OVERRIDES.get(key, {}).get(family)
        if rule is not None:
            return rule
    if _ENV:
        return _FORCED[_ENV]
    if kind == CPU:
        return ALWAYS
    return MEASURED.get(kind, FALLBACK).get(family, FALLBACK[family])


def use_triton_at(family: str, device: torch.device, num: int, nbytes: int) -> bool:
    """Whether a call of ``family`` on ``device`` with ``num`` tensors moving ``nbytes`` runs the kernel."""
    return crossover(family, device).triton(num, nbytes)


def _check(family: str, rule: Crossover | str | None) -> Crossover | None:
    if family not in FAMILIES:
        raise ValueError(f"unknown kernel family {family!r}: pick one of {FAMILIES}")
    if isinstance(rule, str):
        if rule not in _FORCED:
            raise ValueError(f"rule={rule!r}: pass a Crossover, 'triton', 'torch' or None (back to the measured)")
        return _FORCED[rule]
    if rule is not None and not isinstance(rule, Crossover):
        raise TypeError(f"rule must be a Crossover, 'triton', 'torch' or None, got a {type(rule).__name__}")
    return rule


def set_crossover(family: str, rule: Crossover | str | None, kind: str | None = None) -> None:
    """Use ``rule`` for ``family`` on GPUs of ``kind`` (``"h100"``, ``"h200"``, ``"other"``, ``"cpu"``; None: every
    kind). ``"triton"``/``"torch"`` force one path; None drops the override. Launch plans built under other rules
    stay cached but are not used while these rules are in force (their keys carry :func:`token`)."""
    global _token
    checked = _check(family, rule)
    if checked is None:
        _OVERRIDES.get(kind, {}).pop(family, None)
    else:
        _OVERRIDES.setdefault(kind, {})[family] = checked
    state = tuple(sorted((k or "", f, r) for k, rules in _OVERRIDES.items() for f, r in rules.items()))
    _token = _TOKENS.setdefault(state, len(_TOKENS))


@contextlib.contextmanager
def override(rules: Mapping[str, Crossover | str], kind: str | None = None) -> Iterator[None]:
    """``set_crossover`` for each ``family: rule`` of ``rules`` inside the block, the previous rules after it."""
    saved = {f: _OVERRIDES.get(kind, {}).get(f) for f in rules}
    try:
        for family, rule in rules.items():
            set_crossover(family, rule, kind)
        yield
    finally:
        for family, old in saved.items():
            set_crossover(family, old, kind)


def describe(rule: Crossover) -> str:
    """``rule`` as Python source with only its non-default fields (as ``MEASURED`` writes it)."""
    if rule == NEVER:
        return "NEVER"
    parts = [f"{f.name}={_num(getattr(rule, f.name))}" for f in fields(rule) if getattr(rule, f.name) != f.default]
    return f"Crossover({', '.join(parts)})"


def _num(x: float) -> str:
    return "math.inf" if math.isinf(x) else str(int(x))
