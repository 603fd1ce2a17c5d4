"""shardfuse._versions: a fused optimizer's in-place writes change the version counters shardfuse reads (the SSD
tier's write-back, OffloadModel's host copies, the runtime's forward/backward check), once the hook is installed by
wrapping a model or building an OffloadModel."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardfuse import _versions
from shardfuse.offload import OffloadModel


def _stepped(opt_cls, **kw):
    p = nn.Parameter(torch.randn(64))
    frozen_group = nn.Parameter(torch.randn(8))
    opt = opt_cls([{"params": [p]}, {"params": [frozen_group], "fused": False, "foreach": False}], **kw)
    for t in (p, frozen_group):
        t.grad = torch.randn_like(t)
    opt.step()  # makes the state
    return opt, p, frozen_group


@pytest.mark.parametrize("opt_cls,kw", [(torch.optim.AdamW, dict(lr=1e-2)),
                                        (torch.optim.Adam, dict(lr=1e-2, amsgrad=True)),
                                        (torch.optim.SGD, dict(lr=0.1, momentum=0.9))],
                         ids=["adamw", "adam-amsgrad", "sgd-momentum"])
def test_fused_step_changes_every_written_version(opt_cls, kw):
    OffloadModel(nn.Sequential(nn.Linear(2, 2)), "cpu", num_slices=1)  # installs the hook, as wrapping does
    opt, p, other = _stepped(opt_cls, fused=True, **kw)
    assert opt.param_groups[0]["fused"] and not opt.param_groups[1]["fused"]
    written = _versions.fused_updates(opt)
    state = [v for k, v in opt.state[p].items() if isinstance(v, torch.Tensor) and k != "step"]
    assert written[0] is p and len(written) == 1 + len(state)
    assert all(w is not other for w in written), "a non-fused group is counted by torch itself"
    before = [t._version for t in [p] + state]
    opt.step()
    after = [t._version for t in [p] + state]
    assert all(a > b for a, b in zip(after, before)), (before, after)


def test_mark_updated_bumps_views_and_their_base():
    flat = torch.zeros(10)
    view = flat[2:5]
    v0 = flat._version
    _versions.mark_updated([view])
    assert flat._version == v0 + 1 and view._version == flat._version
