"""bench.kernels.run times each case in rounds and keeps the median, so one slow timing moves nothing; within a
round (bench.kernels.timing.paired_round) the implementations alternate call by call."""

from __future__ import annotations

import statistics
import types

import pytest
import torch

from bench.kernels.cases import KernelCase, forced_path
from bench.kernels.run import interleaved_ms, run_case
from bench.kernels.timing import paired_round
from shardfuse.kernels import _crossover


def _case():
    return KernelCase(family="concat", name="x", numel=10, bytes_moved=10**9, shardfuse=lambda: "sf",
                      baselines={"torch.cat": lambda: "cat", "other": lambda: "other"})


def _round_timer(script):
    """A round timer whose round k gives each label ``script[label](k)``, calling every function once."""
    rounds = []

    def timer(fns):
        rounds.append([fn() for fn in fns.values()])
        return {label: script[label](len(rounds) - 1) for label in fns}

    return timer, rounds


def test_rounds_time_every_implementation_each_round():
    timer, rounds = _round_timer({"a": lambda k: 1.0 + k, "b": lambda k: 2.0})
    times = interleaved_ms({"a": lambda: "a", "b": lambda: "b"}, 3, timer)
    assert rounds == [["a", "b"]] * 3
    assert times == {"a": [1.0, 2.0, 3.0], "b": [2.0] * 3}
    with pytest.raises(ValueError, match="rounds must be at least 1, got 0"):
        interleaved_ms({"a": lambda: None}, 0, timer)


def test_row_is_the_median_of_its_rounds_with_the_spread():
    # shardfuse: one slow outlier in round 2; torch.cat: one fast outlier in round 1
    scripted = {"\0shardfuse": [2.0, 9.0, 2.2], "torch.cat": [0.5, 3.0, 3.2], "other": [4.0, 4.0, 4.0]}
    timer, _ = _round_timer({k: v.__getitem__ for k, v in scripted.items()})
    row = run_case(_case(), copy_gbps=1000.0, rounds=3, timer=timer)
    assert row["rounds"] == 3 and row["shardfuse_ms"] == 2.2 and row["shardfuse_ms_spread"] == [2.0, 9.0]
    cat = row["baselines"]["torch.cat"]
    assert cat["ms"] == 3.0 and cat["ms_spread"] == [0.5, 3.2] and cat["speedup"] == pytest.approx(3.0 / 2.2)
    assert row["baselines"]["other"]["speedup"] == pytest.approx(4.0 / 2.2)
    assert row["shardfuse_gbps"] == pytest.approx(10**9 / 2.2e-3 / 1e9)


@pytest.mark.parametrize(("ms", "rounds", "want"), [(0.005, 3, 7), (0.005, 1, 1), (0.05, 3, 3), (0.005, 9, 9)])
def test_rows_at_the_timers_floor_get_more_rounds(ms: float, rounds: int, want: int):
    """Every timing under FLOOR_MS: FLOOR_ROUNDS rounds in all, both sides alike (a one-round run stays one)."""
    from bench.kernels import run

    timer, seen = _round_timer({"\0shardfuse": lambda k: ms + 0.001 * (k % 3), "torch.cat": lambda k: ms,
                                "other": lambda k: ms})
    row = run_case(_case(), copy_gbps=1000.0, rounds=rounds, timer=timer)
    assert run.FLOOR_ROUNDS == 7 and row["rounds"] == want
    assert seen == [["sf", "cat", "other"]] * want
    assert row["shardfuse_ms"] == pytest.approx(statistics.median(ms + 0.001 * (k % 3) for k in range(want)))


class _FakeClock:
    """A stream in a list: flushes, marks (at the fake time) and calls, in the order the host issued them."""

    def __init__(self):
        self.now = 0.0
        self.log: list[tuple] = []

    def flush(self):
        self.log.append(("flush",))

    def mark(self):
        self.log.append(("mark", self.now))
        return self.now

    def elapsed_ms(self, start, end):
        return end - start

    def synchronize(self):
        pass


def test_a_round_alternates_the_calls_rotating_and_takes_each_median():
    clock = _FakeClock()
    # a: 5 ms in the first cycle and the 5 that estimate one, 3 in the warm-up one, then 1, 9, 1, 1, 1 timed
    costs = {"a": iter([5.0] * 6 + [3.0] + [1.0, 9.0, 1.0, 1.0, 1.0]), "b": iter([2.0] * 12)}

    def fn(label):
        def call():
            clock.now += next(costs[label])
            clock.log.append(("call", label))
        return call

    got = paired_round({"a": fn("a"), "b": fn("b")}, clock, warmup_ms=0.0, rep_ms=17.5, max_calls=50)
    # a cycle is estimated at 5 + 2 ms: at least 1 warm-up cycle, 17.5 ms x 2 implementations / 7 ms -> 5 timed
    calls = [e[1] for e in clock.log if e[0] == "call"]
    assert len(calls) == 2 * (1 + 5 + 1 + 5)
    timed = calls[2 * 7:]  # after the first cycle, the 5 estimating one and the warm-up one
    assert timed == ["a", "b", "b", "a", "a", "b", "b", "a", "a", "b"]  # rotating: neither always goes first
    assert got == {"a": 1.0, "b": 2.0}  # medians of [1, 9, 1, 1, 1] and of five 2s
    kinds = [e[0] for e in clock.log]
    timed_calls = [i for i, k in enumerate(kinds) if k == "call" and kinds[i - 1] == "mark"]
    assert len(timed_calls) == 10  # each after its own flush, alone between two marks
    assert all(kinds[i - 2:i + 2] == ["flush", "mark", "call", "mark"] for i in timed_calls)
    assert all(kinds[i - 1] == "flush" for i, k in enumerate(kinds) if k == "call" and i not in timed_calls)
    with pytest.raises(ValueError, match="at least one function"):
        paired_round({}, clock)


def test_a_forced_path_is_forced_around_each_call_outside_its_timing():
    clock = _FakeClock()
    knob = types.SimpleNamespace(LIMIT=7)
    seen = []

    def body():
        seen.append((knob.LIMIT, _crossover.crossover("concat", torch.device("cpu")) == _crossover.NEVER))
        clock.log.append(("call", "forced"))
        clock.now += 1.0

    path = forced_path("torch", ["concat"], body, (knob, "LIMIT", 1))
    real_forcing = path.forcing

    def logged_forcing():
        clock.log.append(("force",))
        with real_forcing():
            yield
        clock.log.append(("unforce",))

    import contextlib
    path.forcing = contextlib.contextmanager(logged_forcing)  # type: ignore[method-assign]
    paired_round({"plain": lambda: clock.log.append(("call", "plain")), "forced": path}, clock,
                 warmup_ms=0.0, rep_ms=1.0, max_calls=3)
    assert seen and all(s == (1, True) for s in seen)  # forced in every call ...
    log = [e[0] if e[0] != "call" else e[1] for e in clock.log]
    for i, e in enumerate(log):
        if e == "forced":  # ... entered before the start mark, left after the end mark
            assert log[i - 1] in ("mark", "force") and log[i + 1] in ("mark", "unforce")
            assert log[i - 2] in ("flush", "force") and "force" in log[max(0, i - 2):i]
    assert knob.LIMIT == 7 and _crossover.crossover("concat", torch.device("cpu")) == _crossover.ALWAYS
