"""``FullyShardedDataParallel``: FairScale 0.4.13's ZeRO-3 wrapper on flat shards and shardfuse kernels.

Data path of one unit (one wrapped module), per training step:

- forward: the fp32 shard is cast into this rank's slice of the padded full buffer and all-gathered in place
  on the all-gather stream (the next unit's gather is issued before this unit computes); the module's
  parameters become views of the full buffer; the buffer is freed after forward (``reshard_after_forward``);
  pre-backward hooks go on the outputs.
- backward: the pre-backward hook gathers again (and prefetches the unit that runs backward next); once
  autograd has accumulated the flat full gradient, the post-backward hook pre-divides/casts/pads it,
  reduce-scatters it and post-divides it into ``flat.grad`` on the post-backward stream, and frees the full
  buffer; the root's final callback waits for the stream, handles units whose hooks did not fire and
  returns every unit to ``IDLE``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.autograd import Variable

from shardfuse._profiling import profiled
from shardfuse._streams import Streams, wait_stream
from shardfuse.sharding import _collectives as coll
from shardfuse.sharding import _data_path as dp
from shardfuse.sharding._flat_param import FLATTENED_MARK, FlatParamHandle, ParamSlot, iter_own_modules
from shardfuse.sharding._grad_reduce import PendingFrees, ReduceConfig, finish_host_grads, reduce_grad
from shardfuse.sharding._state import TrainingState, check_state

logger = logging.getLogger(__name__)

__all__ = ["FullyShardedDataParallel", "TrainingState"]

_WRAPPED_MARK = "_shardfuse_wrapped"
_HOOKED_ATTR = "_shardfuse_pre_backward_units"


class _RootState:
    """What the root shares with every unit of its tree: streams, the recorded order, backward bookkeeping."""

    def __init__(self, root: FullyShardedDataParallel, units: list[FullyShardedDataParallel], streams: Streams):
        self.root = root
        self.units = units
        self.streams = streams
        self.fwd_order: list[FullyShardedDataParallel] = []
        self.order_recorded = False
        self.fwd_pos = 0
        self.prefetch_ok = False
        self.bwd_next: dict[int, FullyShardedDataParallel] = {}
        self.in_backward = False
        self.callback_queued = False
        self.pending = PendingFrees()

    def finish_recording(self) -> None:
        """Freeze the forward order and derive the backward prefetch order from it."""
        self.order_recorded = True
        seen: set[int] = set()
        seq: list[FullyShardedDataParallel] = []
        # Backward runs the root's hook first, then the other units in reverse forward order.
        for u in [self.root, *reversed(self.fwd_order)]:
            if id(u) not in seen:
                seen.add(id(u))
                seq.append(u)
        self.bwd_next = {id(a): b for a, b in zip(seq, seq[1:])}


class _IncompatibleKeys(NamedTuple):
    missing_keys: list[str]
    unexpected_keys: list[str]


def _iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _iter_tensors(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _iter_tensors(x)


def _cast_floats(obj: Any, dtype: torch.dtype) -> Any:
    """``obj`` with every floating tensor inside tuples/lists/dicts cast to ``dtype`` (autograd-aware)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() and obj.dtype != dtype else obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_cast_floats(x, dtype) for x in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cast_floats(x, dtype) for x in obj)
    if isinstance(obj, dict):
        return {k: _cast_floats(v, dtype) for k, v in obj.items()}
    return obj


def _inside_backward() -> bool:
    """True while the autograd engine runs a backward (a checkpoint recompute calls forward from there)."""
    return torch._C._current_graph_task_id() != -1


def _forbidden_reset(module: nn.Module, *args: Any, **kwargs: Any) -> None:
    raise RuntimeError(
        f"reset_parameters() of {type(module).__name__} was called after FullyShardedDataParallel flattened its "
        f"parameters: pass allow_reset_parameters=True and call it inside summon_full_params()"
    )


