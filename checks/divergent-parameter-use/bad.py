"""divergent-parameter-use, bad: layer drop (stochastic depth) drawn from torch's default generator,
which each rank seeded with its own rank for data augmentation: the ranks skip different blocks,
and with find_unused_parameters=True DDP silently averages zeros for the skipped ones.
Run: ddpdoctor trace -- torchrun --nproc_per_node=2 checks/divergent-parameter-use/bad.py
"""

import datetime
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


class Net(nn.Module):
    def __init__(self, drop: float = 0.5) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.head = nn.Linear(16, 1)
        self.drop = drop

    def forward(self, x):
        h = torch.relu(self.stem(x))
        for block in self.blocks:
            if self.training and torch.rand(()) < self.drop:  # BUG: a per-rank draw
                continue
            h = h + torch.relu(block(h))
        return self.head(h)


def main() -> None:
    timeout = datetime.timedelta(seconds=float(os.environ.get("EXAMPLE_PG_TIMEOUT", "20")))
    dist.init_process_group("gloo", timeout=timeout)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(Net(), find_unused_parameters=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    torch.manual_seed(100 + rank)  # per-rank augmentation; the layer drop draws from it too
    for _ in range(4):
        x = torch.randn(16, 8) + 0.1 * torch.randn(16, 8)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
        opt.step()
    dist.destroy_process_group()


class Sharded(nn.Module):
    """The same bug under FSDP2 (``bad.py fsdp``): a ``fully_shard`` module run on some ranks only."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 16)
        self.extra = nn.Linear(16, 32)
        self.head = nn.Linear(16, 1)
        self.use_extra = True

    def forward(self, x):
        h = torch.relu(self.stem(x))
        if dist.get_rank() == 0:  # BUG: only rank 0 runs the FSDP module
            h = h + self.extra(h)[:, :16]
        return self.head(h)


def main_fsdp() -> None:
    from torch.distributed.fsdp import fully_shard

    timeout = datetime.timedelta(seconds=float(os.environ.get("EXAMPLE_PG_TIMEOUT", "20")))
    dist.init_process_group("gloo", timeout=timeout)
    torch.manual_seed(0)
    model = Sharded()
    for sub in (model.stem, model.extra, model.head):
        fully_shard(sub)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main_fsdp() if "fsdp" in sys.argv[1:] else main()
