"""The post-backward data path: full gradient -> pre-divide/cast/pad -> reduce-scatter -> post-divide into the
sharded gradient, on the post-backward stream.

Lifetimes without ``record_stream``: the full gradient was allocated by the compute stream and is read by the
post-backward stream, so a reference is kept (with an event) until the compute stream has waited for that
read; scratch buffers are allocated on the post-backward stream and only ever used there; the sharded
gradient is allocated on the compute stream, written on the post-backward stream, and the compute stream
waits for the post-backward stream at the end of backward before anyone reads it. A fresh sharded gradient that a
``StepInBackward`` takes (the handle's ``grad_consumer``) is allocated on the post-backward stream instead, the only
stream that ever touches it, and dropped there once its update is queued.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch

from shardfuse._profiling import profiled
from shardfuse._streams import Streams, record_event, use_stream, wait_event, wait_stream
from shardfuse.sharding.core import _collectives as coll
from shardfuse.sharding.core import _data_path as dp
from shardfuse.sharding.core._flat_param import FlatParamHandle
from shardfuse.sharding.core._fused_grads import flat_of
from shardfuse.sharding.core._groups import Groups

logger = logging.getLogger(__name__)

# What the post-backward stream read and the compute stream must not free early: a full gradient, or the
# parameters' gradients it was not concatenated from (_fused_grads.py).
Held = torch.Tensor | list[torch.Tensor | None]


@dataclass
class ReduceConfig:
    """How one unit reduces its gradients: the one live copy of its divide factors (``set_gradient_divide_factors``
    changes them here) and of its reduce dtype (settled at lazy init, once the compute dtype is known)."""

    groups: Groups  # the unit's groups (shared): reductions use the reduce-scatter group
    predivide: float
    postdivide: float
    reduce_dtype: torch.dtype = torch.float32

    @property
    def group(self) -> coll.ProcessGroup:
        """The reduce-scatter process group."""
        return self.groups.reduce_scatter_group


@dataclass
class PendingFrees:
    """Tensors read by the post-backward stream, released once the compute stream has waited for the read."""

    items: list[tuple[Held, torch.cuda.Event | None]] = field(default_factory=list)
    # Offloaded gradients: (flat parameter, host copy being written on the post-backward stream, its device
    # source, kept alive until the post-backward stream has finished with it).
    host_grads: list[tuple[torch.nn.Parameter, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    # Shards of an OffloadOptimizer whose gradient copy to the host is in flight (landed at the end of backward),
    # and the device sources of those copies, each freed once the compute stream has waited for its copy.
    landing: list[FlatParamHandle] = field(default_factory=list)
    copies: list[tuple[Held, torch.cuda.Event | None]] = field(default_factory=list)

    def add_copy_source(self, tensor: torch.Tensor, event: torch.cuda.Event | None, streams: Streams,
                        keep: int = 4) -> None:
        """Hold the device source of a host copy until ``event``; at most ``keep`` in flight (memory against how
        far the copies may lag the backward)."""
        _hold(self.copies, tensor, event, streams, keep)

    def add(self, tensor: Held, event: torch.cuda.Event | None, streams: Streams, keep: int = 1) -> None:
        """Hold ``tensor`` until ``event``; release older entries beyond ``keep`` after a device-side wait."""
        _hold(self.items, tensor, event, streams, keep)

    def release_all(self) -> None:
        """Drop every held tensor (the caller made the compute stream wait for the post-backward stream)."""
        self.items.clear()
        self.copies.clear()


def _hold(held: list[tuple[Held, torch.cuda.Event | None]], tensor: Held,
          event: torch.cuda.Event | None, streams: Streams, keep: int) -> None:
    """Append (tensor, event) to ``held``; entries beyond ``keep`` go after the compute stream waited for them."""
    if event is None:  # CPU: everything already ran synchronously
        return
    while len(held) >= keep:
        old, old_event = held.pop(0)
        wait_event(streams.current(), old_event)
        del old
    held.append((tensor, event))


def reduce_grad(handle: FlatParamHandle, cfg: ReduceConfig, streams: Streams, pending: PendingFrees,
                all_reduce: bool = True, pieces: list[torch.Tensor | None] | None = None, keep: int = 1) -> None:
    """Reduce-scatter ``handle.full_param.grad`` into ``handle.flat.grad`` (accumulating into an existing one).

    ``pieces``: the parameters' gradients of a fresh backward kept apart (``_fused_grads.py``, with no
    ``full_param.grad``), pre-divided straight into the reduce-scatter input: the same bytes as their
    concatenation's. The full gradient is detached from ``full_param`` immediately, so it is freed as soon as the
    post-backward stream has consumed it. Under hybrid sharding the reduce-scattered shard is then all-reduced
    across replicas on the same stream, unless ``all_reduce`` is False (``set_requires_all_reduce(False)``):
    then it is added to ``handle.unsynced_grad`` instead, and the next all-reduce carries that sum once.

    ``keep``: how many reductions' gradients stay held before the compute stream waits for the oldest to be read
    (the unit's trained handles: each waits for the previous unit's, never for a sibling's reduction issued just
    now, which would hold the next unit's compute until that reduce-scatter ends).
    """
    full_param = handle.made(handle.full_param)
    grad = full_param.grad
    full_param.grad = None
    if grad is None and pieces is None:
        return
    handle.grads_from_views()
    hold = cfg.groups.hybrid and not all_reduce
    if hold and handle.host is not None:
        raise NotImplementedError(
            f"set_requires_all_reduce(False) with an OffloadOptimizer is not supported ({handle.names[0]} is "
            f"offloaded: its host step expects the all-reduced gradient each backward): use no_sync() to accumulate"
        )
    device = handle.made(handle.full_data).device
    # A fresh gradient a StepInBackward will take on the post-backward stream is made on that stream: its memory is
    # then reused only in that stream's order, so it is freed the moment the update is queued (no hold).
    side = not hold and _taken_on_side(handle, device, streams)
    made_on = streams.post_backward if side else None
    dest, accumulate = (None, False) if hold else _destination(handle, device, made_on)
    lowp = None if dest is None or grad is None else exact_compute_dtype_grad(handle, cfg, grad)
    direct = direct_predivide(handle, cfg, dest, accumulate)
    predivide = cfg.predivide if direct is None else direct
    if pieces is not None and predivide == 1.0 and cfg.reduce_dtype == handle.compute_dtype:
        # No pre-divide pass to fold the concatenation into: the concatenation is the reduce-scatter input.
        grad, pieces = flat_of(handle, pieces), None
    post_backward = streams.post_backward
    wait_stream(post_backward, streams.current())
    with profiled("shardfuse.sharding:reduce_scatter"), use_stream(post_backward):
        rs_in = _reduce_input(handle, cfg, grad, pieces, predivide)
        if direct is not None and dest is not None:  # straight into the sharded gradient: no post-divide pass
            coll.reduce_scatter_into(dest, rs_in, cfg.group, handle.world_size)
        else:
            rs_out = rs_in
            if handle.world_size != 1:
                rs_out = torch.empty(handle.shard_numel, dtype=cfg.reduce_dtype, device=device)
                coll.reduce_scatter_into(rs_out, rs_in, cfg.group, handle.world_size)
            if dest is None:  # the replica all-reduce is skipped: accumulate this rank's partial sum locally
                held = handle.unsynced_grad
                handle.unsynced_grad = rs_out if held is None else held.add_(rs_out)
            else:
                _finish(handle, cfg, rs_out, dest, accumulate, pending, post_backward, lowp)
        consumed = _consume(handle, dest)
        event = record_event(post_backward)  # after the copy to the host: ``grad`` (lowp's storage) is held to it
    if handle.host is not None and dest is not None:
        pending.add_copy_source(dest, event, streams)
    kept: Held | None = grad if pieces is None else pieces
    if consumed is not None and not side:  # made on the compute stream, read on the post-backward one: held
        together: list[torch.Tensor | None] = [consumed]
        together += kept if isinstance(kept, list) else [kept]
        kept = together
    if kept is not None:  # always: reduce_grad returned early when there was neither
        pending.add(kept, event, streams, keep)


def _consume(handle: FlatParamHandle, dest: torch.Tensor | None) -> torch.Tensor | None:
    """On the post-backward stream, once a reduction has written the resident ``flat.grad``: hand it to the
    handle's ``grad_consumer`` (``StepInBackward`` steps the shard with it and drops it). Returns the gradient it
    took, for the caller to hold until the compute stream has waited for this stream (it was allocated on the
    compute stream, which may reuse its memory as soon as it is freed), or None."""
    consumer = handle.grad_consumer
    if consumer is None or dest is None or dest is not handle.flat.grad:
        return None
    with profiled("shardfuse.sharding:step_in_backward"):
        return dest if consumer(handle) else None


def _reduce_input(handle: FlatParamHandle, cfg: ReduceConfig, grad: torch.Tensor | None,
                  pieces: list[torch.Tensor | None] | None, predivide: float) -> torch.Tensor:
    """On the post-backward stream: the padded reduce-scatter input, pre-divided and cast from the full gradient
    ``grad`` or from the parameters' gradients ``pieces`` (None: zeros, as their concatenation holds)."""
    if pieces is not None:
        rs_in = torch.empty(handle.padded_numel, dtype=cfg.reduce_dtype, device=handle.made(handle.full_data).device)
        full_dtype = handle.compute_dtype
        # The multi-tensor kernel reads contiguous tensors of one dtype, as the concatenation would have held them.
        grads = [torch.zeros(n, dtype=full_dtype, device=rs_in.device) if g is None else g.contiguous()
                 for g, n in zip(pieces, handle.numels)]
        dp.pre_divide_pad_pieces(grads, rs_in, predivide)
        return rs_in
    assert grad is not None  # reduce_grad returns early when there is neither
    g = grad.view(-1)
    if predivide == 1.0 and cfg.reduce_dtype == g.dtype:
        return g  # padding of the full gradient is already zero (SplitBackward fills it)
    rs_in = torch.empty(handle.padded_numel, dtype=cfg.reduce_dtype, device=g.device)
    dp.pre_divide_pad(g.narrow(0, 0, handle.numel), rs_in, predivide)
    return rs_in


def direct_predivide(handle: FlatParamHandle, cfg: ReduceConfig, dest: torch.Tensor | None,
                     accumulate: bool) -> float | None:
    """The pre-divide factor with which the reduce-scatter may write straight into the sharded gradient ``dest``
    (saving the post-divide pass, one read and one write of the shard, and its scratch buffer), or None.

    It may where the post-divide would only copy: a fresh gradient on the device that is the shard's own
    ``flat.grad`` (nothing to accumulate, no host copy, no replica all-reduce in between), in the reduce dtype,
    and a post-divide factor of 1. A post-divide factor that is a power of two moves into the pre-divide when the
    reduce dtype is fp32 or fp64 and a pre-divide pass runs anyway: scaling by a power of two commutes with
    rounded addition, so the sum is the same bits outside the subnormal range (FairScale's split of the factors
    guards fp16 sums, which never take this path).
    """
    if dest is None or accumulate or handle.host is not None or handle.world_size == 1 or cfg.groups.hybrid:
        return None
    if dest is not handle.flat.grad:
        # A shard kept on the host (move_params_to_cpu): ``dest`` is a device temporary whose copy to the host
        # runs in the post-divide's step (_finish); writing straight into it would leave ``flat.grad`` unset.
        return None
    if dest.dtype != cfg.reduce_dtype:
        return None
    pre, post = cfg.predivide, cfg.postdivide
    if post == 1.0:
        return pre
    if pre != 1.0 and cfg.reduce_dtype in (torch.float32, torch.float64) and _power_of_two(pre) \
            and _power_of_two(post):
        return pre * post
    return None


def _power_of_two(x: float) -> bool:
    mantissa, _ = math.frexp(x)
    return x > 0 and mantissa == 0.5


def flush_unsynced(handle: FlatParamHandle, cfg: ReduceConfig, streams: Streams, pending: PendingFrees) -> None:
    """All-reduce a gradient held by ``set_requires_all_reduce(False)`` whose unit did not run in this synced
    backward, into ``flat.grad`` (every rank of the replicate group holds one, as usage is the same on all)."""
    held = handle.unsynced_grad
    if held is None:
        return
    handle.unsynced_grad = None
    dest, accumulate = _destination(handle, held.device)
    post_backward = streams.post_backward
    wait_stream(post_backward, streams.current())
    with profiled("shardfuse.sharding:all_reduce_replicas"), use_stream(post_backward):
        _finish(handle, cfg, held, dest, accumulate, pending, post_backward)
        consumed = _consume(handle, dest)
        event = record_event(post_backward)
    if handle.host is not None:
        pending.add_copy_source(dest, event, streams)
    if consumed is not None:
        pending.add(consumed, event, streams)


def exact_compute_dtype_grad(handle: FlatParamHandle, cfg: ReduceConfig, grad: torch.Tensor) -> torch.Tensor | None:
    """The unit's full gradient ``grad`` as its reduced shard gradient, where an offloaded shard may take it in the
    compute dtype instead of its fp32 cast because the reduction is the identity and every cast on the path is
    exact: one rank in the shard group (no reduce-scatter), no replica all-reduce and no partial sum held back for
    one, both divide factors 1, a 2-byte compute dtype into an fp32 shard, and a reduce dtype that holds it (itself
    or fp32). None otherwise. Whether the shard already holds a gradient to accumulate into (then the fp32 path
    runs) is the host shard's to check (``HostShard.send_grad``)."""
    host = handle.host
    if host is None or not host.lowp_grads:
        return None
    if handle.world_size != 1 or cfg.groups.hybrid or handle.unsynced_grad is not None:
        return None
    if cfg.predivide != 1.0 or cfg.postdivide != 1.0:
        return None
    if grad.dtype not in (torch.bfloat16, torch.float16) or handle.flat.dtype != torch.float32:
        return None
    if cfg.reduce_dtype not in (grad.dtype, torch.float32):
        return None
    return grad.view(-1).narrow(0, 0, handle.shard_numel)


def _taken_on_side(handle: FlatParamHandle, device: torch.device, streams: Streams) -> bool:
    """Whether this reduction's gradient is fresh, resident and taken by the handle's ``grad_consumer`` on the
    post-backward stream (a CUDA one)."""
    return (handle.grad_consumer is not None and streams.post_backward is not None and handle.host is None
            and handle.flat.grad is None and handle.flat.device == device)


def _destination(handle: FlatParamHandle, device: torch.device,
                 made_on: torch.cuda.Stream | None = None) -> tuple[torch.Tensor, bool]:
    """Where the reduced shard is written and whether it accumulates there. A fresh one is made on the compute
    stream, or on ``made_on`` (the post-backward stream, where a StepInBackward takes it: :func:`_taken_on_side`)."""
    flat = handle.flat
    handle.step.grad_reduced = True
    if flat.device != device or handle.host is not None:
        # The shard lives on the host: reduce into a device temporary, then copy it out.
        return torch.empty(handle.shard_numel, dtype=flat.dtype, device=device), False
    if flat.grad is None:
        # Its memory is reused only in the order of the stream that made it: the compute stream, which reads it
        # after backward, or the post-backward stream, the only one to touch a gradient a StepInBackward takes.
        with use_stream(made_on):
            flat.grad = torch.empty_like(flat, memory_format=torch.contiguous_format)
        return flat.grad, False
    dest = flat.grad
    if dest.shape != flat.shape or not dest.is_contiguous():  # set outside the runtime: checked here
        raise RuntimeError(
            f"flat parameter gradient has shape {tuple(dest.shape)} stride {dest.stride()} but the shard is "
            f"contiguous of shape {tuple(flat.shape)}: "
            f"do not assign .grad of FullyShardedDataParallel parameters by hand"
        )
    return dest, True


def _finish(handle: FlatParamHandle, cfg: ReduceConfig, rs_out: torch.Tensor, dest: torch.Tensor, accumulate: bool,
            pending: PendingFrees, post_backward: torch.cuda.Stream | None, lowp: torch.Tensor | None = None) -> None:
    """On the post-backward stream: all-reduce across replicas (hybrid sharding; with the sum held back by
    ``set_requires_all_reduce(False)`` added first), post-divide into ``dest``, copy an offloaded shard out
    (``lowp``: the same gradient in the compute dtype, see :func:`exact_compute_dtype_grad`)."""
    groups = cfg.groups
    if groups.hybrid:
        held = handle.unsynced_grad
        if held is not None:
            handle.unsynced_grad = None
            rs_out = rs_out.add_(held)
        with profiled("shardfuse.sharding:all_reduce_replicas"):
            coll.all_reduce_(rs_out, groups.replicate_group, groups.replicate_size)
    flat = handle.flat
    dp.post_divide(rs_out, dest, cfg.postdivide, accumulate=accumulate)
    if handle.host is not None:
        handle.host.send_grad(flat, dest, post_backward, lowp)
        pending.landing.append(handle)
    elif flat.device != dest.device:
        host = torch.empty(dest.shape, dtype=dest.dtype, pin_memory=torch.cuda.is_available())
        host.copy_(dest, non_blocking=True)
        pending.host_grads.append((flat, host, dest))


def finish_host_grads(pending: PendingFrees, streams: Streams) -> None:
    """Land offloaded gradients in ``flat.grad`` on the host (waits for the copies: offload syncs by design)."""
    if not pending.host_grads and not pending.landing:
        return
    if streams.post_backward is not None:
        streams.post_backward.synchronize()
    for handle in pending.landing:
        if handle.host is not None:  # always: only handles with a host side are queued here
            handle.host.land_grad(handle.flat)
    pending.landing.clear()
    for flat, host, _ in pending.host_grads:
        if flat.grad is None:
            flat.grad = host
        else:
            flat.grad.add_(host)
    pending.host_grads.clear()



def _local_norm(grads: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """``max |g|`` (inf) or ``sum ||g||^p`` over ``grads``, as a float32 scalar on ``device``."""
    grads = [g for g in grads if g.numel()]  # a rank's piece of an original parameter may be empty
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    if norm_type == float("inf"):
        return torch.stack([g.detach().abs().max().float().to(device) for g in grads]).max()
    norms = torch._foreach_norm([g.detach() for g in grads], norm_type)
    return torch.stack([n.float().to(device) for n in norms]).pow(norm_type).sum()


@torch.no_grad()
def global_grad_norm(sharded: list[torch.Tensor], replicated: list[torch.Tensor], norm_type: float,
                     device: torch.device, group: coll.ProcessGroup, world: int) -> torch.Tensor:
    """The ``norm_type`` norm of all gradients as one vector: ``sharded`` ones are this rank's pieces (one
    all-reduce over ``group``), ``replicated`` ones are the same on every rank (counted once). Every rank of
    ``group`` must call it."""
    local = _local_norm(sharded, norm_type, device)
    if norm_type == float("inf"):
        total = coll.all_reduce_(local, group, world, op="max")
        return torch.maximum(total, _local_norm(replicated, norm_type, device))
    total = coll.all_reduce_(local, group, world) + _local_norm(replicated, norm_type, device)
    return total.pow(1.0 / norm_type)


@torch.no_grad()
def clip_grad_norm(
    grads: list[torch.Tensor], max_norm: float, norm_type: float, device: torch.device, group: coll.ProcessGroup,
    world: int,
) -> torch.Tensor:
    """Scale the sharded gradients in place so that their global ``norm_type`` norm (one all-reduce over the
    group) is at most ``max_norm``; returns that norm. Every rank must call it."""
    norm_type = float(norm_type)
    total = global_grad_norm(grads, [], norm_type, device, group, world)
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    by_device: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        by_device.setdefault((g.device, g.dtype), []).append(g)
    for same in by_device.values():
        torch._foreach_mul_(same, coef.to(same[0].device))
    return total
