"""The float8 all-gather of a flat parameter: its shard is cast to float8 (e4m3) straight into this rank's slice of
a uint8 all-gather buffer, and the layers compute with float8 weights over the gathered bytes.

The sharding core never imports torchao. A float8 library (``shardfuse.float8``) registers a *marker* here at
conversion time; at wrap time the flattener asks the markers which parameters are float8 weights, and those get
flat parameters of their own (groups keyed ``(dtype, requires_grad, float8)``). A marker is a class (or object)
with three static methods:

- ``marks(module, name, param) -> bool``: ``module.<name>`` is a weight to all-gather in float8;
- ``amax_to_scale(amax, modules) -> Tensor``: the float32 scales of a vector of amaxes, one per weight of
  ``modules`` (the library's formula, with each layer's settings);
- ``weight(data, scale, dtype, module) -> Tensor``: the layer's weight over ``data`` (float8, the weight's shape)
  and ``scale`` (0-dim float32), whose matmul casts nothing again and whose gradient is a plain ``dtype`` tensor.

Scales: each weight's scale is from its amax over every rank (torchao's tensorwise dynamic scale, as
``precompute_float8_dynamic_scale_for_fsdp`` computes it after the optimizer step). :func:`refresh_scales`, called
by the root at the start of its forward, refreshes every float8 flat parameter of the tree whose shard changed
since its last refresh (its version counter or its storage) at once: one ``fp8_amax`` launch over this rank's
piece of each of their weights and one ``all_reduce(MAX)`` per process group. A gather that still finds its shard
changed (a unit run outside the root's forward) refreshes its own scales the same way (the fallback). Then, at
every gather (:meth:`Float8Gather.gather`), one ``cast_fp8_shards`` launch into the rank's uint8 slice and the
all-gather of the bytes. The compute-dtype full buffer is never allocated:
the layer weights are autograd outputs of the handle's grad token (:class:`_Float8WeightsFused`, the fused
gradient path of ``_fused_grads.py``): their gradients are kept apart and pre-divided straight into the
reduce-scatter input, one multi-tensor launch, with no concatenation (at 6.7B, 2 H200s, that concatenation took 14
of a 372 ms step). Without a grad token (``fuse_grads`` off) :class:`_Float8Weights` makes them outputs of the
(unallocated) full parameter, so their gradients flow into ``full_param.grad`` and the normal reduce-scatter.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from shardfuse.sharding.core import _collectives as coll
from shardfuse.sharding.core import _data_path as dp
from shardfuse.sharding.core._fused_grads import add_contribution

__all__ = ["Float8Gather", "marker_of", "refresh_scales", "register_marker"]

# The registered markers (classes or plain objects with the three methods above), in registration order. Nothing
# live: no modules, tensors or handles, only the library's code. Listed on docs/process-wide.md.
_MARKERS: list[Any] = []


def register_marker(marker: Any) -> None:
    """Let ``marker`` mark float8 weights at every later wrap (idempotent)."""
    for name in ("marks", "amax_to_scale", "weight"):
        if not callable(getattr(marker, name, None)):
            raise TypeError(f"a float8 gather marker needs a callable {name}(), {marker!r} has none")
    if marker not in _MARKERS:
        _MARKERS.append(marker)


def marker_of(module: nn.Module, name: str, param: nn.Parameter) -> Any | None:
    """The marker that claims ``module.<name>`` as a float8 weight, or None."""
    for marker in _MARKERS:
        if marker.marks(module, name, param):
            return marker
    return None


class Float8Gather:
    """The float8 side of one flat parameter: where each weight's piece sits in this rank's shard, the scales and
    the gathered bytes (their storage allocated only while gathered, like the compute-dtype full buffer)."""

    def __init__(self, marker: Any, modules: list[nn.Module | None]) -> None:
        self.marker = marker
        self.modules = modules  # the module of each weight (its float8 config)
        self.pieces: list[tuple[int, int]] = []  # (offset in the shard, length) of each weight's piece
        self.scales: torch.Tensor | None = None  # float32, one per weight, written in place at each refresh
        self.data: torch.Tensor | None = None  # uint8, padded full size: gathered into
        self.read: torch.Tensor | None = None  # alias of ``data`` the layer weights view (own version counter)
        self.scaled_for: tuple[int, int] | None = None  # (version, storage address) of the shard scaled last

    def __getstate__(self) -> dict:
        return {**self.__dict__, "scales": None, "data": None, "read": None, "scaled_for": None}

    def drop(self) -> None:
        """Forget the buffers (the shard moved or changed dtype): the next gather makes them again."""
        self.scales = self.data = self.read = None
        self.scaled_for = None

    def set_pieces(self, numels: list[int], rank: int, shard_numel: int) -> None:
        start, end = rank * shard_numel, (rank + 1) * shard_numel
        self.pieces = []
        offset = 0
        for n in numels:
            lo, hi = max(offset, start), min(offset + n, end)
            self.pieces.append((lo - start, hi - lo) if hi > lo else (0, 0))
            offset += n

    def stale(self, shard: torch.Tensor) -> bool:
        """``shard`` changed (or moved) since the scales were last refreshed from it."""
        return self.scales is None or self.scales.device != shard.device or self._key(shard) != self.scaled_for

    @staticmethod
    def _key(shard: torch.Tensor) -> tuple[int, int]:
        return shard._version, shard.untyped_storage().data_ptr()

    def segments(self, shard: torch.Tensor) -> list[torch.Tensor]:
        """This rank's piece of each weight in ``shard``."""
        return [shard.narrow(0, a, n) for a, n in self.pieces]

    def set_scales(self, amax: torch.Tensor, shard: torch.Tensor) -> None:
        """The scales of the weights' global amaxes ``amax`` (one per weight), refreshed from ``shard``."""
        if self.scales is None or self.scales.device != shard.device:
            self.scales = torch.empty(len(self.pieces), dtype=torch.float32, device=shard.device)
        self.scales.copy_(self.marker.amax_to_scale(amax, self.modules))
        self.scaled_for = self._key(shard)

    def gather(self, shard: torch.Tensor, padded_numel: int, rank: int, group: Any, world_size: int) -> None:
        """Refresh the scales if ``shard`` changed since :func:`refresh_scales` (the fallback), cast it into this
        rank's slice of the bytes, all-gather them (on the current stream: the caller's all-gather stream)."""
        if self.data is None or self.data.device != shard.device:
            self.data = torch.empty(padded_numel, dtype=torch.uint8, device=shard.device)
            self.read = self.data.data
        storage = self.data.untyped_storage()
        if storage.size() == 0:
            storage.resize_(padded_numel)
        if self.stale(shard):
            refresh_scales([(self, shard, group, world_size)])
        scales = self.scales
        assert scales is not None
        shard_numel = padded_numel // world_size
        local = self.data.narrow(0, rank * shard_numel, shard_numel)
        dp.cast_fp8_shards(self.segments(shard), scales, local, offsets=[a for a, _ in self.pieces])
        coll.all_gather_into(self.data, local, group, world_size)

    def free(self) -> None:
        if self.data is not None:
            self.data.untyped_storage().resize_(0)

    def weights(self, full_param: torch.Tensor, split_sizes: list[int], shapes: list[torch.Size]) -> list[torch.Tensor]:
        """The layers' weights over the gathered bytes, autograd outputs of ``full_param`` (never read)."""
        return list(_Float8Weights.apply(full_param, self, split_sizes, shapes))

    def weights_fused(self, token: torch.Tensor, handle: Any) -> list[torch.Tensor]:
        """The same weights as outputs of ``handle``'s grad token (``_fused_grads.py``): their gradients are
        stashed on the handle apart, for the reduction to pre-divide straight into the reduce-scatter input."""
        return list(_Float8WeightsFused.apply(token, self, handle))


