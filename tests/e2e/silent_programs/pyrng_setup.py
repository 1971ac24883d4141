"""Python and NumPy randomness seeded with the rank decides the data assignment while setting up.

`random.seed(rank)` / `np.random.seed(rank)` were meant for augmentation, but the file list is
shuffled with them before it is sharded by rank (the shards overlap), and the train/validation
split is a NumPy permutation (each rank trains on a different split). Every collective matches and
the job finishes. Augmentation in the training loop draws from the same generators: intended.
"""

import datetime
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def main() -> None:
    timeout = datetime.timedelta(seconds=float(os.environ.get("EXAMPLE_PG_TIMEOUT", "20")))
    dist.init_process_group("gloo", timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    random.seed(rank)  # per-rank seeds, meant for augmentation
    np.random.seed(rank)
    files = [f"shard-{i:03d}.bin" for i in range(16)]
    random.shuffle(files)  # the bug: a per-rank order, then sharded by rank
    mine = files[rank::world]
    perm = np.random.permutation(40)  # the bug: a per-rank split
    data = TensorDataset(torch.randn(40, 4), torch.randn(40, 1))
    train = Subset(data, perm[:32].tolist())
    model = DDP(nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sampler = DistributedSampler(train, shuffle=False)
    for x, y in DataLoader(train, batch_size=8, sampler=sampler):
        if random.random() < 0.5:  # augmentation: per rank on purpose
            x = x.flip(1)
        x = x + torch.from_numpy(np.random.normal(0, 0.01, x.shape)).float()
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    print(f"rank {rank} reads {len(mine)} files")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
