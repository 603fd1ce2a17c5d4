"""A second ``backward(retain_graph=True)`` through checkpointed blocks and OffloadModel, as with plain autograd.

What a block keeps for its backward is owned by the autograd graph: freed right after the block's backward
unless the graph is retained, kept (and reused) when it is. Gradients of the second backward are compared
with the plain model's second backward; both accumulate into ``.grad``.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from torch import nn

from shardfuse.offload import OffloadModel, checkpoint_wrapper
from shardfuse.offload import _function as function
from shardfuse.offload import _model as offload_model
from tests.offload._models import mlp

pytestmark = pytest.mark.usefixtures("poisoned_slots")

EXACT = {"rtol": 1e-5, "atol": 1e-6}  # microbatch views may sit at another alignment (test_offload_model.py)


def record_calls(monkeypatch, module) -> list:
    """The BlockCall of every checkpointed block / offloaded slice that ``module`` runs."""
    calls = []
    real = function.apply_block

    def recording(call, tensors):
        calls.append(call)
        return real(call, tensors)

    monkeypatch.setattr(module, "apply_block", recording)
    return calls


def net(p: float = 0.3) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(p),
        nn.Linear(8, 8), nn.Tanh(), nn.Dropout(p),
        nn.Linear(8, 3),
    )  # fmt: skip


def backward_twice(model: nn.Module, x: torch.Tensor, w: torch.Tensor, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    out = model(x)
    loss = (out * w).sum()
    loss.backward(retain_graph=True)
    first = [p.grad.clone() for p in model.parameters()]
    loss.backward()
    return out, first


@pytest.mark.parametrize("offload", [False, True], ids=["on-device", "offload-to-cpu"])
def test_checkpoint_wrapper_second_backward(offload):
    ref = net()
    layers = list(copy.deepcopy(ref))
    ck = nn.Sequential(
        checkpoint_wrapper(nn.Sequential(*layers[:4]), offload_to_cpu=offload),
        checkpoint_wrapper(nn.Sequential(*layers[4:7]), offload_to_cpu=offload),
        layers[7],
    )
    x = torch.randn(6, 5, requires_grad=True)
    xc = x.detach().clone().requires_grad_()
    w = torch.randn(6, 3)
    out_ref, first_ref = backward_twice(ref, x, w, seed=3)
    out_ck, first_ck = backward_twice(ck, xc, w, seed=3)
    assert torch.equal(out_ck, out_ref)
    for a, b, fa, fb in zip(ck.parameters(), ref.parameters(), first_ck, first_ref):
        assert torch.equal(fa, fb)
        assert torch.equal(a.grad, b.grad)  # accumulated over both backwards, as the plain model does
        assert torch.equal(a.grad, 2 * fa)
    assert torch.equal(xc.grad, x.grad)
    # neither recompute touched the running statistics
    bn_ref, bn_ck = ref[1], ck[0][1]
    assert torch.equal(bn_ck.running_mean, bn_ref.running_mean) and int(bn_ck.num_batches_tracked) == 1


def test_checkpoint_wrapper_frees_after_backward(monkeypatch):
    from shardfuse.offload import _checkpoint

    calls = record_calls(monkeypatch, _checkpoint)
    ck = checkpoint_wrapper(nn.Linear(4, 4))
    loss = ck(torch.randn(3, 4)).sum()
    loss.backward(retain_graph=True)
    assert calls[-1].peek() is not None  # retained: the stashed input is still there
    loss.backward()
    assert calls[-1].peek() is None  # freed as torch frees saved tensors, though the graph is still alive
    with pytest.raises(RuntimeError, match=r"checkpoint_wrapper\(Linear\) a second time.*retain_graph=True"):
        loss.backward()
    loss = ck(torch.randn(3, 4)).sum()
    del loss
    gc.collect()
    assert calls[-1].peek() is None  # a graph dropped without backward frees it too


MODES = {
    "checkpoint": dict(checkpoint_activation=True),
    "keep-acts": dict(),
    "offload-acts": dict(offload_activations=True),
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("mb", [1, 3], ids=lambda m: f"mb{m}")
@pytest.mark.parametrize("num_slices", [1, 3], ids=lambda n: f"slices{n}")
def test_offload_model_second_backward(park_everything, mode, mb, num_slices):
    ref = mlp(p=0.0)  # microbatches draw dropout masks in another order than the plain model
    off = OffloadModel(mlp(p=0.0), "cpu", num_slices=num_slices, num_microbatches=mb, **MODES[mode])
    for step in range(2):
        x, w = torch.randn(7, 5), torch.randn(7, 4)
        out_ref, first_ref = backward_twice(ref, x, w, seed=step)
        out_off, first_off = backward_twice(off, x, w, seed=step)
        torch.testing.assert_close(out_off, out_ref, **EXACT)
        for (n, a), b, fa, fb in zip(off.named_parameters(), ref.parameters(), first_off, first_ref):
            torch.testing.assert_close(fa, fb, **EXACT, msg=lambda m, n=n, s=step: f"step {s} {n} first: {m}")
            torch.testing.assert_close(a.grad, b.grad, **EXACT, msg=lambda m, n=n, s=step: f"step {s} {n}: {m}")
            assert torch.equal(a.grad, 2 * fa), n
        for m in (ref, off):
            m.zero_grad()
    assert off._engine.param_pool._made == 0 and not off._engine._steps  # buffers given back


def test_offload_model_second_backward_with_dropout():
    # one microbatch: the recompute replays the dropout masks the plain model drew
    ref = mlp()
    off = OffloadModel(mlp(), "cpu", num_slices=4, checkpoint_activation=True)
    x, w = torch.randn(6, 5), torch.randn(6, 4)
    out_ref, _ = backward_twice(ref, x, w, seed=11)
    out_off, _ = backward_twice(off, x, w, seed=11)
    torch.testing.assert_close(out_off, out_ref, **EXACT)
    for a, b in zip(off.parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, **EXACT)


@pytest.mark.parametrize("mode", list(MODES))
def test_offload_model_frees_after_backward(monkeypatch, park_everything, mode):
    calls = record_calls(monkeypatch, offload_model)
    retains = []
    real = function._run_backward

    def recording(outs, grads, retain_graph=False):
        retains.append(retain_graph)
        return real(outs, grads, retain_graph)

    monkeypatch.setattr(function, "_run_backward", recording)
    off = OffloadModel(mlp(), "cpu", num_slices=3, **MODES[mode])
    loss = off(torch.randn(4, 5)).sum()
    loss.backward()
    assert [c.peek() for c in calls] == [None] * 3  # nothing kept once each slice's backward is through
    if mode != "checkpoint":
        # a kept graph is run without retain_graph (freed node by node) once torch is known not to retain:
        # all but the last slice, which runs first
        assert retains == [True, False, False]
    with pytest.raises(RuntimeError, match=r"OffloadModel slice 2 \(layers 8 to 8\) a second time"):
        loss.backward()


def test_offload_model_weights_changed_before_backward():
    # Plain autograd refuses a backward after an in-place change of weights it saved; the recompute (or the
    # kept graph) would silently use the new weights, so OffloadModel refuses too.
    for kw in (dict(checkpoint_activation=True), dict()):
        off = OffloadModel(mlp(), "cpu", num_slices=2, **kw)
        loss = off(torch.randn(3, 5)).sum()
        with torch.no_grad():
            off[0].weight.add_(torch.randn_like(off[0].weight))
        with pytest.raises(RuntimeError, match=r"slice 0 \(layers 0 to 4\): its parameters were modified in place"):
            loss.backward()
        # between two backwards through a retained graph (an optimizer step)
        opt = torch.optim.SGD(off.parameters(), lr=0.1)
        loss = off(torch.randn(3, 5)).sum()
        loss.backward(retain_graph=True)
        opt.step()
        with pytest.raises(RuntimeError, match=r"slice 1 .* modified in place .* run the forward again"):
            loss.backward()


def test_optimizer_in_backward_second_backward_is_refused():
    off = OffloadModel(mlp(), "cpu", num_slices=2, checkpoint_activation=True,
                       optimizer_in_backward=lambda ps: torch.optim.SGD(ps, lr=0.1))  # fmt: skip
    loss = off(torch.randn(3, 5)).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="With optimizer_in_backward every backward steps the weights"):
        loss.backward()


@pytest.mark.parametrize("mb", [1, 2], ids=lambda m: f"mb{m}")
def test_offload_model_running_stats_updated_once(mb):
    # The recompute of checkpoint_activation must leave batch-norm statistics alone: they equal those of the
    # plain model run on the same microbatches (one microbatch: the plain model itself).
    def bn_model(seed=0):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 6), nn.BatchNorm1d(6),
                             nn.Tanh(), nn.Linear(6, 4))  # fmt: skip

    ref = bn_model()
    off = OffloadModel(bn_model(), "cpu", num_slices=3, checkpoint_activation=True, num_microbatches=mb)
    for _ in range(2):
        x, w = torch.randn(8, 5), torch.randn(8, 4)
        out = off(x)
        for xm, wm in zip(x.chunk(mb), w.chunk(mb)):
            (ref(xm) * wm).sum().backward()
        (out * w).sum().backward()
        for (k, v), (kr, vr) in zip(off.state_dict().items(), ref.state_dict().items()):
            assert k == kr
            torch.testing.assert_close(v, vr, **EXACT, msg=lambda m, k=k: f"{k}: {m}")
        for (n, a), b in zip(off.named_parameters(), ref.parameters()):
            torch.testing.assert_close(a.grad, b.grad, **EXACT, msg=lambda m, n=n: f"{n}: {m}")


def test_checkpoint_wrapper_where_saved_tensor_hooks_are_disabled():
    # The graph cannot own what the block keeps there: it is freed after the first backward instead, and a
    # second backward says so.
    ref = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 4))
    ck = checkpoint_wrapper(copy.deepcopy(ref))
    x, w = torch.randn(3, 4), torch.randn(3, 4)
    with torch.autograd.graph.disable_saved_tensors_hooks("disabled by the test"):
        loss = (ck(x) * w).sum()
        loss.backward(retain_graph=True)
        (ref(x) * w).sum().backward()
        for p, q in zip(ck.parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad)
        with pytest.raises(RuntimeError, match=r"checkpoint_wrapper\(Sequential\) a second time"):
            loss.backward()
