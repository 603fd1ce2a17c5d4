"""One half of a DCP round trip under ``torchrun`` (gloo, CPU): save a trained model's checkpoint, or load it at
another world size and check it bit for bit (issue 29, item 3: a SIGABRT at interpreter exit).

    torchrun --standalone --nproc-per-node 2 bench/dcp_loop/run.py save --dir /tmp/ckpt
    torchrun --standalone --nproc-per-node 3 bench/dcp_loop/run.py load --dir /tmp/ckpt

Both checkpoint paths of docs/checkpoints.md are written and read: ``model.sharded_state_dict(optim)`` with
``dcp.save``/``dcp.load`` and ``load_sharded_state_dict``, and torch's ``get_state_dict``/``set_state_dict`` with
``dcp``. ``save`` trains a small nested-wrapped model two AdamW steps and writes both checkpoints plus, on rank 0,
the reference: the full model state dict and the consolidated optimizer state (``gather_full_optim_state_dict``,
one entry per original parameter, so independent of the world size). ``load`` loads each checkpoint into a fresh
model (other initial values) and a fresh optimizer and checks that the full model state dict and the consolidated
optimizer state equal the reference exactly; every rank prints one ``bit-exact`` line, a mismatch raises.

The workaround under test: :func:`run` returns, so its model, optimizer and state dicts are freed, and ``main``
collects them (``gc.collect()``) before it destroys the process group and the interpreter exits. With
``DCP_LOOP_KEEP=1`` they stay alive until exit instead (a module-level training script does that), which is what
lets a gloo worker thread free a finished collective's tensors during ``Py_FinalizeEx`` and abort the process
(docs/troubleshooting.md, "The process aborts at exit").
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import shardfuse
from shardfuse import FullyShardedDataParallel as FSDP

KEEP_ENV = "DCP_LOOP_KEEP"
STEPS = 2
_KEPT: list[Any] = []  # DCP_LOOP_KEEP=1: what run() made stays referenced until the interpreter exits


def build(seed: int) -> FSDP:
    """A small model, every block its own unit inside the root; sizes that do not divide by 2 or 3 (padding)."""
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(13, 29), nn.Tanh(), nn.Linear(29, 29), nn.Tanh(), nn.Linear(29, 7))
    for i in (0, 2, 4):
        net[i] = FSDP(net[i])
    return FSDP(net)


def train(model: FSDP, opt: torch.optim.Optimizer) -> None:
    rank = dist.get_rank()
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(5, 13, generator=gen), torch.randn(5, 7, generator=gen)
        (model(x) - y).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _optimizer(model: FSDP, lr: float = 1e-2) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=lr)


def save(where: Path) -> dict[str, Any]:
    model = build(seed=0)
    opt = _optimizer(model)
    train(model, opt)
    dcp.save(model.sharded_state_dict(opt), checkpoint_id=str(where / "sharded"))
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(where / "dsd"))
    full_model = model.state_dict()
    full_optim = model.gather_full_optim_state_dict(opt)
    if dist.get_rank() == 0:
        torch.save({"model": full_model, "optim": full_optim, "world": dist.get_world_size()}, where / "ref.pt")
    dist.barrier()
    return {"model": model, "opt": opt, "sd": [msd, osd, full_model, full_optim]}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8) if t.is_floating_point() else t


def _same(got: Any, want: Any, path: str = "") -> list[str]:
    """Where ``got`` differs from ``want`` (tensors: dtype, shape and every bit)."""
    if isinstance(want, torch.Tensor):
        ok = isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape and bool(
            torch.equal(_bits(got), _bits(want)))
        return [] if ok else [path or "<root>"]
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            return [f"{path} keys"]
        return [d for k in want for d in _same(got[k], want[k], f"{path}/{k}")]
    if isinstance(want, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(want):
            return [f"{path} length"]
        return [d for i, (a, b) in enumerate(zip(got, want)) for d in _same(a, b, f"{path}[{i}]")]
    return [] if got == want else [path]


def _check(what: str, model: FSDP, opt: torch.optim.Optimizer, ref: dict[str, Any]) -> None:
    full_model = model.state_dict()
    full_optim = model.gather_full_optim_state_dict(opt)
    diff = _same(full_model, ref["model"], "model")
    if dist.get_rank() == 0:  # the consolidated state, less its metadata (which names the world size)
        diff += _same({k: v for k, v in full_optim.items() if k != "shardfuse"},
                      {k: v for k, v in ref["optim"].items() if k != "shardfuse"}, "optim")
    if diff:
        raise AssertionError(f"{what}: loading a checkpoint saved at {ref['world']} ranks into "
                             f"{dist.get_world_size()} ranks changed {diff[:6]}")
    print(f"rank {dist.get_rank()}/{dist.get_world_size()}: {what} bit-exact "
          f"(saved at {ref['world']} ranks)", flush=True)


def load(where: Path) -> dict[str, Any]:
    ref = torch.load(where / "ref.pt", weights_only=True)
    made: dict[str, Any] = {"ref": ref}
    model = build(seed=99)  # other values: the load must overwrite every one
    opt = _optimizer(model, lr=1.0)  # fresh, no step: the load brings the state and the learning rate
    state = model.sharded_state_dict(opt)
    dcp.load(state, checkpoint_id=str(where / "sharded"))
    model.load_sharded_state_dict(state, opt)
    _check("sharded_state_dict + dcp", model, opt, ref)
    made.update(model=model, opt=opt, state=state)
    model2 = build(seed=98)
    opt2 = _optimizer(model2, lr=1.0)
    msd, osd = get_state_dict(model2, opt2)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=str(where / "dsd"))
    set_state_dict(model2, opt2, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    _check("get_state_dict + dcp", model2, opt2, ref)
    made.update(model2=model2, opt2=opt2, sd=sd)
    dist.barrier()
    return made


def run(phase: str, where: Path) -> None:
    """Save or load; what it makes is freed when it returns, unless ``DCP_LOOP_KEEP=1`` keeps it until exit."""
    made = save(where) if phase == "save" else load(where)
    if os.environ.get(KEEP_ENV) == "1":
        _KEPT.append(made)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("phase", choices=["save", "load"])
    p.add_argument("--dir", required=True, type=Path, help="the checkpoint folder (made by save)")
    args = p.parse_args(argv)
    dist.init_process_group("gloo")
    if args.phase == "save" and dist.get_rank() == 0:
        args.dir.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    run(args.phase, args.dir)
    if not _KEPT:
        gc.collect()  # the workaround: nothing holds the process group at exit but the default group itself
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    assert shardfuse.__file__
    sys.exit(main())
