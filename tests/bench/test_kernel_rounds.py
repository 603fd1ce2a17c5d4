"""bench.kernels.run times each case in interleaved rounds and keeps the median, so one slow timing moves nothing."""

from __future__ import annotations

import statistics

import pytest
import torch

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


def test_row_is_the_median_of_its_rounds_with_the_spread(monkeypatch):
    from bench.kernels import run

    monkeypatch.setattr(run, "NOISY_SPREAD", float("inf"))  # three rounds only: the test of rounds that disagree below
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


def test_a_forced_path_is_forced_once_around_its_timing_not_in_each_timed_call():
    import types

    from bench.kernels.cases import forced_path
    from shardfuse.kernels import _crossover

    knob = types.SimpleNamespace(LIMIT=7)
    seen = []

    def body():
        seen.append((knob.LIMIT, _crossover.crossover("concat", torch.device("cpu")) == _crossover.NEVER))
        return "forced"

    path = forced_path("torch", ["concat"], body, (knob, "LIMIT", 1))
    timed = []

    def timer(fn):
        timed.append(fn)
        for _ in range(3):
            fn()
        return 1.0

    times = interleaved_ms({"a": lambda: None, "forced": path}, 2, timer)
    assert times["forced"] == [1.0, 1.0]
    assert timed[1] is body and timed[3] is body  # the bare function: no forcing inside the timed calls
    assert seen == [(1, True)] * 6  # ... and the path was forced around them
    assert knob.LIMIT == 7 and _crossover.crossover("concat", torch.device("cpu")) == _crossover.ALWAYS
    assert path() == "forced" and seen[-1] == (1, True) and knob.LIMIT == 7  # a plain call forces itself


@pytest.mark.parametrize(("ms", "rounds", "want"), [(0.005, 3, 7), (0.005, 1, 1), (0.05, 3, 3), (0.005, 9, 9)])
def test_rows_at_the_timers_floor_get_more_rounds(ms: float, rounds: int, want: int):
    """Every timing under FLOOR_MS: FLOOR_ROUNDS rounds in all, both sides alike (a one-round run stays one)."""
    from bench.kernels import run

    calls = []

    def timer(fn):
        calls.append(fn())
        return ms + 0.001 * (len(calls) % 3)

    row = run_case(_case(), copy_gbps=1000.0, rounds=rounds, timer=timer)
    assert run.FLOOR_ROUNDS == 7 and row["rounds"] == want
    assert calls == ["sf", "cat", "other"] * want
    assert row["shardfuse_ms"] == pytest.approx(statistics.median(
        ms + 0.001 * ((3 * i + 1) % 3) for i in range(want)))


@pytest.mark.parametrize(("spreads", "want"), [((1.0, 1.0, 1.0), 3), ((1.0, 1.3, 1.0), 9), ((1.0, 1.0, 1.19), 3)])
def test_rows_whose_rounds_disagree_get_more_rounds(spreads, want):
    """An implementation whose slowest round is over NOISY_SPREAD x its fastest: NOISY_ROUNDS rounds, all sides."""
    from bench.kernels import run

    base = {"sf": 0.1, "cat": 0.2, "other": 0.3}
    # the first round at base, the second with the spread applied, the third at base
    script = {key: [base[key], base[key] * s, base[key]] for key, s in zip(("sf", "cat", "other"), spreads)}
    seen = {k: 0 for k in script}

    def scripted(fn):
        key = fn()
        seen[key] += 1
        return script[key][seen[key] - 1] if seen[key] <= 3 else base[key]

    row = run_case(_case(), copy_gbps=1000.0, rounds=3, timer=scripted)
    assert run.NOISY_ROUNDS == 9 and row["rounds"] == want and seen == dict.fromkeys(script, want)
    assert row["shardfuse_ms"] == pytest.approx(0.1)  # the median: the noisy round does not move it
