"""bench.e2e.memory_peak: the replay of an allocator trace finds the peak and groups what is alive there."""

from __future__ import annotations

import json
import random

from bench.e2e import memory_peak

SF = {"filename": "/x/site-packages/shardfuse/sharding/core/_flat_param.py", "line": 431, "name": "gather"}
AO = {"filename": "/x/site-packages/torchao/float8/float8_ops.py", "line": 12, "name": "mm"}
TORCH = {"filename": "/x/site-packages/torch/nn/functional.py", "line": 2, "name": "linear"}
FWD = {"filename": "/repo/bench/e2e/run.py", "line": 211, "name": "step_fn"}
BWD = {"filename": "/repo/bench/e2e/run.py", "line": 213, "name": "step_fn"}


def _alloc(addr: int, size: int, *frames: dict) -> dict:
    return {"action": "alloc", "addr": addr, "size": size, "frames": list(frames)}


def _free(addr: int, size: int) -> dict:
    return [{"action": "free_requested", "addr": addr, "size": size},
            {"action": "free_completed", "addr": addr, "size": size}]  # type: ignore[return-value]


def test_replay_finds_the_peak_and_groups_the_live_blocks() -> None:
    rng = random.Random(7)
    a, b, c = rng.randrange(1, 50) * 512, rng.randrange(1, 50) * 512, rng.randrange(26, 60) * 512  # 2c > a
    events = [
        _alloc(0x10, a, TORCH, SF, FWD),  # the gather's buffer, in forward
        _alloc(0x20, b, AO, TORCH, FWD),  # torchao's, in forward
        *_free(0x10, a),
        _alloc(0x30, c, TORCH, SF, BWD),  # the gather again, in backward: the peak is here
        _alloc(0x40, c, TORCH, SF, BWD),
        *_free(0x999, 1000),  # a block from before the step: "before" shrinks
        *_free(0x20, b),
        *_free(0x30, c),
    ]
    start = 10_000
    out = memory_peak.replay(events, start)
    assert out["peak_bytes"] == start + b + 2 * c
    groups = {(r["where"], r["phase"]): r["bytes"] for r in out["at_peak"]}
    assert out["peak_event"] == 5  # the second backward allocation
    assert groups[("shardfuse/sharding/core/_flat_param.py:431 (gather)", "bench/e2e/run.py:213 (step_fn)")] == 2 * c
    assert groups[("torchao/float8/float8_ops.py:12 (mm)", "bench/e2e/run.py:211 (step_fn)")] == b
    assert ("shardfuse/sharding/core/_flat_param.py:431 (gather)", "bench/e2e/run.py:211 (step_fn)") not in groups
    assert groups[(memory_peak.BEFORE, "-")] == start  # freed from it only after the peak
    assert sum(r["bytes"] for r in out["at_peak"]) + out["at_peak_rest_bytes"] == out["peak_bytes"]
    json.dumps(out)  # what --memory-peak writes


def test_a_free_of_an_older_block_before_the_peak_comes_off_before() -> None:
    events = [*_free(0x999, 3000), _alloc(0x10, 5000, TORCH, SF, FWD)]
    out = memory_peak.replay(events, 10_000)
    assert out["peak_bytes"] == 12_000
    groups = {r["where"]: r["bytes"] for r in out["at_peak"]}
    assert groups[memory_peak.BEFORE] == 7000
    assert groups["shardfuse/sharding/core/_flat_param.py:431 (gather)"] == 5000


def test_where_allocated_names_inductor_code_and_torch_alone() -> None:
    gen = {"filename": "/tmp/torchinductor_root/ab/cabc123.py", "line": 90, "name": "call"}
    assert memory_peak.where_allocated([TORCH, gen, FWD]) == ("inductor:cabc123.py:90 (call)",
                                                              "bench/e2e/run.py:211 (step_fn)")
    assert memory_peak.where_allocated([TORCH]) == ("torch/nn/functional.py:2 (linear)", "-")
    assert memory_peak.where_allocated([]) == ("no frames", "-")
