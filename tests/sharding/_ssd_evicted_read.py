"""One rank of ``test_ssd_faults.py``: reads of SSD-offloaded parameters between uses, as a user debugging does.

``python -m tests.sharding._ssd_evicted_read RANK WORLD PORT DIR MODE`` (MODE: ``plain`` or ``offload``, the
optimizer; ``-orig`` appended: ``use_orig_params=True``). Trains a few steps; after each, every way of reading every
parameter (and with ``offload`` each offloaded optimizer-state tensor) must raise a ``RuntimeError`` naming it and
the fix, while ``summon_full_params()`` and ``state_dict()`` read the values. At the end one read is left uncaught:
the process must exit through that exception (exit code 1), not a signal, and remove its SSD directory on the way.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.distributed as dist

from shardfuse import OffloadConfig, OffloadOptimizer
from shardfuse.sharding import FullyShardedDataParallel as FSDP
from tests.sharding._models import batch, build, loss_fn

READS = {
    "p.data.sum()": lambda p: p.data.sum(),
    "print(p)": lambda p: print(p),
    "p.sum()": lambda p: p.sum(),
    "p.detach().clone()": lambda p: p.detach().clone(),
    "p + 1": lambda p: p + 1,
    "p.tolist()": lambda p: p.tolist(),
    "torch.cat([p])": lambda p: torch.cat([p]),
    "p.mul_(1)": lambda p: p.mul_(1),
    "copy.deepcopy(p)": lambda p: __import__("copy").deepcopy(p),
}


def _wrap(path: str, orig: bool) -> FSDP:
    kw: dict[str, Any] = {"offload_config": OffloadConfig(offload_type="ssd_offload", dir=path, optimizer_state=True),
                          "use_orig_params": orig}
    model = build({})
    for i in range(len(model.blocks)):
        model.blocks[i] = FSDP(model.blocks[i], **kw)
    return FSDP(model, **kw)


def _refused(t: torch.Tensor, name: str) -> int:
    """Every read of ``t`` raises, naming ``name`` and the fix; returns how many were refused."""
    for how, read in READS.items():
        try:
            read(t)
        except RuntimeError as err:
            msg = str(err)
            assert name in msg and "on disk" in msg, f"{how}: the error does not name {name}: {msg}"
            assert "summon_full_params" in msg or "state_dict()" in msg, f"{how}: no fix in {msg}"
        else:
            raise AssertionError(f"{how} of {name} read an SSD-offloaded tensor between uses")
    return len(READS)


def main(rank: int, world: int, port: str, path: str, mode: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    orig = mode.endswith("-orig")
    model = _wrap(path, orig)
    opt: Any = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if mode.startswith("offload"):
        opt = OffloadOptimizer(model, opt, gpu_budget_gib=0)
    refused = 0
    for step in range(3):
        ids, target = batch(step, rank, world)
        loss_fn(model, ids, target, step, {}).backward()
        opt.step()
        if isinstance(opt, OffloadOptimizer):
            opt.synchronize()  # no update in flight: every shard is between uses
        for name, p in model.named_parameters():
            if p.numel():
                refused += _refused(p, name.rsplit(".", 1)[-1])
                for key, v in opt.state[p].items():  # optimizer_state=True: on disk too
                    if isinstance(v, torch.Tensor) and v.dim():
                        refused += _refused(v, f"the optimizer state {key!r}")
        with model.summon_full_params():  # the supported reads
            summed = sum(float(p.detach().double().sum()) for p in model.parameters())
        sd = model.state_dict()
        assert abs(sum(float(v.double().sum()) for k, v in sd.items() if k != "scale") - summed) < 1e-6 * (
            1 + abs(summed)), "summon_full_params and state_dict disagree"
        opt.zero_grad(set_to_none=True)
    print(f"rank {rank}: {refused} reads refused", flush=True)
    dist.barrier()
    ids, target = batch(3, rank, world)
    loss_fn(model, ids, target, 3, {}).backward()
    opt.step()
    if isinstance(opt, OffloadOptimizer):
        opt.synchronize()
    next(iter(model.parameters())).data.sum()  # uncaught: the process exits through this error


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5])