class FullyShardedDataParallel(nn.Module):
    """Shard a module's parameters, gradients and optimizer state across data-parallel ranks (ZeRO-3).

    Drop-in for ``fairscale.nn.FullyShardedDataParallel`` 0.4.13. Wrap inner blocks first (or use
    ``shardfuse.sharding._wrap``), then the whole model; build the optimizer on ``model.parameters()``,
    which are the sharded flat parameters. Parameters must be initialised identically on every rank.

    Args:
        module: the module to wrap; its own parameters (not those of nested instances) are flattened per
            (dtype, requires_grad) group and sharded.
        process_group: the data-parallel group (default: the world group).
        process_group_reduce_scatter: optional separate group (same ranks) for gradient reduce-scatter.
        reshard_after_forward: free the full parameters after forward and gather them again for backward.
        disable_reshard_on_root: the root keeps its full parameters between forward and backward.
        mixed_precision: compute in ``compute_dtype`` (default fp16) with fp32 master shards.
        fp32_reduce_scatter: reduce gradients in fp32 under ``mixed_precision`` (default: compute dtype).
        flatten_parameters: must be True (shardfuse always flattens).
        move_params_to_cpu: keep the fp32 shard (and its gradient) in pinned CPU memory.
        compute_dtype: dtype of the gathered parameters under ``mixed_precision`` (fp16 or bf16).
        buffer_dtype: dtype of floating buffers (default: ``compute_dtype`` under ``mixed_precision``).
        move_grads_to_cpu: keep sharded gradients on the CPU (default: ``move_params_to_cpu``).
        bucket_cap_mb: accepted for compatibility; each unit already reduces its gradient in one
            reduce-scatter, so there is nothing to bucket (a non-default value is logged).
        compute_device: device of the computation (default: the parameters' device, or the current CUDA
            device with ``move_params_to_cpu``).
        no_broadcast_optim_state: this unit's optimizer state is local (only for process groups of size 1,
            e.g. mixture-of-experts experts): ``gather_full_optim_state_dict`` takes the recipient's own state.
        state_dict_device: device of the tensors in ``state_dict()`` (default: the shards' device).
        clear_autocast_cache: clear the autocast cache after each forward.
        force_input_to_fp32: cast floating inputs to fp32 when not in mixed precision.
        verbose: add the configuration to ``repr()``.
        cpu_offload: deprecated FairScale alias of ``move_params_to_cpu``.
        state_dict_on_rank_0_only: only rank 0 materialises ``state_dict()`` (other ranks get ``{}``).
        gradient_predivide_factor: divide gradients by this before the reduce-scatter and by
            ``world_size / factor`` after it (default: FairScale's power of two near sqrt(world_size)).
        allow_reset_parameters: allow ``reset_parameters()`` (inside ``summon_full_params()``), including
            ones that replace the ``nn.Parameter`` objects.
    """

    def __init__(
        self,
        module: nn.Module,
        process_group: Any | None = None,
        process_group_reduce_scatter: Any | None = None,
        reshard_after_forward: bool = True,
        disable_reshard_on_root: bool = True,
        mixed_precision: bool = False,
        fp32_reduce_scatter: bool = False,
        flatten_parameters: bool = True,
        move_params_to_cpu: bool = False,
        compute_dtype: torch.dtype | None = None,
        buffer_dtype: torch.dtype | None = None,
        move_grads_to_cpu: bool | None = None,
        bucket_cap_mb: int = 25,
        compute_device: torch.device | str | None = None,
        no_broadcast_optim_state: bool | None = False,
        state_dict_device: torch.device | str | None = None,
        clear_autocast_cache: bool = False,
        force_input_to_fp32: bool = False,
        verbose: bool = False,
        cpu_offload: bool = False,
        state_dict_on_rank_0_only: bool = False,
        gradient_predivide_factor: float | None = None,
        allow_reset_parameters: bool = False,
    ) -> None:
        with profiled("shardfuse.sharding:wrap"):
            super().__init__()
            if not isinstance(module, nn.Module):
                raise TypeError(f"FullyShardedDataParallel wraps an nn.Module, got {type(module).__name__}")
            if isinstance(module, FullyShardedDataParallel):
                raise ValueError(
                    "module is already a FullyShardedDataParallel instance: wrap each module once "
                    "(nest instances by wrapping inner submodules, then the outer module)"
                )
            if getattr(module, _WRAPPED_MARK, False):
                raise ValueError(
                    f"{type(module).__name__} was already wrapped by FullyShardedDataParallel (its parameters are "
                    f"flattened): wrap each module once and keep using the first wrapper"
                )
            if not flatten_parameters:
                raise NotImplementedError(
                    "flatten_parameters=False is not supported: shardfuse always shards flat parameters; "
                    "use flatten_parameters=True (the default)"
                )
            move_params_to_cpu = bool(move_params_to_cpu or cpu_offload)
            if cpu_offload:
                logger.warning("cpu_offload is deprecated (as in FairScale); use move_params_to_cpu=True")
            if move_grads_to_cpu is None:
                move_grads_to_cpu = move_params_to_cpu
            if move_grads_to_cpu and not move_params_to_cpu:
                raise ValueError(
                    "move_grads_to_cpu=True needs move_params_to_cpu=True (the sharded gradient lives beside its "
                    "shard): pass move_params_to_cpu=True or drop move_grads_to_cpu"
                )
            if move_params_to_cpu and not move_grads_to_cpu:
                raise NotImplementedError(
                    "move_params_to_cpu=True with move_grads_to_cpu=False is not supported (the optimizer would "
                    "see CPU parameters with GPU gradients): leave move_grads_to_cpu=None or True"
                )
            if mixed_precision:
                compute_dtype = torch.float16 if compute_dtype is None else compute_dtype
                if compute_dtype not in (torch.float16, torch.bfloat16, torch.float32):
                    raise ValueError(
                        f"compute_dtype={compute_dtype} is not supported: use torch.float16 or torch.bfloat16"
                    )
            else:
                if compute_dtype not in (None, torch.float32):
                    raise ValueError(
                        f"compute_dtype={compute_dtype} needs mixed_precision=True: pass mixed_precision=True "
                        f"or drop compute_dtype"
                    )
                if fp32_reduce_scatter:
                    raise ValueError(
                        "fp32_reduce_scatter=True only applies with mixed_precision=True (full precision already "
                        "reduces in fp32): pass mixed_precision=True or drop fp32_reduce_scatter"
                    )
            if gradient_predivide_factor is not None and not gradient_predivide_factor > 0:
                raise ValueError(f"gradient_predivide_factor must be > 0, got {gradient_predivide_factor=}")
            if bucket_cap_mb != 25:
                logger.info(
                    "bucket_cap_mb=%s has no effect: each unit reduces its flat gradient in one reduce-scatter",
                    bucket_cap_mb,
                )

            self.process_group = coll.default_group() if process_group is None else process_group
            self.rank = coll.rank(self.process_group)
            self.world_size = coll.world_size(self.process_group)
            if process_group_reduce_scatter is not None and not isinstance(process_group_reduce_scatter, str):
                rs_size = coll.world_size(process_group_reduce_scatter)
                rs_rank = coll.rank(process_group_reduce_scatter)
                if (rs_size, rs_rank) != (self.world_size, self.rank):
                    raise ValueError(
                        f"process_group_reduce_scatter must hold the same ranks as process_group: got "
                        f"size={rs_size} rank={rs_rank} vs size={self.world_size} rank={self.rank}"
                    )
                self.process_group_reduce_scatter = process_group_reduce_scatter
            elif isinstance(process_group_reduce_scatter, str):
                raise NotImplementedError(
                    f"process_group_reduce_scatter={process_group_reduce_scatter!r}: pass a ProcessGroup with the "
                    f"same ranks (e.g. torch.distributed.new_group()) or None"
                )
            else:
                self.process_group_reduce_scatter = self.process_group
            if no_broadcast_optim_state and self.world_size > 1:
                raise NotImplementedError(
                    f"no_broadcast_optim_state=True is only supported for unsharded units (process group of size "
                    f"1, e.g. mixture-of-experts experts); this unit's group has world_size={self.world_size}"
                )

            self.reshard_after_forward = reshard_after_forward
            self.disable_reshard_on_root = disable_reshard_on_root
            self.mixed_precision = mixed_precision
            self.fp32_reduce_scatter = fp32_reduce_scatter
            self.flatten_parameters = True
            self.move_params_to_cpu = move_params_to_cpu
            self.move_grads_to_cpu = move_grads_to_cpu
            self.compute_dtype = compute_dtype if mixed_precision else None
            self.buffer_dtype = buffer_dtype if buffer_dtype is not None else self.compute_dtype
            self.bucket_cap_mb = bucket_cap_mb
            self.no_broadcast_optim_state = bool(no_broadcast_optim_state)
            self.clear_autocast_cache = clear_autocast_cache
            self.force_input_to_fp32 = force_input_to_fp32
            self.verbose = verbose
            self.state_dict_on_rank_0_only = state_dict_on_rank_0_only
            self.allow_reset_parameters = allow_reset_parameters
            if gradient_predivide_factor is None:
                self.gradient_predivide_factor, self.gradient_postdivide_factor = dp.default_divide_factors(
                    self.world_size
                )
            else:
                self.gradient_predivide_factor = float(gradient_predivide_factor)
                self.gradient_postdivide_factor = self.world_size / self.gradient_predivide_factor

            self.training_state = TrainingState.IDLE
            self._is_root: bool | None = None
            self._fsdp_parent: FullyShardedDataParallel | None = None  # plain attribute, not a submodule
            self._root_state: _RootState | None = None
            self._require_backward_grad_sync = True
            self._reshard_after_forward_effective = reshard_after_forward
            self._buffer_dtypes: dict[tuple[int, str], torch.dtype] = {}

            self._handles, self._param_table = self._flatten(module, compute_device)
            for i, h in enumerate(self._handles):
                self.register_parameter(f"flat_param_{i}", h.flat)
            self._fsdp_wrapped_module = module
            object.__setattr__(module, _WRAPPED_MARK, True)
            # Nested units know their outermost wrapper, so any of them can trigger the root's lazy init.
            for m in module.modules():
                if isinstance(m, FullyShardedDataParallel) and m.__dict__.get("_fsdp_parent") is None:
                    object.__setattr__(m, "_fsdp_parent", self)
                    m._is_root = False
            self._guard_reset_parameters(module)
            self._state_dict_device = torch.device(state_dict_device) if state_dict_device is not None else None
            self._pre_backward_hook_fn = self._pre_backward_hook
            logger.debug(
                "wrapped %s: %d flat groups, %d params, world_size=%d",
                type(module).__name__, len(self._handles), sum(h.numel for h in self._handles), self.world_size,
            )

    # ----------------------------------------------------------------------------------------------
    # wrap time
    # ----------------------------------------------------------------------------------------------

    def _flatten(
        self, module: nn.Module, compute_device: torch.device | str | None
    ) -> tuple[list[FlatParamHandle], dict[int, list[tuple[str, int, int]]]]:
        """Flatten the module's own parameters per (dtype, requires_grad) group; remove the originals."""
        unique: dict[int, nn.Parameter] = {}
        regs: list[tuple[str, nn.Module, str, nn.Parameter]] = []
        order: dict[int, list[str]] = {}
        for prefix, m in iter_own_modules(module, FullyShardedDataParallel):
            for name, p in m._parameters.items():
                if p is None:
                    continue
                if getattr(p, FLATTENED_MARK, None) is not None:
                    raise ValueError(
                        f"parameter {prefix}{name} is shared with a module already wrapped by another "
                        f"FullyShardedDataParallel unit: parameters shared across units are not supported; wrap "
                        f"the modules that share it in the same unit"
                    )
                if not p.is_floating_point():
                    raise TypeError(
                        f"parameter {prefix}{name} has dtype {p.dtype}; only floating-point parameters can be "
                        f"sharded: register it as a buffer instead"
                    )
                unique.setdefault(id(p), p)
                regs.append((prefix, m, name, p))
                order.setdefault(id(m), []).append(name)
        devices = {p.device for p in unique.values()}
        if len(devices) > 1:
            where = sorted({f"{pre}{n}: {p.device}" for pre, _, n, p in regs})[:8]
            raise ValueError(
                f"parameters of {type(module).__name__} are on several devices ({sorted(map(str, devices))}, e.g. "
                f"{where}): move the module to one device before wrapping"
            )
        param_device = next(iter(devices)) if devices else None
        if compute_device is not None:
            compute_device = torch.device(compute_device)
            if (
                not self.move_params_to_cpu
                and param_device is not None
                and compute_device.type != param_device.type
            ):
                raise ValueError(
                    f"compute_device={compute_device} differs from the parameters' device {param_device}: move "
                    f"the module to {compute_device} before wrapping, or pass move_params_to_cpu=True"
                )
        self._compute_device_arg = compute_device
        # Groups in order of first appearance.
        groups: dict[tuple[torch.dtype, bool], list[nn.Parameter]] = {}
        for p in unique.values():
            groups.setdefault((p.dtype, p.requires_grad), []).append(p)
        shard_device = torch.device("cpu") if self.move_params_to_cpu else param_device
        handles: list[FlatParamHandle] = []
        table: dict[int, list[tuple[str, int, int]]] = {}
        for hi, params in enumerate(groups.values()):
            index = {id(p): i for i, p in enumerate(params)}
            slots = [
                ParamSlot(m, name, f"{prefix}{name}", index[id(p)]) for prefix, m, name, p in regs if id(p) in index
            ]
            h = FlatParamHandle(
                params, slots, group=self.process_group, rank=self.rank, world_size=self.world_size,
                shard_device=shard_device, pin=self.move_params_to_cpu,
            )
            handles.append(h)
            for s in slots:
                table.setdefault(id(s.module), []).append((s.attr, hi, s.index))
        # Keep each module's original parameter order for state dicts.
        for mid, names in order.items():
            rank_of = {n: i for i, n in enumerate(names)}
            table[mid].sort(key=lambda e: rank_of[e[0]])
        for _, m, name, p in regs:
            m._parameters.pop(name, None)
            setattr(p, FLATTENED_MARK, True)
        return handles, table

    def _guard_reset_parameters(self, module: nn.Module) -> None:
        """Make ``reset_parameters`` of owned submodules fail loudly unless ``allow_reset_parameters``."""
        if self.allow_reset_parameters:
            return
        for _, m in iter_own_modules(module, FullyShardedDataParallel):
            if callable(getattr(type(m), "reset_parameters", None)):
                m.__dict__["reset_parameters"] = functools.partial(_forbidden_reset, m)

    # ----------------------------------------------------------------------------------------------
    # properties and nn.Module plumbing
    # ----------------------------------------------------------------------------------------------

    @property
    def module(self) -> nn.Module:
        """The wrapped module."""
        return self._fsdp_wrapped_module

    @property
    def is_root(self) -> bool | None:
        """True for the outermost instance (known after the first forward / lazy init), else False or None."""
        return self._is_root

    @property
    def params_with_grad(self) -> list[nn.Parameter]:
        """The (sharded flat) parameters that have a gradient."""
        return [p for p in self.parameters() if p.grad is not None]

    def __getattr__(self, name: str) -> Any:
        """Attributes not found on the wrapper come from the wrapped module (as in FairScale)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            wrapped = self.__dict__["_modules"].get("_fsdp_wrapped_module")
            if wrapped is None:
                raise
            return getattr(wrapped, name)

    def __getitem__(self, key: int) -> Any:
        """Index into a wrapped ``nn.Sequential``/``nn.ModuleList``."""
        return self.module.__getitem__(key)

    def extra_repr(self) -> str:
        """Configuration summary (with ``verbose=True``)."""
        if not self.verbose:
            return f"world_size={self.world_size}, flat_params={len(self._handles)}"
        return (
            f"world_size={self.world_size}, rank={self.rank}, flat_params={len(self._handles)}, "
            f"numel={[h.numel for h in self._handles]}, reshard_after_forward={self.reshard_after_forward}, "
            f"mixed_precision={self.mixed_precision}, compute_dtype={self.compute_dtype}, "
            f"buffer_dtype={self.buffer_dtype}, fp32_reduce_scatter={self.fp32_reduce_scatter}, "
            f"move_params_to_cpu={self.move_params_to_cpu}, "
            f"gradient_divide=({self.gradient_predivide_factor}, {self.gradient_postdivide_factor})"
        )

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> nn.Module:
        # .to()/.cuda()/.half() move the shards; the runtime (full buffers, streams) is rebuilt lazily.
        for u in self._units():
            check_state(u.training_state, (TrainingState.IDLE,), "moving or casting the model", u._unit_name())
        out = super()._apply(fn, recurse)
        for h in self._handles:
            if h.full_param is not None:
                h.reshard()
            h.full_param = None
        self._root_state = None
        self._is_root = None
        return out

    def _unit_name(self) -> str:
        return f"FullyShardedDataParallel({type(self.module).__name__})"

    def _units(self) -> list[FullyShardedDataParallel]:
        """This unit and every nested unit, in module order (self first)."""
        return [m for m in self.modules() if isinstance(m, FullyShardedDataParallel)]

    # ----------------------------------------------------------------------------------------------
    # lazy init
    # ----------------------------------------------------------------------------------------------

    def _lazy_init(self) -> None:
        """On first use: make this instance the root of its tree; create streams, full buffers, cast buffers."""
        if self._root_state is not None:
            return
        top = self
        while top.__dict__.get("_fsdp_parent") is not None:
            top = top.__dict__["_fsdp_parent"]
        if top is not self:
            top._lazy_init()
            if self._root_state is not None:
                return
        units = self._units()
        for u in units[1:]:
            check_state(u.training_state, (TrainingState.IDLE,), "initialising the root", u._unit_name())
        for u in units:
            u._init_runtime()
        device = self._compute_device
        rs = _RootState(self, units, Streams(device))
        for u in units:
            u._root_state = rs
            u._is_root = u is self
            u._reshard_after_forward_effective = u.reshard_after_forward
        if self.disable_reshard_on_root:
            self._reshard_after_forward_effective = False

    def _init_runtime(self) -> None:
        """Per-unit runtime: compute device and dtypes, full buffers with their post-backward hooks, buffers."""
        if self.move_params_to_cpu:
            dev = self._compute_device_arg
            if dev is None:
                dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
            self._compute_device = dev if dev is not None else torch.device("cpu")
        elif self._handles:
            self._compute_device = self._handles[0].flat.device
        else:
            dev = self._compute_device_arg
            if dev is None:
                some = next(iter(self.module.buffers()), None)
                dev = some.device if some is not None else next(
                    (p.device for p in self.parameters()), torch.device("cpu")
                )
            self._compute_device = torch.device(dev)
        for h in self._handles:
            if h.full_param is None:
                cdt = self.compute_dtype if self.mixed_precision else h.dtype
                h.init_full_buffer(cdt, self._compute_device)
                if h.requires_grad:
                    h.full_param.register_post_accumulate_grad_hook(functools.partial(self._post_backward_hook, h))
        dts = {h.compute_dtype for h in self._handles}
        reduce_dtype = torch.float32 if (self.fp32_reduce_scatter or not self.mixed_precision) else self.compute_dtype
        if not self.mixed_precision and dts:
            reduce_dtype = next(iter(dts))
        self._reduce_cfg = ReduceConfig(
            reduce_dtype=reduce_dtype,
            predivide=self.gradient_predivide_factor,
            postdivide=self.gradient_postdivide_factor,
            group=self.process_group_reduce_scatter,
        )
        self._cast_buffers()

    def _cast_buffers(self) -> None:
        """Floating buffers of owned modules to ``buffer_dtype`` on the compute device (originals remembered)."""
        for _, m in iter_own_modules(self.module, FullyShardedDataParallel):
            for name, b in m._buffers.items():
                if b is None:
                    continue
                key = (id(m), name)
                self._buffer_dtypes.setdefault(key, b.dtype)
                dtype = self.buffer_dtype if (self.buffer_dtype is not None and b.is_floating_point()) else b.dtype
                if b.dtype != dtype or b.device != self._compute_device:
                    m._buffers[name] = b.to(device=self._compute_device, dtype=dtype)

    def __setattr__(self, name: str, value: Any) -> None:
        # training_state changes several times per unit and step; nn.Module.__setattr__'s checks for
        # parameters, buffers and submodules cost more than the state machine itself.
        if name == "training_state":
            self.__dict__[name] = value
        else:
            super().__setattr__(name, value)

    # ----------------------------------------------------------------------------------------------
    # gather / free helpers
    # ----------------------------------------------------------------------------------------------

    def _unshard(self) -> None:
        streams = self._root_state.streams
        for h in self._handles:
            h.unshard(streams)

    def _wait_and_set_views(self, set_views: bool = True) -> None:
        streams = self._root_state.streams
        for h in self._handles:
            h.wait_full(streams)
            if set_views:
                h.set_views()

    def _reshard(self) -> None:
        for h in self._handles:
            h.reshard()

    # ----------------------------------------------------------------------------------------------
    # forward
    # ----------------------------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Gather the full parameters, run the wrapped module, reshard, and hook the outputs for backward."""
        with profiled("shardfuse.sharding:forward"):
            self._lazy_init()
            rs = self._root_state
            if rs.in_backward:
                if _inside_backward():
                    return self._recompute_forward(args, kwargs)
                # The last backward raised (e.g. out of memory) before its final callback could run.
                logger.warning("the previous backward did not finish (it raised); resetting the sharding state")
                rs.root._return_to_idle()
            check_state(
                self.training_state, (TrainingState.IDLE,), "forward()", self._unit_name(),
                "do not call a unit's forward from inside its own forward, summon_full_params() or backward",
            )
            self.training_state = TrainingState.FORWARD
            try:
                if self._is_root:
                    rs.fwd_pos = 0
                    rs.prefetch_ok = rs.order_recorded
                    if self.mixed_precision:
                        args, kwargs = _cast_floats((args, kwargs), self.compute_dtype)
                if self.force_input_to_fp32 and not self.mixed_precision:
                    args, kwargs = _cast_floats((args, kwargs), torch.float32)
                nxt = self._forward_prefetch_target()
                self._unshard()
                if nxt is not None:
                    with profiled("shardfuse.sharding:prefetch"):
                        nxt._unshard()
                self._wait_and_set_views()
                for h in self._handles:
                    h.forward_version = h.flat._version
                outputs = self.module(*args, **kwargs)
                if self._reshard_after_forward_effective and not self._keep_full_for_backward():
                    self._reshard()
                if torch.is_grad_enabled():
                    self._register_pre_backward_hooks(outputs)
            finally:
                self.training_state = TrainingState.IDLE
            if self._is_root and not rs.order_recorded:
                rs.finish_recording()
            if self.clear_autocast_cache:
                torch.clear_autocast_cache()
            return outputs

    def _keep_full_for_backward(self) -> bool:
        """The last unit of the recorded forward order is the first whose backward needs full parameters:
        freeing them now would only gather them again, with nothing to overlap, when backward starts."""
        rs = self._root_state
        return torch.is_grad_enabled() and rs.prefetch_ok and bool(rs.fwd_order) and rs.fwd_order[-1] is self

    def _forward_prefetch_target(self) -> FullyShardedDataParallel | None:
        """The unit that ran after this one in the recorded forward order (None while recording/mismatched)."""
        rs = self._root_state
        pos = rs.fwd_pos
        rs.fwd_pos += 1
        if not rs.order_recorded:
            rs.fwd_order.append(self)
            return None
        if not rs.prefetch_ok:
            return None
        order = rs.fwd_order
        if pos >= len(order) or order[pos] is not self:
            rs.prefetch_ok = False  # the order changed: stop prefetching for this pass
            return None
        return order[pos + 1] if pos + 1 < len(order) else None

    def _recompute_forward(self, args: tuple, kwargs: dict) -> Any:
        """Forward during backward (activation checkpointing recompute): gather, run, keep params for backward."""
        with profiled("shardfuse.sharding:recompute_forward"):
            if self.training_state == TrainingState.IDLE:
                # Reentrant checkpointing runs the unit's backward without its pre-backward hook.
                self.training_state = TrainingState.BACKWARD_PRE
            if self._is_root and self.mixed_precision:
                args, kwargs = _cast_floats((args, kwargs), self.compute_dtype)
            self._unshard()
            self._wait_and_set_views()
            return self.module(*args, **kwargs)

    def _register_pre_backward_hooks(self, outputs: Any) -> None:
        key = id(self)
        for t in _iter_tensors(outputs):
            if not t.requires_grad:
                continue
            units = t.__dict__.get(_HOOKED_ATTR)
            if units is None:
                units = set()
                t.__dict__[_HOOKED_ATTR] = units
            if key in units:  # once per tensor and unit, however often it is returned
                continue
            units.add(key)
            t.register_hook(self._pre_backward_hook_fn)

    # ----------------------------------------------------------------------------------------------
    # backward
    # ----------------------------------------------------------------------------------------------

    def _pre_backward_hook(self, grad: torch.Tensor) -> None:
        rs = self._root_state
        with profiled("shardfuse.sharding:pre_backward"):
            self._check_unchanged_since_forward()  # before any state changes: the error leaves the tree usable
            if not rs.callback_queued:
                rs.callback_queued = True
                rs.in_backward = True
                Variable._execution_engine.queue_callback(rs.root._wait_for_post_backward)
            state = self.training_state
            if state == TrainingState.IDLE:
                self.training_state = TrainingState.BACKWARD_PRE
            elif state not in (TrainingState.BACKWARD_PRE, TrainingState.BACKWARD_POST):
                check_state(state, (TrainingState.IDLE, TrainingState.BACKWARD_PRE), "backward", self._unit_name())
            # Idempotent: several outputs, several forwards and checkpoint recomputes all land here.
            self._unshard()
            if rs.order_recorded:
                nxt = rs.bwd_next.get(id(self))
                if nxt is not None and nxt.training_state == TrainingState.IDLE:
                    with profiled("shardfuse.sharding:prefetch"):
                        nxt._unshard()
            # The views autograd saved in forward share the full buffer's storage, restored in place. The
            # module attributes get fresh autograd-connected views too (grad mode is off inside backward):
            # an activation-checkpoint recompute inside the wrapped module reads them.
            with torch.enable_grad():
                self._wait_and_set_views()

    def _check_unchanged_since_forward(self) -> None:
        for h in self._handles:
            if h.forward_version is not None and h.flat._version != h.forward_version:
                raise RuntimeError(
                    f"the sharded parameters of {self._unit_name()} changed between its forward and its backward "
                    f"(version {h.forward_version} -> {h.flat._version}), e.g. optimizer.step() before "
                    f"loss.backward(): the gradients would not belong to the parameters the forward used; "
                    f"step the optimizer after backward"
                )

    def _post_backward_hook(self, handle: FlatParamHandle, full_param: torch.Tensor) -> None:
        with profiled("shardfuse.sharding:post_backward"):
            if self.training_state not in (TrainingState.BACKWARD_PRE, TrainingState.BACKWARD_POST):
                raise RuntimeError(
                    f"the post-backward hook of {self._unit_name()} ran in state={self.training_state.name} "
                    f"without its pre-backward hook: backward reached the unit's parameters without going "
                    f"through its outputs (e.g. a tensor derived from a parameter view outside forward); "
                    f"compute the loss from the model's outputs"
                )
            self.training_state = TrainingState.BACKWARD_POST
            handle.fired = True
            rs = self._root_state
            if self._require_backward_grad_sync:
                reduce_grad(handle, self._reduce_cfg, rs.streams, rs.pending)
            # Under no_sync the full gradient stays in full_param.grad and keeps accumulating.
            handle.reshard()

    def _wait_for_post_backward(self) -> None:
        """Root's final backward callback: flush reductions, reshard everything, return to IDLE."""
        rs = self._root_state
        with profiled("shardfuse.sharding:wait_for_post_backward"):
            streams = rs.streams
            for u in rs.units:
                for h in u._handles:
                    # A group unused in this synced backward but holding no_sync gradients: reduce them now.
                    # (Usage must be the same on every rank, as in FairScale/FSDP2, or collectives mismatch.)
                    if (
                        h.requires_grad and not h.fired and u._require_backward_grad_sync
                        and h.full_param is not None and h.full_param.grad is not None
                    ):
                        reduce_grad(h, u._reduce_cfg, streams, rs.pending)
            self._return_to_idle()

    def _return_to_idle(self) -> None:
        """Root only: wait for issued reductions, reshard every unit and leave the backward bookkeeping."""
        rs = self._root_state
        streams = rs.streams
        wait_stream(streams.current(), streams.post_backward)
        rs.pending.release_all()
        finish_host_grads(rs.pending, streams)
        for u in rs.units:
            for h in u._handles:
                h.reshard()
                h.fired = False
                h.forward_version = None
            if u.training_state in (TrainingState.BACKWARD_PRE, TrainingState.BACKWARD_POST):
                u.training_state = TrainingState.IDLE
        rs.in_backward = False
        rs.callback_queued = False

    # ----------------------------------------------------------------------------------------------
    # public API: sync control, divide factors, norms
    # ----------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate full-size gradients locally (no reduce-scatter) inside the block, for every nested unit.

        The next backward outside the block reduces the accumulated sum. Costs full-size gradient memory.
        """
        units = self._units()
        old = [u._require_backward_grad_sync for u in units]
        for u in units:
            u._require_backward_grad_sync = False
        try:
            yield
        finally:
            for u, o in zip(units, old):
                u._require_backward_grad_sync = o

    def set_gradient_divide_factors(self, pre: float, post: float, recursive: bool = True) -> None:
        """Divide gradients by ``pre`` before and by ``post`` after the reduce-scatter (``pre * post`` is
        normally ``world_size`` for an average)."""
        for name, v in (("pre", pre), ("post", post)):
            if not (isinstance(v, (int, float)) and v > 0):
                raise ValueError(f"set_gradient_divide_factors needs {name} > 0, got {name}={v!r}")
        for u in self._units() if recursive else [self]:
            u.gradient_predivide_factor = float(pre)
            u.gradient_postdivide_factor = float(post)
            if hasattr(u, "_reduce_cfg"):
                u._reduce_cfg.predivide = float(pre)
                u._reduce_cfg.postdivide = float(post)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients of all sharded parameters by their global norm (one all-reduce); returns the norm.

        Only the root may call it (the norm spans the whole model).
        """
        with profiled("shardfuse.sharding:clip_grad_norm"):
            self._lazy_init()
            if not self._is_root:
                raise RuntimeError(
                    f"clip_grad_norm_() must be called on the root FullyShardedDataParallel instance, not on the "
                    f"nested {self._unit_name()}: call it on the outermost wrapper"
                )
            for u in self._units():
                check_state(u.training_state, (TrainingState.IDLE,), "clip_grad_norm_()", u._unit_name(),
                            "call it after backward has finished")
            norm_type = float(norm_type)
            grads = [p.grad for p in self.parameters() if p.grad is not None]
            device = self._compute_device
            if not grads:
                local = torch.zeros((), dtype=torch.float32, device=device)
            elif norm_type == float("inf"):
                local = torch.stack([g.detach().abs().max().float().to(device) for g in grads]).max()
            else:
                norms = torch._foreach_norm([g.detach() for g in grads], norm_type)
                local = torch.stack([n.float().to(device) for n in norms]).pow(norm_type).sum()
            if norm_type == float("inf"):
                total = coll.all_reduce_(local, self.process_group, self.world_size, op="max")
            else:
                total = coll.all_reduce_(local, self.process_group, self.world_size).pow(1.0 / norm_type)
            coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
            for dev_grads in _by_device(grads).values():
                torch._foreach_mul_(dev_grads, coef.to(dev_grads[0].device))
            return total

    # ----------------------------------------------------------------------------------------------
    # summon_full_params
    # ----------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def summon_full_params(self, recurse: bool = True, volatile: bool = False) -> Iterator[None]:
        """Gather the full fp32 parameters and expose them as the module's original parameters in the block.

        Inside, ``named_parameters()`` of the wrapped modules shows the original names and full tensors. On
        exit, in-place changes are written back to the shards (each rank keeps its own slice) unless
        ``volatile``. Not allowed during forward/backward.
        """
        self._lazy_init()
        units = self._units() if recurse else [self]
        for u in units:
            check_state(u.training_state, (TrainingState.IDLE,), "summon_full_params()", u._unit_name(),
                        "call it outside forward and backward")
        with contextlib.ExitStack() as stack:
            for u in units:
                stack.enter_context(u._summon_own(volatile))
            yield

    @contextlib.contextmanager
    def _summon_own(self, volatile: bool) -> Iterator[None]:
        with profiled("shardfuse.sharding:summon_full_params"):
            streams = self._root_state.streams
            wait_stream(streams.current(), streams.post_backward)
            self.training_state = TrainingState.SUMMON_FULL_PARAMS
            saved_params = dict(self._parameters)
            fulls: list[torch.Tensor] = []
            inserted: list[list[nn.Parameter]] = []
            try:
                for h in self._handles:
                    h.reshard()  # the compute buffer may go stale; it is gathered again after the block
                    full = h.gather_full_precision(self._compute_device)
                    fulls.append(full)
                    params = [nn.Parameter(v, requires_grad=h.requires_grad) for v in h.split_full(full)]
                    inserted.append(params)
                    for s in h.slots:
                        s.module.__dict__.pop(s.attr, None)
                        s.module._parameters[s.attr] = params[s.index]
                for name in saved_params:
                    self._parameters.pop(name)
            except BaseException:
                self._summon_restore(saved_params)
                self.training_state = TrainingState.IDLE
                raise
            versions = [h.flat._version for h in self._handles]
            try:
                yield
            finally:
                try:
                    if not volatile:
                        self._check_shards_untouched(versions)
                        self._summon_write_back(fulls, inserted)
                finally:
                    self._summon_restore(saved_params)
                    self.training_state = TrainingState.IDLE

    def _check_shards_untouched(self, versions: list[int]) -> None:
        for h, v in zip(self._handles, versions):
            if h.flat._version != v:
                raise RuntimeError(
                    f"the sharded parameters of {self._unit_name()} changed inside summon_full_params() (e.g. an "
                    f"optimizer step): writing the full parameters back would overwrite that change; step the "
                    f"optimizer outside summon_full_params(), or pass volatile=True if the full parameters are "
                    f"only read"
                )

    @torch.no_grad()
    def _summon_write_back(self, fulls: list[torch.Tensor], inserted: list[list[nn.Parameter]]) -> None:
        for h, full, params in zip(self._handles, fulls, inserted):
            views = h.split_full(full)
            for s in h.slots:
                cur = s.module._parameters.get(s.attr)
                if cur is params[s.index]:
                    continue
                if not self.allow_reset_parameters:
                    raise RuntimeError(
                        f"{s.fqn} was replaced by a new tensor inside summon_full_params() on {self._unit_name()}: "
                        f"modify parameters in place, or pass allow_reset_parameters=True to copy replacements back"
                    )
                if cur is None or cur.shape != views[s.index].shape:
                    raise RuntimeError(
                        f"{s.fqn} was replaced inside summon_full_params() by "
                        f"{None if cur is None else tuple(cur.shape)}, expected shape {tuple(views[s.index].shape)}"
                    )
                views[s.index].copy_(cur)
            shard = h.shard_of(full)
            h.flat.detach().copy_(shard)  # bumps the shard's version: gathered copies are refreshed

    def _summon_restore(self, saved_params: dict[str, nn.Parameter]) -> None:
        for h in self._handles:
            for s in h.slots:
                s.module._parameters.pop(s.attr, None)
            h.clear_views()
        self._parameters.clear()
        self._parameters.update(saved_params)

    def apply(self, fn: Callable[[nn.Module], None]) -> FullyShardedDataParallel:
        """``nn.Module.apply`` with the full parameters summoned, so ``fn`` can initialise them."""
        if self.training_state == TrainingState.SUMMON_FULL_PARAMS:  # nested unit, reached by the outer apply
            super().apply(fn)
            return self
        with profiled("shardfuse.sharding:apply"), self.summon_full_params(recurse=True):
            super().apply(fn)
        return self

    # ----------------------------------------------------------------------------------------------
    # state dicts and optimizer state (implemented in state_dict.py / optim_state.py)
    # ----------------------------------------------------------------------------------------------

    def state_dict(self, *args: Any, destination: dict | None = None, prefix: str = "",
                   keep_vars: bool = False) -> dict[str, Any]:
        """Full state dict under the original parameter names (no wrapper prefixes), gathered in fp32.

        With ``state_dict_on_rank_0_only`` only rank 0 gets the tensors (others ``{}``); every rank must call.
        """
        from shardfuse.sharding._state_dict import full_state_dict

        if args:  # legacy positional form state_dict(destination, prefix, keep_vars)
            destination = args[0]
            prefix = args[1] if len(args) > 1 else prefix
        with profiled("shardfuse.sharding:state_dict"):
            sd = full_state_dict(self)
            if destination is None:
                destination = type(sd)()
            for k, v in sd.items():
                destination[prefix + k] = v
            return destination

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True, assign: bool = False) -> NamedTuple:
        """Load a full state dict (original names, e.g. from an unwrapped model); every rank must call."""
        from shardfuse.sharding._state_dict import load_full_state_dict

        if assign:
            raise NotImplementedError("load_state_dict(assign=True) is not supported: parameters are flat shards")
        with profiled("shardfuse.sharding:load_state_dict"):
            missing, unexpected = load_full_state_dict(self, state_dict, strict)
            return _IncompatibleKeys(missing, unexpected)

    def local_state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """This rank's shards and the buffers, under the wrapper's own parameter names (flat_param_i)."""
        from shardfuse.sharding._state_dict import local_state_dict

        with profiled("shardfuse.sharding:local_state_dict"):
            return local_state_dict(self)

    def load_local_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> NamedTuple:
        """Load a dict from :meth:`local_state_dict` saved with the same world size and wrapping."""
        from shardfuse.sharding._state_dict import load_local_state_dict

        with profiled("shardfuse.sharding:load_local_state_dict"):
            missing, unexpected = load_local_state_dict(self, state_dict, strict)
            return _IncompatibleKeys(missing, unexpected)

    def gather_full_optim_state_dict(
        self, optim: torch.optim.Optimizer, recipient_rank: int | None = 0, **ignored: Any
    ) -> dict[str, Any] | None:
        """Consolidate the optimizer state of the sharded flat parameters into per-original-parameter state.

        Every rank must call; the result lands on ``recipient_rank`` (all ranks with ``None``), other ranks
        get ``None``. Per-element state (``exp_avg``, ``momentum_buffer``...) is gathered and unflattened;
        scalars (``step``) are copied per parameter.
        """
        from shardfuse.sharding._optim_state import gather_full_optim_state_dict

        if ignored:
            raise TypeError(f"gather_full_optim_state_dict got unsupported arguments {sorted(ignored)}")
        with profiled("shardfuse.sharding:gather_full_optim_state_dict"):
            return gather_full_optim_state_dict(self, optim, recipient_rank)

    def get_shard_from_optim_state_dict(self, full_optim_state_dict: dict[str, Any]) -> dict[str, Any]:
        """This rank's optimizer state dict (for ``optim.load_state_dict``) from a consolidated one."""
        from shardfuse.sharding._optim_state import get_shard_from_optim_state_dict

        with profiled("shardfuse.sharding:get_shard_from_optim_state_dict"):
            return get_shard_from_optim_state_dict(self, full_optim_state_dict)


def _by_device(tensors: list[torch.Tensor]) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    out: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        out.setdefault((t.device, t.dtype), []).append(t)
    return out
