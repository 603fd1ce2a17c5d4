"""The multi-node path of docs/recipes.md: two ``torchrun`` "nodes" on localhost form a 2x2 mesh.

Two torchrun agents (``--nnodes 2 --nproc-per-node 2``, c10d rendezvous on 127.0.0.1) each start 2 gloo
workers running ``examples/train.py --mesh 2,2`` (hybrid sharding: 2 replicas x 2 shards, the tiny config, 2
steps), whose rank 0 checks the result against unsharded training on the same global batches. The agents and
their workers (torchrun starts each worker in a session of its own) are killed if anything goes wrong, so a
failure cannot leave processes behind or hang the suite.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from tests.dist_pool import free_port

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 240


def _children() -> dict[int, list[int]]:
    """Parent pid -> child pids, from /proc."""
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # exited meanwhile
            continue
        ppid = int(stat.rpartition(")")[2].split()[1])  # the command name may hold spaces or parentheses
        tree.setdefault(ppid, []).append(int(entry))
    return tree


def _kill_trees(procs: list[subprocess.Popen]) -> None:
    """SIGKILL each process and all its descendants (collected first, so none is reparented unseen)."""
    tree = _children()
    pids: list[int] = []
    stack = [p.pid for p in procs if p.poll() is None]
    while stack:
        pid = stack.pop()
        pids.append(pid)
        stack.extend(tree.get(pid, []))
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):  # exited meanwhile
            os.kill(pid, signal.SIGKILL)
    for p in procs:
        p.wait()


def _torchrun(node: int, endpoint: str, run_id: str, log: Path, env: dict[str, str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
           # On one machine both agents would take the endpoint for their own: say which one hosts the store.
           "--rdzv-conf", f"is_host={1 if node == 0 else 0}",
           str(REPO / "examples" / "train.py"), "--mesh", "2,2", "--steps", "2", "--batch-size", "1",
           "--seq-len", "8"]
    with open(log, "w") as out:  # the child keeps its own descriptor
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)


def test_two_torchrun_nodes_form_a_2x2_mesh_and_match_unsharded_training(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "0",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    endpoint, run_id = f"127.0.0.1:{free_port()}", f"multinode-{uuid.uuid4().hex[:12]}"
    logs = [tmp_path / f"node{i}.log" for i in range(2)]
    procs: list[subprocess.Popen] = []
    try:
        for node in range(2):
            procs.append(_torchrun(node, endpoint, run_id, logs[node], env))
        deadline = time.monotonic() + TIMEOUT_S
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in procs):
                time.sleep(5)  # let the other node report, then stop it
                break
            time.sleep(0.2)
    finally:
        codes = [p.poll() for p in procs]
        _kill_trees(procs)
    texts = [log.read_text() for log in logs]
    report = "\n".join(f"--- node {i} (exit code {c}, timeout {TIMEOUT_S} s):\n{t[-3000:]}"
                       for i, (c, t) in enumerate(zip(codes, texts)))
    assert codes == [0, 0], report
    out = "\n".join(texts)  # global rank 0, which prints and checks parity, is on either node
    assert "shardfuse FSDP on 4 x cpu (gloo, mesh 2 replicas x 2 shards)" in out, report
    assert "step   2/2" in out and "parity vs unsharded (fp32)" in out and "\nPASS" in out, report
    assert "FAIL" not in out, report
