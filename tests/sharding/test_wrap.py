"""Auto-wrapping: which modules each policy wraps, nested configs, overrides and every error.

A dummy wrapper class records what it wrapped and with which arguments, so no process group is needed.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib

import pytest
import torch
from torch import nn

from shardfuse.sharding._wrap import (
    ModuleClassWrapPolicy,
    auto_wrap,
    config_auto_wrap_policy,
    default_auto_wrap_policy,
    enable_wrap,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
    wrap,
)


class Recorder(nn.Module):
    """Stands in for FullyShardedDataParallel: keeps the module and the arguments it was built with."""

    def __init__(self, module: nn.Module, **kwargs):
        super().__init__()
        self.module = module
        self.kwargs = kwargs

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


class OtherWrapper(Recorder):
    pass


class Block(nn.Module):
    # 8*16+16 + 16*8+8 = 280 parameters; lin1 has 144, lin2 136.
    def __init__(self):
        super().__init__()
        self.lin1 = nn.Linear(8, 16)
        self.lin2 = nn.Linear(16, 8)

    def forward(self, x):
        return x + self.lin2(torch.relu(self.lin1(x)))


class Net(nn.Module):
    # embed 88 + 3 blocks 840 + head 45 = 973 parameters.
    def __init__(self, n_blocks: int = 3):
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.layers = nn.ModuleList([Block() for _ in range(n_blocks)])
        self.head = nn.Linear(8, 5)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def wrapped_paths(model: nn.Module) -> dict[str, str]:
    """{path of each Recorder: class name of what it wraps}, paths without the wrappers' own '.module'."""
    out = {}
    for name, mod in model.named_modules():
        if isinstance(mod, Recorder):
            out[name.replace(".module", "").replace("module.", "") if name != "" else ""] = type(mod.module).__name__
    return out


def test_outside_enable_wrap_returns_module_unchanged():
    net = Net()
    assert wrap(net) is net
    assert auto_wrap(net, auto_wrap_policy=ModuleClassWrapPolicy({Block})) is net
    assert wrapped_paths(net) == {}


BLOCK_PATHS = {"layers.0": "Block", "layers.1": "Block", "layers.2": "Block"}


@pytest.mark.parametrize(
    "policy",
    [
        ModuleClassWrapPolicy({Block}),
        functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}),
        functools.partial(size_based_auto_wrap_policy, min_num_params=280),
    ],
    ids=["class_policy", "transformer_partial", "size_280"],
)
def test_policies_wrap_each_block_and_keep_forward(policy):
    net = Net()
    ref = copy.deepcopy(net)
    tokens = torch.randint(0, 11, (2, 7))
    with enable_wrap(wrapper_cls=Recorder, flag=1):
        out = auto_wrap(net, auto_wrap_policy=policy)
    assert out is net  # the root itself is not wrapped by these policies
    assert wrapped_paths(net) == BLOCK_PATHS
    assert isinstance(net.layers, nn.ModuleList)
    assert all(layer.kwargs == {"flag": 1} for layer in net.layers)
    torch.testing.assert_close(net(tokens), ref(tokens), rtol=0, atol=0)
    assert {n.replace("module.", "") for n, _ in net.named_parameters()} == {n for n, _ in ref.named_parameters()}


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        (dict(min_num_params=int(1e8)), {}),
        (dict(min_num_params=973), {"": "Net"}),
        (dict(min_num_params=974), {}),
        (
            dict(min_num_params=100),
            # Linears >= 100 wrapped; each Block then has 0 left; the root keeps 88+45 = 133 >= 100.
            {"": "Net", **{f"layers.{i}.{lin}": "Linear" for i in range(3) for lin in ("lin1", "lin2")}},
        ),
        # As in FairScale, the root check is only skipped once the root is descended into (973 >= 280).
        (dict(min_num_params=280, skip_params_check_for_root=True), {"": "Net", **BLOCK_PATHS}),
        (dict(min_num_params=int(1e8), skip_params_check_for_root=True), {}),
        (dict(min_num_params=840), {"": "Net"}),  # the ModuleList holds 840 but is never wrapped itself
    ],
    ids=[
        "huge_threshold", "exactly_total", "above_total", "threshold_100",
        "skip_root_check", "skip_root_check_small_root", "modulelist_excluded",
    ],
)
def test_size_based_policy(kwargs, expected):
    net = Net()
    with enable_wrap(wrapper_cls=Recorder):
        net = auto_wrap(net, auto_wrap_policy=functools.partial(size_based_auto_wrap_policy, **kwargs))
    assert wrapped_paths(net) == expected
    assert not any(isinstance(m, Recorder) and isinstance(m.module, nn.ModuleList) for m in net.modules())


