"""``summon_full_params``: the full fp32 parameters as the modules' original ``nn.Parameter`` attributes.

Inside the block each unit's original parameters are real ``nn.Parameter`` objects holding the gathered full
values, and the wrapper's flat parameters are hidden, so ``named_parameters()`` reads like the unwrapped
model. On exit in-place changes (or, with ``allow_reset_parameters``, replacements) are written back to the
shards, each rank keeping its own slice.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from shardfuse._profiling import profiled
from shardfuse._streams import wait_stream
from shardfuse.sharding.core._flat_param import FlatParamHandle
from shardfuse.sharding.core._runtime import Unit
from shardfuse.sharding.core._state import TrainingState, check_state
from shardfuse.sharding.core._tree import require_unit


@contextlib.contextmanager
def summon_full_params(wrappers: Sequence[nn.Module], volatile: bool) -> Iterator[None]:
    """Summon the full parameters of every unit in ``wrappers`` (public wrapper modules) for the block."""
    units = [require_unit(w) for w in wrappers]
    for u in units:
        check_state(u.training_state, (TrainingState.IDLE,), "summon_full_params()", u.name,
                    "call it outside forward and backward")
    inside = {id(u) for u in units}
    with contextlib.ExitStack() as stack:
        for w, u in zip(wrappers, units):
            # A handle shows at every registration, borrowers' included; one borrowed from a sibling that is not
            # summoned here is gathered (and written back) by the borrower.
            lent = {id(b.handle): b.handle for b in u.borrowed if id(b.lender) not in inside}
            stack.enter_context(_summon_unit(w, u, [*u.handles, *lent.values()], volatile))
        yield


@contextlib.contextmanager
def _summon_unit(wrapper: nn.Module, unit: Unit, handles: list[FlatParamHandle], volatile: bool) -> Iterator[None]:
    with profiled("shardfuse.sharding:summon_full_params"):
        streams = unit.require_root_state().streams
        wait_stream(streams.current(), streams.post_backward)
        unit.training_state = TrainingState.SUMMON_FULL_PARAMS
        saved_params = dict(wrapper._parameters)
        fulls: list[torch.Tensor] = []
        inserted: list[list[nn.Parameter]] = []
        try:
            for h in handles:
                h.reshard()  # the compute buffer may go stale; it is gathered again after the block
                full = h.gather_full_precision(unit.compute_device)
                fulls.append(full)
                params = [nn.Parameter(v, requires_grad=h.requires_grad) for v in h.split_full(full)]
                inserted.append(params)
                for s in h.attr_slots:
                    s.module.__dict__.pop(s.attr, None)
                    s.module._parameters[s.attr] = params[s.index]
            for name in saved_params:
                wrapper._parameters.pop(name)
        except BaseException:
            _restore(wrapper, handles, saved_params)
            unit.training_state = TrainingState.IDLE
            raise
        versions = [h.flat._version for h in handles]
        try:
            yield
        finally:
            try:
                if not volatile:
                    _check_shards_untouched(unit, handles, versions)
                    _write_back(unit, handles, fulls, inserted)
            finally:
                _restore(wrapper, handles, saved_params)
                unit.training_state = TrainingState.IDLE


def _check_shards_untouched(unit: Unit, handles: list[FlatParamHandle], versions: list[int]) -> None:
    for h, v in zip(handles, versions):
        if h.flat._version != v:
            raise RuntimeError(
                f"the sharded parameters of {unit.name} changed inside summon_full_params() (e.g. an "
                f"optimizer step): writing the full parameters back would overwrite that change; step the "
                f"optimizer outside summon_full_params(), or pass volatile=True if the full parameters are "
                f"only read"
            )


@torch.no_grad()
def _write_back(
    unit: Unit, handles: list[FlatParamHandle], fulls: list[torch.Tensor], inserted: list[list[nn.Parameter]]
) -> None:
    for h, full, params in zip(handles, fulls, inserted):
        views = h.split_full(full)
        for s in h.attr_slots:
            cur = s.module._parameters.get(s.attr)
            if cur is params[s.index]:
                continue
            if not unit.config.params.allow_reset_parameters:
                raise RuntimeError(
                    f"{s.fqn} was replaced by a new tensor inside summon_full_params() on {unit.name}: "
                    f"modify parameters in place, or pass allow_reset_parameters=True to copy replacements back"
                )
            if cur is None or cur.shape != views[s.index].shape:
                raise RuntimeError(
                    f"{s.fqn} was replaced inside summon_full_params() by "
                    f"{None if cur is None else tuple(cur.shape)}, expected shape {tuple(views[s.index].shape)}"
                )
            views[s.index].copy_(cur)
        h.flat.detach().copy_(h.shard_of(full))  # bumps the shard's version: gathered copies are refreshed


def _restore(wrapper: nn.Module, handles: list[FlatParamHandle], saved_params: dict[str, nn.Parameter | None]) -> None:
    for h in handles:
        for s in h.attr_slots:
            s.module._parameters.pop(s.attr, None)
            if h.orig_views is not None:
                s.module._parameters[s.attr] = h.orig_views[s.index]
        h.clear_views()
    wrapper._parameters.clear()
    wrapper._parameters.update(saved_params)


@contextlib.contextmanager
def own_params_gathered(unit: Unit, action: str) -> Iterator[None]:
    """``unit``'s own parameters gathered as views (nested units gather in their forwards) while its module is
    called other than through the wrapper's forward (e.g. Hugging Face's ``generate()``); no forward order is
    recorded, nothing is prefetched."""
    check_state(unit.training_state, (TrainingState.IDLE,), action, unit.name,
                "call it outside forward, backward and summon_full_params()")
    rs = unit.require_root_state()
    rs.order_paused = True
    unit.training_state = TrainingState.FORWARD
    try:
        unit.unshard()
        unit.wait_and_set_views()
        yield
    finally:
        unit.reshard()
        unit.training_state = TrainingState.IDLE
        rs.order_paused = False
