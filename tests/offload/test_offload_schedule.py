"""What crosses the bus with ``optimizer_in_backward``, and that the shorter schedule computes the same bits.

With the optimizer stepping on the device, the first slices' backward comes last and leaves their updated device
copy behind: they stay for the next forward (``Engine.carries``), and their low-precision shadow does not go home.
The last slice is loaded with its fp32 master in the forward already (its backward follows at once), so its
backward loads nothing and it sends no shadow home either. These tests hold the new schedule against the old one
(carrying off, the last slice reloaded for its backward) bit for bit, count the bytes of both, and check that
whatever invalidates a carried copy (a forward without autograd, a load of new weights) is honoured.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardfuse.offload import OffloadModel
from shardfuse.offload._engine import Phase

pytestmark = pytest.mark.usefixtures("poisoned_slots")


def model(seed: int = 0, width: int = 8, depth: int = 8) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.ReLU())])


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def old_schedule(off: OffloadModel) -> OffloadModel:
    """The schedule before carrying: nothing stays between steps, the last slice is reloaded for its backward."""
    off._engine.carry = False
    return off


def make(num_slices: int, dtype: torch.dtype | None, checkpoint: bool, mb: int, old: bool = False) -> OffloadModel:
    off = OffloadModel(model(), "cpu", num_slices=num_slices, checkpoint_activation=checkpoint, num_microbatches=mb,
                       compute_dtype=dtype, optimizer_in_backward=sgd)  # fmt: skip
    return old_schedule(off) if old else off


def step(off: OffloadModel, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    out = off(x)
    (out.float() * w).sum().backward()
    return out.detach()


@pytest.mark.parametrize("mb", [1, 3], ids=lambda m: f"mb{m}")
@pytest.mark.parametrize("checkpoint", [False, True], ids=["keep-acts", "checkpoint"])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_slices", [1, 2, 3, 5], ids=lambda n: f"slices{n}")
def test_carried_schedule_equals_old_schedule_bit_for_bit(num_slices, dtype, checkpoint, mb):
    new, old = make(num_slices, dtype, checkpoint, mb), make(num_slices, dtype, checkpoint, mb, old=True)
    for i in range(4):
        x, w = torch.randn(6, 8), torch.randn(6, 8)
        out_new, out_old = step(new, x, w), step(old, x, w)
        assert torch.equal(out_new, out_old), f"step {i}: outputs differ"
        for (n, p), q in zip(new.named_parameters(), old.parameters()):
            assert torch.equal(p, q), f"step {i}: {n}"
            assert p.grad is None
        for a, b in zip(new.optimizers, old.optimizers):
            for p, q in zip(a.param_groups[0]["params"], b.param_groups[0]["params"]):
                assert torch.equal(a.state[p]["momentum_buffer"], b.state[q]["momentum_buffer"])
    carried = sorted(new._engine._prefetched)
    assert carried == list(range(min(2, num_slices - 1)))
    assert old._engine._prefetched == {}


def test_bytes_of_the_carried_schedule():
    # bf16, 4 slices: slices 0 and 1 stay on the device between steps, slice 3 (the last) is loaded as fp32 in
    # the forward and kept; only slice 2's shadow goes home. Old schedule: every slice loaded in the forward (the
    # bf16 shadow) and again in the backward (the fp32 master), every shadow sent home.
    new, old = make(4, torch.bfloat16, True, 2), make(4, torch.bfloat16, True, 2, old=True)
    sizes = [s.numel for s in new._slices]
    total = sum(sizes)
    for off in (new, old):
        for _ in range(2):  # the first step loads stale shadows as fp32
            step(off, torch.randn(6, 8), torch.randn(6, 8))
        off.transfer_stats(reset=True)
        step(off, torch.randn(6, 8), torch.randn(6, 8))
    assert old.transfer_stats() == {"h2d": 2 * total + 4 * total, "d2h": 4 * total + 2 * total}
    assert new.transfer_stats() == {
        "h2d": 2 * sizes[2] + 4 * sizes[3] + 4 * (sizes[0] + sizes[1] + sizes[2]),
        "d2h": 4 * total + 2 * sizes[2],
    }
    # fp32: the last slice is no longer loaded twice, the first two not at all in the forward
    new32 = make(4, None, True, 2)
    for _ in range(2):
        new32.transfer_stats(reset=True)
        step(new32, torch.randn(6, 8), torch.randn(6, 8))
    assert new32.transfer_stats() == {"h2d": 4 * (total - sizes[0] - sizes[1]) + 4 * (total - sizes[3]),
                                      "d2h": 4 * total}  # fmt: skip


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_eval_between_steps_sees_the_updated_weights(dtype):
    # A forward without autograd uses the carried copies, then gives every device buffer back; the next training
    # forward loads the masters again (stale shadows: fp32, cast on the device) and computes what the old one does.
    new, old = make(3, dtype, True, 2), make(3, dtype, True, 2, old=True)
    for _ in range(3):
        x, w = torch.randn(5, 8), torch.randn(5, 8)
        assert torch.equal(step(new, x, w), step(old, x, w))
        with torch.no_grad():
            assert torch.equal(new(x), old(x))
        assert new._engine._prefetched == {} and new._engine.param_pool._made == 0
    for p, q in zip(new.parameters(), old.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_new_weights_between_steps_replace_the_carried_copy(dtype):
    # load_state_dict writes the masters in place: the carried copies are stale and must not be used
    new = make(3, dtype, True, 1)
    step(new, torch.randn(5, 8), torch.randn(5, 8))
    assert sorted(new._engine._prefetched) == [0, 1]
    other = model(seed=7)
    new.load_state_dict(other.state_dict())
    x = torch.randn(5, 8)
    out = new(x)
    ref = (other.bfloat16() if dtype else other)(x.to(dtype) if dtype else x)
    assert torch.equal(out, ref)


def test_carried_slices_are_dropped_when_room_is_needed():
    # A load for which no slot is free drops the parked copies (carried ones included) rather than failing.
    off = make(3, torch.bfloat16, True, 1)
    step(off, torch.randn(4, 8), torch.randn(4, 8))
    eng = off._engine
    assert not eng.param_pool.has_free()
    ld = eng.acquire(off._slices[2], Phase.FORWARD)
    assert eng._prefetched == {}  # both carried copies given back for slice 2's load
    eng.release(ld)
    eng.idle()
    assert eng.param_pool._made == 0


def test_no_carry_without_optimizer_in_backward():
    off = OffloadModel(model(), "cpu", num_slices=3, checkpoint_activation=True, compute_dtype=torch.bfloat16)
    step(off, torch.randn(4, 8), torch.randn(4, 8))
    assert off._engine._prefetched == {} and off._engine.param_pool._made == 0
    assert not any(off._engine.carries(s) for s in off._slices)
