"""Full and local state dicts of a ``FullyShardedDataParallel`` tree.

Full state dicts use the original parameter names, with no wrapper prefixes, so they load into the
unwrapped model and back; parameters are gathered in their shard dtype (fp32) one unit at a time; floating
buffers are returned in their original dtype.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from shardfuse._streams import wait_stream
from shardfuse.sharding import _data_path as dp
from shardfuse.sharding._state import TrainingState, check_state

if TYPE_CHECKING:
    from shardfuse.sharding._fully_sharded import FullyShardedDataParallel

logger = logging.getLogger(__name__)


def _check_idle(root: FullyShardedDataParallel, action: str) -> list[FullyShardedDataParallel]:
    root._lazy_init()
    units = root._units()
    for u in units:
        check_state(u.training_state, (TrainingState.IDLE,), action, u._unit_name(),
                    "call it outside forward, backward and summon_full_params()")
    streams = root._root_state.streams
    wait_stream(streams.current(), streams.post_backward)
    return units


def _walk(module: nn.Module, prefix: str, owner: Any) -> Iterator[tuple[str, str, nn.Module, Any]]:
    """Entries ``(kind, key, module, info)`` in ``nn.Module.state_dict`` order, wrapper segments removed.

    kind "param": info = (owner unit, handle index, unique index); "buffer": info = (owner, buffer name);
    "extra": the module's extra state.
    """
    from shardfuse.sharding._fully_sharded import FullyShardedDataParallel

    if isinstance(module, FullyShardedDataParallel):
        owner = module
        module = module.module
    if owner is not None:
        for attr, hi, idx in owner._param_table.get(id(module), ()):
            yield "param", prefix + attr, module, (owner, hi, idx)
    for name, b in module._buffers.items():
        if b is not None and name not in module._non_persistent_buffers_set:
            yield "buffer", prefix + name, module, (owner, name)
    if type(module).get_extra_state is not nn.Module.get_extra_state:
        yield "extra", prefix + "_extra_state", module, None
    for name, child in module._modules.items():
        if child is not None:
            yield from _walk(child, f"{prefix}{name}.", owner)


def _buffer_out(owner: Any, module: nn.Module, name: str) -> torch.Tensor:
    b = module._buffers[name]
    dtype = owner._buffer_dtypes.get((id(module), name), b.dtype) if owner is not None else b.dtype
    return b.detach().to(dtype) if b.dtype != dtype else b.detach()


@torch.no_grad()
def full_state_dict(root: FullyShardedDataParallel) -> OrderedDict[str, Any]:
    """The full state dict of ``root``'s tree (see module docstring); collective: every rank must call."""
    units = _check_idle(root, "state_dict()")
    materialize = not root.state_dict_on_rank_0_only or root.rank == 0
    values: dict[tuple[int, int], list[torch.Tensor]] = {}
    for u in units:
        for hi, h in enumerate(u._handles):
            full = h.gather_full_precision(u._compute_device)
            if materialize:
                outs = [torch.empty(s, dtype=h.dtype, device=full.device) for s in h.shapes]
                dp.unflatten(full, outs)
                device = root._state_dict_device or h.flat.device
                values[(id(u), hi)] = [o.to(device) for o in outs]
            del full
    sd: OrderedDict[str, Any] = OrderedDict()
    if not materialize:
        return sd
    for kind, key, module, info in _walk(root, "", None):
        if kind == "param":
            owner, hi, idx = info
            sd[key] = values[(id(owner), hi)][idx]
        elif kind == "buffer":
            owner, name = info
            t = _buffer_out(owner, module, name)
            sd[key] = t.to(root._state_dict_device) if root._state_dict_device is not None else t
        else:
            sd[key] = module.get_extra_state()
    return sd


