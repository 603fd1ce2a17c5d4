"""Variants of ``bench.e2e.run``'s implementations (issue 32): float8, activation checkpointing, per-layer
``torch.compile``, shardfuse with an ``OffloadOptimizer`` GPU budget, one-round runs; out-of-memory rows, the
deadline, and the ratios against FSDP2.

An implementation name is a base and modifiers joined by ``+`` (``fsdp2+fp8+ac``, ``shardfuse+fp8``,
``fsdp2+once``); ``--compile``, ``--ac`` and ``--float8 RECIPE`` give every implementation of ``--impls`` the same
modifier. Bases that take modifiers: ``shardfuse``, ``shardfuse-budget``, ``fsdp2``; ``+once`` goes on any.

- ``+fp8`` / ``+fp8row``: torchao float8 training, the ``tensorwise`` / ``rowwise`` recipe, on the decoder layers'
  linear layers (the output projection stays in the compute dtype, as torchtitan leaves it). FSDP2: torchao's
  ``convert_to_float8_training`` with ``enable_fsdp_float8_all_gather`` where the recipe allows it (tensorwise) and
  ``precompute_float8_dynamic_scale_for_fsdp`` after every optimizer step. shardfuse: ``shardfuse.float8``'s
  ``convert_to_float8_training`` with the same config (the fp8 all-gather from the fused shard cast, tensorwise).
  On the CPU torchao's ``emulate`` runs the float8 matmuls.
- ``+ac``: activation checkpointing of every decoder layer (torch's ``checkpoint_wrapper``; the wrapper is the
  sharded unit). ``+acK`` (K >= 2, ``fsdp2`` only): of one layer in K (layers K-1, 2K-1, ...: torchtitan's
  selective layer checkpointing, ``ac_freq`` K), what fits between the two when full checkpointing is more than
  the memory needs. ``+acop``: every layer under torchtitan's op-level selective rule (``selective_ac_option = "op"``:
  attention, float8's amax and every other matrix product kept, the rest recomputed; ``_checkpointing``).
- ``+compile``: ``torch.compile`` of every decoder layer (``module.compile()``, before wrapping, as torchtitan).
- ``+split``: the input embedding and the output head wrapped as units of their own (torchtitan's layout), for
  ``shardfuse``, ``shardfuse-graph``, ``fsdp2`` and ``fsdp2-compile``: the step's first all-gather and last
  reduce-scatter carry the embedding alone.
- ``+fused`` / ``+unfused``: shardfuse's fused gradient pre-divide on / off for this run
  (``FlatParamHandle.fuse_grads``, on by default; ``SHARDFUSE_FUSED_GRADS=1``/``0`` sets it for a whole process
  and then wins), for ``shardfuse``, ``shardfuse-graph`` and ``shardfuse-budget``: both paths' runs interleave in
  one job. Runs with neither get the library's default. FSDP2 has no such path: ratios match FSDP2 without them.
- ``+rspg``: shardfuse's gradient reduce-scatters on a separate process group of the same ranks
  (``SHARDFUSE_REDUCE_SCATTER_GROUP=reduce_scatter`` while wrapping, FairScale's default) instead of the process
  group itself, for ``shardfuse``, ``shardfuse-graph`` and ``shardfuse-budget``: both in one job show what the
  second communicator buys. FSDP2 has one group: ratios match FSDP2 without it.
- ``+aoffN`` (e.g. ``+aoff6``): shardfuse's activation offload (``shardfuse.offload_activations``) of N decoder
  layers (its count: spread from the first layer on), for ``shardfuse``: what they save for backward waits in pinned
  host memory from the end of their forward to their backward. FSDP2 has none: ratios match FSDP2 without it.
- ``+keepN`` (e.g. ``+keep16``): the last N decoder layers keep their gathered parameters from forward to backward
  (``reshard_after_forward=False`` for them; with the float8 all-gather their weights stay in float8), for
  ``shardfuse``, ``shardfuse-graph``, ``fsdp2`` and ``fsdp2-compile``: backward gathers (and casts) them no more,
  for 1 byte a float8 weight element (2 in bf16) held through the step's memory peak. What spare memory buys where
  checkpointing is not needed. shardfuse keeps the last unit of the forward anyway, so ``+keep1`` changes nothing
  there.
- ``+sib``: shardfuse's ``StepInBackward``: each unit's optimizer step runs as its gradient is reduced, the
  sharded gradient freed then (the runs here do not clip), for ``shardfuse``. FSDP2 has none: ratios match FSDP2
  without it.
- ``+once``: run in one round only, after every round of the others (a configuration expected to run out of
  memory goes last: a rank that fails alone would leave the others waiting in a collective).
- ``shardfuse-budget``: shardfuse with ``move_params_to_cpu=True`` and ``OffloadOptimizer(gpu_budget_gib=
  --budget-gib)`` (default None: the room the device had at the peak of the first step), fused AdamW on the host
  for the units the budget leaves there, ``host_threads`` = this rank's share of the host's cores less one.

Ratios (``variant_ratios``, > 1 is faster): against FSDP2 with the same modifiers (``+once`` aside) and against
FSDP2's best configuration that ran (any modifiers; out-of-memory and failed runs have no step time), per regime.
``python -m bench.e2e._variants FILE.json ...`` prints the table of a result file.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from torch import nn

from bench.e2e._checkpointing import checkpoint_layers

BASES = ("shardfuse", "shardfuse-budget", "fsdp2")  # the implementations that take modifiers
SPLIT_BASES = ("shardfuse", "shardfuse-graph", "fsdp2", "fsdp2-compile")  # the ones that take +split
FUSED_BASES = ("shardfuse", "shardfuse-graph", "shardfuse-budget")  # the ones that take +fused / +unfused
RECIPES = ("tensorwise", "rowwise")
MODIFIERS = ("fp8", "fp8row", "ac", "acop", "compile", "once", "split", "fused", "unfused", "rspg", "sib")
FP8_RECIPE = {"fp8": "tensorwise", "fp8row": "rowwise"}
DYNAMO_RECOMPILE_LIMIT = 64  # every variant is a new guard set on the same layer code; the default 8 falls back
GIB = 1 << 30
_FLOAT8_ALIGN = 16  # torch._scaled_mm takes weights whose both dimensions are multiples of 16


@dataclass(frozen=True)
class Variant:
    """One implementation name, parsed: its base and what was added to it."""

    name: str
    base: str
    float8: str | None = None  # a recipe of RECIPES
    ac: int = 0  # checkpointed decoder layers: 0 none, 1 every layer (+ac), K (+acK) one in K
    ac_ops: bool = False  # +acop: every layer, op-level selective checkpointing
    compile: bool = False
    once: bool = False
    split: bool = False
    fused: bool | None = None  # +fused / +unfused; None: the library's default
    separate_rs: bool = False  # +rspg: shardfuse's reduce-scatters on a separate group of the same ranks
    offload_activations: int = 0  # +aoffN: N decoder layers' saved activations in host memory
    step_in_backward: bool = False  # +sib: shardfuse's StepInBackward drives the optimizer
    keep_gathered: int = 0  # +keepN: the last N decoder layers not resharded after forward

    @property
    def modifiers(self) -> tuple[str | None, int, bool, bool, bool, int]:
        """What "FSDP2 with the same modifiers" matches (``+once`` only says when the run goes)."""
        return (self.float8, self.ac, self.compile, self.split, self.ac_ops, self.keep_gathered)

    @property
    def fp8_all_gather(self) -> bool:
        """Whether the weights cross the wire in float8: torchao's all-gather exists for tensorwise scales only."""
        return self.float8 == "tensorwise" and self.base != "shardfuse-budget"


