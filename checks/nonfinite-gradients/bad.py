"""nonfinite-gradients, bad: one rank meets a corrupt sample (its loss is NaN) and skips the step
from its own loss; DDP has already averaged the NaN gradients into every replica, and the other
rank, whose loss was finite, applies them.
Run: ddpdoctor trace -- torchrun --nproc_per_node=2 checks/nonfinite-gradients/bad.py
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
    g = torch.Generator().manual_seed(100 + rank)
    for step in range(4):
        x = torch.randn(16, 8, generator=g)
        if rank == 1 and step == 2:
            x[3, 0] = float("nan")  # a corrupt sample on one rank
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
        loss.backward()  # DDP averages rank 1's NaN gradients into rank 0's
        if not torch.isfinite(loss):  # BUG: a local decision, taken after the average
            continue
        opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