def test_default_policy_is_size_based_with_fairscale_threshold():
    assert default_auto_wrap_policy is size_based_auto_wrap_policy
    net = Net()
    with enable_wrap(wrapper_cls=Recorder):  # no policy anywhere: 1e8 parameters, so nothing here
        assert auto_wrap(net) is net
    assert wrapped_paths(net) == {}


def test_multihead_attention_is_a_leaf():
    model = nn.Sequential(nn.MultiheadAttention(16, 2), nn.Linear(16, 16))
    policy = functools.partial(size_based_auto_wrap_policy, min_num_params=200)
    with enable_wrap(wrapper_cls=Recorder):
        model = auto_wrap(model, auto_wrap_policy=policy)
    # As in FairScale: MHA (1088 params) is neither descended into (its out_proj stays with it) nor wrapped
    # on its own; its parameters stay in the parent's unit, which is then large enough to be wrapped.
    assert wrapped_paths(model) == {"": "Sequential", "1": "Linear"}


def test_nested_class_instances_are_each_wrapped_bottom_up():
    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Block()
            self.extra = nn.Linear(8, 8)

    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = Outer()
            self.b = Block()

    model = Holder()
    with enable_wrap(wrapper_cls=Recorder):
        model = auto_wrap(model, auto_wrap_policy=ModuleClassWrapPolicy([Outer, Block]))
    assert wrapped_paths(model) == {"a": "Outer", "a.inner": "Block", "b": "Block"}


def test_policy_without_module_is_root_and_root_flag():
    calls = []

    def three_arg(module, recurse, unwrapped_params):
        calls.append((type(module).__name__, recurse, unwrapped_params))
        return recurse or isinstance(module, Block)

    roots = []

    def with_root(module, recurse, unwrapped_params, module_is_root=False):
        roots.append((type(module).__name__, module_is_root))
        return recurse or isinstance(module, Block)

    with enable_wrap(wrapper_cls=Recorder):
        net = auto_wrap(Net(), auto_wrap_policy=three_arg)
        assert wrapped_paths(net) == BLOCK_PATHS
        auto_wrap(Net(), auto_wrap_policy=with_root)
    # Bottom-up: the root is asked to descend first and asked about itself last, with what is left unwrapped.
    assert calls[0] == ("Net", True, 973) and calls[-1] == ("Net", False, 133)
    assert ("Block", False, 280) in calls
    assert {name for name, is_root in roots if is_root} == {"Net"}


def test_nested_enable_wrap_layers_kwargs_and_restores():
    with enable_wrap(wrapper_cls=Recorder, a=1, b=2, auto_wrap_policy=ModuleClassWrapPolicy({Block})):
        assert wrap(nn.Linear(2, 2)).kwargs == {"a": 1, "b": 2}
        with enable_wrap(wrapper_cls=Recorder, b=3, c=4):
            assert wrap(nn.Linear(2, 2)).kwargs == {"a": 1, "b": 3, "c": 4}
            # The inner context keeps the outer policy.
            assert wrapped_paths(auto_wrap(Net())) == BLOCK_PATHS
        with enable_wrap(wrapper_cls=OtherWrapper, z=9):
            w = wrap(nn.Linear(2, 2))
            assert type(w) is OtherWrapper and w.kwargs == {"z": 9}
            assert wrapped_paths(auto_wrap(Net())) == {}  # a different class starts afresh: default policy
        assert wrap(nn.Linear(2, 2)).kwargs == {"a": 1, "b": 2}
    lin = nn.Linear(2, 2)
    assert wrap(lin) is lin


def test_context_restored_after_exception():
    with pytest.raises(RuntimeError, match="boom"), enable_wrap(wrapper_cls=Recorder):
        raise RuntimeError("boom")
    lin = nn.Linear(2, 2)
    assert wrap(lin) is lin


def test_override_priority():
    lin = nn.Linear(2, 2)
    lin.wrapper_config = {"b": "module", "c": "module"}
    with enable_wrap(wrapper_cls=Recorder, a="ctx", b="ctx", c="ctx"):
        w = wrap(lin, c="call")
    assert w.kwargs == {"a": "ctx", "b": "module", "c": "call"}
    with enable_wrap(wrapper_cls=Recorder, a="ctx"):
        net = auto_wrap(Net(), auto_wrap_policy=ModuleClassWrapPolicy({Block}), a="auto", d="auto")
    assert all(layer.kwargs == {"a": "auto", "d": "auto"} for layer in net.layers)


