"""A unit's process groups, in one object: the shard group, the reduce-scatter group, hybrid sharding's replicate
group and this process's place in them.

:class:`Groups` is the one copy: the unit, its flat-parameter handles and its gradient reduction hold the same
object, so a change (``set_groups``, after unpickling) reaches all of them. :func:`resolve_groups` checks the
groups a user passes; pickling drops them (FairScale's ``"MISSING"`` convention) until they are set again.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from shardfuse.sharding.core import _collectives as coll

MISSING_GROUP = "MISSING"
# Pickled in place of a reduce-scatter group the user did not give: after unpickling it follows the process group
# set again (and the root may give it a separate group once more, at its first forward).
FOLLOWS_GROUP = "FOLLOWS_PROCESS_GROUP"
# ``process_group_reduce_scatter`` by name, FairScale's ``ProcessGroupName`` values (a str Enum): "default" = the
# process group itself (also what None gives); "reduce_scatter" = a separate group of the same ranks.
SAME_NAME, SEPARATE_NAME = "default", "reduce_scatter"
# Either name, read at wrap time where the argument is None (the default): the choice for a whole process.
REDUCE_SCATTER_GROUP_ENV = "SHARDFUSE_REDUCE_SCATTER_GROUP"


class ReduceScatterGroup:
    """Where a unit's reduce-scatter group comes from (``Groups.reduce_scatter_source``)."""

    GIVEN = "given"  # the user's group
    SAME = "same"  # the process group ("default")
    SEPARATE = "separate"  # a separate group of the same ranks, made by the root ("reduce_scatter")


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
    reduce_scatter_source: str = ReduceScatterGroup.GIVEN  # units pickled before it existed kept what they had

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
            follows = self.reduce_scatter_source != ReduceScatterGroup.GIVEN
            if follows and self.reduce_scatter_group in (FOLLOWS_GROUP, self.process_group):
                self.reduce_scatter_group = process_group
            self.process_group = process_group
            self.dcp_meshes = None
        if reduce_scatter_group is not None:
            self.reduce_scatter_group = reduce_scatter_group
            self.reduce_scatter_source = ReduceScatterGroup.GIVEN

    def wants_separate_reduce_scatter(self) -> bool:
        """The root should give this unit a reduce-scatter group of its own: asked for (``"reduce_scatter"``), not
        yet made, and possible: flat sharding on a real group of every rank (a group is made by all ranks at once;
        they agree on the groups of every unit, in order, at the root's first forward)."""
        if self.reduce_scatter_source != ReduceScatterGroup.SEPARATE:
            return False
        if self.reduce_scatter_group is not self.process_group or self.hybrid or self.world_size == 1:
            return False
        return coll.spans_world(self.process_group)

    @property
    def missing(self) -> bool:
        """Pickling dropped the groups and the user has not set them again."""
        return MISSING_GROUP in (self.process_group, self.reduce_scatter_group) or (
            self.reduce_scatter_group == FOLLOWS_GROUP)

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
        given = self.reduce_scatter_source == ReduceScatterGroup.GIVEN
        return {**self.__dict__, "process_group": MISSING_GROUP, "dcp_meshes": None,
                "reduce_scatter_group": MISSING_GROUP if given else FOLLOWS_GROUP}


def resolve_groups(process_group: Any | None, process_group_reduce_scatter: Any | None) -> Groups:
    """The unit's groups (default: the world group); the reduce-scatter group must hold the same ranks."""
    group = coll.default_group() if process_group is None else process_group
    rank, world = coll.rank(group), coll.world_size(group)
    if isinstance(process_group_reduce_scatter, str) or process_group_reduce_scatter is None:
        groups = Groups(group, group, rank, world)
        groups.reduce_scatter_source = _source_of(process_group_reduce_scatter)
        if process_group_reduce_scatter is None and os.environ.get(REDUCE_SCATTER_GROUP_ENV):
            groups.reduce_scatter_source = _source_of(os.environ[REDUCE_SCATTER_GROUP_ENV], REDUCE_SCATTER_GROUP_ENV)
        return groups
    rs_size, rs_rank = coll.world_size(process_group_reduce_scatter), coll.rank(process_group_reduce_scatter)
    if (rs_size, rs_rank) != (world, rank):
        raise ValueError(
            f"process_group_reduce_scatter must hold the same ranks as process_group: got "
            f"size={rs_size} rank={rs_rank} vs size={world} rank={rank}"
        )
    return Groups(group, process_group_reduce_scatter, rank, world)


def _source_of(name: str | None, where: str = "process_group_reduce_scatter") -> str:
    if name is None:
        return ReduceScatterGroup.SAME
    value = str(getattr(name, "value", name))  # FairScale's ProcessGroupName members are str Enum members
    if value == SAME_NAME:
        return ReduceScatterGroup.SAME
    if value == SEPARATE_NAME:
        return ReduceScatterGroup.SEPARATE
    choices = "" if where == REDUCE_SCATTER_GROUP_ENV else "a ProcessGroup with the same ranks, None (the process " \
        "group, or what SHARDFUSE_REDUCE_SCATTER_GROUP names), "
    raise ValueError(
        f"{where}={name!r}: pass {choices}{SEPARATE_NAME!r} (a separate group on any backend) or {SAME_NAME!r} (the "
        f"process group itself: no second communicator)"
    )


def give_separate_reduce_scatter_groups(groups: list[Groups]) -> int:
    """At the root's first forward: every unit that asked for one (:meth:`Groups.wants_separate_reduce_scatter`)
    gets a reduce-scatter group of its own, one per process group shared by all of them: under NCCL its
    reduce-scatters then run on another stream than the all-gathers instead of queueing in front of the next
    unit's gather (FairScale's default; shardfuse's default keeps one group: see docs/api.md). Collective over
    every rank; returns how many groups it made."""
    made: dict[int, Any] = {}
    for g in groups:
        if g.wants_separate_reduce_scatter():
            key = id(g.process_group)
            if key not in made:
                made[key] = coll.new_group_like(g.process_group)
            g.reduce_scatter_group = made[key]
    return len(made)


def check_sync_module_states(groups: Groups) -> None:
    """``sync_module_states`` broadcasts, so it needs a real process group."""
    if not coll.is_process_group(groups.process_group):
        raise ValueError(
            "sync_module_states=True needs a torch.distributed process group to broadcast with, got "
            f"{type(groups.process_group).__name__}: pass a real group, or drop sync_module_states"
        )
