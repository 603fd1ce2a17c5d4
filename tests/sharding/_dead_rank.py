"""One rank of the dead-rank fault test (tests/sharding/test_faults.py): rank 1 dies in the middle of a step.

    python -m tests.sharding._dead_rank RANK WORLD PORT BACKEND TIMEOUT_S
"""

from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist
from torch import nn


def main() -> None:
    rank, world, port, backend, timeout = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=float(timeout)))
    from shardfuse import FullyShardedDataParallel as FSDP

    torch.manual_seed(0)
    model = FSDP(nn.Sequential(FSDP(nn.Linear(64, 64)), nn.Tanh(), FSDP(nn.Linear(64, 8))).to(device))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        loss = model(torch.randn(4, 64, device=device)).pow(2).mean()
        if step == 1 and rank == 1:
            print("rank 1: dying in the middle of step 1", flush=True)
            os._exit(17)
        try:
            loss.backward()
            opt.step()
            opt.zero_grad()
            if device.type == "cuda":
                torch.cuda.synchronize()
        except Exception as exc:  # what the surviving rank's user sees
            print(f"rank {rank}: step {step} failed: {type(exc).__name__}: {exc}", flush=True)
            os._exit(3)
    print(f"rank {rank}: finished all steps", flush=True)


if __name__ == "__main__":
    main()
