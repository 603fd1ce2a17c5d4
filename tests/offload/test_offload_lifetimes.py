"""What an OffloadModel step leaves alive on the compute device, checked on the CPU.

The CPU stands in for the GPU: the engine's bookkeeping says which tensors are the compute device's (what a
slice's kept graph saves), and ``StorageWeakRef`` says whether their memory is still allocated, whoever holds
it (a Python object, or autograd's C++ graph, which Python's garbage collector cannot see into).

The regression these tests pin down (issue 20, item 6): since the ``Kept`` / ``retain_graph`` change, the last
slice ran its kept graph with ``retain_graph=True``, and the graph's saved tensors were never freed. The
saved-tensor pack hook handed autograd the saved tensor itself; a tensor saved as the output of its own node
(ReLU saves its result) then formed a cycle node -> saved tensor -> ``grad_fn`` -> node, which only the
node-by-node release of a non-retained backward broke. Every step leaked the last slice's activations (on the
GPU, ~0.4 GiB a step on the offload bench: 9.19 GiB peak instead of 3.69).
"""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from shardfuse.offload import OffloadModel, _buffers, _engine
from shardfuse.offload import _model as offload_model

pytestmark = pytest.mark.usefixtures("poisoned_slots")


def relu_net(width: int = 16, depth: int = 8, seed: int = 0) -> nn.Sequential:
    """``depth`` x (Linear + ReLU), the shape of the offload bench: ReLU saves its own output."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers)


class SavedLog:
    """Weak references to the storage of every activation a slice's kept graph saved, by slice index."""

    def __init__(self) -> None:
        self.refs: list[tuple[int, StorageWeakRef, int, int]] = []

    def alive(self, slices: set[int] | None = None) -> list[tuple[int, int]]:
        """(slice index, bytes) of the saved activations whose memory is still allocated."""
        gc.collect()  # what survives this is held by autograd's graph or a leak, not by a pending collection
        return [(i, n) for i, ref, n, _ in self.refs if not ref.expired() and (slices is None or i in slices)]

    def storages(self, index: int) -> set[int]:
        """Addresses of the storages slice ``index`` saved."""
        return {ptr for i, _, _, ptr in self.refs if i == index}


@pytest.fixture
def saved_log(monkeypatch) -> SavedLog:
    """Wrap each slice's saved-tensor hooks: log what its kept graph saves (parameter views excluded)."""
    log = SavedLog()
    real = offload_model._SliceCall.saved_tensors_hooks

    def hooks(self: Any) -> torch.autograd.graph.saved_tensors_hooks:
        inner = real(self)

        def pack(t: torch.Tensor) -> Any:
            if t.untyped_storage().data_ptr() != self._fwd_storage:  # a parameter slot lives in the pool
                storage = t.untyped_storage()
                log.refs.append((self.slice.index, StorageWeakRef(storage), t.nbytes, storage.data_ptr()))
            return inner.pack_hook(t)

        return torch.autograd.graph.saved_tensors_hooks(pack, inner.unpack_hook)

    monkeypatch.setattr(offload_model._SliceCall, "saved_tensors_hooks", hooks)
    return log


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01)


