"""A reusable pool of distributed worker processes for tests.

Spawning a process group costs seconds on a small machine, so a test module starts one pool of N workers
(one gloo or NCCL group) once and runs many check functions in it. A check is a module-level function
(picklable by reference); every rank runs it with the same arguments and the results come back as a list
indexed by rank. A worker exception is re-raised in the test process with the rank and the worker's
traceback; every wait has a timeout, so a hang fails the test (and the pool is restarted) instead of
blocking the suite. Each worker uses ``cores // world_size`` CPU threads (at least 1; ``OMP_NUM_THREADS``
wins when set): N ranks with all cores each would oversubscribe a small machine several times over.

A gloo pool's workers are forked from one server process per test session that has imported torch already
(multiprocessing's forkserver, see ``_context``): each spawned worker imported torch anew, ~1.5 s of CPU apiece,
which made a 2-rank pool's start and exit cost ~2 s per test module on a 2-core machine and an 8-rank one ~10 s.
Each worker still gets the test process's environment, working directory and ``sys.path`` as they are when the
pool starts, and imports the library and the test module itself. NCCL pools spawn fresh interpreters as before.

The fixtures ``pool`` (the test module's ``WORLD`` ranks, default 2) and ``pool4`` in ``tests/conftest.py``
start one pool per test module::

    WORLD = 2

    def test_something(pool):
        results = pool.run(check_something, 13)
"""

from __future__ import annotations

import io
import logging
import os
import queue
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 120.0


class WorkerError(RuntimeError):
    """A check raised in a worker; the message carries the rank and the worker's traceback."""


def free_port() -> int:
    """A TCP port that was free a moment ago on localhost."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def threads_per_rank(world_size: int) -> int:
    """CPU threads for each of ``world_size`` processes on this machine: ``OMP_NUM_THREADS`` if set, else
    the usable cores divided among the ranks, at least 1."""
    if os.environ.get("OMP_NUM_THREADS", "").isdigit() and int(os.environ["OMP_NUM_THREADS"]) > 0:
        return int(os.environ["OMP_NUM_THREADS"])
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, cores // world_size)


def _dumps(obj: Any) -> bytes:
    # torch.save keeps tensors out of shared memory / file-descriptor passing between processes.
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


# What the forkserver imports once: third-party modules only, none of which reads the variables the tests set.
# The library (whose kernels read TRITON_INTERPRET when imported) and the test modules load in each worker.
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "pytest"]


def _context(backend: str) -> Any:
    """Forkserver for gloo pools (workers forked from a process with torch imported), spawn for NCCL."""
    if backend == "nccl":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)  # takes effect when the session's server starts (once)
    return ctx


def _worker(
    rank: int, world_size: int, port: int, backend: str, env: dict[str, str], tasks: Any, results: Any
) -> None:
    # The test process's environment at start(), as a spawned worker would inherit it (a forked one has the
    # forkserver's, from when the server started): TRITON_INTERPRET and friends, before anything imports triton.
    os.environ.clear()
    os.environ.update(env)
    import torch.distributed as dist

    torch.set_num_threads(int(env["OMP_NUM_THREADS"]))

    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
            device_id=torch.device("cuda", rank) if backend == "nccl" else None,
        )
        results.put((rank, "ready", None))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
        return
    while True:
        item = tasks.get()
        if item is None:
            break
        task_id, payload = item
        try:
            fn, args, kwargs = _loads(payload)
            out = fn(*args, **kwargs)
            results.put((rank, task_id, ("ok", _dumps(out))))
        except BaseException:
            results.put((rank, task_id, ("error", traceback.format_exc())))
    dist.destroy_process_group()


class DistPool:
    """``world_size`` worker processes in one process group, running check functions on demand."""

    def __init__(self, world_size: int = 2, backend: str = "gloo", timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        """Configure (not start) a pool; ``backend`` is "gloo" (CPU) or "nccl" (one GPU per rank)."""
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size=}")
        if backend == "nccl" and torch.cuda.device_count() < world_size:
            raise RuntimeError(f"nccl pool needs {world_size} GPUs, found {torch.cuda.device_count()}")
        self.world_size = world_size
        self.backend = backend
        self.timeout_s = timeout_s
        self._procs: list[Any] = []
        self._task_id = 0

    def __enter__(self) -> DistPool:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def start(self) -> None:
        """Spawn the workers and wait until the process group is up."""
        ctx = _context(self.backend)
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads_per_rank(self.world_size))}
        port = free_port()
        self._procs = [
            ctx.Process(
                target=_worker, args=(r, self.world_size, port, self.backend, env, self._tasks[r], self._results),
                daemon=True,
            )
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()
        ready = self._collect("ready", timeout_s=max(self.timeout_s, 180.0))
        errors = {r: v for r, v in ready.items() if v is not None}
        if errors:
            self.close(force=True)
            raise WorkerError(f"worker start-up failed: {errors}")

    def _collect(self, task_id: Any, timeout_s: float) -> dict[int, Any]:
        got: dict[int, Any] = {}
        while len(got) < self.world_size:
            try:
                rank, tid, value = self._results.get(timeout=timeout_s)
            except queue.Empty:
                missing = sorted(set(range(self.world_size)) - set(got))
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                self.close(force=True)
                raise TimeoutError(
                    f"DistPool: ranks {missing} gave no answer to task {task_id!r} within {timeout_s:.0f}s "
                    f"(dead workers: {dead}); the pool was shut down"
                ) from None
            if tid == "ready" or tid == "error":
                got[rank] = None if tid == "ready" else value
            elif tid == task_id:
                got[rank] = value
            # Answers to an older, abandoned task are dropped.
        return got

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results by rank or raise a WorkerError."""
        if not self._procs:
            self.start()
        self._task_id += 1
        payload = _dumps((fn, args, kwargs))
        for q in self._tasks:
            q.put((self._task_id, payload))
        got = self._collect(self._task_id, timeout_s or self.timeout_s)
        errors = [(r, v[1]) for r, v in sorted(got.items()) if v[0] == "error"]
        if errors:
            text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in errors)
            raise WorkerError(f"{getattr(fn, '__name__', fn)} failed on ranks {[r for r, _ in errors]}:\n{text}")
        return [_loads(got[r][1]) for r in range(self.world_size)]

    def close(self, force: bool = False) -> None:
        """Stop the workers (politely unless ``force``)."""
        if not self._procs:
            return
        if not force:
            for q in self._tasks:
                q.put(None)
            for p in self._procs:
                p.join(timeout=30)
        for p in self._procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)
        self._procs = []