@torch.no_grad()
def load_full_state_dict(
    root: FullyShardedDataParallel, state_dict: dict[str, Any], strict: bool
) -> tuple[list[str], list[str]]:
    """Load a full state dict into the shards and buffers of ``root``'s tree; returns (missing, unexpected)."""
    units = _check_idle(root, "load_state_dict()")
    entries = list(_walk(root, "", None))
    expected = {key for _, key, _, _ in entries}
    missing = [key for _, key, _, _ in entries if key not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    if strict and (missing or unexpected):
        raise RuntimeError(
            f"Error(s) in loading state_dict for FullyShardedDataParallel: missing keys {missing[:20]} "
            f"(of {len(missing)}), unexpected keys {unexpected[:20]} (of {len(unexpected)}): pass a full "
            f"state dict with the original parameter names, or strict=False"
        )
    # Provided tensor per (unit, handle, unique index): the first key naming it.
    provided: dict[tuple[int, int, int], tuple[str, torch.Tensor]] = {}
    for kind, key, module, info in entries:
        if key not in state_dict:
            continue
        value = state_dict[key]
        if kind == "param":
            owner, hi, idx = info
            shape = owner._handles[hi].shapes[idx]
            if tuple(value.shape) != tuple(shape):
                raise RuntimeError(
                    f"size mismatch for {key}: the state dict has shape {tuple(value.shape)}, the model "
                    f"{tuple(shape)}"
                )
            provided.setdefault((id(owner), hi, idx), (key, value))
        elif kind == "buffer":
            owner, name = info
            buf = module._buffers[name]
            if tuple(value.shape) != tuple(buf.shape):
                raise RuntimeError(
                    f"size mismatch for {key}: the state dict has shape {tuple(value.shape)}, the model "
                    f"{tuple(buf.shape)}"
                )
            buf.copy_(value)
        else:
            module.set_extra_state(value)
    for u in units:
        for hi, h in enumerate(u._handles):
            have = [provided.get((id(u), hi, i)) for i in range(len(h.shapes))]
            device = u._compute_device
            if all(x is not None for x in have):
                full = dp.flatten_padded([x[1].to(device) for x in have], h.world_size, h.dtype)
            else:
                # Partial load (strict=False): start from the current values. Collective, like the full case
                # is not: every rank must provide the same keys.
                full = h.gather_full_precision(device)
                views = h.split_full(full)
                for i, x in enumerate(have):
                    if x is not None:
                        views[i].copy_(x[1])
            h.reshard()
            h.flat.detach().copy_(h.shard_of(full))  # bumps the version: gathered copies are refreshed
    return missing, unexpected


@torch.no_grad()
def local_state_dict(root: FullyShardedDataParallel) -> OrderedDict[str, Any]:
    """This rank's flat shards and the buffers, under the wrapper-inclusive names of ``named_parameters()``."""
    _check_idle(root, "local_state_dict()")
    sd: OrderedDict[str, Any] = OrderedDict()
    for name, p in root.named_parameters():
        sd[name] = p.detach().clone()
    for name, b in root.named_buffers():
        sd[name] = b.detach().clone()
    return sd


@torch.no_grad()
def load_local_state_dict(
    root: FullyShardedDataParallel, state_dict: dict[str, Any], strict: bool
) -> tuple[list[str], list[str]]:
    """Load a :func:`local_state_dict`; shapes must match (same world size and wrapping)."""
    _check_idle(root, "load_local_state_dict()")
    params = dict(root.named_parameters())
    buffers = dict(root.named_buffers())
    missing = [k for k in (*params, *buffers) if k not in state_dict]
    unexpected = [k for k in state_dict if k not in params and k not in buffers]
    if strict and (missing or unexpected):
        raise RuntimeError(
            f"Error(s) in loading local_state_dict: missing keys {missing[:20]}, unexpected keys "
            f"{unexpected[:20]}: it must come from local_state_dict() of the same wrapping on the same rank"
        )
    for k, v in state_dict.items():
        target = params.get(k, buffers.get(k))
        if target is None:
            continue
        if tuple(v.shape) != tuple(target.shape):
            raise RuntimeError(
                f"size mismatch for {k}: saved shard has shape {tuple(v.shape)} but this rank's has "
                f"{tuple(target.shape)}: local state dicts only load with the same world size and wrapping"
            )
        target.detach().copy_(v)
    for u in root._units():
        u._reshard()
    return missing, unexpected
