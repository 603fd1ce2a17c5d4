"""Who owns the SSD tier (issue 29): the model the user holds, not a module-level registry.

The units of one model share one tier (learned orders, bounds) and its store (one folder, its own I/O threads; the
nested units' files move into it); two models have two, even under one directory; freeing a model frees its tier,
its store, its folder and the store's I/O threads. One process-wide optimizer step hook remains (the optimizer is
made after wrapping): it gives each optimizer over SSD-backed parameters hooks of its own at its first step.
"""

from __future__ import annotations

import gc
import os
import threading
import weakref
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

from shardfuse import OffloadConfig, OffloadOptimizer, _versions
from shardfuse.sharding import FullyShardedDataParallel as FSDP
from shardfuse.sharding.ssd import _ssd
from shardfuse.sharding.ssd._ssd import ssd_host
from tests.sharding.test_ssd_offload import _assert_same_model, _flat_handles, _Group


def _model(path: str, seed: int = 5) -> FSDP:
    torch.manual_seed(seed)
    oc = OffloadConfig(offload_type="ssd_offload", dir=path, optimizer_state=True)
    net = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 7), nn.Tanh(), nn.Linear(7, 3))
    net[0] = FSDP(net[0], process_group=_Group(), offload_config=oc)
    net[2] = FSDP(net[2], process_group=_Group(), offload_config=oc)
    return FSDP(net, process_group=_Group(), offload_config=oc)


def _tiers(model: FSDP) -> list[Any]:
    return list({id(t): t for h in _flat_handles(model) if (t := ssd_host(h).ssd.tier) is not None}.values())  # type: ignore[union-attr]


def _train(model: FSDP, opt: Any, steps: int = 2) -> None:
    for _ in range(steps):
        model(torch.randn(4, 5)).square().sum().backward()
        opt.step()
        opt.zero_grad()


def _folder(model: FSDP) -> str:
    """The one folder all of ``model``'s files lie in."""
    folders = {os.path.dirname(p.file.path) for h in _flat_handles(model)
               for p in ssd_host(h).ssd.pages(state=True)}  # type: ignore[union-attr]
    assert len(folders) == 1, f"one model's files in {len(folders)} folders: {folders}"
    return folders.pop()


def _io_threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("shardfuse-ssd-io")}


def test_one_tier_and_store_per_model_freed_with_it(tmp_path):
    """Before: one tier per setting in a module-level dict that never shrank, then one store per directory shared
    by every model (a module-level WeakValueDictionary). Now each model owns its tier and its store."""
    threads_before = _io_threads()
    a, b = _model(str(tmp_path)), _model(str(tmp_path))
    (ta,), (tb,) = _tiers(a), _tiers(b)  # the nested units and the root share one tier
    assert ta is not tb, "two models share a tier (learned orders, bounds)"
    assert len(_flat_handles(a)) == 3
    assert ta.store is not tb.store and ta.store.pool is not tb.store.pool, "two models share a store"
    assert a._unit.lower_tiers == [ta] and b._unit.lower_tiers == [tb], "the root wrapper's state owns the tier"
    assert all(not m._unit.lower_tiers for m in a._units() if m is not a)
    assert _ssd.stores_of(a) == [ta.store]
    # The nested units' files moved into the root's store: one folder per model, two folders in the directory.
    assert _folder(a) == ta.store.dir and _folder(b) == tb.store.dir != ta.store.dir
    assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(t.store.dir) for t in (ta, tb))
    opt = OffloadOptimizer(a, torch.optim.AdamW(a.parameters(), lr=1e-2), gpu_budget_gib=0)
    _train(a, opt)
    opt.close()
    refs = [weakref.ref(ta), weakref.ref(ta.store), weakref.ref(ta.store.pool)]
    threads = list(ta.store.pool._threads)
    assert threads and {t.name for t in threads} <= _io_threads()
    folder_a = ta.store.dir
    del a, opt, ta
    gc.collect()
    assert [r() for r in refs] == [None] * 3, "the tier, store or I/O pool outlived its model"
    for t in threads:
        t.join(timeout=10)
    assert not [t.name for t in threads if t.is_alive()], "I/O threads outlived their model"
    assert not os.path.exists(folder_a), "the model's folder outlived it"
    assert os.listdir(tmp_path) == [os.path.basename(tb.store.dir)]  # b's store untouched
    _train(b, torch.optim.AdamW(b.parameters(), lr=1e-2))
    # The last step's write-behind may still be running: a queued write's completion callback reaches the model,
    # so a collection while it runs keeps the model (a cycle) until the next one. Settle it first, as a's
    # OffloadOptimizer.close() did (a CI run on a loaded 2-core host caught the race).
    for shard in [ssd_host(h).ssd for h in _flat_handles(b)]:
        shard.settle()  # type: ignore[union-attr]
    del shard
    store_b = weakref.ref(tb.store)
    del b, tb
    gc.collect()
    assert store_b() is None, "b's store outlived b once its I/O was done"
    for t in threading.enumerate():
        if t.name.startswith("shardfuse-ssd-io") and t.name not in threads_before:
            t.join(timeout=10)
    assert _io_threads() <= threads_before, f"I/O threads left: {_io_threads() - threads_before}"
    assert os.listdir(tmp_path) == []


