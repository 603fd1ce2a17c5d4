"""A unit's process groups, in one object: the shard group, the reduce-scatter group, hybrid sharding's replicate
group and this process's place in them.

:class:`Groups` is the one copy: the unit, its flat-parameter handles and its gradient reduction hold the same
object, so a change (``set_groups``, after unpickling) reaches all of them. :func:`resolve_groups` checks the
groups a user passes; pickling drops them (FairScale's ``"MISSING"`` convention) until they are set again.
"""

from __future__ import annotations

from typing import Any

import torch

from shardfuse.sharding.core import _collectives as coll

MISSING_GROUP = "MISSING"


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


def check_sync_module_states(groups: Groups) -> None:
    """``sync_module_states`` broadcasts, so it needs a real process group."""
    if not coll.is_process_group(groups.process_group):
        raise ValueError(
            "sync_module_states=True needs a torch.distributed process group to broadcast with, got "
            f"{type(groups.process_group).__name__}: pass a real group, or drop sync_module_states"
        )
