"""Automatic wrapping of submodules, FairScale style: ``enable_wrap``, ``wrap``, ``auto_wrap`` and policies.

Typical use, one sharded unit per decoder layer plus the root::

    with enable_wrap(wrapper_cls=FullyShardedDataParallel, mixed_precision=True):
        model = auto_wrap(model, auto_wrap_policy=ModuleClassWrapPolicy({DecoderLayer}))
        model = wrap(model)

A policy is any callable with FairScale's signature ``policy(module, recurse, unwrapped_params)`` (it may also
take ``module_is_root``). ``auto_wrap`` calls it twice per module, as FairScale does: with ``recurse=True`` to ask
whether to descend into the children, then, after the children were wrapped, with ``recurse=False`` and the
number of parameters still unwrapped below the module to ask whether to wrap the module itself.

The default wrapper class is shardfuse's ``FullyShardedDataParallel``; the wrapper imports nothing from here.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from collections.abc import Callable, Generator, Iterable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from torch import nn

from shardfuse._profiling import profiled
from shardfuse.sharding._fully_sharded import FullyShardedDataParallel

logger = logging.getLogger(__name__)

WrapPolicy = Callable[..., bool]
"""``policy(module, recurse, unwrapped_params[, module_is_root]) -> bool``."""

# Containers only group modules and own no parameters: wrapping one would make a unit with nothing in it
# (and a ModuleList has no forward to wrap), so no policy ever wraps them; their children still get visited.
EXCLUDE_WRAP_MODULES: frozenset[type[nn.Module]] = frozenset({nn.ModuleList, nn.ModuleDict})
# Modules whose forward reads their submodules' parameters directly (MultiheadAttention reads
# out_proj.weight), so their children must never become separate units. As in FairScale, the size policy does
# not descend into them nor wrap them alone: their parameters stay in the enclosing unit.
FORCE_LEAF_MODULES: frozenset[type[nn.Module]] = frozenset({nn.MultiheadAttention})


def size_based_auto_wrap_policy(
    module: nn.Module,
    recurse: bool,
    unwrapped_params: int,
    module_is_root: bool = False,
    min_num_params: int = int(1e8),
    force_leaf_modules: Iterable[type[nn.Module]] | None = None,
    exclude_wrap_modules: Iterable[type[nn.Module]] | None = None,
    skip_params_check_for_root: bool = False,
) -> bool:
    """Wrap every module that holds at least ``min_num_params`` parameters not yet wrapped below it.

    FairScale's ``default_auto_wrap_policy``; customise it with :func:`functools.partial`, e.g.
    ``functools.partial(size_based_auto_wrap_policy, min_num_params=int(1e7))``.

    Args:
        module: the module being considered.
        recurse: True when asked whether to descend into ``module``'s children, False when asked whether to
            wrap ``module`` itself.
        unwrapped_params: parameters under ``module`` (itself included) not inside an already-wrapped child.
        module_is_root: True for the module ``auto_wrap`` was called on.
        min_num_params: the size threshold.
        force_leaf_modules: classes whose children are never visited (default: the policy's attribute
            ``FORCE_LEAF_MODULES``, a set initialised from :data:`FORCE_LEAF_MODULES`, as in FairScale).
        exclude_wrap_modules: classes never wrapped themselves (default: the policy's attribute
            ``EXCLUDE_WRAP_MODULES``, initialised from :data:`EXCLUDE_WRAP_MODULES`).
        skip_params_check_for_root: wrap the root whatever its size.
    """
    defaults: Any = size_based_auto_wrap_policy  # the default sets are attributes of the function (FairScale)
    leaf = tuple(defaults.FORCE_LEAF_MODULES if force_leaf_modules is None else force_leaf_modules)
    excluded = tuple(defaults.EXCLUDE_WRAP_MODULES if exclude_wrap_modules is None else exclude_wrap_modules)
    is_large = unwrapped_params >= min_num_params
    if recurse:
        # A module below the threshold cannot contain a child above it: no need to look further down.
        return is_large and not isinstance(module, leaf)
    return ((module_is_root and skip_params_check_for_root) or is_large) and not isinstance(module, excluded)


default_auto_wrap_policy = size_based_auto_wrap_policy
"""FairScale's name for :func:`size_based_auto_wrap_policy`."""
# FairScale publishes the defaults as attributes of the policy, as sets a user extends with ``.union()``.
default_auto_wrap_policy.FORCE_LEAF_MODULES = set(FORCE_LEAF_MODULES)  # type: ignore[attr-defined]
default_auto_wrap_policy.EXCLUDE_WRAP_MODULES = set(EXCLUDE_WRAP_MODULES)  # type: ignore[attr-defined]