def split_name(name: str) -> tuple[str, list[str]]:
    """``"fsdp2+fp8+ac"`` -> ``("fsdp2", ["fp8", "ac"])``."""
    base, *mods = [part.strip() for part in name.split("+")]
    return base, mods


def _checkpoint_every(name: str, base: str, every: list[str], full: bool) -> int:
    """``Variant.ac`` of a name whose ``+acK`` modifiers are ``every`` and where ``full`` says whether ``+ac`` or
    ``--ac`` asks for every layer."""
    if not every:
        return 1 if full else 0
    k = int(every[0][2:])
    if len(every) > 1 or full or k < 2:
        raise ValueError(f"{name!r}: {'+'.join(every)}{' with +ac/--ac' if full else ''}: give one of +ac (every "
                         f"decoder layer) or +acK with K >= 2 (one layer in K, e.g. +ac2)")
    if base != "fsdp2":
        raise ValueError(f"{name!r}: +{every[0]} (checkpointing one layer in {k}) applies to fsdp2 only (the other "
                         f"wrappers make units of one layer class): use +ac for every layer or drop it")
    return k


def _check_keep(name: str, base: str, keep: list[str]) -> None:
    """Refuse ``+keepN`` modifiers (``keep``) that are not one count >= 1 on a base whose wrapper places units."""
    if len(keep) > 1 or (keep and not (keep[0][4:].isdigit() and int(keep[0][4:]) > 0)):
        raise ValueError(f"{name!r}: {'+'.join(keep)}: give one +keepN with N >= 1 decoder layers (e.g. +keep16)")
    if keep and base not in SPLIT_BASES:
        raise ValueError(f"{name!r}: +{keep[0]} (the last layers kept gathered for backward) applies to "
                         f"{', '.join(SPLIT_BASES)} only: drop it or pick one of those")


