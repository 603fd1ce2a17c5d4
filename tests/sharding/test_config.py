"""Settings, their one home and their rules; per-step state; the process-wide hooks and their switch.

In-process, over a duck-typed process group of one rank (FairScale accepts any object with rank()/size()), so
no worker pool is needed.
"""

from __future__ import annotations

import inspect
import logging
import pickle

import pytest
import torch
from torch import nn

import shardfuse
from shardfuse import FullyShardedDataParallel as FSDP
from shardfuse.sharding.core import _process_hooks
from shardfuse.sharding.core._config import OPTIONS, ConfigView, _Setting
from shardfuse.sharding.core._step_state import HandleStep

LIVE = {"gradient_predivide_factor", "no_broadcast_optim_state"}  # read from the unit, not the frozen config


class _Group:
    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 1


def _wrap(module: nn.Module, **kw: object) -> FSDP:
    return FSDP(module, process_group=_Group(), **kw)


def _net() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))


# ------------------------------------------------------------------------------------------------------
# one home per setting
# ------------------------------------------------------------------------------------------------------


def test_options_are_the_policy_fields_and_all_show() -> None:
    view = {n for n, v in vars(ConfigView).items() if isinstance(v, _Setting)}
    assert view | LIVE == set(OPTIONS), sorted(set(OPTIONS) ^ (view | LIVE))
    sig = inspect.signature(FSDP)
    for name in [*OPTIONS, "cpu_offload", "param_init_fn"]:
        assert sig.parameters[name].kind is inspect.Parameter.KEYWORD_ONLY, name
        assert f"        {name}: " in FSDP.__doc__, f"{name} is missing from the docstring's Args"
    assert sig.parameters["bucket_cap_mb"].default == 25 and sig.parameters["reshard_after_forward"].default is True


def test_every_option_reads_back_from_its_policy() -> None:
    m = _wrap(_net(), reshard_after_forward=False, disable_reshard_on_root=False, state_dict_on_rank_0_only=True,
              force_input_to_fp32=True, verbose=True, use_orig_params=True, allow_reset_parameters=True,
              gradient_predivide_factor=1.0, state_dict_device="cpu")
    cfg = m._unit.config
    assert (m.reshard_after_forward, m.disable_reshard_on_root) == (False, False) == (
        cfg.reshard.reshard_after_forward, cfg.reshard.disable_reshard_on_root)
    assert m.state_dict_on_rank_0_only and cfg.state_dict.state_dict_on_rank_0_only
    assert m.state_dict_device == torch.device("cpu")
    assert m.force_input_to_fp32 and m.verbose and m.use_orig_params and m.allow_reset_parameters
    assert m.flatten_parameters and m.bucket_cap_mb == 25 and m.compute_device is None
    assert (m.mixed_precision, m.compute_dtype) == (False, None)
    assert (m.move_params_to_cpu, m.move_grads_to_cpu) == (False, False)
    assert m.gradient_predivide_factor == 1.0 and m.gradient_postdivide_factor == 1.0
    assert not m.no_broadcast_optim_state
    with pytest.raises(AttributeError, match="verbose is fixed at wrap time"):
        m.verbose = False


def test_cpu_offload_alias_and_mixed_precision_defaults() -> None:
    m = _wrap(_net(), cpu_offload=True, mixed_precision=True)
    assert m.move_params_to_cpu and m.move_grads_to_cpu
    assert m.compute_dtype == torch.float16 and m.buffer_dtype == torch.float16
    assert _wrap(_net(), flatten_parameters=False).use_orig_params  # FairScale's spelling of the same thing


def test_unknown_and_positional_options_are_refused() -> None:
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['reshard_after_fwd'\]: the options are"):
        _wrap(_net(), reshard_after_fwd=False)
    with pytest.raises(TypeError):
        FSDP(_net(), _Group(), None, False)  # options are keyword-only


def test_float64_parameter_is_named_with_the_fix() -> None:
    net = _net()
    net[2].double()
    with pytest.raises(TypeError, match=r"parameter 2\.weight has dtype torch\.float64.*model\.float\(\)"):
        _wrap(net)


