"""The state machine of an SSD tier page (issue 29): every change of state is one the table lists, an illegal one
raises naming the page and both states, and a training step takes each page around the machine and back to disk."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from shardfuse import OffloadConfig
from shardfuse.sharding import FullyShardedDataParallel as FSDP
from shardfuse.sharding.ssd._ssd import ssd_host
from shardfuse.sharding.ssd._ssd_page import TRANSITIONS, Page, PageState
from tests.sharding.test_ssd_offload import _flat_handles, _Group


def test_the_table_covers_every_state():
    assert set(TRANSITIONS) == set(PageState)
    assert TRANSITIONS[PageState.DETACHED] == {}
    for state, targets in TRANSITIONS.items():
        assert state not in targets, f"{state.name} -> itself is no transition"
        assert state.targets == tuple(targets)
    assert {s for s in PageState if s.shown} == {PageState.IN_USE, PageState.DETACHED}
    # From ON_DISK every state is reachable; from every state but DETACHED (for good) the way back to ON_DISK.
    assert _reachable(PageState.ON_DISK) == set(PageState)
    for state in set(PageState) - {PageState.DETACHED}:
        assert PageState.ON_DISK in _reachable(state) | {state}, state


def _reachable(start: PageState) -> set[PageState]:
    reach, todo = set(), [start]
    while todo:
        for nxt in TRANSITIONS[todo.pop()]:
            if nxt not in reach:
                reach.add(nxt)
                todo.append(nxt)
    return reach


def _model(path: str, state: bool = True) -> tuple[FSDP, Any]:
    torch.manual_seed(3)
    oc = OffloadConfig(offload_type="ssd_offload", dir=path, optimizer_state=state)
    net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    net[0] = FSDP(net[0], process_group=_Group(), offload_config=oc)
    m = FSDP(net, process_group=_Group(), offload_config=oc)
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2)


def test_an_illegal_transition_names_the_page_and_both_states(tmp_path):
    m, _ = _model(str(tmp_path))
    page = ssd_host(m._unit.handles[0]).ssd.param  # type: ignore[union-attr]
    page.file.then(lambda: None).wait()
    assert page.state is PageState.ON_DISK
    with pytest.raises(RuntimeError, match=r"flat_param_0 \(the flat shard of 2.weight, 2.bias\): the page cannot go "
                                           r"from ON_DISK to DETACHED \(it may go to READING\)"), page.lock:
        page._to(PageState.DETACHED)
    assert page.state is PageState.ON_DISK


def test_a_step_takes_every_page_around_and_back_to_disk(tmp_path, monkeypatch):
    m, opt = _model(str(tmp_path))
    seen: dict[int, list[tuple[PageState, PageState]]] = {}
    real = Page._to

    def recording(self: Page, new: PageState) -> None:
        old = self.state
        real(self, new)
        seen.setdefault(id(self), []).append((old, new))

    monkeypatch.setattr(Page, "_to", recording)
    for _ in range(3):
        m(torch.randn(5, 4)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    pages = [p for h in _flat_handles(m) for p in ssd_host(h).ssd.pages(state=True)]  # type: ignore[union-attr]
    assert len(pages) == 2 * 3  # each unit: its shard, exp_avg, exp_avg_sq
    for p in pages:
        p.file.then(lambda: None).wait()
        assert p.state is PageState.ON_DISK and p.pins == 0 and p.writes == 0, (p.name(), p.state)
        walk = seen[id(p)]
        for old, new in walk:
            assert new in TRANSITIONS[old], (p.name(), old, new)
        for a, b in zip(walk, walk[1:]):
            assert a[1] is b[0], f"{p.name()}: a change of state outside _to: {walk}"
        visited = {new for _, new in walk}
        assert {PageState.READING, PageState.IN_USE, PageState.EVICTING, PageState.ON_DISK} <= visited, walk
    with m.summon_full_params():
        states = {p.state for p in pages}
    assert states == {PageState.IN_USE}  # read in for the caller, readable