def parse_variant(name: str, known: Sequence[str], *, float8: str | None = None, ac: bool = False,
                  compile: bool = False) -> Variant:
    """Parse ``name`` (a base of ``known`` or ``BASES`` plus modifiers) with the job-wide flags added; raises
    ValueError naming the part that is wrong and what to write instead."""
    base, mods = split_name(name)
    aoff = [m for m in mods if m.startswith("aoff")]
    every = [m for m in mods if re.fullmatch(r"ac\d+", m)]
    keep = [m for m in mods if m.startswith("keep")]
    mods = [m for m in mods if m not in aoff and m not in every and m not in keep]
    ac_every = _checkpoint_every(name, base, every, ac or "ac" in mods)
    if "acop" in mods and ac_every:
        raise ValueError(f"{name!r}: +acop (op-level selective checkpointing of every layer) with +ac, +acK or --ac: "
                         f"give one checkpointing modifier")
    if len(aoff) > 1 or (aoff and not (aoff[0][4:].isdigit() and int(aoff[0][4:]) > 0)):
        raise ValueError(f"{name!r}: {'+'.join(aoff)}: give one +aoffN with N >= 1 decoder layers (e.g. +aoff6)")
    if aoff and base != "shardfuse":
        raise ValueError(f"{name!r}: +{aoff[0]} (shardfuse's activation offload) applies to shardfuse only: drop it "
                         f"or use shardfuse+{aoff[0]}")
    _check_keep(name, base, keep)
    if base not in known and base not in BASES:
        choices = ", ".join(dict.fromkeys([*known, *BASES]))
        raise ValueError(f"{name!r}: unknown implementation {base!r}; choose from {choices}")
    bad = [m for m in mods if m not in MODIFIERS]
    if bad or len(set(mods)) != len(mods):
        raise ValueError(f"{name!r}: modifiers {mods} are not distinct modifiers of {', '.join(MODIFIERS)} "
                         f"(e.g. fsdp2+fp8+ac, shardfuse+fp8, fsdp2+once)")
    recipes = {FP8_RECIPE[m] for m in mods if m in FP8_RECIPE} | ({float8} if float8 else set())
    if len(recipes) > 1:
        raise ValueError(f"{name!r}: float8 recipes {sorted(recipes)} at once (from the name and --float8): "
                         f"give one, +fp8 for tensorwise or +fp8row for rowwise")
    v = Variant(name, base, float8=next(iter(recipes), None), ac=ac_every,
                compile=compile or "compile" in mods, once="once" in mods, split="split" in mods,
                fused=True if "fused" in mods else False if "unfused" in mods else None, separate_rs="rspg" in mods,
                offload_activations=int(aoff[0][4:]) if aoff else 0, step_in_backward="sib" in mods,
                ac_ops="acop" in mods, keep_gathered=int(keep[0][4:]) if keep else 0)
    if v.step_in_backward and base != "shardfuse":
        raise ValueError(f"{name!r}: +sib (shardfuse's StepInBackward) applies to shardfuse only: drop it or use "
                         f"shardfuse+sib")
    if base not in BASES and (v.modifiers[:3] != (None, 0, False) or v.ac_ops):
        raise ValueError(f"{name!r}: float8, activation checkpointing and compile apply to {', '.join(BASES)} only "
                         f"(drop --float8/--ac/--compile or the modifier, or pick one of those)")
    if v.split and base not in SPLIT_BASES:
        raise ValueError(f"{name!r}: +split (embedding and output head as units of their own) applies to "
                         f"{', '.join(SPLIT_BASES)} only: drop it or pick one of those")
    if "fused" in mods and "unfused" in mods:
        raise ValueError(f"{name!r}: +fused and +unfused at once: keep one")
    if v.separate_rs and base not in FUSED_BASES:
        raise ValueError(f"{name!r}: +rspg (shardfuse's reduce-scatter group) applies to {', '.join(FUSED_BASES)} "
                         f"only: drop it or pick one of those")
    if v.fused is not None and base not in FUSED_BASES:
        raise ValueError(f"{name!r}: +fused / +unfused (shardfuse's fused gradient pre-divide) applies to "
                         f"{', '.join(FUSED_BASES)} only: drop it or pick one of those")
    return v


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``bench.e2e.run``'s options of the variants."""
    p.add_argument("--compile", action="store_true", help="torch.compile every decoder layer of every impl")
    p.add_argument("--ac", action="store_true", help="activation checkpointing of every decoder layer, every impl")
    p.add_argument("--float8", choices=RECIPES, default=None, help="torchao float8 training for every impl")
    p.add_argument("--budget-gib", type=float, default=None,
                   help="shardfuse-budget's OffloadOptimizer gpu_budget_gib (default: what the device had free)")
    p.add_argument("--gpu-mem-gib", type=float, default=None, metavar="GIB",
                   help="cap what each rank may allocate on its GPU (torch.cuda.set_per_process_memory_fraction), "
                        "to run a smaller GPU's memory on a larger one (an H100 80GB's on an H200: 78); a GPU "
                        "with less memory than this runs uncapped")
    p.add_argument("--deadline", type=float, default=None, metavar="SECONDS",
                   help="start no round (and no +once run) that would end past this many seconds from the start")


