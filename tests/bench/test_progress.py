"""``bench._progress``: the progress lines of the long benchmark runs, on a fake clock."""

from __future__ import annotations

import pytest

from bench._progress import Progress, fmt_duration


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_time_left_scales_the_estimates_by_the_measured_pace():
    clock = Clock()
    p = Progress(3, [10.0, 20.0, 30.0], clock=clock)
    assert p.line("a") == "-- [1/3] a (elapsed 0 s, left ~1m00s)"  # nothing measured: the plan
    clock.t += 20.0  # the first took twice its estimate
    assert p.line("b") == "-- [2/3] b (elapsed 20 s, left ~1m40s)"  # (20 + 30) x 2
    clock.t += 20.0  # 40 s for 30 s planned
    assert p.line("c") == "-- [3/3] c (elapsed 40 s, left ~40 s)"  # 30 x 40 / 30


def test_without_estimates_the_mean_pace():
    clock = Clock()
    p = Progress(4, clock=clock)
    assert p.line("x").endswith("(elapsed 0 s, left ?)")
    clock.t += 90.0
    assert p.line("y") == "-- [2/4] y (elapsed 1m30s, left ~4m30s)"  # 3 left x 90 s


def test_formats_and_refusals():
    assert [fmt_duration(s) for s in (-3, 0.4, 59.4, 61, 3600 * 2 + 125)] == ["0 s", "0 s", "59 s", "1m01s", "2h02m"]
    with pytest.raises(ValueError, match="2 estimates for 3 measurements"):
        Progress(3, [1.0, 2.0])
