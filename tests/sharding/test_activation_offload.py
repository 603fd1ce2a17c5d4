"""``offload_activations`` on the CPU (one rank): what chosen units save for backward leaves the device at the end of
their forward (the saved tensors themselves die) and comes back for their backward, with the same losses and
gradients as without it, bit for bit; the prefetch order, a tensor saved twice, an in-place change after saving, a
retained graph, a forward that raises, and the errors for units that are not the model's."""

from __future__ import annotations

import weakref
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardfuse
from shardfuse import FullyShardedDataParallel as FSDP
from shardfuse.sharding.host import _activations
from shardfuse.sharding.host._activations import GroupState, IllegalGroupMove

D = 16


class _Group:
    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 1


class Block(nn.Module):
    def __init__(self, inplace_after_save: bool = False, square: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, 4 * D)
        self.fc2 = nn.Linear(4 * D, D)
        self.inplace_after_save, self.square = inplace_after_save, square
        self.probe: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(self.norm(x))
        self.probe = weakref.ref(h)  # saved by gelu alone: with the offload it dies at the end of the forward
        a = F.gelu(h)
        if self.square:
            a = a * a  # the same tensor saved twice by one node
        if self.inplace_after_save:
            h.add_(1.0)
        return x + self.fc2(a)


class Net(nn.Module):
    def __init__(self, n: int = 4, **block: Any) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.blocks = nn.ModuleList(Block(**block) for _ in range(n))
        self.head = nn.Linear(D, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def wrapped(seed: int, fsdp: dict[str, Any] | None = None, checkpointed: bool = False, **kw: Any) -> FSDP:
    torch.manual_seed(seed)
    net = Net(**kw)
    for i, b in enumerate(net.blocks):
        net.blocks[i] = FSDP(shardfuse.checkpoint_wrapper(b) if checkpointed else b, process_group=_Group(),
                             **(fsdp or {}))
    return FSDP(net, process_group=_Group(), **(fsdp or {}))


def train(model: FSDP, data: list[torch.Tensor], retain: bool = False, host_optimizer: bool = False) -> list[float]:
    opt: Any = torch.optim.SGD(model.parameters(), lr=0.1)
    if host_optimizer:
        opt = shardfuse.OffloadOptimizer(model, torch.optim.AdamW(model.parameters(), lr=0.01))
    losses = []
    for x in data:
        loss = model(x).square().mean()
        loss.backward(retain_graph=retain)
        if retain:
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    if host_optimizer:
        opt.close()
    return losses


def params(model: FSDP) -> list[torch.Tensor]:
    with model.summon_full_params():
        return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("units", [1, 2, 4])
@pytest.mark.parametrize("ahead", [None, 0, 1])
@pytest.mark.parametrize("block", [{}, {"square": True}], ids=["plain", "saved_twice"])
def test_same_losses_and_parameters(units: int, ahead: int | None, block: dict[str, Any]) -> None:
    seed = int(torch.randint(0, 1 << 30, ()).item())
    data = [torch.randn(8, 5, D) for _ in range(3)]
    ref = wrapped(seed, **block)
    want = train(ref, data)
    model = wrapped(seed, **block)
    off = shardfuse.offload_activations(model, units, prefetch_ahead=ahead, min_bytes=0)
    assert train(model, data) == want
    for a, b in zip(params(model), params(ref)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    stats = off.stats()
    # per block the norm's input, mean and rstd, fc1's input, gelu's input, fc2's input (a * a: one more); never
    # fc1's and fc2's weights, which are views of the gathered flat parameter
    per_block = 7 if block else 6
    assert stats["calls"] == units and stats["tensors"] == per_block * units and stats["late_fetches"] == 0, stats


@pytest.mark.parametrize("case", [
    {"fsdp": {"use_orig_params": True}},
    {"fsdp": {"mixed_precision": True, "compute_dtype": torch.bfloat16}},
    # the CPU as compute device also where a GPU is (move_params_to_cpu computes on the GPU by default there)
    {"fsdp": {"move_params_to_cpu": True, "compute_device": torch.device("cpu")}, "host_optimizer": True},
    {"checkpointed": True},
], ids=["orig_params", "bf16", "offload_optimizer", "checkpoint_wrapper"])
def test_composes_with_the_other_features(case: dict[str, Any]) -> None:
    seed = int(torch.randint(0, 1 << 30, ()).item())
    data = [torch.randn(4, 5, D) for _ in range(3)]
    build = {k: v for k, v in case.items() if k != "host_optimizer"}
    host = case.get("host_optimizer", False)
    want = train(wrapped(seed, **build), data, host_optimizer=host)
    model = wrapped(seed, **build)
    off = shardfuse.offload_activations(model, 2, min_bytes=0)
    assert train(model, data, host_optimizer=host) == want
    # a checkpointed block keeps only its input, through the checkpoint's own hooks: nothing for the offload
    assert (off.stats()["tensors"] == 0) == ("checkpointed" in case), off.stats()


def test_saved_tensors_leave_at_the_end_of_the_forward() -> None:
    model = wrapped(0)
    shardfuse.offload_activations(model, 2, min_bytes=0)
    loss = model(torch.randn(4, 5, D)).sum()
    blocks = model.module.blocks
    assert [b.module.probe() is None for b in blocks] == [True, True, False, False]
    loss.backward()
    off = model._unit.saved_activations
    assert off is not None and off.stats()["late_fetches"] == 0


def test_a_tensor_saved_twice_is_copied_once() -> None:
    model = wrapped(1, n=2, square=True)
    off = shardfuse.offload_activations(model, 1, min_bytes=0)
    model(torch.randn(4, 5, D)).sum().backward()
    once = off.stats()["tensors"]
    plain = wrapped(1, n=2)
    off_plain = shardfuse.offload_activations(plain, 1, min_bytes=0)
    plain(torch.randn(4, 5, D)).sum().backward()
    # a * a saves a twice (one entry, packed twice) and feeds fc2 a tensor of its own: one entry more than plain
    assert once == off_plain.stats()["tensors"] + 1, (once, off_plain.stats())


def test_prefetch_follows_the_backward_order(monkeypatch) -> None:
    model = wrapped(2)
    off = shardfuse.offload_activations(model, 4, prefetch_ahead=1, min_bytes=0)
    fetched: list[list[int]] = []
    real_fetch, real_before = off._fetch, off.before_backward

    def before(unit: Any) -> None:
        fetched.append([])
        real_before(unit)

    def fetch(group: Any) -> None:
        fetched[-1].append(next(i for i, c in enumerate(off._calls) if c.group is group))
        real_fetch(group)

    monkeypatch.setattr(off, "_fetch", fetch)
    monkeypatch.setattr(off, "before_backward", before)
    model(torch.randn(4, 5, D)).sum().backward()
    # positions: blocks 0-3 end their forwards first (0-3), the top unit last (4). The top's backward starts first
    # and fetches block 3 (one position before it); then each block's backward fetches the block before it.
    assert [f for f in fetched if f] == [[3], [2], [1], [0]], fetched
    assert off.stats()["late_fetches"] == 0


def test_without_prefetch_every_group_is_a_late_fetch(monkeypatch) -> None:
    model = wrapped(3)
    off = shardfuse.offload_activations(model, 3, min_bytes=0)
    monkeypatch.setattr(off, "before_backward", lambda unit: None)
    ref = wrapped(3)
    x = torch.randn(4, 5, D)
    model(x).sum().backward()
    ref(x).sum().backward()
    assert off.stats()["late_fetches"] == 3
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)


def test_retained_graph_backward_twice() -> None:
    seed = int(torch.randint(0, 1 << 30, ()).item())
    data = [torch.randn(4, 5, D) for _ in range(2)]
    want = train(wrapped(seed), data, retain=True)
    model = wrapped(seed)
    shardfuse.offload_activations(model, 2, min_bytes=0)
    assert train(model, data, retain=True) == want


def test_in_place_change_after_saving_raises() -> None:
    model = wrapped(4, inplace_after_save=True)
    shardfuse.offload_activations(model, 1, min_bytes=0)
    with pytest.raises(RuntimeError, match="modified by an in-place operation after it was saved"):
        model(torch.randn(4, 5, D))
    # without the offload autograd raises too, at backward
    ref = wrapped(4, inplace_after_save=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        ref(torch.randn(4, 5, D)).sum().backward()


def test_a_forward_that_raises_drops_its_group_and_the_next_step_runs() -> None:
    model = wrapped(5)
    off = shardfuse.offload_activations(model, 2, min_bytes=0)
    with pytest.raises(RuntimeError):
        model(torch.randn(4, 5, D + 1))
    loss = model(torch.randn(4, 5, D)).sum()
    loss.backward()
    assert off.stats()["calls"] == 2


def test_no_grad_forward_offloads_nothing() -> None:
    model = wrapped(9)
    off = shardfuse.offload_activations(model, 4, min_bytes=0)
    with torch.no_grad():
        model(torch.randn(4, 5, D))
    assert off.stats() == {"calls": 0, "tensors": 0, "bytes": 0, "late_fetches": 0}
    model(torch.randn(4, 5, D)).sum().backward()
    assert off.stats()["calls"] == 4


def test_small_tensors_stay() -> None:
    model = wrapped(6)
    off = shardfuse.offload_activations(model, 4, min_bytes=1 << 20)
    model(torch.randn(4, 5, D)).sum().backward()
    assert off.stats()["tensors"] == 0 and off.stats()["calls"] == 4


def test_remove_turns_it_off_and_a_new_one_can_follow() -> None:
    model = wrapped(7)
    off = shardfuse.offload_activations(model, 2, min_bytes=0)
    with pytest.raises(ValueError, match="already offloads activations"):
        shardfuse.offload_activations(model, 1)
    off.remove()
    loss = model(torch.randn(4, 5, D)).sum()
    assert all(b.module.probe() is not None for b in model.module.blocks)
    loss.backward()
    assert off.stats()["calls"] == 0  # detached: no unit calls it
    again = shardfuse.offload_activations(model, [model.module.blocks[3]], min_bytes=0)
    assert again.chosen_names == [model.module.blocks[3]._unit.name]
    model(torch.randn(4, 5, D)).sum().backward()
    assert again.stats()["calls"] == 1


def test_choosing_units() -> None:
    model = wrapped(8)
    blocks = model.module.blocks
    with pytest.raises(ValueError, match="4 innermost units"):
        shardfuse.offload_activations(model, 5)
    with pytest.raises(ValueError, match="1..4"):
        shardfuse.offload_activations(model, 0)
    with pytest.raises(TypeError, match="units=True"):
        shardfuse.offload_activations(model, True)
    with pytest.raises(ValueError, match="picked no unit"):
        shardfuse.offload_activations(model, lambda name, m: name == "nothing")
    with pytest.raises(ValueError, match="Linear given"):
        shardfuse.offload_activations(model, [nn.Linear(2, 2)])
    with pytest.raises(ValueError, match="outermost"):
        shardfuse.offload_activations(blocks[0], 1)
    with pytest.raises(ValueError, match="prefetch_ahead=-1"):
        shardfuse.offload_activations(model, 1, prefetch_ahead=-1)
    with pytest.raises(ValueError, match="min_bytes=-2"):
        shardfuse.offload_activations(model, 1, min_bytes=-2)
    by_name = shardfuse.offload_activations(model, lambda name, m: name.endswith(("blocks.1", "blocks.2")))
    assert len(by_name.chosen_names) == 2 and by_name.prefetch_ahead == _activations.DEFAULT_PREFETCH_AHEAD
    by_name.remove()
    inner = shardfuse.offload_activations(model, [blocks[0].module, blocks[0]])  # a wrapped module or its wrapper
    assert len(inner.chosen_names) == 1


@pytest.mark.parametrize(("n", "count", "ahead", "want"), [
    (10, 3, None, [0, 3, 6]),  # spread over the first 10 - (2 + 1) blocks
    (10, 4, 1, [0, 2, 5, 7]),
    (10, 8, 2, list(range(8))),  # more than the spread leaves room for: the first 8
    (10, 10, 0, list(range(10))),
    (10, 1, 2, [0]),
])
def test_a_count_spreads_the_units(n: int, count: int, ahead: int | None, want: list[int]) -> None:
    model = wrapped(int(torch.randint(0, 1 << 30, ()).item()), n=n)
    off = shardfuse.offload_activations(model, count, prefetch_ahead=ahead, min_bytes=0)
    loss = model(torch.randn(4, 5, D)).sum()
    # an offloaded block's gelu input dies when its forward ends; the others' live until their backward
    assert [i for i, b in enumerate(model.module.blocks) if b.module.probe() is None] == want
    loss.backward()
    assert off.stats()["calls"] == count and off.stats()["late_fetches"] == 0


@pytest.mark.parametrize("units", range(1, 41))
@pytest.mark.parametrize("ahead", [0, 1, 2, 5])
def test_spread_indices(units: int, ahead: int) -> None:
    room = units - ahead - 1
    for count in range(1, units + 1):
        got = _activations.spread(count, units, ahead)
        assert len(got) == count and got[0] == 0 and all(a < b for a, b in zip(got, got[1:])), (count, got)
        if count == 1:
            assert got == [0]
        elif count <= room:
            assert got[-1] == room - 1, (count, units, ahead, got)  # reaches the last unit it may take
        else:
            assert got == list(range(count)), (count, got)


def test_group_moves_are_checked() -> None:
    g = _activations._Group("unit", torch.device("cpu"))
    g.move(GroupState.ON_HOST)
    with pytest.raises(IllegalGroupMove, match="ON_HOST -> DROPPED"):
        g.move(GroupState.DROPPED)
    g.move(GroupState.FETCHING)
    g.move(GroupState.ON_HOST)


def test_dense_layouts() -> None:
    t = torch.randn(4, 6, 8)
    assert _activations._dense(t) and _activations._dense(t.transpose(0, 2)) and _activations._dense(t[1:2])
    assert _activations._dense(t.unsqueeze(1).transpose(0, 3))
    for gaps in (t[:, ::2], t[:, :, :1], t.expand(2, 4, 6, 8)):
        assert not _activations._dense(gaps), gaps.stride()
