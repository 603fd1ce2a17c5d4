"""OffloadModel against the plain model: outputs, gradients and parameters over several optimizer steps.

The reference runs the *same* layers with plain autograd in the order OffloadModel runs them: slice by slice,
and within a slice microbatch by microbatch. That order matters only for the random numbers dropout draws;
with it, every comparison is exact (``torch.equal``): the offloaded model computes the same ops on the same
shapes and sums microbatch gradients in the same order (microbatch 0 first) as autograd does when the
reference backpropagates its microbatches one after the other.

One caveat keeps the comparisons at a tight tolerance rather than ``torch.equal``: the CPU BLAS picks its
kernel by pointer alignment and row count, and a microbatch that OffloadModel takes as a view of a joined
boundary buffer can sit at another alignment than the reference's separate tensor, which moves the last bit
of a matrix product now and then (seen as 1e-8 differences on O(0.1) values). ``EXACT`` is 1e-5 relative:
any real mistake (a wrong microbatch, a missed accumulation, a stale weight) is off by orders more.
"""

from __future__ import annotations

import copy
from functools import partial

import pytest
import torch
from torch import nn

from shardfuse.offload import OffloadModel, _engine
from shardfuse.offload import _model as offload_model
from shardfuse.offload._microbatch import microbatch_sizes
from tests._asserts import assert_near
from tests.offload._models import mlp

pytestmark = pytest.mark.usefixtures("poisoned_slots")


EXACT = {"rtol": 1e-5, "atol": 1e-6}


assert_same = partial(assert_near, **EXACT)


def run_layers(model: nn.Sequential, start: int, stop: int, args: tuple) -> object:
    layers = list(model.children())[start:stop]
    x = layers[0](*args)
    for layer in layers[1:]:
        x = layer(x)
    return x


def split_args(args: tuple, mb: int) -> list[tuple]:
    batch = next(a.shape[0] for a in args if isinstance(a, torch.Tensor) and a.dim() >= 1)
    sizes = microbatch_sizes(batch, mb)
    cols = [list(torch.split(a, sizes)) if isinstance(a, torch.Tensor) and a.dim() >= 1 else [a] * mb for a in args]
    return [tuple(c[j] for c in cols) for j in range(mb)]


def leaves(out: object) -> list[torch.Tensor]:
    return list(out) if isinstance(out, tuple) else [out]


def loss_of(out: object, weights: list[torch.Tensor]) -> torch.Tensor:
    return sum((o * w).sum() for o, w in zip(leaves(out), weights) if o.is_floating_point())


def reference_step(model, ranges, args, weights, mb):
    """Slice-major forward with plain autograd, backward microbatch by microbatch; returns joined outputs."""
    per_mb = split_args(args, mb)
    for start, stop in ranges:
        per_mb = [(run_layers(model, start, stop, a),) for a in per_mb]
    outs = [a[0] for a in per_mb]
    sizes = [leaves(o)[0].shape[0] for o in outs]
    w_mb = [list(torch.split(w, sizes)) for w in weights]
    for j, o in enumerate(outs):
        loss_of(o, [w[j] for w in w_mb]).backward()
    joined = [torch.cat([leaves(o)[k] for o in outs]) for k in range(len(leaves(outs[0])))]
    return joined


def assert_params_equal(a: nn.Module, b: nn.Module, grads: bool = True) -> None:
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb
        assert_same(pa, pb, na)
        if grads:
            assert (pa.grad is None) == (pb.grad is None), na
            if pa.grad is not None:
                assert_same(pa.grad, pb.grad, f"{na}.grad")


