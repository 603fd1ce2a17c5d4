"""The only place in shardfuse that calls ``torch.distributed`` collectives.

It hides differences between torch versions and backends: torch 2.13 renamed ``all_gather_into_tensor`` /
``reduce_scatter_tensor`` to ``all_gather_single`` / ``reduce_scatter_single`` (the old names warn), and
some gloo builds lack the tensor forms, in which case the list forms (or all-reduce + slice) are used.
A world of size 1 issues no collective at all. The same code path serves NCCL and gloo.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from shardfuse._profiling import profiled

logger = logging.getLogger(__name__)

ProcessGroup = Any  # torch.distributed.ProcessGroup (Any keeps the import cheap when dist is unavailable)

# Prefer the new names where they exist (no deprecation warning), else the old ones (torch 2.11).
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# Backends (by name) on which the tensor forms failed once; they use the list forms from then on.
_NO_TENSOR_FORMS: set[str] = set()


def _unsupported(err: Exception) -> bool:
    text = str(err).lower()
    return any(s in text for s in ("not supported", "does not support", "not implemented", "unsupported"))


def _backend(group: ProcessGroup | None) -> str:
    return str(dist.get_backend(group))


def is_initialized() -> bool:
    """True when a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def default_group() -> ProcessGroup:
    """The default (world) process group; a clear error when none was initialised."""
    if not is_initialized():
        raise RuntimeError(
            "FullyShardedDataParallel needs torch.distributed: call "
            "torch.distributed.init_process_group(backend=...) first (torchrun sets the environment), "
            "or pass process_group="
        )
    return dist.group.WORLD


def is_process_group(group: ProcessGroup) -> bool:
    """True for a real ``torch.distributed`` group (not a duck-typed stand-in with only rank()/size())."""
    return isinstance(group, dist.ProcessGroup)


def is_cuda_group(group: ProcessGroup) -> bool:
    """True when ``group`` communicates CUDA tensors (NCCL): its shards must live on a GPU."""
    try:
        return "nccl" in _backend(group).lower()
    except (RuntimeError, ValueError, TypeError, AttributeError):  # duck-typed or uninitialised groups
        return False


def spans_world(group: ProcessGroup) -> bool:
    """``group`` is a real process group holding every rank of the default group (as the default group does)."""
    return is_process_group(group) and is_initialized() and dist.get_world_size(group) == dist.get_world_size()


def new_group_like(group: ProcessGroup) -> ProcessGroup:
    """A new process group of every rank, with ``group``'s backend: its own communicator (under NCCL its own
    stream, so its collectives run beside ``group``'s). Collective: every rank of the default group calls it, in
    the same order."""
    return dist.new_group(backend=_backend(group))


def rank(group: ProcessGroup) -> int:
    """This process's rank inside ``group`` (any object with ``rank()``/``size()`` works, as in FairScale)."""
    return group.rank() if callable(getattr(group, "rank", None)) else dist.get_rank(group)


def world_size(group: ProcessGroup) -> int:
    """Number of ranks in ``group``."""
    return group.size() if callable(getattr(group, "size", None)) else dist.get_world_size(group)


def all_gather_into(out: torch.Tensor, inp: torch.Tensor, group: ProcessGroup, world: int) -> None:
    """``out = cat([inp of every rank])``, rank-major. ``inp`` may be this rank's slice of ``out`` (in place)."""
    if world == 1:
        if inp.data_ptr() != out.data_ptr():
            out.copy_(inp)
        return
    backend = _backend(group)
    if backend not in _NO_TENSOR_FORMS:
        try:
            _ALL_GATHER(out, inp, group=group)
            return
        except (RuntimeError, NotImplementedError) as err:
            if not _unsupported(err):
                raise
            logger.info("backend %s lacks the tensor all-gather (%s); using the list form", backend, err)
            _NO_TENSOR_FORMS.add(backend)
    chunks = list(out.chunk(world))
    src = inp.clone() if any(c.data_ptr() == inp.data_ptr() for c in chunks) else inp
    dist.all_gather(chunks, src, group=group)


def reduce_scatter_into(out: torch.Tensor, inp: torch.Tensor, group: ProcessGroup, world: int) -> None:
    """``out = sum over ranks of inp.chunk(world)[rank]``. ``inp`` is a scratch buffer and may be overwritten."""
    if world == 1:
        out.copy_(inp)
        return
    backend = _backend(group)
    if backend not in _NO_TENSOR_FORMS:
        try:
            _REDUCE_SCATTER(out, inp, op=dist.ReduceOp.SUM, group=group)
            return
        except (RuntimeError, NotImplementedError) as err:
            if not _unsupported(err):
                raise
            logger.info("backend %s lacks the tensor reduce-scatter (%s); using all-reduce + slice", backend, err)
            _NO_TENSOR_FORMS.add(backend)
    # All-reduce works on every backend; keep only this rank's chunk.
    dist.all_reduce(inp, op=dist.ReduceOp.SUM, group=group)
    n = out.numel()
    out.copy_(inp.narrow(0, dist.get_rank(group) * n, n))


def all_reduce_(t: torch.Tensor, group: ProcessGroup, world: int, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce of ``t`` with ``op`` in {"sum", "max"}; returns ``t``."""
    if world == 1:
        return t
    with profiled("shardfuse.sharding:all_reduce"):
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=group)
    return t


def all_gather_object(obj: Any, group: ProcessGroup, world: int) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order; ``[obj]`` for a world of one."""
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_(t: torch.Tensor, group: ProcessGroup, world: int) -> None:
    """Overwrite ``t`` with its value on the group's first rank."""
    if world > 1:
        dist.broadcast(t, src=dist.get_global_rank(group, 0), group=group)


def barrier(group: ProcessGroup, world: int) -> None:
    """Block until every rank of ``group`` arrives (tests and state-dict paths only)."""
    if world > 1:
        dist.barrier(group=group)
