"""Correct program: gradients that differ per rank by design, handled right.

- A corrupt sample on rank 1 (NaN loss) at one step; the decision to skip comes from the averaged
  gradients (torch.amp.GradScaler), the same on every rank.
- find_unused_parameters=True with an auxiliary head used only in evaluation (unused on every rank),
  layer drop drawn from a generator seeded alike on every rank, and a two-expert route chosen by
  each rank's own data (DDP is meant to handle that; info at most).
- Per-rank data augmentation from a per-rank seed.
"""

import datetime
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.experts = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.head = nn.Linear(16, 1)
        self.aux = nn.Linear(16, 4)  # evaluation only
        self.gen = torch.Generator().manual_seed(7)  # layer drop: the same draws on every rank

    def forward(self, x):
        h = torch.relu(self.stem(x))
        for block in self.blocks:
            if self.training and torch.rand((), generator=self.gen) < 0.3:
                continue
            h = h + torch.relu(block(h))
        expert = self.experts[0] if x.mean() > 0 else self.experts[1]  # routing on this rank's data
        h = h + expert(h)
        if not self.training:
            return self.head(h), self.aux(h)
        return self.head(h)


def main() -> None:
    timeout = datetime.timedelta(seconds=float(os.environ.get("EXAMPLE_PG_TIMEOUT", "20")))
    dist.init_process_group("gloo", timeout=timeout)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(Net(), find_unused_parameters=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    scaler = torch.amp.GradScaler("cpu")
    torch.manual_seed(100 + rank)  # per-rank augmentation
    for step in range(6):
        x = torch.randn(16, 8) + (0.5 if rank == 0 else -0.5)
        if rank == 1 and step == 3:
            x[0, 0] = float("inf")  # a corrupt sample on one rank
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), x.sum(1, keepdim=True).clamp(-5, 5))
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    model.eval()
    with torch.no_grad():
        out, aux = model.module(torch.randn(4, 8))
    assert torch.isfinite(out).all() and torch.isfinite(aux).all()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