def _class_tuple(classes: Iterable[type[nn.Module]], what: str) -> tuple[type[nn.Module], ...]:
    # A single class is accepted for a collection of them; each element is checked below.
    found: tuple[Any, ...] = tuple(classes) if not isinstance(classes, type) else (classes,)
    bad = [c for c in found if not (isinstance(c, type) and issubclass(c, nn.Module))]
    if bad:
        raise TypeError(f"{what} must be nn.Module subclasses, got {bad!r}: pass classes such as {{DecoderLayer}}")
    containers = [c.__name__ for c in found if c in EXCLUDE_WRAP_MODULES]
    if containers:
        raise ValueError(
            f"{what} contains container classes {containers}, which are never wrapped themselves: "
            f"name the class of their elements instead (e.g. the decoder layer class)"
        )
    return found


def transformer_auto_wrap_policy(
    module: nn.Module,
    recurse: bool,
    unwrapped_params: int,
    module_is_root: bool = False,
    transformer_layer_cls: Iterable[type[nn.Module]] = (),
) -> bool:
    """Wrap every instance of the given classes, e.g. each decoder layer.

    Use it through :func:`functools.partial`:
    ``functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={DecoderLayer})``; it descends into
    every module so layers are found at any depth. Same decisions as :class:`ModuleClassWrapPolicy`.
    """
    if recurse:
        return True
    classes = _class_tuple(transformer_layer_cls, "transformer_layer_cls")
    return isinstance(module, classes) and not isinstance(module, tuple(EXCLUDE_WRAP_MODULES))


@dataclass(frozen=True)
class ModuleClassWrapPolicy:
    """Wrap every instance of ``module_classes`` (e.g. ``{DecoderLayer}``), found at any depth.

    Instances of the classes nested inside one another are each wrapped (bottom-up). Container modules
    (``nn.ModuleList``/``nn.ModuleDict``) are rejected: name the class of their elements instead.
    """

    module_classes: frozenset[type[nn.Module]]

    def __post_init__(self) -> None:
        classes = _class_tuple(self.module_classes, "module_classes")
        if not classes:
            raise ValueError("ModuleClassWrapPolicy needs at least one class: ModuleClassWrapPolicy({DecoderLayer})")
        # Frozen dataclass: normalise whatever iterable was passed into a hashable frozenset.
        object.__setattr__(self, "module_classes", frozenset(classes))

    def __call__(self, module: nn.Module, recurse: bool, unwrapped_params: int, module_is_root: bool = False) -> bool:
        """FairScale policy signature: always descend; wrap ``module`` iff it is one of the classes."""
        if recurse:
            return True
        return isinstance(module, tuple(self.module_classes))


def no_split_modules_policy(model: nn.Module) -> ModuleClassWrapPolicy:
    """A policy wrapping every module whose class a Hugging Face model names in ``_no_split_modules`` (its
    decoder layers, e.g. ``LlamaDecoderLayer``): one unit per layer, as transformers' own FSDP integration does.

    Raises:
        ValueError: the model names no such classes, or none of them occurs in it.
    """
    names = set(getattr(model, "_no_split_modules", None) or ())
    if not names:
        raise ValueError(
            f"{type(model).__name__} has no _no_split_modules: name the layer classes yourself, e.g. "
            f"ModuleClassWrapPolicy({{DecoderLayer}})"
        )
    classes = {type(m) for m in model.modules() if type(m).__name__ in names}
    if not classes:
        raise ValueError(
            f"{type(model).__name__}._no_split_modules names {sorted(names)}, but no module of those classes is in "
            f"the model: name the layer classes yourself with ModuleClassWrapPolicy"
        )
    return ModuleClassWrapPolicy(frozenset(classes))


