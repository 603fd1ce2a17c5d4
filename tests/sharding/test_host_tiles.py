"""``_host_tiles.TilePool``: every item runs exactly once, on the pool's threads, each running torch's kernels on one
core; the first error is raised on the caller after the other items finished; misuse is refused by name."""

from __future__ import annotations

import threading

import pytest
import torch

from shardfuse.sharding.host._host_tiles import TilePool


@pytest.fixture
def pool():
    made = TilePool(3)
    yield made
    made.close()


def test_every_item_runs_once_on_a_single_threaded_pool_thread(pool):
    seen: list[tuple[int, str, int]] = []
    grad_modes: list[bool] = []
    lock = threading.Lock()

    def item(i: int) -> None:
        with lock:
            seen.append((i, threading.current_thread().name, torch.get_num_threads()))
            grad_modes.append(torch.is_grad_enabled())

    for size in (1, 2, 7, 100):  # fewer items than threads, more, and the pool reused between lists
        seen.clear()
        pool.run([lambda i=i: item(i) for i in range(size)])
        assert sorted(i for i, _, _ in seen) == list(range(size))
        assert all(name.startswith("shardfuse-host-tile-") for _, name, _ in seen)
        assert all(n == 1 for _, _, n in seen), "a pool thread ran torch's kernels over several intra-op threads"
        assert not any(grad_modes), "a pool thread ran an item with grad mode on (in-place updates would be recorded)"
    pool.run([])  # nothing to do: returns at once


def test_the_callers_thread_count_is_left_alone(pool):
    before = torch.get_num_threads()
    pool.run([lambda: None] * 4)
    assert torch.get_num_threads() == before


def test_the_first_error_is_raised_after_every_item_finished(pool):
    done: list[int] = []

    def ok(i: int) -> None:
        done.append(i)

    def bad() -> None:
        raise ValueError("tile 3 failed")

    items = [lambda i=i: ok(i) for i in range(3)] + [bad] + [lambda i=i: ok(i) for i in range(3, 9)]
    with pytest.raises(ValueError, match="tile 3 failed"):
        pool.run(items)
    assert sorted(done) == list(range(9)), "items after the failing one were skipped"
    pool.run([lambda: ok(99)])  # the pool works again after an error
    assert done[-1] == 99


def test_misuse_is_refused():
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match=f"positive number of threads, got {bad!r}"):
            TilePool(bad)  # type: ignore[arg-type]
    made = TilePool(2)
    inner: list[BaseException] = []

    def nested() -> None:
        try:
            made.run([lambda: None])
        except RuntimeError as err:
            inner.append(err)

    made.run([nested])
    assert inner and "another run() is in progress" in str(inner[0])
    made.close()
    made.close()  # idempotent
    with pytest.raises(RuntimeError, match="after close"):
        made.run([lambda: None])


def test_threads_start_at_the_first_list_and_end_at_close():
    """An optimizer whose updates never take tiles keeps no idle threads: the pool starts them at its first run()."""

    def tile_threads() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name.startswith("shardfuse-host-tile-")]

    before = set(tile_threads())
    made = TilePool(3)
    assert set(tile_threads()) == before, "the pool started threads before it had a list"
    made.run([lambda: None])
    started = set(tile_threads()) - before
    assert len(started) == 3
    made.close()
    assert not any(t.is_alive() for t in started), "close() left a pool thread running"