def train_both(model_fn, num_slices, mb, checkpoint, make_inputs, steps=3, **kw):
    ref = model_fn()
    off = OffloadModel(model_fn(), torch.device("cpu"), num_slices=num_slices,
                       checkpoint_activation=checkpoint, num_microbatches=mb, **kw)  # fmt: skip
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt_off = torch.optim.SGD(off.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        args, weights = make_inputs()
        seed = 1000 + step
        torch.manual_seed(seed)
        out_ref = reference_step(ref, off.slice_ranges, args, weights, mb)
        rng_ref = torch.get_rng_state()
        torch.manual_seed(seed)
        out = off(*args)
        loss_of(out, weights).backward()
        for o, r in zip(leaves(out), out_ref):
            assert_same(o, r, f"step {step}: output")
        # the RNG is where the reference left it: the recompute replayed its draws and restored the stream
        assert torch.equal(torch.get_rng_state(), rng_ref)
        assert_params_equal(off, ref)
        opt_ref.step()
        opt_off.step()
        opt_ref.zero_grad()
        opt_off.zero_grad()
        assert_params_equal(off, ref, grads=False)
    return ref, off


def mlp_inputs(batch=7):
    def make():
        return (torch.randn(batch, 5),), [torch.randn(batch, 4)]

    return make


@pytest.mark.parametrize("checkpoint", [False, True], ids=["keep-acts", "checkpoint"])
@pytest.mark.parametrize("mb", [1, 2, 4], ids=lambda m: f"mb{m}")
@pytest.mark.parametrize("num_slices", [1, 2, 3, 4, 9], ids=lambda n: f"slices{n}")
def test_training_parity(num_slices, mb, checkpoint):
    train_both(mlp, num_slices, mb, checkpoint, mlp_inputs(7))


@pytest.mark.parametrize("mb", [1, 3], ids=lambda m: f"mb{m}")
@pytest.mark.parametrize("num_slices", [1, 2, 4, 9], ids=lambda n: f"slices{n}")
def test_offload_activations_parity(park_everything, num_slices, mb):
    _, off = train_both(mlp, num_slices, mb, False, mlp_inputs(7), offload_activations=True)
    # every slice but the last parks what it saves (one slice: nothing to park)
    assert (len(park_everything) > 0) == (num_slices > 1)


def test_offload_activations_same_shaped_layers(park_everything):
    # Same-shaped layers: a parked activation's memory is freed and handed to the next one of its shape at
    # the same address (the allocator's reuse), so the parking must not mistake one for the other.
    # (64 KiB activations: the CPU allocator reuses blocks of that size at once; seen failing without the fix)
    def same_width(seed=0):
        torch.manual_seed(seed)
        layers = []
        for _ in range(6):
            layers += [nn.Linear(256, 256), nn.Tanh(), nn.Dropout(0.2)]
        return nn.Sequential(*layers)

    def inputs():
        return (torch.randn(64, 256),), [torch.randn(64, 256)]

    for num_slices, mb in [(2, 1), (3, 2), (6, 1)]:
        train_both(same_width, num_slices, mb, False, inputs, steps=2, offload_activations=True)


def test_offload_activations_leave_nothing_on_the_device(park_everything):
    # After the forward, only the last slice may hold activations: everything the earlier slices saved is
    # parked, and neither their inputs nor their outputs are pinned by the graph kept for backward.
    import gc

    off = OffloadModel(mlp(), "cpu", num_slices=4, num_microbatches=2, offload_activations=True)
    x = torch.randn(6, 5)
    out = off(x)
    gc.collect()
    alive = [r() for r in park_everything if r() is not None and r() is not x]
    assert park_everything and alive == [], f"{len(alive)} parked activations are still alive after the forward"
    out.sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in off.parameters())


def test_offload_activations_with_optimizer_in_backward(park_everything):
    def sgd(params):
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)

    normal = OffloadModel(mlp(), "cpu", num_slices=3, num_microbatches=2)
    parked = OffloadModel(mlp(), "cpu", num_slices=3, num_microbatches=2, offload_activations=True,
                          optimizer_in_backward=sgd)  # fmt: skip
    opt = sgd(normal.parameters())
    for step in range(3):
        x, w = torch.randn(6, 5), torch.randn(6, 4)
        torch.manual_seed(step)
        loss_of(normal(x), [w]).backward()
        opt.step()
        opt.zero_grad()
        torch.manual_seed(step)
        loss_of(parked(x), [w]).backward()
        assert_params_equal(parked, normal, grads=False)


