"""bench.offload.host_timeline: one step's host events summarised in ms from the step's start."""

from __future__ import annotations

from bench.offload import host_timeline


def test_summary_of_a_step() -> None:
    t0 = 100.0
    events = [
        (99.0, "done", 0),  # before the window: left out
        (t0 + 0.010, "wait", 0), (t0 + 0.012, "task", 0), (t0 + 0.013, "update", 0), (t0 + 0.030, "done", 0),
        (t0 + 0.031, "waited", 0),
        (t0 + 0.100, "queued", 1), (t0 + 0.101, "task", 1), (t0 + 0.105, "grad_ready", 1), (t0 + 0.106, "update", 1),
        (t0 + 0.126, "done", 1), (t0 + 0.200, "step", -1),
        (t0 + 0.500, "done", 1),  # after the window: left out
    ]  # fmt: skip
    s = host_timeline.summarize(events, t0, t0 + 0.3, t0 + 0.25)
    assert s["window_ms"] == 300.0 and s["step_end_ms"] == 250.0 and s["steps_ms"] == [200.0]
    assert abs(s["updating_ms"] - 37.0) < 1e-6 and abs(s["grad_wait_ms"] - 4.0) < 1e-6
    assert abs(s["caller_wait_ms"] - 21.0) < 1e-6
    assert s["units"]["0"] == {"wait": [10.0], "task": [12.0], "update": [13.0], "done": [30.0], "waited": [31.0]}
    assert s["units"]["1"]["grad_ready"] == [105.0] and s["units"]["1"]["done"] == [126.0]
    lines = host_timeline.table(s)
    assert "worker updating 37 ms, waiting for gradient copies 4 ms; callers waited 21 ms" in lines[0]
    assert lines[2].split() == ["0", "-", "12", "-", "13", "30", "10", "31"]
    assert lines[3].split() == ["1", "100", "101", "105", "106", "126", "-", "-"]
