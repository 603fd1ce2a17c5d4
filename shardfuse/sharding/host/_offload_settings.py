"""The checks of ``OffloadOptimizer``'s settings, before anything is built: each error names the value, why it
cannot work and what to pass instead."""

from __future__ import annotations

from typing import Any

import torch


def check_settings(*, step_in_backward: bool, speculative_clip: bool, speculative_clip_gib: float | None,
                   speculative_backoff: int | None, keep_params_gib: float | None, host_threads: int | None,
                   clip_in_update: bool, gpu_update_share: float = 0.0) -> None:
    """Raise ``ValueError``/``TypeError`` for a setting ``OffloadOptimizer`` cannot run with."""
    _check_speculative(speculative_clip, speculative_clip_gib, step_in_backward, speculative_backoff)
    if isinstance(gpu_update_share, bool) or not isinstance(gpu_update_share, (int, float)) or not (
            0.0 <= gpu_update_share <= 1.0):
        raise ValueError(f"gpu_update_share must be the fraction (0 to 1) of the offloaded parameters whose update "
                         f"the GPU runs, got {gpu_update_share!r}: 0 keeps every update on the host; about half "
                         f"balanced a 16-core host with one H200 (docs/api.md, \"The GPU's share of the update\")")
    if gpu_update_share and speculative_clip:
        raise ValueError("gpu_update_share > 0 streams units' updates through the GPU, in place; speculative_clip=True "
                         "updates out of place into spare host buffers on the host: choose one")
    if keep_params_gib is not None and not keep_params_gib >= 0:
        raise ValueError(f"keep_params_gib must be >= 0 (GiB) or None (the room left on the device), got "
                         f"{keep_params_gib!r}")
    if host_threads is not None and not (isinstance(host_threads, int) and host_threads >= 1):
        raise ValueError(f"host_threads must be a positive int or None (the cores less one), got {host_threads!r}")
    if not isinstance(clip_in_update, bool):
        raise TypeError(f"clip_in_update must be True or False, got {clip_in_update!r}")
    if clip_in_update and step_in_backward:
        raise ValueError("clip_in_update=True sets how clipping scales the host shards' gradients, but "
                         "step_in_backward=True cannot clip (each update starts before the global norm is known): "
                         "drop one of the two")


def _check_speculative(speculative_clip: bool, gib: float | None, step_in_backward: bool,
                       backoff: int | None) -> None:
    if backoff is not None and not (isinstance(backoff, int) and not isinstance(backoff, bool) and backoff >= 1):
        raise ValueError(f"speculative_backoff must be a positive int (consecutive clipped steps before speculation "
                         f"pauses) or None (never pause), got {backoff!r}")
    if speculative_clip and step_in_backward:
        raise ValueError("speculative_clip=True starts each unit's update in backward itself (out of place, so it can "
                         "still clip); step_in_backward=True updates in place and cannot clip: choose one")
    if gib is not None and not gib >= 0:
        raise ValueError(f"speculative_clip_gib must be >= 0 (GiB) or None (every unit), got {gib!r}")


def check_arguments(unit: Any, optimizer: torch.optim.Optimizer, gpu_budget_gib: float | None,
                    per_element: tuple[type, ...]) -> None:
    """The model (its root unit ``unit``), the optimizer and the budget ``OffloadOptimizer`` was given."""
    if unit.parent is not None:
        raise ValueError(f"OffloadOptimizer needs the root (outermost) FullyShardedDataParallel, not the nested "
                         f"{unit.name}: pass the outermost wrapper")
    if not unit.config.offload.move_params_to_cpu:
        raise ValueError(f"OffloadOptimizer needs a model wrapped with move_params_to_cpu=True; {unit.name} keeps its "
                         f"parameters on {unit.compute_device}: wrap with move_params_to_cpu=True, or step the plain "
                         f"optimizer")
    if not isinstance(optimizer, per_element):  # an OffloadOptimizer too: it is none of them
        raise TypeError(
            f"OffloadOptimizer steps each unit's shard on its own, which equals one step of the whole model only for "
            f"per-element optimizers (torch.optim.Adam, AdamW, SGD); got {type(optimizer).__name__}: use one of "
            f"those, or step {type(optimizer).__name__} itself (no overlap)"
        )
    if gpu_budget_gib is not None and not gpu_budget_gib >= 0:
        raise ValueError(f"gpu_budget_gib must be >= 0 (GiB) or None, got {gpu_budget_gib!r}")
