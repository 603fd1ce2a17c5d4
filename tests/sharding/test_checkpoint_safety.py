"""Loading a checkpoint never runs code from it (issue #34), on 2 gloo ranks.

A crafted checkpoint puts a pickle whose ``__reduce__`` calls :func:`payload` (it writes a marker file) in each
place a sharded checkpoint holds pickled data: the packed entries shardfuse reads (``optim.param_groups``,
non-tensor optimizer state, a module's extra state), the entries DCP itself unpickles (any non-tensor value, e.g.
``shardfuse.meta``) and DCP's ``.metadata`` file. Each load path must raise an error naming the entry and the
opt-in, and the marker must not exist. The same payload loaded with ``trust_checkpoint=True`` does run (so the
payload is real), and a legitimate custom extra state loads with the opt-in; checkpoints of plain data, and the
dicts ``state_dict()``, ``local_state_dict()`` and ``gather_full_optim_state_dict()`` return, load without it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import pickle
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata

from shardfuse import SafeFileSystemReader, SafeLoadPlanner, UnsafeCheckpointError
from shardfuse.sharding import FullyShardedDataParallel as FSDP
from tests.sharding.test_dcp import Net, param_groups, same, sharded_step, wrap

WORLD = 2


def payload(marker: str) -> str:
    """What the crafted pickle runs when fully unpickled: it leaves a file behind."""
    Path(marker).write_text("the checkpoint ran code")
    return "pwned"


class Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return payload, (self.marker,)


def packed(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


@dataclasses.dataclass
class Version:
    """A custom object only full pickle rebuilds."""

    major: int
    label: str


class Versioned(Net):
    """Extra state that is a custom object (legitimate, but only loadable with the opt-in)."""

    def get_extra_state(self) -> Any:
        return Version(self.tag["version"], "custom")

    def set_extra_state(self, state: Any) -> None:
        assert isinstance(state, Version), type(state)
        self.tag = {"version": state.major}


class NoteSGD(torch.optim.SGD):
    """SGD that also keeps non-tensor state per parameter (plain data: a dict, a tuple, an int, a bool; no strings,
    which torch's own load_state_dict mangles)."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        out = super().step(closure)
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    note = self.state[p].get("note", {"calls": 0, "tag": (7, 1.5), "on": True})
                    self.state[p]["note"] = {**note, "calls": note["calls"] + 1}
        return out


def _trained(cls: type = Net) -> tuple[FSDP, torch.optim.Optimizer]:
    torch.manual_seed(1234)
    model = wrap(cls())
    opt = NoteSGD(param_groups(model), lr=0.05, momentum=0.9)
    for s in range(2):
        sharded_step(model, opt, s)
    return model, opt


def _fresh(cls: type = Net) -> tuple[FSDP, torch.optim.Optimizer, dict[str, Any]]:
    torch.manual_seed(99)
    model = wrap(cls())
    opt = NoteSGD(param_groups(model), lr=1.0, momentum=0.9)
    return model, opt, model.sharded_state_dict(opt)


def _shared_dir(base: str, name: str) -> str:
    path = os.path.join(base, name)
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    return path


def _dcp_load_errors(state: dict[str, Any], path: str) -> list[BaseException]:
    """The errors of a ``dcp.load`` through the safe reader and planner that must fail (DCP gathers every rank's
    failure into one CheckpointException, a BaseException)."""
    try:
        dcp.load(state, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner())
    except CheckpointException as err:
        return [exc for exc, _ in err.failures.values()]
    except Exception as err:  # noqa: BLE001 - returned for the caller's checks
        return [err]
    raise AssertionError("dcp.load of the crafted checkpoint did not fail")


def _ran(marker: str) -> bool:
    dist.barrier()  # every rank finished its attempt before anyone looks
    return os.path.exists(marker)


# --------------------------------------------------------------------------------------------------
# 1. packed entries that shardfuse unpickles (DCP's outer pickle is plain bytes)
# --------------------------------------------------------------------------------------------------


def _other_state_key(sd: dict[str, Any]) -> str:
    keys = [k for k in sd if k.startswith("optim.state.") and k.endswith(".note")]
    assert keys and all(isinstance(sd[k], bytes) for k in keys), keys
    return keys[0]


def check_packed_entry_refused(base: str, which: str) -> bool:
    path = _shared_dir(base, which)
    marker = os.path.join(base, f"marker-{which}")
    model, opt = _trained()
    sd = model.sharded_state_dict(opt)
    key = {"groups": "optim.param_groups", "extra": "model._extra_state", "other": _other_state_key(sd)}[which]
    sd[key] = packed(Payload(marker))
    dcp.save(sd, checkpoint_id=path)
    fresh, fresh_opt, state = _fresh()
    before = fresh.state_dict()
    dcp.load(state, checkpoint_id=path)  # torch's defaults: the entry is plain bytes to DCP
    with pytest.raises(UnsafeCheckpointError, match=rf"checkpoint entry '{key}' holds a pickled object that is not "
                                                    r"plain data .*GLOBAL .*payload.*trust_checkpoint=True"):
        fresh.load_sharded_state_dict(state, fresh_opt)
    assert not _ran(marker), "the checkpoint's payload ran"
    assert len(fresh_opt.state) == 0 and fresh.module.tag == {"version": 3}
    assert set(before) == set(fresh.state_dict())
    # The opt-in unpickles it fully: the payload is real (it runs), so the refusal above is what kept it out.
    with contextlib.suppress(Exception):  # whatever the unpickled string does to the load afterwards
        fresh.load_sharded_state_dict(state, fresh_opt, trust_checkpoint=True)
    assert _ran(marker), "with trust_checkpoint=True the payload should have run (is the test payload real?)"
    return True


@pytest.mark.parametrize("which", ["groups", "other", "extra"])
def test_packed_entry_with_code_is_refused(pool, tmp_path, which):
    assert pool.run(check_packed_entry_refused, str(tmp_path), which) == [True] * WORLD


# --------------------------------------------------------------------------------------------------
# 2. entries and metadata that DCP itself unpickles: SafeLoadPlanner and SafeFileSystemReader
# --------------------------------------------------------------------------------------------------


def check_dcp_entry_refused(base: str, key: str) -> bool:
    path = _shared_dir(base, key.replace(".", "_"))
    marker = os.path.join(base, f"marker-{key}")
    model, opt = _trained()
    sd = model.sharded_state_dict(opt)
    sd[key] = Payload(marker)  # DCP pickles the object itself: its own load would run it
    dcp.save(sd, checkpoint_id=path)
    fresh, fresh_opt, state = _fresh()
    errors = _dcp_load_errors(state, path)
    want = rf"checkpoint entry '{key}' holds a pickled object .*GLOBAL .*payload.*SafeLoadPlanner\(trust_checkpoint="
    assert errors and all(isinstance(e, UnsafeCheckpointError) and re.search(want, str(e)) for e in errors), errors
    assert not _ran(marker), "the checkpoint's payload ran"
    return True


@pytest.mark.parametrize("key", ["optim.param_groups", "model._extra_state", "shardfuse.meta"])
def test_dcp_entry_with_code_is_refused_by_safe_planner(pool, tmp_path, key):
    assert pool.run(check_dcp_entry_refused, str(tmp_path), key) == [True] * WORLD


def check_metadata_refused(base: str, how: str) -> bool:
    path = _shared_dir(base, f"meta-{how}")
    marker = os.path.join(base, f"marker-meta-{how}")
    model, opt = _trained()
    dcp.save(model.sharded_state_dict(opt), checkpoint_id=path)
    dist.barrier()
    if dist.get_rank() == 0:
        md_path = os.path.join(path, ".metadata")
        with open(md_path, "rb") as f:
            md = pickle.load(f)
        assert isinstance(md, Metadata)
        if how == "inside":  # a real Metadata carrying the payload in a field
            md.planner_data = {"x": Payload(marker)}
            crafted = pickle.dumps(md)
        else:  # the whole file replaced
            crafted = pickle.dumps(Payload(marker))
        with open(md_path, "wb") as f:
            f.write(crafted)
    dist.barrier()
    fresh, fresh_opt, state = _fresh()
    errors = _dcp_load_errors(state, path)
    want = r"\.metadata' refers to [\w.]*test_checkpoint_safety\.payload, which is not part of DCP's metadata.*" \
           r"trust_checkpoint=True"
    # torch may wrap the reader's error (its fallback to per-rank metadata re-raises with the first error's text)
    assert errors and all(re.search(want, str(e)) for e in errors), errors
    assert not _ran(marker), "the checkpoint's payload ran"
    return True


@pytest.mark.parametrize("how", ["whole", "inside"])
def test_metadata_with_code_is_refused_by_safe_reader(pool, tmp_path, how):
    assert pool.run(check_metadata_refused, str(tmp_path), how) == [True] * WORLD


# --------------------------------------------------------------------------------------------------
# 3. legitimate checkpoints: plain data without the opt-in, custom objects with it
# --------------------------------------------------------------------------------------------------


def check_plain_checkpoint_loads(base: str) -> bool:
    """Param groups (floats, tuples, bools, None), step counters, non-tensor state (a dict with a tuple) and
    dict extra state load without any opt-in, through torch's defaults and through the safe reader/planner,
    and the run resumes exactly."""
    path = _shared_dir(base, "plain")
    model, opt = _trained()
    dcp.save(model.sharded_state_dict(opt), checkpoint_id=path)
    want = sharded_step(*_trained(), 2)  # the uninterrupted run's next step (the same seed and steps)
    for safe in (False, True):
        fresh, fresh_opt, state = _fresh()
        if safe:
            dcp.load(state, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner())
        else:
            dcp.load(state, checkpoint_id=path)
        fresh.load_sharded_state_dict(state, fresh_opt)
        assert same(fresh.state_dict(), model.state_dict())
        notes = [st["note"] for st in fresh_opt.state.values()]
        assert notes and all(n == {"calls": 2, "tag": (7, 1.5), "on": True} for n in notes), notes
        assert [g["lr"] for g in fresh_opt.param_groups] == [g["lr"] for g in opt.param_groups]
        assert sharded_step(fresh, fresh_opt, 2) == want
    return True


def test_plain_checkpoint_loads_without_opt_in(pool, tmp_path):
    assert pool.run(check_plain_checkpoint_loads, str(tmp_path)) == [True] * WORLD


def check_custom_extra_state_needs_opt_in(base: str) -> bool:
    path = _shared_dir(base, "custom")
    model, opt = _trained(Versioned)
    model.module.tag = {"version": 7}
    dcp.save(model.sharded_state_dict(opt), checkpoint_id=path)
    fresh, fresh_opt, state = _fresh(Versioned)
    dcp.load(state, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner())
    with pytest.raises(UnsafeCheckpointError, match=r"checkpoint entry 'model._extra_state' holds .*Version.*"
                                                    r"trust_checkpoint=True"):
        fresh.load_sharded_state_dict(state, fresh_opt)
    assert fresh.module.tag == {"version": 3} and len(fresh_opt.state) == 0, "refused before writing anything"
    fresh.load_sharded_state_dict(state, fresh_opt, trust_checkpoint=True)
    assert fresh.module.tag == {"version": 7}
    assert same({k: v for k, v in fresh.state_dict().items() if k != "_extra_state"},
                {k: v for k, v in model.state_dict().items() if k != "_extra_state"})
    return True


def test_custom_extra_state_loads_with_opt_in(pool, tmp_path):
    assert pool.run(check_custom_extra_state_needs_opt_in, str(tmp_path)) == [True] * WORLD


def check_other_state_dicts_load_weights_only(base: str) -> bool:
    """The dicts the other checkpoint paths return hold plain data only: ``torch.load(weights_only=True)`` (what
    users should load them with) reads them back unchanged."""
    model, opt = _trained()
    full_optim = model.gather_full_optim_state_dict(opt, recipient_rank=None)
    for name, sd in (("full", model.state_dict()), ("local", model.local_state_dict()), ("optim", full_optim),
                     ("rank optim", opt.state_dict())):
        f = os.path.join(base, f"{name}-{dist.get_rank()}.pt")
        torch.save(sd, f)
        back = torch.load(f, weights_only=True)
        assert _equal(back, sd), name
    return True


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_equal(v, b[k]) for k, v in a.items())
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return bool(a == b)


def test_other_state_dicts_load_weights_only(pool, tmp_path):
    assert pool.run(check_other_state_dicts_load_weights_only, str(tmp_path)) == [True] * WORLD
