"""Private torch calls: the host tier's go through ``shardfuse._torch_private`` (one capability check, a public
fallback), every other one is listed there, and the private fused Adam kernel still takes the arguments
``_host_fused`` passes and gives the public ``fused=True`` optimizer's values."""

from __future__ import annotations

import ast
import logging
from pathlib import Path

import pytest
import torch

from shardfuse import _torch_private
from shardfuse.sharding.host._host_fused import ALIGN, step_in_chunks

ROOT = Path(_torch_private.__file__).resolve().parent


@pytest.mark.parametrize("name,decoupled", [("_fused_adam_", False), ("_fused_adamw_", True)])
@pytest.mark.parametrize("amsgrad", [False, True], ids=["plain", "amsgrad"])
def test_private_fused_kernel_matches_the_public_optimizer(name, decoupled, amsgrad):
    kernel = getattr(torch, name, None)
    assert kernel is not None, (
        f"torch {torch.__version__} has no torch.{name}: shardfuse's host tier falls back to the optimizer's own "
        f"step (slower); drop or update the private path in shardfuse/_torch_private.py")
    problem = _torch_private.probe_fused_adam(kernel, decoupled, amsgrad)
    assert problem is None, (
        f"torch {torch.__version__}'s private torch.{name} moved: {problem}; update call_fused_adam() (and "
        f"_host_fused's kwargs) in shardfuse/_torch_private.py to its new signature")
    assert _torch_private.fused_adam_kernels() is not None


def test_a_moved_signature_falls_back_to_the_public_step(monkeypatch, caplog):
    def moved(params, grads, *, lr):  # a private kernel whose arguments changed
        raise AssertionError("must not be reached")

    monkeypatch.setattr(torch, "_fused_adamw_", moved)
    _torch_private.fused_adam_kernels.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="shardfuse._torch_private"):
            assert _torch_private.fused_adam_kernels() is None
        monkeypatch.undo()  # torch's public fused step calls the kernel too; the check's verdict stays cached
        assert "torch._fused_adamw_" in caplog.text and "TypeError" in caplog.text, caplog.text
        flat = torch.randn(ALIGN + 5)
        opt = torch.optim.AdamW([flat], lr=1e-2, fused=True)
        flat.grad = torch.randn_like(flat)
        opt.step()  # makes the state
        flat.grad = torch.randn_like(flat)
        before = flat.clone()
        settings = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
        assert not step_in_chunks([(opt, [flat], settings)], None, flat, None), "must leave it to the optimizer"
        assert torch.equal(flat, before), "declining changes nothing"
    finally:
        monkeypatch.undo()
        _torch_private.fused_adam_kernels.cache_clear()


def _private_uses() -> set[tuple[str, str, int]]:
    """``(file under shardfuse/, private name, line)`` of every ``torch._name`` in shardfuse's code."""
    found = set()
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "torch"
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                found.add((rel, node.attr, node.lineno))
            # `from torch._C._dynamo import guards` and `import torch._dynamo` reach private modules too
            modules = ([node.module] if isinstance(node, ast.ImportFrom) and node.module else
                       [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            for module in modules:
                parts = module.split(".")
                if parts[0] == "torch" and len(parts) > 1 and parts[1].startswith("_"):
                    found.add((rel, parts[1], node.lineno))
    return found


def test_every_private_torch_call_is_routed_or_listed():
    stray = sorted((rel, name, line) for rel, name, line in _private_uses()
                   if rel != "_torch_private.py" and (rel, name) not in _torch_private.OTHER_PRIVATE_USES)
    assert not stray, (
        "private torch calls outside shardfuse/_torch_private.py: "
        + "; ".join(f"shardfuse/{rel}:{line} torch.{name}" for rel, name, line in stray)
        + ": call them through shardfuse/_torch_private.py (with a public fallback), or add "
        + ", ".join(sorted({f'("{rel}", "{name}")' for rel, name, _ in stray})) + " to OTHER_PRIVATE_USES with why")
    unused = set(_torch_private.OTHER_PRIVATE_USES) - {(rel, name) for rel, name, _ in _private_uses()}
    assert not unused, f"OTHER_PRIVATE_USES lists {sorted(unused)}, no longer called: drop them"


def test_the_probe_sees_wrong_values():
    """A kernel that runs but computes something else (Adam's coupled weight decay for AdamW) is caught."""
    problem = _torch_private.probe_fused_adam(torch._fused_adam_, decoupled=True, amsgrad=False)
    assert problem is not None and "differs from torch.optim.AdamW(fused=True)" in problem, problem


def test_grad_scale_divides_as_tensor_div():
    """The fused kernels' ``grad_scale`` is a division by it, the quotient written back (clip_in_update's values)."""
    for kernel in (torch._fused_adam_, torch._fused_adamw_):
        assert _torch_private._probe_grad_scale(kernel) is None, (
            f"torch {torch.__version__}'s {kernel.__name__} grad_scale no longer equals Tensor.div_ then the kernel: "
            f"clip_in_update falls back to a separate division pass (slower); check the kernel's grad_scale")
    assert _torch_private.kernel_divides_by_grad_scale()


def test_grad_scale_probe_sees_a_multiply(monkeypatch, caplog):
    """A kernel that multiplies by ``grad_scale`` (or ignores it) is caught, and clip_in_update then divides in a
    pass of its own."""
    real = torch._fused_adamw_

    def multiplies(params, grads, *args, grad_scale=None, **kwargs):
        if grad_scale is not None:
            torch._foreach_mul_(grads, grad_scale)
        return real(params, grads, *args, grad_scale=None, **kwargs)

    assert "differs from dividing first" in str(_torch_private._probe_grad_scale(multiplies))
    monkeypatch.setattr(_torch_private, "fused_adam_kernels", lambda: (torch._fused_adam_, multiplies))
    _torch_private.kernel_divides_by_grad_scale.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="shardfuse._torch_private"):
            assert not _torch_private.kernel_divides_by_grad_scale()
        assert "clip_in_update divides the gradients in a separate pass" in caplog.text, caplog.text
    finally:
        monkeypatch.undo()
        _torch_private.kernel_divides_by_grad_scale.cache_clear()
