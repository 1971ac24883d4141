"""Uneven but handled data: no warning or error expected.

Each rank trains on its own contiguous, disjoint part of one dataset (rank 1 holds more), through
a DataLoader without DistributedSampler, with Join taking care of the uneven step counts; a
DistributedSampler over a length that is not a multiple of the world size (padding) with
drop_last elsewhere; a peek at one batch that leaves a pass early; a rank-0-only evaluation; and
a sampler with replacement that draws per rank by design.
"""

import datetime
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset, TensorDataset, WeightedRandomSampler
from torch.utils.data.distributed import DistributedSampler


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=float(os.environ.get("EXAMPLE_PG_TIMEOUT", "30"))))
    rank = dist.get_rank()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(51, 4), torch.randn(51, 1))
    model = DDP(nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    bounds = [0, 20, 51]  # rank 1 holds more data: uneven inputs
    mine = Subset(data, range(bounds[rank], bounds[rank + 1]))
    loader = DataLoader(mine, batch_size=4, shuffle=True)
    _, _ = next(iter(loader))  # a peek: a pass left after one batch
    for _epoch in range(2):
        with Join([model]):
            for x, y in loader:
                opt.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()

    for drop_last in (False, True):  # 51 samples over 2 ranks: padded by one, or one dropped
        sampler = DistributedSampler(data, drop_last=drop_last)
        for epoch in range(2):
            sampler.set_epoch(epoch)
            for x, y in DataLoader(data, batch_size=8, sampler=sampler):
                opt.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()

    weights = torch.ones(len(data))
    picks = WeightedRandomSampler(weights, num_samples=16, generator=torch.Generator().manual_seed(rank))
    for x, y in DataLoader(data, batch_size=8, sampler=picks):  # per-rank draws with replacement
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    if rank == 0:  # evaluation on rank 0 only
        with torch.no_grad():
            err = sum(float(nn.functional.mse_loss(model.module(x), y)) for x, y in DataLoader(data, batch_size=17))
        print(f"eval {err:.3f}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
