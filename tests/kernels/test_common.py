"""The shared kernel plumbing (``shardfuse.kernels._common``): argument checks, plan keys, the plan cache.

No kernel runs here; these are the host-side helpers every launcher goes through.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from shardfuse.kernels import _common as common

# ------------------------------------------------------------------ argument checks


@pytest.mark.parametrize("factor", [1, 2.0, 0.5, 3, np.float32(4.0), 1e-30], ids=repr)
def test_check_factor_accepts_positive_finite_numbers(factor):
    assert common.check_factor(factor) == float(factor)


@pytest.mark.parametrize(
    "bad", [0.0, -1.0, math.nan, math.inf, -math.inf, True, False, "2", b"2", None, [2.0]], ids=repr
)
def test_check_factor_rejects(bad):
    with pytest.raises(ValueError, match=r"the divide factor must be a finite number > 0, got factor=.*use 1.0"):
        common.check_factor(bad)


@pytest.mark.parametrize("world_size", [1, 2, 7, np.int64(8)], ids=repr)
def test_check_world_size_accepts_positive_ints(world_size):
    assert common.check_world_size(world_size, "f") == int(world_size)


@pytest.mark.parametrize("bad", [0, -2, 2.5, 2.0, True, "4", None], ids=repr)
def test_check_world_size_rejects(bad):
    with pytest.raises(ValueError, match=rf"f needs an integer world_size >= 1, got world_size={bad!r}.*positive int"):
        common.check_world_size(bad, "f")


def test_check_tensors():
    t = torch.zeros(2)
    assert common.check_tensors((t, t), "xs") == [t, t]
    assert common.check_tensors(iter([t]), "xs") == [t]
    with pytest.raises(TypeError, match=r"xs\[1\] is a float, not a torch.Tensor: pass tensors only"):
        common.check_tensors([t, 3.0], "xs")
    with pytest.raises(TypeError, match=r"xs must be a sequence of tensors, got a Tensor: wrap it in a list"):
        common.check_tensors(t, "xs")
    with pytest.raises(TypeError, match=r"f takes a sequence of tensors, got a int"):
        common.check_tensors(3, "xs", "f")
    with pytest.raises(TypeError, match=r"src is a NoneType, not a torch.Tensor"):
        common.check_float(None, "src")
    with pytest.raises(TypeError, match=r"dtype must be a torch.dtype or None, got 'bf16'"):
        common.check_dtype_arg("bf16")


def test_as_list():
    t = torch.zeros(2)
    assert common.as_list((t,)) == [t]
    assert common.as_list(t) is t  # a tensor is not a list of tensors: validation says so later
    assert common.as_list(3.0) == 3.0


@pytest.mark.parametrize("numels,expected", [([1], (512, 4)), ([700, 3], (1024, 4)), ([2049], (4096, 8)),
                                             ([10**6], (4096, 8))], ids=str)
def test_multi_block(numels, expected):
    assert common.multi_block(numels) == expected


# ------------------------------------------------------------------ plan cache


def test_plan_cache_lru_and_interpreter(monkeypatch):
    class Plan:
        device = torch.device("cpu")

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # CPU plans are served under the interpreter (set on a GPU box too)

    cache = common.PlanCache(maxsize=2)
    plans = [Plan() for _ in range(3)]
    for i, p in enumerate(plans):
        cache.put(("k", i), p)
    assert len(cache) == 2 and cache.get(("k", 0)) is None and cache.get(("k", 2)) is plans[2]
    cache.put(None, plans[0])  # no key: nothing cached
    assert len(cache) == 2 and cache.get(None) is None
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert cache.get(("k", 2)) is None, "a plan for the interpreter served a CPU call without it"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert cache.get(("k", 2)) is plans[2]


def test_plan_cache_last_entry_keeps_the_lru_order(monkeypatch):
    class Plan:
        device = torch.device("cpu")

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # CPU plans are served under the interpreter (set on a GPU box too)

    cache = common.PlanCache(maxsize=2)
    p0, p1, p2 = Plan(), Plan(), Plan()
    cache.put(("k", 0), p0)
    cache.put(("k", 1), p1)
    for _ in range(3):  # the first finds it in the LRU order, the others as the last entry used
        assert cache.get(("k", 0)) is p0
    cache.put(("k", 2), p2)  # evicts the least recently used: k1, not k0
    assert cache.get(("k", 1)) is None and cache.get(("k", 0)) is p0 and cache.get(("k", 2)) is p2
    assert hash((-1,)) == hash((-2,))  # CPython: hash(-1) == hash(-2)
    cache.put((-1,), p1)
    assert cache.get((-2,)) is None, "a key with the same hash got another key's plan"
    cache.put((-2,), p2)
    assert cache.get((-1,)) is None and cache.get((-2,)) is p2
    cache.clear()
    assert cache.get((-2,)) is None and len(cache) == 0
    empty = common.PlanCache(maxsize=0)
    empty.put(("k", 0), p0)
    assert empty.get(("k", 0)) is None, "a cache of no entries served the plan it evicted"


def test_triton_device(monkeypatch):
    t = torch.zeros(1)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert common.triton_device(t)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not common.triton_device(t)
    assert not common.triton_device(torch.zeros(1, device="meta"))
