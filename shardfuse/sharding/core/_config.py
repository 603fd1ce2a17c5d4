"""Every setting of a unit, written once, and every rule about which settings are legal.

FairScale's ~24 keyword arguments are the fields of small frozen policies (precision, offload, resharding,
gradient reduction, state dicts, parameter presentation); :class:`ShardingConfig` holds one of each. The
wrapper's keyword pass-through (:data:`OPTIONS`), its read-only attributes (:class:`ConfigView`) and its
signature come from ``dataclasses.fields()`` of these policies. Each rule lives here with an error that names
the fix; the runtime reads the result and never re-checks it. A unit's process groups are ``_groups.py``'s, where
its shards live and where it computes ``_devices.py``'s.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar, overload

import torch

from shardfuse._logging import warn_once
from shardfuse.sharding.core import _data_path as dp

logger = logging.getLogger(__name__)

_COMPUTE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Parameter dtypes the kernels shard, gather and reduce.
_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# What a pickled unit holds instead of its process groups until the user sets them again.


class TierSettings(Protocol):
    """What the core reads of ``offload_config=`` (the SSD tier's ``OffloadConfig``): whether the shards live on
    disk. The rest is the SSD tier's to define, validate and default (``ssd._ssd_config``)."""

    @property
    def ssd(self) -> bool: ...


# The SSD tier's ``settle``: the wrapper's ``offload_config=`` value, validated and defaulted, or None.
SettleTier = Callable[[Any], "TierSettings | None"]


def _opt(default: Any, doc: str, *, keyword: bool = True) -> Any:
    """A policy field: its FairScale default and its documentation (read by the wrapper's docstring)."""
    return field(default=default, metadata={"doc": doc, "keyword": keyword})


@dataclass(frozen=True)
class PrecisionPolicy:
    """Which dtypes a unit computes, keeps its buffers and reduces its gradients in."""

    mixed_precision: bool = _opt(False, "compute in ``compute_dtype`` (default fp16) with fp32 master shards.")
    compute_dtype: torch.dtype | None = _opt(None, "dtype of the gathered parameters under ``mixed_precision`` "
                                             "(fp16 or bf16); without it, only the parameters' own dtype.")
    buffer_dtype: torch.dtype | None = _opt(None, "dtype of floating buffers (default: ``compute_dtype``).")
    fp32_reduce_scatter: bool = _opt(False, "reduce gradients in fp32 under ``mixed_precision``.")
    force_input_to_fp32: bool = _opt(False, "cast floating inputs to fp32 when not in mixed precision.")
    clear_autocast_cache: bool = _opt(False, "clear the autocast cache after each forward.")

    @property
    def input_dtype(self) -> torch.dtype:
        """What the root casts floating inputs to under mixed precision: bf16 for bf16 compute, else fp16
        (FairScale casts to fp16 whatever the compute dtype, so fp32 compute under autocast sees fp16 too)."""
        return torch.bfloat16 if self.compute_dtype == torch.bfloat16 else torch.float16

    def reduce_dtype(self, param_dtypes: set[torch.dtype]) -> torch.dtype:
        """The dtype gradients are reduce-scattered in, for a unit whose parameters have ``param_dtypes``."""
        if not self.mixed_precision:
            return next(iter(param_dtypes)) if param_dtypes else torch.float32
        return torch.float32 if self.fp32_reduce_scatter else (self.compute_dtype or torch.float16)


@dataclass(frozen=True)
class OffloadPolicy:
    """Where the shards and their gradients live between uses (the overlapped CPU-offload engine grows here)."""

    move_params_to_cpu: bool = _opt(False, "keep the fp32 shard (and its gradient) in pinned CPU memory "
                                    "(alias ``cpu_offload``, deprecated).")
    move_grads_to_cpu: bool | None = _opt(None, "keep sharded gradients on the CPU (default: "
                                          "``move_params_to_cpu``; only together with it).")
    offload_config: TierSettings | None = _opt(None, "``OffloadConfig(offload_type='ssd_offload', dir=...)``: "
                                                "the fp32 shards (optionally the optimizer state) live in files "
                                                "under ``dir``; implies ``move_params_to_cpu``.")

    @property
    def ssd(self) -> Any:
        """The SSD tier's settings (its ``OffloadConfig``, opaque to the core) when the shards live on disk, else
        None."""
        return self.offload_config if self.offload_config is not None and self.offload_config.ssd else None


@dataclass(frozen=True)
class ReshardPolicy:
    """When full parameters are freed after use."""

    reshard_after_forward: bool = _opt(True, "free the full parameters after forward and gather them again "
                                       "for backward.")
    disable_reshard_on_root: bool = _opt(True, "the root keeps its full parameters between forward and backward.")


@dataclass(frozen=True)
class GradientPolicy:
    """How gradients are reduced across ranks."""

    gradient_predivide_factor: float | None = _opt(None, "divide gradients by this before the reduce-scatter "
                                                   "and by ``world_size / factor`` after it (default: FairScale's "
                                                   "power of two near sqrt(world_size)).")
    gradient_postdivide_factor: float | None = _opt(None, "set from ``gradient_predivide_factor``.", keyword=False)
    bucket_cap_mb: int = _opt(25, "accepted for compatibility: each unit reduces its gradient in one "
                              "reduce-scatter, so there is nothing to bucket (a non-default value is logged).")

    def divide_factors(self) -> tuple[float, float]:
        """``(predivide, postdivide)``, as :func:`make_config` settles them for the group's world size."""
        pre, post = self.gradient_predivide_factor, self.gradient_postdivide_factor
        if pre is None or post is None:
            raise RuntimeError(
                f"the gradient divide factors are not settled (predivide={pre}, postdivide={post}): build the "
                f"config with make_config(), which derives them from the world size"
            )
        return pre, post


@dataclass(frozen=True)
class StateDictPolicy:
    """What state dicts and optimizer-state consolidation return."""

    state_dict_device: torch.device | None = _opt(None, "device of the tensors in ``state_dict()`` "
                                                  "(default: the shards' device).")
    state_dict_on_rank_0_only: bool = _opt(False, "only rank 0 materialises ``state_dict()`` (others get ``{}``).")
    no_broadcast_optim_state: bool = _opt(False, "this unit's optimizer state is local (process groups of size 1, "
                                          "e.g. mixture-of-experts experts).")


@dataclass(frozen=True)
class ParamPolicy:
    """How the wrapped module's parameters are presented and initialised at wrap time."""

    flatten_parameters: bool = _opt(True, "``False`` exposes the original parameters (see ``use_orig_params``).")
    use_orig_params: bool = _opt(False, "register the original parameters, under their own names, as 1-D views of "
                                 "this rank's piece of each in the flat shard (FSDP1's name): per-parameter "
                                 "optimizer groups and freezing; communication stays flat.")
    sync_module_states: bool = _opt(False, "broadcast the first rank's parameters and buffers of this unit at wrap "
                                    "time; without it, ranks are checked to agree.")
    allow_reset_parameters: bool = _opt(False, "allow ``reset_parameters()`` (inside ``summon_full_params()``).")


@dataclass(frozen=True)
class ShardingConfig:
    """How one unit shards, gathers and reduces: one frozen policy per concern (hybrid sharding adds its own)."""

    precision: PrecisionPolicy = field(default_factory=PrecisionPolicy)
    offload: OffloadPolicy = field(default_factory=OffloadPolicy)
    reshard: ReshardPolicy = field(default_factory=ReshardPolicy)
    gradient: GradientPolicy = field(default_factory=GradientPolicy)
    state_dict: StateDictPolicy = field(default_factory=StateDictPolicy)
    params: ParamPolicy = field(default_factory=ParamPolicy)
    compute_device: torch.device | None = _opt(None, "device of the computation (default: the parameters' "
                                               "device, or the current CUDA device with ``move_params_to_cpu``).")
    verbose: bool = _opt(False, "add the configuration to ``repr()``.")

    @property
    def use_orig_params(self) -> bool:
        """``params.use_orig_params`` (read by optimizer-state consolidation)."""
        return self.params.use_orig_params


@dataclass(frozen=True)
class Option:
    """One FairScale keyword argument: where it lives in :class:`ShardingConfig` and its default."""

    name: str
    policy: str | None  # the ShardingConfig field holding it; None: a field of ShardingConfig itself
    default: Any
    doc: str


def _options() -> dict[str, Option]:
    out: dict[str, Option] = {}
    for top in dataclasses.fields(ShardingConfig):
        if top.default_factory is not dataclasses.MISSING:  # a policy: its keyword fields
            for f in dataclasses.fields(top.default_factory()):
                if f.metadata.get("keyword", True):
                    out[f.name] = Option(f.name, top.name, f.default, f.metadata["doc"])
        else:
            out[top.name] = Option(top.name, None, top.default, top.metadata["doc"])
    return out


# Every FairScale keyword the wrapper takes, in declaration order; ``cpu_offload`` is a deprecated alias.
OPTIONS: dict[str, Option] = _options()
ALIASES = {"cpu_offload": "move_params_to_cpu"}


def option_parameters() -> list[inspect.Parameter]:
    """The keyword-only parameters of the wrapper's signature, for ``inspect.signature`` and ``help()``."""
    names = [*OPTIONS, *ALIASES]
    defaults = {**{n: o.default for n, o in OPTIONS.items()}, **dict.fromkeys(ALIASES, False)}
    return [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=defaults[n]) for n in names]