def test_two_models_under_one_directory_do_not_collide(tmp_path):
    """Two models with the same settings and directory train side by side, each exactly like it alone: their files
    never clash (own folders, own serial numbers), and one's I/O never waits in the other's pool."""
    torch.manual_seed(11)
    batches = [torch.randn(4, 5) for _ in range(3)]
    alone = _model(str(tmp_path), seed=1)
    opt = torch.optim.AdamW(alone.parameters(), lr=1e-2)
    for x in batches:
        alone(x).square().sum().backward()
        opt.step()
        opt.zero_grad()
    want = alone.state_dict()
    del alone, opt
    gc.collect()
    models = [_model(str(tmp_path), seed=1), _model(str(tmp_path), seed=1)]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    names = [sorted(os.path.basename(p.file.path) for h in _flat_handles(m)
                    for p in ssd_host(h).ssd.pages(state=True)) for m in models]  # type: ignore[union-attr]
    assert names[0] == names[1], "the two folders hold the same file names (no shared counter between models)"
    for x in batches:
        for m, o in zip(models, opts):
            m(x).square().sum().backward()
            o.step()
            o.zero_grad()
    assert _folder(models[0]) != _folder(models[1])
    for m in models:
        _assert_same_model(m.state_dict(), want)


def test_one_process_wide_hook_and_per_optimizer_hooks(tmp_path):
    """The tier's only global hook is the dispatching pre-hook; an optimizer over SSD-backed parameters gets its own
    step and state-dict hooks at its first step, another optimizer none; the fused step's writes are counted once
    (the shard is written once per step, and equals the in-memory path)."""
    m = _model(str(tmp_path))
    assert [h for h in _global_optimizer_pre_hooks.values() if getattr(h, "__module__", "") == _ssd.__name__] \
        == [_ssd._dispatch]
    assert not [h for h in _global_optimizer_post_hooks.values() if getattr(h, "__module__", "") == _ssd.__name__]
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True)
    other = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    assert not opt._optimizer_step_pre_hooks
    torch.manual_seed(5)
    plain_net = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 7), nn.Tanh(), nn.Linear(7, 3))
    plain_net[0] = FSDP(plain_net[0], process_group=_Group(), move_params_to_cpu=True)
    plain_net[2] = FSDP(plain_net[2], process_group=_Group(), move_params_to_cpu=True)
    plain = FSDP(plain_net, process_group=_Group(), move_params_to_cpu=True)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, fused=True)
    written = []
    for x in [torch.randn(4, 5) for _ in range(4)]:
        for model, o in ((m, opt), (plain, plain_opt)):
            model(x).square().sum().backward()
            o.step()
            o.zero_grad()
        for h in _flat_handles(m):
            for page in ssd_host(h).ssd.pages(state=True):  # type: ignore[union-attr]
                page.file.then(lambda: None).wait()
        written.append(_tiers(m)[0].store.bytes_written)
        assert all(h.flat.untyped_storage().nbytes() == 0 for h in _flat_handles(m))
    assert list(opt._optimizer_step_pre_hooks.values()) == [_ssd._pre_step]
    # Its own fused-versions hook, then the write-behind (instance post-hooks run in order, before global ones).
    assert list(opt._optimizer_step_post_hooks.values()) == [_versions.fused_step_post_hook, _ssd._post_step]
    other.step()
    assert not other._optimizer_step_pre_hooks and not other._optimizer_step_post_hooks
    floor = sum(p.nbytes for h in _flat_handles(m) for p in ssd_host(h).ssd.pages(state=True))  # type: ignore[union-attr]
    per_step = [b - a for a, b in zip(written[1:], written[2:])]  # after the first step made the state
    assert per_step == [floor] * len(per_step), f"written per step {per_step}, each shard and state once: {floor}"
    _assert_same_model(m.state_dict(), plain.state_dict())
