"""The SSD tier under misuse and faults (issue 29): reads between uses, I/O errors, a full disk.

Reads of a parameter whose shard lives on disk between uses must raise a clear error on every rank, every time (it
used to crash the process with a segmentation fault on the rank whose I/O thread had already given the memory
back, and print the values on the other), and a process leaving through such an error removes its directory.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.dist_pool import free_port

ROOT = Path(__file__).resolve().parents[2]
LIMIT_S = 240


def _run_ranks(world: int, path: str, mode: str) -> tuple[list[int], list[str]]:
    port = str(free_port())
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-X", "faulthandler", "-m", "tests.sharding._ssd_evicted_read",
                               str(r), str(world), port, path, mode],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    start = time.monotonic()
    outs, codes = [], []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1.0, LIMIT_S - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"a rank hung past {LIMIT_S} s")
        outs.append(out)
        codes.append(p.returncode)
    return codes, outs


@pytest.mark.parametrize("world,mode", [(2, "plain"), (2, "offload-orig"), (1, "plain-orig"), (1, "offload")])
def test_reading_a_parameter_on_disk_raises_on_every_rank(tmp_path, world, mode):
    """Before: "Fatal Python error: Segmentation fault" (exit -11) at the first ``p.data.sum()`` after a step."""
    codes, outs = _run_ranks(world, str(tmp_path), mode)
    for rank, (code, out) in enumerate(zip(codes, outs)):
        assert "Segmentation fault" not in out and code >= 0, f"rank {rank} crashed ({code}):\n{out}"
        assert f"rank {rank}: " in out and " reads refused" in out, f"rank {rank}:\n{out}"
        # It left through the last, uncaught read: a Python error naming the parameter and the fix.
        assert code == 1, f"rank {rank} exited with {code}:\n{out}"
        last = out.strip().splitlines()[-1]
        assert "RuntimeError" in last and "on disk" in last and "summon_full_params" in last, last
    assert not [d for d in os.listdir(tmp_path) if d.startswith("shardfuse-ssd-rank")], \
        f"a rank's SSD directory outlived its process: {os.listdir(tmp_path)}"
