"""A parameter shared between two sibling units (FairScale's ``test_fsdp_shared_weights.py`` and the tied
embedding / output projection of ``test_fsdp_shared_weights_mevo.py``, re-typed for CPU): the unit wrapped first
flattens it, the other borrows it; training, state dicts, summoning and no_sync match the unsharded model (2 gloo
ranks, the same input on both)."""

from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardfuse import FullyShardedDataParallel as FSDP

WORLD = 2
TOL = dict(rtol=1e-6, atol=1e-6)


class _Model(nn.Module):
    """FairScale's model: l1 and l3 share the weight or the bias; with ``fsdp`` l1, l2, l3 are sibling units."""

    def __init__(self, sharing: str = "share_none", fsdp: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.l0, self.l1, self.l2, self.l3 = (nn.Linear(4, 4) for _ in range(4))
        if sharing == "share_only_weights":
            self.l1.weight = self.l3.weight
        elif sharing == "share_only_bias":
            self.l1.bias = self.l3.bias
        if fsdp is not None:
            self.l1 = FSDP(self.l1, flatten_parameters=False, **fsdp.get("l1", {}))
            self.l2 = FSDP(self.l2, flatten_parameters=fsdp.get("inner_flat", False))
            self.l3 = FSDP(self.l3, flatten_parameters=False, **fsdp.get("l3", {}))
            if sharing == "share_only_weights":
                self.l3.append_shared_param(self.l1.module.weight)
            elif sharing == "share_only_bias":
                self.l3.append_shared_param(self.l1.module.bias)

    def forward(self, x: torch.Tensor, skip_l1: bool = False) -> torch.Tensor:
        x = self.l0(x)
        if not skip_l1:
            x = self.l1(x)
        return self.l3(self.l2(x))


def _pair(sharing: str, fsdp: dict[str, Any], outer_flat: bool = False) -> tuple[nn.Module, FSDP]:
    """The unsharded model and the sharded one loaded from its state dict (every key, shared ones twice)."""
    torch.manual_seed(0)
    ref = _Model(sharing)
    torch.manual_seed(1)  # other initial values: only load_state_dict makes the two agree
    model = FSDP(_Model(sharing, fsdp), flatten_parameters=outer_flat)
    model.load_state_dict(copy.deepcopy(ref.state_dict()))
    return ref, model


def _train(model: nn.Module, x: torch.Tensor, steps: int = 3, **fwd: Any) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        model(x, **fwd).sum().backward()
        opt.step()
        model.zero_grad(set_to_none=True)


def _assert_same_state(model: FSDP, ref: nn.Module) -> None:
    sd, want = model.state_dict(), ref.state_dict()
    assert list(sd) == list(want), (list(sd), list(want))
    for k, v in want.items():
        torch.testing.assert_close(sd[k], v, **TOL, msg=k)


def check_shared_weight(sharing: str, inner_flat: bool, outer_flat: bool) -> bool:
    ref, model = _pair(sharing, {"inner_flat": inner_flat}, outer_flat)
    x = torch.rand(1, 4, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(model(x), ref(x), **TOL)
    before = copy.deepcopy(ref.state_dict())
    _train(ref, x)
    _train(model, x)
    assert any(not torch.equal(before[k], v) for k, v in ref.state_dict().items())
    _assert_same_state(model, ref)
    # The shared parameter is one parameter of the model, registered by its lender; the borrower does not own it.
    l1, l3 = model.module.l1, model.module.l3
    shared = {"share_only_weights": "weight", "share_only_bias": "bias"}.get(sharing)
    # Sharded views, as FairScale's un-flattened parameters are: this rank's piece of each.
    assert l1.non_shared_params() == [l1.module._parameters["weight"], l1.module._parameters["bias"]]
    assert l3.non_shared_params() == [l3.module._parameters[n] for n in ("weight", "bias") if n != shared]
    if shared is not None:
        assert getattr(l1.module, shared) is getattr(l3.module, shared), "the attributes show one placeholder"
        assert l1.module._parameters[shared] is l3.module._parameters[shared]
        assert not any(p is l1.module._parameters[shared] for p in l3.non_shared_params())
    if not inner_flat and not outer_flat:
        assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
    with pytest.raises(ValueError, match="does not share"):
        l3.append_shared_param(model.module.l2.module.weight)
    with pytest.raises(ValueError, match="flattened itself"):
        l3.append_shared_param(l3.module.bias if shared != "bias" else l3.module.weight)
    return True


@pytest.mark.parametrize("outer_flat", [True, False], ids=["outer_flat", "outer_nonflat"])
@pytest.mark.parametrize("inner_flat", [True, False], ids=["inner_flat", "inner_nonflat"])
@pytest.mark.parametrize("sharing", ["share_none", "share_only_weights", "share_only_bias"])
def test_shared_weight(pool, sharing, inner_flat, outer_flat):
    assert pool.run(check_shared_weight, sharing, inner_flat, outer_flat) == [True] * WORLD


def check_variants(case: str) -> bool:
    """Eval and no_grad forwards, reshard_after_forward=False on either side, no_sync accumulation, steps in
    which only the borrower uses the shared weight; then summoning, a nested unit's state dict, consolidation."""
    fsdp: dict[str, Any] = {
        "keep_l1": {"l1": {"reshard_after_forward": False}},
        "keep_l3": {"l3": {"reshard_after_forward": False}},
        "keep_both": {"l1": {"reshard_after_forward": False}, "l3": {"reshard_after_forward": False}},
    }.get(case, {})
    ref, model = _pair("share_only_weights", fsdp)
    x = torch.rand(2, 4, generator=torch.Generator().manual_seed(3))
    if case == "eval":
        model.eval()
        ref.eval()
        for _ in range(3):
            torch.testing.assert_close(model(x), ref(x), **TOL)
            with torch.no_grad():
                torch.testing.assert_close(model(x), ref(x), **TOL)
        _train(ref, x)
        _train(model, x)
    elif case == "no_sync":
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, model)]
        for _ in range(2):
            for m, opt in zip((ref, model), opts):
                with m.no_sync() if m is model else torch.enable_grad():
                    m(x).sum().backward()
                m(x[:1]).pow(2).sum().backward()
                opt.step()
                opt.zero_grad()
    elif case == "borrower_only":
        _train(ref, x, skip_l1=True)
        _train(model, x, skip_l1=True)
    else:
        _train(ref, x)
        _train(model, x)
    _assert_same_state(model, ref)
    assert not any(h.step.is_full for m in model.modules() if isinstance(m, FSDP) for h in m._unit.handles
                   if m is not model), "every nested unit is resharded after the step"
    # summon_full_params shows the full value at both places, as one parameter; in-place changes go back.
    with model.summon_full_params():
        l1, l3 = model.module.l1.module, model.module.l3.module
        assert l1.weight is l3.weight
        torch.testing.assert_close(l3.weight, ref.l3.weight, **TOL)
        with torch.no_grad():
            l3.weight.add_(1.0)
    with torch.no_grad():
        ref.l3.weight.add_(1.0)
    _assert_same_state(model, ref)
    # Summoning the borrower alone gathers the lender's handle for it.
    with model.module.l3.summon_full_params():
        torch.testing.assert_close(model.module.l3.module.weight, ref.l3.weight, **TOL)
    # A nested unit's own state dict names the borrowed parameter, valued from its lender.
    torch.testing.assert_close(model.module.l3.state_dict()["weight"], ref.l3.weight, **TOL)
    # Consolidating every rank's local shards gives the shared parameter under both names.
    shards = [None] * dist.get_world_size()
    dist.all_gather_object(shards, (model.local_state_dict(), model.local_metadata_dict()))
    full = FSDP.consolidate_shard_weights([s[0] for s in shards], [s[1] for s in shards])
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(full[k], v, **TOL, msg=k)
    return True


