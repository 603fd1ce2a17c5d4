"""FairScale's keyword arguments, validated once into a frozen :class:`ShardingConfig`.

Every rule about which combinations are legal lives here, with an error that names the fix; the runtime reads
the result and never re-checks it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from shardfuse._logging import warn_once
from shardfuse.sharding import _collectives as coll
from shardfuse.sharding import _data_path as dp

logger = logging.getLogger(__name__)

_COMPUTE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class ShardingConfig:
    """How one unit shards, gathers and reduces (see ``FullyShardedDataParallel`` for each field)."""

    reshard_after_forward: bool
    disable_reshard_on_root: bool
    mixed_precision: bool
    fp32_reduce_scatter: bool
    move_params_to_cpu: bool
    move_grads_to_cpu: bool
    compute_dtype: torch.dtype | None  # without mixed_precision: None, or the parameters' own dtype
    buffer_dtype: torch.dtype | None
    bucket_cap_mb: int
    compute_device: torch.device | None  # as given; the runtime resolves the default at lazy init
    no_broadcast_optim_state: bool
    state_dict_device: torch.device | None
    clear_autocast_cache: bool
    force_input_to_fp32: bool
    verbose: bool
    state_dict_on_rank_0_only: bool
    gradient_predivide_factor: float
    gradient_postdivide_factor: float
    allow_reset_parameters: bool
    sync_module_states: bool = False
    flatten_parameters: bool = True
    # The original parameters are registered as views of the flat shard (communication stays flat): per-parameter
    # names, optimizer groups and freezing. FSDP1's use_orig_params=True; FairScale's flatten_parameters=False.
    use_orig_params: bool = False


@dataclass(frozen=True)
class Groups:
    """The process groups of one unit, with this process's place in them."""

    process_group: coll.ProcessGroup
    reduce_scatter_group: coll.ProcessGroup
    rank: int
    world_size: int


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


def make_config(
    world_size: int,
    *,
    reshard_after_forward: bool,
    disable_reshard_on_root: bool,
    mixed_precision: bool,
    fp32_reduce_scatter: bool,
    flatten_parameters: bool,
    move_params_to_cpu: bool,
    compute_dtype: torch.dtype | None,
    buffer_dtype: torch.dtype | None,
    move_grads_to_cpu: bool | None,
    bucket_cap_mb: int,
    compute_device: torch.device | str | None,
    no_broadcast_optim_state: bool | None,
    state_dict_device: torch.device | str | None,
    clear_autocast_cache: bool,
    force_input_to_fp32: bool,
    verbose: bool,
    cpu_offload: bool,
    state_dict_on_rank_0_only: bool,
    gradient_predivide_factor: float | None,
    allow_reset_parameters: bool,
    sync_module_states: bool = False,
    use_orig_params: bool = False,
) -> ShardingConfig:
    """Validate FairScale's keyword arguments for a unit of ``world_size`` ranks into a :class:`ShardingConfig`."""
    move_params_to_cpu = bool(move_params_to_cpu or cpu_offload)
    if cpu_offload:
        warn_once(logger, "cpu_offload is deprecated (as in FairScale); use move_params_to_cpu=True")
    if move_grads_to_cpu is None:
        move_grads_to_cpu = move_params_to_cpu
    if move_grads_to_cpu and not move_params_to_cpu:
        raise ValueError(
            "move_grads_to_cpu=True needs move_params_to_cpu=True (the sharded gradient lives beside its "
            "shard): pass move_params_to_cpu=True or drop move_grads_to_cpu"
        )
    if move_params_to_cpu and not move_grads_to_cpu:
        raise NotImplementedError(
            "move_params_to_cpu=True with move_grads_to_cpu=False is not supported (the optimizer would "
            "see CPU parameters with GPU gradients): leave move_grads_to_cpu=None or True"
        )
    if mixed_precision:
        compute_dtype = torch.float16 if compute_dtype is None else compute_dtype
        if compute_dtype not in _COMPUTE_DTYPES:
            raise ValueError(f"compute_dtype={compute_dtype} is not supported: use torch.float16 or torch.bfloat16")
    else:
        # Without mixed_precision every group computes in its own dtype; a compute_dtype must name that dtype
        # (pure fp16: model.half(), compute_dtype=torch.float16), which the wrapper checks once it sees them.
        if compute_dtype is not None and compute_dtype not in _COMPUTE_DTYPES:
            raise ValueError(f"compute_dtype={compute_dtype} is not supported: use torch.float16, bfloat16 or float32")
        if fp32_reduce_scatter:
            raise ValueError(
                "fp32_reduce_scatter=True only applies with mixed_precision=True (full precision already "
                "reduces in fp32): pass mixed_precision=True or drop fp32_reduce_scatter"
            )
    if gradient_predivide_factor is None:
        predivide, postdivide = dp.gradient_divide_factors(world_size)
    else:
        if isinstance(gradient_predivide_factor, bool) or not isinstance(gradient_predivide_factor, (int, float)):
            raise TypeError(
                f"gradient_predivide_factor must be a number, got {gradient_predivide_factor!r} "
                f"({type(gradient_predivide_factor).__name__}): pass e.g. 2.0, or None for FairScale's default"
            )
        if not gradient_predivide_factor > 0:
            raise ValueError(f"gradient_predivide_factor must be > 0, got {gradient_predivide_factor=}")
        predivide = float(gradient_predivide_factor)
        postdivide = world_size / predivide
    if bucket_cap_mb != 25:
        logger.info("bucket_cap_mb=%s has no effect: each unit reduces its flat gradient in one reduce-scatter",
                    bucket_cap_mb)
    if no_broadcast_optim_state and world_size > 1:
        raise NotImplementedError(
            f"no_broadcast_optim_state=True is only supported for unsharded units (process group of size "
            f"1, e.g. mixture-of-experts experts); this unit's group has world_size={world_size}"
        )
    return ShardingConfig(
        reshard_after_forward=reshard_after_forward,
        disable_reshard_on_root=disable_reshard_on_root,
        mixed_precision=mixed_precision,
        fp32_reduce_scatter=fp32_reduce_scatter,
        move_params_to_cpu=move_params_to_cpu,
        move_grads_to_cpu=move_grads_to_cpu,
        compute_dtype=compute_dtype,
        buffer_dtype=buffer_dtype if buffer_dtype is not None else compute_dtype,
        bucket_cap_mb=bucket_cap_mb,
        compute_device=torch.device(compute_device) if compute_device is not None else None,
        no_broadcast_optim_state=bool(no_broadcast_optim_state),
        state_dict_device=torch.device(state_dict_device) if state_dict_device is not None else None,
        clear_autocast_cache=clear_autocast_cache,
        force_input_to_fp32=force_input_to_fp32,
        verbose=verbose,
        state_dict_on_rank_0_only=state_dict_on_rank_0_only,
        gradient_predivide_factor=predivide,
        gradient_postdivide_factor=postdivide,
        allow_reset_parameters=allow_reset_parameters,
        sync_module_states=bool(sync_module_states),
        flatten_parameters=bool(flatten_parameters),
        use_orig_params=bool(use_orig_params) or not flatten_parameters,
    )