def config_auto_wrap_policy(
    module: nn.Module, recurse: bool, unwrapped_params: int, module_is_root: bool = False
) -> bool:
    """Wrap exactly the modules that carry a ``wrapper_config`` dict attribute (FairScale's config policy).

    The dict's entries override the ``enable_wrap`` arguments for that module (see :func:`wrap`).
    """
    if recurse:
        return True
    return isinstance(getattr(module, "wrapper_config", None), dict) and not isinstance(
        module, tuple(EXCLUDE_WRAP_MODULES)
    )


@dataclass(frozen=True)
class _WrapConfig:
    wrapper_cls: type[nn.Module]
    kwargs: Mapping[str, Any]
    auto_wrap_policy: WrapPolicy


# A context variable rather than class attributes (FairScale): each thread/task sees its own config.
_CONFIG: ContextVar[_WrapConfig | None] = ContextVar("shardfuse_wrap_config", default=None)


@contextlib.contextmanager
def enable_wrap(
    *, wrapper_cls: type[nn.Module] | None = None, auto_wrap_policy: WrapPolicy | None = None, **wrapper_kwargs: Any
) -> Generator[None, None, None]:
    """Within this context :func:`wrap` and :func:`auto_wrap` wrap modules with ``wrapper_cls(module, **kwargs)``.

    Args:
        wrapper_cls: the wrapper class (default: shardfuse's ``FullyShardedDataParallel``).
        auto_wrap_policy: the policy :func:`auto_wrap` uses when it is given none (default:
            :func:`size_based_auto_wrap_policy`).
        **wrapper_kwargs: arguments every wrapper is built with (``mixed_precision=True``, ...).

    Contexts nest: an inner context with the same ``wrapper_cls`` layers its arguments over the outer ones
    (and keeps the outer policy unless given one); an inner context with a different class starts afresh. The
    outer configuration is restored on exit, also when an exception leaves the context.
    """
    if wrapper_cls is None:
        wrapper_cls = FullyShardedDataParallel
    if not isinstance(wrapper_cls, type):
        raise TypeError(
            f"enable_wrap(wrapper_cls=...) must be a class (an nn.Module subclass such as FullyShardedDataParallel), "
            f"got {wrapper_cls!r}: pass the class itself, and its arguments as keyword arguments"
        )
    if auto_wrap_policy is not None and not callable(auto_wrap_policy):
        raise TypeError(f"auto_wrap_policy must be callable, got {auto_wrap_policy!r}")
    outer = _CONFIG.get()
    if outer is not None and outer.wrapper_cls is wrapper_cls:
        kwargs = {**outer.kwargs, **wrapper_kwargs}
        policy = auto_wrap_policy if auto_wrap_policy is not None else outer.auto_wrap_policy
    else:
        kwargs = dict(wrapper_kwargs)
        policy = auto_wrap_policy if auto_wrap_policy is not None else size_based_auto_wrap_policy
    token = _CONFIG.set(_WrapConfig(wrapper_cls=wrapper_cls, kwargs=kwargs, auto_wrap_policy=policy))
    try:
        yield
    finally:
        _CONFIG.reset(token)


def _wrapper_types(cfg: _WrapConfig) -> tuple[type, ...]:
    # shardfuse's own wrapper counts as "wrapped" whatever class the context names.
    return (cfg.wrapper_cls, FullyShardedDataParallel)


