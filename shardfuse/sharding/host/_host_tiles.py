"""A pool of single-threaded workers that run one host update's tiles, each taking the next tile as it finishes one.

torch's CPU kernels split each call over every intra-op thread and end it with a barrier: a step of a shard in
chunks is a barrier per chunk, and where one thread is descheduled (the main thread launching GPU work, the copy
threads, the driver share the cores) the whole call waits for it. Here each pool thread runs its kernels on one
core (``torch.set_num_threads(1)`` from that thread: torch's intra-op count is per thread) and takes tiles from a
shared list, so a late thread delays only its own tile while the others take the rest; the only barrier is the end
of the list. A tile's operations (clipping's scale, the fused update, the compute copy) run back to back on one
core, so the data one writes is in that core's cache when the next reads it.

The pool runs one list at a time, for one caller: the host worker thread (``_host_step.StepWorker``), which waits in
:meth:`TilePool.run` while the pool works.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence


class TilePool:
    """``threads`` daemon threads (``shardfuse-host-tile-<i>``) running torch's kernels single-threaded, with grad
    mode off.

    :meth:`run` hands them a list of callables and returns when every one has run (raising the first error one
    raised, after the others finished); the first run starts the threads, :meth:`close` ends them. Not reentrant:
    one :meth:`run` at a time.
    """

    def __init__(self, threads: int) -> None:
        if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
            raise ValueError(f"TilePool needs a positive number of threads, got {threads!r}")
        self.threads = threads
        self._cond = threading.Condition()
        self._items: Sequence[Callable[[], None]] = ()
        self._next = 0  # the next item to take
        self._left = 0  # items not finished yet
        self._round = 0  # bumped by each run(): wakes the threads
        self._error: BaseException | None = None
        self._closing = False
        self._busy = False
        # Started by the first run(): an optimizer whose updates never take tiles (no clip fires, no compute copy)
        # keeps no idle threads.
        self._workers: list[threading.Thread] = []

    def _work(self) -> None:
        import torch  # noqa: PLC0415 - per-thread setting, made in the thread itself

        torch.set_num_threads(1)
        torch.set_grad_enabled(False)  # the items update tensors in place: no autograd history, ever
        seen = 0
        while True:
            with self._cond:
                while self._round == seen and not self._closing:
                    self._cond.wait()
                if self._round == seen:  # closing, and no list left to help with
                    return
                seen = self._round
            self._drain()

    def _drain(self) -> None:
        while True:
            with self._cond:
                if self._next >= len(self._items):
                    return
                item = self._items[self._next]
                self._next += 1
            try:
                item()
            except BaseException as err:  # noqa: BLE001 - re-raised by run() on the caller's thread
                with self._cond:
                    self._error = self._error or err
            with self._cond:
                self._left -= 1
                if self._left == 0:
                    self._cond.notify_all()

    def run(self, items: Sequence[Callable[[], None]]) -> None:
        """Run every item once on the pool; return when all finished, raising the first error any raised."""
        if not items:
            return
        with self._cond:
            if self._closing:
                raise RuntimeError("TilePool.run() after close(): the pool's threads have ended")
            if self._busy:
                raise RuntimeError("TilePool.run() while another run() is in progress: the pool runs one list at "
                                   "a time (one caller, the host worker thread)")
            self._busy = True
            if not self._workers:
                self._workers = [threading.Thread(target=self._work, name=f"shardfuse-host-tile-{i}", daemon=True)
                                 for i in range(self.threads)]
                for worker in self._workers:
                    worker.start()
            self._items, self._next, self._left, self._error = items, 0, len(items), None
            self._round += 1
            self._cond.notify_all()
            while self._left:
                self._cond.wait()
            error, self._error, self._items, self._busy = self._error, None, (), False
        if error is not None:
            raise error

    def close(self) -> None:
        """End the threads (idempotent); a run in progress finishes first."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            workers = list(self._workers)
        for worker in workers:
            if worker is not threading.current_thread():
                worker.join()