def test_slices_balanced_by_param_count():
    off = OffloadModel(mlp(), "cpu", num_slices=4)
    assert off.slice_ranges == [(0, 3), (3, 5), (5, 8), (8, 9)]
    assert [list(names) for _, names in off.named_slices()][0] == ["0", "1", "2"]
    off9 = OffloadModel(mlp(), "cpu", num_slices=9)
    assert off9.slice_ranges == [(i, i + 1) for i in range(9)]


def test_batch_of_one_and_prime_batch():
    train_both(mlp, 3, 1, True, mlp_inputs(1), steps=1)
    train_both(mlp, 3, 4, True, mlp_inputs(13), steps=1)


def test_input_requires_grad():
    ref, off = mlp(), OffloadModel(mlp(), "cpu", num_slices=3, checkpoint_activation=True, num_microbatches=2)
    x = torch.randn(6, 5)
    w = torch.randn(6, 4)
    xr, xo = x.clone().requires_grad_(), x.clone().requires_grad_()
    torch.manual_seed(3)
    reference_step(ref, off.slice_ranges, (xr,), [w], 2)
    torch.manual_seed(3)
    loss_of(off(xo), [w]).backward()
    assert_same(xo.grad, xr.grad, "input grad")
    assert_params_equal(off, ref)


# ------------------------------------------------------------------ several inputs, tuples, integer inputs