@pytest.mark.parametrize("case", ["eval", "keep_l1", "keep_l3", "keep_both", "no_sync", "borrower_only"])
def test_shared_weight_variants(pool, case):
    assert pool.run(check_variants, case) == [True] * WORLD


class _TiedLM(nn.Module):
    """The mevo test's shape on CPU: the output projection (a sibling of the embedding) reuses its weight."""

    def __init__(self, wrap_middle: str = "") -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.middle = nn.Linear(6, 6)
        self.ln = nn.LayerNorm(6)
        self.out = _Projection(self.embed.weight)
        if wrap_middle:  # "none", "flat" or "nonflat": the sharing pair is wrapped, the middle layer as named
            self.embed = FSDP(self.embed, flatten_parameters=False)
            self.out = FSDP(self.out, flatten_parameters=False)
            self.out.append_shared_param(self.embed.module.weight)
        if wrap_middle in ("flat", "nonflat"):
            self.middle = FSDP(self.middle, flatten_parameters=wrap_middle == "flat")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.out(self.ln(self.middle(self.embed(ids))))
        return F.cross_entropy(logits.flatten(0, 1), ((ids + 1) % 11).flatten(), reduction="sum")


class _Projection(nn.Module):
    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight
        self.scale = nn.Parameter(torch.ones(()))  # a parameter of its own, as FairScale requires

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self.weight.t() * self.scale


