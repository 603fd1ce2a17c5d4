"""checkpoint_wrapper against the same model without checkpointing: exact outputs and gradients.

The recompute replays the forward's RNG state, so dropout inside a checkpointed block draws the same mask
twice and the wrapped model matches the plain one bit for bit, over several optimizer steps.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from shardfuse.offload import checkpoint_wrapper, disable_checkpointing


class Block(nn.Module):
    """Residual MLP block with dropout; optional keyword input and tuple output."""

    def __init__(self, d: int = 6):
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d + 1)
        self.fc2 = nn.Linear(2 * d + 1, d)
        self.drop = nn.Dropout(0.3)
        self.calls = 0

    def forward(self, x, scale=None, *, extra=None):
        self.calls += 1
        h = self.fc2(self.drop(torch.relu(self.fc1(x))))
        if scale is not None:
            h = h * scale
        out = x + h
        if extra is not None:
            return out, extra + 1
        return out


def model(seed=0, wrap=False, offload=False):
    torch.manual_seed(seed)
    blocks = [Block(), Block(), Block()]
    if wrap:
        blocks = [checkpoint_wrapper(b, offload_to_cpu=offload) for b in blocks[:2]] + blocks[2:]
    return nn.ModuleList(blocks)


def run(m, x):
    for b in m:
        x = b(x)
    return x


@pytest.mark.parametrize("offload", [False, True], ids=["on-device", "offload-to-cpu"])
def test_parity_over_steps(offload):
    ref, ck = model(), model(wrap=True, offload=offload)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    opt_ck = torch.optim.SGD(ck.parameters(), lr=0.05, momentum=0.9)
    for step in range(3):
        x = torch.randn(7, 6)
        w = torch.randn(7, 6)
        torch.manual_seed(step)
        out_ref = run(ref, x)
        (out_ref * w).sum().backward()
        rng_ref = torch.get_rng_state()
        torch.manual_seed(step)
        out = run(ck, x)
        (out * w).sum().backward()
        assert torch.equal(out, out_ref)
        assert torch.equal(torch.get_rng_state(), rng_ref)
        for (n, p), q in zip(ck.named_parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad), n
        for o in (opt_ref, opt_ck):
            o.step()
            o.zero_grad()
    assert ck[0].calls == 6 and ref[0].calls == 3  # every forward ran again in backward


def test_names_unchanged_and_input_grad():
    ref, ck = model(), model(wrap=True, offload=True)
    assert list(ck.state_dict()) == list(ref.state_dict())
    x = torch.randn(5, 6)
    xr, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
    torch.manual_seed(1)
    run(ref, xr).pow(2).sum().backward()
    torch.manual_seed(1)
    run(ck, xc).pow(2).sum().backward()
    assert torch.equal(xc.grad, xr.grad)


def test_kwargs_tuple_outputs_and_non_tensor_args():
    torch.manual_seed(0)
    ref = Block()
    torch.manual_seed(0)
    ck = checkpoint_wrapper(Block(), offload_to_cpu=True)
    x, scale, extra = torch.randn(4, 6), torch.randn(()), torch.randint(0, 5, (4,))
    sr, sc = scale.clone().requires_grad_(), scale.clone().requires_grad_()
    torch.manual_seed(2)
    out_r, e_r = ref(x, sr, extra=extra)
    torch.manual_seed(2)
    out_c, e_c = ck(x, sc, extra=extra)
    assert torch.equal(out_c, out_r) and torch.equal(e_c, e_r) and not e_c.requires_grad
    out_r.sum().backward()
    out_c.sum().backward()
    assert torch.equal(sc.grad, sr.grad)
    for p, q in zip(ck.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)
    assert ck(x, None).shape == (4, 6)  # None positional argument passes through


def test_no_grad_runs_plainly():
    ck = checkpoint_wrapper(Block())
    with torch.no_grad():
        out = ck(torch.randn(3, 6))
    assert not out.requires_grad and ck.calls == 1


def test_frozen_module_and_plain_input_does_not_checkpoint():
    ck = checkpoint_wrapper(Block())
    ck.requires_grad_(False)
    out = ck(torch.randn(3, 6))
    assert out.grad_fn is None and ck.calls == 1


def test_profiler_ranges():
    ck = checkpoint_wrapper(Block(), offload_to_cpu=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        ck(torch.randn(3, 6)).sum().backward()
    names = {e.name for e in prof.events()}
    for phase in ["forward_compute", "backward_recompute", "backward_pass"]:
        assert f"shardfuse.checkpoint:{phase}" in names


def test_autograd_grad_is_rejected():
    ck = checkpoint_wrapper(Block())
    x = torch.randn(3, 6, requires_grad=True)
    with pytest.raises(RuntimeError, match="not compatible with .grad"):
        torch.autograd.grad(ck(x).sum(), x)


def test_wrap_twice():
    ck = checkpoint_wrapper(Block())
    with pytest.raises(ValueError, match="already wrapped by checkpoint_wrapper"):
        checkpoint_wrapper(ck)


def test_not_a_module():
    with pytest.raises(TypeError, match="takes an nn.Module, got function"):
        checkpoint_wrapper(lambda x: x)


# ------------------------------------------------------------------ FairScale fidelity


def norm_net(norm: str) -> nn.Module:
    if norm == "batchnorm2d":
        return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 2, 1))
    if norm == "batchnorm1d-cma":  # momentum=None: cumulative average, driven by num_batches_tracked
        return nn.Sequential(nn.Linear(3, 5), nn.BatchNorm1d(5, momentum=None), nn.Tanh(), nn.Linear(5, 2))
    assert norm == "instancenorm1d"  # not a _BatchNorm: tracks running stats through F.instance_norm
    return nn.Sequential(nn.Linear(3, 6), nn.Unflatten(1, (2, 3)), nn.InstanceNorm1d(2, track_running_stats=True),
                         nn.Flatten(), nn.Linear(6, 2))  # fmt: skip


def norm_input(norm: str) -> torch.Tensor:
    return torch.randn(5, 3, 6, 6) if norm == "batchnorm2d" else torch.randn(7, 3)


@pytest.mark.parametrize("offload", [False, True], ids=["on-device", "offload-to-cpu"])
@pytest.mark.parametrize("norm", ["batchnorm2d", "batchnorm1d-cma", "instancenorm1d"])
def test_running_stats_updated_once(norm, offload):
    # FairScale's test_norm[fp32-BatchNorm2d-cpu]: the recompute in backward must not update the running
    # statistics a second time; after each forward and after each backward they equal the plain module's.
    ref = norm_net(norm)
    ck = checkpoint_wrapper(copy.deepcopy(ref), offload_to_cpu=offload)
    opt_ref, opt_ck = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, ck))
    for _ in range(3):
        x = norm_input(norm).requires_grad_()
        out_ref, out_ck = ref(x), ck(x)
        assert torch.equal(out_ck, out_ref)
        assert_same_state(ck, ref)  # the forward updated them, once
        w = torch.randn_like(out_ref)
        (out_ref * w).sum().backward()
        (out_ck * w).sum().backward()
        assert_same_state(ck, ref)  # the recompute did not
        for (n, p), q in zip(ck.named_parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad), n
        for o in (opt_ref, opt_ck):
            o.step()
            o.zero_grad()
        assert_same_state(ck, ref)
    # the wrapper leaves the norm layers as it found them
    assert all(m.track_running_stats for m in ck.modules() if isinstance(m, nn.modules.batchnorm._NormBase))


def assert_same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sb:
        assert torch.equal(sa[k], sb[k]), f"{k}: {sa[k]} vs {sb[k]}"


def test_running_stats_eval_mode_and_bn_identity():
    ref = norm_net("batchnorm2d")
    ck = checkpoint_wrapper(copy.deepcopy(ref))
    ref.eval()
    ck.eval()
    x = torch.randn(4, 3, 6, 6, requires_grad=True)
    ref(x).sum().backward()
    ck(x).sum().backward()
    assert_same_state(ck, ref)
    bn = ck[1]
    buffers = {k: id(v) for k, v in bn.named_buffers()}
    ck.train()
    ck(torch.randn(4, 3, 6, 6, requires_grad=True)).sum().backward()
    assert {k: id(v) for k, v in bn.named_buffers()} == buffers  # updated in place, never replaced


class Counter(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return torch.tanh(self.lin(x))


def test_disable_checkpointing_runs_plain_forward():
    ref = Counter()
    ck = checkpoint_wrapper(copy.deepcopy(ref))
    x = torch.randn(3, 4)
    with disable_checkpointing():
        with disable_checkpointing():  # nests
            out = ck(x)
        out2 = ck(x)
    assert out.grad_fn is not None and "Offload" not in type(out.grad_fn).__name__  # the plain graph
    (out + out2).sum().backward()
    (ref(x) + ref(x)).sum().backward()
    assert ck.calls == 2  # no recompute
    for p, q in zip(ck.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)
    ck(x).sum().backward()  # enabled again after the context
    assert ck.calls == 4


def test_disable_checkpointing_is_per_thread():
    import threading

    ck = checkpoint_wrapper(Counter())
    seen = []
    with disable_checkpointing():
        t = threading.Thread(target=lambda: seen.append(type(ck(torch.randn(2, 4)).grad_fn).__name__))
        t.start()
        t.join()
    assert seen == ["OffloadCheckpointFunctionBackward"]


def test_fairscale_disable_checkpointing_flag(monkeypatch):
    # FairScale's disable_checkpointing() sets a flag on a thread-local of its module; the peer harness keeps
    # that function FairScale's own, so the wrapper reads the flag when FairScale is loaded (here a stand-in).
    import sys
    import types

    fake = types.ModuleType("fairscale.nn.checkpoint.checkpoint_activations")
    fake.thread_local = types.SimpleNamespace(is_checkpointing_disabled=False)
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    ck = checkpoint_wrapper(Counter())
    x = torch.randn(3, 4)
    ck(x).sum().backward()
    assert ck.calls == 2
    fake.thread_local.is_checkpointing_disabled = True
    ck(x).sum().backward()
    assert ck.calls == 3


def flat_views(inner: nn.Module) -> nn.Module:
    """Wrap ``inner`` like FlattenParamsWrapper: one registered flat parameter outside, views inside."""
    holder = nn.Module()
    named = [(m, n) for m in inner.modules() for n, _ in list(m.named_parameters(recurse=False))]
    params = [getattr(m, n) for m, n in named]
    holder.flat = nn.Parameter(torch.cat([p.detach().reshape(-1) for p in params]))
    holder.inner = inner
    shapes = [p.shape for p in params]
    for m, n in named:
        delattr(m, n)

    def forward(x):
        for (m, n), v, shape in zip(named, holder.flat.split([s.numel() for s in shapes]), shapes):
            setattr(m, n, v.view(shape))  # a plain attribute, as FlattenParamsWrapper sets it
        return inner(x)

    holder.forward = forward
    return holder


@pytest.mark.parametrize("frozen", [False, True], ids=["trainable", "frozen"])
def test_parameters_as_plain_attribute_views(frozen):
    # FairScale's test_checkpoint_requires_grad (FlattenParamsWrapper part): no input requires grad and the
    # wrapped module has no registered parameters, yet its (view) parameters require grad: checkpoint it.
    ref = Counter()
    ck = flat_views(checkpoint_wrapper(copy.deepcopy(ref)))
    plain = flat_views(copy.deepcopy(ref))
    assert list(ck.inner.parameters()) == []
    for m in (ref, ck, plain):
        m.requires_grad_(not frozen)
    x = torch.randn(5, 4)
    out = ck(x)
    assert out.requires_grad == (not frozen)
    if frozen:
        assert ck.inner.calls == 1 and out.grad_fn is None
        return
    w = torch.randn(5, 4)
    (out * w).sum().backward()
    (plain(x) * w).sum().backward()
    assert ck.inner.calls == 2  # forward + recompute
    assert torch.equal(ck.flat.grad, plain.flat.grad)
    (ref(x) * w).sum().backward()
    assert torch.equal(ck.flat.grad, torch.cat([p.grad.reshape(-1) for p in ref.parameters()]))
