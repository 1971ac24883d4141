"""unseeded-rng, good: what must agree is seeded identically; augmentation randomness is per rank.

The shared seed comes first (model initialisation), the split uses its own fixed generator, and
augmentation noise draws from a per-rank generator, which is intended and not compared. A second
model is initialised differently per rank on purpose, then broadcast from rank 0 before training:
it starts from the same weights everywhere.
Run: ddpdoctor trace -- torchrun --nproc_per_node=2 checks/unseeded-rng/good.py
"""

import datetime
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset, random_split
from torch.utils.data.distributed import DistributedSampler


def main() -> None:
    timeout = datetime.timedelta(seconds=float(os.environ.get("EXAMPLE_PG_TIMEOUT", "20")))
    dist.init_process_group("gloo", timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1234)  # the same on every rank
    data = TensorDataset(torch.randn(40, 4), torch.randn(40, 1))
    train, val = random_split(data, [32, 8], generator=torch.Generator().manual_seed(42))
    sampler = DistributedSampler(train, shuffle=True)
    model = DDP(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    augment = torch.Generator().manual_seed(1000 + rank)  # per-rank augmentation: intended

    # A model synchronised by hand: different initial weights, made equal by a broadcast.
    head = torch.nn.Linear(4, 1)
    with torch.no_grad():
        head.weight.add_(rank)
    for p in head.parameters():
        dist.broadcast(p.data, src=0)
    head_opt = torch.optim.SGD(head.parameters(), lr=0.1)

    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in DataLoader(train, batch_size=8, sampler=sampler):
            x = x + 0.01 * torch.randn(x.shape, generator=augment)
            opt.zero_grad()
            head_opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y) + torch.nn.functional.mse_loss(head(x), y)
            loss.backward()
            for p in head.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
            opt.step()
            head_opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
