"""sampler-misuse, bad: a shuffled DistributedSampler without set_epoch, and an evaluation sampler
over a dataset whose length does not divide by the number of ranks.

Without set_epoch the sampler shuffles with the same seed every epoch: the same order, epoch after
epoch. The evaluation sampler pads 11 samples to 12 with a duplicate, which the all-reduced
accuracy then counts twice.
Run: ddpdoctor trace -- torchrun --nproc_per_node=2 checks/sampler-misuse/bad.py
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
    for _epoch in range(3):
        for _x, _y in loader:  # the bug: no sampler.set_epoch(epoch), same order every epoch
            pass
    val = TensorDataset(torch.randn(11, 4), torch.randint(0, 2, (11,)))
    val_sampler = DistributedSampler(val, shuffle=False)  # 11 samples over 2 ranks: padded
    correct = torch.zeros(2)
    for x, y in DataLoader(val, batch_size=4, sampler=val_sampler):
        correct += torch.tensor([float((x[:, 0] > 0).long().eq(y).sum()), float(len(y))])
    dist.all_reduce(correct)  # counts the padded duplicate twice: 12 samples, not 11
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
