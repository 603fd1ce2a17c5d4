"""The SSD tier under misuse and faults (issue 29): reads between uses, I/O errors, a full disk.

Reads of a parameter whose shard lives on disk between uses must raise a clear error on every rank, every time (it
used to crash the process with a segmentation fault on the rank whose I/O thread had already given the memory
back, and print the values on the other), and a process leaving through such an error removes its directory.
"""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from shardfuse import OffloadConfig, OffloadOptimizer
from shardfuse.sharding import FullyShardedDataParallel as FSDP
from shardfuse.sharding.ssd import _ssd_store
from shardfuse.sharding.ssd._ssd import ssd_host
from tests.dist_pool import free_port
from tests.sharding._models import batch, loss_fn, make_optim
from tests.sharding.test_ssd_offload import _assert_same_model, _flat_handles, _Group, _train, _wrap

ROOT = Path(__file__).resolve().parents[2]
LIMIT_S = 240


def _run_ranks(world: int, path: str, mode: str) -> tuple[list[int], list[str]]:
    port = str(free_port())
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-X", "faulthandler", "-m", "tests.sharding._ssd_evicted_read",
                               str(r), str(world), port, path, mode],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    start = time.monotonic()
    outs, codes = [], []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1.0, LIMIT_S - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"a rank hung past {LIMIT_S} s")
        outs.append(out)
        codes.append(p.returncode)
    return codes, outs


@pytest.mark.parametrize("world,mode", [(2, "plain"), (2, "offload-orig"), (1, "plain-orig"), (1, "offload")])
def test_reading_a_parameter_on_disk_raises_on_every_rank(tmp_path, world, mode):
    """Before: "Fatal Python error: Segmentation fault" (exit -11) at the first ``p.data.sum()`` after a step."""
    codes, outs = _run_ranks(world, str(tmp_path), mode)
    for rank, (code, out) in enumerate(zip(codes, outs)):
        assert "Segmentation fault" not in out and code >= 0, f"rank {rank} crashed ({code}):\n{out}"
        assert f"rank {rank}: " in out and " reads refused" in out, f"rank {rank}:\n{out}"
        # It left through the last, uncaught read: a Python error naming the parameter and the fix.
        assert code == 1, f"rank {rank} exited with {code}:\n{out}"
        last = out.strip().splitlines()[-1]
        assert "RuntimeError" in last and "on disk" in last and "summon_full_params" in last, last
    assert not [d for d in os.listdir(tmp_path) if d.startswith("shardfuse-ssd-rank")], \
        f"a rank's SSD directory outlived its process: {os.listdir(tmp_path)}"


# ------------------------------------------------------------------------------------------------------
# I/O faults: an exception on an I/O thread, a full disk (2 ranks, both hit)
# ------------------------------------------------------------------------------------------------------

WORLD = 2


def _fault(kind: str) -> Any:
    def enospc(*args: Any) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def bug(*args: Any) -> int:
        raise ValueError("injected fault in an I/O thread")

    return enospc if kind == "enospc" else bug


def _flush(model: Any) -> None:
    """Wait for the writes (and evictions) queued on every shard's files."""
    for h in _flat_handles(model):
        for page in ssd_host(h).ssd.pages(state=True):  # type: ignore[union-attr]
            page.file.then(lambda: None).wait()


