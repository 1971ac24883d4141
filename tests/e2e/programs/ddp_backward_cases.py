"""DDP backward events and DD015's output-gradient test in the cases the C hook (rank/_ddpstep.c)
handles itself and those it leaves to Python: a float32 model with a NaN on rank 1 and an Inf on
rank 0 at chosen steps, finite gradients whose sum overflows (no finding), a non-contiguous
output gradient, a float64 model, a second DDP module, a backward under no_sync. A correct 2-rank
gloo program; its losses go to ``OUT/result-rank<R>.json`` (the test compares them untraced).

Usage: ddp_backward_cases.py OUT
"""

import datetime
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    out = sys.argv[1]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(7 + rank)
    losses = []
    for step in range(10):
        x = torch.randn(6, 8, generator=g)
        y = model(x)
        if step == 3 and rank == 1:
            loss = (y * float("nan")).sum()  # NaN output gradient on rank 1
        elif step == 5 and rank == 0:
            loss = (y * float("inf")).sum()  # Inf output gradient on rank 0
        elif step == 6:
            loss = (y * 3e38).sum()  # finite gradients (3e38) whose sum overflows: no finding
        elif step == 7:
            loss = (y.t() * torch.arange(6.0)).sum()  # a non-contiguous output gradient
        else:
            loss = (y - 1).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        if step not in (3, 5, 6):  # every rank skips those steps: the parameters stay finite
            opt.step()
        losses.append(float(loss))
    with model.no_sync():  # a backward that does not reduce: no event
        model(torch.ones(2, 8)).sum().backward()
    wide = DDP(nn.Linear(4, 3).double())  # float64 gradients, a second module
    opt2 = torch.optim.SGD(wide.parameters(), lr=0.01)
    for step in range(4):
        x = torch.randn(5, 4, generator=g, dtype=torch.float64)
        loss = wide(x).pow(2).sum() * (float("nan") if step == 2 and rank == 0 else 1.0)
        opt2.zero_grad()
        loss.backward()
        losses.append(float(loss))
    with open(os.path.join(out, f"result-rank{rank}.json"), "w") as f:
        json.dump({"losses": [repr(v) for v in losses]}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