def check_tied_lm(wrap_middle: str) -> bool:
    torch.manual_seed(0)
    ref = _TiedLM()
    model = FSDP(_TiedLM(wrap_middle))
    model.load_state_dict(ref.state_dict())
    ids = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(4))
    model.eval()
    ref.eval()
    for _ in range(2):
        torch.testing.assert_close(model(ids), ref(ids), **TOL)
        with torch.no_grad():
            torch.testing.assert_close(model(ids), ref(ids), **TOL)
    model.train()
    ref.train()
    _train(ref, ids)
    _train(model, ids)
    sd, want = model.state_dict(), ref.state_dict()
    assert list(sd) == list(want), (list(sd), list(want))
    for k, v in want.items():
        torch.testing.assert_close(sd[k], v, rtol=1e-5, atol=1e-5, msg=k)
    return True


@pytest.mark.parametrize("wrap_middle", ["none", "flat", "nonflat"])
def test_tied_embedding_and_projection(pool, wrap_middle):
    assert pool.run(check_tied_lm, wrap_middle) == [True] * WORLD


class _FlatPair(nn.Module):
    """Two sibling units with flat parameters (``flatten_parameters=True``) sharing a weight."""

    def __init__(self, wrap: bool = False) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.b.weight = self.a.weight
        if wrap:
            self.a, self.b = FSDP(self.a), FSDP(self.b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def check_flat_units(pickled: bool) -> bool:
    """Flat lender and flat borrower; optionally pickled before first use (FairScale's convention: set the process
    groups again), after which both come back sharing one handle. The same seed builds both models."""
    torch.manual_seed(0)
    ref = _FlatPair()
    torch.manual_seed(0)
    model = FSDP(_FlatPair(wrap=True))
    assert model.module.b.non_shared_params() == [model.module.b._unit.handles[0].flat]
    if pickled:
        model = pickle.loads(pickle.dumps(model))
        for m in model.modules():
            if isinstance(m, FSDP):
                m.process_group = m.process_group_reduce_scatter = dist.group.WORLD
    x = torch.rand(2, 4, generator=torch.Generator().manual_seed(5))
    _train(ref, x)
    _train(model, x)
    torch.testing.assert_close(model(x), ref(x), **TOL)
    _assert_same_state(model, ref)
    return True


@pytest.mark.parametrize("pickled", [False, True], ids=["plain", "pickled"])
def test_flat_units_share(pool, pickled):
    assert pool.run(check_flat_units, pickled) == [True] * WORLD


def check_errors() -> bool:
    # The lender outside the borrower's tree: one root must run both.
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    b.weight = a.weight
    fa, fb = FSDP(a, flatten_parameters=False), FSDP(b, flatten_parameters=False)
    with pytest.raises(RuntimeError, match="outside its tree .* one outer FullyShardedDataParallel"):
        fb(torch.rand(1, 4))
    assert fa(torch.rand(1, 4)).shape == (1, 4)
    # A unit nested inside the borrower lends: refused when wrapping (only siblings share).
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    b.weight = a.weight
    seq = nn.Sequential(FSDP(a), b)
    with pytest.raises(ValueError, match="nested inside this Sequential: parameters are shared only between sibling"):
        FSDP(seq)
    # A lender or borrower cannot hand its parameters back to be wrapped again.
    model = FSDP(_Model("share_only_weights", {}))
    with pytest.raises(RuntimeError, match="shares parameters .*'weight'.* wrap the whole model anew"):
        FSDP(model.module.l3.module)
    return True


def test_shared_weight_errors(pool):
    assert pool.run(check_errors) == [True] * WORLD
