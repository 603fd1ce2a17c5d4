"""bench/dcp_loop/run.py works under torchrun: a save at 2 gloo ranks and a load at 2 check both checkpoint paths
bit for bit, exit 0 (the workaround on: run() returns and its objects are freed before the exit), and a load that
is not loaded fails (the bit-exact check can fail)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "bench" / "dcp_loop" / "run.py"


def _torchrun(phase: str, where: Path, **env: str) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "DCP_LOOP_KEEP": "0", **env}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(RUN), phase, "--dir", str(where)],
                          capture_output=True, text=True, timeout=240, env=full)


def test_save_and_load_at_two_ranks_bit_exact(tmp_path):
    where = tmp_path / "ckpt"
    saved = _torchrun("save", where)
    assert saved.returncode == 0, saved.stdout[-3000:] + saved.stderr[-3000:]
    assert {p.name for p in where.iterdir()} == {"sharded", "dsd", "ref.pt"}
    loaded = _torchrun("load", where)
    assert loaded.returncode == 0, loaded.stdout[-3000:] + loaded.stderr[-3000:]
    for what in ("sharded_state_dict + dcp", "get_state_dict + dcp"):
        assert loaded.stdout.count(f"{what} bit-exact (saved at 2 ranks)") == 2, loaded.stdout
    # The reference is what the check compares with: change one bit of it and the load must fail.
    ref = torch.load(where / "ref.pt", weights_only=True)
    first = next(iter(ref["model"]))
    ref["model"][first].view(-1)[0] = torch.nextafter(ref["model"][first].view(-1)[0], torch.tensor(1e9))
    torch.save(ref, where / "ref.pt")
    bad = _torchrun("load", where)
    assert bad.returncode != 0 and "changed ['model/" in bad.stdout + bad.stderr, bad.stdout[-2000:]
