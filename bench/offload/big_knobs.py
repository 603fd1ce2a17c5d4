"""The offload benchmark's chunk-size diagnostics (``BIG_SPEC_CHUNK``, ``BIG_HOST_CHUNK``): each sets one module
constant of the host tier for the row's own process, checked, and returns the value in force for the row; and
``Skip``, what a row raises when it cannot run here."""

from __future__ import annotations


class Skip(Exception):
    """This implementation cannot run here (not installed, needs a GPU, no OffloadOptimizer): not an error."""


def set_spec_chunk(value: str | None) -> int | None:
    """``BIG_SPEC_CHUNK``: the speculative update's elements per chunk (``_speculative.SPEC_CHUNK_ELEMENTS``) for
    this row's process; returns the size in force (None: a shardfuse without the constant, and none asked)."""
    try:
        from shardfuse.sharding.host import _speculative
    except ImportError:
        _speculative = None  # type: ignore[assignment]
    has = _speculative is not None and hasattr(_speculative, "SPEC_CHUNK_ELEMENTS")
    if not value:
        return int(_speculative.SPEC_CHUNK_ELEMENTS) if has else None
    if not has:
        raise Skip(f"BIG_SPEC_CHUNK={value} needs _speculative.SPEC_CHUNK_ELEMENTS, not in this shardfuse")
    chunk = int(value)
    if chunk <= 0 or chunk % 4096:
        raise ValueError(f"BIG_SPEC_CHUNK={value}: the speculative update's chunk must be a positive multiple of "
                         f"4096 elements (so its values match the in-place update's); pick e.g. {1 << 20}")
    _speculative.SPEC_CHUNK_ELEMENTS = chunk
    return chunk


def set_host_chunk(value: str | None) -> int | None:
    """``BIG_HOST_CHUNK``: elements per chunk of the host update's cache-sized pass (``whole``: one kernel call per
    parameter); returns the value in force (None where this shardfuse has no such pass)."""
    from shardfuse.sharding.host import _host_fused

    if not hasattr(_host_fused, "CHUNK_ELEMENTS"):
        return None
    if value:
        chunk = 1 << 50 if value == "whole" else int(value)
        if chunk <= 0 or chunk % 4096:
            raise ValueError(f"BIG_HOST_CHUNK={value}: a positive multiple of 4096 elements (so the values match the "
                             f"whole-shard update) or 'whole'; pick e.g. {1 << 23}")
        _host_fused.CHUNK_ELEMENTS = chunk
    return int(_host_fused.CHUNK_ELEMENTS)


def set_host_tile(value: str | None) -> int:
    """``BIG_HOST_TILE``: elements per tile of the host update on the tile pool (``_host_fused.TILE_ELEMENTS``) for
    the ``-tl`` rows; returns the value in force."""
    from shardfuse.sharding.host import _host_fused

    if value:
        tile = int(value)
        if tile <= 0 or tile % 4096:
            raise ValueError(f"BIG_HOST_TILE={value}: a positive multiple of 4096 elements (so the values match the "
                             f"whole-shard update); pick e.g. {1 << 22}")
        _host_fused.TILE_ELEMENTS = tile
    return int(_host_fused.TILE_ELEMENTS)
