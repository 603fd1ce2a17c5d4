"""A parameter's link to its ``FlatParamHandle`` is an attribute on the parameter (``HandleRef``), not a
module-level table (issue 29): it is weak (the handle, so the model, dies with the model), it holds for that very
tensor only (a shallow copy finds nothing, a deep copy gets a dead link), and it pickles as an empty ``set``, so a
saved parameter or state dict loads with ``torch.load(weights_only=True)`` (one process, a one-rank group)."""

from __future__ import annotations

import copy
import gc
import io
import pickle
import weakref

import pytest
import torch
from torch import nn

from shardfuse.sharding import FullyShardedDataParallel as FSDP
from shardfuse.sharding.core import _registry
from shardfuse.sharding.core._registry import FLATTENED_LINK, HANDLE_LINK, HandleRef, flattened_into, handle_of
from tests.sharding.test_ssd_offload import _flat_handles, _Group

MODES = ["flat", "use_orig_params"]


def _net() -> nn.Sequential:
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def _wrap(net: nn.Module, mode: str) -> FSDP:
    kw = {"use_orig_params": True} if mode == "use_orig_params" else {}
    net[0] = FSDP(net[0], process_group=_Group(), **kw)
    return FSDP(net, process_group=_Group(), **kw)


def _sharded(model: FSDP) -> list[torch.Tensor]:
    """Every tensor linked to a handle: the flat parameters and, with use_orig_params, the views."""
    out: list[torch.Tensor] = []
    for h in _flat_handles(model):
        out.append(h.flat)
        out.extend(h.orig_views or [])
    return out


def _load(obj: object) -> object:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("mode", MODES)
def test_links_are_weak_attributes_and_die_with_the_model(mode):
    net = _net()
    originals = list(net.parameters())
    model = _wrap(net, mode)
    model(torch.randn(2, 5)).sum().backward()
    sharded = _sharded(model)
    assert len(sharded) == (2 if mode == "flat" else 2 + 4)
    for t in sharded:
        assert isinstance(t.__dict__.get(HANDLE_LINK), HandleRef), "the link is an attribute of the parameter"
        assert any(handle_of(t) is h for h in _flat_handles(model))
    for i, p in enumerate(originals):
        found = flattened_into(p)
        assert isinstance(p.__dict__.get(FLATTENED_LINK), HandleRef)
        assert found is not None and found[0] in _flat_handles(model) and found[1] == i % 2
    handles = [weakref.ref(h) for h in _flat_handles(model)]
    model_ref = weakref.ref(model)
    del model, net, found
    gc.collect()
    assert model_ref() is None, "a parameter's link keeps its model alive"
    assert all(h() is None for h in handles)
    assert all(handle_of(t) is None for t in sharded)
    assert all(flattened_into(p) is None for p in originals)
    # No module-level table was left behind to grow (the old _HANDLES/_FLATTENED dicts).
    assert not [n for n, v in vars(_registry).items()
                if not n.startswith("__") and isinstance(v, (dict, list, set, weakref.WeakValueDictionary))]


@pytest.mark.parametrize("mode", MODES)
def test_copies_are_not_linked(mode):
    net = _net()
    originals = list(net.parameters())
    model = _wrap(net, mode)
    for t in [*_sharded(model), *originals]:
        linked = handle_of(t) if HANDLE_LINK in t.__dict__ else flattened_into(t)
        assert linked is not None
        shallow = copy.copy(t)
        assert shallow is not t
        assert handle_of(shallow) is None and flattened_into(shallow) is None, "a shallow copy is another tensor"
        deep = copy.deepcopy(t)
        assert handle_of(deep) is None and flattened_into(deep) is None
        # The original keeps its link.
        assert (handle_of(t) if HANDLE_LINK in t.__dict__ else flattened_into(t)) == linked
    # A tensor deep copy copies the attributes: the copied link is dead, even for the tensor it was made for.
    view = _sharded(model)[0].detach()
    _registry.register_handle(view, _flat_handles(model)[0])
    dead = copy.deepcopy(view).__dict__[HANDLE_LINK]
    assert isinstance(dead, HandleRef) and dead.handle_for(view) is None
    assert handle_of(view) is _flat_handles(model)[0]


@pytest.mark.parametrize("mode", MODES)
def test_weights_only_load_of_parameters_and_state_dicts(mode):
    net = _net()
    originals = list(net.parameters())
    model = _wrap(net, mode)
    model(torch.randn(2, 5)).sum().backward()
    views = {id(v) for h in _flat_handles(model) for v in h.orig_views or []}
    for t in [*_sharded(model), *originals]:
        back = _load(t)
        assert isinstance(back, torch.Tensor) and back.shape == t.shape
        # An original-parameter view pickles as a meta placeholder by design (FlatParamHandle.make_orig_views).
        assert back.is_meta if id(t) in views else torch.equal(back, t.detach())
        assert handle_of(back) is None and flattened_into(back) is None
        for attr in (HANDLE_LINK, FLATTENED_LINK):
            assert back.__dict__.get(attr, set()) == set()
    sd = model.state_dict()
    back = _load({"model": sd, "flat": [h.flat for h in _flat_handles(model)]})
    assert list(back["model"]) == list(sd)
    for k, v in sd.items():
        assert torch.equal(back["model"][k], v), k
    for a, b in zip(back["flat"], _flat_handles(model)):
        assert torch.equal(a, b.flat.detach())


def test_pickling():
    handle = _flat_handles(_wrap(_net(), "flat"))[0]
    ref = HandleRef(handle.flat, handle, 3)
    assert pickle.loads(pickle.dumps(ref)) == set()
    assert copy.copy(ref).handle_for(handle.flat) is handle
    assert copy.deepcopy(ref).handle_for(handle.flat) is None and copy.deepcopy(ref).index == 3
    p = pickle.loads(pickle.dumps(handle.flat))
    assert torch.equal(p, handle.flat) and handle_of(p) is None
    # A pickled model links its unpickled shards to its unpickled handles again (FlatParamHandle.__setstate__).
    model = _wrap(_net(), "use_orig_params")
    twin = pickle.loads(pickle.dumps(model))
    for a, b in zip(_flat_handles(model), _flat_handles(twin)):
        assert b is not a and handle_of(b.flat) is b and handle_of(a.flat) is a
        assert all(handle_of(v) is b for v in b.orig_views)