def options_doc(indent: str = "        ") -> str:
    """The ``Args:`` lines of every option, from the policies' field documentation."""
    lines = [f"{indent}{o.name}: {o.doc}" for o in OPTIONS.values()]
    lines += [f"{indent}{a}: deprecated FairScale alias of ``{n}``." for a, n in ALIASES.items()]
    return "\n".join(lines)


_T = TypeVar("_T")


class _Setting(Generic[_T]):
    """A read-only attribute of the wrapper that reads option ``name`` from its unit's config."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name
        self.policy = OPTIONS[name].policy

    @overload
    def __get__(self, obj: None, objtype: type | None = None) -> _Setting[_T]: ...
    @overload
    def __get__(self, obj: object, objtype: type | None = None) -> _T: ...
    def __get__(self, obj: object | None, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        config = obj._unit.config  # type: ignore[attr-defined]
        return getattr(config if self.policy is None else getattr(config, self.policy), self.name)

    def __set__(self, obj: object, value: Any) -> None:
        raise AttributeError(f"{self.name} is fixed at wrap time (read-only): pass {self.name}=... when wrapping")


class ConfigView:
    """Mixin: the options as read-only attributes of the wrapper (FairScale exposes its settings so), read from
    the unit's frozen config. ``gradient_predivide_factor`` and ``no_broadcast_optim_state`` are the unit's live
    values instead (the wrapper declares them); a test checks that the two cover :data:`OPTIONS`."""

    reshard_after_forward = _Setting[bool]()
    disable_reshard_on_root = _Setting[bool]()
    mixed_precision = _Setting[bool]()
    compute_dtype = _Setting["torch.dtype | None"]()
    buffer_dtype = _Setting["torch.dtype | None"]()
    fp32_reduce_scatter = _Setting[bool]()
    force_input_to_fp32 = _Setting[bool]()
    clear_autocast_cache = _Setting[bool]()
    move_params_to_cpu = _Setting[bool]()
    move_grads_to_cpu = _Setting[bool]()
    offload_config = _Setting["TierSettings | None"]()
    bucket_cap_mb = _Setting[int]()
    state_dict_device = _Setting["torch.device | None"]()
    state_dict_on_rank_0_only = _Setting[bool]()
    flatten_parameters = _Setting[bool]()
    use_orig_params = _Setting[bool]()
    sync_module_states = _Setting[bool]()
    allow_reset_parameters = _Setting[bool]()
    compute_device = _Setting["torch.device | None"]()
    verbose = _Setting[bool]()


# ------------------------------------------------------------------------------------------------------
# keyword arguments -> ShardingConfig
# ------------------------------------------------------------------------------------------------------


def make_config(world_size: int, options: dict[str, Any], total_world: int | None = None,
                settle_tier: SettleTier | None = None) -> ShardingConfig:
    """Validate FairScale's keyword arguments for a unit sharded over ``world_size`` ranks into a
    :class:`ShardingConfig`; the divide factors span ``total_world`` ranks (hybrid sharding: shards times
    replicas, so the reduced gradient is the mean over every rank; default ``world_size``). ``settle_tier``
    (the SSD tier's ``settle``) validates and defaults ``offload_config``, which the core only carries."""
    opts = _with_defaults(options)
    top = {name: opts[name] for name, o in OPTIONS.items() if o.policy is None}
    if top["compute_device"] is not None:
        top["compute_device"] = torch.device(top["compute_device"])
    return ShardingConfig(
        precision=_precision(opts),
        offload=_offload(opts, settle_tier),
        reshard=ReshardPolicy(opts["reshard_after_forward"], opts["disable_reshard_on_root"]),
        gradient=_gradient(opts, world_size if total_world is None else total_world),
        state_dict=_state_dict(opts, world_size),
        params=ParamPolicy(
            flatten_parameters=bool(opts["flatten_parameters"]),
            use_orig_params=bool(opts["use_orig_params"]) or not opts["flatten_parameters"],
            sync_module_states=bool(opts["sync_module_states"]),
            allow_reset_parameters=opts["allow_reset_parameters"],
        ),
        **top,
    )


def _with_defaults(options: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(options) - set(OPTIONS) - set(ALIASES))
    if unknown:
        raise TypeError(
            f"FullyShardedDataParallel got unexpected keyword arguments {unknown}: the options are "
            f"{sorted([*OPTIONS, *ALIASES])}"
        )
    opts = {name: options.get(name, o.default) for name, o in OPTIONS.items()}
    if options.get("cpu_offload"):
        warn_once(logger, "cpu_offload is deprecated (as in FairScale); use move_params_to_cpu=True")
        opts["move_params_to_cpu"] = True
    return opts


def _offload(opts: dict[str, Any], settle_tier: SettleTier | None) -> OffloadPolicy:
    value = opts["offload_config"]
    if value is not None and settle_tier is None:
        raise TypeError(f"make_config got offload_config={value!r} but no settle_tier to validate it: pass the SSD "
                        f"tier's settle (shardfuse.sharding.ssd._ssd_config.settle), as the wrapper does")
    offload = settle_tier(value) if settle_tier is not None else None
    if offload is not None and offload.ssd:  # FairScale: the SSD tier keeps parameters and gradients on the CPU
        if opts["move_grads_to_cpu"] is False:
            raise ValueError(
                "offload_config=OffloadConfig(offload_type='ssd_offload') keeps gradients on the CPU "
                "(move_grads_to_cpu=True): drop move_grads_to_cpu=False"
            )
        opts = {**opts, "move_params_to_cpu": True}
    move_params = bool(opts["move_params_to_cpu"])
    move_grads = move_params if opts["move_grads_to_cpu"] is None else opts["move_grads_to_cpu"]
    if move_grads and not move_params:
        raise ValueError(
            "move_grads_to_cpu=True needs move_params_to_cpu=True (the sharded gradient lives beside its "
            "shard): pass move_params_to_cpu=True or drop move_grads_to_cpu"
        )
    if move_params and not move_grads:
        raise NotImplementedError(
            "move_params_to_cpu=True with move_grads_to_cpu=False is not supported (the optimizer would "
            "see CPU parameters with GPU gradients): leave move_grads_to_cpu=None or True"
        )
    return OffloadPolicy(move_params_to_cpu=move_params, move_grads_to_cpu=move_grads, offload_config=offload)


def _precision(opts: dict[str, Any]) -> PrecisionPolicy:
    compute_dtype = opts["compute_dtype"]
    if opts["mixed_precision"]:
        compute_dtype = torch.float16 if compute_dtype is None else compute_dtype
        if compute_dtype not in _COMPUTE_DTYPES:
            raise ValueError(f"compute_dtype={compute_dtype} is not supported: use torch.float16 or torch.bfloat16")
    else:
        # Without mixed_precision every group computes in its own dtype; a compute_dtype must name that dtype
        # (pure fp16: model.half(), compute_dtype=torch.float16): check_compute_dtype, once the dtypes are known.
        if compute_dtype is not None and compute_dtype not in _COMPUTE_DTYPES:
            raise ValueError(f"compute_dtype={compute_dtype} is not supported: use torch.float16, bfloat16 or float32")
        if opts["fp32_reduce_scatter"]:
            raise ValueError(
                "fp32_reduce_scatter=True only applies with mixed_precision=True (full precision already "
                "reduces in fp32): pass mixed_precision=True or drop fp32_reduce_scatter"
            )
    buffer_dtype = opts["buffer_dtype"]
    return PrecisionPolicy(
        mixed_precision=opts["mixed_precision"],
        compute_dtype=compute_dtype,
        buffer_dtype=buffer_dtype if buffer_dtype is not None else compute_dtype,
        fp32_reduce_scatter=opts["fp32_reduce_scatter"],
        force_input_to_fp32=opts["force_input_to_fp32"],
        clear_autocast_cache=opts["clear_autocast_cache"],
    )


def _gradient(opts: dict[str, Any], world_size: int) -> GradientPolicy:
    factor = opts["gradient_predivide_factor"]
    if factor is None:
        predivide, postdivide = dp.gradient_divide_factors(world_size)
    else:
        if isinstance(factor, bool) or not isinstance(factor, (int, float)):
            raise TypeError(
                f"gradient_predivide_factor must be a number, got {factor!r} ({type(factor).__name__}): pass "
                f"e.g. 2.0, or None for FairScale's default"
            )
        if not factor > 0:
            raise ValueError(f"gradient_predivide_factor must be > 0, got gradient_predivide_factor={factor}")
        predivide, postdivide = float(factor), world_size / float(factor)
    if opts["bucket_cap_mb"] != 25:
        logger.info("bucket_cap_mb=%s has no effect: each unit reduces its flat gradient in one reduce-scatter",
                    opts["bucket_cap_mb"])
    return GradientPolicy(predivide, postdivide, opts["bucket_cap_mb"])


def _state_dict(opts: dict[str, Any], world_size: int) -> StateDictPolicy:
    if opts["no_broadcast_optim_state"] and world_size > 1:
        raise NotImplementedError(
            f"no_broadcast_optim_state=True is only supported for unsharded units (process group of size "
            f"1, e.g. mixture-of-experts experts); this unit's group has world_size={world_size}"
        )
    device = opts["state_dict_device"]
    return StateDictPolicy(
        state_dict_device=torch.device(device) if device is not None else None,
        state_dict_on_rank_0_only=opts["state_dict_on_rank_0_only"],
        no_broadcast_optim_state=bool(opts["no_broadcast_optim_state"]),
    )


# ------------------------------------------------------------------------------------------------------
# rules that need the module: parameters' dtypes and devices, groups
# ------------------------------------------------------------------------------------------------------


def check_param_dtype(name: str, dtype: torch.dtype) -> None:
    """A parameter must be of a dtype the kernels shard (fp32, bf16, fp16)."""
    if not dtype.is_floating_point:
        raise TypeError(
            f"parameter {name} has dtype {dtype}; only floating-point parameters can be sharded: register it as "
            f"a buffer instead"
        )
    if dtype not in _PARAM_DTYPES:
        raise TypeError(
            f"parameter {name} has dtype {dtype}; FullyShardedDataParallel shards {list(_PARAM_DTYPES)} (its "
            f"kernels take no {dtype}): cast the model before wrapping, e.g. model.float(), or keep {name} out of "
            f"the wrapped module"
        )


def check_compute_dtype(config: ShardingConfig, dtypes: Iterable[torch.dtype], module_name: str) -> None:
    """Without mixed precision a ``compute_dtype`` must be the parameters' own dtype."""
    cd = config.precision.compute_dtype
    if config.precision.mixed_precision or cd is None:
        return
    wrong = sorted({str(d) for d in dtypes if d != cd})
    if wrong:
        raise ValueError(
            f"compute_dtype={cd} without mixed_precision computes in the parameters' own dtype, but {module_name} "
            f"has {wrong} parameters: cast the model first (e.g. model.half() for pure fp16), or pass "
            f"mixed_precision=True"
        )
