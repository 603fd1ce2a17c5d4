"""A rank that dies mid-step: the others stop with an error within the process-group timeout, never hang.

On CPU (gloo) the peer's closed connection fails the next collective; on GPUs (NCCL) the watchdog's
asynchronous error handling ends the survivors once the process-group timeout has passed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.dist_pool import free_port

ROOT = Path(__file__).resolve().parents[2]


def _run_ranks(backend: str, timeout_s: float, limit_s: float) -> tuple[list[int], list[str], float]:
    port = str(free_port())
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    start = time.monotonic()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.sharding._dead_rank", str(r), "2", port, backend, str(timeout_s)],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for r in range(2)
    ]
    outs, codes = [], []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1.0, limit_s - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"a surviving rank hung past {limit_s} s (process-group timeout {timeout_s} s)")
        outs.append(out)
        codes.append(p.returncode)
    return codes, outs, time.monotonic() - start


def test_dead_rank_gloo_raises_on_the_survivor():
    codes, outs, took = _run_ranks("gloo", timeout_s=30, limit_s=120)
    assert codes[1] == 17, outs[1]
    assert codes[0] == 3, outs[0]  # the survivor's step raised (and did not finish)
    assert "rank 0: step 1 failed" in outs[0], outs[0]
    assert "finished all steps" not in outs[0]


@pytest.mark.multigpu
def test_dead_rank_nccl_ends_the_survivor_within_the_timeout():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    codes, outs, took = _run_ranks("nccl", timeout_s=20, limit_s=150)
    assert codes[1] == 17, outs[1]
    assert codes[0] != 0, outs[0]  # an exception (code 3) or the watchdog's abort (a signal)
    assert "finished all steps" not in outs[0]
    assert took < 150
