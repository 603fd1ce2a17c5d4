"""bench.offload.gpu_timeline: the GPU engines' busy times of a profiled step, from a Chrome trace."""

from __future__ import annotations

import random

import pytest

from bench.offload import gpu_timeline as gt


def ev(cat: str, name: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def brute_union_length(intervals: list[tuple[float, float]]) -> float:
    """Covered length by unit-step sampling (the reference for integer intervals)."""
    return float(len({t for a, b in intervals for t in range(int(a), int(b))}))


def test_union_and_intersection_match_a_brute_force_count_on_random_intervals() -> None:
    rng = random.Random(7)
    for _ in range(200):
        xs = [(a, a + rng.randint(0, 15)) for a in (rng.randint(0, 60) for _ in range(rng.randint(0, 9)))]
        ys = [(a, a + rng.randint(0, 15)) for a in (rng.randint(0, 60) for _ in range(rng.randint(0, 9)))]
        assert gt.length(xs) == brute_union_length(xs)
        both = {t for a, b in xs for t in range(a, b)} & {t for a, b in ys for t in range(a, b)}
        assert gt.length(gt.intersect(xs, ys)) == len(both)


def test_attribute_splits_the_window_by_engine_and_counts_overlaps_once() -> None:
    events = [
        ev("user_annotation", gt.WINDOW_NAME, 1000, 10_000),
        ev("gpu_user_annotation", gt.WINDOW_NAME, 1500, 20),  # the GPU mirror of the range: not the window
        ev("kernel", "gemm", 1000, 3000),  # compute 1000-4000
        ev("kernel", "gemm2", 2000, 3000),  # concurrent: 2000-5000, union 1000-5000
        ev("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 4000, 2000),  # 4000-6000: 1000 hidden under compute
        ev("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 7000, 1000),  # 7000-8000: exposed
        ev("gpu_memcpy", "Memcpy DtoD (Device -> Device)", 8500, 500),
        ev("kernel", "outside", 20_000, 1000),  # after the window: ignored
        ev("cpu_op", "aten::add", 1500, 100),  # not a GPU activity
    ]
    a = gt.attribute(events)
    assert a["window_ms"] == 10.0
    assert a["compute_ms"] == 4.0 and a["h2d_ms"] == 2.0 and a["d2h_ms"] == 1.0 and a["dtod_ms"] == 0.5
    assert a["gpu_any_ms"] == 6.5 and a["gpu_idle_ms"] == 3.5
    assert a["h2d_hidden_ms"] == 1.0 and a["d2h_hidden_ms"] == 0.0
    assert a["compute_only_ms"] == 3.0 and a["copy_only_ms"] == 2.0
    assert a["kernels"] == 2 and a["copies"] == 2
    assert "compute 4" in gt.table(a)


def test_attribute_without_the_window_range_says_how_to_get_one() -> None:
    with pytest.raises(ValueError, match="profiled_step"):
        gt.attribute([ev("kernel", "k", 0, 1)])


def test_profiled_step_records_the_window_and_writes_the_trace(tmp_path, monkeypatch) -> None:
    import gzip
    import json

    import torch

    monkeypatch.setenv("BIG_PROFILE_DIR", str(tmp_path))
    with gt.profiled_step(True, "cpu_probe") as attribution:
        torch.randn(256, 256) @ torch.randn(256, 256)
    a = attribution()
    assert a is not None and a["window_ms"] > 0 and a["gpu_idle_ms"] <= a["window_ms"]
    with gzip.open(tmp_path / "trace_cpu_probe.json.gz", "rt") as f:
        names = {e.get("name") for e in json.load(f)["traceEvents"]}
    assert gt.WINDOW_NAME in names
    with gt.profiled_step(False) as nothing:
        pass
    assert nothing() is None
