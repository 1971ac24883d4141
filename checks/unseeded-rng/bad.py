"""unseeded-rng, bad: the seed depends on the rank, and it is set before the data split and the model.

`torch.manual_seed(rank)` was meant to vary augmentation per rank, but it also makes random_split
and the model's initialisation differ across ranks: each rank's validation set overlaps other
ranks' training data, the DistributedSampler shards different index lists, and the model (not
wrapped in DDP, gradients averaged by hand) starts from different weights on every rank.
Run: ddpdoctor trace -- torchrun --nproc_per_node=2 checks/unseeded-rng/bad.py
"""

import datetime
import os

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset, random_split
from torch.utils.data.distributed import DistributedSampler


def main() -> None:
    timeout = datetime.timedelta(seconds=float(os.environ.get("EXAMPLE_PG_TIMEOUT", "20")))
    dist.init_process_group("gloo", timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)  # the bug: rank-dependent seed before split and model init
    data = TensorDataset(torch.randn(40, 4), torch.randn(40, 1))
    train, val = random_split(data, [32, 8])
    sampler = DistributedSampler(train, shuffle=True)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in DataLoader(train, batch_size=8, sampler=sampler):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            for p in model.parameters():  # gradients averaged by hand: one model is meant
                dist.all_reduce(p.grad)
                p.grad /= world
            opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
