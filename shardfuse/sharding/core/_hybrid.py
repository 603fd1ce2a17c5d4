"""Hybrid sharding: shard over one group, replicate over another (FSDP1 ``HYBRID_SHARD``, FSDP2 on a 2-D mesh).

A unit's groups come from one of three spellings, checked here and turned into one :class:`Groups`:

- ``device_mesh=init_device_mesh(device_type, (replicas, shards), mesh_dim_names=("replicate", "shard"))``;
- ``sharding_strategy=ShardingStrategy.HYBRID_SHARD`` (or ``"hybrid_shard"``) with
  ``process_group=(shard_group, replicate_group)``;
- neither: flat sharding over ``process_group`` (``ShardingStrategy.FULL_SHARD``), as before.

The parameters are cut for the shard group only (``Groups.process_group``, ``rank``, ``world_size``), so
everything that gathers or writes back shards (state dicts, summoning, optimizer-state consolidation, the
norm of ``clip_grad_norm_``) works within the shard group unchanged; the replicate group adds one all-reduce
after each reduce-scatter (``_grad_reduce``).
"""

from __future__ import annotations

import enum
from typing import Any

import torch.distributed as dist

from shardfuse.sharding.core import _collectives as coll
from shardfuse.sharding.core._groups import Groups, resolve_groups

MESH_DIMS = ("replicate", "shard")


class ShardingStrategy(enum.Enum):
    """How a unit spreads its parameters (FSDP1's names; strings ``"full_shard"``/``"hybrid_shard"`` work too).

    ``FULL_SHARD``: shard over ``process_group`` (the default). ``HYBRID_SHARD``: shard over the first group of
    ``process_group=(shard_group, replicate_group)`` and replicate over the second, or pass ``device_mesh``.
    """

    FULL_SHARD = "full_shard"
    HYBRID_SHARD = "hybrid_shard"


def parse_strategy(value: Any) -> ShardingStrategy | None:
    """``value`` as a :class:`ShardingStrategy` (None stays None: decided by the other arguments)."""
    if value is None or isinstance(value, ShardingStrategy):
        return value
    names = [s.value for s in ShardingStrategy]
    if isinstance(value, str) and value.lower() in names:
        return ShardingStrategy(value.lower())
    raise ValueError(
        f"sharding_strategy={value!r} is not supported: pass ShardingStrategy.FULL_SHARD or HYBRID_SHARD (or one of "
        f"the strings {names}); FSDP1's SHARD_GRAD_OP / NO_SHARD have no shardfuse equivalent (use "
        f"reshard_after_forward=False for the former)"
    )


def resolve(process_group: Any, reduce_scatter_group: Any, device_mesh: Any, sharding_strategy: Any) -> Groups:
    """The unit's :class:`Groups` from the wrapper's arguments, or an error naming the fix."""
    strategy = parse_strategy(sharding_strategy)
    if device_mesh is not None:
        if process_group is not None or reduce_scatter_group is not None:
            raise ValueError(
                "pass either device_mesh or process_group (and process_group_reduce_scatter), not both: the mesh "
                "already names the shard and replicate groups"
            )
        return _from_mesh(device_mesh, strategy)
    if strategy is ShardingStrategy.HYBRID_SHARD:
        if not (isinstance(process_group, (tuple, list)) and len(process_group) == 2):
            raise ValueError(
                f"sharding_strategy=HYBRID_SHARD needs two groups, got process_group={process_group!r}: pass "
                f"process_group=(shard_group, replicate_group), or device_mesh=init_device_mesh(device_type, "
                f"(replicas, shards), mesh_dim_names={MESH_DIMS})"
            )
        if reduce_scatter_group is not None:
            raise ValueError("process_group_reduce_scatter is not supported with HYBRID_SHARD: drop it")
        return _hybrid(process_group[0], process_group[1], None)
    if isinstance(process_group, (tuple, list)):
        raise ValueError(
            f"process_group is a pair of {len(process_group)} groups but sharding_strategy={strategy}: pass "
            f"sharding_strategy=ShardingStrategy.HYBRID_SHARD with process_group=(shard_group, replicate_group)"
        )
    return resolve_groups(process_group, reduce_scatter_group)


def _from_mesh(mesh: Any, strategy: ShardingStrategy | None) -> Groups:
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if getattr(mesh, "ndim", None) != 2 or names != MESH_DIMS:
        raise ValueError(
            f"device_mesh must be 2-D with mesh_dim_names={MESH_DIMS}, got ndim={getattr(mesh, 'ndim', None)} "
            f"mesh_dim_names={names or None}: build it with init_device_mesh(device_type, (replicas, shards), "
            f"mesh_dim_names={MESH_DIMS}) ((1, N) is flat sharding over N ranks)"
        )
    world = coll.world_size(coll.default_group())
    if mesh.size() != world:
        raise ValueError(
            f"device_mesh has {mesh.size()} ranks (shape {tuple(mesh.shape)}) but the job has world_size={world}: "
            f"every rank must be in the mesh; use a shape whose product is {world}"
        )
    if strategy is ShardingStrategy.FULL_SHARD and mesh.shape[0] > 1:
        raise ValueError(
            f"sharding_strategy=FULL_SHARD with a device_mesh of shape {tuple(mesh.shape)} that replicates: drop "
            f"sharding_strategy (a 2-D mesh means hybrid sharding) or pass a mesh of shape (1, {world})"
        )
    return _hybrid(mesh.get_group("shard"), mesh.get_group("replicate"), mesh)


def _hybrid(shard_group: Any, replicate_group: Any, mesh: Any) -> Groups:
    groups = Groups(shard_group, shard_group, coll.rank(shard_group), coll.world_size(shard_group), replicate_group,
                    mesh)
    world = coll.world_size(coll.default_group())
    if groups.total_world != world:
        raise ValueError(
            f"HYBRID_SHARD groups cover {groups.world_size} shards x {groups.replicate_size} replicas = "
            f"{groups.total_world} ranks but the job has world_size={world}: pass process_group=(shard_group, "
            f"replicate_group) of sizes S and R with S * R == {world}, each rank in one of each"
        )
    return groups


def layout(groups: Groups) -> tuple[Any, ...]:
    """What must be the same for every unit of one tree: the ranks of the replicate group (and of the shard group,
    under hybrid sharding); flat units in groups of their own (experts) may differ in the shard group."""
    if groups.replicate_group is None:
        return ("flat",)
    return (_ranks(groups.process_group), _ranks(groups.replicate_group))


def _ranks(group: Any) -> tuple[int, ...]:
    if coll.is_process_group(group):
        return tuple(dist.get_process_group_ranks(group))
    return (coll.world_size(group),)


def check_one_mesh(names: list[str], layouts: list[tuple[Any, ...]]) -> None:
    """Every unit of a tree must shard and replicate over the same groups (``layouts``: :func:`layout` of each)."""
    for name, got in zip(names[1:], layouts[1:]):
        if got != layouts[0]:
            raise ValueError(
                f"nested units are on different meshes: {names[0]} has (shard ranks, replicate ranks) "
                f"{layouts[0]} but {name} has {got}: wrap every unit of the model with the same device_mesh (or "
                f"the same HYBRID_SHARD groups), e.g. pass device_mesh=mesh to each FullyShardedDataParallel"
            )


def refuse(groups: Groups, what: str, instead: str) -> None:
    """Raise ``NotImplementedError`` for ``what`` on a hybrid-sharded unit (not supported yet)."""
    if groups.hybrid:
        raise NotImplementedError(f"{what} is not supported with hybrid sharding (a 2-D mesh) yet: {instead}")
