"""The chunked host step (``_host_fused.step_in_chunks``) against torch's own fused Adam/AdamW step over the whole
shard: bit for bit in parameters, optimizer state and the compute-dtype copy, over odd sizes and chunks that split
parameters; and every case the path must leave to the optimizer's own step."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from shardfuse.sharding.host._host_fused import ALIGN, step_in_chunks
from shardfuse.sharding.host._host_tiles import TilePool

CASES = {
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "adam-amsgrad": (torch.optim.Adam, dict(lr=3e-3, weight_decay=0.01, amsgrad=True)),
    "adamw-maximize-tensor-lr": (torch.optim.AdamW, dict(lr=torch.tensor(2e-3), maximize=True)),
    "adam-decoupled-betas": (torch.optim.Adam, dict(lr=1e-3, betas=(0.8, 0.95), decoupled_weight_decay=True,
                                                    weight_decay=0.05)),
}
SPLITS = (5003, ALIGN * 7 + 3)  # three views of one flat shard, none aligned to a chunk


def _views(flat: torch.Tensor) -> list[torch.Tensor]:
    a, b = SPLITS
    return [flat[:a], flat[a:a + b].view(-1, 1), flat[a + b:]]


def _settings(opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {k: v for k, v in opt.param_groups[0].items() if k != "params"}


@pytest.fixture(scope="module")
def tile_pool():
    pool = TilePool(3)
    yield pool
    pool.close()


@pytest.mark.parametrize("tiles", [False, True], ids=["chunks", "tiles"])
@pytest.mark.parametrize("chunk", [ALIGN, 3 * ALIGN, 1 << 21], ids=["4k", "12k", "default"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_chunked_step_equals_torch_fused_step(case, chunk, tiles, tile_pool):
    """``tiles``: the chunks run as tiles on a TilePool of 3 single-threaded workers."""
    pool = tile_pool if tiles else None
    cls, kw = CASES[case]
    gen = torch.Generator().manual_seed(hash(case) % 1000)
    n = sum(SPLITS) + 3 * ALIGN + 777
    flat = torch.randn(n, generator=gen)
    ref_flat = flat.clone()
    views, ref_views = _views(flat), _views(ref_flat)
    opt, ref = cls(views, fused=True, **kw), cls(ref_views, fused=True, **kw)
    copy = torch.full((n,), float("nan"), dtype=torch.bfloat16)  # poisoned: every element must be written
    for step in range(4):
        coef = torch.rand((), generator=gen) if step % 2 else None
        for v, r in zip(views, ref_views):
            g = torch.randn(v.shape, generator=gen)
            v.grad, r.grad = g.clone(), g.clone()
        if step == 0:  # the state does not exist yet: the optimizer's own step makes it
            assert not step_in_chunks([(opt, views, _settings(opt))], coef, flat, copy, chunk)
            opt.step()
            copy.copy_(flat)
        else:
            versions = [v._version for v in views]
            assert step_in_chunks([(opt, views, _settings(opt))], coef, flat, copy, chunk, pool=pool)
            assert all(v._version > was for v, was in zip(views, versions)), "the update's writes were not counted"
        if coef is not None:
            torch._foreach_mul_([r.grad for r in ref_views], coef)
        ref.step()
        assert torch.equal(flat, ref_flat), f"step {step}: max |diff| {(flat - ref_flat).abs().max().item():.3e}"
        assert torch.equal(copy, ref_flat.to(torch.bfloat16)), f"step {step}: the compute copy differs"
        for v, r in zip(views, ref_views):
            assert torch.equal(v.grad, r.grad), "the scaled gradient differs"
            for key, value in ref.state[r].items():
                assert torch.equal(opt.state[v][key], value), f"step {step}: state {key} differs"


def _stepped(cls: Any, **kw: Any) -> tuple[torch.optim.Optimizer, list[torch.Tensor], torch.Tensor]:
    flat = torch.randn(3 * ALIGN)
    views = _views(torch.cat([flat, torch.zeros(sum(SPLITS))]))
    opt = cls(views, **kw)
    for v in views:
        v.grad = torch.randn(v.shape)
    opt.step()
    return opt, views, views[0].detach()


@pytest.mark.parametrize("make", [
    lambda: _stepped(torch.optim.SGD, lr=0.1, momentum=0.9),
    lambda: _stepped(torch.optim.AdamW, lr=0.1),  # foreach, not fused
    lambda: _stepped(torch.optim.RMSprop, lr=0.1),
    lambda: _stepped(type("MyAdamW", (torch.optim.AdamW,), {}), lr=0.1, fused=True),  # a subclass may differ
], ids=["sgd", "adamw-foreach", "rmsprop", "adamw-subclass"])
def test_other_optimizers_take_their_own_step(make):
    opt, views, _ = make()
    before = [v.clone() for v in views]
    flat = views[0]._base if views[0]._base is not None else views[0]
    assert not step_in_chunks([(opt, views, _settings(opt))], None, flat, None)
    assert all(torch.equal(a, b) for a, b in zip(views, before)), "a refused step changed the parameters"


def test_parameters_outside_the_shard_need_the_whole_copy():
    """With a compute copy to write, parameters that are no view of the shard are refused (the caller copies the
    whole shard); without one they are stepped."""
    params = [torch.randn(100), torch.randn(50)]
    opt = torch.optim.AdamW(params, fused=True)
    for p in params:
        p.grad = torch.randn(p.shape)
    opt.step()
    flat = torch.randn(150)
    assert not step_in_chunks([(opt, params, _settings(opt))], None, flat, torch.empty(150, dtype=torch.bfloat16))
    assert step_in_chunks([(opt, params, _settings(opt))], None, flat, None)


@pytest.mark.parametrize("chunk", [0, -ALIGN, ALIGN + 1])
def test_bad_chunk_is_refused(chunk):
    p = torch.randn(10)
    opt = torch.optim.AdamW([p], fused=True)
    with pytest.raises(ValueError, match=f"multiple of {ALIGN}.*{chunk}"):
        step_in_chunks([(opt, [p], _settings(opt))], None, p, None, chunk)


@pytest.mark.parametrize("tiles", [False, True], ids=["chunks", "tiles"])
@pytest.mark.parametrize("scaled,copied", [(False, False), (True, False), (False, True)],
                         ids=["plain", "scale", "copy"])
def test_chunks_only_where_a_pass_shares_the_cache(monkeypatch, scaled, copied, tiles, tile_pool):
    """With neither clipping's scale nor the compute copy each parameter takes one kernel call (chunks would only add
    per-call overhead), on the caller's thread even where a tile pool is given; with either, one call per chunk
    (``tiles``: on the pool's threads). Equal to torch's fused step either way."""
    from shardfuse.sharding.host import _host_fused

    calls: list[int] = []
    real = _host_fused.call_fused_adam

    threads: set[str] = set()

    def counting(kernel, params, *args, **kwargs):
        calls.append(params[0].numel())
        threads.add(threading.current_thread().name)
        return real(kernel, params, *args, **kwargs)

    monkeypatch.setattr(_host_fused, "call_fused_adam", counting)
    n = sum(SPLITS) + 3 * ALIGN + 777
    flat = torch.randn(n, generator=torch.Generator().manual_seed(3))
    ref_flat = flat.clone()
    views, ref_views = _views(flat), _views(ref_flat)
    opt = torch.optim.AdamW(views, lr=1e-2, fused=True)
    ref = torch.optim.AdamW(ref_views, lr=1e-2, fused=True)
    copy = torch.empty(n, dtype=torch.bfloat16)
    for step in range(2):
        for v, r in zip(views, ref_views):
            v.grad = torch.randn(v.shape, generator=torch.Generator().manual_seed(step))
            r.grad = v.grad.clone()
        coef = torch.tensor(0.25) if scaled else None
        if step == 0:  # the optimizer's own step makes the state
            if coef is not None:
                torch._foreach_mul_([v.grad for v in views], coef)
            opt.step()
            copy.copy_(flat)
        else:
            assert step_in_chunks([(opt, views, _settings(opt))], coef, flat, copy if copied else None, ALIGN,
                                  pool=tile_pool if tiles else None)
        if coef is not None:
            torch._foreach_mul_([r.grad for r in ref_views], coef)
        ref.step()
    assert torch.equal(flat, ref_flat)
    if copied:
        assert torch.equal(copy, ref_flat.to(torch.bfloat16)), "the compute copy differs"
    whole = [v.numel() for v in views]
    if scaled or copied:
        assert len(calls) > len(views) and max(calls) <= ALIGN, f"kernel calls over {calls} elements"
    else:
        assert calls == whole, f"kernel calls over {calls} elements, expected one per parameter {whole}"
    on_pool = {t for t in threads if t.startswith("shardfuse-host-tile-")}
    assert bool(on_pool) == (tiles and (scaled or copied)), f"kernel calls ran on {threads}"
