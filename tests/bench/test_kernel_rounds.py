"""bench.kernels.run times each case in interleaved rounds and keeps the median, so one slow timing moves nothing."""

from __future__ import annotations

import pytest

from bench.kernels.cases import KernelCase
from bench.kernels.run import interleaved_ms, run_case


def _case():
    return KernelCase(family="concat", name="x", numel=10, bytes_moved=10**9, shardfuse=lambda: "sf",
                      baselines={"torch.cat": lambda: "cat", "other": lambda: "other"})


def test_rounds_interleave_the_implementations():
    calls = []

    def timer(fn):
        calls.append(fn())
        return 1.0

    times = interleaved_ms({"a": lambda: "a", "b": lambda: "b"}, 3, timer)
    assert calls == ["a", "b"] * 3
    assert times == {"a": [1.0] * 3, "b": [1.0] * 3}
    with pytest.raises(ValueError, match="rounds must be at least 1, got 0"):
        interleaved_ms({"a": lambda: None}, 0, timer)


def test_row_is_the_median_of_its_rounds_with_the_spread():
    # shardfuse: one slow outlier in round 2; torch.cat: one fast outlier in round 1
    scripted = {"sf": [2.0, 9.0, 2.2], "cat": [0.5, 3.0, 3.2], "other": [4.0, 4.0, 4.0]}
    seen = {k: 0 for k in scripted}

    def timer(fn):
        key = fn()
        seen[key] += 1
        return scripted[key][seen[key] - 1]

    row = run_case(_case(), copy_gbps=1000.0, rounds=3, timer=timer)
    assert row["rounds"] == 3 and row["shardfuse_ms"] == 2.2 and row["shardfuse_ms_spread"] == [2.0, 9.0]
    cat = row["baselines"]["torch.cat"]
    assert cat["ms"] == 3.0 and cat["ms_spread"] == [0.5, 3.2] and cat["speedup"] == pytest.approx(3.0 / 2.2)
    assert row["baselines"]["other"]["speedup"] == pytest.approx(4.0 / 2.2)
    assert row["shardfuse_gbps"] == pytest.approx(10**9 / 2.2e-3 / 1e9)
