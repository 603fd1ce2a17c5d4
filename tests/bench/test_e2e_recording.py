"""bench.e2e.recording: the profiled window's kernel summary, its span split and its longest idle gaps."""

from __future__ import annotations

import json
import random

from bench.e2e import recording


def test_summary_splits_the_span_and_names_the_gaps() -> None:
    rng = random.Random(3)
    g1, g2 = rng.uniform(50, 90), rng.uniform(5, 40)  # the idle gaps, us
    kernels = [
        (0.0, 100.0, "gemm_a"),
        (80.0, 150.0, "ncclDevKernel_AllGather"),  # 50 us of it exposed (100..150)
        (150.0 + g1, 300.0 + g1, "gemm_b"),
        (160.0 + g1, 200.0 + g1, "short_copy"),  # inside gemm_b's run: gemm_b ends that busy run
        (300.0 + g1 + g2, 310.0 + g1 + g2, "adam"),
    ]
    out = recording.summarize(kernels, steps=2)
    t = out["timeline_ms_per_step"]
    span = 310.0 + g1 + g2
    assert abs(t["span"] - span / 2e3) < 1e-9
    assert abs(t["exposed_comm"] - 50.0 / 2e3) < 1e-9
    assert abs(t["idle"] - (g1 + g2) / 2e3) < 1e-9
    assert abs(t["compute"] + t["exposed_comm"] + t["idle"] - t["span"]) < 1e-9
    gaps = out["idle_gaps"]
    assert [round(g["ms"] * 1e3, 6) for g in gaps] == [round(g1, 6), round(g2, 6)]
    assert (gaps[0]["after"], gaps[0]["before"]) == ("ncclDevKernel_AllGather", "gemm_b")
    assert (gaps[1]["after"], gaps[1]["before"]) == ("gemm_b", "adam")
    assert abs(out["nccl_ms_per_step"] - 70.0 / 2e3) < 1e-9
    assert [k["name"] for k in out["top_other"]][:1] == ["gemm_b"]
    (exposed,) = out["exposed_comm"]
    assert abs(exposed["ms"] - 50.0 / 1e3) < 1e-9 and exposed["collectives"] == ["allgather"]
    assert (exposed["after"], exposed["before"]) == ("gemm_a", "gemm_b")
    assert out["collectives"]["allgather"]["count"] == 1
    json.dumps(out)

