"""Rank 0 evaluates between epochs and leaves the model in eval mode; the others keep training.

`model.train()` is called once, before the epoch loop. Rank 0 alone evaluates after each epoch
through `model.module` (no collective, so nothing hangs) with `model.eval()`, and never switches
back: from the second epoch on its BatchNorm layers normalise with running statistics while the
other rank's use batch statistics, at the same DDP steps. The job finishes without an error.
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
    model = DDP(nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data, target = torch.randn(64, 4), torch.randn(64, 1)
    model.train()
    for epoch in range(3):
        for i in range(4):
            x, y = data[i * 16:(i + 1) * 16], target[i * 16:(i + 1) * 16]
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        if rank == 0:
            model.eval()  # the bug: rank 0 never returns to train mode
            with torch.no_grad():
                print(f"epoch {epoch} val {nn.functional.mse_loss(model.module(data), target).item():.4f}")
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
