"""One all-gather for a unit's float8 and compute-dtype flat parameters (docs/design.md, "Float8 all-gather").

A unit holding float8 weights and other parameters has two flat parameters: the float8 one gathers uint8 bytes,
the other its compute-dtype buffer. Gathered apart, that is two collectives per gather. Here each rank lays its
slices side by side in one uint8 buffer (each part at a 16-byte boundary, so it can be viewed in its dtype), one
all-gather moves it, and each part is copied back, rank by rank, into its own full buffer (the float8 bytes, the
compute-dtype full buffer), as FSDP2's copy-in/copy-out all-gather of several parameters. The bytes are those of
the separate gathers, and each full buffer lives as long as before; the joint buffer lives only during the copy.
"""

from __future__ import annotations

import torch

from shardfuse._profiling import profiled
from shardfuse._streams import Streams, record_event, use_stream, wait_stream
from shardfuse.sharding.core import _collectives as coll
from shardfuse.sharding.core._flat_param import FlatParamHandle

__all__ = ["gather_jointly"]

_ALIGN = 16  # each part's offset in a rank's slice: any dtype view, and the kernels' vector loads, stay aligned


def gather_jointly(handles: list[FlatParamHandle], streams: Streams) -> list[FlatParamHandle]:
    """Issue one all-gather for those of ``handles`` that need a gather on the compute device, when they mix
    float8 and compute-dtype flat parameters of one process group; returns the handles left to gather alone."""
    joint = [h for h in handles if h.needs_gather() and h.gathers_on_device()]
    if {h.gathers_float8() for h in joint} != {True, False} or any(h.group is not joint[0].group for h in joint):
        return handles
    _gather(joint, streams)
    return [h for h in handles if not any(h is j for j in joint)]


def _gather(handles: list[FlatParamHandle], streams: Streams) -> None:
    first = handles[0]
    rank, world = first.rank, first.world_size
    sizes = [h.shard_numel * h.wire_itemsize for h in handles]
    offsets, slice_bytes = [], 0
    for n in sizes:
        offsets.append(slice_bytes)
        slice_bytes += -(-n // _ALIGN) * _ALIGN
    ag = streams.all_gather
    with profiled("shardfuse.sharding:all_gather"):
        # The all-gather stream waits for the compute queued so far (the optimizer's writes to the shards), as
        # FlatParamHandle.unshard does.
        wait_stream(ag, streams.current())
        with use_stream(ag):
            wire = torch.empty(world * slice_bytes, dtype=torch.uint8, device=first.flat.device)
            local = wire.narrow(0, rank * slice_bytes, slice_bytes)
            for h, offset, n in zip(handles, offsets, sizes):
                h.cast_local(local.narrow(0, offset, n))
            coll.all_gather_into(wire, local, first.group, world)
            rows = wire.view(world, slice_bytes)
            for h, offset, n in zip(handles, offsets, sizes):
                h.gathered_bytes().view(world, n).copy_(rows[:, offset:offset + n])
            event = record_event(ag)
    for h in handles:
        h.mark_full(event)