def check_arguments(p: argparse.ArgumentParser, args: argparse.Namespace, impls: Sequence[str],
                    known: Sequence[str]) -> dict[str, Variant]:
    """The parsed variant of every name of ``impls``; ``p.error`` on a wrong name or option."""
    if (args.budget_gib is not None and args.budget_gib < 0) or (args.deadline is not None and args.deadline <= 0):
        p.error(f"need --budget-gib >= 0 and --deadline > 0, got {args.budget_gib=} {args.deadline=}")
    if args.gpu_mem_gib is not None and not args.gpu_mem_gib > 0:
        p.error(f"need --gpu-mem-gib > 0 (GiB), got {args.gpu_mem_gib}")
    try:
        return {i: parse_variant(i, known, float8=args.float8, ac=args.ac, compile=args.compile) for i in impls}
    except ValueError as exc:
        p.error(f"--impls {args.impls!r}: {exc}")


def cap_gpu_memory(gib: float | None, device: torch.device) -> dict[str, Any]:
    """Cap this process's allocations on ``device`` at ``gib`` GiB (``--gpu-mem-gib``) and say so for the result's
    config. Only the caching allocator is capped: the CUDA context, NCCL's and cuBLAS's buffers come on top, as
    on the smaller GPU they come out of its memory, so a cap a little under that GPU's ``total_memory`` (78 of an
    H100 80GB's 79.2 GiB) is the fair emulation. OffloadOptimizer's default budget plans within the cap."""
    if gib is None or device.type != "cuda":
        return {"gpu_mem_cap_gib": None}
    total = torch.cuda.get_device_properties(device).total_memory
    if gib * GIB >= total:
        return {"gpu_mem_cap_gib": None, "gpu_mem_cap_note": f"--gpu-mem-gib {gib:g} >= the device's "
                f"{total / GIB:.1f} GiB: uncapped"}
    torch.cuda.set_per_process_memory_fraction(gib * GIB / total, device)
    return {"gpu_mem_cap_gib": gib, "gpu_mem_total_gib": round(total / GIB, 2)}


