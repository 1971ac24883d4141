"""data-coverage, bad: three ways the ranks' shards stop partitioning the data in an epoch.

1. The index list is shuffled with Python's global RNG, seeded with the rank, before each rank
   takes idx[rank::world]: the shards are cut from different orders (overlap, gaps).
2. A training DataLoader with shuffle=True and no DistributedSampler: every rank trains on the
   whole dataset each epoch.
3. An IterableDataset over files shuffled per rank before files[rank::world].
4. An IterableDataset that generates one stream and never shards it by rank: every rank trains
   on the same batches.
Run: ddpdoctor trace -- torchrun --nproc_per_node=2 checks/data-coverage/bad.py
"""

import datetime
import os
import random
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, IterableDataset, SubsetRandomSampler, TensorDataset


class Lines(IterableDataset):
    """Samples read line by line from a list of text files."""

    def __init__(self, files):
        self.files = files

    def __iter__(self):
        for path in self.files:
            with open(path) as f:
                for line in f:
                    yield torch.tensor([float(v) for v in line.split()])


def fit(model, opt, loader, epochs=2, sampler=None):
    for epoch in range(epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        for batch in loader:
            x = batch[0] if isinstance(batch, (list, tuple)) else batch
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()


def main() -> None:
    timeout = datetime.timedelta(seconds=float(os.environ.get("EXAMPLE_PG_TIMEOUT", "20")))
    dist.init_process_group("gloo", timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = TensorDataset(torch.randn(32, 4))

    random.seed(rank)
    idx = list(range(len(data)))
    random.shuffle(idx)  # BUG: a different order on each rank
    loader = DataLoader(data, batch_size=4, sampler=SubsetRandomSampler(idx[rank::world]))
    fit(model, opt, loader)

    fit(model, opt, DataLoader(data, batch_size=8, shuffle=True))  # BUG: no DistributedSampler

    folder = os.path.join(tempfile.gettempdir(), f"ddpdoctor-coverage-{os.environ.get('MASTER_PORT', '0')}")
    if rank == 0:
        os.makedirs(folder, exist_ok=True)
        for i in range(6):
            with open(os.path.join(folder, f"part{i}.txt"), "w") as f:
                f.write("".join(f"{i} {j} 1 2\n" for j in range(4)))
    dist.barrier()
    files = sorted(os.path.join(folder, n) for n in os.listdir(folder))
    random.shuffle(files)  # BUG: a different order on each rank (the RNG was seeded with the rank)
    fit(model, opt, DataLoader(Lines(files[rank::world]), batch_size=2))
    dist.barrier()
    if rank == 0:
        shutil.rmtree(folder)
    fit(model, opt, DataLoader(Stream(), batch_size=4))  # BUG: the same stream on every rank
    dist.destroy_process_group()


class Stream(IterableDataset):
    """Samples generated from a fixed seed (a stand-in for a stream every rank opens)."""

    def __iter__(self):
        g = torch.Generator().manual_seed(1)
        for _ in range(16):
            yield torch.randn(4, generator=g)


if __name__ == "__main__":
    main()