def refresh_scales(stale: list[tuple[Float8Gather, torch.Tensor, Any, int]]) -> None:
    """Refresh the scales of each ``(gather, shard, process group, world size)``: per process group and device,
    one ``fp8_amax`` launch over every weight piece of their shards and one ``all_reduce(MAX)`` of the amaxes.
    Collective: every rank of each group passes the same gathers, in the same order."""
    batches: dict[tuple[int, torch.device], list[tuple[Float8Gather, torch.Tensor, Any, int]]] = {}
    for item in stale:
        batches.setdefault((id(item[2]), item[1].device), []).append(item)
    for batch in batches.values():
        segments = [seg for g, shard, _, _ in batch for seg in g.segments(shard)]
        amax = dp.fp8_amax(segments)
        _, _, group, world_size = batch[0]
        coll.all_reduce_(amax, group, world_size, op="max")
        start = 0
        for g, shard, _, _ in batch:
            n = len(g.pieces)
            g.set_scales(amax[start:start + n], shard)
            start += n


def _float8_weights(gather: Float8Gather, dtype: torch.dtype, split_sizes: list[int],
                    shapes: list[torch.Size]) -> tuple[torch.Tensor, ...]:
    """The layers' float8 weights over ``gather``'s bytes, with gradients of ``dtype``."""
    read, scales = gather.read, gather.scales
    assert read is not None and scales is not None
    chunks = torch.split_with_sizes(read.view(dp.FP8_DTYPE), split_sizes)
    # unbind: every weight's 0-dim scale in one call (indexing made one view per call)
    return tuple(gather.marker.weight(c.view(s), scale, dtype, m)
                 for c, s, scale, m in zip(chunks, shapes, scales.unbind(), gather.modules))


