"""data-coverage, good: shards that partition the data in every epoch.

DistributedSampler over a dataset whose length is not a multiple of the world size (it pads with
repeats: intended) and with drop_last; an index list shuffled by a generator seeded the same on
every rank, then idx[rank::world]; files shuffled by such a generator before files[rank::world];
a generated stream that the IterableDataset shards by rank; and an evaluation that every rank
runs over the whole (small) validation set (info at most).
Run: ddpdoctor trace -- torchrun --nproc_per_node=2 checks/data-coverage/good.py
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
from torch.utils.data.distributed import DistributedSampler


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
    data = TensorDataset(torch.randn(37, 4))  # 37 samples: DistributedSampler pads one

    sampler = DistributedSampler(data)
    fit(model, opt, DataLoader(data, batch_size=4, sampler=sampler), sampler=sampler)
    trimmed = DistributedSampler(data, drop_last=True)
    fit(model, opt, DataLoader(data, batch_size=4, sampler=trimmed), sampler=trimmed)

    idx = list(range(36))
    random.Random(1234).shuffle(idx)  # the same order on every rank
    fit(model, opt, DataLoader(data, batch_size=4, sampler=SubsetRandomSampler(idx[rank::world])))

    folder = os.path.join(tempfile.gettempdir(), f"ddpdoctor-coverage-{os.environ.get('MASTER_PORT', '0')}")
    if rank == 0:
        os.makedirs(folder, exist_ok=True)
        for i in range(6):
            with open(os.path.join(folder, f"part{i}.txt"), "w") as f:
                f.write("".join(f"{i} {j} 1 2\n" for j in range(4)))
    dist.barrier()
    files = sorted(os.path.join(folder, n) for n in os.listdir(folder))
    random.Random(99).shuffle(files)  # the same order on every rank
    fit(model, opt, DataLoader(Lines(files[rank::world]), batch_size=2))
    # one generated stream, sharded by rank inside the dataset
    fit(model, opt, DataLoader(Stream(rank, world), batch_size=4))
    dist.barrier()
    if rank == 0:
        shutil.rmtree(folder)

    val = TensorDataset(torch.randn(10, 4))
    with torch.no_grad():
        total = sum(float(model(x).sum()) for (x,) in DataLoader(val, batch_size=5))  # every rank: all of val
    dist.destroy_process_group()
    print(f"rank {rank}: val {total:.3f}")



class Stream(IterableDataset):
    """Samples generated from a fixed seed; each rank keeps every world-th one from its rank."""

    def __init__(self, rank, world):
        self.rank, self.world = rank, world

    def __iter__(self):
        g = torch.Generator().manual_seed(1)
        for i in range(16):
            x = torch.randn(4, generator=g)
            if i % self.world == self.rank:
                yield x


if __name__ == "__main__":
    main()
