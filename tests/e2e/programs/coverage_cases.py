"""data-coverage cases beyond the example pair, on real gloo ranks.

1. A DistributedSampler told the same rank on every rank (a rank read from a variable the
   launcher does not set): both ranks draw shard 0, shard 1 is drawn by no one.
2. An IterableDataset every rank reads whole (no sharding of its files) while a DDP model trains.
3. A DataLoader with persistent worker processes over a correct DistributedSampler: silent.
4. An IterableDataset generating one seeded stream, read unsharded by every rank while the DDP
   model trains (the same batches everywhere), and the same stream sharded by rank (silent).
The results are printed so that the test can compare them with an untraced run.
"""

import datetime
import os
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, IterableDataset, TensorDataset
from torch.utils.data.distributed import DistributedSampler


class Lines(IterableDataset):
    def __init__(self, files):
        self.files = files

    def __iter__(self):
        for path in self.files:
            with open(path) as f:
                for line in f:
                    yield torch.tensor([float(v) for v in line.split()])


class Stream(IterableDataset):
    """Samples drawn from a generator seeded the same on every rank; ``shard``: (rank, world)."""

    def __init__(self, shard=None):
        self.shard = shard

    def __iter__(self):
        g = torch.Generator().manual_seed(7)
        for i in range(24):
            x = torch.randn(4, generator=g)
            if self.shard is None or i % self.shard[1] == self.shard[0]:
                yield x


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = TensorDataset(torch.arange(40, dtype=torch.float32).reshape(10, 4))
    total = torch.zeros(())

    same = DistributedSampler(data, shuffle=False, rank=int(os.environ.get("GROUP_RANK_X", "0")))  # L:same-rank
    for (x,) in DataLoader(data, batch_size=5, sampler=same):
        total += x.sum()

    folder = os.path.join(tempfile.gettempdir(), f"ddpdoctor-cases-{os.environ.get('MASTER_PORT', '0')}")
    if rank == 0:
        os.makedirs(folder, exist_ok=True)
        for i in range(3):
            with open(os.path.join(folder, f"s{i}.txt"), "w") as f:
                f.write("".join(f"{i} {j} 0 1\n" for j in range(2)))
    dist.barrier()
    files = sorted(os.path.join(folder, n) for n in os.listdir(folder))
    for x in DataLoader(Lines(files), batch_size=2):  # L:all-files
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
        total += x.sum()
    dist.barrier()
    if rank == 0:
        shutil.rmtree(folder)

    for shard in (None, (rank, dist.get_world_size())):
        for x in DataLoader(Stream(shard), batch_size=3):  # L:same-stream (shard None)
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
            total += x.sum()

    sampler = DistributedSampler(data, shuffle=True)
    loader = DataLoader(data, batch_size=2, sampler=sampler, num_workers=2, persistent_workers=True)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for (x,) in loader:
            total += x.sum()
    print(f"rank {rank} total {float(total):.1f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
