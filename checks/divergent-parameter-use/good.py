"""divergent-parameter-use, good: the same layer drop, drawn from a generator seeded alike on every
rank (the data augmentation keeps its per-rank seed): every rank skips the same blocks.
Run: ddpdoctor trace -- torchrun --nproc_per_node=2 checks/divergent-parameter-use/good.py
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
        self.gen = torch.Generator().manual_seed(1234)  # the same draws on every rank

    def forward(self, x):
        h = torch.relu(self.stem(x))
        for block in self.blocks:
            if self.training and torch.rand((), generator=self.gen) < self.drop:
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
    torch.manual_seed(100 + rank)  # per-rank augmentation
    for _ in range(4):
        x = torch.randn(16, 8) + 0.1 * torch.randn(16, 8)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
        opt.step()
    dist.destroy_process_group()


class Sharded(nn.Module):
    """The same bug under FSDP2 (``good.py fsdp``): a ``fully_shard`` module run on some ranks only."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 16)
        self.extra = nn.Linear(16, 32)
        self.head = nn.Linear(16, 1)
        self.use_extra = True

    def forward(self, x):
        h = torch.relu(self.stem(x))
        if self.use_extra:  # the same on every rank
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