MODES = {
    "keep-acts": dict(),
    "offload-acts": dict(offload_activations=True),
    "offload-acts-opt-in-bwd": dict(offload_activations=True, optimizer_in_backward=sgd),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_a_step_leaves_no_activation_alive(park_everything, saved_log, mode):
    off = OffloadModel(relu_net(), "cpu", num_slices=4, **MODES[mode])
    opt = None if "optimizer_in_backward" in MODES[mode] else sgd(off.parameters())
    for step in range(3):
        loss = off(torch.randn(8, 16)).pow(2).mean()
        loss.backward()
        if opt is not None:
            opt.step()
            opt.zero_grad()
        del loss
        alive = saved_log.alive()
        # failed before the fix: the last slice's activations of every step so far stayed allocated
        assert alive == [], f"step {step}: {len(alive)} saved activations outlived the step (slice, bytes): {alive}"


@pytest.mark.parametrize("mode", list(MODES))
def test_retained_graph_is_freed_by_the_last_backward(park_everything, saved_log, mode):
    kw = dict(MODES[mode])
    kw.pop("optimizer_in_backward", None)  # a second backward is refused there (it stepped the weights)
    off = OffloadModel(relu_net(), "cpu", num_slices=4, **kw)
    loss = off(torch.randn(8, 16)).pow(2).mean()
    loss.backward(retain_graph=True)
    assert saved_log.alive(), "a retained graph keeps what its second backward needs"
    loss.backward()
    del loss
    assert saved_log.alive() == []
    # a retained graph dropped without a second backward frees everything too
    loss = off(torch.randn(8, 16)).pow(2).mean()
    loss.backward(retain_graph=True)
    del loss
    assert saved_log.alive() == []


@pytest.mark.parametrize("opt_in_bwd", [False, True], ids=["host-opt", "opt-in-bwd"])
def test_offloaded_activations_leave_the_device_between_forward_and_backward(park_everything, saved_log, opt_in_bwd):
    # With offload_activations the kept graphs of every slice but the last hold host copies only: between
    # forward and backward no activation of an earlier slice is allocated on the compute device.
    n = 4
    off = OffloadModel(relu_net(), "cpu", num_slices=n, offload_activations=True,
                       optimizer_in_backward=sgd if opt_in_bwd else None)  # fmt: skip
    loss = off(torch.randn(8, 16)).pow(2).mean()
    assert {i for i, *_ in saved_log.refs} == set(range(n))
    # the last slice's input is the previous slice's output, which that slice saved too (ReLU saves its result)
    last = saved_log.storages(n - 1)
    earlier = [(i, ref) for i, ref, _, ptr in saved_log.refs if i < n - 1 and ptr not in last]
    gc.collect()
    assert earlier and [i for i, ref in earlier if not ref.expired()] == []
    assert saved_log.alive({n - 1}), "the last slice keeps its activations on the device (its backward is next)"
    loss.backward()
    del loss
    assert saved_log.alive() == []


class _FakeEvent:
    """Stands in for a CUDA event: ``done`` says whether the device work before it has finished."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


def test_pending_frees_hold_until_the_read_is_over(monkeypatch):
    # What replaces record_stream: a device tensor read by the d2h stream stays alive until its copy's event.
    waited = []
    monkeypatch.setattr(_buffers, "wait_event", lambda stream, ev: waited.append(ev))
    pending = _buffers.PendingFrees()
    a, b = torch.randn(4), torch.randn(4)
    ea, eb = _FakeEvent(), _FakeEvent()
    refs = [StorageWeakRef(t.untyped_storage()) for t in (a, b)]
    pending.hold(a, ea)
    pending.hold(b, eb)
    pending.hold(torch.randn(4), None)  # CPU: the copy already ran, nothing to hold
    del a, b
    assert len(pending) == 2 and not any(r.expired() for r in refs)
    ea.done = True
    pending.collect()
    assert len(pending) == 1 and refs[0].expired() and not refs[1].expired()
    pending.release_all(compute=None)
    assert waited == [eb] and len(pending) == 0 and refs[1].expired()


def test_pending_frees_are_bounded(monkeypatch):
    # The host may run ahead of the GPU: past MAX_HELD held copies, the oldest is released after the compute stream
    # waits for its read (a device-side wait), so held activations cannot pile up under a tight memory cap.
    waited = []
    monkeypatch.setattr(_buffers, "wait_event", lambda stream, ev: waited.append((stream, ev)))
    pending = _buffers.PendingFrees()
    tensors = [torch.randn(4) for _ in range(pending.MAX_HELD + 3)]
    events = [_FakeEvent() for _ in tensors]
    refs = [StorageWeakRef(t.untyped_storage()) for t in tensors]
    for t, ev in zip(tensors, events):
        pending.hold(t, ev, compute="compute")
    del tensors, t
    assert len(pending) == pending.MAX_HELD
    assert waited == [("compute", ev) for ev in events[:3]]
    assert all(r.expired() for r in refs[:3]) and not any(r.expired() for r in refs[3:])


def test_offload_package_keeps_the_rules():
    # issue 19, section 4: errors that name the value and the fix (no bare assert), lifetimes held by events
    # (no record_stream)
    import ast
    from pathlib import Path

    import shardfuse.offload as pkg

    for path in Path(pkg.__file__).parent.glob("*.py"):
        tree = ast.parse(path.read_text())
        asserts = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Assert)]
        streams = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "record_stream"]
        assert asserts == [] and streams == [], f"{path.name}: assert at {asserts}, record_stream at {streams}"


class _BehindD2H:
    """A device->host stream the host runs ahead of, as in the offload bench (the host queues a whole forward
    and backward before the GPU is far into the forward): no copy is found done by a query until the host
    waits for one, and then every copy before it is done too (one stream, in order)."""

    def __init__(self) -> None:
        self.issued = 0
        self.done = 0

    def event(self) -> _BehindEvent:
        self.issued += 1
        return _BehindEvent(self, self.issued)


class _BehindEvent:
    def __init__(self, stream: _BehindD2H, seq: int) -> None:
        self.stream, self.seq = stream, seq

    def query(self) -> bool:
        return self.seq <= self.stream.done

    def synchronize(self) -> None:
        self.stream.done = max(self.stream.done, self.seq)


def _trace_copy_sources(monkeypatch, hold: bool, **kw: Any) -> list[tuple[str, int, int, int]]:
    """Two steps on the CPU with every stash a device->host copy behind the host (the engine's own hold and
    release bookkeeping runs as on a GPU). At each slice load: (phase, slice, copy sources still allocated,
    tensors the engine holds). ``hold=False`` is record_stream's schedule: the engine holds nothing, and a
    source's memory leaves the allocator's count when its last other reference goes."""
    d2h = _BehindD2H()
    sources: list[StorageWeakRef] = []

    def copy_home(self: Any, t: torch.Tensor) -> tuple[torch.Tensor, Any]:
        sources.append(StorageWeakRef(t.untyped_storage()))
        return t.detach().clone(), d2h.event()

    monkeypatch.setattr(_engine.Engine, "_on_device", lambda self, t: True)
    monkeypatch.setattr(_engine.Engine, "_copy_home", copy_home)
    monkeypatch.setattr(offload_model, "MIN_OFFLOAD_BYTES", 0)
    with monkeypatch.context() as m:
        if not hold:
            m.setattr(_buffers.PendingFrees, "hold", lambda self, t, ev, compute=None: None)
        trace: list[tuple[str, int, int, int]] = []
        real_acquire = _engine.Engine.acquire

        def acquire(self: Any, s: Any, phase: Any, stash: Any = None, **kw: Any) -> Any:
            gc.collect()
            trace.append((phase.value, s.index, sum(not r.expired() for r in sources), len(self.pending)))
            return real_acquire(self, s, phase, stash, **kw)

        m.setattr(_engine.Engine, "acquire", acquire)
        off = OffloadModel(relu_net(depth=8), "cpu", num_slices=4, **kw)
        opt = None if kw.get("optimizer_in_backward") else sgd(off.parameters())
        torch.manual_seed(1)
        for _ in range(2):
            x = torch.randn(8, 16)
            off(x).pow(2).mean().backward()
            if opt is not None:
                opt.step()
                opt.zero_grad()
            del x
    return trace


def test_stashed_inputs_die_when_their_slice_forward_ends(monkeypatch):
    # The offload bench's default shape (checkpoint_activation=True, 4 microbatches): each slice's input is
    # copied home while the slice computes. Held until a query found its copy done, and the host far ahead of
    # the GPU, the last two inputs stayed allocated through backward (4.28 -> 4.53 GiB on the GPU at the
    # MAX_HELD commit); record_stream had let each go when the forward dropped it. Now the engine drops its hold
    # at the end of that slice's forward (after a compute-stream wait): at every slice load the copy sources
    # still allocated are exactly those of record_stream's schedule, and the engine holds nothing.
    kw = dict(checkpoint_activation=True, num_microbatches=4)
    now = _trace_copy_sources(monkeypatch, hold=True, **kw)
    before = _trace_copy_sources(monkeypatch, hold=False, **kw)
    assert [t[:3] for t in now] == [t[:3] for t in before], f"now {now}\nrecord_stream's schedule {before}"
    assert max(held for *_, held in now) == 0
    assert max(alive for _, _, alive, _ in now) == max(alive for _, _, alive, _ in before)


@pytest.mark.parametrize("opt_in_bwd", [False, True], ids=["host-opt", "opt-in-bwd"])
def test_parked_activations_are_not_held_into_backward(monkeypatch, opt_in_bwd):
    # offload_activations: what a slice parked goes at the end of the next slice's forward at the latest (its
    # copies ran while that one computed), so backward starts with the copy sources of record_stream's schedule;
    # in the forward at most MAX_HELD more are allocated (the bound of the capped run).
    kw = dict(offload_activations=True, optimizer_in_backward=sgd if opt_in_bwd else None)
    now = _trace_copy_sources(monkeypatch, hold=True, **kw)
    before = _trace_copy_sources(monkeypatch, hold=False, **kw)
    assert [t[:3] for t in now if t[0] == "backward"] == [t[:3] for t in before if t[0] == "backward"]
    assert all(held == 0 for phase, _, _, held in now if phase == "backward")
    assert all(a - b <= _buffers.PendingFrees.MAX_HELD for (_, _, a, _), (_, _, b, _) in zip(now, before))


def test_pending_frees_release_waits_then_drops_only_the_named_copies(monkeypatch):
    # A caller done with a source (its slice's forward is over) drops it without a query: the compute stream waits
    # for that copy first, so the memory is never handed out again under a running copy; the others stay held.
    waited = []
    monkeypatch.setattr(_buffers, "wait_event", lambda stream, ev: waited.append((stream, ev)))
    pending = _buffers.PendingFrees()
    tensors = [torch.randn(4) for _ in range(2)]
    events = [_FakeEvent() for _ in tensors]
    refs = [StorageWeakRef(t.untyped_storage()) for t in tensors]
    for t, ev in zip(tensors, events):
        pending.hold(t, ev, compute="compute")
    del tensors, t
    pending.release([events[0], None], compute="compute")
    assert waited == [("compute", events[0])] and len(pending) == 1
    assert refs[0].expired() and not refs[1].expired()