def wrap(module: nn.Module, **wrap_overrides: Any) -> nn.Module:
    """Wrap ``module`` with the active :func:`enable_wrap` config; outside any context return it unchanged.

    The wrapper's arguments are, by increasing priority: the ``enable_wrap`` arguments, the module's own
    ``wrapper_config`` dict attribute if it has one, then ``wrap_overrides``.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``.
        ValueError: ``module`` is already wrapped (wrap each module once).
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"wrap() takes an nn.Module, got {type(module).__name__}")
    cfg = _CONFIG.get()
    if cfg is None:
        return module
    if isinstance(module, _wrapper_types(cfg)):
        raise ValueError(
            f"wrap() got a module that is already wrapped ({type(module).__name__}): wrap each module once "
            f"(drop the second wrap(), or wrap the inner module before wrapping it)"
        )
    module_config = getattr(module, "wrapper_config", None)
    kwargs = {**cfg.kwargs, **(module_config if isinstance(module_config, dict) else {}), **wrap_overrides}
    with profiled("shardfuse.wrap:wrap"):
        logger.debug("wrapping %s with %s(%s)", type(module).__name__, cfg.wrapper_cls.__name__, sorted(kwargs))
        return cfg.wrapper_cls(module, **kwargs)


def _takes_module_is_root(policy: WrapPolicy) -> bool:
    # FairScale 0.4 passes module_is_root; the plain 3-argument form is accepted too.
    target = policy.func if isinstance(policy, functools.partial) else policy
    try:
        params = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "module_is_root" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def auto_wrap(module: nn.Module, auto_wrap_policy: WrapPolicy | None = None, **kwargs: Any) -> nn.Module:
    """Wrap ``module``'s submodules bottom-up wherever ``auto_wrap_policy`` says so (inside :func:`enable_wrap`).

    Children are replaced in place (``setattr`` on their parent); the returned module is ``module`` itself,
    or its wrapper when the policy also wraps the root. Outside an ``enable_wrap`` context ``module`` is
    returned unchanged. ``kwargs`` override the wrapper arguments of every wrapper made here.

    Args:
        module: the model (no part of it may be wrapped yet).
        auto_wrap_policy: the policy; default: the one given to ``enable_wrap``, else
            :func:`size_based_auto_wrap_policy`.

    Raises:
        ValueError: ``module`` or one of its submodules is already wrapped.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"auto_wrap() takes an nn.Module, got {type(module).__name__}")
    cfg = _CONFIG.get()
    if cfg is None:
        return module
    policy = auto_wrap_policy if auto_wrap_policy is not None else cfg.auto_wrap_policy
    if not callable(policy):
        raise TypeError(f"auto_wrap_policy must be callable, got {policy!r}")
    wrapped_types = _wrapper_types(cfg)
    # Never wrap inside a wrapper: its parameters are already flattened and sharded.
    for name, sub in module.named_modules():
        if isinstance(sub, wrapped_types):
            where = f"submodule {name!r}" if name else "the module itself"
            raise ValueError(
                f"auto_wrap() found an already-wrapped module ({type(sub).__name__}) at {where}: call auto_wrap on "
                f"the unwrapped model first, then wrap the rest by hand with wrap()"
            )
    pass_root = _takes_module_is_root(policy)

    def ask(mod: nn.Module, recurse: bool, unwrapped: int, is_root: bool) -> bool:
        extra = {"module_is_root": is_root} if pass_root else {}
        return bool(policy(module=mod, recurse=recurse, unwrapped_params=unwrapped, **extra))

    wrapped_at: dict[int, str] = {}  # id of each module wrapped here -> its path

    def recurse_wrap(mod: nn.Module, path: str, is_root: bool) -> tuple[nn.Module, int]:
        # Returns (module or its wrapper, number of parameters wrapped at or below it).
        if id(mod) in wrapped_at or isinstance(mod, wrapped_types):
            # A module registered under two parents would get two wrappers sharding the same parameters.
            raise ValueError(
                f"auto_wrap() reached the module at {path!r} a second time (it is shared with "
                f"{wrapped_at.get(id(mod), 'a module wrapped earlier')!r}) and would wrap it twice: give each "
                f"place its own module, or wrap their common parent instead"
            )
        num_params = sum(p.numel() for p in mod.parameters())
        if not ask(mod, True, num_params, is_root):
            return mod, 0
        wrapped_below = 0
        for name, child in list(mod.named_children()):
            new_child, n = recurse_wrap(child, f"{path}.{name}" if path else name, False)
            if new_child is not child:
                setattr(mod, name, new_child)
            wrapped_below += n
        if not isinstance(mod, tuple(EXCLUDE_WRAP_MODULES)) and ask(mod, False, num_params - wrapped_below, is_root):
            logger.debug("auto_wrap: wrapping %s (%s)", path or "<root>", type(mod).__name__)
            wrapped_at[id(mod)] = path or "<root>"
            return wrap(mod, **kwargs), num_params
        return mod, wrapped_below

    with profiled("shardfuse.wrap:auto_wrap"):
        wrapped, _ = recurse_wrap(module, "", True)
    return wrapped
