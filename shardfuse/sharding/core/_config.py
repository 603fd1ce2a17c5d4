"""Every setting of a unit, written once, and every rule about which settings are legal.

FairScale's ~24 keyword arguments are the fields of small frozen policies (precision, offload, resharding,
gradient reduction, state dicts, parameter presentation); :class:`ShardingConfig` holds one of each. The
wrapper's keyword pass-through (:data:`OPTIONS`), its read-only attributes (:class:`ConfigView`) and its
signature come from ``dataclasses.fields()`` of these policies. Each rule lives here with an error that names
the fix, and so does the choice of the compute device; the runtime reads the result and never re-checks it.
:class:`Groups` is the one copy of a unit's process groups, shared by its handles and its gradient reduction.
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
from shardfuse.sharding.core import _collectives as coll
from shardfuse.sharding.core import _data_path as dp

logger = logging.getLogger(__name__)

_COMPUTE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Parameter dtypes the kernels shard, gather and reduce.
_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# What a pickled unit holds instead of its process groups until the user sets them again.
MISSING_GROUP = "MISSING"


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


class Groups:
    """The process groups of one unit and this process's place in them.

    The one copy: the unit, its flat-parameter handles and its gradient reduction hold this object, so
    :meth:`replace` (``set_groups``, after unpickling) changes them all. Hybrid sharding adds its replicate
    group (and the mesh) here: flat sharding has none.
    """

    # Class-level defaults: units pickled before hybrid sharding existed unpickle as flat ones.
    replicate_group: Any = None
    replicate_size: int = 1
    replicate_rank: int = 0
    mesh: Any = None
    # The 1-D DeviceMesh of ``process_group`` per device type, made by the checkpoint layer on first use (its
    # DTensors need one); dropped when the groups change or pickle.
    dcp_meshes: dict[str, Any] | None = None

    def __init__(self, process_group: coll.ProcessGroup, reduce_scatter_group: coll.ProcessGroup, rank: int,
                 world_size: int, replicate_group: coll.ProcessGroup | None = None, mesh: Any = None) -> None:
        self.process_group = process_group  # the shard group (hybrid sharding: the mesh's "shard" dimension)
        self.reduce_scatter_group = reduce_scatter_group
        self.rank = rank  # in the shard group
        self.world_size = world_size  # of the shard group: the shards are cut for it
        # Hybrid sharding: the replicas of this rank's shard (the mesh's "replicate" dimension), all-reduced
        # after each reduce-scatter; None for flat sharding. ``mesh``: the DeviceMesh given, if any.
        self.replicate_group = replicate_group
        self.replicate_size = 1 if replicate_group is None else coll.world_size(replicate_group)
        self.replicate_rank = 0 if replicate_group is None else coll.rank(replicate_group)
        self.mesh = mesh

    @property
    def hybrid(self) -> bool:
        """Gradients are all-reduced across more than one replica (a replicate group of size > 1)."""
        return self.replicate_size > 1

    @property
    def total_world(self) -> int:
        """Every rank that trains this unit: shard ranks times replicas (the divide factors' product)."""
        return self.world_size * self.replicate_size

    def replace(self, owner: str, process_group: Any | None = None, reduce_scatter_group: Any | None = None) -> None:
        """Set new groups (e.g. after unpickling); they must hold this rank at the same place."""
        for name, g in (("process_group", process_group), ("process_group_reduce_scatter", reduce_scatter_group)):
            if g is not None and (coll.rank(g), coll.world_size(g)) != (self.rank, self.world_size):
                raise ValueError(
                    f"{name} of {owner} must keep rank={self.rank} of world_size={self.world_size}, got "
                    f"rank={coll.rank(g)} of {coll.world_size(g)}: the shards were cut for the original group"
                )
        if process_group is not None:
            self.process_group = process_group
            self.dcp_meshes = None
        if reduce_scatter_group is not None:
            self.reduce_scatter_group = reduce_scatter_group

    @property
    def missing(self) -> bool:
        """Pickling dropped the groups and the user has not set them again."""
        return MISSING_GROUP in (self.process_group, self.reduce_scatter_group)

    @property
    def device(self) -> torch.device:
        """Where this group's collectives take tensors: the current GPU under NCCL, else the host."""
        if coll.is_cuda_group(self.process_group) and torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def __getstate__(self) -> dict:
        # Process groups do not pickle; the user sets them again (FairScale's "MISSING" convention).
        if self.replicate_group is not None or self.mesh is not None:
            raise NotImplementedError(
                "pickling a hybrid-sharded (device_mesh / HYBRID_SHARD) FullyShardedDataParallel is not supported: "
                "its replicate group and mesh cannot be set again after unpickling; save model.state_dict() "
                "instead and load it into a model wrapped on the new mesh"
            )
        return {**self.__dict__, "process_group": MISSING_GROUP, "reduce_scatter_group": MISSING_GROUP,
                "dcp_meshes": None}


def resolve_groups(process_group: Any | None, process_group_reduce_scatter: Any | None) -> Groups:
    """The unit's groups (default: the world group); the reduce-scatter group must hold the same ranks."""
    group = coll.default_group() if process_group is None else process_group
    rank, world = coll.rank(group), coll.world_size(group)
    if isinstance(process_group_reduce_scatter, str):
        raise NotImplementedError(
            f"process_group_reduce_scatter={process_group_reduce_scatter!r}: pass a ProcessGroup with the "
            f"same ranks (e.g. torch.distributed.new_group()) or None"
        )
    if process_group_reduce_scatter is None:
        return Groups(group, group, rank, world)
    rs_size, rs_rank = coll.world_size(process_group_reduce_scatter), coll.rank(process_group_reduce_scatter)
    if (rs_size, rs_rank) != (world, rank):
        raise ValueError(
            f"process_group_reduce_scatter must hold the same ranks as process_group: got "
            f"size={rs_size} rank={rs_rank} vs size={world} rank={rank}"
        )
    return Groups(group, process_group_reduce_scatter, rank, world)


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


def check_sync_module_states(groups: Groups) -> None:
    """``sync_module_states`` broadcasts, so it needs a real process group."""
    if not coll.is_process_group(groups.process_group):
        raise ValueError(
            "sync_module_states=True needs a torch.distributed process group to broadcast with, got "
            f"{type(groups.process_group).__name__}: pass a real group, or drop sync_module_states"
        )


def param_device(module_name: str, placed: dict[str, torch.device]) -> torch.device | None:
    """The one device of a unit's own parameters (``placed``: name -> device), or None without parameters."""
    devices = set(placed.values())
    if len(devices) > 1:
        where = sorted(f"{n}: {d}" for n, d in placed.items())[:8]
        raise ValueError(
            f"parameters of {module_name} are on several devices ({sorted(map(str, devices))}, e.g. {where}): move "
            f"the module to one device before wrapping"
        )
    return next(iter(devices)) if devices else None


# ------------------------------------------------------------------------------------------------------
# devices: where shards are kept and where a unit computes, chosen here only
# ------------------------------------------------------------------------------------------------------


def _default_gpu(groups: Groups) -> torch.device | None:
    return groups.device if groups.device.type == "cuda" else None


def shard_device(config: ShardingConfig, groups: Groups, found: torch.device | None) -> torch.device:
    """Where a unit keeps its shards, for parameters ``found`` on a device (None: meta-built or none yet).

    With ``move_params_to_cpu`` the host; under NCCL, parameters left on the CPU go to the compute device (the
    current GPU by default), as FairScale moves such modules; else where the parameters are.
    """
    requested = config.compute_device
    if config.offload.move_params_to_cpu:
        return torch.device("cpu")
    gpu = _default_gpu(groups)
    if found is None:  # nothing placed yet (a meta-built module gets its storage here)
        return requested or gpu or torch.device("cpu")
    if requested is not None and gpu is None and requested.type != found.type:
        raise ValueError(
            f"compute_device={requested} differs from the parameters' device {found}: move the module to "
            f"{requested} before wrapping, or pass move_params_to_cpu=True"
        )
    if gpu is not None and found.type == "cpu":
        return requested or gpu
    return found


def compute_device(config: ShardingConfig, shards: torch.device | None, fallback: torch.device | None) -> torch.device:
    """Where a unit computes (settled at lazy init): beside its shards, or with ``move_params_to_cpu`` on the
    requested (default: the current) GPU; a unit without parameters computes where ``fallback`` (its buffers or
    nested parameters) is."""
    if config.offload.move_params_to_cpu:
        if config.compute_device is not None:
            return config.compute_device
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if shards is not None:
        return shards
    return config.compute_device or fallback or torch.device("cpu")