def unavailable(v: Variant) -> str | None:
    """Why the variant's extra pieces cannot run here (torchao missing), or None."""
    if v.float8 is None:
        return None
    try:
        import torchao.float8  # noqa: F401
    except ImportError as exc:
        return f"float8 needs torchao ({exc}): pip install torchao"
    return None


# ------------------------------------------------------------------------------------------------ building


@dataclass
class Prepared:
    """A wrapped model with its optimizer, and what runs after each optimizer step."""

    model: nn.Module
    opt: torch.optim.Optimizer
    after_step: Callable[[], None] | None = None
    info: dict[str, Any] = field(default_factory=dict)


def _float8_config(v: Variant, device: torch.device) -> Any:
    from torchao.float8 import Float8LinearConfig

    assert v.float8 is not None
    config = Float8LinearConfig.from_recipe_name(v.float8)
    # emulate: no float8 matmul on the CPU (smoke runs)
    return dataclasses.replace(config, enable_fsdp_float8_all_gather=v.fp8_all_gather, emulate=device.type != "cuda")


def convert_float8(v: Variant, model: nn.Module, layers: nn.ModuleList, device: torch.device) -> dict[str, Any]:
    """Swap the decoder layers' linear layers for torchao's ``Float8Linear`` (in place), through shardfuse.float8
    for shardfuse; returns what the row records."""
    inside = {id(m) for layer in layers for m in layer.modules()}

    def in_layers(module: nn.Module, fqn: str) -> bool:
        return (isinstance(module, nn.Linear) and id(module) in inside
                and module.in_features % _FLOAT8_ALIGN == 0 and module.out_features % _FLOAT8_ALIGN == 0)

    config = _float8_config(v, device)
    if v.base == "fsdp2":
        from torchao.float8 import convert_to_float8_training
    else:
        from shardfuse.float8 import convert_to_float8_training
    convert_to_float8_training(model, config=config, module_filter_fn=in_layers)
    converted = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
    return {"float8": v.float8, "fp8_all_gather": v.fp8_all_gather, "float8_linears": converted}


def _raise_recompile_limit() -> None:
    import torch._dynamo

    for key in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, key):
            setattr(torch._dynamo.config, key, max(getattr(torch._dynamo.config, key), DYNAMO_RECOMPILE_LIMIT))
            return