class _Float8WeightsFused(torch.autograd.Function):
    """``(token, gather, handle)`` -> the float8 weights; backward: their gradients stashed on ``handle`` apart
    (``_fused_grads.add_contribution``, as the compute-dtype views' Unflatten node does), an empty gradient for
    the token. No concatenation: the reduction reads each weight's gradient where it lies."""

    @staticmethod
    def forward(ctx: Any, token: torch.Tensor, gather: Float8Gather, handle: Any) -> tuple[torch.Tensor, ...]:
        ctx.set_materialize_grads(False)  # a weight without gradient stays None (zeros where the reduction reads)
        ctx.handle = weakref.ref(handle)  # a graph the user keeps must not keep the model alive
        ctx.token_meta = (token.dtype, token.device)
        return _float8_weights(gather, handle.compute_dtype, handle.split_sizes, handle.shapes)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor, None, None]:
        handle = ctx.handle()
        dtype, device = ctx.token_meta
        if handle is not None:
            # In the compute dtype, as the concatenating node's gradient (torchao's is already: a no-op there).
            grads = tuple(g if g is None or g.dtype == dtype else g.to(dtype) for g in grads)
            handle.step.fused = add_contribution(handle, handle.step.fused, grads)
        return torch.empty(0, dtype=dtype, device=device), None, None


class _Float8Weights(torch.autograd.Function):
    """``full_param`` -> the float8 weights; backward: their gradients as one flat gradient of ``full_param``."""

    @staticmethod
    def forward(ctx: Any, full_param: torch.Tensor, gather: Float8Gather, split_sizes: list[int],
                shapes: list[torch.Size]) -> tuple[torch.Tensor, ...]:
        ctx.set_materialize_grads(False)  # a zeros_like of a float8 weight is not what the gradient needs
        ctx.split_sizes = split_sizes
        ctx.shapes = shapes
        ctx.dtype, ctx.device = full_param.dtype, full_param.device
        return _float8_weights(gather, full_param.dtype, split_sizes, shapes)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        sizes = ctx.split_sizes
        parts = [
            torch.zeros(n, dtype=ctx.dtype, device=ctx.device) if g is None else g.reshape(-1).to(ctx.dtype)
            for g, n in zip(grads, sizes)
        ]
        parts.append(torch.zeros(sizes[-1], dtype=ctx.dtype, device=ctx.device))  # the padding tail
        return torch.cat(parts), None, None, None