def test_groups_and_divide_factors_have_one_copy() -> None:
    inner = _wrap(nn.Linear(4, 4))
    root = _wrap(nn.Sequential(inner, nn.Linear(4, 2)))
    for u in (root._unit, inner._unit):
        assert all(h.groups is u.groups for h in u.handles) and u.reduce_cfg.groups is u.groups
    new = _Group()
    root.process_group = new
    assert root._unit.handles[0].group is new and root._unit.reduce_cfg.group is root.process_group_reduce_scatter
    root.set_gradient_divide_factors(2.0, 0.5)  # before lazy init: kept through it
    root(torch.randn(3, 4)).sum().backward()
    for m in (root, inner):
        assert (m.gradient_predivide_factor, m.gradient_postdivide_factor) == (2.0, 0.5)
        assert (m._unit.reduce_cfg.predivide, m._unit.reduce_cfg.postdivide) == (2.0, 0.5)


# ------------------------------------------------------------------------------------------------------
# per-step state
# ------------------------------------------------------------------------------------------------------


def test_step_state_resets_at_the_end_of_backward_and_in_pickles() -> None:
    step = HandleStep(is_full=True, gathered_version=3, forward_version=2, ag_event=object(), fired=True,
                      grad_reduced=True)
    step.reset()
    assert step == HandleStep()
    m = _wrap(_net(), disable_reshard_on_root=False)
    h = m._unit.handles[0]
    m(torch.randn(2, 4)).sum().backward()
    assert h.step == HandleStep(), h.step
    m(torch.randn(2, 4))  # mid-step: forward recorded its version
    assert h.step.forward_version is not None
    assert pickle.loads(pickle.dumps(h)).step == HandleStep()


# ------------------------------------------------------------------------------------------------------
# the wrap of a wrapped module is no longer silent
# ------------------------------------------------------------------------------------------------------


class _Rewrapped(nn.Linear):
    pass


def test_wrapping_a_module_again_warns(caplog: pytest.LogCaptureFixture) -> None:
    m = _Rewrapped(3, 3)
    first = _wrap(m)
    with caplog.at_level(logging.WARNING, logger="shardfuse.sharding._fully_sharded"):
        second = _wrap(m)
    assert "_Rewrapped was wrapped again" in caplog.text and "stops working" in caplog.text
    with pytest.raises(RuntimeError, match="gave its parameters to a newer"):
        first(torch.randn(1, 3))
    assert second(torch.randn(1, 3)).shape == (1, 3)


# ------------------------------------------------------------------------------------------------------
# process-wide hooks: one module, a switch
# ------------------------------------------------------------------------------------------------------


@pytest.fixture
def hooks_restored():
    yield
    shardfuse.set_process_hooks(True)
    _process_hooks._enabled = None


def _stale_step() -> None:
    """An optimizer over parameters from before wrapping: refused by the hooks, silent without them."""
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    _wrap(net)
    for p in opt.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    opt.step()


def test_process_hooks_install_at_wrap_and_turn_off(hooks_restored: None) -> None:
    torch_clip = torch.nn.utils.clip_grad.clip_grad_norm_
    _wrap(_net())
    assert _process_hooks.installed() and torch.nn.utils.clip_grad_norm_ is _process_hooks.clip_grad_norm_
    with pytest.raises(RuntimeError, match="build the optimizer after wrapping"):
        _stale_step()
    shardfuse.set_process_hooks(False)
    assert not _process_hooks.installed()
    assert torch.nn.utils.clip_grad_norm_ is not _process_hooks.clip_grad_norm_
    assert torch.nn.utils.clip_grad.clip_grad_norm_ is not _process_hooks.clip_grad_norm_
    assert torch_clip is _process_hooks.clip_grad_norm_  # it was ours while installed
    _stale_step()  # no hook: steps silently
    _wrap(_net())
    assert not _process_hooks.installed(), "wrapping must not install them while they are off"
    shardfuse.set_process_hooks(True)
    assert _process_hooks.installed()
    with pytest.raises(TypeError, match="takes True or False"):
        shardfuse.set_process_hooks("no")  # type: ignore[arg-type]


def test_process_hooks_environment_variable(hooks_restored: None, monkeypatch: pytest.MonkeyPatch) -> None:
    shardfuse.set_process_hooks(False)
    _process_hooks._enabled = None  # follow the environment again
    monkeypatch.setenv(_process_hooks.ENV_VAR, "0")
    _wrap(_net())
    assert not _process_hooks.installed()
    monkeypatch.setenv(_process_hooks.ENV_VAR, "1")
    _wrap(_net())
    assert _process_hooks.installed()
