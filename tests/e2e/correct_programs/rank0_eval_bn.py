"""Correct: BatchNorm under DDP with evaluation on rank 0 alone, between epochs and at the end.

Every epoch starts with `model.train()` on every rank; rank 0 evaluates through `model.module`
in eval mode (no collective) while the others wait at a barrier, and after training rank 0
evaluates once more and leaves the model in eval mode. Also: the BatchNorm layers frozen in eval
mode on every rank for the last epoch (fine-tuning style), the same on all ranks. Expected: no
error, no warning.
"""

import datetime
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def evaluate(model: DDP, data: torch.Tensor, target: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        return nn.functional.mse_loss(model.module(data), target).item()


def main() -> None:
    timeout = datetime.timedelta(seconds=float(os.environ.get("EXAMPLE_PG_TIMEOUT", "30")))
    dist.init_process_group("gloo", timeout=timeout)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data, target = torch.randn(64, 4), torch.randn(64, 1)
    for epoch in range(3):
        model.train()
        if epoch == 2:  # freeze BatchNorm for the last epoch, on every rank
            for m in model.modules():
                if isinstance(m, nn.BatchNorm1d):
                    m.eval()
        for i in range(4):
            x, y = data[i * 16:(i + 1) * 16], target[i * 16:(i + 1) * 16]
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        if rank == 0:
            print(f"epoch {epoch} val {evaluate(model, data, target):.4f}")
        dist.barrier()
    if rank == 0:
        print(f"final val {evaluate(model, data, target):.4f}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
