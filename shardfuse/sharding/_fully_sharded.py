"""``FullyShardedDataParallel``: FairScale 0.4.13's ZeRO-3 wrapper on flat shards and shardfuse kernels.

A thin public module: the keyword arguments become a frozen config (``_config.py``), the module's own
parameters become flat shards (``_flat_param.py``), and a plain :class:`~shardfuse.sharding.core._runtime.Unit`
carries the runtime state and the lifecycle of a training step (``_runtime.py``), initialised lazily by the
root (``_root.py``). Summoning, state dicts and optimizer state live in their own modules; the wrapper's
checkpoint methods come from :class:`~shardfuse.sharding._checkpoint_api.CheckpointAPI`.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
from torch import nn

from shardfuse._lazy_disable import disabled_on_first_use
from shardfuse._profiling import profiled
from shardfuse.sharding._checkpoint_api import CheckpointAPI
from shardfuse.sharding.checkpoint import _resume_guard
from shardfuse.sharding.checkpoint._summon import own_params_gathered, summon_full_params
from shardfuse.sharding.core import _process_hooks
from shardfuse.sharding.core._arrival import arrive
from shardfuse.sharding.core._config import (
    ConfigView,
    check_compute_dtype,
    make_config,
    option_parameters,
    options_doc,
)
from shardfuse.sharding.core._devices import shard_device
from shardfuse.sharding.core._flatten import flatten_own_params
from shardfuse.sharding.core._grad_reduce import clip_grad_norm
from shardfuse.sharding.core._hybrid import ShardingStrategy, resolve
from shardfuse.sharding.core._registry import UNIT_ATTR, WRAPPED_MARK
from shardfuse.sharding.core._root import apply_to_unit, lazy_init, reset_root, take_module
from shardfuse.sharding.core._runtime import Unit
from shardfuse.sharding.core._setup import (
    agree_on_initial_values,
    broadcast_own_states,
    guard_reset_parameters,
    materialize_meta,
)
from shardfuse.sharding.core._state import TrainingState, check_state
from shardfuse.sharding.core._tree import clean_key, unit_of, units_below
from shardfuse.sharding.host._engine import detach_host_engine, engine_of, settle
from shardfuse.sharding.ssd import _ssd, _ssd_config

__all__ = ["FullyShardedDataParallel", "ShardingStrategy", "TrainingState"]

logger = logging.getLogger(__name__)

class FullyShardedDataParallel(CheckpointAPI, ConfigView):
    """Shard a module's parameters, gradients and optimizer state across data-parallel ranks (ZeRO-3).

    Drop-in for ``fairscale.nn.FullyShardedDataParallel`` 0.4.13. Wrap inner blocks first (or use
    ``shardfuse.auto_wrap`` / ``shardfuse.wrap`` under ``shardfuse.enable_wrap``), then the whole model; build
    the optimizer on ``model.parameters()``, which are the sharded flat parameters. Every rank starts from the
    first rank's parameters and buffers: ``sync_module_states=True`` broadcasts them; otherwise ranks are
    checked, and ranks that differ get the first rank's values with a warning. Every option is keyword-only and
    readable afterwards as an attribute of the same name; each belongs to one policy of
    ``shardfuse.sharding.core._config`` (precision, offload, resharding, gradient, state dict, parameters).

    Args:
        module: the module to wrap; its own parameters (not those of nested instances) are flattened per
            (dtype, requires_grad) group and sharded.
        process_group: the data-parallel group (default: the world group); with ``HYBRID_SHARD`` the pair
            ``(shard_group, replicate_group)``.
        process_group_reduce_scatter: a separate group (same ranks) for the gradient reduce-scatter; None: the
            process group (or ``SHARDFUSE_REDUCE_SCATTER_GROUP``'s choice); FairScale's names ``"reduce_scatter"``
            (one separate group made at the root's first forward) and ``"default"`` (the process group).
        device_mesh: hybrid sharding: a 2-D ``DeviceMesh`` with dims ``("replicate", "shard")``; parameters are
            sharded over "shard" and gradients all-reduced over "replicate" (instead of ``process_group``).
        sharding_strategy: ``ShardingStrategy.FULL_SHARD`` (default) or ``HYBRID_SHARD`` (or their strings).
        param_init_fn: for modules built on the meta device: called with each module of the unit that has meta
            tensors (FSDP1's argument, e.g. ``m.to_empty(device=..., recurse=False)`` then the model's own init of
            ``m``) before they are sharded; by default ``to_empty`` then ``reset_parameters()`` of each. Wrap inner
            units first (or use auto_wrap), so only one unit's parameters are ever full on a rank.
{options}
    """

    def __init__(
        self,
        module: nn.Module,
        process_group: Any | None = None,
        process_group_reduce_scatter: Any | None = None,
        *,
        param_init_fn: Callable[[nn.Module], None] | None = None,
        device_mesh: Any | None = None,
        sharding_strategy: ShardingStrategy | str | None = None,
        **options: Any,
    ) -> None:
        with profiled("shardfuse.sharding:wrap"):
            super().__init__()
            take_module(module)
            groups = resolve(process_group, process_group_reduce_scatter, device_mesh, sharding_strategy)
            config = make_config(groups.world_size, options, groups.total_world, _ssd_config.settle)
            materialize_meta(module, shard_device(config, groups, None), param_init_fn)
            if config.params.sync_module_states:
                broadcast_own_states(module, groups)
            else:
                agree_on_initial_values(module, groups, f"{type(self).__name__}({type(module).__name__})")
            handles, table, borrowed = flatten_own_params(module, config, groups)
            check_compute_dtype(config, (h.dtype for h in handles), type(module).__name__)
            if config.offload.ssd is not None:  # SSD offload: storages that can be evicted, before any view
                _ssd.prepare(handles)
            unit = Unit(module, config, groups, handles, table, borrowed)
            if config.params.use_orig_params:
                # The original parameters, views of the shard, where they were; compute reads the instance
                # attributes (gathered views or meta placeholders), which shadow these registrations.
                for h in handles:
                    views = h.make_orig_views()
                    for slot in h.slots:
                        slot.module._parameters[slot.attr] = views[slot.index]
            else:
                for i, h in enumerate(handles):
                    self.register_parameter(f"flat_param_{i}", h.flat)
            if config.offload.ssd is not None:  # SSD offload: the shards move into their files (_ssd.py)
                _ssd.attach(handles, config.offload.ssd, type(module).__name__, unit)
            self._fsdp_wrapped_module = module
            self.__dict__[UNIT_ATTR] = unit
            object.__setattr__(module, WRAPPED_MARK, unit)
            # Nested units know their outermost unit, so any of them can trigger the root's lazy init.
            for u in units_below(unit)[1:]:
                if u.parent is None:
                    u.parent = unit
                    u.is_root = False
            if not config.params.allow_reset_parameters:
                guard_reset_parameters(module)
            _process_hooks.install(_resume_guard.refuse_fresh_state_after_load)
            _process_hooks.require_fused_versions()  # a fused optimizer's updates must change the version counters

    # ----------------------------------------------------------------------------------------------
    # properties and nn.Module plumbing

    @property
    def _ddp_params_and_buffers_to_ignore(self) -> list[str]:
        # DistributedDataParallel reads this before its start-up broadcast, which would overwrite every rank's
        # shards with rank 0's (accelerate's prepare() wraps models in DDP): refuse loudly instead.
        raise RuntimeError(
            "a FullyShardedDataParallel model must not be wrapped in DistributedDataParallel: its start-up "
            "broadcast would overwrite every rank's parameter shards with rank 0's, and FullyShardedDataParallel "
            "already reduces gradients; use the model as it is (with accelerate, do not pass it to prepare() "
            "with a DDP plugin)"
        )

    @property
    def _unit(self) -> Unit:
        return self.__dict__[UNIT_ATTR]

    @property
    def module(self) -> nn.Module:
        """The wrapped module."""
        return self._fsdp_wrapped_module

    @property
    def is_root(self) -> bool | None:
        """True for the outermost instance (known after the first forward / lazy init), else False or None."""
        return self._unit.is_root

    @property
    def training_state(self) -> TrainingState:
        """This unit's phase (FairScale's ``TrainingState``)."""
        return self._unit.training_state

    @property
    def process_group(self) -> Any:
        """The data-parallel process group."""
        return self._unit.groups.process_group

    @process_group.setter
    def process_group(self, group: Any) -> None:
        # FairScale's way to restore the group after unpickling; it must hold the same ranks.
        self._unit.set_groups(process_group=group)

    @property
    def process_group_reduce_scatter(self) -> Any:
        """The process group of the gradient reduce-scatter (same ranks as ``process_group``)."""
        return self._unit.groups.reduce_scatter_group

    @process_group_reduce_scatter.setter
    def process_group_reduce_scatter(self, group: Any) -> None:
        self._unit.set_groups(reduce_scatter_group=group)

    @property
    def rank(self) -> int:
        """This process's rank in ``process_group``."""
        return self._unit.rank

    @property
    def world_size(self) -> int:
        """The number of ranks the parameters are sharded over."""
        return self._unit.world_size

    @property
    def gradient_predivide_factor(self) -> float:
        """Gradients are divided by this before the reduce-scatter."""
        return self._unit.gradient_predivide_factor

    @property
    def gradient_postdivide_factor(self) -> float:
        """Gradients are divided by this after the reduce-scatter."""
        return self._unit.gradient_postdivide_factor

    @property
    def no_broadcast_optim_state(self) -> bool:
        """This unit's optimizer state stays local (a size-1 group, e.g. a mixture-of-experts expert)."""
        return self._unit.no_broadcast_optim_state

    @property
    def params_with_grad(self) -> list[nn.Parameter]:
        """The (sharded flat) parameters that have a gradient."""
        return [p for p in self.parameters() if p.grad is not None]

    def assert_state(self, state: TrainingState | list[TrainingState]) -> None:
        """Raise ``ValueError`` unless this unit is in ``state`` (or one of a list of states), as FairScale does."""
        allowed = [state] if isinstance(state, TrainingState) else list(state)
        if self.training_state not in allowed:
            raise ValueError(
                f"expected {self._unit.name} to be in states {[s.name for s in allowed]} but current state is "
                f"{self.training_state.name}"
            )

    def _reset_lazy_init(self) -> None:
        """Forget the runtime (streams, full buffers, root); it is rebuilt on the next use (FairScale's name)."""
        for u in units_below(self._unit):
            reset_root(u)

    def __getstate__(self) -> dict[str, Any]:
        """Like FairScale: pickling drops the runtime (streams, full buffers, hooks; rebuilt on the next use, also
        in this model) and the units drop their process groups: after unpickling, set ``process_group`` (and
        ``process_group_reduce_scatter``) on every instance. The shards, the original-parameter views
        (``use_orig_params``) and the state-dict layout come back; gradients and optimizer state do not (an
        optimizer keys its state by parameter objects): build a new optimizer on the copy's ``parameters()``
        (and load a state saved with :meth:`gather_full_optim_state_dict` or :meth:`sharded_state_dict`)."""
        units = units_below(self._unit)
        _ssd.refuse(units, "pickling")
        for u in units:
            check_state(u.training_state, (TrainingState.IDLE,), "pickling", u.name)
            if any(h.full_param is not None and h.full_param.grad is not None for h in u.handles):
                raise RuntimeError(
                    f"cannot pickle {u.name} while it holds full-size gradients accumulated under no_sync(), which "
                    f"are not part of the pickle (nor reduced yet): pickle it after a backward outside no_sync()"
                )
        self._reset_lazy_init()
        return dict(self.__dict__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        unit = self._unit
        if unit.config.params.use_orig_params:
            # The handles made their original-parameter views again from the unpickled shards; the modules (all
            # unpickled by now) still register pickle's copies, which are no views of anything: replace them.
            for h in unit.handles:
                h.register_orig_views()

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        """``nn.Module.named_parameters``; with ``use_orig_params`` and inside ``summon_full_params()`` the names
        carry no wrapper segment (the original names), as in FairScale."""
        clean = self._unit.config.params.use_orig_params or self.training_state == TrainingState.SUMMON_FULL_PARAMS
        for name, p in super().named_parameters(*args, **kwargs):
            yield (clean_key(name) if clean else name), p

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
        return cast(Any, self.module).__getitem__(key)  # whatever the wrapped container's __getitem__ does

    def extra_repr(self) -> str:
        """Configuration summary (with ``verbose=True``)."""
        u = self._unit
        if not u.config.verbose:
            return f"world_size={self.world_size}, flat_params={len(u.handles)}"
        cfg = u.config
        return (
            f"world_size={self.world_size}, rank={self.rank}, flat_params={len(u.handles)}, "
            f"numel={[h.numel for h in u.handles]}, reshard_after_forward={cfg.reshard.reshard_after_forward}, "
            f"mixed_precision={cfg.precision.mixed_precision}, compute_dtype={cfg.precision.compute_dtype}, "
            f"buffer_dtype={cfg.precision.buffer_dtype}, fp32_reduce_scatter={cfg.precision.fp32_reduce_scatter}, "
            f"move_params_to_cpu={cfg.offload.move_params_to_cpu}, "
            f"gradient_divide=({u.gradient_predivide_factor}, {u.gradient_postdivide_factor})"
        )

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> nn.Module:
        _ssd.refuse(units_below(self._unit), ".to()/.cuda()/.half()")
        detach_host_engine(self._unit)  # its host buffers belong to the old placement and dtype
        # .to()/.cuda()/.half() move the shards; the runtime (full buffers, streams) is rebuilt lazily.
        return apply_to_unit(self._unit, fn, lambda: super(FullyShardedDataParallel, self)._apply(fn, recurse))

    def _units(self) -> list[FullyShardedDataParallel]:
        """This wrapper and every nested wrapper, in module order (self first)."""
        return [m for m in self.modules() if isinstance(m, FullyShardedDataParallel) and unit_of(m) is not None]

    # ----------------------------------------------------------------------------------------------
    # forward (the step's lifecycle is in _runtime.py)
    # ----------------------------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Gather the full parameters, run the wrapped module, reshard, and hook the outputs for backward."""
        with profiled("shardfuse.sharding:forward"):
            unit = self._unit
            # Under torch.compile the unit's bookkeeping runs eagerly (a graph break on each side) and only the
            # wrapped module is traced; eager calls skip the disable wrapper's cost.
            compiling = torch.compiler.is_compiling()
            pre, post, abort = _compiled_forward_hooks() if compiling else (
                _pre_forward, Unit.post_forward, Unit.abort_forward)
            args, kwargs, recomputing = pre(unit, args, kwargs)
            saved = None if recomputing else unit.saved_activations
            try:
                if saved is None:
                    outputs = self.module(*args, **kwargs)
                elif compiling:
                    raise RuntimeError(
                        f"offload_activations: {unit.name}'s forward is traced by torch.compile, which cannot run "
                        f"saved-tensor hooks inside the graph; compile the layers inside the wrappers "
                        f"(layer.compile()) instead of the wrapped model, or remove() the ActivationOffload")
                else:
                    with saved.forward_context(unit):
                        outputs = self.module(*args, **kwargs)
            except BaseException:
                abort(unit, recomputing)
                raise
            return post(unit, outputs, recomputing)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped model's ``generate()`` (Hugging Face) with this unit's own parameters gathered for the
        whole call; nested units gather per forward as usual. Collective: every rank must call it."""
        inner = getattr(self.module, "generate", None)
        if not callable(inner):
            raise AttributeError(f"{type(self.module).__name__} has no generate() method")
        lazy_init(self._unit)
        with profiled("shardfuse.sharding:generate"), own_params_gathered(self._unit, "generate()"):
            return inner(*args, **kwargs)

    def save_pretrained(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped model's ``save_pretrained()`` (Hugging Face) with the full state dict gathered from the
        shards (every rank must call; pass ``is_main_process=(rank == 0)`` so one rank writes)."""
        inner = getattr(self.module, "save_pretrained", None)
        if not callable(inner):
            raise AttributeError(f"{type(self.module).__name__} has no save_pretrained() method")
        if kwargs.get("state_dict") is None:
            kwargs["state_dict"] = self.state_dict()
        return inner(*args, **kwargs)

    # ----------------------------------------------------------------------------------------------
    # public API: sync control, divide factors, norms

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate full-size gradients locally (no reduce-scatter) inside the block, for every nested unit.

        The next backward outside the block reduces the accumulated sum. Costs full-size gradient memory.
        """
        units = units_below(self._unit)
        old = [u.require_backward_grad_sync for u in units]
        for u in units:
            u.require_backward_grad_sync = False
        try:
            yield
        finally:
            for u, o in zip(units, old):
                u.require_backward_grad_sync = o

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """Hybrid sharding (FSDP2's name): with False, backward still reduce-scatters within the shard group but
        skips the all-reduce across replicas; each rank adds its shard's partial sum to a held buffer (one shard
        of the reduce dtype per flat parameter) and ``.grad`` is not written. The next backward with True
        all-reduces that sum once (with its own gradient) into ``.grad``. No effect without replicas."""
        for u in units_below(self._unit) if recurse else [self._unit]:
            u.require_all_reduce = bool(requires_all_reduce)
    def append_shared_param(self, p: torch.Tensor) -> None:
        """FairScale's declaration that ``p``, flattened by a sibling unit, is also used by this unit's modules.

        Sharing is found when wrapping: a parameter that an earlier (sibling) unit flattened and that this unit's
        modules register too is borrowed, not flattened again (any ``flatten_parameters`` on either side). This
        only checks that ``p`` (e.g. ``sibling.module.weight``) is such a parameter, and raises otherwise.
        """
        unit = self._unit
        if any(b.handle.index_of(p) == b.index for b in unit.borrowed):
            return
        what = f"a {type(p).__name__} of shape {tuple(p.shape)}" if isinstance(p, torch.Tensor) else repr(p)
        own = next((h.names[i] for h in unit.handles if (i := h.index_of(p)) is not None), None)
        if own is not None:
            raise ValueError(f"append_shared_param got {own!r}, a parameter {unit.name} flattened itself: pass a "
                             f"parameter of the sibling unit it shares with")
        raise ValueError(
            f"append_shared_param got {what} that {unit.name} does not share (it shares "
            f"{[b.fqn for b in unit.borrowed] or 'nothing'}): a parameter is shared when a sibling unit wrapped "
            f"first flattened it and a module of this unit registers the same nn.Parameter (tie them before "
            f"wrapping, e.g. l1.weight = l3.weight); pass it as the sibling shows it (e.g. l1.module.weight)"
        )

    def non_shared_params(self) -> list[nn.Parameter]:
        """This unit's own parameters, without those it borrows from siblings (FairScale's method): the flat
        parameters, or with ``use_orig_params`` the original parameters' views."""
        unit = self._unit
        if unit.config.params.use_orig_params:
            return [v for h in unit.handles for v in h.orig_views or ()]
        return [h.flat for h in unit.handles]

    def set_gradient_divide_factors(self, pre: float, post: float, recursive: bool = True) -> None:
        """Divide gradients by ``pre`` before and by ``post`` after the reduce-scatter (``pre * post`` is
        normally ``world_size`` for an average)."""
        for name, v in (("pre", pre), ("post", post)):
            if not (isinstance(v, (int, float)) and v > 0):
                raise ValueError(f"set_gradient_divide_factors needs {name} > 0, got {name}={v!r}")
        for u in units_below(self._unit) if recursive else [self._unit]:
            u.reduce_cfg.predivide = float(pre)  # the one live copy, read by every later reduction
            u.reduce_cfg.postdivide = float(post)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients of all sharded parameters by their global norm (one all-reduce); returns the norm.

        Only the root may call it (the norm spans the whole model).
        """
        with profiled("shardfuse.sharding:clip_grad_norm"):
            unit = self._unit
            lazy_init(unit)
            if not unit.is_root:
                raise RuntimeError(
                    f"clip_grad_norm_() must be called on the root FullyShardedDataParallel instance, not on the "
                    f"nested {unit.name}: call it on the outermost wrapper"
                )
            for u in units_below(unit):
                check_state(u.training_state, (TrainingState.IDLE,), "clip_grad_norm_()", u.name,
                            "call it after backward has finished")
            engine = engine_of(unit)
            if engine is not None:
                return engine.clip_grad_norm_(max_norm, norm_type)
            return clip_grad_norm([p.grad for p in self.parameters() if p.grad is not None], max_norm, norm_type,
                                  unit.compute_device, unit.groups.process_group, unit.world_size)

    # ----------------------------------------------------------------------------------------------
    # summon_full_params (implemented in _summon.py)

    def summon_full_params(self, recurse: bool = True, volatile: bool = False) -> contextlib.AbstractContextManager:
        """Gather the full fp32 parameters and expose them as the module's original parameters in the block.

        Inside, ``named_parameters()`` of the wrapped modules shows the original names and full tensors. On
        exit, in-place changes are written back to the shards (each rank keeps its own slice) unless
        ``volatile``. Not allowed during forward/backward.
        """
        arrive(self._unit, "summon_full_params()")  # every rank, before lazy init's collectives
        settle(self._unit)  # finishes host optimizer steps in flight, then lazy init
        return summon_full_params(self._units() if recurse else [self], volatile)

    def apply(self, fn: Callable[[nn.Module], None]) -> FullyShardedDataParallel:
        """``nn.Module.apply`` with the full parameters summoned, so ``fn`` can initialise them."""
        if self.training_state == TrainingState.SUMMON_FULL_PARAMS:  # nested unit, reached by the outer apply
            super().apply(fn)
            return self
        with profiled("shardfuse.sharding:apply"), self.summon_full_params(recurse=True):
            super().apply(fn)
        return self


def _pre_forward(unit: Unit, args: tuple, kwargs: dict) -> tuple[tuple, dict, bool]:
    lazy_init(unit)
    return unit.pre_forward(args, kwargs)


_compiled_forward_hooks = disabled_on_first_use(_pre_forward, Unit.post_forward, Unit.abort_forward)


# The options come from the policies' fields: the docstring's Args and the signature help() and IDEs show.
FullyShardedDataParallel.__doc__ = (FullyShardedDataParallel.__doc__ or "").replace("{options}", options_doc())
FullyShardedDataParallel.__init__.__signature__ = inspect.signature(  # type: ignore[attr-defined]
    FullyShardedDataParallel.__init__
).replace(parameters=[
    *(p for p in inspect.signature(FullyShardedDataParallel.__init__).parameters.values()
      if p.kind is not inspect.Parameter.VAR_KEYWORD),
    *option_parameters(),
])
