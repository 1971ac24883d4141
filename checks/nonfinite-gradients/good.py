"""nonfinite-gradients, good: the same corrupt sample, but the decision to skip is taken from the
averaged gradients, the same on every rank: a GradScaler skips the step everywhere.
Run: ddpdoctor trace -- torchrun --nproc_per_node=2 checks/nonfinite-gradients/good.py
"""

import datetime
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    timeout = datetime.timedelta(seconds=float(os.environ.get("EXAMPLE_PG_TIMEOUT", "20")))
    dist.init_process_group("gloo", timeout=timeout)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(100 + rank)
    for step in range(4):
        x = torch.randn(16, 8, generator=g)
        if rank == 1 and step == 2:
            x[3, 0] = float("nan")  # a corrupt sample on one rank
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
        scaler.scale(loss).backward()
        scaler.step(opt)  # skipped on every rank: the averaged gradients hold the NaN everywhere
        scaler.update()
    for p in model.parameters():
        assert torch.isfinite(p).all()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