class EmbedIn(nn.Module):
    """Takes (token ids, features), returns (hidden, ids): ids cross the slice boundary with no gradient."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.lin = nn.Linear(3, 6)

    def forward(self, ids, feats):
        return self.emb(ids) + self.lin(feats), ids


class Mid(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.drop = nn.Dropout(0.2)

    def forward(self, pair):
        h, ids = pair
        return self.drop(torch.relu(self.lin(h))), ids


class Out(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 5)
        self.lin = nn.Linear(6, 5)

    def forward(self, pair):
        h, ids = pair
        return self.lin(h) + self.emb(ids), ids * 2


def tuple_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(EmbedIn(), Mid(), Mid(), Out())


@pytest.mark.parametrize("checkpoint", [False, True], ids=["keep-acts", "checkpoint"])
@pytest.mark.parametrize("mb", [1, 3], ids=lambda m: f"mb{m}")
def test_tuple_and_integer_inputs(mb, checkpoint):
    def make():
        ids = torch.randint(0, 11, (7,))
        return (ids, torch.randn(7, 3)), [torch.randn(7, 5), torch.zeros(7)]

    train_both(tuple_model, 3, mb, checkpoint, make, steps=2)


def test_integer_output_passes_through():
    off = OffloadModel(tuple_model(), "cpu", num_slices=2, checkpoint_activation=True, num_microbatches=2)
    ids = torch.randint(0, 11, (5,))
    out, ids2 = off(ids, torch.randn(5, 3))
    assert ids2.dtype == torch.int64 and not ids2.requires_grad and torch.equal(ids2, ids * 2)
    assert out.requires_grad


# ------------------------------------------------------------------ eval, frozen params, state dict


def test_no_grad_eval_matches_plain_model():
    ref, off = mlp(), OffloadModel(mlp(), "cpu", num_slices=3, checkpoint_activation=True, num_microbatches=2)
    ref.eval()
    off.eval()
    x = torch.randn(9, 5)
    with torch.no_grad():
        out = off(x)
    assert not out.requires_grad
    assert torch.equal(out, ref(x))
    assert off._engine.param_pool._made == 0  # device buffers given back after the forward


def test_train_mode_no_grad_forward_draws_like_plain_model():
    ref, off = mlp(), OffloadModel(mlp(), "cpu", num_slices=4)
    x = torch.randn(8, 5)
    torch.manual_seed(4)
    with torch.no_grad():
        out = off(x)
    torch.manual_seed(4)
    with torch.no_grad():
        assert torch.equal(out, ref(x))


def test_frozen_parameters():
    def frozen():
        m = mlp()
        for p in list(m[0].parameters()) + [m[5].bias]:
            p.requires_grad_(False)
        return m

    _, off = train_both(frozen, 3, 2, True, mlp_inputs(6), steps=2)
    assert off[0].weight.grad is None and off[5].bias.grad is None


def test_state_dict_round_trip():
    plain = mlp(seed=1)
    off = OffloadModel(mlp(seed=2), "cpu", num_slices=3)
    sd = off.state_dict()
    assert list(sd) == list(plain.state_dict())  # original names: "0.weight", ..., "8.bias"
    off.load_state_dict(plain.state_dict())
    for k, v in off.state_dict().items():
        assert torch.equal(v, plain.state_dict()[k]), k
    plain.eval()
    off.eval()
    x = torch.randn(4, 5)
    with torch.no_grad():
        assert torch.equal(off(x), plain(x))
    # the parameters still view the master buffers after loading (the state dict wrote into them)
    s = off._slices[0]
    assert off[0].weight.data_ptr() == s.flat.data_ptr()


def test_optimizer_built_before_wrapping_still_steps():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    off = OffloadModel(model, "cpu", num_slices=2)
    before = off[0].weight.detach().clone()
    loss_of(off(torch.randn(3, 5)), [torch.randn(3, 4)]).backward()
    opt.step()
    assert not torch.equal(off[0].weight, before)


def test_gradient_accumulation_over_two_backwards():
    ref, off = mlp(p=0.0), OffloadModel(mlp(p=0.0), "cpu", num_slices=3, checkpoint_activation=True)
    for _ in range(2):
        x, w = torch.randn(5, 5), torch.randn(5, 4)
        loss_of(ref(x), [w]).backward()
        loss_of(off(x), [w]).backward()
    assert_params_equal(off, ref)


def test_two_forwards_then_one_backward():
    ref, off = mlp(p=0.0), OffloadModel(mlp(p=0.0), "cpu", num_slices=3, checkpoint_activation=True)
    x1, x2, w = torch.randn(4, 5), torch.randn(4, 5), torch.randn(4, 4)
    (loss_of(ref(x1), [w]) + loss_of(ref(x2), [w])).backward()
    (loss_of(off(x1), [w]) + loss_of(off(x2), [w])).backward()
    for (n, a), b in zip(off.named_parameters(), ref.parameters()):
        # the two graphs' gradients meet in a different order than in the single reference graph
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-6, msg=n)


# ------------------------------------------------------------------ compute_dtype and optimizer in backward


def bf16_reference_train(model_fn, num_slices, steps, batch=6, opt_fn=None):
    """fp32 masters; every step runs a bf16 copy; gradients come back as fp32."""
    ref = model_fn()
    off = OffloadModel(model_fn(), "cpu", num_slices=num_slices, checkpoint_activation=True,
                       compute_dtype=torch.bfloat16)  # fmt: skip
    opt_fn = opt_fn or (lambda params: torch.optim.SGD(params, lr=0.1))
    opt_ref = opt_fn(ref.parameters())
    opt_off = opt_fn(off.parameters())
    for _ in range(steps):
        x, w = torch.randn(batch, 5), torch.randn(batch, 4, dtype=torch.bfloat16)
        low = copy.deepcopy(ref).bfloat16()
        torch.manual_seed(9)
        out_ref = low(x.bfloat16())
        (out_ref * w).sum().backward()
        torch.manual_seed(9)
        out = off(x)
        assert out.dtype == torch.bfloat16
        (out * w).sum().backward()
        assert torch.equal(out, out_ref)
        for (n, p), q in zip(off.named_parameters(), low.parameters()):
            assert p.dtype == torch.float32 and p.grad.dtype == torch.float32
            assert torch.equal(p.grad, q.grad.float()), n
        for p, q in zip(ref.parameters(), low.parameters()):
            p.grad = q.grad.float()
        opt_ref.step()
        opt_off.step()
        opt_ref.zero_grad()
        opt_off.zero_grad()
        assert_params_equal(off, ref, grads=False)
    return off


def test_compute_dtype_bf16_exact_against_bf16_copy():
    # one microbatch: the same bf16 math as a bf16 copy of the fp32 masters, so exact; later steps check
    # that the low-precision host shadow is refreshed after each optimizer step
    off = bf16_reference_train(mlp, 3, steps=3)
    assert all(s.shadow.dtype == torch.bfloat16 for s in off._slices)


def test_fused_optimizer_updates_refresh_the_shadow():
    # torch's fused AdamW updates in place without bumping the parameters' version counters, by which the
    # low-precision host shadow knows it is stale: after each step the next forward must see the update
    off = bf16_reference_train(mlp, 3, steps=3, opt_fn=lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True))
    assert all(s.shadow.dtype == torch.bfloat16 for s in off._slices)


def test_compute_dtype_bf16_microbatches_close_to_fp32():
    # Tolerance: bf16 has an 8-bit mantissa (relative rounding 2**-9 ~ 2e-3 per op); through 4 layers and a
    # sum over 12 rows the gradients stay within a few percent of the fp32 ones, relative to their scale.
    ref = mlp(p=0.0)
    off = OffloadModel(mlp(p=0.0), "cpu", num_slices=2, checkpoint_activation=True, num_microbatches=3,
                       compute_dtype=torch.bfloat16)  # fmt: skip
    x, w = torch.randn(12, 5), torch.randn(12, 4)
    loss_of(ref(x), [w]).backward()
    loss_of(off(x), [w.bfloat16()]).backward()
    for (n, p), q in zip(off.named_parameters(), ref.parameters()):
        err = (p.grad - q.grad).abs().max() / q.grad.abs().max()
        assert err < 3e-2, f"{n}: relative error {err}"


OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    # torch's fused AdamW updates in place without bumping version counters (shardfuse._versions counts them)
    "adamw-fused": lambda params: torch.optim.AdamW(params, lr=1e-2, fused=True),
}


@pytest.mark.parametrize("optim", list(OPTIMIZERS))
@pytest.mark.parametrize("compute_dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("checkpoint", [False, True], ids=["keep-acts", "checkpoint"])
def test_optimizer_in_backward_equals_normal_step(checkpoint, compute_dtype, optim):
    make = OPTIMIZERS[optim]
    kw = dict(num_slices=3, checkpoint_activation=checkpoint, num_microbatches=2, compute_dtype=compute_dtype)
    normal = OffloadModel(mlp(), "cpu", **kw)
    inbwd = OffloadModel(mlp(), "cpu", optimizer_in_backward=make, **kw)
    assert len(inbwd.optimizers) == 3 and normal.optimizers == []
    opt = make(normal.parameters())
    for step in range(3):
        x, w = torch.randn(6, 5), torch.randn(6, 4)
        if compute_dtype is not None:
            w = w.to(compute_dtype)
        torch.manual_seed(step)
        loss_of(normal(x), [w]).backward()
        opt.step()
        opt.zero_grad()
        torch.manual_seed(step)
        loss_of(inbwd(x), [w]).backward()
        assert all(p.grad is None for p in inbwd.parameters())
        assert_params_equal(inbwd, normal, grads=False)


# ------------------------------------------------------------------ errors


def test_autograd_grad_is_rejected():
    off = OffloadModel(mlp(), "cpu", num_slices=2, checkpoint_activation=True)
    x = torch.randn(3, 5, requires_grad=True)
    with pytest.raises(RuntimeError, match="not compatible with .grad"):
        torch.autograd.grad(off(x).sum(), x)


def test_offload_activations_with_checkpoint_is_rejected():
    with pytest.raises(ValueError, match="needs checkpoint_activation=False"):
        OffloadModel(mlp(), "cpu", checkpoint_activation=True, offload_activations=True)
    with pytest.raises(TypeError, match="must be a bool"):
        OffloadModel(mlp(), "cpu", offload_activations="yes")


def test_not_sequential():
    with pytest.raises(TypeError, match="needs an nn.Sequential, got Linear"):
        OffloadModel(nn.Linear(2, 2), "cpu")


def test_empty_sequential():
    with pytest.raises(ValueError, match="empty nn.Sequential"):
        OffloadModel(nn.Sequential(), "cpu")


@pytest.mark.parametrize("n", [0, -1, 10], ids=lambda n: f"slices{n}")
def test_bad_num_slices(n):
    with pytest.raises(ValueError, match=rf"num_slices={n} must be between 1 and the number of layers \(9\)"):
        OffloadModel(mlp(), "cpu", num_slices=n)


def test_num_slices_not_int():
    with pytest.raises(TypeError, match="num_slices=2.0 must be an int"):
        OffloadModel(mlp(), "cpu", num_slices=2.0)


def test_bad_num_microbatches():
    with pytest.raises(ValueError, match="num_microbatches=0 must be an int >= 1"):
        OffloadModel(mlp(), "cpu", num_microbatches=0)


def test_batch_smaller_than_microbatches():
    off = OffloadModel(mlp(), "cpu", num_slices=2, checkpoint_activation=True, num_microbatches=4)
    with pytest.raises(ValueError, match="batch size 3 is smaller than num_microbatches=4"):
        off(torch.randn(3, 5))


def test_inputs_with_different_batch_sizes():
    off = OffloadModel(tuple_model(), "cpu", num_slices=2, num_microbatches=2)
    with pytest.raises(ValueError, match=r"same size along dim 0.*\(4,\), \(5, 3\)"):
        off(torch.randint(0, 11, (4,)), torch.randn(5, 3))


class Reduce(nn.Module):
    def forward(self, x):
        return x.sum()


def test_zero_dim_output_with_microbatches():
    off = OffloadModel(nn.Sequential(nn.Linear(3, 3), Reduce()), "cpu", num_slices=2, num_microbatches=2)
    with pytest.raises(ValueError, match="0-dim tensors"):
        off(torch.randn(4, 3))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_cuda_device_without_cuda():
    with pytest.raises(RuntimeError, match="CUDA is not available: pass device=torch.device\\('cpu'\\)"):
        OffloadModel(mlp(), torch.device("cuda"))


def test_unsupported_device():
    with pytest.raises(ValueError, match="device=meta is not supported"):
        OffloadModel(mlp(), "meta")


def test_unsupported_offload_device():
    with pytest.raises(ValueError, match="offload_device=meta is not supported"):
        OffloadModel(mlp(), "cpu", offload_device="meta")


def test_bad_compute_dtype():
    with pytest.raises(ValueError, match="compute_dtype=torch.int8 is not supported"):
        OffloadModel(mlp(), "cpu", compute_dtype=torch.int8)


def test_optimizer_in_backward_not_callable():
    with pytest.raises(TypeError, match="optimizer_in_backward must be a callable"):
        OffloadModel(mlp(), "cpu", optimizer_in_backward=torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=1))


def test_mixed_parameter_dtypes():
    model = mlp()
    model[3].half()
    with pytest.raises(TypeError, match=r"one floating dtype, got \['torch.float16', 'torch.float32'\]"):
        OffloadModel(model, "cpu")


def test_weights_tied_across_slices():
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    b.weight = a.weight
    with pytest.raises(ValueError, match=r"shared by slices 0 and 1"):
        OffloadModel(nn.Sequential(a, nn.ReLU(), b), "cpu", num_slices=2)


def test_moving_the_model_is_rejected():
    off = OffloadModel(mlp(), "cpu")
    with pytest.raises(RuntimeError, match="do not call .to"):
        off.to(torch.float64)


def test_profiler_ranges():
    off = OffloadModel(mlp(), "cpu", num_slices=3, checkpoint_activation=True, num_microbatches=2,
                       optimizer_in_backward=lambda ps: torch.optim.SGD(ps, lr=0.1))  # fmt: skip
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        off(torch.randn(4, 5)).sum().backward()
    names = {e.name for e in prof.events()}
    for phase in ["forward_load", "forward_compute", "forward_drop", "backward_load", "backward_recompute",
                  "backward_pass", "backward_drop", "optimizer_step"]:  # fmt: skip
        assert f"shardfuse.offload:{phase}" in names, phase


def test_transfer_accounting_and_resident_last_slice():
    off = OffloadModel(mlp(), "cpu", num_slices=3, checkpoint_activation=True, compute_dtype=torch.bfloat16)
    sizes = [s.numel for s in off._slices]
    total = sum(sizes)
    loss_of(off(torch.randn(4, 5)), [torch.randn(4, 4)]).backward()
    # forward: fp32 masters in (the bf16 shadow is stale on the first step), shadow out; backward: the bf16
    # shadow in, except for the last slice, which stays resident from the forward; fp32 gradients out
    assert off.transfer_stats(reset=True) == {
        "h2d": 4 * total + 2 * (total - sizes[-1]),
        "d2h": 2 * total + 4 * total,
    }
    loss_of(off(torch.randn(4, 5)), [torch.randn(4, 4)]).backward()  # no step in between: shadow still fresh
    assert off.transfer_stats() == {"h2d": 2 * total + 2 * (total - sizes[-1]), "d2h": 4 * total}


@pytest.mark.parametrize("num_slices", [2, 4], ids=lambda n: f"slices{n}")
def test_checkpoint_with_stash_round_trip(monkeypatch, num_slices):
    # On CUDA the boundary activations come back from pinned host memory as new tensors that do not
    # require grad; on the CPU the stash keeps the tensor itself. Make the CPU stash return a copy too, so
    # a recompute that trusts the restored tensor's requires_grad (and drops every gradient but the last
    # slice's) fails here, not only on a GPU.
    monkeypatch.setattr(_engine.Engine, "stash", lambda self, t: t.detach().clone())
    train_both(mlp, num_slices, 2, True, mlp_inputs(6), steps=2)


def test_checkpoint_forward_keeps_no_boundary_activation(monkeypatch):
    # With checkpoint_activation=True only the stashed (host) copies may outlive the forward: the calls
    # kept for backward must not pin a slice's device input or output. The stash returns a copy, as on CUDA.
    import gc
    import weakref

    monkeypatch.setattr(_engine.Engine, "stash", lambda self, t: t.detach().clone())
    seen: list[weakref.ref] = []
    real_apply = offload_model.apply_block

    def recording_apply(call, tensors):
        seen.extend(weakref.ref(t) for t in tensors)
        return real_apply(call, tensors)

    monkeypatch.setattr(offload_model, "apply_block", recording_apply)
    off = OffloadModel(mlp(), "cpu", num_slices=4, checkpoint_activation=True, num_microbatches=2)
    out = off(torch.randn(6, 5))
    gc.collect()
    alive = [i for i, r in enumerate(seen[1:], start=1) if r() is not None]  # seen[0] is the caller's input
    assert alive == [], f"boundary activations of slices {alive} are still alive after the forward"
    out.sum().backward()
    assert all(p.grad is not None for p in off.parameters())
