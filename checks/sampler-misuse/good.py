"""sampler-misuse, good: set_epoch every epoch on every rank; an evaluation set that divides evenly.

Also silent: a sampler used for a single epoch without set_epoch, and a training sampler iterated
twice within an epoch (a second pass for statistics) while its epochs do advance.
Run: ddpdoctor trace -- torchrun --nproc_per_node=2 checks/sampler-misuse/good.py
"""

import datetime
import os

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def main() -> None:
    timeout = datetime.timedelta(seconds=float(os.environ.get("EXAMPLE_PG_TIMEOUT", "20")))
    dist.init_process_group("gloo", timeout=timeout)
    torch.manual_seed(0)
    train = TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
    sampler = DistributedSampler(train, shuffle=True)
    loader = DataLoader(train, batch_size=4, sampler=sampler)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        for _x, _y in loader:
            pass
        for _x, _y in loader:  # a second pass in the same epoch: deliberate
            pass

    warmup = DistributedSampler(train, shuffle=True)  # one epoch only: set_epoch not needed
    for _x, _y in DataLoader(train, batch_size=4, sampler=warmup):
        pass

    val = TensorDataset(torch.randn(12, 4), torch.randint(0, 2, (12,)))
    val_sampler = DistributedSampler(val, shuffle=False)  # 12 samples over 2 ranks: no padding
    correct = torch.zeros(2)
    for x, y in DataLoader(val, batch_size=4, sampler=val_sampler):
        correct += torch.tensor([float((x[:, 0] > 0).long().eq(y).sum()), float(len(y))])
    dist.all_reduce(correct)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
