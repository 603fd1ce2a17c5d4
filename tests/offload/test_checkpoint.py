"""checkpoint_wrapper against the same model without checkpointing: exact outputs and gradients.

The recompute replays the forward's RNG state, so dropout inside a checkpointed block draws the same mask
twice and the wrapped model matches the plain one bit for bit, over several optimizer steps.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardfuse.offload import checkpoint_wrapper


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