def test_config_policy_wraps_modules_with_wrapper_config():
    net = Net()
    net.layers[1].wrapper_config = {"reshard_after_forward": False}
    net.head.wrapper_config = {}
    net.layers.wrapper_config = {"x": 1}  # a container: still never wrapped
    with enable_wrap(wrapper_cls=Recorder, reshard_after_forward=True):
        net = auto_wrap(net, auto_wrap_policy=config_auto_wrap_policy)
    assert wrapped_paths(net) == {"layers.1": "Block", "head": "Linear"}
    assert net.layers[1].kwargs == {"reshard_after_forward": False}
    assert net.head.kwargs == {"reshard_after_forward": True}


def test_manual_nested_wrapping_then_root():
    with enable_wrap(wrapper_cls=Recorder):
        net = Net()
        for i, layer in enumerate(net.layers):
            net.layers[i] = wrap(layer)
        root = wrap(net)  # wrapping around wrapped children is how the root unit is made
    assert wrapped_paths(root) == {"": "Net", **BLOCK_PATHS}


def test_policy_dataclass_is_frozen_and_hashable():
    p = ModuleClassWrapPolicy([Block, Block])
    assert p.module_classes == frozenset({Block})
    assert p == ModuleClassWrapPolicy({Block}) and hash(p) == hash(ModuleClassWrapPolicy({Block}))
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.module_classes = frozenset()
    assert ModuleClassWrapPolicy(Block).module_classes == frozenset({Block})


# ----------------------------------------------------------------------------------------------- errors


def test_wrap_already_wrapped_raises():
    with enable_wrap(wrapper_cls=Recorder):
        w = wrap(nn.Linear(2, 2))
        with pytest.raises(ValueError, match=r"already wrapped \(Recorder\): wrap each module once"):
            wrap(w)


def test_auto_wrap_inside_wrapped_submodule_raises():
    net = Net()
    with enable_wrap(wrapper_cls=Recorder):
        net.layers[1] = wrap(net.layers[1])
        with pytest.raises(ValueError, match=r"already-wrapped module \(Recorder\) at submodule 'layers.1'"):
            auto_wrap(net, auto_wrap_policy=ModuleClassWrapPolicy({Block}))
        root = wrap(Net())
        with pytest.raises(ValueError, match="at the module itself: call auto_wrap on the unwrapped model"):
            auto_wrap(root, auto_wrap_policy=ModuleClassWrapPolicy({Block}))


def test_shared_module_raises():
    shared = Block()
    model = nn.ModuleDict({"a": nn.Sequential(shared), "b": nn.Sequential(shared)})
    with enable_wrap(wrapper_cls=Recorder), pytest.raises(ValueError, match=r"'b.0' a second time .*'a.0'"):
        auto_wrap(model, auto_wrap_policy=ModuleClassWrapPolicy({Block}))


def test_bad_arguments_raise():
    with pytest.raises(TypeError, match="wrapper_cls=...\\) must be a class"), enable_wrap(wrapper_cls=lambda m: m):
        pass
    with pytest.raises(TypeError, match="auto_wrap_policy must be callable, got 3"), enable_wrap(
        wrapper_cls=Recorder, auto_wrap_policy=3
    ):
        pass
    with enable_wrap(wrapper_cls=Recorder):
        with pytest.raises(TypeError, match="auto_wrap_policy must be callable, got 'x'"):
            auto_wrap(Net(), auto_wrap_policy="x")
        with pytest.raises(TypeError, match=r"wrap\(\) takes an nn.Module, got int"):
            wrap(3)
        with pytest.raises(TypeError, match=r"auto_wrap\(\) takes an nn.Module, got list"):
            auto_wrap([])
        with pytest.raises(TypeError, match="transformer_layer_cls must be nn.Module subclasses"):
            bad = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=[int])
            auto_wrap(Net(), auto_wrap_policy=bad)
    with pytest.raises(TypeError, match=r"module_classes must be nn.Module subclasses, got \['Block'\]"):
        ModuleClassWrapPolicy({"Block"})
    with pytest.raises(ValueError, match=r"container classes \['ModuleList'\]"):
        ModuleClassWrapPolicy({nn.ModuleList})
    with pytest.raises(ValueError, match="needs at least one class"):
        ModuleClassWrapPolicy(set())


def test_default_wrapper_is_shardfuse_fsdp():
    fsdp = pytest.importorskip("shardfuse.sharding._fully_sharded")
    wrap_mod = importlib.import_module("shardfuse.sharding._wrap")  # the package may re-export wrap() by name
    with enable_wrap():
        assert wrap_mod._CONFIG.get().wrapper_cls is fsdp.FullyShardedDataParallel