def host_threads() -> int:
    """This rank's share of the host's cores, less one for the thread that launches GPU work."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
    return max(1, cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))) - 1)


def _wrap_budget(model: nn.Module, layer_cls: type[nn.Module], device: torch.device,
                 args: Any) -> tuple[nn.Module, torch.optim.Optimizer, dict[str, Any]]:
    import shardfuse

    kwargs: dict[str, Any] = dict(mixed_precision=True, compute_dtype=torch.bfloat16, fp32_reduce_scatter=True,
                                  move_params_to_cpu=True, compute_device=device)
    with shardfuse.enable_wrap(wrapper_cls=shardfuse.FullyShardedDataParallel, **kwargs):
        model = shardfuse.auto_wrap(model, auto_wrap_policy=shardfuse.ModuleClassWrapPolicy(frozenset({layer_cls})))
        model = shardfuse.wrap(model)
    threads = host_threads()
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=True)  # the host's fastest AdamW
    opt = shardfuse.OffloadOptimizer(model, inner, gpu_budget_gib=args.budget_gib, host_threads=threads)
    return model, opt, {"gpu_budget_gib": args.budget_gib, "host_threads": threads, "host_optimizer": "AdamW fused"}


_LIBRARY_DEFAULT: dict[str, bool] = {}  # FlatParamHandle.fuse_grads as the library set it, before any run changed it


def _choose_gradient_path(fused: bool | None) -> None:
    """Every shardfuse run sets the class attribute its units read at lazy init (the first step, after this): runs
    of one process go one after the other, so each gets its own choice (None: the library's) whatever ran before."""
    from shardfuse.sharding.core._flat_param import FlatParamHandle

    default = _LIBRARY_DEFAULT.setdefault("fuse_grads", FlatParamHandle.fuse_grads)
    FlatParamHandle.fuse_grads = default if fused is None else fused


REDUCE_SCATTER_GROUP_ENV = "SHARDFUSE_REDUCE_SCATTER_GROUP"


def _unit_layout(v: Variant, n_layers: int) -> dict[str, str]:
    """What the row records of where the wrapper draws units (``+split``) and what they keep gathered for backward
    (``+keepN``); refuses a ``+keepN`` of more layers than the model's ``n_layers``."""
    info = {}
    if v.split:
        info["split"] = "input embedding and output head as units of their own"
    if v.keep_gathered:
        if v.keep_gathered > n_layers:
            raise ValueError(f"{v.name!r}: +keep{v.keep_gathered} asks for more layers than the model's {n_layers}: "
                             f"use +keep{n_layers} at most")
        info["keep_gathered"] = (f"the last {v.keep_gathered} decoder layers keep their gathered parameters from "
                                 f"forward to backward (reshard_after_forward=False)")
    return info


def prepare(v: Variant, model: nn.Module, spec: Any, device: torch.device, args: Any,
            wrappers: dict[str, Callable[..., nn.Module]], capturable: bool = False) -> Prepared:
    """Float8, then checkpointing, then compile (torchtitan's order), then the wrapper and the optimizer."""
    layers = spec.layers(model)
    layer_cls = spec.layer_cls
    info: dict[str, Any] = {}
    if v.float8:
        info.update(convert_float8(v, model, layers, device))
    if v.ac or v.ac_ops:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

        every_layer, info["activation_checkpointing"] = checkpoint_layers(layers, v.ac, v.ac_ops)
        # +acK is fsdp2's alone, whose wrapper shards spec.layers(model) whatever their class.
        layer_cls = CheckpointWrapper if every_layer else layer_cls
    if v.compile:
        _raise_recompile_limit()
        for layer in layers:
            layer.compile()
        info["compile"] = "every decoder layer"
    if v.base == "shardfuse-budget":
        model, opt, extra = _wrap_budget(model, layer_cls, device, args)
        return Prepared(model, opt, None, {**info, **extra})
    info.update(_unit_layout(v, len(layers)))
    if v.base in FUSED_BASES:
        _choose_gradient_path(v.fused)
        if v.fused is not None:
            info["fused_grads"] = ("views' gradients pre-divided straight into the reduce-scatter input" if v.fused
                                   else "off: one concatenated flat gradient, then the pre-divide")
    if v.separate_rs:
        info["reduce_scatter_group"] = "a separate group (SHARDFUSE_REDUCE_SCATTER_GROUP=reduce_scatter)"
    # Set only while wrapping (read at wrap time), restored after.
    choice = mock.patch.dict(os.environ, {REDUCE_SCATTER_GROUP_ENV: "reduce_scatter"})
    with choice if v.separate_rs else contextlib.nullcontext():
        placed = dataclasses.replace(spec, layer_cls=layer_cls, split_edges=v.split, keep_gathered=v.keep_gathered)
        model = wrappers[v.base](model, placed, device)
    if v.offload_activations:
        import shardfuse

        offload = shardfuse.offload_activations(model, v.offload_activations)
        info["offload_activations"] = (f"{v.offload_activations} decoder layers, spread (offload_activations' "
                                       f"count, copies back {offload.prefetch_ahead} ahead)")
    fused = args.optim == "fused" and device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, capturable=capturable and device.type == "cuda",
                            fused=fused)
    if v.step_in_backward:
        import shardfuse

        opt = shardfuse.StepInBackward(model, opt)
        info["step_in_backward"] = "each unit's AdamW step as its gradient is reduced (StepInBackward)"
    after_step = None
    if v.base == "fsdp2" and v.fp8_all_gather:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        def after_step() -> None:  # one all-reduce of every float8 weight's amax, for the next all-gather
            precompute_float8_dynamic_scale_for_fsdp(model)

    return Prepared(model, opt, after_step, info)


def is_oom(exc: BaseException) -> bool:
    """Whether ``exc`` is the device running out of memory (the caching allocator's error or NCCL's/cuBLAS's)."""
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


# ------------------------------------------------------------------------------------------------ schedule


def plan_runs(regimes: Sequence[str], variants: Sequence[Variant],
              rounds: int) -> tuple[list[list[tuple[str, Variant]]], list[tuple[str, Variant]]]:
    """The rounds of (regime, variant) runs, interleaved as ``bench.e2e.run`` always ran them, and after them the
    ``+once`` runs, each once, last."""
    every = [(r, v) for r in regimes for v in variants if not v.once]
    once = [(r, v) for r in regimes for v in variants if v.once]
    return [list(every) for _ in range(rounds)], once