def check_write_fault_loses_nothing(path: str, kind: str, overlapped: bool) -> bool:
    """Every write-behind of a step fails: the next forward raises at its first gather, before computing anything,
    one error naming every shard (its unit's parameters, its optimizer state) and the cause; the checkpoint saved
    before loads; once the fault is gone the model trains on exactly as the in-memory reference (the values were
    kept in memory)."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    cfg = dict(overlapped=overlapped, state=True)
    model, opt, losses = _train(path, cfg, steps=2)
    ref, ref_opt, ref_losses = _train(None, cfg, steps=2)
    assert losses == ref_losses
    ckpt = os.path.join(path, f"dcp-{kind}-{overlapped}")
    dcp.save(model.sharded_state_dict(opt), checkpoint_id=ckpt)
    saved = model.state_dict()
    # A step after the checkpoint (whose reads leave every shard to be written back at its next use).
    assert _train(path, cfg, steps=1, start=2, model=model, opt=opt)[2] == \
        _train(None, cfg, steps=1, start=2, model=ref, opt=ref_opt)[2]
    if isinstance(opt, OffloadOptimizer):
        opt.synchronize()  # that step's updates (and their write-behinds) done before the fault starts
    _flush(model)
    real = _ssd_store._pwrite
    _ssd_store._pwrite = _fault(kind)
    try:
        ids, target = batch(3, rank, ws)
        loss_fn(model, ids, target, 3, cfg).backward()
        opt.step()  # the write-behinds fail on the I/O threads
        if isinstance(opt, OffloadOptimizer):
            opt.synchronize()
        opt.zero_grad(set_to_none=True)
        _flush(model)
        _train(None, cfg, steps=1, start=3, model=ref, opt=ref_opt)
        ids, target = batch(4, rank, ws)
        with pytest.raises(RuntimeError, match="SSD offload: writing the values of") as info:
            loss_fn(model, ids, target, 4, cfg)
    finally:
        _ssd_store._pwrite = real
    msg = str(info.value)
    cause = "No space left on device" if kind == "enospc" else "ValueError: injected fault in an I/O thread"
    assert cause in msg and path in msg and "Nothing is lost" in msg, msg
    for name in ("flat_param_0 (the flat shard of embed.weight", "blocks.0.flat_param_0 (the flat shard of fc1.weight",
                 "blocks.1.flat_param_0", "the optimizer state 'exp_avg' of blocks.1.flat_param_0"):
        assert name in msg, f"{name} not in {msg}"
    # The checkpoint saved before the fault loads into a fresh model.
    fresh = _wrap(path, cfg)
    o = make_optim(fresh.parameters(), cfg)
    sd = fresh.sharded_state_dict(o)
    dcp.load(sd, checkpoint_id=ckpt)
    fresh.load_sharded_state_dict(sd, o)
    _assert_same_model(fresh.state_dict(), saved)
    # Nothing lost: the faulted model trains on as the reference.
    _, _, more = _train(path, cfg, steps=2, start=4, model=model, opt=opt)
    _, _, ref_more = _train(None, cfg, steps=2, start=4, model=ref, opt=ref_opt)
    assert more == ref_more, f"{more} vs {ref_more}"
    _assert_same_model(model.state_dict(), ref.state_dict())
    if isinstance(opt, OffloadOptimizer):
        opt.close()
    return True


FAULTS = {
    "enospc-plain-optimizer": ("enospc", False),
    "enospc-offload-optimizer": ("enospc", True),
    "exception-plain-optimizer": ("exception", False),
    "exception-offload-optimizer": ("exception", True),
}


@pytest.mark.parametrize("fault", list(FAULTS.values()), ids=list(FAULTS))
def test_a_failed_write_is_raised_at_the_next_step_and_loses_nothing(pool, tmp_path, fault):
    """Before: each shard's error came at its own next use (part way through a forward or backward, one shard at a
    time), naming its file but not its parameters, and an exception other than OSError not even the file."""
    assert pool.run(check_write_fault_loses_nothing, str(tmp_path), *fault) == [True] * WORLD


# ------------------------------------------------------------------------------------------------------
# one rank, in this process
# ------------------------------------------------------------------------------------------------------


def _pair(path: str) -> tuple[tuple[FSDP, Any], tuple[FSDP, Any]]:
    """An SSD-backed model and the in-memory reference, identical (a nested unit and the root)."""
    out = []
    for kw in ({"offload_config": OffloadConfig(offload_type="ssd_offload", dir=path)}, {"move_params_to_cpu": True}):
        torch.manual_seed(7)
        net = nn.Sequential(nn.Linear(5, 9), nn.Tanh(), nn.Linear(9, 3))
        net[0] = FSDP(net[0], process_group=_Group(), **kw)
        m = FSDP(net, process_group=_Group(), **kw)
        out.append((m, torch.optim.AdamW(m.parameters(), lr=1e-2)))
    return out[0], out[1]


def _step(m: FSDP, opt: Any, x: torch.Tensor) -> float:
    loss = m(x).square().sum()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def test_a_failed_read_is_raised_naming_the_shard_and_retried(tmp_path, monkeypatch):
    """A read that fails raises at the gather, naming the parameter and the file; its file is kept, and once the
    fault is gone the next forward reads it and training goes on as the in-memory path."""
    (m, opt), (ref, ref_opt) = _pair(str(tmp_path))
    data = [torch.randn(4, 5) for _ in range(4)]
    assert _step(m, opt, data[0]) == _step(ref, ref_opt, data[0])
    _flush(m)

    def broken(*args: Any) -> int:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(_ssd_store, "_preadv", broken)
    with pytest.raises(RuntimeError, match=rf"reading flat_param_0 \(the flat shard of 2.weight, 2.bias\) in from "
                                           rf"{tmp_path}.*Input/output error.*next use reads it again"):
        m(data[1])
    monkeypatch.undo()
    for x in data[1:]:
        assert _step(m, opt, x) == _step(ref, ref_opt, x)
    _assert_same_model(m.state_dict(), ref.state_dict())


def test_a_reference_taken_while_readable_keeps_valid_memory(tmp_path, caplog):
    """``x = p.detach()`` after a state dict (readable then): the next step does not give that memory back under
    ``x`` (it would dangle: a crash or garbage at ``x.sum()``) but warns; once ``x`` is dropped it is evicted."""
    (m, opt), (ref, ref_opt) = _pair(str(tmp_path))
    data = [torch.randn(4, 5) for _ in range(3)]
    for model, o in ((m, opt), (ref, ref_opt)):
        _step(model, o, data[0])
    m.state_dict()  # reads every shard in: readable until the next training use
    p = m._unit.handles[0].flat
    x = p.detach()
    before = x.clone()
    with caplog.at_level(logging.WARNING, logger="shardfuse.sharding.ssd._ssd_page"):
        _step(m, opt, data[1])
        _flush(m)
    held, need = x.untyped_storage().nbytes(), x.numel() * 4  # (not in the assert: pytest would print x)
    assert held == need, f"the memory under a live reference was given back: {held} of {need} bytes left"
    assert not torch.equal(x, before)  # the step's update, seen through x
    assert any("flat_param_0" in r.getMessage() and "stays in memory" in r.getMessage() for r in caplog.records)
    with pytest.raises(RuntimeError, match="flat_param_0.*on disk"):
        p.sum()  # the parameter itself is between uses all the same
    del x
    _step(m, opt, data[2])
    _flush(m)
    assert p.untyped_storage().nbytes() == 0
    _step(ref, ref_opt, data[1])
    _step(ref, ref_opt, data[2])
    _assert_same_model(m.state_dict(), ref.state_dict())
