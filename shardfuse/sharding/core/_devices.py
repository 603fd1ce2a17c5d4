"""Devices: where a unit keeps its shards and where it computes, chosen here only.

The wrapper asks :func:`param_device` where the module's parameters are, :func:`shard_device` where the shards go
(the host with ``move_params_to_cpu``, the GPU under NCCL for a module left on the CPU, else in place), and, at lazy
init, :func:`compute_device`; the runtime reads the answers and never chooses again.
"""

from __future__ import annotations

import torch

from shardfuse.sharding.core._config import ShardingConfig
from shardfuse.sharding.core._groups import Groups


def param_device(module_name: str, placed: dict[str, torch.device]) -> torch.device | None:
    """The one device of a unit's own parameters (``placed``: name -> device), or None without parameters."""
    devices = set(placed.values())
    if len(devices) > 1:
        where = sorted(f"{n}: {d}" for n, d in placed.items())[:8]
        raise ValueError(
            f"parameters of {module_name} are on several devices ({sorted(map(str, devices))}, e.g. {where}): move "
            f"the module to one device before wrapping"
        )
    return next(iter(devices)) if devices else None


def _default_gpu(groups: Groups) -> torch.device | None:
    return groups.device if groups.device.type == "cuda" else None


def shard_device(config: ShardingConfig, groups: Groups, found: torch.device | None) -> torch.device:
    """Where a unit keeps its shards, for parameters ``found`` on a device (None: meta-built or none yet).

    With ``move_params_to_cpu`` the host; under NCCL, parameters left on the CPU go to the compute device (the
    current GPU by default), as FairScale moves such modules; else where the parameters are.
    """
    requested = config.compute_device
    if config.offload.move_params_to_cpu:
        return torch.device("cpu")
    gpu = _default_gpu(groups)
    if found is None:  # nothing placed yet (a meta-built module gets its storage here)
        return requested or gpu or torch.device("cpu")
    if requested is not None and gpu is None and requested.type != found.type:
        raise ValueError(
            f"compute_device={requested} differs from the parameters' device {found}: move the module to "
            f"{requested} before wrapping, or pass move_params_to_cpu=True"
        )
    if gpu is not None and found.type == "cpu":
        return requested or gpu
    return found


def compute_device(config: ShardingConfig, shards: torch.device | None, fallback: torch.device | None) -> torch.device:
    """Where a unit computes (settled at lazy init): beside its shards, or with ``move_params_to_cpu`` on the
    requested (default: the current) GPU; a unit without parameters computes where ``fallback`` (its buffers or
    nested parameters) is."""
    if config.offload.move_params_to_cpu:
        if config.compute_device is not None:
            return config.compute_device
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if shards is not None:
        return shards
    return config.compute_device or fallback or torch.device("cpu")
