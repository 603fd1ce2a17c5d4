"""The checks of ``OffloadOptimizer``'s settings, before anything is built: each error names the value, why it
cannot work and what to pass instead."""

from __future__ import annotations


def check_settings(*, step_in_backward: bool, speculative_clip: bool, speculative_clip_gib: float | None,
                   speculative_backoff: int | None, keep_params_gib: float | None, host_threads: int | None,
                   clip_in_update: bool) -> None:
    """Raise ``ValueError``/``TypeError`` for a setting ``OffloadOptimizer`` cannot run with."""
    _check_speculative(speculative_clip, speculative_clip_gib, step_in_backward, speculative_backoff)
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