class Deadline:
    """``--deadline``: a round starts only while the time so far plus the last round's time fits the budget; the
    ``+once`` runs start while the budget is not spent. Every rank asks its own clock and the ranks agree on the
    most cautious answer (one all-reduce on the host group), so they all stop at the same run."""

    def __init__(self, budget_s: float | None, clock: Callable[[], float] = time.monotonic) -> None:
        self.budget_s, self.clock = budget_s, clock
        self.start = clock()
        self.round_start = self.start
        self.last_round_s = 0.0

    def elapsed(self) -> float:
        return self.clock() - self.start

    def round_done(self, estimate_s: float | None = None) -> None:
        """A round ended; the next one is expected to take ``estimate_s`` (default: as long as this one)."""
        now = self.clock()
        self.last_round_s = now - self.round_start if estimate_s is None else estimate_s
        self.round_start = now

    def allows(self, need_s: float) -> bool:
        """Whether work of ``need_s`` seconds, started now, ends within the budget (always without one)."""
        return self.budget_s is None or self.elapsed() + need_s <= self.budget_s

    def agree(self, ok: bool, group: Any = None) -> bool:
        """Every rank's answer, the most cautious one (no collective outside a process group)."""
        import torch.distributed as dist

        if not dist.is_initialized():
            return ok
        flag = torch.tensor([1.0 if ok else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        return bool(flag.item())


def steady_round_s(rows: Sequence[dict[str, Any]], warmup: int) -> float:
    """What these runs would take again: each run's wall time with its warm-up steps at the timed steps' pace
    (the first round's warm-up compiles; the next one finds the compiled code cached)."""
    total = 0.0
    for r in rows:
        wall = float(r.get("wall_s", 0.0))
        if "step_ms" in r and "warmup_s_rank0" in r:
            wall += warmup * r["step_ms"] / 1e3 - r["warmup_s_rank0"]
        total += max(wall, 0.0)
    return total


# ------------------------------------------------------------------------------------------------ ratios


def _modifier_key(impl: str) -> tuple[str, tuple[str, ...]]:
    base, mods = split_name(impl)
    return base, tuple(sorted(m for m in mods if m not in ("once", "fused", "unfused", "rspg", "sib")
                              and not m.startswith("aoff")))


def variant_ratios(summary: list[dict[str, Any]]) -> None:
    """Add to each summary entry (medians over rounds, as ``bench.e2e.run.summarize`` makes them) its ratios
    against FSDP2: ``vs_fsdp2_same`` (FSDP2 with the same modifiers, ``fsdp2_same`` its name, ``peak_vs_fsdp2_same``
    this peak / that one) and ``vs_fsdp2_best`` (the fastest FSDP2 configuration of the regime that ran,
    ``fsdp2_best``). Step-time ratios are FSDP2's median / this one: > 1 is faster."""
    fsdp2 = [s for s in summary if _modifier_key(s["impl"])[0] == "fsdp2"]
    for s in summary:
        mods = _modifier_key(s["impl"])[1]
        same = [f for f in fsdp2 if f["regime"] == s["regime"] and _modifier_key(f["impl"])[1] == mods]
        if same and same[0] is not s:
            s["fsdp2_same"] = same[0]["impl"]
            s["vs_fsdp2_same"] = same[0]["step_ms_median"] / s["step_ms_median"]
            if same[0].get("peak_gib_max") and s.get("peak_gib_max"):
                s["peak_vs_fsdp2_same"] = s["peak_gib_max"] / same[0]["peak_gib_max"]
        ran = [f for f in fsdp2 if f["regime"] == s["regime"]]
        if ran:
            best = min(ran, key=lambda f: f["step_ms_median"])
            s["fsdp2_best"] = best["impl"]
            s["vs_fsdp2_best"] = best["step_ms_median"] / s["step_ms_median"]


def _status(rows: list[dict[str, Any]], impl: str, regime: str) -> str:
    mine = [r for r in rows if r.get("impl") == impl and r.get("regime") == regime]
    if any(r.get("oom") for r in mine):
        return "oom"
    if any("error" in r for r in mine):
        return "error"
    return "skipped" if any("skipped" in r for r in mine) else ""


def variant_table(payload: dict[str, Any]) -> list[str]:
    """The comparison table of a result file: medians, peak memory and the ratios against FSDP2; runs without a
    step time say why (oom, error, skipped)."""
    rows = payload.get("results", [])
    summary = payload.get("summary") or []
    if summary and not any("fsdp2_best" in s or "vs_fsdp2_same" in s for s in summary):
        variant_ratios(summary)
    lines = [f"{'impl':22s} {'regime':6s} {'rounds':>6s} {'median ms':>10s} {'tok/s/GPU':>10s} {'peak GiB':>9s} "
             f"{'reserved':>9s} {'retries':>7s} {'vs FSDP2 same':>14s} {'peak/same':>10s} {'vs FSDP2 best':>14s}  "
             f"best FSDP2"]
    done = set()
    for s in summary:
        done.add((s["impl"], s["regime"]))
        same = f"{s['vs_fsdp2_same']:13.3f}x" if "vs_fsdp2_same" in s else f"{'-':>14s}"
        peak = f"{s['peak_vs_fsdp2_same']:9.3f}x" if "peak_vs_fsdp2_same" in s else f"{'-':>10s}"
        best = f"{s['vs_fsdp2_best']:13.3f}x" if "vs_fsdp2_best" in s else f"{'-':>14s}"
        gib = f"{s['peak_gib_max']:9.2f}" if s.get("peak_gib_max") else f"{'-':>9s}"  # no peak on the CPU
        # the allocator's reserved peak and retries in the timed steps, most over rounds (GPU rows from a41648c on)
        runs = [r for r in rows if (r.get("impl"), r.get("regime")) == (s["impl"], s["regime"])
                and "alloc_retries" in r]
        reserved = f"{max(r['peak_reserved_gib'] for r in runs):9.2f}" if runs else f"{'-':>9s}"
        retries = f"{max(r['alloc_retries'] for r in runs):7d}" if runs else f"{'-':>7s}"
        lines.append(f"{s['impl']:22s} {s['regime']:6s} {s['rounds']:6d} {s['step_ms_median']:10.1f} "
                     f"{s['tok_s_gpu_median']:10,.0f} {gib} {reserved} {retries} {same} {peak} {best}  "
                     f"{s.get('fsdp2_best', '-')}")
    for r in rows:
        key = (r.get("impl"), r.get("regime"))
        if key not in done and "step_ms" not in r:
            done.add(key)
            status = _status(rows, *key)
            reason = str(r.get("error") or r.get("skipped") or "")
            lines.append(f"{key[0]:22s} {key[1]:6s} {status}: {reason[:110]}")
    lines.append("(median step times over rounds; vs FSDP2: FSDP2's median / this one, > 1 is faster; same = FSDP2 "
                 "with the same modifiers, best = FSDP2's fastest configuration that ran; peak/same: this peak / "
                 "that one; reserved: the allocator's peak, retries: its allocation retries in the timed steps, "
                 "both the most over rounds and ranks)")
    cap = (payload.get("config") or {}).get("gpu_mem_cap_gib")
    if cap:
        lines.append(f"(every rank's GPU allocations capped at {cap:g} GiB of "
                     f"{payload['config'].get('gpu_mem_total_gib', '?')}: --gpu-mem-gib, a smaller GPU's memory)")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """Print the variant table of each result file given."""
    import json

    paths = list(sys.argv[1:] if argv is None else argv)
    if not paths:
        print("usage: python -m bench.e2e._variants RESULT.json [...]", file=sys.stderr)
        return 2
    rc = 0
    for path in paths:
        p = Path(path)
        if not p.is_file():
            print(f"{p}: no such result file (did the run write it? see its log)")
            rc = 1
            continue
        payload = json.loads(p.read_text())
        cfg = payload.get("config", {})
        print(f"\n== {p.name}: {cfg.get('model', '?')} ({cfg.get('params', 0):,} params), "
              f"{cfg.get('world_size', '?')} ranks, compile {cfg.get('compile', False)}")
        print("\n".join(variant_table(payload)))
    return rc


if __name__ == "__main__":
    sys.exit(main())
