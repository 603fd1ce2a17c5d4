"""Everything process-wide is installed in one place (``_process_hooks``), named on one page
(docs/process-wide.md), and works on and off; what can be attached to the object it serves is attached there
(the OffloadOptimizer hangs on the root wrapper's state; its per-shard optimizers count their own fused writes).

In-process, over a duck-typed process group of one rank, as tests/sharding/test_config.py.
"""

from __future__ import annotations

import gc
import pickle
import re
import threading
import weakref
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.optim import optimizer as torch_optimizer

import shardfuse
from shardfuse import FullyShardedDataParallel as FSDP
from shardfuse import OffloadOptimizer, _versions
from shardfuse.sharding.core import _process_hooks
from shardfuse.sharding.core._registry import SHARD_MARK_ATTR, SHARD_MARK_KEY
from shardfuse.sharding.host import _engine, _offload_optim

PAGE = Path(__file__).resolve().parents[2] / "docs" / "process-wide.md"


class _Group:
    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 1


def _model(seed: int = 0, **kw: object) -> FSDP:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    net[0] = FSDP(net[0], process_group=_Group(), move_params_to_cpu=True, **kw)
    return FSDP(net, process_group=_Group(), move_params_to_cpu=True, **kw)


def _train(model: FSDP, opt: torch.optim.Optimizer, steps: int, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        model(torch.randn(3, 5, generator=gen)).square().sum().backward()
        opt.step()
        opt.zero_grad()


@pytest.fixture
def hooks_restored():
    yield
    shardfuse.set_process_hooks(True)
    _process_hooks._enabled = None


def _global_post_hooks() -> list[object]:
    return list(torch_optimizer._global_optimizer_post_hooks.values())


# ------------------------------------------------------------------------------------------------------
# one page names every process-wide change
# ------------------------------------------------------------------------------------------------------


def test_the_page_names_every_process_wide_change_and_no_other() -> None:
    rows = re.findall(r"^\| `([a-z_]+)` \|", PAGE.read_text(), re.MULTILINE)
    want = [*_process_hooks.SWITCHABLE, *_process_hooks.REQUIRED]
    assert sorted(rows) == sorted(want), (
        f"docs/process-wide.md lists {sorted(rows)}, _process_hooks installs {sorted(want)}: add a table row "
        f"'| `name` | what changes | installed | why | turned off by |' for each missing one (and drop stale rows)")
    assert "(process-wide.md)" in (PAGE.parent / "api.md").read_text(), "docs/api.md must link the page"


def test_only_process_hooks_registers_global_optimizer_hooks() -> None:
    """The one place: no other module of shardfuse registers a global optimizer hook or replaces torch's clip."""
    root = Path(shardfuse.__file__).parent
    offenders = [p.relative_to(root.parent).as_posix() for p in root.rglob("*.py")
                 if p.name != "_process_hooks.py" and re.search(
                     r"register_optimizer_step_(pre|post)_hook|torch\.nn\.utils\.(clip_grad\.)?clip_grad_norm_ =",
                     p.read_text())]
    assert not offenders, (f"{offenders} install process-wide hooks: do it through "
                           "shardfuse/sharding/core/_process_hooks.py")


def test_required_hooks_have_known_names() -> None:
    with pytest.raises(ValueError, match="unknown hook name 'mine'.*add it to REQUIRED"):
        _process_hooks.require_step_hooks("mine", lambda *a: None, lambda *a: None)


# ------------------------------------------------------------------------------------------------------
# on and off
# ------------------------------------------------------------------------------------------------------


def _marked_after_steps() -> bool:
    """A parameter marked as rank 0's shard of 2 (what a 2-rank wrap marks), stepped by a plain optimizer."""
    _model()  # a wrap: installs the hooks unless they are off
    p = nn.Parameter(torch.randn(6))
    setattr(p, SHARD_MARK_ATTR, (0, 2))
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    p.grad = torch.randn(6)
    opt.step()
    return opt.state[p].get(SHARD_MARK_KEY) == (0, 2)


def test_shard_marks_on_and_off(hooks_restored: None) -> None:
    assert _marked_after_steps(), "with the hooks on, every sharded parameter's state carries its shard mark"
    shardfuse.set_process_hooks(False)
    assert not _marked_after_steps(), "with the hooks off, no optimizer state is touched"


def _module_tables() -> dict[str, int]:
    """The sizes of _process_hooks' module-level containers (what a per-optimizer table would grow)."""
    return {k: len(v) for k, v in vars(_process_hooks).items()
            if not k.startswith("__") and hasattr(v, "__len__") and not isinstance(v, (str, bytes, tuple))}


def test_optimizer_guards_keep_their_bookkeeping_on_the_optimizer(hooks_restored: None) -> None:
    """Before: three module-level weak tables (_checked_optimizers, _marks_seen, _load_hooked) keyed by optimizer.
    Now each optimizer carries what the guards saw, stamped with the hooks' generation; no module table grows."""
    shardfuse.set_process_hooks(True)
    model = _model()
    before = _module_tables()
    params = [nn.Parameter(torch.randn(6)) for _ in range(3)]
    for p in params:
        setattr(p, SHARD_MARK_ATTR, (0, 2))
    opts = [torch.optim.SGD([*params, *model.parameters()], lr=0.1, momentum=0.9) for _ in range(4)]
    for opt in opts:
        for p in params:
            p.grad = torch.randn(6)
        _train(model, opt, 1)
    gen = _process_hooks._generation
    count = len(params) + len(list(model.parameters()))
    for opt in opts:
        assert opt.__dict__[_process_hooks.CHECKED_ATTR] == (gen, count)
        assert opt.__dict__[_process_hooks.MARKS_ATTR][:2] == (gen, count)
        assert all(opt.state[p][SHARD_MARK_KEY] == (0, 2) for p in params)
    assert _module_tables() == before, "a module-level table grew with the optimizers"
    # load_state_dict (the optimizer's own post-hook) forgets the marks: the loaded state is checked at the next step.
    opts[0].load_state_dict(opts[0].state_dict())
    assert opts[0].__dict__[_process_hooks.MARKS_ATTR][:2] == (gen, None)
    bad = opts[1].state_dict()
    bad["state"][0][SHARD_MARK_KEY] = (1, 2)
    opts[1].load_state_dict(bad)
    with pytest.raises(RuntimeError, match="optimizer state of rank 1 of 2, but this rank trains the shard of rank 0"):
        opts[1].step()
    _train(model, opts[0], 1)
    assert opts[0].__dict__[_process_hooks.MARKS_ATTR][:2] == (gen, count)
    # Turning the hooks off and on starts a new generation: what the optimizers carry is stale, checked again.
    shardfuse.set_process_hooks(False)
    shardfuse.set_process_hooks(True)
    assert _process_hooks._generation > gen
    assert _process_hooks._marks_seen(opts[2]) is None
    _train(model, opts[2], 1)
    assert opts[2].__dict__[_process_hooks.CHECKED_ATTR] == (_process_hooks._generation, count)
    ref = weakref.ref(opts[3])
    del opts, opt
    gc.collect()
    assert ref() is None, "the bookkeeping keeps an optimizer alive"
    assert _module_tables() == before


def test_fused_versions_is_required_and_left_by_the_switch(hooks_restored: None) -> None:
    shardfuse.set_process_hooks(False)
    _model()
    assert "fused_versions" in _process_hooks.installed_required()
    assert _versions.global_fused_step_post_hook in _global_post_hooks(), "wrapping needs it, switch or not"
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    _train(model, opt, 1)
    before = [p._version for p in model.parameters()]
    _train(model, opt, 1)
    assert all(p._version > v for p, v in zip(model.parameters(), before)), "a fused step must count its writes"


def test_offload_optimizer_counts_its_own_fused_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The per-shard optimizers carry their own version hook: no process-wide hook is needed for them."""
    _model()  # installs the global hook, which is taken away below
    monkeypatch.setattr(_versions, "global_fused_step_post_hook", lambda *a, **k: None)
    hooks = torch_optimizer._global_optimizer_post_hooks
    saved = dict(hooks)
    hooks.clear()
    try:
        model = _model()
        opt = OffloadOptimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True))
        for step in range(3):  # the first makes the state (the optimizer's own step), then the chunked pass
            before = [p._version for p in model.parameters()]
            _train(model, opt, 1, seed=step)
            opt.synchronize()
            assert all(p._version > v for p, v in zip(model.parameters(), before)), f"step {step}: writes unseen"
        opt.close()
    finally:
        hooks.update(saved)


# ------------------------------------------------------------------------------------------------------
# the OffloadOptimizer hangs on the model the user holds
# ------------------------------------------------------------------------------------------------------


def test_engine_is_owned_by_the_root_wrapper_state() -> None:
    assert not any(isinstance(v, dict) or type(v).__name__.startswith("WeakKey")
                   for k, v in vars(_offload_optim).items() if k.isupper() or k.startswith("_E")), \
        "no module-level registry of live engines"
    a, b = _model(0), _model(1)
    opt_a = OffloadOptimizer(a, torch.optim.SGD(a.parameters(), lr=0.1))
    opt_b = OffloadOptimizer(b, torch.optim.SGD(b.parameters(), lr=0.1))
    assert a._unit.host_engine is not None and a._unit.host_engine() is opt_a
    assert _engine.engine_of(a._fsdp_wrapped_module[0]._unit) is opt_a, "nested units find the root's"
    assert _engine.engine_of(b._unit) is opt_b
    copy = pickle.loads(pickle.dumps(a))  # the engine stays with the original
    assert copy._unit.host_engine is None and a._unit.host_engine() is opt_a
    opt_a.close()
    assert a._unit.host_engine is None and _engine.engine_of(a._unit) is None
    assert all(h.host is None for u in (a._unit, a._fsdp_wrapped_module[0]._unit) for h in u.handles)
    workers = {t for t in threading.enumerate() if t.name == "shardfuse-host-step"}
    del opt_b
    gc.collect()
    assert _engine.engine_of(b._unit) is None, "the model must not keep a dropped optimizer alive"
    left = {t for t in threading.enumerate() if t.name == "shardfuse-host-step"}
    assert len(left) < len(workers), "the dropped optimizer's worker thread must end"
