"""One epoch over a FakeData-style dataset (seeded per item by the library) with a
DistributedSampler, after a peek at the first batch (``next(iter(loader))``): a correct program.
Run with ``site-packages`` (next to this file) on PYTHONPATH."""

import datetime
import os

import torch
import torch.distributed as dist
from fakevision import FakeData
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=float(os.environ.get("EXAMPLE_PG_TIMEOUT", "20"))))
    data = FakeData(size=200)
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=20, sampler=sampler)
    images, _ = next(iter(loader))  # a peek at the shapes, not an epoch
    print("batch", tuple(images.shape))
    sampler.set_epoch(0)
    total = torch.zeros(1)
    for images, _targets in loader:
        total += images.sum()
    dist.all_reduce(total)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
